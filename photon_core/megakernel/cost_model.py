"""A cost model of one megakernel launch, built from its task graph and the kernel's parameters,
fitted to what the first GPU run measured (../shared/gpu-runs/h200-2026-12-04, bench/RESULTS.md).

The run refuted the roofline (bytes at 80% of bandwidth + 1.5 us a level: 0.85 ms predicted for
Moondream 2 at batch 1, 7.67 ms measured): fp32 weights took the time bf16 ones did, and batch 8
about twice batch 1, whose K step is half as wide. A step is not moving bytes; it is waiting. So
this model is a simulation of the persistent kernel's schedule, in which time is round trips:

* P programs (one an SM under Triton 3.4-3.7, two under 3.8+) claim tasks in the table's order
  (the static build: task i is program i mod P's, in order);
  a claimed task pays `task` (the claim, its header and fields: dependent loads from L2), waits
  until each counter it needs reaches its target, plus `observe` (the release seen by the poll),
  then runs its body and releases. A ticket group's last finisher also runs the group's finale.
* A linear task's body is its K steps, each one trip to memory for one weight tile (`k_step`):
  the loop keeps one tile in flight, so the trip's latency, not its bytes, sets the step. With
  `tiles_in_flight` > 1 (a pipelined loop, a prefetch) a step costs k_step / tiles_in_flight, but
  never less than its bytes at the program's share of `bandwidth`.
* An expert task (MoE up or down) of a routed pair that is the first to choose its expert streams
  that expert's tile (Launch.expert_pairs of the pairs, the first ones: uniform routing's count of
  distinct experts; the others exit): a trip per expert K step (Launch.expert_k_step, FP8 experts
  1 byte a weight), each trip's whole tile in flight at once, trip after trip (the plain loop and
  the wide steps alike).
* An attention partial's body is its key blocks, one trip each (`k_step`: the caches are in HBM);
  the last partial of a head merges (`l2` per partial read). Statistics finales read the stage's
  output twice in BLOCK_K chunks, one L2 trip each (`l2`), or, in builds whose linear tiles leave
  partial statistics (Launch.stats_tiles), merge those, one trip a chunk of them; append rows,
  argmax blocks, embeds and the rest a few L2 trips.

Five constants, fitted once to the eight measured steps (Whisper tiny.en and Moondream 2, batch 1
and 8, fp32 and bf16 weights) and stated in FITTED; test_megakernel_cost_model holds the model to
those eight within 15%. Design changes are then predicted by changing the parameters they change
(predict(), bench/cost_model.py), before they are built.
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, replace
from typing import Any

from photon_core.megakernel.graph import TaskGraph
from photon_core.megakernel.ops import (OP_ARGMAX, OP_ATTN_MERGE, OP_ATTN_PARTIAL, OP_EMBED, OP_LINEAR,
                                        OP_LINEAR_SPLIT, OP_MOE_DOWN, OP_MOE_UP, OP_ROPE_APPEND)


@dataclass(frozen=True)
class Machine:
    """The round trips a launch is made of, in seconds, and the kernel's shape on the GPU."""
    k_step: float          # one dependent trip to HBM for a weight tile or a key block (a K step)
    l2: float              # one dependent trip to L2 (statistics, merges, argmax blocks, fields)
    task: float            # claim + header + fields of one task, before its waits
    observe: float         # a release until the waiting program sees it
    launch: float = 0.0    # the launch itself: start, the control buffer's zeroing, the last exit
    programs: int = 132    # resident programs (H200, Triton 3.6: 8 warps, one an SM)
    bandwidth: float = 4.8e12
    tiles_in_flight: float = 1.0    # weight tiles a linear task's loop keeps outstanding
    static: bool = False            # task i runs on program i % programs (KernelVariant.static), not the first free


# Fitted to the 2026-12-04 H200 run (Triton 3.6, 132 programs) by `bench/cost_model.py --fit`
# (bounds: an L2 trip no longer than an HBM one, a task's own trips at most 5 us, a launch at most
# 20 us); the residuals are in bench/RESULTS.md ("Megakernel cost model"). Two constants sit at
# their bounds (task, launch): the eight steps want more fixed time per task and per launch than
# round trips explain, so the model still lacks a mechanism, one the trace of a launch
# (timeline.py, the next GPU run's first job) will show; until then its predictions of changes
# to the K loop are firmer than those of changes to claims and waits.
FITTED = Machine(k_step=0.812e-6, l2=0.763e-6, task=5.0e-6, observe=1.298e-6, launch=19.976e-6)

# The eight measured steps (us, median CUDA-graph replay): (model, batch, weights) -> us.
MEASURED_US = {("whisper-tiny.en", 1, "fp32"): 578, ("whisper-tiny.en", 1, "bf16"): 587,
               ("whisper-tiny.en", 8, "fp32"): 1041, ("whisper-tiny.en", 8, "bf16"): 1060,
               ("moondream2", 1, "fp32"): 7766, ("moondream2", 1, "bf16"): 7670,
               ("moondream2", 8, "fp32"): 17242, ("moondream2", 8, "bf16"): 17543}


