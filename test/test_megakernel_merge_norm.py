"""Tickets: work that the LAST task of a group to finish does for the whole group.

Attention: the merge runs in the last of a (row, head)'s partials, not in a task of its own. The
checker orders a ticket's finale after all of its group and before only the tasks that follow
every member; the compiled step has no merge tasks, one dependency level fewer per attention, and
the same bits whichever partial happens to be last.

Norms: the last task of the stage producing a normed value writes each row's (mean, rstd) once;
the linears behind the norm read those two floats instead of every tile re-reading its rows."""
import os

os.environ["TRITON_INTERPRET"] = "1"  # must precede the first import of triton

import pytest  # noqa: E402
import torch  # noqa: E402

from photon_core.megakernel import CompiledStep, Tiling, check, lower, plan  # noqa: E402
from photon_core.megakernel.checker import GraphError  # noqa: E402
from photon_core.megakernel.graph import Region, Task, TaskGraph  # noqa: E402
from photon_core.megakernel.ops import (OP_ATTN_MERGE, OP_ATTN_PARTIAL, OP_EMBED, OP_LINEAR,  # noqa: E402
                                        OP_LINEAR_SPLIT, OP_ROPE_APPEND)

from test_megakernel_compiler import fill_caches, toy_graph, toy_weights  # noqa: E402


def _members(reader_waits):
    """Two partials of one ticket (each writes its own slot, the finale reads both and writes o),
    a reader of o with the given waits."""
    g = TaskGraph("toy", 1)
    fin = dict(ticket="m", last_reads=[Region("state", 0, 8)], last_writes=[Region("state", 8, 12)])
    g.add(Task("p0", OP_ATTN_PARTIAL, {}, [], "c0", [], [Region("state", 0, 4)], **fin))
    g.add(Task("p1", OP_ATTN_PARTIAL, {}, [], "c1", [], [Region("state", 4, 8)], **fin))
    g.add(Task("r", OP_LINEAR, {}, reader_waits, None, [Region("state", 8, 12)], []))
    return g


def test_a_finale_is_ordered_only_before_tasks_after_every_member():
    check(_members([("c0", 1), ("c1", 1)]))
    # After p0 only: p1 may be the last and merge after r has read o.
    with pytest.raises(GraphError, match="finale of ticket 'm'"):
        check(_members([("c0", 1)]))
    # A member's own reads of the other's slot (no ticket finale) race: nothing orders them.
    g = TaskGraph("toy", 1)
    g.add(Task("p0", OP_ATTN_PARTIAL, {}, [], "c", [], [Region("state", 0, 4)]))
    g.add(Task("p1", OP_ATTN_PARTIAL, {}, [], "c", [Region("state", 0, 4)], [Region("state", 4, 8)]))
    with pytest.raises(GraphError, match="race"):
        check(g)


def test_finales_must_be_declared_alike_and_ordered_among_themselves():
    g = _members([("c0", 1), ("c1", 1)])
    g.tasks[1].last_writes = [Region("state", 8, 13)]
    with pytest.raises(GraphError, match="different finale accesses"):
        check(g)
    # Two tickets whose finales write the same cell: ordered only when a task after every member
    # of the first precedes a member of the second.
    def two(second_waits):
        g = TaskGraph("toy", 1)
        a = dict(ticket="a", last_reads=[], last_writes=[Region("state", 0, 1)])
        b = dict(ticket="b", last_reads=[], last_writes=[Region("state", 0, 1)])
        draws = {"stout": 0}   # a ticket's member draws it for its finale (here: row statistics)
        g.add(Task("a0", OP_EMBED, draws, [], "ca", [], [Region("state", 1, 2)], **a))
        g.add(Task("a1", OP_EMBED, draws, [], "ca", [], [Region("state", 2, 3)], **a))
        g.add(Task("b0", OP_EMBED, draws, second_waits, "cb", [], [Region("state", 3, 4)], **b))
        return g
    check(two([("ca", 2)]))
    with pytest.raises(GraphError, match="race"):
        check(two([("ca", 1)]))


