"""The compiler: a model's step graph (stepgraph.py) -> megakernel tasks (graph.py) for one batch
bucket and tiling, the arenas they address, and the host object that owns them and launches a step.
Every family's decode step goes through here; nothing here knows a model.

Lowering, op by op:
  * embed       one task per BLOCK_N columns: token row (+ position row) into the value.
  * layer_norm  no task: fused in front of every linear that reads it (only linears may read one);
                the last task of its input's producer stage writes each row's (mean, rstd) once
                (stats_finale), or, without such a producer, every tile computes them;
                rms_norm, glu (act(gate) * up), mul (x * act(g)) and act likewise fuse into
                the loads of the linears that read them.
  * add_norm    one task per row: (x + rms_norm(z) * w) * scale, chunk by chunk.
  * linear      one task per tile of output columns, bias / activation / residual fused behind. A
                stage with fewer tiles than Tiling.min_tasks gets narrower tiles, then split-K: K
                slices write partial products to a scratch, and the last slice of each tile to
                finish (a ticket) sums them in a fixed order and runs the epilogue: no reduce
                task, no dependency level of its own (stage_shape decides, per stage). The
                store depends on the readers: a kv_append without rotary as the only reader makes it
                a q|k|v store (q into the query buffer, k and v straight into the caches at the row's
                position: no append task); an argmax reader makes it a logits store that also writes
                each tile's (max, first index) per row.
  * kv_append   one task per (row, head): per-head RMSNorm and rotary on q and k, q out, k and v
                into the caches (slot position % length for a ring cache). Where each group of
                heads sharing q|k|v tiles has at most Tiling.rope_finale_rows of them (batch 1),
                they are not tasks: the last of the group's q|k|v tiles to finish runs them (a
                ticket finale over rows of the task table that are never claimed), so the append
                costs no dependency level.
  * attention   split-KV partials per (row, head, split); the last of a (row, head)'s partials to
                finish merges them (a ticket: no merge task, no dependency level of its own).
  * conv_step   one task per tile of channels (all rows): the conv and its state shift in place.
  * delta_rule  one task per (row, value head): the state read, decayed, written and read again, then
                the gated per-head RMSNorm of the output.
  * argmax      one task per result column, over the tiles of the columns it covers.
  * moe         route tasks per row; expert tasks per routed (row, slot) pair and tile, of which
                only the batch's first pair choosing an expert reads it, for all rows choosing
                it (each chosen expert read once a step); sum tasks per row and tile (_lower_moe).

Dependencies come from the data flow: a task waits for the stages that produce what it reads, per
head where the producer signals per head (q|k|v tiles or rotary tasks whose only readers are
attention, tiles never straddling a head), so a head's attention starts as soon as its own q/k/v
are done. A wait already implied by another is dropped; at most two remain per task. Values are
single-assignment (each has its own region), so the only shared state is the KV caches, whose
accesses follow the data flow; checker.check proves the tasks race-free before anything runs.
"""
from __future__ import annotations

import contextlib

import math
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import torch

from photon_core.megakernel.graph import (BATCH_BUCKETS, DYN_SECTIONS, LEN_CROSS, LEN_SELF, MODE_LOGITS, MODE_PLAIN, MODE_QKV,
                                          OP_ADD_NORM, OP_ARGMAX, OP_ATTN_PARTIAL, OP_CONV_STEP,
                                          OP_DELTA_STEP, OP_MOE_DOWN, OP_MOE_ROUTE, OP_MOE_SUM, OP_MOE_UP,
                                          OP_EMBED, OP_LINEAR,
                                          OP_LINEAR_SPLIT, OP_ROPE_APPEND, Arena, Region,
                                          StateViews, Task, TaskGraph)
from photon_core.kernels.linear import ACT_SIGMOID, ACT_TANH, activation_code
from photon_core.megakernel.stepgraph import CacheRef, Node, StepGraph, Tau, Value



WEIGHT_ROW_ALIGN = 16   # elements; kernel.py's tl.multiple_of hints rely on it
WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
KV_DTYPES = (torch.float32, torch.bfloat16)
_cuda_kv_dtype = [torch.bfloat16]   # what a CompiledStep on CUDA gets when its caller names none


@contextlib.contextmanager
def cuda_kv_dtype(dtype: torch.dtype):
    """Steps built inside get KV caches in `dtype` on CUDA unless their caller names one: fidelity
    checks of families whose step classes do not pass `kv_dtype` (bench/gpu_proof.py) use fp32."""
    if dtype not in KV_DTYPES:
        raise ValueError(f"KV caches can be {KV_DTYPES}, not {dtype}")
    before, _cuda_kv_dtype[0] = _cuda_kv_dtype[0], dtype
    try:
        yield
    finally:
        _cuda_kv_dtype[0] = before
FP8 = torch.float8_e4m3fn
NORMS = ("layer_norm", "rms_norm")   # fused in front of the linears that read them
FUSED = NORMS + ("glu", "mul", "act")   # no task of their own: a linear's loads compute them
NORM_CODES = {"layer_norm": 1, "rms_norm": 2}


def act_code(act: str | None) -> int:
    """The kernel's activation code, including the gate-only sigmoid and tanh."""
    return {"sigmoid": ACT_SIGMOID, "tanh": ACT_TANH}.get(act) or activation_code(act)


@dataclass(frozen=True)
class Tiling:
    block_n: int = 32        # output columns per linear / embed task (the widest tile)
    block_k: int = 64        # K step inside a linear task
    block_t: int = 32        # keys per attention inner step
    self_splits: int = 4     # KV splits of self-attention (per row and head)
    cross_splits: int = 8    # KV splits of attention over host-filled ("cross") caches
    # A linear stage with fewer tiles than `min_tasks` (0: never) gets narrower tiles (down to
    # `min_block_n` columns), then splits K into up to `max_split_k` slices, so that every program
    # has work: on a GPU, min_tasks is about the number of programs (2 per SM).
    min_tasks: int = 0
    min_block_n: int = 16
    max_split_k: int = 8
    # A q|k|v linear runs its rotary / per-head-norm append's (row, head) tasks as finales of its
    # own tiles (the last tile of a head's q, k and v to finish does that head: no level of its
    # own) when each finale is at most this many (row, head) tasks (0: never). Larger batches keep
    # the append tasks, which run in parallel rather than one after another in one program.
    rope_finale_rows: int = 1


