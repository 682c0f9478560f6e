"""What every op module is written against: the rule an op declares (OpRule) and the three contexts
its parts run in: Planning (checks and fusion decisions over the whole step graph), Lowering (the
task graph being built, and how a task finds the waits and the state regions it needs) and Eager
(the reference run's values). Nothing here knows an op.
"""
from __future__ import annotations

import struct
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from photon_core.kernels.linear import ACT_SIGMOID, ACT_TANH, activation_code
from photon_core.megakernel.graph import Region, TaskGraph
from photon_core.megakernel.stepgraph import CacheRef, Node, StepGraph, Value

if TYPE_CHECKING:
    from photon_core.megakernel.layout import Plan

NORMS = ("layer_norm", "rms_norm")   # fused in front of the linears that read them
FUSED = NORMS + ("glu", "mul", "act")   # no task of their own: a linear's loads compute them
NORM_CODES = {"layer_norm": 1, "rms_norm": 2}


def act_code(act: str | None) -> int:
    """The kernel's activation code, including the gate-only sigmoid and tanh."""
    return {"sigmoid": ACT_SIGMOID, "tanh": ACT_TANH}.get(act or "") or activation_code(act)


def float_bits(x: float) -> int:
    """An fp32 constant as the int32 the task table carries (the kernel bitcasts it back)."""
    return struct.unpack("<i", struct.pack("<f", x))[0]


@dataclass
class Planning:
    """What plan() learns walking the step graph once, op by op (each op's `plan` rule adds to it)."""
    graph: StepGraph
    block_n: int
    producer: dict[str, Node]                                # value name -> the node that defines it
    norm_of: dict[str, Node] = field(default_factory=dict)   # linear name -> the norm fused in front of it
    glu_of: dict[str, Node] = field(default_factory=dict)    # linear name -> the glu fused into its loads
    mul_of: dict[str, Node] = field(default_factory=dict)    # linear name -> the mul (x * act(g)) fused in
    act_of: dict[str, Node] = field(default_factory=dict)    # linear name -> the activation fused in
    qkv_store: dict[str, Node] = field(default_factory=dict)  # linear name -> the kv_append it stores for
    logits: dict[str, int] = field(default_factory=dict)     # linear name -> tiles, for linears argmax reads
    eps: set[float] = field(default_factory=set)             # every norm's epsilon (one per step)
    weight_offset: dict[str, float] = field(default_factory=dict)   # weight -> constant added when stored
    offset_readers: dict[str, set[int]] = field(default_factory=dict)   # weight -> nodes reading it so

    def fold_offset(self, node: Node, w: str, offset: float) -> None:
        """Weight `w` is stored as (offset + w) (RMSNorm's 1 + w), read so by `node` only."""
        if self.weight_offset.setdefault(w, offset) != offset:
            raise ValueError(f"{self.graph.name}: weight {w!r} read by norms with different offsets")
        self.offset_readers.setdefault(w, set()).add(id(node))


@dataclass
class Stage:
    """The tasks of one node as the waits of later tasks see them."""
    name: str
    counter: str | None                          # one counter for the whole stage
    heads: list[str] | None = None               # or one counter per attention head
    ancestors: frozenset[str] = field(default_factory=frozenset)


