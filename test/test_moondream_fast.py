"""Moondream 2's fast path against the PyTorch reference, on the same (small, random) weights:

* vision encoder, projection and the prefill of [BOS][image] through the per-op Triton kernels:
  features, image tokens and the whole KV cache within fp32 relative error 1e-4;
* the decode megakernel step (all layers, LM head under per-row masks, coordinate and size heads on
  the hidden state before post_ln): hidden state and logits close, same token, same coordinate and
  size bins, same appended K/V, for batch 1 and 2 (rows at different positions) over several steps;
* the graphs pass the checker for every batch bucket (and at moondream2's real sizes), and a graph
  with a dropped dependency is rejected;
* the skills on the megakernel backend give exactly the reference's greedy tokens, boxes and points;
* every object's score (P(coord) at its boundary) is the reference's within SCORE_ATOL on the per-op
  Triton path, host-driven megakernel steps and device rounds: these run with coord's LM bias at
  eos's + MARGIN (ff.coord_margin), so the scores are probabilities inside (0.5, 1), not the 1.0
  of the fixtures' +100 bias.

Runs Triton under the CPU interpreter on moondream_fast_fixtures' reduced checkpoint (vocab 1024,
126-px crops), which keeps all of it around a minute on two cores.
"""
import dataclasses
import os

os.environ["TRITON_INTERPRET"] = "1"  # must precede the first import of triton

import pytest  # noqa: E402
import torch  # noqa: E402

import moondream_fast_fixtures as ff  # noqa: E402
from photon_core.backends import reference as ref  # noqa: E402
from photon_core.models.moondream import decoder_step as md  # noqa: E402
from photon_core.megakernel.compiler import Tiling, lower, plan  # noqa: E402
from photon_core.megakernel.ops import OP_ARGMAX, OP_ROPE_APPEND  # noqa: E402
from photon_core.megakernel.checker import GraphError, check  # noqa: E402
from photon_core.models.moondream import Request, load_moondream, text, vision  # noqa: E402
from photon_core.models.moondream.config import MoondreamConfig  # noqa: E402
from photon_core.backends.select import get_backend  # noqa: E402
from photon_core.models.moondream import batch as batch_decoding  # noqa: E402
from photon_core.models.moondream.megakernel_decode import MegakernelDecode  # noqa: E402

RTOL = 1e-4
# Scores are sigmoids (slope <= 1/4) of a logit difference, which fp32 gets to rounding on every
# path (measured: within 4e-7 of the reference's); bins and tokens are compared exactly.
SCORE_ATOL = 1e-5
MARGIN = 3.0   # coord's LM bias over eos's: every boundary of these tests still goes on (gaps > -2.1)
# Wider tiles than the GPU default: the interpreter's cost is per task, not per byte.
TILING = Tiling(block_n=64, block_k=128, block_t=32, self_splits=2)
# The skills' steps (end to end against the reference's results): wider still, a linear's 128-256
# outputs one task (half the tasks of TILING, still split KV); the steps themselves at TILING's
# narrower tiles are the decode-step tests'.
SKILL_TILING = Tiling(block_n=256, block_k=128, block_t=32, self_splits=2)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    assert torch.isfinite(a).all() and a.shape == b.shape
    return ((a - b).abs().max() / b.abs().max()).item()


def fast_model(ckpt):
    """The same checkpoint on the megakernel backend: Triton per-op encode/prefill, compiled decode steps."""
    return load_moondream(ckpt, backend=get_backend("megakernel", "cpu"), tiling=SKILL_TILING)


@pytest.fixture(scope="module")
def pair():
    """(reference model, fast model) on the same checkpoint (LM head biased towards `coord`)."""
    ckpt = ff.checkpoint()
    return load_moondream(ckpt), fast_model(ckpt)


@pytest.fixture(scope="module")
def encoded(pair):
    ref_m, fast = pair
    img = ff.image()
    return ref_m.encode_image(img), fast.encode_image(img)