# Append tasks (rope_finale_rows 1): the step's tickets are its attention merges and x0's statistics.
def _step(batch=2, tiling=Tiling(16, 32, 8, 3, 4, rope_finale_rows=1)):
    w = toy_weights()
    step = CompiledStep(toy_graph(w), w, batch, tiling)
    gen = torch.Generator().manual_seed(7)
    fill_caches(step, batch, [4, 2][:batch], 9, gen)
    step.set_cross_len([9, 7][:batch])
    step.set_input("bias", torch.zeros(batch, 70))
    step.set_step([3, 5][:batch], [4, 2][:batch])
    return step


def test_compiled_attention_has_no_merge_tasks_and_one_level():
    step = _step()
    g = step.graph
    parts = [t for t in g.tasks if t.op == OP_ATTN_PARTIAL]
    assert parts and not any(t.op == OP_ATTN_MERGE for t in g.tasks)
    assert all(t.ticket is not None and t.last_writes for t in parts)
    # one ticket per (row, attention, head); 2 rows x 3 heads x (self + cross)
    assert len({t.ticket for t in parts}) == 2 * 3 * 2
    assert g.ctrl_size() == 2 + len(g.counters) + len(g.tickets)
    # The attention's readers wait for every partial (each may be the last of its (row, head)).
    reader = next(t for t in g.tasks if t.name.startswith("x1["))
    assert ("a", sum(1 for t in parts if t.signal == "a")) in reader.waits


def test_the_merge_is_the_same_whichever_partial_finishes_last():
    """The interpreter runs tasks in list order: reversing each (row, head)'s partials makes split 0
    the last one (the merger) instead of split S-1. Outputs must be bit-identical."""
    step = _step()
    step.launch()
    want = {k: step.view(k).clone() for k in ("a", "c", "x1", "logits")}
    ticks = step.kernel.ctrl[2 + len(step.graph.counters):].clone()
    # every ticket drawn by all of its members (partials: 3 self splits, 4 cross; x0's 3 embed tiles)
    assert [ticks[step.graph.tickets[t]].item() for t in ("a.merge[b1,h2]", "c.merge[b0,h0]", "x0.stats")] == [3, 4, 3]
    assert sorted(set(ticks.tolist())) == [3, 4]
    g = step.graph
    groups: dict[str, list[int]] = {}
    for i, t in enumerate(g.tasks):
        if t.ticket is not None:
            groups.setdefault(t.ticket, []).append(i)
    order = list(range(len(g.tasks)))
    for idx in groups.values():
        assert idx == list(range(idx[0], idx[0] + len(idx)))   # a group is listed contiguously
        order[idx[0]:idx[-1] + 1] = idx[::-1]
    g.tasks = [g.tasks[i] for i in order]
    check(g)
    mk = step.kernel
    mk.tasks = g.encode()
    # Poison what the first launch left: a merge that ran before all partials would read NaN.
    for key in ("a", "a.part", "c", "c.part"):
        step.sarena.typed(step.state, key).fill_(float("nan"))
    step.launch()
    for k, v in want.items():
        assert torch.equal(step.view(k), v), k


