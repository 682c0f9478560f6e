"""FP8 experts, bf16 KV caches and lookup tables read in place in the compiled step: the e4m3 byte decode against torch for
every byte; a mixture-of-experts layer whose experts stay FP8 bytes in the arena (scaled per row
after the K loop) equals run_reference's dequantized math, in fp32 and bf16 weight arenas; KV
caches stored in bf16 equal run_reference over bf16 caches (the same rounding) and stay within a
stated tolerance of fp32 caches."""
import os

os.environ["TRITON_INTERPRET"] = "1"  # must precede the first import of triton

import math  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from photon_core.megakernel import CompiledStep, Rotary, StepGraph, Tiling, run_reference  # noqa: E402
from photon_core.megakernel.compiler import plan  # noqa: E402
from photon_core.kernels.fp8 import fp8_e4m3_over_256  # noqa: E402
from photon_core.megakernel.kernel import bf16_rne  # noqa: E402
from photon_core.megakernel.memory import step_memory  # noqa: E402

RTOL = 1e-4
TILING = Tiling(16, 32, 8, 2, 2)


def rel_err(a, b):
    assert torch.isfinite(a).all()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


@triton.jit
def _decode_bytes(b_ptr, out_ptr):
    i = tl.arange(0, 256)
    tl.store(out_ptr + i, fp8_e4m3_over_256(tl.load(b_ptr + i)) * 256.0)


def test_fp8_byte_decode_matches_torch_for_every_byte():
    decode = _decode_bytes
    b = torch.arange(256, dtype=torch.uint8)
    out = torch.empty(256)
    decode[(1,)](b, out)
    want = b.view(torch.float8_e4m3fn).float()
    finite = ~want.isnan()
    assert finite.sum() == 254     # 0x7F and 0xFF are e4m3fn's NaNs
    assert torch.equal(out[finite], want[finite])
    assert out[0x80].item() == 0.0 and math.copysign(1, out[0x80].item()) == -1   # -0 keeps its sign
    assert out[1].item() == 2.0 ** -9 and out[0x7E].item() == 448.0    # smallest subnormal, largest normal