@pytest.fixture(scope="module")
def unbiased():
    """(reference model, fast model, their encodings of one image) on a checkpoint whose LM head is
    not biased towards `coord` (the caption tests': their greedy tokens a real search). The image is
    encoded once, by the reference model: the fast model's own encoder and prefill are `encoded`'s
    (test_vision_features_and_tokens_match, test_prefill_kv_cache_matches); these test its decode."""
    ckpt = ff.checkpoint(seed=1, object_bias=False)
    ref_m, fast = load_moondream(ckpt), fast_model(ckpt)
    ref_e = ref_m.encode_image(ff.image(seed=1))
    return ref_m, fast, ref_e, dataclasses.replace(ref_e, owner=fast.serial)


def test_batched_requests_through_the_triton_ops_match_reference(pair, encoded):
    """model.batch on the per-op kernels: the per-row-position decode step (rotary with one
    position per row, kv_append, decode_attention over ragged lengths) gives the reference's
    boxes and points."""
    ref_m, fast = pair
    ref_e, fast_e = encoded
    requests = [("detect", "cup", 2), ("point", "dog", 3)]
    with ff.coord_margin(MARGIN, ref_m, fast):
        want = ref_m.batch([Request(t, ref_e, p, max_objects=n) for t, p, n in requests])
        got = batch_decoding.run(fast, [Request(t, fast_e, p, max_objects=n) for t, p, n in requests])  # ops stepper
    scores = ff.assert_same_results(got, want, SCORE_ATOL)
    assert len(got[1]["points"]) == 3
    flat = [p for row in scores for p in row]
    assert 0.5 <= min(flat) and max(flat) < 0.999 and max(flat) - min(flat) > 0.05


# ---------------------------------------------------------------------------------------------------
# Vision encoder and prefill through the per-op kernels


def test_vision_features_and_tokens_match(pair):
    ref_m, fast = pair
    m = fast
    crops, tiling = ref_m.preprocess(ff.image())
    assert tiling == (1, 1) and crops.shape[0] == 2  # global crop + one local crop
    x = vision.normalize(crops, torch.float32, "cpu")
    want = vision.encode_crops(x, ref_m.vision_w, ref_m.config.vision, ref)
    got = vision.encode_crops(x, m.vision_w, m.config.vision, m.ops)
    assert rel_err(got, want) < RTOL
    want_t = vision.project(want, tiling, ref_m.vision_w, ref_m.config.vision, ref)
    got_t = vision.project(got, tiling, m.vision_w, m.config.vision, m.ops)
    assert got_t.shape == (81, 128) and rel_err(got_t, want_t) < RTOL


def test_prefill_kv_cache_matches(pair, encoded):
    ref_e, fast_e = encoded
    assert fast_e.pos == ref_e.pos == 82 and fast_e.tiling == ref_e.tiling
    assert rel_err(fast_e.k, ref_e.k) < RTOL
    assert rel_err(fast_e.v, ref_e.v) < RTOL


# ---------------------------------------------------------------------------------------------------
# The decode megakernel step


