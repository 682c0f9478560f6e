"""Gemma 4's text decoder against transformers' Gemma4ForConditionalGeneration on the same tiny
random checkpoint (test_gemma4_fixtures): prefill logits of a prompt longer than the sliding
window, 20 decode steps (the window slides through the ring cache, the KV-shared layers read their
source layers' caches), greedy tokens, a sharded checkpoint, and batched rows at different positions."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from transformers import DynamicCache

from test_gemma4_fixtures import BOS, WINDOW, gemma4_dir, gemma4_hf, save_checkpoint  # noqa: F401

from photon_core.models.gemma4 import load_gemma4
from photon_core.models.gemma4 import text
from photon_core.runtime.requests import Request

ATOL = 2e-4
STEPS = 20


@pytest.fixture(scope="module")
def model(gemma4_dir):
    return load_gemma4(gemma4_dir)


def prompt(n: int, seed: int = 1) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return [BOS] + torch.randint(20, 300, (n - 1,), generator=g).tolist()


def banned_mask(model) -> torch.Tensor:
    allowed = torch.ones(model.config.text.vocab_size, dtype=torch.bool)
    allowed[list(model.config.placeholder_ids)] = False
    return allowed


@torch.no_grad()
def hf_greedy(hf, ids: list[int], steps: int, allowed: torch.Tensor) -> tuple[list[torch.Tensor], list[int]]:
    """transformers with its own cache, one token per step: logits after the prompt and each token."""
    cache = DynamicCache(config=hf.config.get_text_config())
    out = hf(input_ids=torch.tensor([ids]), cache=cache, use_cache=True)
    logits, toks = [out.logits[0, -1]], []
    for _ in range(steps):
        tok = int(logits[-1].masked_fill(~allowed, float("-inf")).argmax())
        toks.append(tok)
        out = hf(input_ids=torch.tensor([[tok]]), cache=out.cache, use_cache=True)
        logits.append(out.logits[0, -1])
    return logits, toks


def test_config_reads_the_layer_plan(model):
    t = model.config.text
    assert [L.sliding for L in t.layers] == [True, False, True, False]
    assert [L.kv_source for L in t.layers] == [0, 1, 0, 1]
    assert [L.head_dim for L in t.layers] == [16, 32, 16, 32]
    assert [L.ff_dim for L in t.layers] == [96, 96, 192, 192]
    assert t.sliding_window == WINDOW and t.final_softcap == 30.0


def test_prefill_logits_match_transformers(model, gemma4_hf):
    ids = prompt(3 * WINDOW + 1)
    with torch.no_grad():
        ref = gemma4_hf(input_ids=torch.tensor([ids])).logits[0]
    ours = model.prefill_logits(ids)
    assert ours.shape == ref.shape
    torch.testing.assert_close(ours, ref, atol=ATOL, rtol=0)


def test_decode_steps_and_greedy_tokens_match_transformers(model, gemma4_hf):
    ids = prompt(WINDOW + 3)
    allowed = banned_mask(model)
    ref_logits, ref_toks = hf_greedy(gemma4_hf, ids, STEPS, allowed)
    cache = text.KVCache(model.config.text, 1, len(ids) + STEPS + 1, model.dtype, model.device)
    # The sliding layers keep a ring of WINDOW slots, however long the context.
    assert cache.slots(0) == WINDOW and cache.slots(1) == len(ids) + STEPS + 1
    assert set(cache.k) == {0, 1}          # the shared layers keep no cache of their own
    logits = model.prefill(ids, None, cache)[0]
    toks = []
    for s in range(STEPS):
        torch.testing.assert_close(logits, ref_logits[s], atol=ATOL, rtol=0)
        tok = int(logits.masked_fill(~allowed, float("-inf")).argmax())
        toks.append(tok)
        logits = model.step(torch.tensor([[tok]]), torch.tensor([len(ids) + s]), cache)[0]
    torch.testing.assert_close(logits, ref_logits[STEPS], atol=ATOL, rtol=0)
    assert toks == ref_toks


def test_skill_decoding_gives_the_reference_greedy_tokens(model, gemma4_hf):
    from photon_core.models.gemma4.decoding import BatchDecoder, Row

    ids = prompt(WINDOW + 2, seed=3)
    _, ref_toks = hf_greedy(gemma4_hf, ids, 12, banned_mask(model))
    eos = [i for i, t in enumerate(ref_toks) if t in model.eos_ids]
    want = ref_toks[:eos[0]] if eos else ref_toks
    row = Row(ids, None, 12)
    for _ in BatchDecoder(model, [row]).run():
        pass
    assert row.tokens == want


def test_batched_rows_at_different_positions_match_single_rows(model):
    from photon_core.models.gemma4.decoding import BatchDecoder, Row

    prompts = [prompt(4, seed=5), prompt(WINDOW + 5, seed=6), prompt(2 * WINDOW, seed=7)]
    singles = []
    for p in prompts:
        row = Row(p, None, 10)
        for _ in BatchDecoder(model, [row]).run():
            pass
        singles.append(row.tokens)
    rows = [Row(p, None, n) for p, n in zip(prompts, (10, 10, 3))]
    for _ in BatchDecoder(model, rows).run():
        pass
    assert [r.tokens for r in rows] == [singles[0], singles[1], singles[2][:3]]


def test_keys_as_values_on_full_layers_match_transformers(tmp_path):
    """attention_k_eq_v (values = the raw key projection on full layers, with their own kv heads)."""
    from test_gemma4_fixtures import build_hf

    hf = build_hf(vision=False, seed=4, attention_k_eq_v=True, num_global_key_value_heads=1,
                  num_kv_shared_layers=0, use_double_wide_mlp=False)
    m = load_gemma4(save_checkpoint(hf, tmp_path / "keq"))
    assert [L.k_eq_v for L in m.config.text.layers] == [False, True, False, True]
    assert m.config.text.layers[1].n_kv_heads == 1 and m.config.vision is None
    ids = prompt(2 * WINDOW)
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor([ids])).logits[0]
    torch.testing.assert_close(m.prefill_logits(ids), ref, atol=ATOL, rtol=0)
    with pytest.raises(ValueError, match="no vision tower"):
        m.query(np.zeros((8, 8, 3), np.uint8), "what?")


def test_sharded_checkpoint_loads_the_same(gemma4_hf, model, tmp_path):
    folder = save_checkpoint(gemma4_hf, tmp_path / "sharded", max_shard_size="100KB")
    assert (folder / "model.safetensors.index.json").is_file()
    other = load_gemma4(folder)
    ids = prompt(9)
    torch.testing.assert_close(other.prefill_logits(ids), model.prefill_logits(ids), atol=0, rtol=0)


def test_bare_gemma4_model_checkpoint_loads_the_same(gemma4_hf, model, tmp_path):
    """A Gemma4Model export (no "model." prefix, no lm_head: the head is the tied embedding)."""
    folder = save_checkpoint(gemma4_hf.model, tmp_path / "bare")
    assert json.loads((folder / "config.json").read_text())["architectures"] == ["Gemma4Model"]
    other = load_gemma4(folder)
    ids = prompt(9)
    torch.testing.assert_close(other.prefill_logits(ids), model.prefill_logits(ids), atol=0, rtol=0)


def test_bfloat16_runs_close_to_float32(gemma4_dir, model):
    low = load_gemma4(gemma4_dir, dtype="bfloat16")
    ids = prompt(WINDOW + 2)
    a, b = low.prefill_logits(ids), model.prefill_logits(ids)
    assert torch.isfinite(a).all() and (a - b).abs().max() < 0.1 * b.abs().max() + 0.05


def test_a_seeded_request_samples_the_same_whatever_decodes_beside_it(model):
    # Each row draws from its own generator, seeded by its place in the call: rows sampled beside
    # it (stopping sooner or later) take none of its draws, and identical requests draw apart.
    sampled = {"temperature": 1.0, "top_p": 1.0, "max_tokens": 8}
    a = Request("query", None, "what is in this image?", settings=sampled)
    b = Request("query", None, "the cat sat on the mat", settings=sampled)
    short = Request("query", None, "the cat sat on the mat", settings={**sampled, "max_tokens": 1})
    greedy = Request("query", None, "the cat sat on the mat", settings={"max_tokens": 8, "temperature": 0.0})
    alone = model.batch([a], seed=5)[0]
    assert model.batch([a, b], seed=5)[0] == alone
    assert model.batch([a, short, b], seed=5)[0] == alone
    assert model.query(None, "what is in this image?", settings=sampled, seed=5) == alone
    second = model.batch([b, a], seed=5)[1]
    assert model.batch([greedy, a], seed=5)[1] == second == model.batch([short, a], seed=5)[1]
    assert len(set(map(str, model.batch([a, a, a, a], seed=5)))) > 1
    assert model.batch([a], seed=6)[0] != alone   # the seed still decides the draws