@triton.jit
def _round_bf16(x_ptr, out_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(out_ptr + i, bf16_rne(tl.load(x_ptr + i)))


def test_bf16_rounding_is_torchs_round_to_nearest_even():
    """The kernel's fp32 -> bf16 (the interpreter's own conversion truncates; the GPU's rounds):
    ties to even, carries into the exponent, overflow to inf, NaN kept, random values."""
    special = torch.tensor([1 + 2 ** -8, 1 + 3 * 2 ** -8, 1 + 2 ** -8 + 2 ** -20, -(1 + 2 ** -8), 3.3895e38,
                            float("inf"), float("-inf"), 0.0, -0.0, 1e-40, float("nan")])
    x = torch.cat([special, torch.randn(1024 - len(special), generator=torch.Generator().manual_seed(3)) * 100])
    out = torch.empty(1024, dtype=torch.bfloat16)
    _round_bf16[(1,)](x, out, N=1024)
    want = x.to(torch.bfloat16)
    assert out[10].isnan() and torch.equal(torch.cat([out[:10], out[11:]]), torch.cat([want[:10], want[11:]]))


def fp8_experts(E, rows, cols, gen):
    """Random FP8 expert table [E, rows, cols] and per-row scales [E, rows], as checkpoints ship."""
    w = torch.randn(E, rows, cols, generator=gen)
    scale = w.abs().amax(-1) / 448.0 * (0.5 + torch.rand(E, rows, generator=gen))
    return (w / scale[..., None]).clamp(-448, 448).to(torch.float8_e4m3fn), scale


def moe_case(seed=61):
    g0 = torch.Generator().manual_seed(seed)
    d, heads, dh, E, F, k, vocab = 32, 2, 16, 8, 24, 3, 40

    def r(*shape, s=1.0):
        return torch.randn(*shape, generator=g0) * s

    gu, gus = fp8_experts(E, 2 * F, d, g0)
    dn, dns = fp8_experts(E, d, F, g0)
    w = {"tok": r(vocab, d, s=0.5), "ln.w": 1 + r(d, s=0.1), "ln.b": r(d, s=0.1), "qkv": r(3 * d, d, s=0.2),
         "out": r(d, d, s=0.2), "router": r(E, d, s=0.5), "router.b": r(E, s=0.1), "gu": gu, "gu.s": gus * 0.2,
         "down": dn, "down.s": dns * 0.2, "head": r(vocab, d, s=0.2)}
    g = StepGraph("moe-fp8", {k_: tuple(v.shape) for k_, v in w.items()})
    kc, vc = g.cache("k", heads, 16, dh), g.cache("v", heads, 16, dh)
    x = g.embed("x", "tok")
    h = g.layer_norm("h", x, "ln.w", "ln.b")
    q = g.kv_append("q", g.linear("qkv", h, "qkv"), kc, vc)
    logits_e = g.linear("route", h, "router", "router.b")
    mlp = g.moe("mlp", h, logits_e, "gu", "down", k, act="gelu", up_offset=1.0, residual=x,
                gate_up_scale="gu.s", down_scale="down.s")
    x = g.linear("x1", g.attention("a", q, kc, vc), "out", residual=mlp)
    g.expose("logits", logits := g.linear("logits", x, "head"))
    g.argmax("token", logits)
    hist = {n: r(2, heads, 16, dh) for n in ("k", "v")}
    return g, w, hist, dict(E=E, F=F, d=d, k=k, vocab=vocab)


@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
def test_fp8_experts_stay_fp8_and_equal_the_dequantized_reference(weight_dtype):
    """Experts are stored as their bytes (1 byte a weight) next to fp32 scales, also inside a bf16
    arena; the compiled step on NaN-poisoned state equals run_reference (which dequantizes
    w.float() * scale) step after step; experts no row chose are never read (their bytes set
    to 448, the largest e4m3, change nothing); the step's bytes count FP8 experts at 1 byte."""
    g, w, hist, c = moe_case()
    positions = [0, 3]
    for n in hist:
        for row, p in enumerate(positions):
            hist[n][row, :, p:] = 0.0
    step = CompiledStep(g, w, 2, TILING, weight_dtype=weight_dtype)
    unit = weight_dtype.itemsize
    # megakernel.memory counts, from the graph alone, exactly what the step allocated
    mem = step_memory(g, 2, TILING, weight_dtype, torch.float32, external=())
    assert sum(v for k, v in mem.items() if k.startswith("weights")) == step.weights.numel() * unit
    assert mem["weights fp8"] == sum(math.prod(w[k].shape[:-1]) * 32 for k in ("gu", "down"))
    assert mem["kv caches"] + mem["states"] + mem["values"] == step.state.numel() * 4
    assert mem["task table"] == step.kernel.tasks.numel() * 8
    # bytes, not converted: the arena region of an FP8 table is its byte count in arena units
    assert step.warena.dtypes["gu"] == torch.uint8 and step.weight("gu.s").dtype == torch.float32
    assert torch.equal(step.weight("gu").view(torch.uint8), w["gu"].view(torch.uint8))
    assert torch.equal(step.weight("down.s"), w["down.s"])     # scales exact, even in a bf16 arena
    assert step.warena.regions["gu"][1] * unit == math.prod(w["gu"].shape[:-1]) * 32   # rows padded to 32 bytes
    # the reference sees the weights the arena holds: bf16-rounded dense weights, exact FP8 + scales
    ref_w = {k: (v if v.dtype == torch.float8_e4m3fn or k.endswith(".s") else v.to(weight_dtype).float())
             for k, v in w.items()}
    step.state.fill_(float("nan"))
    for name, value in hist.items():
        step.view(name).copy_(value)
    gen = torch.Generator().manual_seed(62)
    for _ in range(3):
        tokens = torch.randint(0, c["vocab"], (2,), generator=gen).tolist()
        step.set_step(tokens, positions)
        step.launch()
        want = run_reference(g, ref_w, hist, tokens, positions)
        for name in ("route", "mlp", "logits"):
            assert rel_err(step.view(name), want[name]) < RTOL, name
        assert step.result("token").tolist() == want["results"]["token"]
        positions = [p + 1 for p in positions]
    from photon_core.backends import reference as ref
    chosen = set(ref.moe_route(step.view("route"), c["k"], True)[1].flatten().tolist())
    before = step.view("mlp").clone()
    for e in set(range(c["E"])) - chosen:
        step.weight("gu")[e].view(torch.uint8).fill_(0x7E)
        step.weight("down")[e].view(torch.uint8).fill_(0x7E)
    step.set_step(step.dyn[:2].tolist(), step.dyn[2:4].tolist())
    step.launch()
    assert len(chosen) < c["E"] and torch.equal(step.view("mlp"), before)
    # bytes per step: dense weights at the arena's size, the distinct experts the rows choose at 1
    # byte a weight plus their rows' fp32 scales (batch 2, uniform routing: E(1 - (1 - k/E)^2)
    # expected, each read once however many rows chose it); what this step read, by the kernel's count
    E, F, d, k = c["E"], c["F"], c["d"], c["k"]
    dense = sum(v.numel() for n, v in w.items() if n not in ("gu", "gu.s", "down", "down.s", "tok")) + d
    per_expert = 2 * F * d + d * F + 4 * (2 * F + d)
    assert step.weight_bytes_per_step() == round(dense * unit + E * (1 - (1 - k / E) ** 2) * per_expert)
    assert step.expert_bytes_read() == {"mlp": len(chosen) * per_expert}


def test_fp8_experts_must_come_as_fp8():
    g, w, _, _ = moe_case()
    w = dict(w, gu=w["gu"].float())
    with pytest.raises(ValueError, match="FP8 expert table"):
        CompiledStep(g, w, 2, TILING)
    with pytest.raises(ValueError, match="both scales"):
        g.moe("m2", g.values["h"], g.values["route"], "gu", "down", 2, gate_up_scale="gu.s")


# ---------------------------------------------------------------------------------------------------
# KV caches in bf16


def kv_case(seed=71):
    """Two layers: equal q/k/v heads without rotary (the linear stores k, v into the caches
    itself) and grouped-query heads with partial rotary over a sliding-window ring cache
    (append tasks), so every cache store and read path of the kernel runs."""
    g0 = torch.Generator().manual_seed(seed)
    d, dh, vocab, T, ring = 32, 8, 40, 16, 6

    def r(*shape, s=1.0):
        return torch.randn(*shape, generator=g0) * s

    w = {"tok": r(vocab, d, s=0.5), "n0": 1 + r(d, s=0.1), "qkv0": r(3 * d, d, s=0.3), "o0": r(d, d, s=0.2),
         "n1": 1 + r(d, s=0.1), "qkv1": r(d + 2 * 2 * dh, d, s=0.3), "o1": r(d, d, s=0.2),
         "cos": torch.cos(r(T, 2)), "sin": torch.sin(r(T, 2)), "head": r(vocab, d, s=0.3)}
    g = StepGraph("kv", {k: tuple(v.shape) for k, v in w.items()})
    k0, v0 = g.cache("k0", 4, T, dh), g.cache("v0", 4, T, dh)
    k1, v1 = g.cache("k1", 2, ring, dh, ring=True), g.cache("v1", 2, ring, dh, ring=True)
    x = g.embed("x", "tok")
    q = g.kv_append("q0", g.linear("qkv0", g.rms_norm("h0", x, "n0"), "qkv0"), k0, v0)
    x = g.linear("x1", g.attention("a0", q, k0, v0), "o0", residual=x)
    q = g.kv_append("q1", g.linear("qkv1", g.rms_norm("h1", x, "n1"), "qkv1"), k1, v1, Rotary("cos", "sin", 4),
                    q_heads=4)
    x = g.linear("x2", g.attention("a1", q, k1, v1, window=5), "o1", residual=x)
    g.expose("logits", logits := g.linear("logits", x, "head"))
    g.argmax("token", logits)
    hist = {n: r(2, g.caches[n].heads, g.caches[n].length, dh) for n in g.caches}
    return g, w, hist, vocab


def test_bf16_kv_caches_equal_the_reference_with_the_same_rounding():
    """kv_dtype=bf16: the caches are bf16 views (half the bytes), the kernel's stores round to
    bf16 and its attention reads convert to fp32, exactly as run_reference over bf16 caches; 6
    steps so the ring (6 slots) wraps for both rows (row 0's at its 5th step); against fp32 caches
    the logits stay within 2e-2 relative."""
    g, w, hist, vocab = kv_case()
    positions = [2, 5]
    for n in ("k0", "v0"):
        for row, p in enumerate(positions):
            hist[n][row, :, p:] = 0.0
    p32 = plan(g, 2, TILING)
    p16 = plan(g, 2, TILING, kv_dtype=torch.bfloat16)
    cache_units = sum(math.prod(p32.shapes[n]) for n in g.caches)
    assert p32.sarena.size - p16.sarena.size >= cache_units // 2 - 16 * len(g.caches)
    step = CompiledStep(g, w, 2, TILING, kv_dtype=torch.bfloat16)
    step32 = CompiledStep(g, w, 2, TILING, kv_dtype=torch.float32)
    bf = {n: t.to(torch.bfloat16) for n, t in hist.items()}
    f32 = {n: t.clone() for n, t in hist.items()}
    for s in (step, step32):
        s.state.fill_(float("nan"))
        for n, t in hist.items():
            assert s.view(n).dtype == s.plan.kv_dtype
            s.view(n).copy_(t)
    gen = torch.Generator().manual_seed(72)
    for _ in range(6):
        tokens = torch.randint(0, vocab, (2,), generator=gen).tolist()
        for s in (step, step32):
            s.set_step(tokens, positions)
            s.launch()
        want = run_reference(g, w, bf, tokens, positions)
        for name in ("x1", "q1", "logits"):
            assert rel_err(step.view(name), want[name]) < RTOL, name
        for n in g.caches:
            assert torch.equal(step.view(n), bf[n]), n      # bit-equal bf16 caches, poisoned slots aside
        assert step.result("token").tolist() == want["results"]["token"]
        want32 = run_reference(g, w, f32, tokens, positions)
        assert rel_err(step32.view("logits"), want32["logits"]) < RTOL
        assert rel_err(step.view("logits"), want32["logits"]) < 2e-2
        positions = [p + 1 for p in positions]


# ---------------------------------------------------------------------------------------------------
# Tables only looked up stay the caller's


def test_lookup_only_tables_are_read_in_place():
    """A per-layer-input style table that only an embed reads, named in read_in_place, is not copied
    into the arena: the step reads the caller's tensor (a write to it shows in the next step), equal
    to run_reference; a table also read as a tied LM head, or held in another dtype, is refused."""
    g0 = torch.Generator().manual_seed(81)
    d, vocab = 32, 40
    w = {"tok": torch.randn(vocab, d, generator=g0) * 0.3, "ple": torch.randn(vocab, 3 * d, generator=g0) * 0.3,
         "proj": torch.randn(d, 3 * d, generator=g0) * 0.2, "n": 1 + torch.randn(d, generator=g0) * 0.1}
    g = StepGraph("lookup", {k: tuple(v.shape) for k, v in w.items()})
    x = g.embed("x", "tok")
    t = g.embed("t", "ple", scale=2.0)
    y = g.linear("y", t, "proj", residual=x)
    g.expose("logits", logits := g.linear("logits", g.rms_norm("h", y, "n"), "tok"))
    g.argmax("token", logits)
    step = CompiledStep(g, w, 2, TILING, read_in_place=["ple"])
    assert "ple" not in step.warena.regions and "tok" in step.warena.regions
    assert step.weight("ple").data_ptr() == w["ple"].data_ptr()
    assert step_memory(g, 2, TILING, torch.float32, torch.float32, external=["ple"])["weights fp32"] == \
        step.weights.numel() * 4
    gen = torch.Generator().manual_seed(82)
    for i in range(3):
        tokens = torch.randint(0, vocab, (2,), generator=gen).tolist()
        if i == 2:
            w["ple"][tokens[0]] += 1.0       # the caller's tensor is what the step reads
        step.set_step(tokens, [i, i + 1])
        step.launch()
        want = run_reference(g, w, {}, tokens, [i, i + 1])
        for name in ("t", "y", "logits"):
            assert rel_err(step.view(name), want[name]) < RTOL, name
    assert "ple" in CompiledStep(g, w, 2, TILING).warena.regions      # copied unless asked
    for bad in (dict(w, ple=w["ple"].double()), dict(w, ple=w["ple"].T.contiguous().T)):
        with pytest.raises(ValueError, match="read in place"):
            CompiledStep(g, bad, 2, TILING, read_in_place=["ple"])
    with pytest.raises(ValueError, match="read in place"):
        CompiledStep(g, w, 2, TILING, read_in_place=["tok"])      # the tied LM head reads it too


@pytest.mark.parametrize("batch,variant", [(1, "wide512+aligned"), (4, "unroll8+aligned"), (2, "plain")])
@pytest.mark.parametrize("fp8", [True, False])
def test_the_streaming_builds_stream_experts_over_several_steps(fp8, batch, variant):
    """The streaming builds (what backend auto times: wide512+aligned at batch 1, unroll8+aligned
    above) run the expert tasks' K loop in wide steps (kernel.expert_loop: the tuning's bytes of an
    expert row a step at the batch; FP8 loaded as two halves before either is decoded), each step
    reduced by the rows that chose the expert in a loop over the rows (the others are skipped,
    which the values cannot show: their stores are masked either way). K spans several steps and
    ends inside one at every step width the tables hold (D = 592 = 512 + 80: two steps of 512, and
    at 128 and 256 more, the last one's first half partly past K; F = 432: the down task's last half
    partial), bf16 arena, rows choosing 2 of 8
    experts (at batch 4 some expert by several rows): the MoE output equals run_reference's (the
    plain build's is held to it above); the experts no row chose are NaN (16-bit) or 448 (FP8) and
    change nothing. Each expert task spans 4 column tiles (Tiling.expert_span, the last span
    partial), one after another (one tile a task: the every-family test in test_megakernel_variants);
    the plain build's K loop over the spans too, at batch 2."""
    from photon_core.backends import reference as ref
    from photon_core.megakernel.kernel import XTILES, KernelVariant, expert_loop
    g0 = torch.Generator().manual_seed(71)
    d, E, F, k, vocab = 592, 8, 432, 2, 40

    def r(*shape, s=1.0):
        return torch.randn(*shape, generator=g0) * s
    w = {"tok": r(vocab, d, s=0.5), "ln.w": 1 + r(d, s=0.1), "ln.b": r(d, s=0.1), "router": r(E, d, s=0.5),
         "head": r(vocab, d, s=0.05)}
    if fp8:
        w["gu"], gus = fp8_experts(E, 2 * F, d, g0)
        w["down"], dns = fp8_experts(E, d, F, g0)
        w["gu.s"], w["down.s"] = gus * 0.05, dns * 0.05
    else:
        w["gu"], w["down"] = r(E, 2 * F, d, s=0.03), r(E, d, F, s=0.04)
    g = StepGraph("moe-wide", {k_: tuple(v.shape) for k_, v in w.items()})
    x = g.embed("x", "tok")
    h = g.layer_norm("h", x, "ln.w", "ln.b")
    mlp = g.moe("mlp", h, g.linear("route", h, "router"), "gu", "down", k, act="gelu", up_offset=1.0, residual=x,
                **(dict(gate_up_scale="gu.s", down_scale="down.s") if fp8 else {}))
    g.expose("logits", logits := g.linear("logits", mlp, "head"))
    g.argmax("token", logits)
    # every expert task 4 tiles of its pair however few pairs (F's 14 tiles: 4 + 4 + 4 + 2, the last
    # partial; D's 19: 4 x 4 + 3): the build that loops over them (kernel.XTILES)
    step = CompiledStep(g, w, batch, Tiling(expert_span=4, expert_min_tasks=0), weight_dtype=torch.bfloat16)
    ref_w = {k_: (v if v.dtype == torch.float8_e4m3fn or k_.endswith(".s") else v.to(torch.bfloat16).float())
             for k_, v in w.items()}
    tokens, positions = [7, 3, 11, 20][:batch], [0] * batch
    step.set_step(tokens, positions)
    want = run_reference(g, ref_w, {}, tokens, positions)
    picks = ref.moe_route(want["route"], k, True)[1]
    chosen = set(picks.flatten().tolist())
    for e in set(range(E)) - chosen:
        if fp8:
            step.weight("gu")[e].view(torch.uint8).fill_(0x7E)
            step.weight("down")[e].view(torch.uint8).fill_(0x7E)
        else:
            step.weight("gu")[e] = float("nan")
            step.weight("down")[e] = float("nan")
    step.set_engine("megakernel", variant)
    kern = step.kernel_for(None)
    assert kern.variant.name() == variant
    table = kern.tuning.fp8_expert_bytes if fp8 else kern.tuning.expert_bytes
    wide = table[batch.bit_length() - 1] // (1 if fp8 else 2)
    if variant == "plain":   # the plain K loop (one tile in flight a trip) over the spans
        assert kern.expert_loop() == XTILES
    else:
        assert wide >= 16 and kern.expert_loop() == KernelVariant(wide=wide, aligned=True).loop + XTILES
    assert expert_loop(KernelVariant(), kern.meta["BLOCK_M"], 1, kern.tuning) == 0     # the plain build's plain loop
    from photon_core.megakernel.ops import OP_MOE_DOWN, OP_MOE_UP
    widths = {op: sorted({t.args["n1"] - t.args["n0"] for t in step.graph.tasks if t.op == op})
              for op in (OP_MOE_UP, OP_MOE_DOWN)}
    assert widths == {OP_MOE_UP: [F % 128, 128], OP_MOE_DOWN: [d % 128, 128]}
    step.launch()
    assert len(chosen) < E and rel_err(step.view("mlp"), want["mlp"]) < RTOL
    if batch > 2:   # some expert's tile reduced by several rows, others skipped (at batch 4)
        assert max(int((picks == e).any(dim=1).sum()) for e in chosen) > 1
