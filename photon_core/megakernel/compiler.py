"""The compiler: a model's step graph (stepgraph.py) -> megakernel tasks (graph.py) for one batch
bucket and tiling, the arenas they address, and the host object that owns them and launches a step.
Every family's decode step goes through here; nothing here knows a model.

Each op's planning and lowering rules live in its module under ops/ (ops/__init__.py lists them):
plan() walks the graph once asking each node's rule (checks, what fuses into which linear), then
lays out the arenas; lower() asks each node's rule for its tasks, in graph order. Ops without a
lowering rule (layer_norm, rms_norm, glu, mul, act, input) have no task: the first five fuse into
the loads of the linears that read them (ops/fused.py).

Dependencies come from the data flow: a task waits for the stages that produce what it reads, per
head where the producer signals per head (q|k|v tiles or rotary tasks whose only readers are
attention, tiles never straddling a head), so a head's attention starts as soon as its own q/k/v
are done. A wait already implied by another is dropped; at most two remain per task. Values are
single-assignment (each has its own region), so the only shared state is the KV caches, whose
accesses follow the data flow; checker.check proves the tasks race-free before anything runs.
A kernel's proven graph and encoded table are kept on disk (build_cache.py): a later start of the
same step reads them instead of lowering, checking and encoding again.
"""
from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable, Mapping
from typing import Any, ContextManager

import torch

from photon_core.megakernel import ops
from photon_core.megakernel.graph import BATCH_BUCKETS, DYN_SECTIONS, Arena, CacheLayout, StateViews, TaskGraph
from photon_core.megakernel.layout import Plan, Tiling, needed_nodes
from photon_core.megakernel.ops.base import FUSED, NORM_CODES, Lowering, Planning
from photon_core.megakernel.ops.kv_append import head_groups
from photon_core.megakernel.ops.linear import stage_shape, stage_span
from photon_core.megakernel.ops.moe import expert_spans
from photon_core.megakernel.stepgraph import CacheRef, StepGraph, Value
from photon_core.runtime.decode import WEIGHT_DTYPES, ThreadSetting, engine_label

# Kept importable from here: what callers (tests, bench) name the compiler's helpers by.
__all__ = ["Tiling", "Plan", "plan", "lower", "lookup_tables", "CompiledStep", "cuda_kv_dtype", "stage_shape",
           "ENGINES", "first_engine", "needed_nodes",
           "head_groups", "FUSED", "NORM_CODES", "FP8",
           "WEIGHT_ROW_ALIGN", "WEIGHT_DTYPES", "KV_DTYPES"]

WEIGHT_ROW_ALIGN = 16   # elements; kernel.py's tl.multiple_of hints rely on it
KV_DTYPES = (torch.float32, torch.bfloat16)
_cuda_kv_dtype = [torch.bfloat16]   # what a CompiledStep on CUDA gets when its caller names none
# How a step runs: one persistent megakernel launch, or its graph op by op with torch's kernels
# (perop_engine.py); engine_choice.py picks between them by measuring both on the GPU.
ENGINES = ("megakernel", "perop")
PEROP_VARIANTS = ("plain", "chained", "chained-unlinked")   # perop_engine.VARIANTS (this module does not import it)
_first_engine = ThreadSetting("engine", ENGINES, "megakernel")   # what a CompiledStep starts on


def first_engine(engine: str) -> ContextManager[None]:
    """Steps built inside start on `engine` (CompiledStep.set_engine). Started on "perop", a step
    lowers, checks and compiles no megakernel unless it is switched to one: what a start whose
    recorded choice is the per-op engine saves."""
    return _first_engine.scope(engine)


@contextlib.contextmanager
def cuda_kv_dtype(dtype: torch.dtype):
    """Steps built inside get KV caches in `dtype` on CUDA unless their caller names one: fidelity
    checks of families whose step classes do not pass `kv_dtype` (photon_core/gpu_proof, bench/gpu_proof.py) use fp32."""
    if dtype not in KV_DTYPES:
        raise ValueError(f"KV caches can be {KV_DTYPES}, not {dtype}")
    before, _cuda_kv_dtype[0] = _cuda_kv_dtype[0], dtype
    try:
        yield
    finally:
        _cuda_kv_dtype[0] = before


