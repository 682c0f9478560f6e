"""The megakernel cost model reproduces the eight decode steps the first GPU run measured (H200,
Triton 3.6) within 15%, from the task graphs alone (lowered on meta tensors: no weights, no GPU),
and responds to what it models: more tiles in flight, fewer programs."""
from __future__ import annotations

import os
import sys
from dataclasses import replace
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"  # must precede the first import of triton (the kernels it defines)

import pytest  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import cost_model as bench  # noqa: E402

from photon_core.megakernel import cost_model as cm  # noqa: E402


@pytest.fixture(scope="module")
def graphs():
    return bench.graphs()


@pytest.fixture(scope="module")
def today():
    """The graphs at today's Tiling() (the run's: bench.measured_tiling)."""
    from photon_core.megakernel import Tiling
    return bench.graphs(Tiling())


def test_the_model_reproduces_the_measured_steps(graphs):
    got = bench.predict(cm.FITTED, graphs)
    off = {k: got[k] / us - 1 for k, us in cm.MEASURED_US.items()}
    assert all(abs(e) <= 0.15 for e in off.values()), off


def test_the_model_moves_with_its_parameters(graphs):
    graph, tiling = graphs["moondream2", 1]
    launch = bench.launch("moondream2", 1, "bf16", graph, tiling)
    base = cm.simulate(graph, launch, cm.FITTED)["seconds"]
    assert cm.simulate(graph, launch, replace(cm.FITTED, tiles_in_flight=4))["seconds"] < 0.6 * base
    assert cm.simulate(graph, launch, replace(cm.FITTED, programs=66))["seconds"] > 1.3 * base
    # bytes bound a step once enough tiles are in flight: 4x the bandwidth is not free time
    slow = replace(cm.FITTED, tiles_in_flight=64, bandwidth=cm.FITTED.bandwidth / 16)
    assert cm.simulate(graph, launch, slow)["seconds"] > cm.simulate(graph, launch, replace(slow, bandwidth=4.8e12))[
        "seconds"]


def test_the_static_schedule_is_the_claimed_one_on_one_program_and_near_it_on_many(graphs):
    """Task i on program i mod P (KernelVariant.static): with one program that is the claimed
    order itself; on 132 it leaves some programs idle while others still work (round robin ignores
    how long each task takes), so it is no faster, but by a few percent at most at Moondream 2 B1."""
    graph, tiling = graphs["moondream2", 1]
    launch = bench.launch("moondream2", 1, "bf16", graph, tiling)
    one = replace(cm.FITTED, programs=1)
    assert cm.simulate(graph, launch, replace(one, static=True))["seconds"] == cm.simulate(graph, launch, one)["seconds"]
    claimed = cm.simulate(graph, launch, cm.FITTED)["seconds"]
    static = cm.simulate(graph, launch, replace(cm.FITTED, static=True))["seconds"]
    assert claimed <= static < 1.05 * claimed, (claimed, static)


MOE_D, MOE_F = 1024, 512


def moe_graph(batch: int, span: int = 1):
    """A lowered step of one MoE layer (8 experts of d 1024, F 512, top 2) between an embed and a
    head, each expert task `span` column tiles of its pair."""
    from photon_core.megakernel import StepGraph, Tiling
    from photon_core.megakernel.compiler import lower, plan
    d, E, F, k = MOE_D, 8, MOE_F, 2
    g = StepGraph("moe", {"tok": (40, d), "router": (E, d), "gu": (E, 2 * F, d), "down": (E, d, F), "head": (40, d)})
    x = g.embed("x", "tok")
    mlp = g.moe("mlp", x, g.linear("route", x, "router"), "gu", "down", k, residual=x)
    g.argmax("token", g.linear("logits", mlp, "head"))
    return lower(plan(g, batch, Tiling(expert_span=span, expert_min_tasks=0)))

