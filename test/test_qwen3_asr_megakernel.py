"""Qwen3-ASR's decode step on the megakernel (under Triton's interpreter on CPU), on the tiny random
checkpoint of test_qwen3_asr_reference: the compiled step equals the eager run of the same graph
(logits, caches, the device-advanced tokens); after a real prefill (audio and text prompts) its
logits and greedy tokens equal the family's reference decode step for step; transcribe() with the
"megakernel" backend gives the reference backend's text on espeak-ng speech."""
from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # must precede the first import of triton

import functools  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from test_qwen3_asr_reference import ours, speech, tiny_checkpoint  # noqa: E402

from photon_core.megakernel import run_reference  # noqa: E402
from photon_core.megakernel.compiler import Tiling  # noqa: E402
from photon_core.models.qwen3_asr import load_qwen3_asr  # noqa: E402
from photon_core.models.qwen3_asr.checkpoint import load_tensors  # noqa: E402
from photon_core.models.qwen3_asr.decoder_step import (EMBED, LM_HEAD, Dims, Qwen3ASRDecoderMegakernel,  # noqa: E402
                                                       gather_weights, step_graph)
from photon_core.models.qwen3_asr.megakernel_decode import MegakernelDecode  # noqa: E402

# Few, large tiles: the interpreter runs the tasks one after another, so its cost is per task.
INTERPRETER_TILING = Tiling(block_n=512, block_k=64, block_t=32, self_splits=1, cross_splits=1)
SMALL_TILING = Tiling(block_n=32, block_k=32, block_t=8, self_splits=2, cross_splits=1)   # tiles straddle heads
RTOL = 1e-4
MAX_LEN = 96


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    assert torch.isfinite(a).all()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


@functools.lru_cache(maxsize=None)
def tensors() -> dict[str, torch.Tensor]:
    return load_tensors(tiny_checkpoint(False))


@pytest.mark.parametrize("tied,batch,tiling", [(False, 2, INTERPRETER_TILING), (True, 1, SMALL_TILING)])
def test_compiled_step_equals_the_eager_graph(tied, batch, tiling):
    """Random history in the caches, rows at their own positions; three steps where the device's
    argmax picks each next token and position (advance) and run_reference is fed the same."""
    model = ours()
    dm = Dims.of(model.config.text, tied)
    w = gather_weights(tensors(), dm, 16, torch.device("cpu"))
    assert (LM_HEAD in w) != tied
    graph = step_graph(dm, 16)
    step = Qwen3ASRDecoderMegakernel(w, dm, batch, 16, tiling)
    step.state.fill_(float("nan"))                   # poison: unwritten positions must never be read
    gen = torch.Generator().manual_seed(3)
    positions = [4, 9][:batch]
    caches = {}
    for name in ("kcache", "vcache"):
        t = torch.randn(dm.layers, batch, dm.kv_heads, 16, dm.head_dim, generator=gen)
        view = step.view(name)
        for r, p in enumerate(positions):
            t[:, r, :, p:] = 0.0
            view[:, r, :, :p] = t[:, r, :, :p]
        caches[name] = t
    tokens = torch.randint(0, dm.vocab, (batch,), generator=gen).tolist()
    step.set_step(tokens, positions)
    for _ in range(3):
        step.launch()
        want = run_reference(graph, w, caches, tokens, positions)
        assert rel_err(step.view("logits"), want["logits"]) < RTOL
        assert rel_err(step.view("hidden"), want[graph.exposed["hidden"].name]) < RTOL
        assert step.result("token").tolist() == want["results"]["token"]
        for name in ("kcache", "vcache"):
            for r, p in enumerate(positions):
                assert rel_err(step.view(name)[:, r, :, p], caches[name][:, r, :, p]) < RTOL
        tokens, positions = want["results"]["token"], [p + 1 for p in positions]
        assert step.dyn[batch:2 * batch].tolist() == positions   # advanced on the device
    if tied:   # the LM head streams the embedding table itself
        assert torch.equal(step.weight(EMBED), tensors()[EMBED])