class Lowering:
    """The task graph of one step as it is built, and what an op's lower rule asks while adding its
    tasks: the waits on the stages that wrote a value, the ancestors of a new stage, the state
    regions of caches. A rule registers the stages it creates in `stage_of`."""

    def __init__(self, p: "Plan", nodes: list[Node]) -> None:
        self.p, self.graph, self.B = p, p.graph, p.batch
        self.bn, self.S, self.W = p.tiling.block_n, p.sarena, p.warena
        self.kept = {id(n) for n in nodes}
        self.g = TaskGraph(model=p.graph.name, batch=p.batch)
        B = p.batch
        self.dyn_tok, self.dyn_pos, self.dyn_xlen = Region("dyn", 0, B), Region("dyn", B, 2 * B), Region("dyn", 2 * B, 3 * B)
        self.dyn_rot = Region("dyn", 3 * B, 4 * B)
        self.stage_of: dict[str, Stage] = {}     # value name -> stage that wrote it

    def source(self, v: Value) -> Value:
        """What a read of `v` really reads: a fused LayerNorm's input."""
        n = self.p.producer.get(v.name)
        return n.args["x"] if n is not None and n.op in FUSED else v

    def waits(self, values: list[Value], head: int | None = None) -> list[tuple[str, int]]:
        stages: list[Stage] = []
        for v in values:
            st = self.stage_of.get(self.source(v).name)
            if st is not None and st not in stages:
                stages.append(st)
        stages = [s for s in stages if not any(s.name in o.ancestors for o in stages if o is not s)]
        out = []
        for s in stages:
            c = s.heads[head] if s.heads is not None and head is not None else s.counter
            if c is None:
                raise ValueError(f"{self.graph.name}: {s.name!r} signals per head, but a reader needs all of it")
            out.append((c, self.g.signalers(c)))
        if len(out) > 2:
            raise ValueError(f"{self.graph.name}: a task would wait on {len(out)} stages ({[c for c, _ in out]}); "
                             "the megakernel encodes two")
        return out

    def ancestors(self, values: Iterable[Value], name: str) -> frozenset[str]:
        anc = {name}
        for v in values:
            st = self.stage_of.get(self.source(v).name)
            if st is not None:
                anc |= st.ancestors
        return frozenset(anc)

    def per_head(self, value: Value) -> int | None:
        """Head size if every reader of `value` is attention with one K/V head per query head (then
        its writers may signal per head: a head's attention needs that head's q, k and v only)."""
        readers = [n for n in self.graph.consumers(value) if id(n) in self.kept]
        if readers and all(n.op == "attention" and n.args["k"].spec.heads * n.args["k"].spec.head_dim == value.width
                           for n in readers):
            return readers[0].args["k"].spec.head_dim
        return None

    def cache_cols(self, c: CacheRef, r: int, c0: int, c1: int) -> Region:
        """Features [c0, c1) (head-major: head h is [h*Dh, (h+1)*Dh)) of row r of a cache at ANY
        position: positions are dynamic, so cache accesses are declared position-free; two overlap
        exactly when they share a (row, feature) pair."""
        d = c.spec.heads * c.spec.head_dim
        return Region(f"{c.key}@cols", r * d + c0, r * d + c1)

    def cache_off(self, c: CacheRef) -> int:
        spec = c.spec
        layer = 0 if c.layer is None else c.layer * self.B * spec.heads * spec.length * spec.head_dim
        return self.S.toff(spec.name) + layer      # in elements of the cache's dtype

    def stats_finale(self, value: str) -> tuple[dict, dict]:
        """(task arguments, Task keywords) for every task of the stage that writes `value` when a
        fused norm reads it (Plan.stats), else ({}, {}). The stage's tasks share a ticket; the last
        of them to finish computes each row's (mean, rstd) over the whole value into
        "{value}.stats" before it signals. Chosen over a stats task per row (one more dependency
        level per norm) and over the first reading tile publishing them (a wait inside the reading
        stage): the readers already wait for the whole producer stage, so the statistics cost no
        level and no wait, only one task's pass over B*K values it (or its stage) just wrote."""
        p = self.p
        code = p.stats.get(value)
        if code is None:
            return {}, {}
        S, key, parts = p.sarena, f"{value}.stats", f"{value}.tstats"
        args = dict(stx=S.off(value), stn=p.shapes[value][1], stout=S.off(key), stkind=code)
        if parts in p.shapes:    # a linear's tiles leave partials (tile_stats): the finale merges those
            args.update(stpart=S.off(parts), stnt=p.shapes[parts][1])
        return args, dict(ticket=key, last_reads=[S.region(parts if parts in p.shapes else value)],
                          last_writes=[S.region(key)])

    def tile_stats(self, value: str, tiles: range) -> tuple[dict, list[Region]]:
        """(arguments, writes) of a task computing `tiles` (their indices) of a linear stage whose
        tiles leave their rows' partial statistics for its stats finale (kernel._tile_stats): the
        first tile's slot, and each tile's slot of each row's partials."""
        parts = f"{value}.tstats"
        if parts not in self.p.shapes:
            return {}, []
        B, nt, _ = self.p.shapes[parts]
        return dict(sttile=tiles[0]), [self.S.region(parts, (r * nt + j) * 3, (r * nt + j + 1) * 3)
                                       for j in tiles for r in range(B)]

    def stats_read(self, norm: Node | None) -> tuple[dict, list[Region]]:
        """(arguments, reads) of a linear / expert task with `norm` fused in front: where the norm's
        input has statistics (stats_finale), the offset the task reads them at."""
        p = self.p
        if norm is None or norm.args["x"].name not in p.stats:
            return dict(lnst=-1), []
        key = f"{norm.args['x'].name}.stats"
        return dict(lnst=p.sarena.off(key)), [p.sarena.region(key)]