FP8 = torch.float8_e4m3fn




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
    producer = {n.value.name: n for n in graph.nodes if n.out is not None}
    pl = Planning(graph, bn, producer)
    for node in graph.nodes:
        rule = ops.RULES.get(node.op)
        if rule is not None and rule.plan is not None:
            rule.plan(pl, node)
    norm_of, glu_of, mul_of, act_of = pl.norm_of, pl.glu_of, pl.mul_of, pl.act_of
    qkv_store, logits, eps = pl.qkv_store, pl.logits, pl.eps
    weight_offset, offset_readers = pl.weight_offset, pl.offset_readers
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
    for nd in graph.nodes:
        rule = ops.RULES.get(nd.op)
        for key in rule.matrices if rule is not None else ():
            matrix = nd.args.get(key)
            if matrix is not None:
                ldw[matrix] = -(-graph.weight_shapes[matrix][-1] // WEIGHT_ROW_ALIGN) * WEIGHT_ROW_ALIGN
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
    for k, wshape in graph.weight_shapes.items():
        if k not in external:
            wa.alloc(k, math.prod(wshape[:-1]) * ldw[k] if k in ldw else math.prod(wshape), align=WEIGHT_ROW_ALIGN,
                     dtype=dtypes.get(k))
    wa.size = -(-wa.size // WEIGHT_ROW_ALIGN) * WEIGHT_ROW_ALIGN   # viewable as any element size
    shapes: dict[str, tuple[int, ...]] = {}
    fused_away = {n.args["qkv"].name for n in qkv_store.values()} | {n.value.name for n in graph.nodes
                                                                      if n.op in FUSED}
    for node in graph.nodes:
        if node.out is not None and node.value.name not in fused_away:
            shapes[node.value.name] = (batch, node.value.width)
        rule = ops.RULES.get(node.op)
        if rule is not None and rule.scratch is not None:
            shapes.update(rule.scratch(graph, node, batch, tiling))
    for name, ntiles in logits.items():
        shapes[f"{name}.part"] = (batch, ntiles, 2)
    for node in graph.nodes:
        rule = ops.RULES.get(node.op)
        if rule is not None and rule.tail_scratch is not None:
            shapes.update(rule.tail_scratch(graph, node, batch, tiling))
    shape: dict[str, tuple[int, int, int]] = {}
    for node in graph.nodes:
        if node.op != "linear":
            continue
        rows, cols = graph.weight_shapes[node.args["w"]]
        name = node.value.name
        written = qkv_store[name].value if name in qkv_store else node.value
        readers = [c for c in graph.consumers(written) if c.op == "attention"]
        align = readers[0].args["k"].spec.head_dim if readers else None
        width, splits = stage_shape(rows, cols, tiling, align, narrow=name not in logits)
        shape[name] = (width, splits, stage_span(rows, width, splits, tiling, align))
        if shape[name][1] > 1:
            shapes[f"{name}.kpart"] = (shape[name][1], batch, rows)
    rope_groups = {}
    for node in graph.nodes:
        src = producer.get(node.args["qkv"].name) if node.op == "kv_append" else None
        if (src is None or src.op != "linear" or src.value.name in qkv_store or node.args["tau"] is not None
                or [id(c) for c in graph.consumers(src.value)] != [id(node)]):
            continue
        width, _, span = shape[src.value.name]
        groups = head_groups(node, width * span)     # heads joined by a task's columns
        if batch * max(map(len, groups)) <= tiling.rope_finale_rows:
            rope_groups[src.value.name] = (node, groups)
    for spec in graph.caches.values():
        shapes[spec.name] = ((spec.layers,) if spec.layers is not None else ()) + (
            batch, spec.heads, spec.length, spec.head_dim)
    for st in graph.states.values():
        shapes[st.name] = (batch,) + st.shape
    # Row statistics of normed values, written once by their producer's stage (a ticket finale)
    # rather than by every tile of every linear reading them: produced by tiles / rows that cover
    # the whole value (not q|k|v stores, attention, recurrent ops) and normed one way only. A
    # linear's tiles (at most ops.linear.STATS_TILES) leave their partial statistics ("{v}.tstats":
    # count, mean, M2 per row and tile) for the finale to merge in the aligned builds
    # (kernel._tile_stats), so it reads 3 floats a tile, not the value.
    kinds: dict[str, set[int]] = {}
    for nrm in norm_of.values():
        kinds.setdefault(nrm.args["x"].name, set()).add(NORM_CODES[nrm.op])
    stats = {}
    for v, codes in kinds.items():
        src = producer.get(v)
        if len(codes) == 1 and src is not None and ops.rule(src.op).stats_finale and src.value.name not in qkv_store:
            stats[v] = codes.pop()
            shapes[f"{v}.stats"] = (batch, 2)
            tiles = -(-src.value.width // shape[v][0]) if src.op == "linear" else 0
            if 0 < tiles <= ops.linear.STATS_TILES and v not in logits:
                shapes[f"{v}.tstats"] = (batch, tiles, 3)
    for k, shp in shapes.items():
        sa.alloc(k, math.prod(shp), dtype=kv_dtype if k in graph.caches else None)

    # Positions must stay inside the caches (a ring takes any position) and the position tables;
    # rotary tables are checked with each row's rotary offset (set_rotary_offsets).
    limits = [spec.length for n in graph.nodes if n.op == "kv_append" for spec in (n.args["k"].spec,)
              if not spec.ring]
    limits += [graph.weight_shapes[n.args["pos"]][0] for n in graph.nodes if n.op == "embed" and n.args["pos"]]
    rotary = [graph.weight_shapes[n.args["rotary"].cos][0] for n in graph.nodes
              if n.op == "kv_append" and n.args["rotary"] is not None]
    return Plan(graph=graph, batch=batch, tiling=tiling, warena=wa, sarena=sa, shapes=shapes, producer=producer,
                norm_of=norm_of, glu_of=glu_of, mul_of=mul_of, act_of=act_of, qkv_store=qkv_store, logits=logits,
                shape=shape, ldw=ldw, weight_offset=weight_offset, ln_eps=eps.pop() if eps else 1e-5,
                max_position=min(limits + rotary) if limits + rotary else 1 << 30, weight_dtype=weight_dtype,
                kv_dtype=kv_dtype, fp8=fp8, external={k: (0, graph.weight_shapes[k][1]) for k in external},
                stats=stats, rope_groups=rope_groups)


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


def lower(p: Plan, results: Iterable[str] | None = None) -> TaskGraph:
    """The task graph of one step; with `results`, only the tasks those result columns (and the
    graph's exposed values) need, over the same arenas. Each node's tasks are its op's lowering
    rule's (ops/); ops without one are fused into their readers."""
    nodes = needed_nodes(p.graph, p, results)
    lo = Lowering(p, nodes)
    for node in nodes:
        rule = ops.RULES.get(node.op)
        if rule is None:
            raise ValueError(f"{p.graph.name}: no lowering for op {node.op!r}")
        if rule.lower is not None:
            rule.lower(lo, node)
    S, unit = p.sarena, p.sarena.unit
    for spec in p.graph.caches.values():   # where each cache's namespace lies in the state arena
        for ref in [CacheRef(spec)] if spec.layers is None else [spec[i] for i in range(spec.layers)]:
            lo.g.caches[f"{ref.key}@cols"] = CacheLayout(S.name, unit, lo.cache_off(ref), p.kv_dtype.itemsize,
                                                         spec.heads, spec.length, spec.head_dim)
    return lo.g


def _proven_kernel(graph: TaskGraph, table: torch.Tensor, weights: torch.Tensor, state: torch.Tensor,
                   dyn: torch.Tensor, out: torch.Tensor, *, block_m: int, block_n: int, block_k: int, block_t: int,
                   head_dim: int, max_splits: int, max_tiles: int, ln_eps: float, run_task: Any) -> Any:
    """Megakernel(graph, ...) for a graph checker.check proved when it was built, with the table
    TaskGraph.encode gave then (build_cache): the constructor's work without the proof and the
    encoding. It mirrors Megakernel.__init__ (test_megakernel_build_cache compares the objects)."""
    from photon_core.megakernel import kernel
    mk = object.__new__(kernel.Megakernel)
    dev = weights.device
    mk.graph, mk.run_task = graph, run_task
    mk.expert_tiles = kernel.spans_expert_tiles(graph, block_n)
    mk.linear_tiles = kernel.spans_linear_tiles(graph, block_n)
    mk.kv_aligned = kernel.kv_aligned(graph)
    mk.tasks = table.to(dev)
    mk.ctrl = torch.zeros(graph.ctrl_size(), dtype=torch.int32, device=dev)
    mk.weights, mk.state, mk.dyn, mk.out = weights, state, dyn, out
    mk.batch, mk.ln_eps = graph.batch, ln_eps
    kernel.check_supported()
    mk.num_programs = kernel.resident_programs(dev, len(graph.tasks), mk.tuning.programs_per_sm)
    mk.spin_limit = 2 if dev.type == "cpu" else 1 << 20
    mk.meta = kernel.megakernel_meta(graph.batch, block_n, block_k, block_t, head_dim, max_splits, max_tiles)
    if block_m and block_m < mk.meta["BLOCK_M"]:
        raise ValueError(f"block_m {block_m} < batch {graph.batch}")
    return mk


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
        self._kernels: dict[tuple[str, frozenset[str] | None], object] = {}
        self.engine = _first_engine.get()
        self.variant = "plain"     # how the megakernel's K loops are built (kernel.KernelVariant.name())
        self.perop_variant = "plain"   # the per-op engine's build (perop_engine.VARIANTS)
        if self.engine == "megakernel":
            self.kernel_for(None)   # build and prove the full graph at load time

    def scrub_nonfinite(self) -> None:
        """Zero every non-finite entry of the caches and recurrent states. The per-op engine's
        attention reads every slot under a mask, so NaN that a refused request left past a later
        request's keys would poison that request too (the megakernel never reads those slots)."""
        for name in (*self.graph_def.caches, *self.graph_def.states):
            self.view(name).nan_to_num_(0.0, 0.0, 0.0)

    def set_engine(self, engine: str, variant: str = "plain") -> None:
        """Run the following launches on `engine` ("megakernel" or "perop"), the megakernel built as
        `variant` (kernel.KernelVariant's name: the same task table, another compile of its K
        loops), the per-op engine as PEROP_VARIANTS' "plain" or "chained": every engine reads and writes the same buffers, so a step may switch between
        launches. A loop built on the step before (DeviceDecode, whose CUDA graphs hold the kernel
        they captured) keeps the kernel object it took, and its build: a new variant is a new
        object. The per-op engine holds the small weights (norms, rotary tables) as fp32 copies
        made with its kernel: after writing weights in place, set the engine again to make them
        anew."""
        import copy

        from photon_core.megakernel.kernel import KernelVariant
        if engine not in ENGINES:
            raise ValueError(f"engine {engine!r}: one of {ENGINES}")
        if engine == "perop":
            if variant not in PEROP_VARIANTS:
                raise ValueError(f"the per-op engine's variants are {PEROP_VARIANTS} (asked for {variant!r})")
            self.perop_variant = variant
        else:
            built = KernelVariant.parse(variant)       # a bad name fails before anything changes
        for k in [k for k in self._kernels if k[0] == "perop"]:
            del self._kernels[k]
        if engine == "megakernel" and variant != self.variant:
            for k, kernel in list(self._kernels.items()):
                self._kernels[k] = copy.copy(kernel)   # shares the table and buffers, not the build
                self._kernels[k].variant = built  # type: ignore[attr-defined]
            self.variant = variant
        self.engine = engine
        self.kernel_for(None)

    @property
    def engine_label(self) -> str:
        """The engine and its variant where it is not the plain build."""
        return engine_label(self.engine, self.perop_variant if self.engine == "perop" else self.variant)

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
        """The megakernel of the whole step, or of the part that computes `results` (under the
        per-op engine, perop_engine.PerOpKernel of those nodes)."""
        key = None if results is None else frozenset(results)
        if self.engine == "perop":
            k = self._kernels.get(("perop", key))
            if k is None or getattr(k, "arena", None) != self.weights.data_ptr():   # built on an arena since swapped
                from photon_core.megakernel.perop_engine import PerOpKernel
                self._kernels["perop", key] = PerOpKernel(self, key, self.perop_variant)
            return self._kernels["perop", key]
        if ("megakernel", key) not in self._kernels:
            from photon_core.megakernel import build_cache
            from photon_core.megakernel.kernel import KernelVariant, Megakernel, step_tasks_for
            p, tl = self.plan, self.tiling
            specs = list(self.graph_def.caches.values())
            # The delta rule holds a value head ([Dv]) in one block, like an attention head.
            dims = [s.head_dim for s in specs] + [st.shape[-1] for st in self.graph_def.states.values()]
            kw: dict[str, Any] = dict(
                block_m=self.batch, block_n=tl.block_n, block_k=tl.block_k, block_t=tl.block_t,
                head_dim=max(dims, default=16),
                max_splits=max([tl.self_splits, tl.cross_splits] + [n.args["top_k"] for n in self.graph_def.nodes
                                                                     if n.op == "moe"]),
                max_tiles=max(p.logits.values(), default=1),
                ln_eps=p.ln_eps, run_task=step_tasks_for(p.kv_dtype == torch.bfloat16, bool(p.fp8)))
            # A table holding the addresses of tables read in place is this process's alone: not cached.
            entry = None if p.external else build_cache.entry_key(
                self.graph_def, self.batch, tl, p.weight_dtype, p.kv_dtype, key, self.weights.device)
            stored = build_cache.load(entry) if entry is not None else None
            if stored is not None:
                mk = _proven_kernel(*stored, self.weights, self.state, self.dyn, self.out, **kw)
            else:
                mk = Megakernel(lower(p, key), self.weights, self.state, self.dyn, self.out, **kw)
                if entry is not None:
                    build_cache.store(entry, mk.graph, mk.tasks)
            if self.variant != "plain":
                mk.variant = KernelVariant.parse(self.variant)
            self._kernels["megakernel", key] = mk
        return self._kernels["megakernel", key]

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
            vocab = min((self.graph_def.weight_shapes[n.args["tok"]][0] for n in self.graph_def.nodes
                         if n.op == "embed"), default=None)
            if vocab is not None and (int(tok.min()) < 0 or int(tok.max()) >= vocab):
                raise ValueError(f"need {B} tokens in [0, {vocab}), got {tok.tolist()}")
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
        """Result column `name` of the last step, [B] int32 on the device. -2 marks a row whose
        logits held NaN (no argmax; decode_loop.NON_FINITE); with `advance`, -1 marks a row whose
        context is full (its position stayed where it was)."""
        R = len(self.graph_def.results)
        return self.out.view(self.batch, R)[:, self.graph_def.results.index(name)]

    def sparse_scratch(self) -> set[str]:
        """State regions a launch may leave partly unwritten by design, never reading what it leaves:
        split-K partial slots a stage does not use, a MoE layer's per-pair slabs ({name}.h,
        {name}.part) in the rows that did not choose that pair's expert, and the tiles' partial
        statistics ({name}.tstats), which only the aligned builds write and read (the plain builds'
        finales read the value itself: kernel._task_row_stats)."""
        moe = [n.value.name for n in self.graph_def.nodes if n.op == "moe"]
        sparse = {f"{m}.{part}" for m in moe for part in ("h", "part")}
        return {k for k in self.sarena.regions if k.endswith((".kpart", ".tstats")) or k in sparse}

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
            cells = self.view(f"{n.value.name}.loads")
            tiles_f = len(expert_spans(f2 // 2, self.batch * n.args["top_k"], self.tiling))
            up, down = cells[:, :tiles_f].sum().item(), cells[:, tiles_f:].sum().item()
            if n.args["gate_up_scale"]:   # a byte a weight, and 4 bytes of scale per weight row
                out[n.value.name] = round(up + down + 4 * (up / d + down / (f2 // 2)))
            else:
                out[n.value.name] = round((up + down) * self.weights.element_size())
        return out

    def weight_bytes_per_step(self, skip: tuple[str, ...] = ()) -> int:
        return self.graph_def.weight_bytes(self.weights.element_size(), skip, rows=self.batch)
