"""Qwen3-ASR's greedy decode on the megakernel: the audio encoder and each prompt's prefill run on
the model's per-op ops (the megakernel backend's Triton kernels); every following token of every
utterance is one launch of the compiled decode step (decoder_step.py).

Utterances step together: up to 8 take rows of the smallest batch bucket (1, 2, 4, 8) that holds
them (more are decoded 8 at a time: greedy rows are independent). Each prompt is prefilled alone
into a temporary per-op cache, whose K/V are copied into its row of the bucket's caches; the
prefill's last logits give the first token. The step's argmax advances each row's token and
position on the device, so the steps run in rounds (megakernel.decode_loop: one CUDA-graph replay
and one read of the device per round of up to 8 tokens); the host reads the tokens to see the stop
tokens. Padding rows decode a placeholder from position 0 of their own row.

One call at a time per model: each bucket's state (KV caches, activations) is one arena.
"""
from __future__ import annotations

from collections.abc import Collection, Iterator, Sequence

import torch

from photon_core.megakernel.compiler import Tiling
from photon_core.runtime.decode import CompiledSteps, copy_prefilled_kv, decode_length, resolve_weight_dtype
from photon_core.runtime.generate import greedy_tokens
from photon_core.runtime.sampling import check_finite

from .decoder import TextDecoder
from .decoder_step import Dims, Qwen3ASRDecoderMegakernel, gather_weights
from .transcribe import DECODE_CONTEXT

# The megakernel's caches are per bucket row: 2 x layers x kv_heads x head_dim x 2 bytes a
# position on a GPU (bf16: 115 KB for the 0.6B and 1.7B; 4 bytes, fp32, on the CPU), so the default
# context is what one speech chunk needs, not the model's 65536 positions: transcribe.py cuts long
# audio into chunks whose prompt plus transcript fit it (about 76 s each at 2048 positions).
DEFAULT_MAX_LEN = DECODE_CONTEXT


