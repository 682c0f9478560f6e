"""The compiler path: a step graph run eagerly by run_reference and the same graph compiled to one
megakernel launch give the same values, results and cache contents, step after step; pruning by
results keeps exactly what they need; graphs the megakernel cannot run are refused with a reason;
and megakernel/ imports no model code."""
import os

os.environ["TRITON_INTERPRET"] = "1"  # must precede the first import of triton

import ast  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from photon_core.megakernel import CompiledStep, Rotary, StepGraph, Tiling, check, lower, plan, run_reference  # noqa: E402
from photon_core.megakernel.ops import OP_LINEAR, OP_LINEAR_SPLIT  # noqa: E402
from photon_core.megakernel.stepgraph import HeadNorm, Tau  # noqa: E402

RTOL = 1e-4


def rel_err(a, b):
    assert torch.isfinite(a).all()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def toy_weights(d=48, heads=3, ff=80, vocab=70, ctx=24, seed=0):
    """A pre-norm decoder layer with rotary, a parallel MLP, an LM head and a two-part side head:
    every op of the step-graph language, in shapes no tile divides."""
    g = torch.Generator().manual_seed(seed)

    def w(*shape, scale=None):
        return torch.randn(*shape, generator=g) * (scale if scale is not None else shape[-1] ** -0.5)

    dh = d // heads
    return {"tok": w(vocab, d, scale=0.5), "pos": w(ctx, d, scale=0.2), "ln.w": 1 + 0.1 * w(d, scale=1),
            "ln.b": w(d, scale=0.1), "rms.w": 0.1 * w(d, scale=1), "qkv": w(3 * d, d), "qkv.b": w(3 * d, scale=0.1), "out": w(d, d),
            "up": w(ff, d), "up.b": w(ff, scale=0.1), "down": w(d, ff), "cos": torch.cos(w(ctx, dh // 4, scale=1)),
            "sin": torch.sin(w(ctx, dh // 4, scale=1)), "xq": w(d, d), "head": w(vocab, d), "side": w(64, d)}


def toy_graph(weights, max_len=12, enc_len=9, rotary=True, advance=False, expose=True, norm="layer"):
    d = weights["tok"].shape[1]
    heads = 3
    g = StepGraph("toy", {k: tuple(t.shape) for k, t in weights.items()})
    kc, vc = g.cache("k", heads, max_len, d // heads), g.cache("v", heads, max_len, d // heads)
    xk, xv = g.cache("xk", heads, enc_len, d // heads), g.cache("xv", heads, enc_len, d // heads)
    x = g.embed("x0", "tok", "pos")
    # RMSNorm in Gemma's (1 + w) form, folded into the stored weight; LayerNorm with a bias.
    h = g.layer_norm("h", x, "ln.w", "ln.b") if norm == "layer" else g.rms_norm("h", x, "rms.w", 1e-5, offset=1.0)
    qkv = g.linear("qkv", h, "qkv", "qkv.b")
    q = g.kv_append("q", qkv, kc, vc, rotary=Rotary("cos", "sin", d // heads // 2) if rotary else None)
    a = g.attention("a", q, kc, vc, "self")
    m = g.linear("m", g.linear("u", h, "up", "up.b", act="gelu_tanh"), "down", residual=x)
    x = g.linear("x1", a, "out", residual=m)
    c = g.attention("c", g.linear("cq", x, "xq"), xk, xv, "cross")
    bias = g.input("bias", weights["tok"].shape[0])
    logits = g.linear("logits", g.layer_norm("hf", c, "ln.w", "ln.b"), "head", residual=bias)
    if expose:
        g.expose("logits", logits)
    g.argmax("token", logits, advance=advance)
    side = g.linear("side", x, "side", act="gelu")
    g.argmax("left", side, 0, 32)
    g.argmax("right", side, 32, 64)
    return g


def fill_caches(step, batch, positions, enc_len, gen):
    """Random history in both the compiled step's caches and plain tensors for the reference."""
    caches = {}
    for name, spec in step.graph_def.caches.items():
        t = torch.randn(batch, spec.heads, spec.length, spec.head_dim, generator=gen)
        if name in ("k", "v"):
            for r, p in enumerate(positions):
                t[r, :, p:] = 0.0        # not yet written: the reference must not need it
        caches[name] = t
        view = step.view(name)
        view.fill_(float("nan"))         # poison: unwritten positions must never be read
        for r, p in enumerate(positions):
            n = p if name in ("k", "v") else enc_len
            view[r, :, :n] = t[r, :, :n]
    return caches


@pytest.mark.parametrize("batch,rotary,tiling,norm", [
    (1, True, Tiling(16, 32, 8, 2, 3), "rms"),
    (2, False, Tiling(16, 32, 8, 3, 2), "layer"),      # no rotary: q|k|v stored by the linear itself
    # tiles straddle heads: whole-stage waits; straddling tiles join all 3 heads in one group,
    # whose finale runs their 12 appends (batch 1's run as finales of one row each by default)
    (4, True, Tiling(32, 64, 16, 1, 1, rope_finale_rows=12), "layer"),
    # Few-tile stages get narrower tiles and split-K (partials summed by the last slice of each tile).
    # ... here the q|k|v stage too: its slices draw the tile's ticket, then their heads' (the appends)
    (2, True, Tiling(32, 16, 8, 2, 2, min_tasks=40, min_block_n=8, max_split_k=3, rope_finale_rows=4), "rms"),
    (1, False, Tiling(32, 16, 8, 2, 2, min_tasks=40, min_block_n=16, max_split_k=4), "layer"),
    # Tasks of several tiles (Tiling.linear_span), one after another: spans that join heads into one
    # append group (rotary), that keep to a head its attention waits on alone (q|k|v stored), that end
    # short (a stage of 3 tiles in spans of 2), and the logits' spans writing each tile's argmax partial.
    (1, True, Tiling(16, 32, 8, 2, 3, linear_span=4, linear_min_tasks=1), "rms"),
    (2, False, Tiling(16, 32, 8, 3, 2, linear_span=2, linear_min_tasks=1), "layer"),
    (4, True, Tiling(16, 64, 16, 1, 1, linear_span=8, linear_min_tasks=2, rope_finale_rows=12), "layer"),
])
def test_compiled_step_equals_the_eager_graph(batch, rotary, tiling, norm):
    w = toy_weights()
    g = toy_graph(w, rotary=rotary, norm=norm)
    step = CompiledStep(g, w, batch, tiling)
    assert bool(step.graph.rows) == rotary   # every rotary case runs its appends as finales
    widths = {t.args["n1"] - t.args["n0"] for t in step.graph.tasks if t.op in (OP_LINEAR, OP_LINEAR_SPLIT)}
    assert (max(widths) > tiling.block_n) == (tiling.linear_span > 1)
    if tiling.min_tasks == 40 and rotary:
        assert all(t.kticket and t.ticket.startswith("q.g") for t in step.graph.tasks if t.name.startswith("qkv."))
    step.state.fill_(float("nan"))
    gen = torch.Generator().manual_seed(batch)
    positions = [1 + 2 * r for r in range(batch)]
    cross = [9 - r for r in range(batch)]
    caches = fill_caches(step, batch, positions, 9, gen)
    step.set_cross_len(cross)
    for _ in range(3):
        tokens = torch.randint(0, 70, (batch,), generator=gen).tolist()
        bias = torch.zeros(batch, 70)
        bias[:, torch.randint(0, 70, (5,), generator=gen)] = float("-inf")
        step.set_input("bias", bias)
        step.set_step(tokens, positions)
        step.launch()
        want = run_reference(g, w, caches, tokens, positions, cross, {"bias": bias})
        finite = torch.isfinite(want["logits"])
        assert torch.equal(torch.isfinite(step.view("logits")), finite)
        assert rel_err(step.view("logits")[finite], want["logits"][finite]) < RTOL
        assert rel_err(step.view("x1"), want["x1"]) < RTOL
        for name in ("token", "left", "right"):
            assert step.result(name).tolist() == want["results"][name], name
        for name in ("k", "v"):
            for r, p in enumerate(positions):
                assert rel_err(step.view(name)[r, :, p], caches[name][r, :, p]) < RTOL
        positions = [p + 1 for p in positions]


def test_stage_spans_keep_enough_tasks_and_whole_heads():
    """Tiling.linear_span tiles a task, halved while the stage would have too few tasks or a task would
    reach past a head its readers wait on alone; narrowed or split stages keep one tile a task."""
    from photon_core.megakernel.ops.linear import stage_span
    t = Tiling(block_n=32, linear_span=4, linear_min_tasks=64)
    assert stage_span(8192, 32, 1, Tiling(block_n=32)) == 1             # linear_span 1: one tile
    assert stage_span(8192, 32, 1, t) == 4                                # 256 tiles: 64 tasks of 4
    assert stage_span(6144, 32, 1, t) == 2                                # 192 tiles: 96 tasks of 2
    assert stage_span(2048, 32, 1, t) == 1                                # 64 tiles: one each
    assert stage_span(8192, 32, 1, t, align=64) == 2                      # 4 tiles would pass a 64-wide head
    assert stage_span(8192, 16, 1, t) == 1 and stage_span(8192, 32, 2, t) == 1   # narrowed, split


def test_stage_shapes_narrow_tiles_first_then_split_k():
    from photon_core.megakernel.compiler import stage_shape
    t = Tiling(block_n=64, block_k=32, min_tasks=16, min_block_n=16, max_split_k=4)
    assert stage_shape(4096, 512, Tiling(block_n=64)) == (64, 1)          # min_tasks 0: as tiled
    assert stage_shape(4096, 512, t) == (64, 1)                           # 64 tiles: enough
    assert stage_shape(512, 512, t) == (32, 1)                            # 16 narrower tiles
    assert stage_shape(128, 4096, t) == (16, 2)                           # 8 tiles, then 2 K slices
    assert stage_shape(128, 4096, t, align=48) == (64, 4)                 # 32 would straddle 48-wide heads
    assert stage_shape(64, 48, t) == (16, 1)                              # K too short to split
    g = lower(plan(toy_graph(toy_weights()), 1, Tiling(32, 16, 8, 2, 2, min_tasks=40, max_split_k=4)))
    splits = [t for t in g.tasks if t.op == OP_LINEAR_SPLIT]
    assert splits and all(t.kticket is not None and t.ksum_writes for t in splits)
    # no reduce tasks: the slices of a tile share its ticket, and their stage's readers wait for all
    tiles: dict[str, int] = {}
    for t in splits:
        tiles[t.kticket] = tiles.get(t.kticket, 0) + 1
    assert min(tiles.values()) >= 2
    check(g)


@pytest.mark.parametrize("rotary,tiling", [(True, Tiling(16, 32, 8, 2, 2, rope_finale_rows=2)), (False, Tiling(16, 32, 8, 2, 2)),
                                           (False, Tiling(32, 32, 8, 1, 1, min_tasks=40, max_split_k=3))])
def test_a_llama_style_layer_equals_the_eager_graph(rotary, tiling):
    """A Qwen / Gemma / Llama-style layer: RMSNorm, 4 query heads over 2 K/V heads of 16, rotary
    (or a plain q|k|v), and a SwiGLU MLP fused into the down-projection's loads (narrow tiles and
    split-K in the last case): the compiled step against run_reference, which repeats K/V heads."""
    g0 = torch.Generator().manual_seed(11)
    d, hq, hkv, dh, vocab, ctx = 64, 4, 2, 16, 50, 16
    w = {"tok": torch.randn(vocab, d, generator=g0) * 0.5, "n.w": torch.randn(d, generator=g0) * 0.1,
         "qkv": torch.randn((hq + 2 * hkv) * dh, d, generator=g0) / 8, "o": torch.randn(d, hq * dh, generator=g0) / 8,
         "cos": torch.cos(torch.randn(ctx, 4, generator=g0)), "sin": torch.sin(torch.randn(ctx, 4, generator=g0)),
         "head": torch.randn(vocab, d, generator=g0) / 8, "n2.w": torch.randn(d, generator=g0) * 0.1,
         "gu": torch.randn(2 * 96, d, generator=g0) / 8, "down": torch.randn(d, 96, generator=g0) / 10}
    g = StepGraph("gqa", {k: tuple(t.shape) for k, t in w.items()})
    kc, vc = g.cache("k", hkv, 10, dh), g.cache("v", hkv, 10, dh)
    x = g.embed("x", "tok")
    h = g.rms_norm("h", x, "n.w", offset=1.0)
    q = g.kv_append("q", g.linear("qkv", h, "qkv"), kc, vc, rotary=Rotary("cos", "sin", 8) if rotary else None,
                    q_heads=hq)
    x = g.linear("x1", g.attention("a", q, kc, vc), "o", residual=x)
    gate_up = g.linear("gu", g.rms_norm("h2", x, "n2.w", offset=1.0), "gu")
    x = g.linear("x2", g.glu("g", gate_up, "silu"), "down", residual=x)
    g.expose("logits", logits := g.linear("logits", x, "head"))
    g.argmax("token", logits)
    step = CompiledStep(g, w, 2, tiling)
    step.state.fill_(float("nan"))
    positions = [2, 5]
    caches = {}
    for name in ("k", "v"):
        t = torch.randn(2, hkv, 10, dh, generator=g0)
        view = step.view(name)
        for r, p in enumerate(positions):
            t[r, :, p:] = 0.0
            view[r, :, :p] = t[r, :, :p]
        caches[name] = t
    for _ in range(2):
        tokens = torch.randint(0, vocab, (2,), generator=g0).tolist()
        step.set_step(tokens, positions)
        step.launch()
        want = run_reference(g, w, caches, tokens, positions)
        assert rel_err(step.view("logits"), want["logits"]) < RTOL
        assert step.result("token").tolist() == want["results"]["token"]
        for name in ("k", "v"):
            for r, p in enumerate(positions):
                assert rel_err(step.view(name)[r, :, p], caches[name][r, :, p]) < RTOL
        positions = [p + 1 for p in positions]


def hybrid_graph(w, ring: bool, window: int = 5, ring_len: int = 6, full_len: int = 16):
    """Two layers of the newer decoders: a sliding-window layer (its K/V in a ring of `ring_len`
    positions, or in a full cache) with per-head q/k/v RMSNorm, a custom attention scale and a
    sigmoid output gate (Qwen 3.5), then a global layer with q/k norms; rotary at an offset."""
    hq, hkv, dh = 4, 2, 16
    g = StepGraph("hybrid", {k: tuple(t.shape) for k, t in w.items()})
    kc = g.cache("k0", hkv, ring_len if ring else full_len, dh, ring=ring)
    vc = g.cache("v0", hkv, ring_len if ring else full_len, dh, ring=ring)
    kc2, vc2 = g.cache("k1", hkv, full_len, dh), g.cache("v1", hkv, full_len, dh)
    rot = Rotary("cos", "sin", 8)
    x = g.embed("x", "tok")
    h = g.rms_norm("h", x, "n.w", offset=1.0)
    q = g.kv_append("q", g.linear("qkv", h, "qkv"), kc, vc, rotary=rot, q_heads=hq,
                    norm=HeadNorm(q="qn", k="kn", v=True, offset=1.0))
    a = g.attention("a", q, kc, vc, window=window, scale=0.7)
    x = g.linear("x1", g.gate("ag", a, g.linear("gt", h, "gate")), "o", residual=x)
    h = g.rms_norm("h2", x, "n2.w", offset=1.0)
    q = g.kv_append("q2", g.linear("qkv2", h, "qkv2"), kc2, vc2, rotary=rot, q_heads=hq,
                    norm=HeadNorm(q="qn2", k="kn2"))
    x = g.linear("x2", g.attention("a2", q, kc2, vc2), "o2", residual=x)
    g.expose("logits", logits := g.linear("logits", x, "head"))
    g.argmax("token", logits)
    return g


def hybrid_weights():
    g0 = torch.Generator().manual_seed(5)
    d, hq, hkv, dh, vocab, ctx = 64, 4, 2, 16, 50, 24

    def r(*shape, s=1.0):
        return torch.randn(*shape, generator=g0) * s

    return {"tok": r(vocab, d, s=0.5), "n.w": r(d, s=0.1), "n2.w": r(d, s=0.1),
            "qkv": r((hq + 2 * hkv) * dh, d, s=1 / 8), "qkv2": r((hq + 2 * hkv) * dh, d, s=1 / 8),
            "gate": r(hq * dh, d, s=1 / 8), "o": r(d, hq * dh, s=1 / 8), "o2": r(d, hq * dh, s=1 / 8),
            "qn": r(dh, s=0.2), "kn": r(dh, s=0.2), "qn2": 1 + r(dh, s=0.2), "kn2": 1 + r(dh, s=0.2),
            "cos": torch.cos(r(ctx, 4)), "sin": torch.sin(r(ctx, 4)), "head": r(vocab, d, s=1 / 8)}


def test_window_ring_head_norms_gate_and_rotary_offsets_equal_the_eager_graph():
    """The sliding window slides and its ring wraps (6 steps past a window of 5 in a ring of 6,
    from positions 3 and 5: each row's ring wraps, row 0's at its 4th step):
    the compiled step equals run_reference step after step, and the ring graph's logits equal
    those of the same layers over a full-length cache (the ring changes memory, not results)."""
    w = hybrid_weights()
    ring_graph, full_graph = hybrid_graph(w, ring=True), hybrid_graph(w, ring=False)
    step = CompiledStep(ring_graph, w, 2, Tiling(16, 32, 8, 2, 2, rope_finale_rows=2))   # appends as finales
    assert step.plan.rope_groups and step.graph.rows
    step.state.fill_(float("nan"))
    g0 = torch.Generator().manual_seed(6)
    positions, offsets = [3, 5], [0, -2]
    caches = {"ring": {}, "full": {}}
    for name, ring_len in (("k0", 6), ("v0", 6), ("k1", 16), ("v1", 16)):
        hist = torch.randn(2, 2, 16, 16, generator=g0)
        for r, p in enumerate(positions):
            hist[r, :, p:] = 0.0
        caches["full"][name] = hist.clone()
        ring = torch.zeros(2, 2, ring_len, 16)
        for r, p in enumerate(positions):
            for t in range(p):
                ring[r, :, t % ring_len] = hist[r, :, t]
        caches["ring"][name] = ring
        view = step.view(name)
        for r, p in enumerate(positions):
            for t in range(p):
                view[r, :, t % ring_len] = hist[r, :, t]
    for _ in range(6):
        tokens = torch.randint(0, 50, (2,), generator=g0).tolist()
        step.set_step(tokens, positions)
        step.set_rotary_offsets(offsets)
        step.launch()
        want = run_reference(ring_graph, w, caches["ring"], tokens, positions, rotary_offsets=offsets)
        full = run_reference(full_graph, w, caches["full"], tokens, positions, rotary_offsets=offsets)
        assert rel_err(want["logits"], full["logits"]) < 1e-5
        assert rel_err(step.view("logits"), want["logits"]) < RTOL
        assert step.result("token").tolist() == want["results"]["token"]
        positions = [p + 1 for p in positions]
    with pytest.raises(ValueError, match="offsets <= 0"):
        step.set_rotary_offsets([1, 0])


def test_a_gated_deltanet_layer_equals_the_eager_graph():
    """Qwen 3.5's linear-attention layer as the compiler sees it: one projection q|k|v|z|b|a, a
    causal conv over q|k|v with its state, the gated delta rule on a [Hv, Dk, Dv] state (2 q/k
    heads shared by 4 value heads, Dv not a power of two), the gated RMSNorm, the output
    projection. Compiled against run_reference for 5 steps, states included."""
    g0 = torch.Generator().manual_seed(21)
    d, hk, hv, dk, dv, width, vocab = 48, 2, 4, 16, 24, 4, 40
    conv_dim = 2 * hk * dk + hv * dv

    def r(*shape, s=1.0):
        return torch.randn(*shape, generator=g0) * s

    w = {"tok": r(vocab, d, s=0.5), "n.w": r(d, s=0.1), "in": r(conv_dim + hv * dv + 2 * hv, d, s=1 / 7),
         "conv": r(conv_dim, width, s=0.5), "a_log": r(hv, s=0.5), "dt": r(hv, s=0.5), "nw": 1 + r(dv, s=0.1),
         "out": r(d, hv * dv, s=1 / 9), "head": r(vocab, d, s=1 / 7)}
    g = StepGraph("deltanet", {k: tuple(v.shape) for k, v in w.items()})
    conv_state, rec = g.state("conv", conv_dim, width - 1), g.state("rec", hv, dk, dv)
    x = g.embed("x", "tok")
    proj = g.linear("proj", g.rms_norm("h", x, "n.w", offset=1.0), "in")
    c = g.conv_step("c", proj, conv_state, "conv", 0, conv_dim)
    o = g.delta_rule("o", c, proj, rec, hk, "a_log", "dt", "nw", c0=conv_dim)
    x = g.linear("x1", o, "out", residual=x)
    g.expose("logits", logits := g.linear("logits", x, "head"))
    g.argmax("token", logits)
    step = CompiledStep(g, w, 2, Tiling(16, 32, 8, 2, 2))
    step.state.fill_(float("nan"))
    states = {"conv": r(2, conv_dim, width - 1), "rec": r(2, hv, dk, dv, s=0.3)}
    for name, value in states.items():
        step.view(name).copy_(value)
    positions = [4, 9]
    for _ in range(5):
        tokens = torch.randint(0, vocab, (2,), generator=g0).tolist()
        step.set_step(tokens, positions)
        step.launch()
        want = run_reference(g, w, states, tokens, positions)
        for name in ("c", "o", "logits"):
            assert rel_err(step.view(name), want[name]) < RTOL, name
        for name in states:
            assert rel_err(step.view(name), states[name]) < RTOL, name
        assert step.result("token").tolist() == want["results"]["token"]
        positions = [p + 1 for p in positions]


def run_both(g, w, states, steps, positions, seed, vocab, batch=2, tiling=Tiling(16, 32, 8, 2, 2), inputs=None,
             check=("logits",)):
    """Compile `g`, poison its state, load `states` (caches / recurrent states by name, laid out
    as the graph declares), then step both the compiled graph and run_reference and compare."""
    step = CompiledStep(g, w, batch, tiling)
    step.state.fill_(float("nan"))
    for name, value in states.items():
        step.view(name).copy_(value)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        tokens = torch.randint(0, vocab, (batch,), generator=gen).tolist()
        step.set_step(tokens, positions)
        for name, value in (inputs or {}).items():
            step.set_input(name, value)
        step.launch()
        want = run_reference(g, w, states, tokens, positions, inputs=inputs)
        for name in check:
            assert rel_err(step.view(name), want[name]) < RTOL, name
        assert step.result("token").tolist() == want["results"]["token"]
        positions = [p + 1 for p in positions]
    return step


def test_a_gemma4_style_step_equals_the_eager_graph():
    """Gemma 4's decoder pieces: a scaled embedding, per-layer inputs (a second scaled table plus a
    projection, normalised in chunks of P with one weight), post-norm residuals (add_norm) with a
    per-layer scalar, GeGLU, q/k/v head norms, attention scale 1 over a sliding window in a ring,
    a layer that reads the previous layer's K/V (q only, no append), the input gate
    gelu_tanh(x W) * ple[layer], and a logit bias that bars some tokens. 7 steps: the ring wraps."""
    g0 = torch.Generator().manual_seed(31)
    d, hq, hkv, dh, P, L, ff, vocab = 32, 2, 1, 16, 8, 2, 48, 40

    def r(*shape, s=1.0):
        return torch.randn(*shape, generator=g0) * s

    w = {"tok": r(vocab, d, s=0.3), "ple_tok": r(vocab, L * P, s=0.3), "ple_proj": r(L * P, d, s=0.1),
         "ple_norm": r(P, s=0.3), "cos": torch.cos(r(24, dh // 2)), "sin": torch.sin(r(24, dh // 2)),
         "final": r(d, s=0.3), "n0": r(d, s=0.3), "qkv0": r((hq + 2 * hkv) * dh, d, s=0.2), "qn0": r(dh, s=0.3),
         "kn0": r(dh, s=0.3), "o0": r(d, hq * dh, s=0.2), "post0": r(d, s=0.3), "m0": r(d, s=0.3),
         "gu0": r(2 * ff, d, s=0.2), "down0": r(d, ff, s=0.15), "post0b": r(d, s=0.3), "g0": r(P, d, s=0.3),
         "p0": r(d, P, s=0.3), "pn0": r(d, s=0.3), "ls0": r(1, s=0.5).abs() + 0.5,
         "n1": r(d, s=0.3), "q1": r(hq * dh, d, s=0.2), "qn1": r(dh, s=0.3), "o1": r(d, hq * dh, s=0.2),
         "post1": r(d, s=0.3)}
    g = StepGraph("gemma4ish", {k: tuple(v.shape) for k, v in w.items()})
    kc, vc = g.cache("k0", hkv, 5, dh, ring=True), g.cache("v0", hkv, 5, dh, ring=True)
    rot = Rotary("cos", "sin", dh)
    x = g.embed("x", "tok", scale=d ** 0.5)
    ple = g.add_norm("ple", g.embed("t", "ple_tok", scale=P ** 0.5), g.linear("pp", x, "ple_proj"), "ple_norm",
                     chunk=P, scale=2 ** -0.5)
    q = g.kv_append("q0", g.linear("qkv0", g.rms_norm("h0", x, "n0"), "qkv0"), kc, vc, rot, hq,
                    HeadNorm(q="qn0", k="kn0", v=True))
    x = g.add_norm("x1", x, g.linear("a0o", g.attention("a0", q, kc, vc, window=4, scale=1.0), "o0"), "post0")
    mlp = g.linear("dn0", g.glu("gl0", g.linear("gu0", g.rms_norm("h0b", x, "m0"), "gu0"), "gelu_tanh"), "down0")
    x = g.add_norm("x2", x, mlp, "post0b")
    gated = g.mul("m0g", ple, g.linear("g0", x, "g0"), act="gelu_tanh", c0=0)
    x = g.add_norm("x3", x, g.linear("p0", gated, "p0"), "pn0", scale_w="ls0")
    q = g.kv_append("q1r", g.linear("q1", g.rms_norm("h1", x, "n1"), "q1"), kc, vc, rot, hq, HeadNorm(q="qn1"),
                    append=False)
    x = g.add_norm("x4", x, g.linear("a1o", g.attention("a1", q, kc, vc, window=4, scale=1.0), "o1"), "post1")
    logits = g.linear("logits", g.rms_norm("hf", x, "final"), "tok", residual=g.input("bias", vocab))
    g.expose("logits", logits)
    g.argmax("token", logits)
    bias = torch.zeros(2, vocab)
    bias[:, 3:7] = -30.0     # barred tokens (Gemma's image/audio placeholders; finite, to compare logits)
    positions = [2, 3]
    hist = {n: r(2, hkv, 5, dh) for n in ("k0", "v0")}
    for n in hist:
        for row, p in enumerate(positions):
            hist[n][row, :, p:] = 0.0
    run_both(g, w, hist, 7, positions, 32, vocab, inputs={"bias": bias}, check=("ple", "x1", "x3", "x4", "logits"))


def test_a_moondream3_style_tau_layer_equals_the_eager_graph():
    """Moondream 3's tau attention: t = tanh(gelu(qkv) W_tau) scales each query and value head by
    t + sigmoid(alpha log(pos + 1)) + 0.5 before partial rotary and the append; a parallel block
    (one LayerNorm feeding attention and a GELU MLP)."""
    g0 = torch.Generator().manual_seed(41)
    d, heads, dh, ff, vocab = 32, 2, 16, 64, 40

    def r(*shape, s=1.0):
        return torch.randn(*shape, generator=g0) * s

    w = {"tok": r(vocab, d, s=0.5), "ln.w": 1 + r(d, s=0.1), "ln.b": r(d, s=0.1), "qkv": r(3 * d, d, s=0.2),
         "qkv.b": r(3 * d, s=0.1), "tau": r(2 * heads, 3 * d, s=0.2), "alpha": r(heads), "out": r(d, d, s=0.2),
         "fc1": r(ff, d, s=0.2), "fc2": r(d, ff, s=0.15), "cos": torch.cos(r(24, 4)), "sin": torch.sin(r(24, 4)),
         "head": r(vocab, d, s=0.2)}
    g = StepGraph("md3ish", {k: tuple(v.shape) for k, v in w.items()})
    kc, vc = g.cache("k", heads, 16, dh), g.cache("v", heads, 16, dh)
    x = g.embed("x", "tok")
    h = g.layer_norm("h", x, "ln.w", "ln.b")
    qkv = g.linear("qkv", h, "qkv", "qkv.b")
    tau = g.linear("tau", g.act("gq", qkv, "gelu"), "tau", act="tanh")
    q = g.kv_append("q", qkv, kc, vc, Rotary("cos", "sin", 8), tau=Tau(tau, "alpha"))
    mlp = g.linear("m", g.linear("u", h, "fc1", act="gelu_tanh"), "fc2", residual=x)
    x = g.linear("x1", g.attention("a", q, kc, vc), "out", residual=mlp)
    g.expose("logits", logits := g.linear("logits", x, "head"))
    g.argmax("token", logits)
    positions = [0, 4]
    hist = {n: r(2, heads, 16, dh) for n in ("k", "v")}
    for n in hist:
        for row, p in enumerate(positions):
            hist[n][row, :, p:] = 0.0
    run_both(g, w, hist, 4, positions, 42, vocab, check=("tau", "q", "logits"))
    # pruning by results keeps what the append's tau reads (a Tau holds a value, not a plain arg)
    pruned = lower(plan(g, 2, Tiling(16, 32, 8, 2, 2)), ["token"])
    assert any(task.name.startswith("tau[") for task in pruned.tasks)


@pytest.mark.parametrize("renormalize", [True, False])
def test_a_mixture_of_experts_layer_equals_the_eager_graph(renormalize):
    """Moondream 3's MoE MLP in a parallel block: the LayerNorm fused into the router and the
    expert tiles, top 3 of 8 experts per row (rows choosing apart), gelu(gate) * (up + 1),
    weighted down-projections plus the residual; the weights of experts no row chose are NaN, so
    reading one would show."""
    g0 = torch.Generator().manual_seed(51)
    d, heads, dh, E, F, k, vocab = 32, 2, 16, 8, 24, 3, 40

    def r(*shape, s=1.0):
        return torch.randn(*shape, generator=g0) * s

    w = {"tok": r(vocab, d, s=0.5), "ln.w": 1 + r(d, s=0.1), "ln.b": r(d, s=0.1), "qkv": r(3 * d, d, s=0.2),
         "out": r(d, d, s=0.2), "router": r(E, d, s=0.5), "router.b": r(E, s=0.1), "gu": r(E, 2 * F, d, s=0.2),
         "down": r(E, d, F, s=0.2), "head": r(vocab, d, s=0.2)}
    g = StepGraph("moe", {k_: tuple(v.shape) for k_, v in w.items()})
    kc, vc = g.cache("k", heads, 16, dh), g.cache("v", heads, 16, dh)
    x = g.embed("x", "tok")
    h = g.layer_norm("h", x, "ln.w", "ln.b")
    q = g.kv_append("q", g.linear("qkv", h, "qkv"), kc, vc)
    logits_e = g.linear("route", h, "router", "router.b")
    mlp = g.moe("mlp", h, logits_e, "gu", "down", k, act="gelu", up_offset=1.0, renormalize=renormalize, residual=x)
    x = g.linear("x1", g.attention("a", q, kc, vc), "out", residual=mlp)
    g.expose("logits", logits := g.linear("logits", x, "head"))
    g.argmax("token", logits)
    positions = [0, 3]
    hist = {n: r(2, heads, 16, dh) for n in ("k", "v")}
    for n in hist:
        for row, p in enumerate(positions):
            hist[n][row, :, p:] = 0.0
    step = run_both(g, w, hist, 3, positions, 52, vocab, check=("route", "mlp", "logits"))
    # Poison the experts the last step's rows did not choose, and run that step again: same result.
    from photon_core.backends import reference as ref
    chosen = set(ref.moe_route(step.view("route"), k, renormalize)[1].flatten().tolist())
    before = step.view("mlp").clone()
    for e in set(range(E)) - chosen:
        step.weight("gu")[e] = float("nan")
        step.weight("down")[e] = float("nan")
    step.set_step(step.dyn[:2].tolist(), step.dyn[2:4].tolist())   # the last step's tokens and positions
    step.launch()
    assert len(chosen) < E and torch.equal(step.view("mlp"), before)
    assert step.weight_bytes_per_step() < sum(v.numel() for v in w.values()) * 4
    # NaN router logits choose no expert: the ids stay inside the table (the NaN shows in the output)
    step.weight("router")[:] = float("nan")
    step.launch()
    ids = step.view("mlp.route")[..., 0]
    assert ((ids >= 0) & (ids < E)).all() and torch.isnan(step.view("mlp")).all()


def test_window_layers_are_checked_when_stated():
    w = hybrid_weights()
    g = StepGraph("bad-ring", {k: tuple(t.shape) for k, t in w.items()})
    kc, vc = g.cache("k", 2, 4, 16, ring=True), g.cache("v", 2, 4, 16, ring=True)
    q = g.kv_append("q", g.linear("qkv", g.embed("x", "tok"), "qkv"), kc, vc, q_heads=4)
    with pytest.raises(ValueError, match="ring of 4 positions"):
        g.attention("a", q, kc, vc, window=5)
    with pytest.raises(ValueError, match="self-attention only"):
        g.attention("a", q, kc, vc, length="cross", window=3)


def test_advance_writes_the_next_token_and_position():
    w = toy_weights()
    g = toy_graph(w, advance=True)
    step = CompiledStep(g, w, 1, Tiling(16, 32, 8, 2, 2))
    gen = torch.Generator().manual_seed(3)
    caches = fill_caches(step, 1, [0], 9, gen)
    step.set_cross_len([9])
    step.set_input("bias", torch.zeros(70))
    step.set_step([4], [0])
    tokens, positions = [4], [0]
    for _ in range(3):
        step.launch()     # no host write between launches: what a replayed CUDA graph does
        want = run_reference(g, w, caches, tokens, positions, [9], {"bias": torch.zeros(1, 70)})
        tokens, positions = want["results"]["token"], [positions[0] + 1]
        assert step.dyn[:1].tolist() == tokens and step.dyn[1:2].tolist() == positions


def test_advance_stops_a_row_at_the_end_of_its_context():
    # max_len 12: a row at position 10 may decode twice (positions 10 and 11), then its context is
    # full; the launch reports -1 for it and leaves its position, rather than write past the cache.
    w = toy_weights()
    step = CompiledStep(toy_graph(w, advance=True), w, 2, Tiling(16, 32, 8, 2, 2))
    gen = torch.Generator().manual_seed(5)
    fill_caches(step, 2, [10, 3], 9, gen)
    step.set_cross_len([9, 9])
    step.set_input("bias", torch.zeros(70))
    step.set_step([1, 2], [10, 3])
    step.launch()
    assert step.dyn[2:4].tolist() == [11, 4] and min(step.result("token").tolist()) >= 0
    step.launch()
    assert step.result("token").tolist()[0] == -1 and step.dyn[2:4].tolist() == [11, 5]
    assert step.result("token").tolist()[1] >= 0


def test_pruned_step_runs_only_what_its_results_need():
    w = toy_weights()
    p = plan(toy_graph(w, expose=False), 2, Tiling(16, 32, 8, 2, 2))
    full, side = lower(p), lower(p, ["left"])
    check(side)
    names = {t.name.split("[")[0] for t in side.tasks}
    assert {"side", "argmax.left", "x1", "a.part"} <= names
    assert not names & {"logits", "c.part", "cq", "argmax.token", "argmax.right"}
    assert len(side.tasks) < len(full.tasks)
    # An exposed value is computed whatever the results asked for.
    exposed = plan(toy_graph(w), 2, Tiling(16, 32, 8, 2, 2))
    assert any(t.name.startswith("logits[") for t in lower(exposed, ["left"]).tasks)
    with pytest.raises(KeyError, match="no results"):
        lower(p, ["nope"])


def test_graphs_the_megakernel_cannot_run_are_refused():
    w = toy_weights()
    g = StepGraph("bad-norm", {k: tuple(t.shape) for k, t in w.items()})
    x = g.embed("x", "tok", "pos")
    h = g.layer_norm("h", x, "ln.w", "ln.b")
    g.linear("y", x, "out", residual=h)          # a norm read as a residual cannot be fused
    with pytest.raises(ValueError, match="fused LayerNorm"):
        plan(g, 1)
    g = StepGraph("bad-argmax", {k: tuple(t.shape) for k, t in w.items()})
    side = g.linear("side", g.embed("x", "tok"), "side")
    g.argmax("a", side, 0, 20)                  # 20 is not on a 32-column tile
    with pytest.raises(ValueError, match="tiles"):
        plan(g, 1, Tiling(block_n=32))
    with pytest.raises(ValueError, match="bucket"):
        plan(toy_graph(w), 3)
    g = StepGraph("shared-weight", {k: tuple(t.shape) for k, t in w.items()})
    x = g.embed("x", "tok", "pos")
    g.linear("y", g.rms_norm("h", x, "ln.w", 1e-5, offset=1.0), "out")
    g.linear("z", g.layer_norm("h2", x, "ln.w", eps=1e-5), "out")   # the stored (1 + w) would be wrong here
    with pytest.raises(ValueError, match=r"RMSNorm's \(offset \+ w\) and also read by layer_norm"):
        plan(g, 1)
    g = StepGraph("glu-as-residual", {"tok": (70, 96), "w": (48, 48), "v": (48, 48)})
    gated = g.glu("g", g.embed("x", "tok"), "silu")
    g.linear("y", g.linear("u", gated, "w"), "v", residual=gated)   # a GLU is fused into loads only
    with pytest.raises(ValueError, match="fused GLU"):
        plan(g, 1)
    with pytest.raises(ValueError, match="takes 48 features"):
        StepGraph("bad-shape", {"a": (4, 48), "b": (4, 5)}).linear("y", Value_of(5), "a")


def Value_of(width):
    from photon_core.megakernel.stepgraph import Value
    return Value("v", width)


def test_megakernel_imports_no_model_code():
    root = Path(__file__).resolve().parents[1] / "photon_core" / "megakernel"
    for path in root.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else \
                [a.name for a in node.names] if isinstance(node, ast.Import) else []
            assert not any(n.startswith("photon_core.models") for n in names), f"{path.name} imports {names}"