@dataclass(frozen=True)
class Launch:
    """What the simulation needs of one launch besides the graph: the kernel's K step and key
    block, the rows' positions and cross lengths, the weights' bytes per element."""
    k_step: int
    block_k: int
    block_t: int
    block_r: int
    positions: tuple[int, ...]
    cross_len: tuple[int, ...] | None
    weight_bytes: int
    stats_chunk: int = 0     # elements of a row a statistics finale reads a trip (0: block_k, as measured)
    stats_tiles: int = 0     # tiles' partial statistics a linear stage's finale merges a trip (kernel.STATS_TILES;
                             # 0: it reads the value, as the measured build did)
    expert_k_step: int = 0   # elements an expert task's K loop reads a trip (0: k_step)
    expert_bytes: int = 0    # bytes an expert weight (0: weight_bytes; FP8 experts 1)
    expert_pairs: int | None = None   # routed pairs whose expert tasks compute (the first pair choosing each
                                      # expert; None: every pair)
    block_n: int = 32        # columns of a tile (an expert task computes its span a tile after another)


def _keys(t, launch: Launch) -> int:
    """Key blocks one attention partial reads (as kernel._task_attn_partial cuts them)."""
    a = t.args
    b = a["bi"]
    length = launch.positions[b] + 1 if a.get("lenkind", 0) == 0 else (launch.cross_len or (0,))[b]
    if not a.get("ring", 0):
        length = min(length, a["Tmax"])
    window = a.get("window", -1)
    lo = max(length - window, 0) if window and window > 0 else 0
    S = a["S"]
    chunk = math.ceil(math.ceil((length - lo) / S) / launch.block_t) * launch.block_t
    start = min(lo + a["s"] * chunk, length)
    end = min(start + chunk, length)
    return math.ceil((end - start) / launch.block_t)


def body(t, launch: Launch, m: Machine) -> float:
    """Seconds of a task's own work (its waits and finale apart)."""
    a, op = t.args, t.op
    if op in (OP_LINEAR, OP_LINEAR_SPLIT):
        # a task of several block_n tiles (Tiling.linear_span) computes them one after another
        tiles = math.ceil((a["n1"] - a["n0"]) / launch.block_n)
        steps = math.ceil((a["k1"] - a["k0"]) / launch.k_step)
        tile = (a["n1"] - a["n0"]) / tiles * launch.k_step * launch.weight_bytes
        per = max(m.k_step / m.tiles_in_flight, tile * m.programs / m.bandwidth)
        fused_norm_without_stats = a.get("lnw", -1) >= 0 and a.get("lnst", -1) < 0
        own_stats = 2 * math.ceil(a["K"] / launch.k_step) * m.l2 if fused_norm_without_stats else 0
        return tiles * (m.k_step + (steps - 1) * per + own_stats) + 2 * m.l2
    if op in (OP_MOE_UP, OP_MOE_DOWN):
        if launch.expert_pairs is not None and a["tile"] >= launch.expert_pairs:   # not its expert's first pair: exits
            return 2 * m.l2
        # Each trip's whole tile in flight at once (plain loop, wide steps), a latency a trip; up
        # reads its gate and up rows one after the other; a task of several column tiles
        # (Tiling.expert_span) one tile after another.
        step = launch.expert_k_step or launch.k_step
        tiles = math.ceil((a["n1"] - a["n0"]) / launch.block_n)
        trips = math.ceil((a["k1"] - a["k0"]) / step) * (2 if op == OP_MOE_UP else 1) * tiles
        tile = (a["n1"] - a["n0"]) / tiles * step * (launch.expert_bytes or launch.weight_bytes)
        return trips * max(m.k_step, tile * m.programs / m.bandwidth) + 4 * m.l2
    if op == OP_ATTN_PARTIAL:
        return _keys(t, launch) * m.k_step + 2 * m.l2
    if op == OP_ARGMAX:
        return a["M"] * math.ceil(a["S"] / launch.block_r) * 2 * m.l2 + m.l2
    if op in (OP_EMBED, OP_ROPE_APPEND, OP_ATTN_MERGE):
        return 2 * m.l2
    return 4 * m.l2          # conv, delta rule, add-norm, MoE routing / sums: a few trips


