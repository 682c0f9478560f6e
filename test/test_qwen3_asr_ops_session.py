"""Qwen3-ASR's per-op batch (OpsSession) on a tiny random decoder: rows that finish early leave the
cache, so a batch sized by each row's prompt + budget never overflows and each row decodes as alone."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from photon_core.backends import reference
from photon_core.models.qwen3_asr.config import TextConfig
from photon_core.models.qwen3_asr.decoder import OpsSession, TextDecoder
from photon_core.models.qwen3_asr.transcribe import Qwen3ASRSpeech
from photon_core.runtime.generate import greedy_tokens

V, H, NH, NKV, D, F = 50, 32, 2, 1, 16, 64


def _decoder() -> TextDecoder:
    cfg = TextConfig(V, H, 1, NH, NKV, D, F, 1e-6, 10000.0, 4096, False)
    g = torch.Generator().manual_seed(0)

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) / shape[-1] ** 0.5

    p, a = "language_model.", "language_model.layers.0."
    sd = {p + "embed_tokens.weight": torch.randn(V, H, generator=g), p + "norm.weight": torch.ones(H),
          "lm_head.weight": r(V, H), a + "input_layernorm.weight": torch.ones(H),
          a + "self_attn.q_proj.weight": r(NH * D, H), a + "self_attn.k_proj.weight": r(NKV * D, H),
          a + "self_attn.v_proj.weight": r(NKV * D, H), a + "self_attn.q_norm.weight": torch.ones(D),
          a + "self_attn.k_norm.weight": torch.ones(D), a + "self_attn.o_proj.weight": r(H, NH * D),
          a + "post_attention_layernorm.weight": torch.ones(H), a + "mlp.gate_proj.weight": r(F, H),
          a + "mlp.up_proj.weight": r(F, H), a + "mlp.down_proj.weight": r(H, F)}
    return TextDecoder(sd, cfg, reference, torch.device("cpu"))


def _speech(dec: TextDecoder) -> SimpleNamespace:
    """What Qwen3ASRSpeech.generate reads of its model on the per-op path (no stop token, so every
    row runs to its budget)."""
    return SimpleNamespace(megakernel=None, decoder=dec, config=SimpleNamespace(eos_token_ids=()), ops=reference)


def test_a_long_prompt_with_a_small_budget_does_not_overflow_a_long_row():
    """The cache holds max(prompt + budget): the 40-token prompt done after 2 tokens must not keep
    advancing while the 5-token prompt decodes its 60 (it used to raise "KV cache is full")."""
    dec, g = _decoder(), torch.Generator().manual_seed(1)
    prompts = [torch.randn(40, H, generator=g), torch.randn(5, H, generator=g), torch.randn(20, H, generator=g)]
    budgets = [2, 60, 7]
    together = Qwen3ASRSpeech.generate(_speech(dec), prompts, budgets)
    alone = [Qwen3ASRSpeech.generate(_speech(dec), [p], n)[0] for p, n in zip(prompts, budgets)]
    assert together == alone
    assert [len(t) for t in together] == budgets
    assert len(set(together[1])) > 3   # a row that varies, so a misplaced row would show


def test_finished_rows_leave_the_cache():
    dec, g = _decoder(), torch.Generator().manual_seed(2)
    prompts = [torch.randn(8, H, generator=g), torch.randn(3, H, generator=g)]
    session = OpsSession(dec, prompts, max(p.shape[0] + n for p, n in zip(prompts, [1, 10])))
    greedy_tokens(session, 2, [1, 10], (), reference)
    assert session.cache.k[0].shape[0] == 1 and session.cache.lengths.tolist() == [3 + 10 - 1]
