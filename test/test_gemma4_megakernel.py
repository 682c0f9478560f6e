"""Gemma 4's decode step compiled to one megakernel launch (decoder_step.py), on the tiny random
checkpoint of test_gemma4_fixtures (sliding + full layers with different head sizes, KV-shared
layers with double-wide MLPs, per-layer inputs, proportional rotary, softcap, window 6):
(1) the compiled step equals run_reference of the same graph, caches included, with rows whose
ring has wrapped; (2) after a real prefill (a text prompt and an image prompt in one batch bucket)
its logits and greedy tokens equal the reference backend's decode; (3) the query skill on the
"megakernel" backend answers what the reference backend answers, and a second request during a
stream is refused; a batch of three (one row sampled) in the 4-row bucket does too. Runs under the Triton interpreter."""
import os

os.environ["TRITON_INTERPRET"] = "1"  # must precede the first import of triton

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from test_gemma4_fixtures import WINDOW, gemma4_dir, gemma4_hf  # noqa: E402,F401

from photon_core.backends.select import get_backend  # noqa: E402
from photon_core.megakernel import Tiling, plan, run_reference  # noqa: E402
from photon_core.models.gemma4 import decoder_step, load_gemma4, text  # noqa: E402
from photon_core.models.gemma4.megakernel_decode import MegakernelStepper  # noqa: E402
from photon_core.runtime.requests import Request  # noqa: E402
from photon_core.runtime.sampling import Sampling  # noqa: E402

RTOL = 1e-4
MAX_LEN = 96            # the image prompt is 84 tokens
TILING = Tiling(64, 64, 32, 1, 1)   # wide tiles, one KV split: fewer tasks for the interpreter


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    assert torch.isfinite(a).all() and torch.isfinite(b).all()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


@pytest.fixture(scope="module")
def ref(gemma4_dir):
    return load_gemma4(gemma4_dir)


@pytest.fixture(scope="module")
def mk_model(gemma4_dir):
    return load_gemma4(gemma4_dir, backend=get_backend("megakernel", "cpu"), tiling=TILING, max_len=MAX_LEN)


def test_the_graph_covers_the_layer_plan(ref):
    cfg = ref.config.text
    g = decoder_step.step_graph(cfg, MAX_LEN)
    # Caches only for layers that make their own K/V, each with its layer kind's head size; rings
    # of the window for sliding layers.
    assert {n: (c.heads, c.length, c.head_dim, c.ring) for n, c in g.caches.items()} == {
        "L0.k": (2, WINDOW, 16, True), "L0.v": (2, WINDOW, 16, True),
        "L1.k": (2, MAX_LEN, 32, False), "L1.v": (2, MAX_LEN, 32, False)}
    appends = [n for n in g.nodes if n.op == "kv_append"]
    assert [n.args["append"] for n in appends] == [True, True, False, False]
    assert [n.args["k"].spec.name for n in appends] == ["L0.k", "L1.k", "L0.k", "L1.k"]
    assert [n.args["window"] for n in g.nodes if n.op == "attention"] == [WINDOW, None, WINDOW, None]
    assert g.weight_shapes["text.layers.2.mlp.gate_up.weight"] == (4 * 96, 64)   # double-wide MLP
    # The real E2B step (35 layers, heads of 256 and 512, 20 KV-shared layers) is accepted by the
    # compiler: planned on shapes alone, no weights.
    _, e2b, _ = decoder_step.roofline_model()
    p = plan(e2b, 1, Tiling())
    assert len(e2b.caches) == 2 * 15 and p.max_position == 4096
    assert {c.head_dim for c in e2b.caches.values()} == {256, 512}


def test_compiled_step_equals_the_eager_graph(ref):
    """Batch 2 at positions 8 and 3 (row 0's ring of 6 has wrapped), 2 steps: logits, hidden state,
    per-layer inputs, tokens and every cache."""
    cfg = ref.config.text
    step = decoder_step.Gemma4DecoderStep(ref.w, cfg, 2, MAX_LEN, TILING, barred=ref.config.placeholder_ids)
    g, w = step.graph_def, decoder_step.gather_weights(ref.w, cfg, MAX_LEN)
    gen = torch.Generator().manual_seed(7)
    positions = [8, 3]
    step.state.fill_(float("nan"))     # poison: what the step reads must have been written
    caches = {}
    for name, spec in g.caches.items():
        t = torch.randn(2, spec.heads, spec.length, spec.head_dim, generator=gen)
        view = step.view(name)
        for r, p in enumerate(positions):
            n = min(p, spec.length)
            t[r, :, n:] = 0.0
            view[r, :, :n] = t[r, :, :n]
        caches[name] = t
    allowed = step.allowed
    bias = torch.zeros(2, cfg.vocab_size).masked_fill(~allowed, float("-inf"))
    step.set_input("logit_bias", bias)     # the constructor's bias went with the poison
    tokens = [17, 250]
    for _ in range(2):
        step.set_step(tokens, positions)
        step.launch()
        want = run_reference(g, w, caches, tokens, positions, inputs={"logit_bias": bias})
        for name in ("ple", "L1.x_attn", "L2.x_ple", g.exposed["hidden"].name):
            assert rel_err(step.view(name), want[name]) < RTOL, name
        assert rel_err(step.view("logits")[:, allowed], want["logits"][:, allowed]) < RTOL
        assert step.result("token").tolist() == want["results"]["token"]
        for name, spec in g.caches.items():
            for r, p in enumerate(positions):
                n = min(p + 1, spec.length)
                assert rel_err(step.view(name)[r, :, :n], caches[name][r, :, :n]) < RTOL, name
        tokens, positions = want["results"]["token"], [p + 1 for p in positions]


