"""Random weights of real shapes for any step graph, and the rows a decode step runs at.

GraphFamily compiles a family's step graph (models/<family>/decoder_step.step_graph) with
CompiledStep on random weights whose scale follows the role each weight plays in the graph, so a
decode step of real size runs with activations O(1) and no checkpoint: what the GPU proof
(photon_core.gpu_proof) runs for every family compiled from its step graph alone, and what a
benchmark or test of a new family's graph can use the same way. run_reference on the same graph,
reading the arena's weights, is its reference.
"""
from __future__ import annotations

import copy
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    import torch

    from photon_core.megakernel.layout import Plan


@dataclass
class Rows:
    """One decode step's rows: each row's token, position and (encoder-decoder models) cross length."""
    tokens: list[int]
    positions: list[int]
    cross_len: list[int] | None


def spaced(batch: int, start: int, spacing: int) -> list[int]:
    """Row positions start, start + spacing, ...: rows at different positions."""
    return [start + spacing * r for r in range(batch)]


def make_rows(batch: int, vocab: int, start_spacing: tuple[int, int], cross_len: list[int] | None = None) -> Rows:
    """Random tokens (seeded by the batch, so every part sees the same rows) at spaced positions."""
    import torch
    start, spacing = start_spacing
    g = torch.Generator().manual_seed(batch)
    return Rows(torch.randint(0, vocab, (batch,), generator=g).tolist(), spaced(batch, start, spacing), cross_len)


def logit_bias(batch: int, width: int, dev: Any) -> Any:
    """Per-row logit bias: ~10% of the columns barred with -inf, as the skills' masks do."""
    import torch
    g = torch.Generator().manual_seed(100 + batch)
    masked = torch.rand(batch, width, generator=g) < 0.1
    return torch.zeros(batch, width).masked_fill(masked, float("-inf")).to(dev)


def dtype_of(name: str) -> Any:
    """torch dtype of a weight dtype's short name: the proof runs fp32 and bf16 only."""
    from photon_core.weights.tensor_files import DTYPES
    if name not in ("fp32", "bf16"):
        raise ValueError(f"unknown weight dtype {name!r}: fp32 or bf16")
    return DTYPES[name]