def finale(t, graph: TaskGraph, launch: Launch, m: Machine) -> float:
    """Seconds of the finale a ticket group's last member runs after its body."""
    a = t.args
    if t.op == OP_ATTN_PARTIAL:
        return a["S"] * m.l2 / 4 + m.l2       # the S partials read together, then the output
    if a.get("stout", -1) >= 0:
        if launch.stats_tiles and a.get("stpart", -1) >= 0:    # the tiles' partials, a trip a chunk of them
            return math.ceil(a["stnt"] / launch.stats_tiles) * m.l2
        return 2 * math.ceil(a["stn"] / (launch.stats_chunk or launch.block_k)) * m.l2   # two passes over K
    if "fin" in a:                            # the heads' append rows, one after another
        return a["nfin"] * 2 * m.l2
    if t.op == OP_LINEAR_SPLIT:               # the slices' sum and the epilogue
        return a.get("ktickets", 2) * m.l2 / 4 + m.l2
    return 0.0


def simulate(graph: TaskGraph, launch: Launch, m: Machine) -> dict[str, Any]:
    """The launch's schedule: tasks claimed in order by the earliest free program; each starts when
    claimed and its counters are reached (+ observe); a ticket group's finale extends its last
    member. Returns the step's seconds and where they went."""
    free = [(0.0, p) for p in range(m.programs)]
    heapq.heapify(free)
    signalers: dict[str, list[int]] = {}      # counter -> the tasks so far that signal it
    release = [0.0] * len(graph.tasks)
    groups: dict[str, list[int]] = {}
    for i, t in enumerate(graph.tasks):
        for g in (t.ticket, t.kticket):
            if g is not None:
                groups.setdefault(g, []).append(i)
    remaining = {g: len(v) for g, v in groups.items()}
    end = [0.0] * len(graph.tasks)
    prog = [0] * len(graph.tasks)
    waited = 0.0
    ran = 0.0
    free_at = [0.0] * m.programs
    for i, t in enumerate(graph.tasks):
        if m.static:
            p = i % m.programs
            at = free_at[p]
        else:
            at, p = heapq.heappop(free)
        start = at + m.task
        ready = start
        for counter, target in t.waits:
            times = sorted(release[j] for j in signalers.get(counter, []))
            if len(times) >= target > 0:
                ready = max(ready, times[target - 1] + m.observe)
        waited += ready - start
        work = body(t, launch, m)
        ran += work
        end[i], prog[i] = ready + work, p
        done = end[i]
        for g in (t.kticket, t.ticket):
            if g is None:
                continue
            remaining[g] -= 1
            if remaining[g] == 0:             # the group's last member to finish runs its finale
                last = max(groups[g], key=lambda j: end[j])
                extra = finale(graph.tasks[last], graph, launch, m)
                end[last] += extra
                release[last] = end[last]     # it signals after its finale (signalled or not yet)
                if last == i:
                    done = end[i]
        release[i] = done
        if t.signal is not None:
            signalers.setdefault(t.signal, []).append(i)
        if m.static:
            free_at[p] = done
        else:
            heapq.heappush(free, (done, p))
    total = (max(end) if end else 0.0) + m.launch
    return dict(seconds=total, tasks=len(graph.tasks), programs=m.programs,
                run_share=ran / (total * m.programs) if total else 0.0,
                wait_share=waited / (total * m.programs) if total else 0.0)


def stats_row_chunk(batch: int, block_k: int, tile: int) -> int:
    """Elements of each row a statistics finale reads a trip in a build whose STATS_TILE is `tile`
    (kernel._task_row_stats, whose BLOCK_M is the batch: buckets are powers of two; 0: the first
    GPU run's build, BLOCK_K a row)."""
    if not tile:
        return block_k
    if batch == 1:
        return tile
    return max(block_k, min(tile // batch, 2 * block_k))


def launch_of(plan_graph: Any, tiling: Any, batch: int, positions: list[int], cross_len: list[int] | None,
              weight_bytes: int, k_step: int, block_r: int, stats_chunk: int = 0, stats_tiles: int = 0,
              **experts: int) -> Launch:
    """experts: expert_k_step, expert_bytes, expert_pairs (Launch), for graphs with MoE layers."""
    return Launch(k_step=k_step, block_k=tiling.block_k, block_t=tiling.block_t, block_r=block_r,
                  positions=tuple(positions), cross_len=None if cross_len is None else tuple(cross_len),
                  weight_bytes=weight_bytes, stats_chunk=stats_chunk, stats_tiles=stats_tiles, block_n=tiling.block_n,
                  **experts)


def distinct_experts(experts: int, top_k: int, rows: int) -> int:
    """Distinct experts `rows` rows choose, expected under uniform routing (each row top_k distinct)."""
    return min(rows * top_k, round(experts * (1 - (1 - top_k / experts) ** rows)))


def with_changes(m: Machine, **changes: Any) -> Machine:
    """A machine with some of its constants changed (a design change's prediction)."""
    return replace(m, **changes)


__all__ = ["Machine", "FITTED", "MEASURED_US", "Launch", "body", "finale", "simulate", "launch_of", "with_changes",
           "stats_row_chunk", "distinct_experts"]