def test_decode_after_prefill_equals_the_reference_backend(ref, mk_model):
    """A text prompt longer than the window and an image prompt, prefilled by the reference
    backend, then 6 decode steps: the compiled step's logits (softcapped) and greedy tokens equal
    the reference's batched decode step for step."""
    img = np.random.default_rng(1).integers(0, 256, (16, 24, 3), dtype=np.uint8)
    rows = [ref._row(None, "describe this image in detail.", Sampling(8)),
            ref._row(img, "what is in this image?", Sampling(8))]
    assert len(rows[0].prompt) > WINDOW and rows[1].image is not None
    cfg = ref.config.text
    stepper = MegakernelStepper(mk_model.decode, 2, MAX_LEN)
    cache = text.KVCache(cfg, 2, MAX_LEN, ref.dtype, ref.device)
    last = []
    for b, r in enumerate(rows):
        # A prefill cache shorter than the compiled context: copied position for position.
        one = text.KVCache(cfg, 1, len(r.prompt) + 8, ref.dtype, ref.device)
        last.append(ref.prefill(r.prompt, r.image, one)[0])
        cache.copy_row(b, one)
        stepper.mk.load_row(b, one)
    allowed = stepper.mk.allowed
    toks = [int(torch.stack(last)[b].masked_fill(~allowed, float("-inf")).argmax()) for b in range(2)]
    pos = [len(r.prompt) for r in rows]
    for _ in range(6):
        want = ref.step(torch.tensor(toks)[:, None], torch.tensor(pos), cache)
        logits, greedy = stepper.step(toks, pos)
        assert rel_err(logits[:, allowed], want[:, allowed]) < RTOL
        assert (logits[:, ~allowed] == float("-inf")).all()
        toks = [int(want[b].masked_fill(~allowed, float("-inf")).argmax()) for b in range(2)]
        assert greedy == toks
        pos = [p + 1 for p in pos]


def test_query_on_the_megakernel_backend_answers_as_the_reference(ref, mk_model):
    question = "what is in this image?"
    greedy = {"temperature": 0, "max_tokens": 4}
    want = ref.query(None, question, settings=greedy)["answer"]
    assert want    # a non-empty answer: the stream below has a first piece
    stream = mk_model.query(None, question, stream=True, settings=greedy)["answer"]
    first = next(stream)
    with pytest.raises(RuntimeError, match="one request or batch at a time"):
        next(mk_model.query(None, "hello world", stream=True, settings=greedy)["answer"])
    assert first + "".join(stream) == want
    assert 1 in mk_model.decode._steps


def test_batch_on_the_megakernel_backend_answers_as_the_reference(ref, mk_model):
    """Three requests in the 4-row bucket (one slot idle), one of them sampled (the exposed
    logits, softcapped on the host, with the same seed): the same answers as the reference."""
    # Two tokens each: the first from the prefill's logits, the second from one launch.
    reqs = [Request("query", None, "hello world", max_tokens=2),
            Request("query", None, "how many people are there?", max_tokens=2, temperature=0.8, top_p=0.9),
            Request("query", None, "the cat sat on the mat", max_tokens=2)]
    want = ref.batch(reqs, seed=3)
    assert mk_model.batch(reqs, seed=3) == want
    assert 4 in mk_model.decode._steps



def _rounds_for(max_new: list[int], launches: int, chunk: int = 8) -> int:
    """DeviceDecode.stream's rounds until `launches` steps have run: the launches the longest row
    may need (max_new - 1) taken greedily in powers of two up to `chunk`."""
    left, done, rounds = max(max_new) - 1, 0, 0
    while done < launches:
        n = min(chunk, 1 << (left.bit_length() - 1))
        left, done, rounds = left - n, done + n, rounds + 1
    return rounds