@pytest.mark.parametrize("batch", [1, 2])
def test_decode_step_matches_reference(pair, encoded, batch):
    ref_m, _ = pair
    ref_e, _ = encoded
    cfg = ref_m.config
    dm = md.dims_of(cfg)
    max_len = 100
    mk = md.MoondreamDecoderMegakernel(ref_m.text_w, ref_m.region_w, cfg, batch, max_len, TILING)
    mk.state.fill_(float("nan"))  # poison: every value a step reads must have been written first
    g = torch.Generator().manual_seed(batch)
    caches = []
    positions = [ref_e.pos + 2 * r for r in range(batch)]  # rows at different positions
    for r, p in enumerate(positions):
        c = text.KVCache(cfg.text, max_len, torch.float32, "cpu")
        c.k[:, :, :, :ref_e.pos], c.v[:, :, :, :ref_e.pos] = ref_e.k, ref_e.v
        # Later rows get a few random earlier (text) positions after the image prefix.
        c.k[:, :, :, ref_e.pos:p] = torch.randn(c.k[:, :, :, ref_e.pos:p].shape, generator=g)
        c.v[:, :, :, ref_e.pos:p] = torch.randn(c.v[:, :, :, ref_e.pos:p].shape, generator=g)
        mk.cache(r).k[:, :, :, :p], mk.cache(r).v[:, :, :, :p] = c.k[:, :, :, :p], c.v[:, :, :, :p]
        caches.append(c)
    # Row 0: the detect boundary mask (coord or eos); other rows: a random half of the vocabulary
    # without `coord` (which the biased LM head would pick otherwise), so the argmax is a real search.
    bias = torch.full((batch, dm.vocab), float("-inf"))
    bias[0, [5, 0]] = 0.0
    for r in range(1, batch):
        keep = torch.rand(dm.vocab, generator=g) < 0.5
        keep[5] = False
        bias[r, keep] = 0.0
    mk.set_bias(bias)
    for step in range(3):
        emb = torch.randn(batch, dm.d, generator=g) * (1.0 if step != 1 else 3.0)
        got = mk.step(emb, positions)
        want = md.reference_step(ref_m.text_w, ref_m.region_w, cfg, caches, emb, positions, bias)
        assert rel_err(got.hidden, want["hidden"]) < RTOL
        finite = torch.isfinite(want["logits"])
        assert torch.equal(torch.isfinite(mk.logits), finite)
        assert rel_err(mk.logits[finite], want["logits"][finite]) < RTOL
        assert got.tokens == want["tokens"]
        assert got.coord_bins == want["coord_bins"]
        assert got.size_bins == want["size_bins"]
        for r, p in enumerate(positions):
            # The appended (rotated) keys and values themselves, not only their effect.
            assert rel_err(mk.view("kcache")[:, r, :, p], caches[r].k[:, 0, :, p]) < RTOL
            assert rel_err(mk.view("vcache")[:, r, :, p], caches[r].v[:, 0, :, p]) < RTOL
        positions = [p + 1 for p in positions]
    assert got.tokens[0] == 5  # the biased LM head, under the boundary mask


def test_text_graph_without_region_heads(pair, encoded):
    """The caption/query variant: same token and hidden state, no region tasks in the graph."""
    ref_m, _ = pair
    ref_e, _ = encoded
    cfg = ref_m.config
    mk = md.MoondreamDecoderMegakernel(ref_m.text_w, ref_m.region_w, cfg, 1, 90, TILING)
    assert not any(t.name.startswith(("coord", "size")) for t in mk.kernel_for(["token"]).graph.tasks)
    assert mk.weight_bytes_per_step(region_heads=False) < mk.weight_bytes_per_step()
    cache = text.KVCache(cfg.text, 90, torch.float32, "cpu")
    cache.k[:, :, :, :ref_e.pos], cache.v[:, :, :, :ref_e.pos] = ref_e.k, ref_e.v
    mk.cache(0).k[:, :, :, :ref_e.pos], mk.cache(0).v[:, :, :, :ref_e.pos] = ref_e.k, ref_e.v
    bias = torch.zeros(md.dims_of(cfg).vocab)
    bias[5] = float("-inf")
    emb = torch.randn(1, md.dims_of(cfg).d, generator=torch.Generator().manual_seed(7))
    allowed = torch.ones(md.dims_of(cfg).vocab, dtype=torch.bool)
    allowed[5] = False  # the same mask given as allowed tokens
    got = mk.step(emb, [ref_e.pos], allowed, region_heads=False)
    want = md.reference_step(ref_m.text_w, ref_m.region_w, cfg, [cache], emb, [ref_e.pos], bias)
    assert got.coord_bins is None and got.tokens == want["tokens"] and got.tokens[0] != 5
    assert rel_err(got.hidden, want["hidden"]) < RTOL


# ---------------------------------------------------------------------------------------------------
# Graphs


def _graph(cfg: MoondreamConfig, batch: int, max_len: int, tiling: Tiling) -> md.TaskGraph:
    return lower(plan(md.step_graph(md.dims_of(cfg), max_len), batch, tiling))