class MegakernelDecode(CompiledSteps[Qwen3ASRDecoderMegakernel]):
    """The compiled decode steps of one Qwen3ASRSpeech: one per batch bucket, built on first use,
    all streaming one shared copy of the weights."""

    family = "A Qwen3-ASR model"

    def __init__(self, decoder: TextDecoder, sd: dict[str, torch.Tensor], tiling: Tiling = Tiling(),
                 max_len: int | None = None, weight_dtype: torch.dtype | None = None) -> None:
        """sd: the checkpoint's schema-named tensors; max_len: the caches' context (prompt plus
        generated tokens); weight_dtype: what each step streams (math is fp32), None = the model's."""
        cfg = decoder.cfg
        super().__init__(decode_length(max_len, cfg.max_positions, DEFAULT_MAX_LEN),
                         resolve_weight_dtype(weight_dtype, decoder.dtype))
        self.text, self.device, self.tiling = decoder, decoder.device, tiling   # the per-op decoder
        # Tied exactly when the per-op decoder ties them (decoder.TextDecoder).
        tied = cfg.tie_embeddings or "lm_head.weight" not in sd
        self.dims = Dims.of(cfg, tied)
        self._weights = gather_weights(sd, self.dims, self.max_len, self.device)

    def build_step(self, batch: int, weights: torch.Tensor | None) -> Qwen3ASRDecoderMegakernel:
        return Qwen3ASRDecoderMegakernel(self._weights, self.dims, batch, self.max_len, self.tiling,
                                         self.weight_dtype, shared_weights=weights)

    @torch.inference_mode()
    def generate(self, prompts: Sequence[torch.Tensor], max_new_tokens: int | Sequence[int],
                 stop: Sequence[int]) -> list[list[int]]:
        """Qwen3ASRSpeech.generate's contract: greedy ids of each prompt's embeddings [T, hidden]
        until a stop token (excluded) or `max_new_tokens` (or each row's own)."""
        if not prompts:
            return []
        budgets = [max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int) else list(max_new_tokens)
        if len(prompts) > self.max_rows:
            n = self.max_rows
            return self.generate(prompts[:n], budgets[:n], stop) + self.generate(prompts[n:], budgets[n:], stop)
        for p, new in zip(prompts, budgets):
            # the k-th new token is fed at prompt + k - 1: the last one needs no position of its own
            # (the first comes from the prefill's logits), but the prompt's K/V must fit the caches
            if p.shape[0] + max(new, 1) - 1 > self.max_len:
                raise ValueError(f"a prompt of {p.shape[0]} tokens plus {new} new ones exceeds the megakernel's "
                                 f"context of {self.max_len} positions; load with a larger max_len or shorter audio")
        with self.exclusive():
            return greedy_tokens(self.session(prompts), len(prompts), budgets, stop, self.text.ops)

    def session(self, prompts: Sequence[torch.Tensor]) -> "StepSession":
        """runtime.generate's session on the smallest bucket holding the prompts, prefilled
        (call under `exclusive()`)."""
        return StepSession(self, *self._prefill(prompts))

    def start(self, prompts: Sequence[torch.Tensor]) -> tuple[Qwen3ASRDecoderMegakernel, list[int]]:
        """The prompts prefilled and the step set to each row's first token (the prefill's argmax)
        at its prompt length: the bucket's step and the first tokens (for driving it by hand)."""
        mk, logits, lengths = self._prefill(prompts)
        if max(lengths) >= self.max_len:   # the step is set at the prompt's length: a position of its own
            raise ValueError(f"a prompt of {max(lengths)} tokens leaves no room to step in the megakernel's "
                             f"context ({self.max_len})")
        check_finite(logits)
        first = [int(t) for t in self.text.ops.argmax(logits)]
        pad = mk.batch - len(prompts)
        mk.set_step(first + [0] * pad, lengths + [0] * pad)
        return mk, first

    def _prefill(self, prompts: Sequence[torch.Tensor]) -> tuple[Qwen3ASRDecoderMegakernel, torch.Tensor, list[int]]:
        """Each prompt prefilled per-op alone, its K/V copied into its row of the smallest bucket
        holding them: (that bucket's step, the logits [rows, V] after each prompt, their lengths)."""
        dec = self.text
        mk = self.for_rows(len(prompts))
        logits, lengths = [], []
        for row, embeds in enumerate(prompts):
            t = embeds.shape[0]
            # A prompt that fills the context exactly still gives its first token (these logits);
            # only a longer one does not fit the caches. generate() refuses, before this, a budget
            # that would need a step past the context.
            if t > self.max_len:
                raise ValueError(f"a prompt of {t} tokens does not fit the megakernel's context ({self.max_len})")
            tmp = dec.new_cache(1, t)
            logits.append(dec.logits(dec.prefill(embeds, tmp, 0)[-1:]))
            copy_prefilled_kv(mk, ("kcache", "vcache"), list(zip(tmp.k, tmp.v)), slice(row, row + 1), t)
            lengths.append(t)
        return mk, torch.cat(logits), lengths


class StepSession:
    """runtime.generate's session on a bucket's compiled step, for greedy rows: `rounds` decodes
    them on the device (the step's argmax advances each row's token and position), each row
    from the first token the loop chose at its prompt length; padding rows decode a placeholder
    from position 0 of their own row. Qwen3-ASR decodes greedily only, so the host never steps."""

    def __init__(self, decode: MegakernelDecode, mk: Qwen3ASRDecoderMegakernel, first: torch.Tensor,
                 lengths: list[int]) -> None:
        self.decode, self.mk, self.first, self.lengths = decode, mk, first, lengths

    def prefill(self) -> tuple[torch.Tensor, None]:
        return self.first, None

    def step(self, tokens: list[int]) -> tuple[torch.Tensor, None]:
        raise NotImplementedError("Qwen3-ASR's compiled step decodes greedy rows in rounds only")

    def keep(self, rows: list[int]) -> None:
        raise NotImplementedError("Qwen3-ASR's compiled step decodes greedy rows in rounds only")

    def rounds(self, first: list[int], max_new: list[int], stop: Collection[int]) -> Iterator[tuple[int, int]]:
        pad = self.mk.batch - len(first)
        # A prompt that fills the context (generate allows it for a one-token budget, which the
        # prefill's logits give) has no position to step at; it is never stepped for a token of
        # its own, so it decodes a placeholder from position 0 of its own row, as padding rows do.
        positions = [n if n < self.mk.max_len else 0 for n in self.lengths]
        self.mk.set_step(first + [0] * pad, positions + [0] * pad)
        return self.decode.loop(self.mk.batch).stream(first, max_new, stop)


__all__ = ["MegakernelDecode", "DEFAULT_MAX_LEN", "StepSession"]