def test_real_whisper_tiny_graph_checks_and_loses_a_level_per_attention_and_split_stage():
    """Whisper tiny's real sizes at batch 1 on the GPU tiling (meta weights: nothing is allocated):
    the checker proves the fused graph, and the longest chain of waits is 2 levels per layer
    (self + cross attention) shorter than with merge tasks (4 layers: 66 -> 58, bench/roofline.py),
    and 6 more per layer shorter than with a reduce task behind each split-K stage (58 -> 34)."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import roofline
    m = roofline.whisper("Whisper tiny", 384, 6, 4)
    tiling = Tiling(block_n=64, block_k=128, block_t=64, self_splits=4, cross_splits=8, min_tasks=264)
    g = lower(plan(m.graph, 1, tiling))
    check(g)
    assert roofline.depth(g) == 34


def test_norm_statistics_are_written_once_by_the_producer_stage_and_read_by_every_tile():
    """x0 (embed tiles) feeds a LayerNorm: the embed stage's last tile writes each row's (mean, rstd)
    and the linears behind the norm read them; hf normalises an attention output (no whole-value
    producer): its linear still computes them itself."""
    from photon_core.megakernel.graph import F
    step = _step()
    g, p = step.graph, step.plan
    assert set(p.stats) == {"x0"}
    embeds = [t for t in g.tasks if t.name.startswith("x0[")]
    assert embeds and all(t.ticket == "x0.stats" for t in embeds)
    readers = [t for t in g.tasks if t.args.get("lnw", -1) >= 0]
    assert {t.name.split("[")[0] for t in readers if t.args["lnst"] >= 0} == {"qkv", "u"}
    assert all(t.args["lnst"] == -1 for t in readers if t.name.startswith("logits"))
    step.launch()
    x = step.view("x0")
    want = torch.stack([x.mean(1), (x.var(1, unbiased=False) + p.ln_eps).rsqrt()], 1)
    assert torch.allclose(step.view("x0.stats"), want, rtol=1e-5, atol=1e-6)
    qkv = step.view("q").clone()
    # Without the finale the readers see poisoned statistics: they do read them (not recompute).
    mk = step.kernel
    for i, t in enumerate(g.tasks):
        if t.ticket == "x0.stats":
            mk.tasks[i, F["stout"]] = -1
    step.sarena.typed(step.state, "x0.stats").fill_(float("nan"))
    step.launch()
    assert torch.isnan(step.view("q")).all() and not torch.isnan(qkv).any()


def _stats_step(norm, tiling, offset=0.0):
    """y = x0 @ w1 + x0, a norm over y read by two linears (u, v); batch 2. offset: added to every
    embedding, w1 made small, so y's rows have mean ~offset and spread ~1."""
    from photon_core.megakernel import StepGraph
    gen = torch.Generator().manual_seed(11)
    d, ff, vocab = 40, 72, 30
    w = {"tok": torch.randn(vocab, d, generator=gen) + offset,
         "w1": torch.randn(d, d, generator=gen) * d ** -0.5 * (1e-4 if offset else 1),
         "n.w": 1 + 0.1 * torch.randn(d, generator=gen), "n.b": 0.1 * torch.randn(d, generator=gen),
         "w2": torch.randn(ff, d, generator=gen) * d ** -0.5, "w3": torch.randn(d, d, generator=gen) * d ** -0.5}
    g = StepGraph("stats", {k: tuple(t.shape) for k, t in w.items()})
    x0 = g.embed("x0", "tok")
    y = g.linear("y", x0, "w1", residual=x0)
    h = g.layer_norm("h", y, "n.w", "n.b") if norm == "layer" else g.rms_norm("h", y, "n.w", 1e-5)
    g.expose("u", g.linear("u", h, "w2", act="gelu"))
    g.expose("v", g.linear("v", h, "w3", residual=y))
    step = CompiledStep(g, w, 2, tiling)
    assert set(step.plan.stats) == {"y"}
    op = {t.op for t in step.graph.tasks if t.ticket == "y.stats"}
    assert op == ({OP_LINEAR} if tiling.min_tasks == 0 else {OP_LINEAR_SPLIT})
    return g, w, step


def _row_stats_of(x, norm, eps):
    """(mean, rstd) per row in float64, as the step's statistics should hold them."""
    x = x.double()
    if norm == "layer":
        return torch.stack([x.mean(1), (x.var(1, unbiased=False) + eps).rsqrt()], 1)
    return torch.stack([torch.zeros(len(x), dtype=x.dtype), (x.square().mean(1) + eps).rsqrt()], 1)


def _launch(step, variant):
    from photon_core.megakernel.kernel import KernelVariant
    step.kernel.variant = KernelVariant.parse(variant)
    step.state.fill_(float("nan"))
    step.set_step([3, 17], [0, 0])
    step.launch()


