"""Qwen 3.5's decode step on the megakernel (Triton interpreter on CPU): the compiled step graph equals
run_reference of the same graph (logits, results, KV caches, conv and delta-rule states, rotary
offsets, two rows at different positions); after a real prefill the compiled steps give the logits
of the family's own reference-backend decode (text and image prompts, both fixture configs, q/k/v
biases); and the skills with backend "megakernel" return the reference backend's text (single,
streamed and batched requests)."""
from __future__ import annotations

import dataclasses
import os

os.environ["TRITON_INTERPRET"] = "1"  # must precede the first import of triton

import pytest  # noqa: E402
import torch  # noqa: E402

import test_qwen3_5_fixtures as fx  # noqa: E402
from photon_core.backends.select import get_backend  # noqa: E402
from photon_core.megakernel import CompiledStep, Tiling, run_reference  # noqa: E402
from photon_core.models.qwen3_5 import FAMILY, load_qwen3_5, text  # noqa: E402
from photon_core.models.qwen3_5 import decoder_step as ds  # noqa: E402
from photon_core.runtime.requests import Request  # noqa: E402
from photon_core.weights.resolve import Resolved  # noqa: E402

RTOL = 1e-4
FAST = Tiling(64, 64, 32, 1, 1)   # few tasks: the interpreter's cost is per task


def rel_err(a, b):
    assert torch.isfinite(a).all()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    out = {}
    for name in ("deltas3", "alternate"):
        out[name] = tmp_path_factory.mktemp(f"qwen3_5_mk_{name}")
        fx.build(out[name], name, seed=7)
    return out


@pytest.fixture(scope="module")
def pairs(folders):
    """(reference model, megakernel model) per config; the megakernel one on small caches."""
    mk = get_backend("megakernel")
    return {n: (load_qwen3_5(f), load_qwen3_5(f, backend=mk, tiling=FAST, max_len=96)) for n, f in folders.items()}


@pytest.mark.parametrize("name,batch,tiling", [
    ("deltas3", 2, Tiling(32, 32, 8, 2, 2)),      # tiles inside heads, split KV, two rows
    ("alternate", 1, FAST),                        # tied LM head, 1 K/V head, Dv = 24
])
def test_compiled_step_equals_run_reference(pairs, name, batch, tiling):
    model = pairs[name][0]
    cfg = model.config.text
    max_len = 24
    tied = model.config.tie_embeddings
    g = ds.step_graph(cfg, max_len, tied)
    w = ds.gather_weights(model.text_w, cfg, max_len, tied)
    assert ("lm_head.weight" in w) != tied
    step = CompiledStep(g, w, batch, tiling)
    step.state.fill_(float("nan"))   # poison: whatever the step reads must have been written
    gen = torch.Generator().manual_seed(3)
    positions, offsets = [5, 9][:batch], [0, -3][:batch]
    states = {}
    for kname, spec in g.caches.items():
        t = torch.randn(batch, spec.heads, spec.length, spec.head_dim, generator=gen)
        for r, p in enumerate(positions):
            t[r, :, p:] = 0.0
        step.view(kname)[:, :, :] = t
        for r, p in enumerate(positions):
            step.view(kname)[r, :, p:] = float("nan")
        states[kname] = t
    for sname, spec in g.states.items():
        states[sname] = torch.randn(batch, *spec.shape, generator=gen) * (0.3 if sname.startswith("rec") else 1.0)
        step.view(sname).copy_(states[sname])
    for _ in range(2):
        tokens = torch.randint(0, fx.VOCAB, (batch,), generator=gen).tolist()
        step.set_step(tokens, positions)
        step.set_rotary_offsets(offsets)
        step.launch()
        want = run_reference(g, w, states, tokens, positions, rotary_offsets=offsets)
        assert rel_err(step.view("logits"), want["logits"]) < RTOL
        assert step.result("token").tolist() == want["results"]["token"] == want["logits"].argmax(-1).tolist()
        for sname in g.states:
            assert rel_err(step.view(sname), states[sname]) < RTOL, sname
        for kname in g.caches:
            for r, p in enumerate(positions):
                assert rel_err(step.view(kname)[r, :, :p + 1], states[kname][r, :, :p + 1]) < RTOL, kname
        positions = [p + 1 for p in positions]