def test_greedy_batch_decodes_in_rounds_on_the_device(ref, mk_model):
    """Three greedy rows in the 4-row bucket (one padding slot), prompts of 22, 21 and 24 tokens
    (past the window of 6: the sliding layers' rings wrap while positions advance on the device),
    with the model's context cut to 30 positions: row 0 meets a stop token after 7 tokens (inside
    the first round of 8), row 1 ends at its position limit (30 - 21 + 1 = 10 tokens, before its
    max_tokens of 14), row 2 at max_tokens (3). The rounds give the tokens, and the per-step lists
    run() yields, of the reference backend, with one read of the device per round: 2 rounds (8 + 1)
    for 9 launches; each slot's position advanced once per launch. The per-token megakernel path
    (device_rounds=False) gives the reference's tokens too, on the same rows cut to 3 tokens each
    (2 launches: each launch costs seconds under the interpreter)."""
    from photon_core.models.gemma4.decoding import BatchDecoder

    asks = [("and detail", 10), ("hello world", 14), ("the cat sat on the mat", 3)]
    context = 30
    loop = mk_model.decode.loop(4)    # built before the context is cut (the step checks its max_len)

    def run(model, asks=asks, **kw):
        rows = [ref._row(None, q, Sampling(n)) for q, n in asks]
        cfg, full = model.config.text, model.config.text.max_context
        object.__setattr__(cfg, "max_context", context)   # BatchDecoder reads it when built
        try:
            decoder = BatchDecoder(model, rows, **kw)
        finally:
            object.__setattr__(cfg, "max_context", full)
        steps = list(decoder.run())
        return [r.tokens for r in rows], steps, [len(r.prompt) for r in rows]

    want, want_steps, lengths = run(ref)
    assert [len(t) for t in want] == [7, 10, 3] and lengths == [22, 21, 24]
    before = loop.rounds
    got, got_steps, _ = run(mk_model)
    rounds = loop.rounds - before
    B = loop.step.batch
    positions = loop.step.dyn[B:2 * B].tolist()
    short = [(q, 3) for q, _ in asks]
    per_token, per_token_steps, _ = run(mk_model, short, device_rounds=False)
    assert loop.rounds - before == rounds     # the per-token path launches the step itself
    assert got == want and got_steps == want_steps
    assert (per_token, per_token_steps) == run(ref, short)[:2]
    assert per_token == [w[:3] for w in want]
    launches = 9     # row 1's tokens after its first (row 0's stop token came at launch 7)
    assert rounds == _rounds_for([10, 10, 3], launches) == 2
    assert positions == [p + launches for p in lengths] + [launches]


def test_the_host_driven_step_reads_its_token_at_the_last_position(mk_model):
    """The argmax advances, so at the last compiled position its result column says -1 (no room
    for a next step); the per-token path still gets the row's greedy token (the one fed next)."""
    mk = mk_model.decode.decoder(1)
    out = mk.step([17], [MAX_LEN - 1])
    assert mk.result("token").tolist() == [-1]
    assert out.tokens == [int(out.logits[0].argmax())] and out.tokens[0] >= 0


def test_a_request_canceled_mid_round_stops_there(ref, mk_model):
    """Canceled at its first piece of text (an action goal canceled, a timeout): on the device
    rounds its later tokens are dropped and the rounds end, as the host-driven decode stops at its
    next step; before, the rounds decoded on to max_tokens and returned that text."""
    import threading

    from photon_core.runtime.requests import Request

    def ask(model):
        cancel, seen = threading.Event(), []

        def progress(result):
            seen.append(result["answer"])
            cancel.set()
        out = model.batch([Request("query", None, "hello world", max_tokens=8, cancel=cancel, progress=progress)])
        return out, seen

    want, want_seen = ask(ref)
    got, got_seen = ask(mk_model)
    assert got == want and got_seen == want_seen and len(want_seen) == 1


def test_a_row_with_no_room_at_a_full_context_does_not_refuse_the_batch(ref, gemma4_dir):
    """A row asking max_tokens 0 whose prompt fills the compiled context exactly still feeds its
    (unseen) first token: at the last position. It was given the one past it, and the step's range
    check refused the whole batch."""
    from photon_core.runtime.requests import Request
    a, b = "describe this image in detail. the cat sat on the mat", "hello world"
    full = len(ref._row(None, a, Sampling(0)).prompt)
    mk = load_gemma4(gemma4_dir, backend=get_backend("megakernel", "cpu"), tiling=TILING, max_len=full)
    asks = [Request("query", None, a, max_tokens=0), Request("query", None, b, max_tokens=2)]
    assert mk.batch(asks) == ref.batch(asks)