@pytest.mark.parametrize("batch", md.BATCH_BUCKETS)
def test_graphs_check_for_every_bucket(batch):
    cfg = MoondreamConfig.from_dict(ff.fast_config())
    g = _graph(cfg, batch, 100, TILING)
    check(g)
    dm = md.dims_of(cfg)
    # Every row's output is produced: one reduction per output column.
    assert sorted(t.name for t in g.tasks if t.op == OP_ARGMAX) == sorted(
        ["argmax.token", "argmax.coord", "argmax.width", "argmax.height"])
    # One rotary append per (layer, head, row), each run as a finale of its head's q|k|v tiles (a
    # finale row, no task of its own): a head's rows at every bucket up to Tiling.rope_finale_rows.
    appends = [t for t in g.tasks + g.rows if t.op == OP_ROPE_APPEND]
    assert len(appends) == dm.layers * dm.heads * batch
    assert len(g.rows) == (len(appends) if batch <= TILING.rope_finale_rows else 0)


def test_real_moondream2_graph_checks():
    """moondream2's real sizes (24 layers, dim 2048, vocab 51200, 8192-wide region heads, context
    2048) at batch 1: ~20k tasks (the real sizes, not a small graph). (Batch 8, ~50k tasks, also
    checks but takes ~30 s.)"""
    g = _graph(MoondreamConfig(), 1, 2048, Tiling())
    check(g)
    assert len(g.tasks) > 15000


def test_dropped_dependency_is_caught():
    cfg = MoondreamConfig.from_dict(ff.fast_config())
    g = _graph(cfg, 2, 100, TILING)
    proj = next(t for t in g.tasks if t.name.startswith("L0.proj"))
    proj.waits = proj.waits[:1]  # forget to wait for the MLP-down tiles
    with pytest.raises(GraphError, match="race"):
        check(g)
    g = _graph(cfg, 2, 100, TILING)
    part = next(t for t in g.tasks if t.name.startswith("L1.attn.part"))
    part.waits = []  # attention before its rotary/cache-append task
    with pytest.raises(GraphError, match="race"):
        check(g)


# ---------------------------------------------------------------------------------------------------
# Skills end to end


def test_detect_and_point_match_reference(pair, encoded):
    """Host-driven megakernel steps (one read per step: the path of batches with a sampled answer);
    the rounds on the device are test_megakernel_batch_matches_reference's. Then a caption on the
    same steps."""
    ref_m, fast = pair
    ref_e, fast_e = encoded
    # The steps are built afresh by the detect below, inside the batch's inference mode; the caption
    # after it (outside that mode) writes their arenas in place, so they must be ordinary tensors.
    fast.decode.reset()
    fast.decode.device_rounds = False
    try:
        with ff.coord_margin(MARGIN, ref_m, fast):
            got = fast.detect(fast_e, "cup", settings={"max_objects": 2})
            want = ref_m.detect(ref_e, "cup", settings={"max_objects": 2})
            assert len(want["objects"]) == 2
            ff.assert_same_results([got], [want], SCORE_ATOL)
            got = fast.point(fast_e, "dog", settings={"max_objects": 2})
            want = ref_m.point(ref_e, "dog", settings={"max_objects": 2})
            assert len(want["points"]) == 2 and max(p["score"] for p in want["points"]) < 0.999
            ff.assert_same_results([got], [want], SCORE_ATOL)
    finally:
        fast.decode.device_rounds = True
    assert fast.caption(fast_e, "short", settings={"temperature": 0, "max_tokens": 2}) == ref_m.caption(ref_e, "short", settings={"temperature": 0, "max_tokens": 2})


def test_caption_and_query_match_reference(unbiased):
    """An unbiased LM head, so the greedy tokens are a real search over the vocabulary."""
    ref_m, fast, ref_e, fast_e = unbiased
    want = ref_m.caption(ref_e, "short", settings={"temperature": 0, "max_tokens": 4})
    assert fast.caption(fast_e, "short", settings={"temperature": 0, "max_tokens": 4}) == want
    assert len(set(want["caption"].split())) > 1  # not one token repeated
    want = ref_m.query(ref_e, "what is this ?", settings={"temperature": 0, "max_tokens": 3})
    assert "".join(fast.query(fast_e, "what is this ?", settings={"temperature": 0, "max_tokens": 3}, stream=True)["answer"]) == want["answer"]