def _teacher_forced(ref, mk, image, question, steps):
    """Prefill both models (per-op reference / per-op Triton), then decode `steps` tokens on each
    (the megakernel model through its compiled step) fed the reference's greedy tokens."""
    s1, l1 = ref.prefill(image, question, extra=steps)
    s2, l2 = mk.prefill(image, question, extra=steps)
    torch.testing.assert_close(l2, l1, atol=1e-4, rtol=0)
    for _ in range(steps):
        tok = torch.tensor([[int(l1.argmax())]])
        l1, l2 = ref.step(tok, s1)[0], mk.step(tok, s2)[0]
        assert rel_err(l2, l1) < RTOL
        step = mk.decode.decoder(1)
        assert step.holds(s2) and int(step.result("token")[0]) == int(l1.argmax())
    assert torch.equal(s1.length, s2.length)
    for i in s1.rec:   # the states the megakernel updated in its arena are the reference's
        assert rel_err(s2.rec[i], s1.rec[i].float()) < RTOL
        assert rel_err(s2.conv[i], s1.conv[i].float()) < RTOL
    return s1, s2


def test_text_prompt_decode_equals_the_reference_backend(pairs):
    ref, mk = pairs["deltas3"]
    s1, s2 = _teacher_forced(ref, mk, None, "describe the quick fox", 8)
    for i in s1.k:
        n = int(s1.length[0]) - 1   # the last appended position: written by the megakernel
        assert rel_err(s2.k[i][:, :, :n + 1], s1.k[i][:, :, :n + 1]) < RTOL
        assert rel_err(s2.v[i][:, :, :n + 1], s1.v[i][:, :, :n + 1]) < RTOL


def test_image_prompt_decode_equals_the_reference_backend(pairs):
    """An image prompt: M-RoPE delta < 0, so rotary runs behind the cache position (rotary offsets)."""
    ref, mk = pairs["alternate"]
    s1, _ = _teacher_forced(ref, mk, fx.image(32, 48, seed=4), "what?", 4)
    assert int(s1.rope_delta[0]) < 0


def test_attention_biases_and_deinterleaved_q_gate(pairs):
    """q_proj's per-head [q | gate] rows and q/k/v/o biases as the re-laid linears read them: random
    biases on a copy of the weights, decoded by text.decode (reference ops) and by the compiled step."""
    model = pairs["deltas3"][0]
    cfg = dataclasses.replace(model.config.text, attention_bias=True)
    tw = type(model.text_w).__new__(type(model.text_w))
    tw.__dict__.update(model.text_w.__dict__)
    gen = torch.Generator().manual_seed(11)
    tw.layers = [dict(lw) for lw in model.text_w.layers]
    for i, lw in enumerate(tw.layers):
        if cfg.is_attention(i):
            for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
                rows = lw[f"self_attn.{n}.weight"].shape[0]
                lw[f"self_attn.{n}.bias"] = torch.randn(rows, generator=gen) * 0.3
    mcfg = dataclasses.replace(model.config, text=cfg)
    step = ds.Qwen35DecoderStep(tw, mcfg, batch=2, max_len=32, tiling=FAST)
    s1 = text.DecodeState(cfg, 2, 32, torch.float32, "cpu")
    x = text.embed(torch.randint(0, fx.VOCAB, (2, 6), generator=gen), tw)
    text.prefill(x, torch.arange(6), s1, tw, cfg, model.ops)
    s1.rope_delta[:] = torch.tensor([0, -2])
    s2 = text.DecodeState(cfg, 2, 32, torch.float32, "cpu")
    for d1, d2 in ((s1.k, s2.k), (s1.v, s2.v), (s1.conv, s2.conv), (s1.rec, s2.rec)):
        for i in d1:
            d2[i].copy_(d1[i])
    s2.length, s2.rope_delta = s1.length.clone(), s1.rope_delta.clone()
    step.load_state(s2)
    for _ in range(2):
        ids = torch.randint(0, fx.VOCAB, (2, 1), generator=gen)
        want = text.logits(text.decode(text.embed(ids, tw), s1, tw, cfg, model.ops)[:, 0], tw, model.ops)
        assert rel_err(step.step(ids, s2), want) < RTOL


def test_query_skill_on_the_megakernel_backend(folders, pairs):
    """The family's loader with backend "megakernel" (default tiling and caches): query returns the
    reference backend's answer."""
    ref = pairs["deltas3"][0]
    mk = FAMILY.load(Resolved(folders["deltas3"], "tiny", True), "cpu", None, "megakernel")
    assert mk.decode is not None and ref.decode is None
    greedy = {"temperature": 0, "max_tokens": 4}
    want = ref.query(None, "what is in the picture?", settings=greedy)
    assert mk.query(None, "what is in the picture?", settings=greedy) == want
    assert len(want["answer"]) > 0


def test_batch_skill_on_the_megakernel(pairs):
    """Requests decoded together (batch 2, then 1 when a row finishes) give the reference's results."""
    ref, mk = pairs["alternate"]
    reqs = [Request(task="query", image=None, prompt="the lazy dog", max_tokens=3),
            Request(task="query", image=None, prompt="what?", max_tokens=2)]
    assert mk.batch(reqs) == ref.batch(reqs)


