"""Batched rows sharing experts read them once: a compiled mixture-of-experts layer at batch 4 (and 1),
with router logits forced so that the rows share some, all or none of their experts, equals
run_reference on NaN-poisoned state, for float and FP8 experts in fp32 and bf16 weight arenas; and
the kernel's own record of the expert weight elements each task loaded shows every chosen expert
read exactly once per step (distinct experts x expert bytes, not rows x top-k), loaded only by the
batch's first (row, slot) pair choosing it: a non-first pair's task that still computed would
leave a nonzero record."""
import os

os.environ["TRITON_INTERPRET"] = "1"  # must precede the first import of triton

import math  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from photon_core.megakernel import CompiledStep, StepGraph, Tiling, run_reference  # noqa: E402
from photon_core.megakernel.ops import OP_MOE_DOWN, OP_MOE_SUM, OP_MOE_UP  # noqa: E402
from photon_core.megakernel.stepgraph import expected_experts  # noqa: E402

RTOL = 1e-4
E, F, D, K, VOCAB = 8, 16, 32, 2, 20
TILING = Tiling(block_n=16, block_k=32, block_t=8, self_splits=1, cross_splits=1)
# expert tasks of 4 tiles however few pairs (expert_min_tasks 0), 8 columns a tile: F's 2 tiles one
# up task, D's 4 one down task, the kernel's tile loop (kernel.XTILES)
SPANS = {"one tile": TILING, "spans": Tiling(8, 32, 8, 1, 1, expert_span=4, expert_min_tasks=0)}
# Each row's chosen experts, in slot order (the forced logits make them the top k, in this order).
ROUTINGS = {
    "some": [[0, 1], [1, 2], [3, 4], [4, 0]],    # 5 distinct experts of 8 pairs
    "all": [[5, 2], [2, 5], [5, 2], [2, 5]],     # 2 distinct: every row the same two, slots swapped
    "none": [[0, 1], [2, 3], [4, 5], [6, 7]],    # 8 distinct: nothing shared
    "one row": [[6, 3]],
}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    assert torch.isfinite(a).all()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def moe_weights(fp8: bool, seed: int = 5) -> dict[str, torch.Tensor]:
    g0 = torch.Generator().manual_seed(seed)
    w = {"tok": torch.randn(VOCAB, D, generator=g0) * 0.5, "ln.w": 1 + torch.randn(D, generator=g0) * 0.1,
         "ln.b": torch.randn(D, generator=g0) * 0.1}
    for name, shape in (("gu", (E, 2 * F, D)), ("down", (E, D, F))):
        t = torch.randn(*shape, generator=g0) * 0.3
        if fp8:   # per-output-row scales, as checkpoints ship them
            scale = t.abs().amax(-1) / 448.0 * (0.5 + torch.rand(shape[:2], generator=g0))
            w[name], w[f"{name}.s"] = (t / scale[..., None]).clamp(-448, 448).to(torch.float8_e4m3fn), scale
        else:
            w[name] = t
    return w


def moe_graph(w: dict[str, torch.Tensor], fp8: bool) -> StepGraph:
    """Embedding -> LayerNorm fused into the experts -> MoE (+ residual); the router logits are an
    input, so each test picks every row's experts."""
    g = StepGraph("moe-shared", {k: tuple(v.shape) for k, v in w.items()})
    x = g.embed("x", "tok")
    h = g.layer_norm("h", x, "ln.w", "ln.b")
    logits = g.input("logits", E)
    g.expose("mlp", g.moe("mlp", h, logits, "gu", "down", K, act="silu", residual=x,
                          gate_up_scale="gu.s" if fp8 else None, down_scale="down.s" if fp8 else None))
    return g


def forced_logits(routing: list[list[int]], gen: torch.Generator) -> torch.Tensor:
    """Logits whose top k per row are the row's experts in the given order, well apart from the rest."""
    lg = torch.rand(len(routing), E, generator=gen) - 4.0
    for r, chosen in enumerate(routing):
        for s, e in enumerate(chosen):
            lg[r, e] = 2.0 - s + 0.5 * torch.rand((), generator=gen)
    return lg