class GraphFamily:
    """Any family's step graph (`graph_fn()` -> StepGraph) compiled with CompiledStep directly, on
    random weights generated from graph.weight_shapes by the role each weight plays in the graph, so
    that activations stay O(1): linear / embedding / expert matrices N(0, 1) / sqrt(K) (K: the last
    dimension), norm scales 1 + 0.1 N(0, 1) (0.1 N(0, 1) where the norm adds an offset of 1),
    rotary tables of real angles (theta 1e4), the delta rule's A_log = log U(1, 16) and dt_bias =
    softplus^-1 of dt log-uniform in [1e-3, 0.1] (Mamba's initialisation), conv taps N(0, 1) /
    sqrt(W), other vectors 0.1 N(0, 1). Weights are generated one at a time straight into the
    arena (no master copy; bf16 alone when the family is proved in bf16 only: a 9B graph in fp32
    and bf16 besides the others would crowd an H200); the references read the arenas (bf16 rounding
    included; folded norm offsets taken back out).

    Host inputs (g.input): one added to logits an argmax reads is a per-row logit bias (~10% of the
    columns -inf, as the skills' masks); any other is an input embedding, a fixed N(0, 1) row per
    token. Recurrent states get random history in fill(). No own reference: run_reference on the
    same graph is the reference. `advance` is the graph's own (an argmax(advance=True))."""
    perop = False      # no per-op step function to time it against

    def __init__(self, name: str, graph_fn: Callable[[], Any], tiling: Callable[[int], Any],
                 batches: tuple[int, ...], dtypes: tuple[str, ...], stress_dtype: str, steps_rows: tuple[int, int],
                 fixed_rows: tuple[int, int]) -> None:
        self.name, self.graph_fn, self.tiling = name, graph_fn, tiling
        self.batches, self.dtypes, self.stress_dtype = batches, dtypes, stress_dtype
        self.steps_rows, self.fixed_rows = steps_rows, fixed_rows
        self.graph = graph_fn()
        self.advance = any(n.op == "argmax" and n.args["advance"] for n in self.graph.nodes)
        embeds = [n.args["tok"] for n in self.graph.nodes if n.op == "embed"]
        argmax = next(n.args for n in self.graph.nodes if n.op == "argmax")
        self.vocab = self.graph.weight_shapes[embeds[0]][0] if embeds else argmax["c1"] - argmax["c0"]
        # Host inputs that are a logit bias: the residual of a linear an argmax reads (Moondream 3's
        # input embedding is a residual too, of its first MLP).
        picked = {n.args["x"].name for n in self.graph.nodes if n.op == "argmax"}
        self.biases = {n.args["residual"].name for n in self.graph.nodes
                       if n.op == "linear" and n.args["residual"] is not None and n.value.name in picked}
        self.host_inputs = [n.value for n in self.graph.nodes if n.op == "input"]
        self.arena32: torch.Tensor | None = None   # the first bucket's weights arena, once built
        self.plan: Plan | None = None
        self.arenas: dict = {}     # dtype -> weights arena; Build.use_dtype shares this dict
        self._tables: dict = {}
        self._bias: dict = {}

    # -- random weights -----------------------------------------------------------------------------
    def roles(self) -> dict[str, tuple]:
        """weight name -> (role, detail) from the nodes that read it."""
        r: dict[str, tuple] = {}

        def scale(w, offset=0.0):
            if w is not None:
                r[w] = ("offset_scale",) if offset else ("scale",)
        for n in self.graph.nodes:
            a = n.args
            if n.op in ("layer_norm", "rms_norm"):
                scale(a["w"], a.get("offset", 0.0))
            elif n.op == "add_norm":
                scale(a["w"], a["offset"])
                scale(a["scale_w"])
            elif n.op == "kv_append":
                if a["rotary"] is not None:
                    r[a["rotary"].cos] = ("cos", a["rotary"].dims)
                    r[a["rotary"].sin] = ("sin", a["rotary"].dims)
                if a["norm"] is not None:
                    scale(a["norm"].q, a["norm"].offset)
                    scale(a["norm"].k, a["norm"].offset)
                if a["tau"] is not None:
                    r[a["tau"].alpha] = ("vector",)
            elif n.op == "delta_rule":
                r[a["a_log"]], r[a["dt_bias"]] = ("a_log",), ("dt_bias",)
                scale(a["norm_w"])
        return r

    def _weight(self, name: str, shape: tuple[int, ...], role: tuple, gen):
        import torch
        dev = self.dev

        def randn(scale: float):
            return torch.randn(*shape, generator=gen, device=dev) * scale

        kind = role[0] if role else ("matrix" if len(shape) > 1 else "vector")
        if kind in ("cos", "sin"):
            half = shape[1]
            inv = 1e4 ** (-torch.arange(half, dtype=torch.float32, device=dev) / half)
            ang = torch.arange(shape[0], dtype=torch.float32, device=dev)[:, None] * inv[None]
            return ang.cos() if kind == "cos" else ang.sin()
        if kind == "scale":
            return 1 + randn(0.1)
        if kind == "offset_scale":
            return randn(0.1)
        if kind == "a_log":
            return torch.log(1 + 15 * torch.rand(*shape, generator=gen, device=dev))
        if kind == "dt_bias":
            dt = torch.exp(math.log(1e-3) + (math.log(0.1) - math.log(1e-3)) * torch.rand(*shape, generator=gen,
                                                                                             device=dev))
            return dt + torch.log(-torch.expm1(-dt))          # softplus^-1(dt)
        if kind == "matrix":
            return randn(shape[-1] ** -0.5)
        return randn(0.1)

    def load(self, dev) -> None:
        self.dev = dev

    def build(self, batch: int, advance: bool):
        import torch

        from photon_core.megakernel.compiler import CompiledStep
        from photon_core.megakernel.stepgraph import Node
        g = self.graph
        if self.advance and not advance:    # the same graph, the host stepping rows instead
            g = copy.copy(g)
            g.nodes = [Node(n.op, n.out, dict(n.args, advance=False)) if n.op == "argmax" else n for n in g.nodes]
        shared = self.arena32      # every bucket streams one copy of the weights
        tensors: Mapping[str, Any]
        if shared is not None:
            tensors = {k: torch.empty(0) for k in g.weight_shapes}
        else:
            roles = self.roles()
            gen = torch.Generator(device=self.dev).manual_seed(0)
            tensors = LazyWeights(g.weight_shapes, lambda k: self._weight(k, g.weight_shapes[k], roles.get(k, ()), gen))
        # Built in the finest dtype the family is proved in (bf16 alone: no fp32 copy of a 9B arena).
        dtype = torch.float32 if "fp32" in self.dtypes else dtype_of(self.dtypes[0])
        step = CompiledStep(g, tensors, batch, self.tiling(batch), dtype, shared_weights=shared, device=self.dev)
        if self.arena32 is None:     # the first arena (fp32 unless the family is proved in bf16 only)
            self.arena32 = self.arenas[dtype] = step.weights
            self.plan = step.plan
        return step

    # -- rows, inputs, references ------------------------------------------------------------------
    def rows(self, batch: int, purpose: str) -> Rows:
        return make_rows(batch, self.vocab, self.steps_rows if purpose == "steps" else self.fixed_rows)

    def inputs(self, batch: int, tokens: list[int]) -> dict:
        import torch
        out = {}
        for v in self.host_inputs:
            if v.name in self.biases:
                key = (v.name, batch)
                if key not in self._bias:
                    self._bias[key] = logit_bias(batch, v.width, self.dev)
                out[v.name] = self._bias[key]
            else:                        # an input embedding of the row's token
                if v.name not in self._tables:
                    g = torch.Generator(device=self.dev).manual_seed(7)
                    self._tables[v.name] = torch.randn(self.vocab, v.width, generator=g, device=self.dev)
                out[v.name] = self._tables[v.name][torch.tensor(tokens, device=self.dev) % self.vocab]
        return out

    def ref_weights(self, dtype) -> dict:
        """name -> the weight as the arena of `dtype` holds it (views; run_reference casts them to
        fp32 per use), folded norm offsets taken back out (exactly: Sterbenz)."""
        if self.arena32 is None or self.plan is None:
            raise ValueError(f"{self.name}: no step built yet, so no weights")
        if dtype not in self.arenas:
            if self.arena32.element_size() < dtype.itemsize:
                raise ValueError(f"{self.name}: built in {self.arena32.dtype}, cannot give {dtype} weights")
            self.arenas[dtype] = self.arena32.to(dtype)
        arena, p = self.arenas[dtype], self.plan
        out = {}
        for k, shape in self.graph.weight_shapes.items():
            off, n = p.warena.regions[k]
            if k in p.ldw:
                rows = math.prod(shape[:-1])
                t = arena[off:off + n].view(rows, p.ldw[k])[:, :shape[-1]].view(shape)
            else:
                t = arena[off:off + n].view(shape)
            out[k] = t.float() - p.weight_offset[k] if k in p.weight_offset else t
        return out

    def own_state(self, caches: dict) -> dict:
        return {}

    def own_reference(self, dtype, state: dict, tokens, positions, rows: Rows, inputs: dict) -> dict:
        return {}


class LazyWeights(Mapping):
    """name -> tensor made on first use and not kept: CompiledStep copies each into its arena."""

    def __init__(self, shapes: dict, make: Callable[[str], Any]) -> None:
        self.shapes, self.make = shapes, make

    def __getitem__(self, key: str):
        if key not in self.shapes:
            raise KeyError(key)
        return self.make(key)

    def __iter__(self):
        return iter(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)