def _copy(state):
    return text.DecodeState.merge([state], state.max_len)   # a fresh copy of a one-row state


def test_bucket_padding_rebinding_and_interleaved_states(pairs):
    """Three rows at different lengths in the bucket-4 step (a padded row), then two rows (the state
    rebinds to bucket 2), then two one-row states stepped in turn on the batch-1 arena (each takes
    the rows back from the other): every step's logits equal the reference decode's."""
    ref, mk = pairs["alternate"]
    singles = [ref.prefill(None, q, extra=4)[0] for q in ("the lazy dog", "a cat", "what is in the picture?")]
    n = max(s.max_len for s in singles)
    mine, want = text.DecodeState.merge(singles, n), text.DecodeState.merge(singles, n)
    gen = torch.Generator().manual_seed(5)
    for rows in (None, None, [0, 2]):
        if rows is not None:
            mine.keep(rows)
            want.keep(rows)
        ids = torch.randint(0, fx.VOCAB, (mine.batch, 1), generator=gen)
        assert rel_err(mk.step(ids, mine), ref.step(ids, want)) < RTOL
    assert mk.decode.decoder(2).holds(mine)
    a, b = singles[0], singles[1]
    a_ref, b_ref = _copy(a), _copy(b)
    for _ in range(2):
        for s, s_ref in ((a, a_ref), (b, b_ref)):
            ids = torch.randint(0, fx.VOCAB, (1, 1), generator=gen)
            assert rel_err(mk.step(ids, s), ref.step(ids, s_ref)) < RTOL
    assert mk.decode.decoder(1).holds(b) and not mk.decode.decoder(1).holds(a)


def test_greedy_rounds_on_the_device_equal_the_per_token_decode(folders, pairs):
    """Greedy requests on the megakernel decode in rounds on the device (the host reads tokens once
    per round, no logits), here in rounds of at most 4 steps (production's are 8: the same loop, half
    the launches under the interpreter): a streamed answer of 7 tokens comes in rounds of 4 and 2 with
    the reference backend's tokens, even with a request stepped on the same arena between the two
    rounds (moved out and back without changing either); in a batch a row that stops inside a round
    ends there."""
    from photon_core.megakernel.decode_loop import DeviceDecode
    from photon_core.models.qwen3_5 import generate

    ref = pairs["deltas3"][0]
    mk = load_qwen3_5(folders["deltas3"], backend=get_backend("megakernel"), tiling=FAST, max_len=96)
    mk.decode.build_loop = lambda step: DeviceDecode(step, chunk=4)   # each bucket's loop, as it is built
    q = "what is in the picture?"
    s = generate.Sampling(max_tokens=7)
    st1, lg1 = ref.prefill(None, q, extra=7)
    want = list(generate.tokens(ref, st1, lg1, s))
    assert len(want) == 7 and len(set(want)) >= 4    # no stop token: every round is used
    mk.decode.decoder(1)
    loop = mk.decode._loops[1]
    assert loop.chunk == 4
    before = loop.rounds

    st3, lg3 = mk.prefill(None, q, extra=7)
    stream = generate.tokens(mk, st3, lg3, s)
    got = [next(stream) for _ in range(5)]            # the first token and round one (4 steps)
    other, other_ref = mk.prefill(None, "a cat", extra=2)[0], ref.prefill(None, "a cat", extra=2)[0]
    ids = torch.tensor([[3]])
    assert rel_err(mk.step(ids, other), ref.step(ids, other_ref)) < RTOL   # takes the batch-1 rows
    got += list(stream)                                # round two moves this request back first
    assert got == want
    assert loop.rounds - before == 2                   # the host step between them is no round
    assert torch.equal(st3.length, st1.length)         # 6 steps each, no step past the answer
    for i in st1.rec:   # the recurrent states went on from this request's own, not the other's
        assert rel_err(st3.rec[i], st1.rec[i].float()) < RTOL
        assert rel_err(st3.conv[i], st1.conv[i].float()) < RTOL

    # (A longer prompt asking for fewer tokens: rows fit their own lengths, not the longest prompt
    # plus the most tokens.) 7 steps: rounds of 4 and 3.
    reqs = [Request(task="query", image=None, prompt=q, max_tokens=8),
            Request(task="query", image=None, prompt="the quick brown fox", max_tokens=8),   # stops at 6: step 6
            Request(task="query", image=None, prompt=q + " say it", max_tokens=2)]
    mk.decode.decoder(4)
    before = mk.decode._loops[4].rounds
    assert mk.batch(reqs) == ref.batch(reqs)
    assert mk.decode._loops[4].rounds - before == 2