def test_query_features_match_across_backends(pair, encoded):
    """Reasoning (its coordinates decoded by the region heads inside the text), spatial refs on
    query and point, and a text-only query (causal from BOS): greedy results identical on the
    reference ops, the per-op Triton kernels (batch.run's OpsStepper) and the megakernel (single
    calls, streamed, and batched). A variant on the megakernel is refused."""
    ref_m, fast = pair
    ref_e, fast_e = encoded
    g = {"temperature": 0, "max_tokens": 2}   # each path prefills, then steps: few steps keep it short
    refs = [(0.25, 0.5), (0.1, 0.2, 0.6, 0.7)]

    def asks(enc):
        return [Request("query", enc, "what is this ?", settings=g, reasoning=True, spatial_refs=refs),
                Request("point", enc, "cup", settings={"max_objects": 1}, spatial_refs=refs)]
    want = ref_m.batch(asks(ref_e))
    assert len(want[0]["reasoning"]["grounding"][0]["points"]) == 1   # the biased head: coords
    assert len(want[1]["points"]) == 1 and len(want[0]["answer"].split()) == 2
    ff.assert_same_results(batch_decoding.run(fast, asks(fast_e)), want, SCORE_ATOL)
    ff.assert_same_results(fast.batch(asks(fast_e)), want, SCORE_ATOL)
    streamed = fast.query(fast_e, "what is this ?", reasoning=True, spatial_refs=refs, stream=True, settings=g)
    assert streamed["reasoning"] == want[0]["reasoning"] and "".join(streamed["answer"]) == want[0]["answer"]
    with ff.coord_margin(-50.0, ref_m, fast):   # ordinary words
        for image, kw in ((None, {}), (ref_e, {"spatial_refs": refs})):
            ours = fast_e if image is not None else None
            want_text = ref_m.query(image, "what is this ?", settings=g, **kw)
            assert fast.query(ours, "what is this ?", settings=g, **kw) == want_text
            assert batch_decoding.run(fast, [Request("query", ours, "what is this ?", settings=g, **kw)]) == [want_text]
    with pytest.raises(NotImplementedError, match="variant"):
        fast.detect(fast_e, "cup", settings={"variant": "any"})


def test_greedy_caption_decodes_in_rounds_on_the_device(unbiased):
    """A greedy caption of 11 tokens on the megakernel: the tokens after the first come in rounds of
    8 and 2 steps (the masked argmax's token embedded into the next input on the device), one read
    each, and the text is the reference's."""
    ref_m, fast, ref_e, fast_e = unbiased
    want = ref_m.caption(ref_e, "normal", settings={"temperature": 0, "max_tokens": 11})
    n = len(fast.tokenizer.encode(want["caption"]))
    fast.decode.decoder(1)
    loop = fast.decode._text_loop
    before = loop.rounds
    assert fast.caption(fast_e, "normal", settings={"temperature": 0, "max_tokens": 11}) == want
    assert n >= 9 and len(set(want["caption"].split())) > 3
    assert loop.rounds - before == 2


def test_fast_model_rules(pair, encoded):
    ref_m, fast = pair
    ref_e, _ = encoded
    with pytest.raises(ValueError, match="another model"):
        fast.detect(ref_e, "cup", settings={"max_objects": 1})  # an EncodedImage of the reference model
    with pytest.raises(ValueError, match="Triton ops"):
        MegakernelDecode(ref_m)
    with pytest.raises(ValueError, match="max_objects"):
        fast.point(encoded[1], "cup", settings={"max_objects": -1})


def test_megakernel_batch_matches_reference(pair, encoded):
    """Three requests in the batch-4 bucket (one idle slot), rows at different positions and
    finishing at different steps, decoded in rounds on the device after the prompt step (the
    protocol's inputs chosen by device ops): each result equals the reference's own single call."""
    ref_m, fast = pair
    ref_e, fast_e = encoded
    asks = [("detect", "cup", 2), ("point", "dog", 3), ("point", "person", 2)]
    loop = fast.decode.object_rounds(fast.decode.decoder(4)).loop
    before = loop.rounds
    with ff.coord_margin(MARGIN, ref_m, fast):
        got = fast.batch([Request(t, fast_e, p, max_objects=n) for t, p, n in asks])
        want = [getattr(ref_m, t)(ref_e, p, settings={"max_objects": n}) for t, p, n in asks]
    # The scores came from the rounds' records (the prompt step's first ones from the host's read).
    scores = ff.assert_same_results(got, want, SCORE_ATOL)
    assert [len(r.get("points", r.get("objects"))) for r in got] == [2, 3, 2]
    assert all(0.5 <= p < 0.999 for row in scores for p in row)
    # Two rounds of 3 steps: each row through its next boundary, then through the objects left to it.
    assert loop.rounds - before == 2
    assert fast.decode.decoder(4).weights is fast.decode.decoder(1).weights     # one copy of the weights


