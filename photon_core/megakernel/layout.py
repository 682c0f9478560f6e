"""What the compiler decides for one step graph, batch bucket and tiling, as data: the tiling
(Tiling) and the plan (Plan: the arenas, the shapes, what fuses into which linear). Its own module
so that the op rules (ops/) that read a plan and the compiler that makes one both depend on it,
and on nothing of each other's."""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from photon_core.megakernel.graph import Arena
from photon_core.megakernel.stepgraph import Node, StepGraph, Tau, Value


@dataclass(frozen=True)
class Tiling:
    block_n: int = 32        # output columns per linear / embed task (the widest tile)
    block_k: int = 64        # K step inside a linear task
    block_t: int = 64        # keys per attention inner step (a step's K and V tiles are in flight at
                             # once: 16 KB at head dim 64 in bf16; kernel.ATTN_TILE caps it for wide heads)
    self_splits: int = 4     # KV splits of self-attention (per row and head)
    cross_splits: int = 8    # KV splits of attention over host-filled ("cross") caches
    # Either split count halves while the attention stage keeps at least this many (row, head,
    # split) tasks (ops.attention.attention_splits; 0: never): at batch 8 the (row, head) pairs
    # alone fill the GPU, and a split only adds a task's fixed cost and a merge.
    attn_min_tasks: int = 128
    # A linear stage with fewer tiles than `min_tasks` (0: never) gets narrower tiles (down to
    # `min_block_n` columns), then splits K into up to `max_split_k` slices, so that every program
    # has work: on a GPU, min_tasks is about the number of programs (2 per SM).
    min_tasks: int = 0
    min_block_n: int = 16
    max_split_k: int = 8
    # A dense linear task computes up to `linear_span` block_n tiles one after another (its claim,
    # header, waits and fields paid once for them), the span halving while the stage would have
    # fewer than `linear_min_tasks` tasks (or a task would reach past a head its readers wait on
    # alone). Stages of narrowed tiles or K slices keep one tile a task.
    linear_span: int = 1
    linear_min_tasks: int = 128
    # A q|k|v linear runs its rotary / per-head-norm append's (row, head) tasks as finales of its
    # own tiles (the last tile of a head's q, k and v to finish does that head: no level of its
    # own) when each finale is at most this many (row, head) tasks (0: never). Larger groups keep
    # the append tasks, which run in parallel rather than one after another in one program. 8: a
    # head's rows at batch 8 (Moondream 2: 8 rows of one head a finale; 6144 append tasks a step
    # at 1, each paying a task's fixed cost; the cost model: batch 8 3589 -> 3194 us, and 2757 ->
    # 2655 us were a task's fixed cost 1 us, not the fitted 5: bench/RESULTS.md).
    rope_finale_rows: int = 8
    # An MoE expert task computes up to `expert_span` block_n column tiles of its pair, one after
    # another: its fixed cost (claim, header, waits, the routing read), about half of an expert
    # task's modelled time at one tile, is paid once for all of them. The span halves while a
    # stage would have fewer than `expert_min_tasks` tasks (the routed pairs' tasks: an H100 /
    # H200 has 132 SMs, one program each under Triton 3.3-3.7), so that every SM still has an
    # expert tile to stream. 1 (one tile a task) until a GPU measures 4: the cost model predicts
    # Moondream 3.1 at 4 1.2-1.6x faster at batch 1 and 8 (bench/RESULTS.md), but the builds that
    # loop over tiles hold more registers (kernel.XTILES; sm_90 SASS: no spill inside a K loop,
    # 0-136 B of stack outside them where the one-tile builds have 0-40).
    expert_span: int = 1
    expert_min_tasks: int = 128


@dataclass
class Plan:
    """Where everything lives and how each node is lowered, for one graph, batch and tiling."""
    graph: StepGraph
    batch: int
    tiling: Tiling
    warena: Arena
    sarena: Arena
    shapes: dict[str, tuple[int, ...]]
    producer: dict[str, Node]             # value name -> the node that defines it
    norm_of: dict[str, Node]              # linear name -> the layer_norm fused in front of it
    glu_of: dict[str, Node]               # linear name -> the glu fused into its loads of x
    mul_of: dict[str, Node]               # linear name -> the mul (x * act(g)) fused into its loads of x
    act_of: dict[str, Node]               # linear name -> the activation fused into its loads of x
    qkv_store: dict[str, Node]            # linear name -> the kv_append it stores for
    logits: dict[str, int]                # linear name -> tiles, for linears argmax reads
    shape: dict[str, tuple[int, int, int]]   # linear name -> (tile width, K slices, tiles a task)
    ldw: dict[str, int]                   # weight name -> padded row stride (matrices tasks stream)
    weight_offset: dict[str, float]       # weight name -> constant added when stored (RMSNorm 1 + w)
    ln_eps: float
    max_position: int                     # positions must stay below this
    weight_dtype: torch.dtype = torch.float32
    kv_dtype: torch.dtype = torch.float32   # the KV caches' (stores round to it; reads convert to fp32)
    fp8: dict[str, str] = field(default_factory=dict)   # FP8 expert table -> its row scales
    # Lookup-only tables read in place from the caller's tensor, not copied into the arena: name ->
    # (element offset from the arena's start, row stride), set by CompiledStep (0 until bound).
    external: dict[str, tuple[int, int]] = field(default_factory=dict)
    # Values that feed fused norms of one kind (name -> norm code) whose producer stage's last task
    # writes each row's (mean, rstd) to "{name}.stats" ([B, 2]); see ops.base.Lowering.stats_finale.
    stats: dict[str, int] = field(default_factory=dict)
    # q|k|v linear name -> (its kv_append, that append's query heads grouped by the tiles they share):
    # the linear's tiles run the append's (row, head) tasks as ticket finales (Tiling.rope_finale_rows).
    rope_groups: dict[str, tuple[Node, list[list[int]]]] = field(default_factory=dict)


def needed_nodes(graph: StepGraph, p: Plan, results: Iterable[str] | None) -> list[Node]:
    """The nodes the chosen results and the exposed values depend on, in graph order."""
    if results is None:
        return list(graph.nodes)
    results = set(results)
    unknown = results - set(graph.results)
    if unknown:
        raise KeyError(f"{graph.name}: no results {sorted(unknown)}; it has {graph.results}")
    want = [n for n in graph.nodes if n.op == "argmax" and n.args["name"] in results]
    want += [p.producer[v.name] for v in graph.exposed.values()]
    keep: set[int] = set()
    while want:
        n = want.pop()
        if id(n) in keep:
            continue
        keep.add(id(n))
        for arg in n.args.values():
            if isinstance(arg, Tau):   # kv_append's tau reads a value too
                arg = arg.value
            if isinstance(arg, Value) and arg.name in p.producer:
                want.append(p.producer[arg.name])
    return [n for n in graph.nodes if id(n) in keep]