def stage_shape(n: int, k: int, tiling: Tiling, align: int | None = None, narrow: bool = True) -> tuple[int, int]:
    """(tile width, K slices) of a linear stage of n output columns over k inputs. Narrower tiles
    first (they read no extra bytes), split-K only if that is not enough (it adds a reduction).
    `align`: a size the width must divide (a head, so tiles can signal per head); `narrow=False`
    keeps block_n (argmax reads the stage on that tile grid)."""
    width, splits = tiling.block_n, 1
    if not tiling.min_tasks:
        return width, splits
    while (narrow and -(-n // width) < tiling.min_tasks and width // 2 >= tiling.min_block_n
           and (align is None or align % (width // 2) == 0)):
        width //= 2
    tiles = -(-n // width)
    if tiles < tiling.min_tasks:
        splits = max(1, min(tiling.max_split_k, -(-tiling.min_tasks // tiles), k // tiling.block_k))
    return width, splits


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
    shape: dict[str, tuple[int, int]]     # linear name -> (tile width, K slices)
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
    # writes each row's (mean, rstd) to "{name}.stats" ([B, 2]); see stats_finale.
    stats: dict[str, int] = field(default_factory=dict)
    # q|k|v linear name -> (its kv_append, that append's query heads grouped by the tiles they share):
    # the linear's tiles run the append's (row, head) tasks as ticket finales (Tiling.rope_finale_rows).
    rope_groups: dict[str, tuple[Node, list[list[int]]]] = field(default_factory=dict)


def qkv_head(node: Node, c: int) -> int:
    """The query head whose append task (kv_append `node`) reads column c of its q|k|v input."""
    dh, H, d = node.args["k"].spec.head_dim, node.args["k"].spec.heads, node.out.width
    return c // dh if c < d else (c - d) % (H * dh) // dh


def head_groups(node: Node, width: int) -> list[list[int]]:
    """The query heads of kv_append `node` joined by the `width`-column tiles of its q|k|v input:
    an append task (row, head h) reads q head h and, while h < K/V heads, k and v head h; a tile
    whose columns reach two heads joins their groups."""
    a = node.args
    parent = list(range(node.out.width // a["k"].spec.head_dim))

    def root(h: int) -> int:
        while parent[h] != h:
            h = parent[h]
        return h

    n = a["qkv"].width
    for n0 in range(0, n, width):
        heads = {qkv_head(node, c) for c in range(n0, min(n, n0 + width))}
        first = root(min(heads))
        for h in heads:
            parent[root(h)] = first
    groups: dict[int, list[int]] = {}
    for h in range(len(parent)):
        groups.setdefault(root(h), []).append(h)
    return sorted(groups.values())


def plan(graph: StepGraph, batch: int, tiling: Tiling = Tiling(), weight_dtype: torch.dtype = torch.float32,
         kv_dtype: torch.dtype = torch.float32, external: Iterable[str] = ()) -> Plan:
    """Check that the graph can be lowered and lay out its arenas (no memory is allocated): the
    weights arena in `weight_dtype` units (FP8 experts as bytes, their scales fp32, inside it), the
    fp32 state arena with the KV caches in `kv_dtype`. `external`: tables of lookup_tables(graph)
    left out of the arena (the step reads the caller's tensor in place)."""
    if weight_dtype not in WEIGHT_DTYPES or kv_dtype not in KV_DTYPES:
        raise ValueError(f"weights must be one of {WEIGHT_DTYPES} and KV caches one of {KV_DTYPES}")
    if batch not in BATCH_BUCKETS:
        raise ValueError(f"batch {batch} is not a bucket {BATCH_BUCKETS}; pad rows up to the next bucket")
    bn = tiling.block_n
    producer = {n.out.name: n for n in graph.nodes if n.out is not None}
    norm_of: dict[str, Node] = {}
    glu_of: dict[str, Node] = {}
    mul_of: dict[str, Node] = {}
    act_of: dict[str, Node] = {}
    weight_offset: dict[str, float] = {}
    offset_readers: dict[str, set[int]] = {}   # weight -> nodes reading it as an (offset + w) scale

    def fold_offset(node: Node, w: str, offset: float) -> None:
        if weight_offset.setdefault(w, offset) != offset:
            raise ValueError(f"{graph.name}: weight {w!r} read by norms with different offsets")
        offset_readers.setdefault(w, set()).add(id(node))

    qkv_store: dict[str, Node] = {}
    logits: dict[str, int] = {}
    eps = set()
    for node in graph.nodes:
        a = node.args
        if node.op in NORMS:
            eps.add(a["eps"])
            if node.op == "rms_norm" and a["offset"]:
                # (offset + w) is folded into the stored weight at load time.
                fold_offset(node, a["w"], a["offset"])
            for c in graph.consumers(node.out):
                if c.op not in ("linear", "moe") or c.args["x"] is not node.out or c.args["residual"] is node.out:
                    raise ValueError(f"{graph.name}: {node.op} {node.out.name!r} is read by {c.op} "
                                     f"{c.out.name if c.out else c.args.get('name')!r}: only a linear's input "
                                     "can take a fused LayerNorm")
                norm_of[c.out.name] = node
        elif node.op in ("glu", "mul", "act"):
            for arg in ("x", "g") if node.op == "mul" else ("x",):
                src = producer.get(a[arg].name)
                if src is not None and src.op in FUSED:
                    raise ValueError(f"{graph.name}: {node.op} {node.out.name!r} reads {src.op} "
                                     f"{src.out.name!r}; fused ops cannot be chained")
            for c in graph.consumers(node.out):
                if c.op != "linear" or c.args["x"] is not node.out or c.args["residual"] is node.out \
                        or c.out.name in norm_of:
                    raise ValueError(f"{graph.name}: {node.op} {node.out.name!r} is read by {c.op} "
                                     f"{c.out.name if c.out else c.args.get('name')!r}: only a linear's input "
                                     f"can take a fused {'GLU' if node.op == 'glu' else node.op}")
                {"glu": glu_of, "mul": mul_of, "act": act_of}[node.op][c.out.name] = node
        elif node.op == "add_norm":
            eps.add(a["eps"])
            if a["offset"]:
                fold_offset(node, a["w"], a["offset"])
        elif node.op in ("conv_step", "delta_rule"):
            if node.op == "delta_rule":
                eps.add(a["eps"])
            for arg in ("x", "zba"):
                src = producer.get(a[arg].name) if arg in a else None
                if src is not None and src.op in FUSED:
                    raise ValueError(f"{graph.name}: {node.op} {node.out.name!r} reads {src.op} "
                                     f"{src.out.name!r}, which is fused into linears only")
        elif node.op == "kv_append" and a["norm"] is not None:
            hn = a["norm"]
            eps.add(hn.eps)
            for w in (hn.q, hn.k):
                if w is not None and hn.offset:
                    fold_offset(node, w, hn.offset)
        elif node.op == "kv_append" and a["rotary"] is None and a["k"].spec.heads * a["k"].spec.head_dim == node.out.width \
                and not a["k"].spec.ring and a["tau"] is None and a["append"]:
            # The linear stores q|k|v itself only with as many K/V heads as query heads (the
            # kernel's q|k|v store); grouped-query K/V go through append tasks.
            src = producer.get(a["qkv"].name)
            readers = graph.consumers(src.out) if src is not None else []
            if src is not None and src.op == "linear" and len(readers) == 1 and readers[0] is node:
                qkv_store[src.out.name] = node
        elif node.op == "argmax":
            src = producer.get(a["x"].name)
            if src is None or src.op != "linear":
                raise ValueError(f"{graph.name}: argmax {a['name']!r} must read a linear's output")
            n = src.out.width
            if a["c0"] % bn or (a["c1"] % bn and a["c1"] != n):
                raise ValueError(f"{graph.name}: argmax {a['name']!r} over columns [{a['c0']}, {a['c1']}) "
                                 f"does not fall on the {bn}-column tiles")
            logits[src.out.name] = -(-n // bn)
    for name in set(norm_of) | set(glu_of) | set(mul_of) | set(act_of):
        if sum(name in d for d in (norm_of, glu_of, mul_of, act_of)) > 1:
            raise ValueError(f"{graph.name}: linear {name!r} would fuse two prologues (norm, glu, mul, act)")
    if len(eps) > 1:
        raise ValueError(f"{graph.name}: one LayerNorm epsilon per step, got {sorted(eps)}")
    for w in weight_offset:   # the stored weight is (offset + w): nothing else may read it
        others = [n for n in graph.nodes if id(n) not in offset_readers[w]
                  and (w in n.args.values() or (n.args.get("norm") is not None
                                                and w in (n.args["norm"].q, n.args["norm"].k)))]
        if others:
            raise ValueError(f"{graph.name}: weight {w!r} is an RMSNorm's (offset + w) and also read by "
                             f"{others[0].op} {others[0].out.name if others[0].out else ''!r}")

    # Matrices that linear and embed tasks read get rows padded to 16 elements (64 B in fp32, 32 B
    # in bf16): with aligned rows and offsets every weight load can be a 128-bit vector load.
    ldw = {}
    for n in graph.nodes:
        for key in ("w", "tok", "pos", "gate_up", "down"):
            w = n.args.get(key) if n.op in ("linear", "embed", "moe") else None
            if w is not None:
                ldw[w] = -(-graph.weight_shapes[w][-1] // WEIGHT_ROW_ALIGN) * WEIGHT_ROW_ALIGN
    external = set(external)
    if external - lookup_tables(graph):
        raise ValueError(f"{graph.name}: only token tables that embeds alone read can stay outside the arena, "
                         f"not {sorted(external - lookup_tables(graph))}")
    wa, sa = Arena("weights", unit=weight_dtype.itemsize), Arena("state")
    fp8 = graph.fp8_weights()
    if fp8 and any(not n.args["gate_up_scale"] for n in graph.nodes if n.op == "moe"):
        # the kernel is compiled for FP8 experts or float ones (kernel.step_tasks_for), not both
        raise ValueError(f"{graph.name}: all MoE layers of a step must have FP8 experts, or none")
    dtypes = {k: torch.uint8 for k in fp8} | {sc: torch.float32 for sc in fp8.values()}
    for k, shape in graph.weight_shapes.items():
        if k not in external:
            wa.alloc(k, math.prod(shape[:-1]) * ldw[k] if k in ldw else math.prod(shape), align=WEIGHT_ROW_ALIGN,
                     dtype=dtypes.get(k))
    wa.size = -(-wa.size // WEIGHT_ROW_ALIGN) * WEIGHT_ROW_ALIGN   # viewable as any element size
    shapes: dict[str, tuple[int, ...]] = {}
    fused_away = {n.args["qkv"].name for n in qkv_store.values()} | {n.out.name for n in graph.nodes
                                                                      if n.op in FUSED}
    for node in graph.nodes:
        if node.out is not None and node.out.name not in fused_away:
            shapes[node.out.name] = (batch, node.out.width)
        if node.op == "attention":
            spec = node.args["k"].spec
            splits = tiling.self_splits if node.args["length"] == "self" else tiling.cross_splits
            shapes[f"{node.out.name}.part"] = (batch, node.out.width // spec.head_dim, splits, spec.head_dim + 2)
    for name, ntiles in logits.items():
        shapes[f"{name}.part"] = (batch, ntiles, 2)
    for node in graph.nodes:
        if node.op == "moe":   # see _lower_moe
            k, (_, d, f) = node.args["top_k"], graph.weight_shapes[node.args["down"]]
            shapes[f"{node.out.name}.route"] = (batch, k, 2)        # per row: chosen (expert, weight)
            shapes[f"{node.out.name}.h"] = (batch * k, batch, f)    # pair j's expert, every row's hidden
            shapes[f"{node.out.name}.part"] = (batch, batch * k, d)  # row r's output from pair j's expert
            tiles = -(-f // tiling.block_n) + -(-d // tiling.block_n)
            shapes[f"{node.out.name}.loads"] = (batch * k, tiles)     # weight elements each expert task read
    shape: dict[str, tuple[int, int]] = {}
    for node in graph.nodes:
        if node.op != "linear":
            continue
        n, k = graph.weight_shapes[node.args["w"]]
        name = node.out.name
        written = qkv_store[name].out if name in qkv_store else node.out
        readers = [c for c in graph.consumers(written) if c.op == "attention"]
        align = readers[0].args["k"].spec.head_dim if readers else None
        shape[name] = stage_shape(n, k, tiling, align, narrow=name not in logits)
        if shape[name][1] > 1:
            shapes[f"{name}.kpart"] = (shape[name][1], batch, n)
    rope_groups = {}
    for node in graph.nodes:
        src = producer.get(node.args["qkv"].name) if node.op == "kv_append" else None
        if (src is None or src.op != "linear" or src.out.name in qkv_store or node.args["tau"] is not None
                or [id(c) for c in graph.consumers(src.out)] != [id(node)]):
            continue
        groups = head_groups(node, shape[src.out.name][0])
        if batch * max(map(len, groups)) <= tiling.rope_finale_rows:
            rope_groups[src.out.name] = (node, groups)
    for spec in graph.caches.values():
        shapes[spec.name] = ((spec.layers,) if spec.layers is not None else ()) + (
            batch, spec.heads, spec.length, spec.head_dim)
    for st in graph.states.values():
        shapes[st.name] = (batch,) + st.shape
    # Row statistics of normed values, written once by their producer's stage (a ticket finale)
    # rather than by every tile of every linear reading them: produced by tiles / rows that cover
    # the whole value (not q|k|v stores, attention, recurrent ops) and normed one way only.
    kinds: dict[str, set[int]] = {}
    for nrm in norm_of.values():
        kinds.setdefault(nrm.args["x"].name, set()).add(NORM_CODES[nrm.op])
    stats = {}
    for v, codes in kinds.items():
        src = producer.get(v)
        if len(codes) == 1 and src is not None and (src.op in ("embed", "moe", "add_norm") or (
                src.op == "linear" and src.out.name not in qkv_store)):
            stats[v] = codes.pop()
            shapes[f"{v}.stats"] = (batch, 2)
    for k, shp in shapes.items():
        sa.alloc(k, math.prod(shp), dtype=kv_dtype if k in graph.caches else None)

    # Positions must stay inside the caches (a ring takes any position) and the position tables;
    # rotary tables are checked with each row's rotary offset (set_rotary_offsets).
    limits = [spec.length for n in graph.nodes if n.op == "kv_append" for spec in (n.args["k"].spec,)
              if not spec.ring]
    limits += [graph.weight_shapes[n.args["pos"]][0] for n in graph.nodes if n.op == "embed" and n.args["pos"]]
    rotary = [graph.weight_shapes[n.args["rotary"].cos][0] for n in graph.nodes
              if n.op == "kv_append" and n.args["rotary"] is not None]
    return Plan(graph, batch, tiling, wa, sa, shapes, producer, norm_of, glu_of, mul_of, act_of, qkv_store, logits, shape,
                ldw, weight_offset, eps.pop() if eps else 1e-5, min(limits + rotary) if limits + rotary else 1 << 30,
                weight_dtype, kv_dtype, fp8, {k: (0, graph.weight_shapes[k][1]) for k in external}, stats,
                rope_groups)


def lookup_tables(graph: StepGraph) -> set[str]:
    """Token tables only embeds read (no linear reads them: not a tied LM head), whose rows the
    step can read in place from the caller's tensor: its row stride is the table's width, so where
    a position table shares the embed's stride the width must be the arena's 16-aligned one."""
    embeds = [n for n in graph.nodes if n.op == "embed"]
    toks = {n.args["tok"] for n in embeds}
    other = {v for n in graph.nodes if n.op != "embed" for v in n.args.values() if isinstance(v, str)}
    other |= {n.args["pos"] for n in embeds if n.args["pos"]}
    return {t for t in toks - other
            if all(n.args["pos"] is None or graph.weight_shapes[t][1] % WEIGHT_ROW_ALIGN == 0
                   for n in embeds if n.args["tok"] == t)}


# ---------------------------------------------------------------------------------------------------
# Lowering


def stats_finale(p: Plan, value: str) -> tuple[dict, dict]:
    """(task arguments, Task keywords) for every task of the stage that writes `value` when a fused
    norm reads it (Plan.stats), else ({}, {}). The stage's tasks share a ticket; the last of them
    to finish computes each row's (mean, rstd) over the whole value into "{value}.stats" before it
    signals. Chosen over a stats task per row (one more dependency level per norm) and over the
    first reading tile publishing them (a wait inside the reading stage): the readers already wait
    for the whole producer stage, so the statistics cost no level and no wait, only one task's
    pass over B*K values it (or its stage) just wrote."""
    code = p.stats.get(value)
    if code is None:
        return {}, {}
    S, key = p.sarena, f"{value}.stats"
    return (dict(stx=S.off(value), stn=p.shapes[value][1], stout=S.off(key), stkind=code),
            dict(ticket=key, last_reads=[S.region(value)], last_writes=[S.region(key)]))


def stats_read(p: Plan, norm: Node | None) -> tuple[dict, list[Region]]:
    """(arguments, reads) of a linear / expert task with `norm` fused in front: where the norm's
    input has statistics (stats_finale), the offset the task reads them at."""
    if norm is None or norm.args["x"].name not in p.stats:
        return dict(lnst=-1), []
    key = f"{norm.args['x'].name}.stats"
    return dict(lnst=p.sarena.off(key)), [p.sarena.region(key)]


@dataclass
class _Stage:
    """The tasks of one node as the waits of later tasks see them."""
    name: str
    counter: str | None                          # one counter for the whole stage
    heads: list[str] | None = None               # or one counter per attention head
    ancestors: frozenset[str] = field(default_factory=frozenset)


def lower(p: Plan, results: Iterable[str] | None = None) -> TaskGraph:
    """The task graph of one step; with `results`, only the tasks those result columns (and the
    graph's exposed values) need, over the same arenas."""
    graph, B, bn, S, W = p.graph, p.batch, p.tiling.block_n, p.sarena, p.warena
    nodes = _needed(graph, p, results)
    kept = {id(n) for n in nodes}
    g = TaskGraph(model=graph.name, batch=B)
    dyn_tok, dyn_pos, dyn_xlen = Region("dyn", 0, B), Region("dyn", B, 2 * B), Region("dyn", 2 * B, 3 * B)
    dyn_rot = Region("dyn", 3 * B, 4 * B)
    stage_of: dict[str, _Stage] = {}     # value name -> stage that wrote it

    def source(v: Value) -> Value:
        """What a read of `v` really reads: a fused LayerNorm's input."""
        n = p.producer.get(v.name)
        return n.args["x"] if n is not None and n.op in FUSED else v

    def waits(values: list[Value], head: int | None = None) -> list[tuple[str, int]]:
        stages = []
        for v in values:
            st = stage_of.get(source(v).name)
            if st is not None and st not in stages:
                stages.append(st)
        stages = [s for s in stages if not any(s.name in o.ancestors for o in stages if o is not s)]
        out = []
        for s in stages:
            c = s.heads[head] if s.heads is not None and head is not None else s.counter
            if c is None:
                raise ValueError(f"{graph.name}: {s.name!r} signals per head, but a reader needs all of it")
            out.append((c, g.signalers(c)))
        if len(out) > 2:
            raise ValueError(f"{graph.name}: a task would wait on {len(out)} stages ({[c for c, _ in out]}); "
                             "the megakernel encodes two")
        return out

    def ancestors(values: list[Value], name: str) -> frozenset[str]:
        anc = {name}
        for v in values:
            st = stage_of.get(source(v).name)
            if st is not None:
                anc |= st.ancestors
        return frozenset(anc)

    def per_head(value: Value) -> int | None:
        """Head size if every reader of `value` is attention with one K/V head per query head (then
        its writers may signal per head: a head's attention needs that head's q, k and v only)."""
        readers = [n for n in graph.consumers(value) if id(n) in kept]
        if readers and all(n.op == "attention" and n.args["k"].spec.heads * n.args["k"].spec.head_dim == value.width
                           for n in readers):
            return readers[0].args["k"].spec.head_dim
        return None

    def cache_cols(c: CacheRef, r: int, c0: int, c1: int) -> Region:
        """Features [c0, c1) (head-major: head h is [h*Dh, (h+1)*Dh)) of row r of a cache at ANY
        position: positions are dynamic, so cache accesses are declared position-free; two overlap
        exactly when they share a (row, feature) pair."""
        d = c.spec.heads * c.spec.head_dim
        return Region(f"{c.key}@cols", r * d + c0, r * d + c1)

    def cache_off(c: CacheRef) -> int:
        spec = c.spec
        layer = 0 if c.layer is None else c.layer * B * spec.heads * spec.length * spec.head_dim
        return S.toff(spec.name) + layer      # in elements of the cache's dtype

    for node in nodes:
        a = node.args
        if node.op == "input" or node.op in FUSED:
            continue
        if node.op == "embed":
            st = _Stage(node.out.name, g.counter(node.out.name), ancestors=frozenset({node.out.name}))
            d = node.out.width
            fa, fk = stats_finale(p, node.out.name)
            for n0 in range(0, d, bn):
                n1 = min(d, n0 + bn)
                g.add(Task(f"{node.out.name}[{n0}:{n1}]", OP_EMBED,
                           dict(M=B, N=d, n0=n0, w=p.external[a["tok"]][0] if a["tok"] in p.external else W.off(a["tok"]),
                                b=W.off(a["pos"]) if a["pos"] else -1,
                                ldw=p.external[a["tok"]][1] if a["tok"] in p.external else p.ldw[a["tok"]],
                                scale=float_bits(a["scale"]),
                                out=S.off(node.out.name), **fa),
                           [], st.counter, [dyn_tok, dyn_pos], S.columns(node.out.name, B, d, n0, n1), **fk))
            stage_of[node.out.name] = st
        elif node.op == "linear":
            stage_of.update(_lower_linear(p, g, node, waits, ancestors, per_head, cache_cols, cache_off,
                                          dyn_pos, dyn_rot))
        elif node.op == "kv_append":
            if node.out.name in stage_of:      # stored by its q|k|v linear, or run as its tiles' finales
                continue
            H = a["k"].spec.heads
            tau = a["tau"]
            signal_heads = per_head(node.out) is not None
            st = _Stage(node.out.name, None if signal_heads else g.counter(node.out.name),
                        [g.counter(f"{node.out.name}.h{h}") for h in range(H)] if signal_heads else None,
                        ancestors([a["qkv"]], node.out.name))
            wait = waits([a["qkv"]] + ([tau.value] if tau else []))
            for (r, h), t in _append_tasks(p, node, cache_cols, cache_off, dyn_pos, dyn_rot).items():
                t.waits, t.signal = list(wait), st.heads[h] if st.heads else st.counter
                g.add(t)
            stage_of[node.out.name] = st
        elif node.op == "add_norm":
            st = _Stage(node.out.name, g.counter(node.out.name),
                        ancestors=ancestors([a["x"], a["z"]], node.out.name))
            d = node.out.width
            fa, fk = stats_finale(p, node.out.name)
            for r in range(B):
                g.add(Task(f"{node.out.name}[b{r}]", OP_ADD_NORM,
                           dict(N=d, x=S.off(a["x"].name), res=S.off(a["z"].name), lnw=W.off(a["w"]),
                                sw=W.off(a["scale_w"]) if a["scale_w"] else -1, scale=float_bits(a["scale"]),
                                chunk=a["chunk"], bi=r, out=S.off(node.out.name), **fa),
                           waits([a["x"], a["z"]]), st.counter,
                           [S.region(a["x"].name, r * d, (r + 1) * d), S.region(a["z"].name, r * d, (r + 1) * d)],
                           [S.region(node.out.name, r * d, (r + 1) * d)], **fk))
            stage_of[node.out.name] = st
        elif node.op == "conv_step":
            st = _Stage(node.out.name, g.counter(node.out.name), ancestors=ancestors([a["x"]], node.out.name))
            C, taps = graph.weight_shapes[a["w"]]
            x, state = a["x"], a["state"].name
            for n0 in range(0, C, bn):
                n1 = min(C, n0 + bn)
                regions = [S.region(state, (r * C + n0) * (taps - 1), (r * C + n1) * (taps - 1)) for r in range(B)]
                g.add(Task(f"{node.out.name}[{n0}:{n1}]", OP_CONV_STEP,
                           dict(M=B, K=x.width, N=C, n0=n0, n1=n1, k0=a["c0"], x=S.off(x.name), w=W.off(a["w"]),
                                kc=S.off(state), Dh=taps, act=activation_code(a["act"]), out=S.off(node.out.name)),
                           waits([x]), st.counter,
                           S.columns(x.name, B, x.width, a["c0"] + n0, a["c0"] + n1) + regions,
                           S.columns(node.out.name, B, C, n0, n1) + regions))
            stage_of[node.out.name] = st
        elif node.op == "delta_rule":
            x, zba, state = a["x"], a["zba"], a["state"]
            hv, dk, dv = state.shape
            hk, c0 = a["k_heads"], a["c0"]
            st = _Stage(node.out.name, g.counter(node.out.name), ancestors=ancestors([x, zba], node.out.name))
            for r in range(B):
                for h in range(hv):
                    j = h // (hv // hk)
                    s0 = (r * hv + h) * dk * dv
                    reads = [S.region(x.name, r * x.width + j * dk, r * x.width + (j + 1) * dk),
                             S.region(x.name, r * x.width + (hk + j) * dk, r * x.width + (hk + j + 1) * dk),
                             S.region(x.name, r * x.width + 2 * hk * dk + h * dv, r * x.width + 2 * hk * dk + (h + 1) * dv),
                             S.region(zba.name, r * zba.width + c0 + h * dv, r * zba.width + c0 + (h + 1) * dv),
                             S.region(zba.name, r * zba.width + c0 + hv * dv + h, r * zba.width + c0 + hv * dv + h + 1),
                             S.region(zba.name, r * zba.width + c0 + hv * dv + hv + h,
                                      r * zba.width + c0 + hv * dv + hv + h + 1),
                             S.region(state.name, s0, s0 + dk * dv)]
                    g.add(Task(f"{node.out.name}[b{r},h{h}]", OP_DELTA_STEP,
                               dict(K=x.width, N=zba.width, k0=c0, x=S.off(x.name), res=S.off(zba.name),
                                    w=W.off(a["a_log"]), b=W.off(a["dt_bias"]), lnw=W.off(a["norm_w"]),
                                    kc=S.off(state.name), H=hk, ntiles=hv, Dh=dk, Tmax=dv, bi=r, hi=h,
                                    out=S.off(node.out.name)),
                               waits([x, zba]), st.counter, reads,
                               [S.region(state.name, s0, s0 + dk * dv),
                                S.region(node.out.name, (r * hv + h) * dv, (r * hv + h + 1) * dv)]))
            stage_of[node.out.name] = st
        elif node.op == "moe":
            stage_of.update(_lower_moe(p, g, node, waits, ancestors))
        elif node.op == "attention":
            stage_of[node.out.name] = _lower_attention(p, g, node, waits, ancestors, cache_cols, cache_off,
                                                       dyn_pos, dyn_xlen)
        elif node.op == "argmax":
            src = a["x"]
            ntiles = p.logits[src.name]
            t0, t1 = a["c0"] // bn, -(-a["c1"] // bn)
            col = graph.results.index(a["name"])
            R = len(graph.results)
            reads = [S.region(f"{src.name}.part", (r * ntiles + t0) * 2, (r * ntiles + t1) * 2) for r in range(B)]
            writes = [Region("out", r * R + col, r * R + col + 1) for r in range(B)]
            if a["advance"]:
                reads += [dyn_tok, dyn_pos]
                writes += [dyn_tok, dyn_pos]
            g.add(Task(f"argmax.{a['name']}", OP_ARGMAX,
                       dict(M=B, K=R, n0=a["c0"], out=col, tile=t0, part=S.off(f"{src.name}.part"),
                            ntiles=ntiles, S=t1 - t0, mode=1 if a["advance"] else 0, Tmax=p.max_position),
                       waits([src]), None, reads, writes))
        else:
            raise ValueError(f"{graph.name}: no lowering for op {node.op!r}")
    return g


def _own_lists(kw: dict) -> dict:
    """Task keywords whose access lists the task owns: a ticket's finale accesses are shared by its
    group's members (the tiles of a head group, the slices of a tile) and must not alias."""
    return {k: list(v) if isinstance(v, list) else v for k, v in kw.items()}


def _append_tasks(p: Plan, node: Node, cache_cols, cache_off, dyn_pos: Region,
                  dyn_rot: Region) -> dict[tuple[int, int], Task]:
    """kv_append's task per (row, query head), without waits or signal: per-head norms and rotary
    on q (and k), q out, k and v of K/V head h (h < K/V heads) into the caches."""
    S, W, B, a = p.sarena, p.warena, p.batch, node.args
    k, v = a["k"], a["v"]
    H, dh = k.spec.heads, k.spec.head_dim
    d = node.out.width                 # Hq * dh: query heads may outnumber K/V heads
    hq, row = d // dh, d + 2 * H * dh
    rot, tau, append, hn = a["rotary"], a["tau"], a["append"], a["norm"]
    qkv = a["qkv"].name
    if not append:
        row = d                        # q alone: nothing goes into the (shared) caches
    tasks = {}
    for h in range(hq):                # query head h; K/V head h too while h < H
        for r in range(B):
            reads = [S.region(qkv, r * row + h * dh, r * row + (h + 1) * dh), dyn_pos, dyn_rot]
            writes = [S.region(node.out.name, r * d + h * dh, r * d + (h + 1) * dh)]
            if tau:
                tv = tau.value.name
                reads += [S.region(tv, r * 2 * hq + h, r * 2 * hq + h + 1)]
                if h < H:
                    reads += [S.region(tv, r * 2 * hq + hq + h, r * 2 * hq + hq + h + 1)]
            if h < H and append:
                reads += [S.region(qkv, r * row + d + c * H * dh + h * dh, r * row + d + c * H * dh + (h + 1) * dh)
                          for c in range(2)]
                writes += [cache_cols(k, r, h * dh, (h + 1) * dh), cache_cols(v, r, h * dh, (h + 1) * dh)]
            tasks[(r, h)] = Task(f"{node.out.name}[b{r},h{h}]", OP_ROPE_APPEND,
                                 dict(K=rot.dims if rot else 0, N=d, x=S.off(qkv),
                                      w=W.off(rot.cos) if rot else -1, b=W.off(rot.sin) if rot else -1,
                                      out=S.off(node.out.name), kc=cache_off(k), vc=cache_off(v), H=H, Dh=dh,
                                      Tmax=k.spec.length, bi=r, hi=h, ring=int(k.spec.ring),
                                      lnw=W.off(hn.q) if hn is not None and hn.q else -1,
                                      lnb=W.off(hn.k) if hn is not None and hn.k else -1,
                                      norm=0 if hn is None else (hn.q is not None) | (hn.k is not None) << 1 | hn.v << 2,
                                      mode=0 if append else 1, tau=S.off(tau.value.name) if tau else -1,
                                      alpha=W.off(tau.alpha) if tau else -1),
                                 [], None, reads, writes)
    return tasks


def _append_finales(p: Plan, g: TaskGraph, name: str, ancestors: frozenset[str], per_head, cache_cols,
                    cache_off, dyn_pos: Region, dyn_rot: Region) -> tuple[_Stage, dict[int, tuple]]:
    """For a q|k|v linear in Plan.rope_groups: its append's stage, and per query head, what the
    tiles producing that head's columns carry: (task arguments, Task keywords, counter to signal).
    A group of heads shares a ticket whose finale runs the group's append rows (rows of the task
    table after the tasks, never claimed themselves)."""
    node, groups = p.rope_groups[name]
    tasks = _append_tasks(p, node, cache_cols, cache_off, dyn_pos, dyn_rot)
    out = node.out.name
    heads = per_head(node.out) is not None
    counters = [g.counter(f"{out}.g{i}") for i in range(len(groups))] if heads else None
    group_of = {h: i for i, grp in enumerate(groups) for h in grp}
    rst = _Stage(out, None if heads else g.counter(out),
                 [counters[group_of[h]] for h in sorted(group_of)] if heads else None, ancestors | {out})
    per_group = []
    for i, grp in enumerate(groups):
        rows = [tasks[(r, h)] for h in grp for r in range(p.batch)]
        per_group.append((dict(fin=len(g.rows), nfin=len(rows)),
                          dict(ticket=f"{out}.g{i}", last_reads=[x for t in rows for x in t.reads],
                               last_writes=[x for t in rows for x in t.writes]),
                          counters[i] if heads else rst.counter))
        g.rows += rows
    return rst, {h: per_group[group_of[h]] for h in group_of}


def _lower_linear(p: Plan, g: TaskGraph, node: Node, waits, ancestors, per_head, cache_cols, cache_off,
                  dyn_pos: Region, dyn_rot: Region) -> dict[str, _Stage]:
    """Tiles of the stage's width; with K slices, split tasks (partial products into the stage's
    scratch) of which the last of each tile sums them in a fixed order and runs the epilogue."""
    graph, B, S, W = p.graph, p.batch, p.sarena, p.warena
    a, name = node.args, node.out.name
    N, K = graph.weight_shapes[a["w"]]
    width, splits = p.shape[name]
    norm, glu, mul, xact = p.norm_of.get(name), p.glu_of.get(name), p.mul_of.get(name), p.act_of.get(name)
    fused = norm or glu or mul or xact
    x = fused.args["x"] if fused else a["x"]
    reads_of = ([mul.args["x"], mul.args["g"]] if mul else [a["x"]]) + (
        [a["residual"]] if a["residual"] is not None else [])
    st_args, st_reads = stats_read(p, norm)
    x_regions = [S.region(x.name)] + ([S.region(mul.args["g"].name)] if mul else []) + st_reads
    # The prologue's extra fields: a mul reads x's columns [c0, c0 + K) (row stride: x's width)
    # times act(g); an act applies its activation to the loads.
    pro = dict(xgate=S.off(mul.args["g"].name) if mul else -1, gact=act_code(mul.args["act"]) if mul else 0,
               xs=x.width if mul else -1, xc0=mul.args["c0"] if mul else 0,
               xact=act_code(xact.args["act"]) if xact else 0)
    kv = p.qkv_store.get(name)
    out = kv.out if kv is not None else node.out          # what the tiles write
    dh = per_head(out)
    signal_heads = dh is not None and dh % width == 0
    d = out.width
    heads = -(-d // dh) if signal_heads else 0
    finales, rope = None, p.rope_groups.get(name, (None,))[0]
    if rope is not None:   # the append's rows run as finales of these tiles (it alone reads them)
        st, finales = _append_finales(p, g, name, ancestors(reads_of, out.name), per_head, cache_cols, cache_off,
                                      dyn_pos, dyn_rot)
    else:
        st = _Stage(out.name, None if signal_heads else g.counter(out.name),
                    [g.counter(f"{out.name}.h{h}") for h in range(heads)] if signal_heads else None,
                    ancestors(reads_of, out.name))
    wait = waits(reads_of)
    mode = MODE_QKV if kv is not None else MODE_LOGITS if name in p.logits else MODE_PLAIN
    ntiles = -(-N // width)
    kpart = f"{name}.kpart"
    if splits > 1:
        step = -(-K // splits // p.tiling.block_k) * p.tiling.block_k   # slices on the K-step grid
        used = -(-K // step)
    for i, n0 in enumerate(range(0, N, width)):
        n1 = min(N, n0 + width)
        args = dict(M=B, K=K, N=N, n0=n0, n1=n1, k0=0, k1=K, x=S.off(x.name), w=W.off(a["w"]), ldw=p.ldw[a["w"]],
                    b=W.off(a["b"]) if a["b"] else -1,
                    lnw=W.off(norm.args["w"]) if norm else -1,
                    lnb=W.off(norm.args["b"]) if norm and norm.args.get("b") else -1,
                    norm=NORM_CODES[norm.op] if norm else 0, xglu=activation_code(glu.args["act"]) if glu else 0,
                    **pro, **st_args, act=act_code(a["act"]),
                    res=S.off(a["residual"].name) if a["residual"] is not None else -1,
                    mode=mode, out=S.off(out.name))
        fa, fk = stats_finale(p, out.name) if kv is None else ({}, {})
        args.update(fa)
        # The epilogue's accesses: the whole tile's, or the finale of the slices' ticket.
        reads = []
        if a["residual"] is not None:
            reads += S.columns(a["residual"].name, B, N, n0, n1)
        writes = []
        if mode == MODE_QKV:
            kc, vc = kv.args["k"], kv.args["v"]
            H, hd = kc.spec.heads, kc.spec.head_dim
            kvw = H * hd                       # d (the query width) may be a multiple of it
            args.update(kc=cache_off(kc), vc=cache_off(vc), H=H, Dh=hd, Tmax=kc.spec.length)
            reads.append(dyn_pos)
            for c0, c1, cache in ((0, d, None), (d, d + kvw, kc), (d + kvw, d + 2 * kvw, vc)):
                lo, hi = max(n0, c0), min(n1, c1)
                if lo >= hi:
                    continue
                if cache is None:
                    writes += S.columns(out.name, B, d, lo - c0, hi - c0)
                else:
                    writes += [cache_cols(cache, r, lo - c0, hi - c0) for r in range(B)]
        else:
            writes += S.columns(out.name, B, N, n0, n1)
        if mode == MODE_LOGITS:
            part = f"{name}.part"
            args.update(tile=i, part=S.off(part), ntiles=ntiles, rb=-1)
            writes += [S.region(part, (r * ntiles + i) * 2, (r * ntiles + i) * 2 + 2) for r in range(B)]
        if finales is not None:
            fa, fk, signal = finales[qkv_head(rope, n0)]
            args.update(fa)
        else:
            signal = st.heads[(n0 % d) // dh] if signal_heads else st.counter
        if splits == 1:
            g.add(Task(f"{name}[{n0}:{n1}]", OP_LINEAR, args, list(wait), signal, list(x_regions) + reads, writes,
                       **_own_lists(fk)))
            continue
        # Split-K: the tile's slices, each a partial product into its slot of the scratch; the last
        # of them to finish (the tile's ticket) sums the slots and runs the epilogue above.
        slots = [S.region(kpart, (ks * B + r) * N + n0, (ks * B + r) * N + n1) for ks in range(used) for r in range(B)]
        for ks, k0 in enumerate(range(0, K, step)):
            g.add(Task(f"{name}.split[{n0}:{n1},k{k0}]", OP_LINEAR_SPLIT,
                       dict(args, k0=k0, k1=min(K, k0 + step), kpart=S.off(kpart), ksplit=ks),
                       list(wait), signal, list(x_regions), slots[ks * B:(ks + 1) * B],
                       kticket=f"{name}.sum[{n0}:{n1}]", ksum_reads=slots + reads, ksum_writes=list(writes),
                       **_own_lists(fk)))
    return {st.name: st}


def _lower_moe(p: Plan, g: TaskGraph, node: Node, waits, ancestors) -> dict[str, _Stage]:
    """Four stages. Route: one task per row (top k of its logits, their weights). Up: one task per
    routed pair j = (row, slot) and tile of F; down: one per pair and tile of D. Every row's route
    is done before any expert task starts, so an up or down task of pair j sees the whole batch's
    routing: only if j is the FIRST pair choosing its expert e does it read e's weight tile, once
    per K step, for every row choosing e at once (the other tasks exit), so a step reads each
    chosen expert once however many rows chose it. Up writes h[j, row] ([B*k, B, F]); down writes
    the weighted partial part[row, j] ([B, B*k, D]). Sum: one task per row and tile of D adds the
    partials of the row's slots in slot order (deterministic: no atomics), + residual. Which pair
    writes which h / part rows depends on the routing, so each task's declared writes are its own
    slab j (all rows) and readers declare the slabs they may read: the checker proves the graph
    for every routing. Each expert task also writes the weight elements it loaded (0 if not the
    first) to its cell of `{name}.loads`: CompiledStep.expert_bytes_read counts them."""
    graph, B, S, W, bn = p.graph, p.batch, p.sarena, p.warena, p.tiling.block_n
    a, name = node.args, node.out.name
    E, F2, D = graph.weight_shapes[a["gate_up"]]
    F, k = F2 // 2, a["top_k"]
    P = B * k                                   # routed pairs
    tiles_f, tiles_d = -(-F // bn), -(-D // bn)
    norm = p.norm_of.get(name)
    x = norm.args["x"] if norm else a["x"]
    route, hid, part = Value(f"{name}.route", 2 * k), f"{name}.h", f"{name}.part"
    loads = f"{name}.loads"
    stages = {route.name: _Stage(route.name, g.counter(route.name), ancestors=ancestors([a["logits"]], route.name))}
    for r in range(B):
        g.add(Task(f"{route.name}[b{r}]", OP_MOE_ROUTE,
                   dict(N=E, x=S.off(a["logits"].name) + r * E, out=S.off(route.name) + r * 2 * k, S=k,
                        mode=int(a["renormalize"])),
                   waits([a["logits"]]), stages[route.name].counter,
                   [S.region(a["logits"].name, r * E, (r + 1) * E)], [S.region(route.name, r * 2 * k, (r + 1) * 2 * k)]))
    all_routes = S.region(route.name)
    # the new stages are visible to waits() only once registered
    up = _Stage(hid, g.counter(hid), ancestors=ancestors([x], hid) | stages[route.name].ancestors)
    st_args, st_reads = stats_read(p, norm)
    norm_args = dict(lnw=W.off(norm.args["w"]) if norm else -1,
                     lnb=W.off(norm.args["b"]) if norm and norm.args.get("b") else -1,
                     norm=NORM_CODES[norm.op] if norm else 0, **st_args)
    no_prologue = dict(xs=-1, xc0=0, xgate=-1, gact=0, xact=0, xglu=0)
    return_stages = dict(stages)
    route_st = stages[route.name]
    # x is ready once the route is, when the router read x (Moondream 3): then one wait.
    wait_up = [(route_st.counter, B)] + ([] if x.name in route_st.ancestors else waits([x]))
    for j in range(P):
        for t, n0 in enumerate(range(0, F, bn)):
            n1 = min(F, n0 + bn)
            cell = j * (tiles_f + tiles_d) + t
            g.add(Task(f"{hid}[p{j},{n0}:{n1}]", OP_MOE_UP,
                       dict(M=B, K=D, N=F, n0=n0, n1=n1, k0=0, k1=D, x=S.off(x.name), w=W.toff(a["gate_up"]),
                            wsc=W.toff(a["gate_up_scale"]) if a["gate_up_scale"] else -1,
                            ldw=p.ldw[a["gate_up"]], act=activation_code(a["act"]), scale=float_bits(a["up_offset"]),
                            tile=j, S=k, part=S.off(route.name), out=S.off(hid) + j * B * F,
                            loads=S.off(loads) + cell, **no_prologue, **norm_args),
                       list(wait_up), up.counter, [S.region(x.name), all_routes] + st_reads,
                       [S.region(hid, (j * B + r) * F + n0, (j * B + r) * F + n1) for r in range(B)]
                       + [S.region(loads, cell, cell + 1)]))
    return_stages[hid] = up
    down = _Stage(part, g.counter(part), ancestors=up.ancestors | {part})
    n_up = g.signalers(up.counter)
    for j in range(P):
        for t, n0 in enumerate(range(0, D, bn)):
            n1 = min(D, n0 + bn)
            cell = j * (tiles_f + tiles_d) + tiles_f + t
            g.add(Task(f"{part}[p{j},{n0}:{n1}]", OP_MOE_DOWN,
                       dict(M=B, K=F, N=D, n0=n0, n1=n1, k0=0, k1=F, x=S.off(hid) + j * B * F, w=W.toff(a["down"]),
                            wsc=W.toff(a["down_scale"]) if a["down_scale"] else -1, ldw=p.ldw[a["down"]],
                            tile=j, S=k, part=S.off(route.name), out=S.off(part) + j * D, loads=S.off(loads) + cell,
                            lnw=-1, lnb=-1, norm=0, **no_prologue),
                       [(up.counter, n_up)], down.counter, [S.region(hid, j * B * F, (j + 1) * B * F), all_routes],
                       [S.region(part, (r * P + j) * D + n0, (r * P + j) * D + n1) for r in range(B)]
                       + [S.region(loads, cell, cell + 1)]))
    return_stages[part] = down
    res = a["residual"]
    out = _Stage(name, g.counter(name), ancestors=down.ancestors | {name} | (
        ancestors([res], name) if res is not None else frozenset()))
    wait_sum = [(down.counter, g.signalers(down.counter))]
    if res is not None and res.name not in down.ancestors:
        wait_sum += waits([res])
    fa, fk = stats_finale(p, name)
    for r in range(B):
        for n0 in range(0, D, bn):
            n1 = min(D, n0 + bn)
            # any pair's partial for this row may be read (which ones: the routing's first pairs)
            reads = [S.region(part, r * P * D, (r + 1) * P * D), all_routes]
            if res is not None:
                reads.append(S.region(res.name, r * D + n0, r * D + n1))
            g.add(Task(f"{name}[b{r},{n0}:{n1}]", OP_MOE_SUM,
                       dict(M=1, N=D, n0=n0, n1=n1, bi=r, S=k, part=S.off(route.name), kpart=S.off(part), b=-1,
                            act=0, res=S.off(res.name) + r * D if res is not None else -1, mode=MODE_PLAIN,
                            out=S.off(name) + r * D, **fa),
                       list(wait_sum), out.counter, reads, [S.region(name, r * D + n0, r * D + n1)], **fk))
    return_stages[name] = out
    return return_stages


def _lower_attention(p: Plan, g: TaskGraph, node: Node, waits, ancestors, cache_cols, cache_off,
                     dyn_pos: Region, dyn_xlen: Region) -> _Stage:
    B, S = p.batch, p.sarena
    a, name = node.args, node.out.name
    k, v, q = a["k"], a["v"], a["q"]
    H, dh = k.spec.heads, k.spec.head_dim
    d = node.out.width
    hq = d // dh                         # query heads; head h reads K/V head h // (hq / H)
    self_len = a["length"] == "self"
    splits = p.tiling.self_splits if self_len else p.tiling.cross_splits
    part = f"{name}.part"
    # No merge tasks: the last partial of each (row, head) to finish merges (a ticket per (row,
    # head)), so the stage's counter, which every partial signals, is complete only once every
    # merge is done, and the attention costs one dependency level instead of two.
    st = _Stage(name, g.counter(name), ancestors=ancestors([q], name))
    for r in range(B):
        for h in range(hq):
            hk = h // (hq // H)
            wait = waits([q], head=h)
            b0 = (r * hq + h) * splits * (dh + 2)
            merge_reads = [S.region(part, b0, b0 + splits * (dh + 2))]
            merge_writes = [S.region(name, r * d + h * dh, r * d + (h + 1) * dh)]
            for s in range(splits):
                p0 = b0 + s * (dh + 2)
                g.add(Task(f"{name}.part[b{r},h{h},s{s}]", OP_ATTN_PARTIAL,
                           dict(x=S.off(q.name), K=d, N=hq, tile=hk, kc=cache_off(k), vc=cache_off(v), H=H,
                                Dh=dh, Tmax=k.spec.length, part=S.off(part), bi=r, hi=h, s=s, S=splits,
                                out=S.off(name), lenkind=LEN_SELF if self_len else LEN_CROSS,
                                window=a["window"] or 0, ring=int(k.spec.ring),
                                scale=-1 if a["scale"] is None else float_bits(a["scale"])),
                           wait, st.counter,
                           [S.region(q.name, r * d + h * dh, r * d + (h + 1) * dh),
                            cache_cols(k, r, hk * dh, (hk + 1) * dh), cache_cols(v, r, hk * dh, (hk + 1) * dh),
                            dyn_pos if self_len else dyn_xlen],
                           [S.region(part, p0, p0 + dh + 2)],
                           ticket=f"{name}.merge[b{r},h{h}]", last_reads=list(merge_reads),
                           last_writes=list(merge_writes)))
    return st


def float_bits(x: float) -> int:
    """An fp32 constant as the int32 the task table carries (the kernel bitcasts it back)."""
    return struct.unpack("<i", struct.pack("<f", x))[0]


def _needed(graph: StepGraph, p: Plan, results: Iterable[str] | None) -> list[Node]:
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


# ---------------------------------------------------------------------------------------------------
# The host object


class CompiledStep(StateViews):
    """A step graph compiled for one batch bucket, bound to its buffers.

    Buffers: the weights arena (fp32, or bf16/fp16 to halve the bytes a step streams; math stays
    fp32), the fp32 state arena (values, caches, partials), the int32 dyn buffer [tokens, positions,
    cross lengths] and the int32 results [B, len(graph.results)]. Every step-dependent value is read
    from device memory, so a launch can be captured in a CUDA graph and replayed.
        step = CompiledStep(graph, weights, batch=1)
        step.set_step(tokens, positions); step.launch(); step.result("token"); step.view("logits")
    `launch(results=(...))` runs the pruned task graph that computes only those result columns.
    """

    # A step is often built lazily inside a request run under torch.inference_mode (a batch's first
    # use of a bucket): its arenas must still be ordinary tensors, which requests outside that mode
    # (a streamed caption) write in place. So are the buffers of the kernels built on first use.
    @torch.inference_mode(False)
    def __init__(self, graph: StepGraph, weights: Mapping[str, torch.Tensor], batch: int,
                 tiling: Tiling = Tiling(), weight_dtype: torch.dtype = torch.float32,
                 shared_weights: torch.Tensor | None = None, check: bool = True,
                 device: torch.device | str | None = None, kv_dtype: torch.dtype | None = None,
                 read_in_place: Iterable[str] = ()) -> None:
        self.graph_def, self.batch, self.tiling = graph, batch, tiling
        dev = torch.device(device) if device is not None else next(iter(weights.values())).device
        # bf16 KV on a GPU halves the cache bytes each step reads; fp32 elsewhere (fidelity tests)
        kv_dtype = kv_dtype or (_cuda_kv_dtype[0] if dev.type == "cuda" else torch.float32)
        # Tables only looked up (token embeddings, Gemma 4's per-layer inputs: 262144 x 8960) named in
        # `read_in_place` are read from the caller's tensor, not copied: no second copy of gigabytes.
        # The task table then holds their offsets from this arena, so the arena must not be swapped
        # for another (e.g. a dtype-converted copy) afterwards.
        external = set(read_in_place)
        for k in external:
            t = weights.get(k)
            if k not in lookup_tables(graph) or t is None or t.dtype != weight_dtype or t.dim() != 2 \
                    or t.stride(1) != 1 or t.device.type != dev.type or dev.index not in (None, t.device.index):
                raise ValueError(f"{graph.name}: {k!r} can be read in place only if embeds alone read it and the "
                                 f"caller holds it row-major on {dev} in {weight_dtype}")
        self.plan = p = plan(graph, batch, tiling, weight_dtype, kv_dtype, external)
        self.warena = p.warena
        self.external = {k: weights[k] for k in external}
        missing = set(graph.weight_shapes) - set(weights)
        if missing:
            raise KeyError(f"{graph.name}: weights missing: {sorted(missing)[:8]}")
        if shared_weights is not None:
            # Another bucket's arena: the layout does not depend on the batch, so every bucket of
            # one model streams one copy of the weights.
            if shared_weights.numel() != p.warena.size or shared_weights.dtype != weight_dtype:
                raise ValueError("shared weight arena does not match this graph's layout and dtype")
            self.weights = shared_weights
        else:
            self.weights = torch.zeros(p.warena.size, dtype=weight_dtype, device=dev)
            for k, shape in graph.weight_shapes.items():
                if k in external:
                    continue
                t = weights[k]
                if tuple(t.shape) != shape:
                    raise ValueError(f"{graph.name}: weight {k!r} has shape {tuple(t.shape)}, the graph says {shape}")
                if k in p.fp8 and t.dtype != FP8:
                    raise ValueError(f"{graph.name}: {k!r} is an FP8 expert table (it has scales), got {t.dtype}")
                t = t.detach().float() + p.weight_offset[k] if k in p.weight_offset else t.detach()
                # copied as stored: FP8 bytes stay bytes (1 byte a weight), scales fp32
                self.weight(k).copy_(t.to(dev))
        # Offsets of the external tables from the arena's start (the kernel adds them to its weights
        # pointer); the step keeps the tensors alive.
        for k, t in self.external.items():
            if tuple(t.shape) != graph.weight_shapes[k]:
                raise ValueError(f"{graph.name}: weight {k!r} has shape {tuple(t.shape)}, the graph says "
                                 f"{graph.weight_shapes[k]}")
            p.external[k] = ((t.data_ptr() - self.weights.data_ptr()) // t.element_size(), t.stride(0))
        self.sarena, self.shapes = p.sarena, p.shapes
        self.state = torch.zeros(p.sarena.size, dtype=torch.float32, device=dev)
        self.dyn = torch.zeros(DYN_SECTIONS * batch, dtype=torch.int32, device=dev)
        self.out = torch.zeros(batch * max(1, len(graph.results)), dtype=torch.int32, device=dev)
        self.check = check
        self._kernels: dict[frozenset[str] | None, object] = {}
        self.kernel_for(None)   # build and prove the full graph at load time

    def weight(self, key: str) -> torch.Tensor:
        """A weight as the arena holds it (matrices without their row padding): a view, so writes
        change what the next launch reads."""
        if key in self.external:
            return self.external[key]
        shape = self.graph_def.weight_shapes[key]
        flat = self.warena.typed(self.weights, key)
        if key in self.plan.fp8:
            flat = flat.view(FP8)
        if key in self.plan.ldw:
            rows = math.prod(shape[:-1])
            return flat[:rows * self.plan.ldw[key]].view(rows, self.plan.ldw[key])[:, :shape[-1]].view(shape)
        return flat[:math.prod(shape)].view(shape)

    def view(self, key: str) -> torch.Tensor:
        """A value, cache or exposed value (by its exposed name) as a tensor view of the state."""
        exposed = self.graph_def.exposed.get(key)
        return super().view(exposed.name if exposed is not None else key)

    @torch.inference_mode(False)
    def kernel_for(self, results: Iterable[str] | None = None):
        """The megakernel of the whole step, or of the part that computes `results`."""
        key = None if results is None else frozenset(results)
        if key not in self._kernels:
            from photon_core.megakernel.kernel import Megakernel, step_tasks_for
            p, tl = self.plan, self.tiling
            specs = list(self.graph_def.caches.values())
            # The delta rule holds a value head ([Dv]) in one block, like an attention head.
            dims = [s.head_dim for s in specs] + [st.shape[-1] for st in self.graph_def.states.values()]
            self._kernels[key] = Megakernel(
                lower(p, key), self.weights, self.state, self.dyn, self.out, block_m=self.batch,
                block_n=tl.block_n, block_k=tl.block_k, block_t=tl.block_t,
                head_dim=max(dims, default=16),
                max_splits=max([tl.self_splits, tl.cross_splits] + [n.args["top_k"] for n in self.graph_def.nodes
                                                                     if n.op == "moe"]),
                max_tiles=max(p.logits.values(), default=1),
                ln_eps=p.ln_eps, run_task=step_tasks_for(p.kv_dtype == torch.bfloat16, bool(p.fp8)))
        return self._kernels[key]

    @property
    def kernel(self):
        return self.kernel_for(None)

    @property
    def graph(self) -> TaskGraph:
        """The full step's task graph."""
        return self.kernel.graph

    def set_step(self, tokens: list[int] | torch.Tensor | None, positions: list[int] | torch.Tensor) -> None:
        """Each row's token (None: the graph takes no token) and position."""
        B = self.batch
        pos = torch.as_tensor(positions, dtype=torch.int32)
        if pos.numel() != B or int(pos.min()) < 0 or int(pos.max()) >= self.plan.max_position:
            raise ValueError(f"need {B} positions in [0, {self.plan.max_position})")
        if tokens is not None:
            tok = torch.as_tensor(tokens, dtype=torch.int32)
            if tok.numel() != B:
                raise ValueError(f"need {B} tokens")
            self.dyn[:B] = tok.to(self.dyn.device)
        self.dyn[B:2 * B] = pos.to(self.dyn.device)

    def set_rotary_offsets(self, offsets: list[int] | torch.Tensor) -> None:
        """Each row's rotary offset: rotary tables are read at position + offset (0 by default).
        Offsets are <= 0 (multimodal positions run behind the cache position), so the range check
        of positions (set_step, and `advance` on the device) covers the rotary tables too."""
        B = self.batch
        off = torch.as_tensor(offsets, dtype=torch.int32)
        pos = self.dyn[B:2 * B].cpu()
        if off.numel() != B or int(off.max()) > 0 or int((pos + off).min()) < 0:
            raise ValueError(f"need {B} rotary offsets <= 0 keeping position + offset >= 0")
        self.dyn[3 * B:4 * B] = off.to(self.dyn.device)

    def set_cross_len(self, lengths: list[int]) -> None:
        self.dyn[2 * self.batch:3 * self.batch] = torch.tensor(lengths, dtype=torch.int32)

    def set_input(self, name: str, value: torch.Tensor) -> None:
        view = self.view(name)
        view.copy_(value.to(torch.float32).expand_as(view))

    def launch(self, results: Iterable[str] | None = None) -> None:
        kernel = self.kernel_for(results)
        kernel.launch()
        if self.check:
            kernel.raise_on_error()

    def result(self, name: str) -> torch.Tensor:
        """Result column `name` of the last step, [B] int32 on the device. With `advance`, -1 marks
        a row whose context is full (its position stayed where it was)."""
        R = len(self.graph_def.results)
        return self.out.view(self.batch, R)[:, self.graph_def.results.index(name)]

    def sparse_scratch(self) -> set[str]:
        """State regions a launch may leave partly unwritten by design, never reading what it leaves:
        split-K partial slots a stage does not use, and a MoE layer's per-pair slabs ({name}.h,
        {name}.part) in the rows that did not choose that pair's expert."""
        moe = [n.out.name for n in self.graph_def.nodes if n.op == "moe"]
        sparse = {f"{m}.{part}" for m in moe for part in ("h", "part")}
        return {k for k in self.sarena.regions if k.endswith(".kpart") or k in sparse}

    def expert_bytes_read(self) -> dict[str, int]:
        """Per MoE layer, the expert bytes (weights, and FP8 row scales) the last launch read, from
        the kernel's own record: every expert task writes the weight elements it loaded (0 when
        another pair of the batch chose the same expert first). Reading each chosen expert once,
        this is (distinct experts chosen) x (bytes of one expert)."""
        out = {}
        for n in self.graph_def.nodes:
            if n.op != "moe":
                continue
            _, f2, d = self.graph_def.weight_shapes[n.args["gate_up"]]
            cells = self.view(f"{n.out.name}.loads")
            tiles_f = -(-(f2 // 2) // self.tiling.block_n)
            up, down = cells[:, :tiles_f].sum().item(), cells[:, tiles_f:].sum().item()
            if n.args["gate_up_scale"]:   # a byte a weight, and 4 bytes of scale per weight row
                out[n.out.name] = round(up + down + 4 * (up / d + down / (f2 // 2)))
            else:
                out[n.out.name] = round((up + down) * self.weights.element_size())
        return out

    def weight_bytes_per_step(self, skip: tuple[str, ...] = ()) -> int:
        return self.graph_def.weight_bytes(self.weights.element_size(), skip, rows=self.batch)