def test_rounds_feed_the_inputs_the_host_would(pair):
    """The device's choice of each row's next input, what BatchSession computes from the same
    results: the encoded x at a boundary whose token is `coord`, the token's embedding at one
    that ends, the encoded size, an answer token's embedding; and the phases after them."""
    from photon_core.models.moondream.megakernel_decode import size_values
    from photon_core.models.moondream.object_rounds import PHASE
    _, fast = pair
    m, tk = fast, fast.config.tokenizer
    dev = fast.decode.object_rounds(fast.decode.decoder(4))
    x = dev.mk.view("x")
    with torch.no_grad():
        for phases, detect, want_phase in (([0, 2, 0, 3], [True, True, False, False], [1, 0, 0, 3]),
                                           ([1, 1, 0, 2], [True, False, True, False], [2, 0, 1, 0])):
            rec = torch.tensor([[tk.coord_id, 517, 3, 9], [tk.eos_id, 12, 300, 701],
                                [tk.eos_id if phases[2] == 0 and not detect[2] else tk.coord_id, 1000, 5, 6],
                                [42, 7, 1020, 2]], dtype=torch.int32)
            dev.phase.copy_(torch.tensor(phases))
            dev.detect.copy_(torch.tensor(detect))
            dev._feed(rec)
            for r, (ph, (tok, coord, wb, hb)) in enumerate(zip(phases, rec.tolist())):
                if (ph == 0 and tok == tk.coord_id) or ph == 1:
                    want = m.region_impl.encode_coords([coord / fast.config.region.coord_out_dim], m.region_w, m.ops)
                elif ph == 2:
                    want = m.region_impl.encode_sizes([size_values((wb, hb))], m.region_w, m.ops)
                else:
                    want = m.text_impl.embed(torch.tensor([[tok]]), m.text_w)
                    assert torch.equal(x[r], want.reshape(-1).float()), (phases, r)
                # The encoders' batched matmuls round by the number of rows (as a host-driven batch's do).
                torch.testing.assert_close(x[r], want.reshape(-1).float(), rtol=1e-5, atol=1e-5, msg=f"{phases} {r}")
            assert dev.phase.tolist() == want_phase
    assert PHASE == {"boundary": 0, "y": 1, "size": 2, "token": 3}


def test_a_row_the_prompt_step_ends_may_sit_at_the_end_of_the_caches(pair, encoded):
    """A detect with max_objects=0 ends in its prompt step at position max_len (its request fills
    the caches exactly): the rounds of the row beside it must not hand that position to the step."""
    ref_m, fast = pair
    ref_e, fast_e = encoded
    det = Request("detect", fast_e, "red cup on the kitchen table", max_objects=0)
    pt = Request("point", fast_e, "cup", max_objects=1)
    lengths = [len(batch_decoding._prompt(fast, r, r.options())[0]) for r in (det, pt)]
    assert lengths[0] - lengths[1] >= 2                       # the point's 2 steps fit too
    fm = MegakernelDecode(fast, SKILL_TILING, max_len=fast_e.pos + lengths[0])
    assert fm.batch([det, pt]) == [{"objects": []}, ref_m.point(ref_e, "cup", settings={"max_objects": 1})]
    assert fm.object_rounds(fm.decoder(2)).loop.rounds == 1