def own_lists(kw: dict) -> dict:
    """Task keywords whose access lists the task owns: a ticket's finale accesses are shared by its
    group's members (the tiles of a head group, the slices of a tile) and must not alias."""
    return {k: list(v) if isinstance(v, list) else v for k, v in kw.items()}


@dataclass
class Eager:
    """One reference step's inputs and the values computed so far (run_reference)."""
    bsz: int
    dev: torch.device
    pos: torch.Tensor                        # [B] positions
    rot_pos: torch.Tensor                    # [B] rotary positions (position + offset)
    tokens: list[int]
    cross_len: list[int] | None
    weights: Mapping[str, torch.Tensor]
    caches: Mapping[str, torch.Tensor]
    inputs: Mapping[str, torch.Tensor] | None
    vals: dict[str, torch.Tensor] = field(default_factory=dict)
    results: dict[str, list[int]] = field(default_factory=dict)

    def cache(self, c: CacheRef) -> torch.Tensor:
        t = self.caches[c.spec.name]
        return t if c.layer is None else t[c.layer]

    def val(self, v: Value) -> torch.Tensor:
        return self.vals[v.name]

    def w(self, name: str | None) -> torch.Tensor | None:
        """A weight as fp32 (None for an absent optional weight)."""
        return None if name is None else self.weights[name].float()

    def weight(self, name: str) -> torch.Tensor:
        """A weight the op always has, as fp32."""
        return self.weights[name].float()


def eager_act(x: torch.Tensor, act: str | None) -> torch.Tensor:
    if act is None:
        return x
    if act == "tanh":        # the megakernel's Moondream 3 tau projection; not a contract activation
        return torch.tanh(x)
    from photon_core.backends import reference as ref
    return ref.activate(x, act)


@dataclass(frozen=True)
class OpRule:
    """One step-graph op, declared once. `reference(e, node)` returns the node's output ([B, width])
    in the eager run (None: it writes none, e.g. argmax's result column); `plan(pl, node)` checks the
    node against the graph and records fusion decisions; `lower(lo, node)` adds its tasks (None:
    fused into its readers' loads, no task of its own); `codes`: the kernel ops its tasks run
    (code -> name), each one the kernel's task body of that number (kernel._step_tasks)."""
    op: str
    reference: Callable[[Eager, Node], torch.Tensor | None]
    lower: Callable[[Lowering, Node], None] | None = None
    plan: Callable[[Planning, Node], None] | None = None
    codes: Mapping[int, str] = field(default_factory=dict)
    # kernel ops whose tasks may draw a tile ticket (Task.kticket: split-K slices; checker.check)
    kticket_codes: frozenset[int] = frozenset()
    # Arguments naming matrices its tasks stream by rows: plan() pads their rows to 16 elements
    # (aligned vector loads; kernel.py's tl.multiple_of hints).
    matrices: tuple[str, ...] = ()
    # Its stage's tasks cover the whole value, so the last of them can compute the rows' statistics
    # for a norm fused into the value's readers (Lowering.stats_finale; the rule writes its fields).
    stats_finale: bool = False
    # State regions of its own the op's tasks address beyond its value (name -> shape), from
    # `scratch(graph, node, batch, tiling)`: laid out right after the node's value, or with
    # `tail_scratch` after every value and the logits partials (where each lands is part of the
    # task table: both places are kept as they were when the compiler listed them).
    scratch: Callable[[StepGraph, Node, int, Any], dict[str, tuple[int, ...]]] | None = None
    tail_scratch: Callable[[StepGraph, Node, int, Any], dict[str, tuple[int, ...]]] | None = None