def test_steps_after_a_real_prefill_equal_the_reference_decode():
    """Three utterances in the 4-row bucket (one padding row): two audio prompts and a text-only
    prompt, prefilled per-op and copied into the step's caches; 5 greedy tokens each, logits and
    tokens against TextDecoder.step (the reference backend) fed the same tokens."""
    model = ours()
    prompts = []
    for text in ("Stop.", "Pick up the red cup."):
        mel, frames = model.features(speech(text))
        audio = model.encode(mel, frames)
        prompts.append(model.prompt_embeds(model.prompt_ids(audio.shape[0], "en", None), audio))
    ids = model.prompt.encode("turn on the kitchen lights")
    prompts.insert(1, model.decoder.embed_tokens(torch.tensor(ids)))
    lengths = [p.shape[0] for p in prompts]
    assert len(set(lengths)) == 3   # rows at their own positions

    mkd = MegakernelDecode(model.decoder, tensors(), INTERPRETER_TILING, MAX_LEN)
    mk, tokens = mkd.start(prompts)
    assert mk.batch == 4
    dec = model.decoder
    cache = dec.new_cache(3, MAX_LEN)
    want = []
    for row, embeds in enumerate(prompts):
        want.append(int(dec.logits(dec.prefill(embeds, cache, row)[-1:]).argmax()))
    assert tokens == want
    seen = set(tokens)
    for _ in range(4):
        mk.launch()
        logits = dec.step(torch.tensor(tokens), cache)
        assert rel_err(mk.logits[:3], logits) < RTOL
        tokens = logits.argmax(-1).tolist()
        assert mk.result("token")[:3].tolist() == tokens
        seen |= set(tokens)
    assert len(seen) >= 4   # the random model's tokens vary: the comparison is not of a constant
    for name, cached in (("kcache", cache.k), ("vcache", cache.v)):
        for r, n in enumerate(lengths):   # every position, prefilled or decoded
            got = mk.view(name)[:, r, :, :n + 4]
            assert rel_err(got, torch.stack([c[r, :, :n + 4] for c in cached])) < RTOL

    with pytest.raises(ValueError, match="exceeds the megakernel's context of 96"):
        mkd.generate(prompts, MAX_LEN - lengths[1], model.config.eos_token_ids)


def test_transcribe_on_the_megakernel_equals_the_reference_backend():
    model = load_qwen3_asr(tiny_checkpoint(False), backend="megakernel", tiling=INTERPRETER_TILING, max_len=MAX_LEN)
    assert getattr(model.ops, "NAME", "") == "megakernel" and model.megakernel is not None
    assert ours().megakernel is None
    pcm = speech("Stop.")
    got = model.transcribe(pcm, 16000, language="en", max_new_tokens=6)
    want = ours().transcribe(pcm, 16000, language="en", max_new_tokens=6)
    assert got["text"] == want["text"] and len(want["text"]) >= 4
    # the gate's silence never reaches the decode
    assert model.transcribe(np.zeros(16000, np.float32), 16000)["text"] == ""
    import photon_core   # the speech node's way in: the registry with the backend named
    assert photon_core.load(tiny_checkpoint(False), backend="megakernel", skills=("transcribe",)).megakernel is not None
    with pytest.raises(ValueError, match="megakernel backend only"):
        load_qwen3_asr(tiny_checkpoint(False), backend="reference", max_len=MAX_LEN)


def test_a_request_that_fits_the_context_exactly_is_decoded():
    """The k-th new token is fed at prompt + k - 1, so prompt + n - 1 positions hold n new tokens:
    a prompt of t tokens and 4 new ones fit a context of t + 3, and were refused. Per-row budgets:
    a batch is checked row by row, not its longest prompt against its largest budget."""
    model = ours()
    p = model.decoder.embed_tokens(torch.tensor(model.prompt.encode("turn on the kitchen lights")))
    t = p.shape[0]
    mkd = MegakernelDecode(model.decoder, tensors(), INTERPRETER_TILING, t + 3)
    assert mkd.generate([p], 4, []) == model.generate([p], 4) and len(model.generate([p], 4)[0]) == 4
    short = p[:t - 2]
    assert mkd.generate([p, short], [4, 6], []) == [model.generate([p], 4)[0], model.generate([short], 6)[0]]
    with pytest.raises(ValueError, match="exceeds"):
        mkd.generate([p], 5, [])


def test_a_prompt_that_fills_the_context_still_gives_its_one_token():
    """generate accepts prompt + n - 1 <= max_len, so a prompt of max_len tokens with a one-token
    budget fits (that token comes from the prefill's logits, no cache position of its own), but the
    prefill refused any prompt of max_len tokens. Alone, and beside a row that steps on (the full
    row must then not be set at a position past the caches)."""
    model = ours()
    p = model.decoder.embed_tokens(torch.tensor(model.prompt.encode("turn on the kitchen lights")))
    t = p.shape[0]
    mkd = MegakernelDecode(model.decoder, tensors(), INTERPRETER_TILING, t)
    want = model.generate([p], 1)
    assert mkd.generate([p], 1, []) == want and len(want[0]) == 1
    short = p[:t - 2]
    stepped = model.generate([short], 3)[0]
    assert mkd.generate([p, short], [1, 3], []) == [want[0], stepped] and len(stepped) == 3
    with pytest.raises(ValueError, match="exceeds"):
        mkd.generate([p], 2, [])