def test_expert_tasks_cost_their_trips_and_only_their_experts_first_pairs_compute():
    """An MoE layer's up and down tasks: a routed pair that is not its expert's first exits after
    two L2 trips; the first pairs' tasks take a trip per expert K step (up: gate and up rows, one
    after the other), so wider expert steps (the wide build's) shorten the step; distinct experts
    under uniform routing as the roofline counts them."""
    from photon_core.megakernel import Tiling
    from photon_core.megakernel.ops import OP_MOE_DOWN, OP_MOE_UP
    d, F = MOE_D, MOE_F
    graph = moe_graph(1)
    up = next(t for t in graph.tasks if t.op == OP_MOE_UP and t.args["tile"] == 0)
    down = next(t for t in graph.tasks if t.op == OP_MOE_DOWN and t.args["tile"] == 1)
    m = cm.FITTED
    la = cm.launch_of(graph, Tiling(), 1, [5], None, 2, 64, 64, expert_k_step=32, expert_bytes=1, expert_pairs=2)
    assert cm.body(up, la, m) == pytest.approx(2 * (d // 32) * m.k_step + 4 * m.l2)
    assert cm.body(down, la, m) == pytest.approx((F // 32) * m.k_step + 4 * m.l2)
    assert cm.body(down, replace(la, expert_pairs=1), m) == 2 * m.l2
    wide = replace(la, expert_k_step=512)
    assert cm.body(up, wide, m) == pytest.approx(2 * 2 * m.k_step + 4 * m.l2)
    assert cm.simulate(graph, wide, m)["seconds"] < cm.simulate(graph, la, m)["seconds"]
    assert [cm.distinct_experts(64, 8, b) for b in (1, 2, 8)] == [8, 15, 42]


def test_expert_tasks_of_several_column_tiles_cost_their_tiles_and_less_fixed_time():
    """Tiling.expert_span: each MoE up / down task computes up to `span` consecutive column tiles of
    its pair; the columns each pair covers are the same as at one tile a task, a task takes its
    tiles' trips one after another (its body at 4 tiles = 4 one-tile bodies, the fixed trips once),
    and with fewer programs than tasks the fixed time saved wins, while 132 programs on this small
    layer lose more parallelism than they save (what the model weighs for Moondream 3,
    bench/cost_model.py)."""
    from collections import Counter

    from photon_core.megakernel import Tiling
    from photon_core.megakernel.ops import OP_MOE_DOWN, OP_MOE_UP
    one, four = moe_graph(2, span=1), moe_graph(2, span=4)
    m = cm.FITTED
    la = cm.launch_of(one, Tiling(), 2, [5, 9], None, 2, 64, 64, expert_k_step=512, expert_bytes=1, expert_pairs=3)

    def columns(gr):
        out = Counter()
        for t in gr.tasks:
            if t.op in (OP_MOE_UP, OP_MOE_DOWN):
                out[t.op, t.args["tile"]] += t.args["n1"] - t.args["n0"]
        return out
    moe = [t for t in four.tasks if t.op in (OP_MOE_UP, OP_MOE_DOWN)]
    assert columns(four) == columns(one)
    assert max(t.args["n1"] - t.args["n0"] for t in moe) == 4 * Tiling().block_n
    assert len(moe) * 4 == sum(t.op in (OP_MOE_UP, OP_MOE_DOWN) for t in one.tasks)
    wide = next(t for t in moe if t.op == OP_MOE_DOWN and t.args["tile"] == 0)
    narrow = next(t for t in one.tasks if t.op == OP_MOE_DOWN and t.args["tile"] == 0)
    assert cm.body(wide, la, m) - 4 * m.l2 == pytest.approx(4 * (cm.body(narrow, la, m) - 4 * m.l2))
    few = replace(m, programs=4)
    assert cm.simulate(four, la, few)["seconds"] < cm.simulate(one, la, few)["seconds"]
    assert cm.simulate(four, la, m)["seconds"] > cm.simulate(one, la, m)["seconds"]


def test_attention_splits_follow_the_batch_on_the_real_shapes(graphs, today):
    """Tiling() splits each (row, head)'s keys only while the stage would otherwise have too few
    tasks for the GPU (Tiling.attn_min_tasks): Moondream 2 (32 heads, 24 layers) keeps 4 splits at
    batch 1 and takes one at batch 8; Whisper tiny.en (6 heads) keeps its 4 self splits at batch 8
    and halves its 8 cross splits. The model sees the batch-8 step shorter than the run's build."""
    from photon_core.megakernel.ops import OP_ATTN_PARTIAL

    def partials(g):
        return sum(t.op == OP_ATTN_PARTIAL for t in g.tasks)
    assert partials(today["moondream2", 1][0]) == partials(graphs["moondream2", 1][0]) == 24 * 32 * 4
    assert partials(graphs["moondream2", 8][0]) == 24 * 8 * 32 * 4
    assert partials(today["moondream2", 8][0]) == 24 * 8 * 32
    assert partials(today["whisper-tiny.en", 8][0]) == 4 * 8 * 6 * (4 + 4)
    run, now = (cm.simulate(g, bench.launch("moondream2", 8, "bf16", g, t), cm.FITTED)["seconds"]
                for g, t in (graphs["moondream2", 8], today["moondream2", 8]))
    assert now < run, (now, run)


def test_statistics_finales_merge_the_tiles_partials_on_the_real_shapes(graphs):
    """Every statistics finale of a linear stage merges its tiles' partials (Moondream 2: the out
    projection feeding the next layer's LayerNorm, 64 tiles of 32 columns; Whisper tiny.en: the
    residual linears, 12 tiles): one trip a STATS_TILES of them, where reading the value takes two
    passes of 128 elements a row a trip at batch 8. The model sees the batch-8 steps shorter."""
    from photon_core.megakernel.ops import OP_LINEAR
    for (name, batch), (g, tiling) in graphs.items():
        finales = [t for t in g.tasks if t.args.get("stout", -1) >= 0]
        linear = [t for t in finales if t.op == OP_LINEAR]
        assert linear and all(t.args["stpart"] >= 0 and 0 <= t.args["sttile"] < t.args["stnt"] for t in linear)
        assert all(t.args.get("stpart", -1) == -1 for t in finales if t.op != OP_LINEAR)
        if name == "moondream2":
            assert {t.args["stnt"] for t in linear} == {2048 // 32}
        if batch == 8:
            read, merged = (cm.simulate(g, bench.launch(name, 8, "bf16", g, tiling, stats_chunk=1024, stats_tiles=n),
                                        cm.FITTED)["seconds"] for n in (0, 64))
            assert merged < read, (name, merged, read)


def test_batch_8_append_rows_run_as_finales_of_their_qkv_tiles(graphs, today):
    """Tiling.rope_finale_rows 8: Moondream 2 at batch 8 has no append tasks (the run's build had
    8 x 32 a layer), the last q|k|v tile of each head to finish runs its 8 rows; the model sees the
    step shorter with the stages otherwise alike."""
    from photon_core.megakernel import Tiling
    from photon_core.megakernel.ops import OP_ROPE_APPEND
    run, now = graphs["moondream2", 8][0], today["moondream2", 8][0]
    assert sum(t.op == OP_ROPE_APPEND for t in run.tasks) == 24 * 8 * 32
    assert not any(t.op == OP_ROPE_APPEND for t in now.tasks)
    assert {t.args["nfin"] for t in now.tasks if t.args.get("fin", -1) >= 0} == {8}
    import roofline

    from photon_core.megakernel.compiler import lower, plan
    tiling = Tiling(rope_finale_rows=1)
    tasks = lower(plan(roofline.moondream2().graph, 8, tiling)), tiling
    kw = bench.TODAY_KW["by_batch"][8]
    before, after = (cm.simulate(g, bench.launch("moondream2", 8, "bf16", g, t, **kw), cm.FITTED)["seconds"]
                     for g, t in (tasks, today["moondream2", 8]))
    assert after < before, (after, before)