def first_pairs(routing: list[list[int]]) -> set[int]:
    """Pairs j = row * k + slot that are the first (lowest j) to choose their expert."""
    seen, firsts = set(), set()
    for j, e in enumerate(e for row in routing for e in row):
        if e not in seen:
            seen.add(e)
            firsts.add(j)
    return firsts


def expert_bytes(fp8: bool, unit: int) -> int:
    """One expert's gate|up and down weights (+ FP8 row scales) as the step streams them."""
    weights = 3 * F * D
    return weights + 4 * (2 * F + D) if fp8 else weights * unit


@pytest.mark.parametrize("tiling", SPANS)
@pytest.mark.parametrize("fp8", [False, True], ids=["float", "fp8"])
@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_rows_sharing_experts_read_them_once(fp8, weight_dtype, tiling):
    tiling = SPANS[tiling]
    w = moe_weights(fp8)
    g = moe_graph(w, fp8)
    ref_w = {k: (v if v.dtype == torch.float8_e4m3fn or k.endswith(".s") else v.to(weight_dtype).float())
             for k, v in w.items()}
    unit = weight_dtype.itemsize
    gen = torch.Generator().manual_seed(11)
    for batch, names in ((4, ("some", "all", "none")), (1, ("one row",))):
        step = CompiledStep(g, w, batch, tiling, weight_dtype=weight_dtype)
        tasks = step.graph.tasks
        # one expert task per (pair, span of expert_span tiles): B*k pairs, whatever the routing
        span = tiling.block_n * tiling.expert_span
        assert sum(t.op == OP_MOE_UP for t in tasks) == batch * K * -(-F // span)
        assert sum(t.op == OP_MOE_DOWN for t in tasks) == batch * K * -(-D // span)
        assert step.kernel_for(None).expert_tiles == (tiling.expert_span > 1)
        assert sum(t.op == OP_MOE_SUM for t in tasks) == batch * -(-D // tiling.block_n)
        for name in names:
            routing = ROUTINGS[name]
            lg = forced_logits(routing, gen)
            tokens = torch.randint(0, VOCAB, (batch,), generator=gen).tolist()
            step.state.fill_(float("nan"))     # stale data anywhere would show
            step.set_step(tokens, [0] * batch)
            step.set_input("logits", lg)
            step.launch()
            want = run_reference(g, ref_w, {}, tokens, [0] * batch, inputs={"logits": lg})
            ids = step.view("mlp.route")[..., 0]
            assert ids.tolist() == [[float(e) for e in row] for row in routing], name
            assert rel_err(step.view("mlp"), want["mlp"]) < RTOL, name
            distinct = len({e for row in routing for e in row})
            # the kernel's own count: every chosen expert's bytes once, not once per pair
            read = step.expert_bytes_read()["mlp"]
            assert read == distinct * expert_bytes(fp8, unit), (name, read)
            if name in ("some", "all"):
                assert read < batch * K * expert_bytes(fp8, unit)
            # ... loaded by the first pair choosing each expert only: every task of a pair that
            # is not first recorded no load (it exited before touching the weights)
            loads = step.view("mlp.loads")
            firsts = first_pairs(routing)
            for j in range(batch * K):
                assert bool((loads[j] > 0).all()) if j in firsts else bool((loads[j] == 0).all()), (name, j)
            # the task table agrees: the first pairs' tiles cover each chosen expert's rows exactly once
            covered: dict[tuple[int, int], list[tuple[int, int]]] = {}
            for t in tasks:
                if t.op in (OP_MOE_UP, OP_MOE_DOWN) and t.args["tile"] in firsts:
                    key = (int(ids.flatten()[t.args["tile"]]), t.op)
                    covered.setdefault(key, []).append((t.args["n0"], t.args["n1"]))
            assert len(covered) == 2 * distinct
            for (_, op), spans in covered.items():
                ends = [0] + [n1 for _, n1 in sorted(spans)]
                assert [n0 for n0, _ in sorted(spans)] == ends[:-1] and ends[-1] == (F if op == OP_MOE_UP else D)


def test_expert_tasks_span_several_tiles_while_the_stage_keeps_enough_tasks():
    """Tiling.expert_span: a pair's expert tasks cover its columns in contiguous ranges of up to
    expert_span tiles, halved while the stage (pairs x ranges) would have fewer tasks than
    expert_min_tasks: Moondream 3.1's shapes (F 1024, D 2048, top 8, 32-column tiles) at batch 1
    take 2 tiles an up task (128 tasks) and 4 a down task; at batch 8 4 each."""
    from photon_core.megakernel.ops.moe import expert_spans
    t = Tiling(expert_span=4)

    def widths(n, pairs, tiling=t):
        spans = expert_spans(n, pairs, tiling)
        assert spans[0][0] == 0 and spans[-1][1] == n and all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
        return {b - a for a, b in spans}
    assert (widths(1024, 8), widths(2048, 8)) == ({64}, {128})
    assert (widths(1024, 64), widths(2048, 64)) == ({128}, {128})
    assert widths(1024, 1) == {32}                       # one pair: every tile its own task
    assert widths(432, 2, Tiling(expert_span=4, expert_min_tasks=0)) == {128, 48}
    assert widths(1024, 64, Tiling()) == {32}            # the default: one tile a task


@pytest.mark.parametrize("tiling", SPANS)
def test_experts_normalize_a_host_input_themselves(tiling):
    """x from the host (no producer stage to write its rows' norm statistics, lnst = -1): the expert
    tasks compute the LayerNorm's statistics themselves, the span tasks once for all their tiles
    (kernel._norm_stats before the tile loop), and the layer equals run_reference's."""
    w = moe_weights(fp8=False)
    g = StepGraph("moe-host-x", {k: tuple(v.shape) for k, v in w.items()})
    h = g.layer_norm("h", g.input("x", D), "ln.w", "ln.b")
    g.expose("mlp", g.moe("mlp", h, g.input("logits", E), "gu", "down", K, act="silu"))
    gen = torch.Generator().manual_seed(23)
    routing = ROUTINGS["some"][:2]
    xs, lg = torch.randn(2, D, generator=gen) * 2 + 0.5, forced_logits(routing, gen)
    step = CompiledStep(g, w, 2, SPANS[tiling])
    assert all(t.args.get("lnst", -1) < 0 for t in step.graph.tasks if t.op == OP_MOE_UP)
    step.state.fill_(float("nan"))
    step.set_step([0, 0], [0, 0])
    step.set_input("x", xs)
    step.set_input("logits", lg)
    step.launch()
    want = run_reference(g, w, {}, [0, 0], [0, 0], inputs={"x": xs, "logits": lg})
    assert rel_err(step.view("mlp"), want["mlp"]) < RTOL


def test_expected_expert_bytes_under_uniform_routing():
    """The bytes model (stepgraph.weight_bytes, bench/roofline.py): one row reads its top k; B rows
    the expected distinct count E(1-(1-k/E)^B), which a Monte Carlo of uniform top-k routing
    matches, and which stays between k and min(E, B*k)."""
    w = moe_weights(fp8=True)
    g = moe_graph(w, fp8=True)
    dense = 3 * D * 4    # one looked-up token row + the LayerNorm's weight and bias, fp32
    for rows in (1, 2, 4, 8):
        want = expected_experts(E, K, rows)
        assert K <= want <= min(E, rows * K)
        assert g.weight_bytes(4, rows=rows) == round(dense + want * expert_bytes(True, 1))
        gen = torch.Generator().manual_seed(rows)
        draws = torch.rand(4000, rows, E, generator=gen).topk(K, dim=-1).indices
        seen = torch.zeros(4000, E, dtype=torch.bool).scatter_(1, draws.flatten(1), True)
        assert abs(seen.sum(1).float().mean().item() - want) < 0.05 * want
    assert expected_experts(E, K, 1) == K and math.isclose(expected_experts(64, 8, 8), 64 * (1 - (7 / 8) ** 8))