def test_round_sizes_follow_the_protocol():
    """Each object row through its next boundary, plus as many objects as it has found (within its
    max_objects); answer rows their tokens left; at most CHUNK."""
    from photon_core.models.moondream.batch import BOUNDARY, COORD_Y, SIZE, TOKEN, _Row
    from photon_core.models.moondream.object_rounds import CHUNK, round_size

    def row(task, phase, found=0, max_objects=50, tokens=0, max_tokens=20):
        r = _Row(Request(task, None, "x", max_objects=max_objects, max_tokens=max_tokens), [], 999, 0, phase)
        r.objects, r.tokens = [{}] * found, [0] * tokens
        return r
    assert round_size([row("detect", COORD_Y)], [0]) == 3          # a first object: no step wasted
    assert round_size([row("point", COORD_Y)], [0]) == 2
    assert round_size([row("detect", COORD_Y, found=1)], [0]) == 6
    assert round_size([row("detect", SIZE, found=2)], [0]) == 8
    assert round_size([row("detect", BOUNDARY, found=2, max_objects=3)], [0]) == 4
    assert round_size([row("detect", COORD_Y, found=1, max_objects=2)], [0]) == 3
    assert round_size([row("point", BOUNDARY, found=40)], [0]) == CHUNK
    assert round_size([row("caption", TOKEN, tokens=15)], [0]) == 5
    assert round_size([row("point", COORD_Y), row("caption", TOKEN, tokens=16)], [0, 1]) == 4
    assert round_size([row("point", COORD_Y), row("caption", TOKEN, tokens=16)], [0]) == 2


# ---------------------------------------------------------------------------------------------------
# The Moondream megakernel compiles for sm_90 (no GPU needed; the interpreter misses compiler errors)

_COMPILE = r'''
import json
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from photon_core.megakernel import kernel
from photon_core.megakernel.graph import NUM_FIELDS
sig0 = dict(tasks_ptr="*i64", num_tasks="i32", ctrl_ptr="*i32", dyn_ptr="*i32", w_ptr="*fp32", s_ptr="*fp32",
            out_ptr="*i32", B="i32", ln_eps="fp32", spin_limit="i32", trace_ptr="*i64")
out = {}
for b, wdt in ((1, "*bf16"), (8, "*fp32")):
    const = dict(NF=NUM_FIELDS, BLOCK_M=b, BLOCK_N=32, BLOCK_K=64, BLOCK_T=32, BLOCK_D=64, BLOCK_S=4, BLOCK_R=1024,
                 RUN_TASK=kernel.step_tasks, TRACE=0, XLOOP=0, **kernel.KernelVariant().constexprs())
    sig = dict(sig0, w_ptr=wdt)
    sig.update({k: "constexpr" for k in const})
    ck = triton.compile(ASTSource(kernel._megakernel, sig, const), target=GPUTarget("cuda", 90, 32))
    out[f"b{b}"] = dict(cubin=len(ck.asm["cubin"]), ptx=ck.asm["ptx"])
print(json.dumps(out))
'''


def test_megakernel_compiles_for_sm90():
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(root) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    r = subprocess.run([sys.executable, "-c", _COMPILE], env=env, cwd=root, capture_output=True, text=True,
                       timeout=300)
    if r.returncode != 0 and "ptxas" in r.stderr and "not found" in r.stderr:
        pytest.skip("triton's NVIDIA backend (ptxas) is not available here")
    assert r.returncode == 0, r.stderr[-4000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    for name in ("b1", "b8"):
        ptx = out[name]["ptx"]
        assert out[name]["cubin"] > 0
        assert "ld.global.gpu.acquire" in ptx or "atom.global.gpu.acquire" in ptx  # dependency waits
        assert "red.global.gpu.release.add" in ptx or "atom.global.gpu.release.add" in ptx  # signals


def test_device_paths_decode_coordinate_bins_as_moondream2(pair):
    """bin / 1024 (Moondream 2's public code) on every device path (Moondream 3.1: bin / 1023,
    test_moondream3_megakernel)."""
    _, fast = pair
    want = [1023 / 1024, 0.5, 0.0]
    heads, recorded, table = ff.device_coords(fast, [1023, 512, 0])
    assert heads == recorded == want
    assert table == torch.tensor(want, dtype=fast.region_w.coord_features.dtype).tolist()