@pytest.mark.parametrize("norm,tiling,offset", [
    ("rms", Tiling(16, 16, 8, 1, 1), 0.0),                                                 # whole-K tiles
    ("layer", Tiling(32, 16, 8, 1, 1, min_tasks=12, min_block_n=16, max_split_k=3), 0.0),  # split-K slices
    ("layer", Tiling(16, 16, 8, 1, 1), 1000.0),     # rows of mean 1000 and spread 1: no cancellation
    ("rms", Tiling(16, 16, 8, 1, 1), 1000.0),
    ("layer", Tiling(16, 16, 8, 1, 1, linear_span=2, linear_min_tasks=1), 0.0),   # tasks of tiles 0-1 and 2
])
def test_statistics_of_a_linear_output_equal_the_eager_graph(norm, tiling, offset):
    """A norm over a residual linear's output, read by two linears. The plain build's finale (the
    stage's last task; of a split-K stage, after the sums of its tiles) reads the value; in an aligned
    build every tile (of a split-K stage, the last slice of each tile) leaves its rows' count, mean
    and M2 and the finale merges them. Both: the step equals run_reference and the statistics are
    the value's (float64), for rows far from zero too (mean 1000, spread 1: a variance from sums of
    squares about zero would lose ~10% there in fp32)."""
    from photon_core.megakernel import run_reference
    g, w, step = _stats_step(norm, tiling, offset)
    want = run_reference(g, w, {}, [3, 17], [0, 0])
    width = tiling.block_n if tiling.min_tasks == 0 else step.plan.shape["y"][0]
    for variant in ("plain", "aligned"):
        _launch(step, variant)
        for k in ("u", "v"):
            assert ((step.view(k) - want[k]).abs().max() / want[k].abs().max()).item() < 1e-4, (variant, k)
        x, st = step.view("y"), step.view("y.stats")
        if offset:
            assert (x.mean(1) - offset).abs().max() < 5 and (x.std(1) - 1).abs().max() < 0.5
        assert torch.allclose(st.double(), _row_stats_of(x, norm, step.plan.ln_eps), rtol=1e-5, atol=1e-6), variant
        parts = step.view("y.tstats")
        assert parts.shape == (2, -(-x.shape[1] // width), 3)
        if variant == "plain":
            assert torch.isnan(parts).all()      # the plain build leaves none: its finale reads y
            continue
        # the tiles' partials: count, mean and M2 of each row's columns in each tile, in tile order
        for i, c0 in enumerate(range(0, x.shape[1], width)):
            cols = x[:, c0:c0 + width].double()
            m2 = (cols - cols.mean(1, keepdim=True)).square().sum(1)
            assert torch.equal(parts[:, i, 0], torch.full((2,), float(cols.shape[1])))
            assert torch.allclose(parts[:, i, 1].double(), cols.mean(1), rtol=1e-6, atol=1e-6)
            assert torch.allclose(parts[:, i, 2].double(), m2, rtol=1e-4, atol=1e-6)


def test_the_aligned_finale_reads_the_tiles_partials_and_a_wide_stage_leaves_none(monkeypatch):
    """It is the partials the aligned build's finale merges: with every tile writing slot 0, the
    other slots keep their NaN and so do the statistics, while y is right. A stage of more tiles
    than one trip merges (ops.linear.STATS_TILES; 2 here) gets no partials, and its aligned finale
    reads the value."""
    from photon_core.megakernel.graph import F
    from photon_core.megakernel.ops import linear
    _, _, step = _stats_step("layer", Tiling(16, 16, 8, 1, 1))
    _launch(step, "aligned")
    x = step.view("y").clone()
    want = _row_stats_of(x, "layer", step.plan.ln_eps)
    tiles = step.kernel.tasks[:, F["sttile"]]
    assert sorted(tiles[tiles >= 0].tolist()) == [0, 1, 2]
    tiles[tiles > 0] = 0
    _launch(step, "aligned")
    assert torch.equal(step.view("y"), x) and torch.isnan(step.view("y.stats")).all()
    monkeypatch.setattr(linear, "STATS_TILES", 2)
    _, _, wide = _stats_step("layer", Tiling(16, 16, 8, 1, 1))
    assert "y.tstats" not in wide.plan.shapes
    assert all(t.args.get("stpart", -1) == -1 and t.args.get("sttile", -1) == -1 for t in wide.graph.tasks)
    _launch(wide, "aligned")
    assert torch.allclose(wide.view("y.stats").double(), want, rtol=1e-5, atol=1e-6)


SPLIT = Tiling(32, 16, 8, 1, 1, min_tasks=12, min_block_n=16, max_split_k=3)


def test_split_k_sums_are_the_same_whichever_slice_finishes_last():
    """Split-K without reduce tasks: the last slice of each tile to finish sums the tile's slots in
    slot order and runs the epilogue. Reversing each tile's slices in the list (the interpreter then
    runs slice 0 last) gives the same bits; without the tile tickets no slice sums (y stays NaN)."""
    from photon_core.megakernel.graph import F
    _, _, step = _stats_step("layer", SPLIT)
    g = step.graph
    step.state.fill_(float("nan"))
    step.set_step([3, 17], [0, 0])
    step.launch()
    # every tile's ticket drawn by each of its slices, the stage's by every slice of the stage
    ticks = step.kernel.ctrl[2 + len(g.counters):]
    members: dict[str, int] = {}
    for t in g.tasks:
        for name in (t.kticket, t.ticket):
            if name is not None:
                members[name] = members.get(name, 0) + 1
    assert any(k.startswith("y.sum") for k in members) and members["y.stats"] > 2
    assert {k: ticks[g.tickets[k]].item() for k in members} == members
    keys = ("y", "y.stats", "u", "v")
    want = {k: step.view(k).clone() for k in keys}
    groups: dict[str, list[int]] = {}
    for i, t in enumerate(g.tasks):
        if t.kticket is not None:
            groups.setdefault(t.kticket, []).append(i)
    assert groups and all(len(idx) > 1 for idx in groups.values())
    order = list(range(len(g.tasks)))
    for idx in groups.values():
        assert idx == list(range(idx[0], idx[0] + len(idx)))   # a tile's slices are listed together
        order[idx[0]:idx[-1] + 1] = idx[::-1]
    g.tasks = [g.tasks[i] for i in order]
    check(g)
    mk = step.kernel
    mk.tasks = g.encode()
    for k in keys + ("y.kpart",):
        step.sarena.typed(step.state, k).fill_(float("nan"))
    step.launch()
    for k, v in want.items():
        assert torch.equal(step.view(k), v), k
    mk.tasks[:, F["kticket"]] = -1
    step.sarena.typed(step.state, "y").fill_(float("nan"))
    step.launch()
    assert torch.isnan(step.view("y")).all()


def test_a_stage_finale_follows_only_tile_sums_whose_slices_all_draw_its_ticket():
    """Two tiles of two slices each; the stage's ticket (row statistics over both tiles' outputs)
    is ordered after a tile's sum only when every slice of that tile takes the stage's ticket after
    its tile's: drop one slice from the stage's group and the statistics race with that tile's sum."""
    def graph(stage_members):
        g = TaskGraph("toy", 1)
        stage = dict(ticket="st", last_reads=[Region("state", 16, 24)], last_writes=[Region("state", 24, 26)])
        for tile in (0, 1):
            slots = [Region("state", tile * 8, tile * 8 + 4), Region("state", tile * 8 + 4, tile * 8 + 8)]
            for k in (0, 1):
                name = f"s{tile}{k}"
                member = name in stage_members   # draws the stage's ticket for its row statistics
                g.add(Task(name, OP_LINEAR_SPLIT, {"stout": 0} if member else {}, [], "y", [], [slots[k]],
                           kticket=f"t{tile}",
                           ksum_reads=list(slots), ksum_writes=[Region("state", 16 + tile * 4, 20 + tile * 4)],
                           **(stage if name in stage_members else {})))
        g.add(Task("r", OP_LINEAR, {}, [("y", 4)], None, [Region("state", 16, 26)], []))
        return g
    check(graph({"s00", "s01", "s10", "s11"}))
    g = graph({"s00", "s01", "s10", "s11"})
    g.tasks[0].kticket = "st"      # one counter per name: the tile's and the stage's would share it
    with pytest.raises(GraphError, match="name both"):
        check(g)
    with pytest.raises(GraphError, match="finale of ticket 't1'.*finale of ticket 'st'|"
                                         "finale of ticket 'st'.*finale of ticket 't1'"):
        check(graph({"s00", "s01", "s10"}))


def test_appends_run_as_finales_of_their_qkv_tiles_whichever_tile_is_last():
    """At batch 1 the rotary append of each head runs in the last of that head's q, k and v tiles
    to finish (finale rows, no append tasks, no level of their own). Reversing the q|k|v stage in
    the list changes which tile is last: the same bits. Without the finale rows q is never written."""
    from photon_core.megakernel.compiler import head_groups
    from photon_core.megakernel.graph import F
    step = _step(batch=1)
    g = step.graph
    node, groups = step.plan.rope_groups["qkv"]
    assert groups == [[0], [1], [2]] and head_groups(node, 32) == [[0, 1, 2]]   # 32 columns straddle 16-wide heads
    assert not any(t.op == OP_ROPE_APPEND for t in g.tasks)
    assert [t.name for t in g.rows] == ["q[b0,h0]", "q[b0,h1]", "q[b0,h2]"]
    tiles = [i for i, t in enumerate(g.tasks) if t.name.startswith("qkv[")]
    assert len(tiles) == 9 and {g.tasks[i].ticket for i in tiles} == {"q.g0", "q.g1", "q.g2"}
    step.launch()
    ticks = step.kernel.ctrl[2 + len(g.counters):]
    assert [ticks[g.tickets[f"q.g{h}"]].item() for h in range(3)] == [3, 3, 3]   # q, k and v tile of each head
    keys = ("q", "a", "logits")
    want = {k: step.view(k).clone() for k in keys}
    kv = {k: step.view(k)[0, :, 4].clone() for k in ("k", "v")}   # this step's position
    order = list(range(len(g.tasks)))
    order[tiles[0]:tiles[-1] + 1] = tiles[::-1]
    g.tasks = [g.tasks[i] for i in order]
    check(g)
    mk = step.kernel
    mk.tasks = g.encode()
    for k in keys:
        step.sarena.typed(step.state, k).fill_(float("nan"))
    for k in ("k", "v"):
        step.view(k)[0, :, 4] = float("nan")
    step.launch()
    for k, v in want.items():
        assert torch.equal(step.view(k), v), k
    for k, v in kv.items():
        assert torch.equal(step.view(k)[0, :, 4], v), k
    mk.tasks[:, F["fin"]] = -1
    step.sarena.typed(step.state, "q").fill_(float("nan"))
    step.launch()
    assert torch.isnan(step.view("q")).all()



@pytest.mark.parametrize("min_tasks, splits", [(0, (3, 4)), (12, (3, 2)), (6, (1, 1))])
def test_attention_splits_follow_the_batch(min_tasks, splits):
    """Tiling.attn_min_tasks: a split count halves while the stage keeps that many tasks (2 rows x 3
    heads here; 0 never halves). The step equals run_reference whatever the splits (one split: a
    ticket of one, its partial merged alone), and a row without cross keys reads zeros."""
    from dataclasses import replace

    from photon_core.megakernel import run_reference
    from test_megakernel_compiler import RTOL, rel_err
    w = toy_weights()
    g = toy_graph(w)
    step = CompiledStep(g, w, 2, replace(Tiling(16, 32, 8, 3, 4), attn_min_tasks=min_tasks))
    for name, want in zip(("a", "c"), splits):
        parts = [t for t in step.graph.tasks if t.name.startswith(f"{name}.part[")]
        assert len(parts) == 2 * 3 * want and all(t.args["S"] == want for t in parts)
        assert step.plan.sarena.numel(f"{name}.part") == 2 * 3 * want * (16 + 2)   # head_dim 16
    check(step.graph)
    step.state.fill_(float("nan"))
    gen = torch.Generator().manual_seed(3)
    positions, cross = [4, 2], [9, 0]
    caches = fill_caches(step, 2, positions, 9, gen)
    step.set_cross_len(cross)
    bias = torch.zeros(2, 70)
    step.set_input("bias", bias)
    step.set_step([5, 7], positions)
    step.launch()
    want = run_reference(g, w, caches, [5, 7], positions, cross, {"bias": bias})
    for name in ("a", "c", "logits"):
        assert rel_err(step.view(name), want[name]) < RTOL, name
    assert torch.equal(step.view("c")[1], torch.zeros_like(step.view("c")[1]))
