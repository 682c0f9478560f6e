"""A compiled step's graph run op by op with torch's own kernels: the per-op engine.

The megakernel runs a step as one persistent launch. This runs the same step graph as a few torch
kernels an op (the vendor's GEMV/GEMM for linears, scaled_dot_product_attention over the caches)
on the very same buffers: the weights arena, the state arena's values, caches and states, the dyn
buffer and the results. So a CompiledStep can switch engines between launches and everything around
it (prefill copies into its caches, DeviceDecode's rounds, `restoring`, a family's logit rules
reading `logits`) works unchanged. Captured in a CUDA graph (DeviceDecode does that), a step is one
replay of those kernels: that is how transformers decodes Moondream 2 in 2.98 ms on an H200 where
the megakernel took 7.67 ms (../shared/gpu-runs/h200-2026-12-04). engine_choice.py measures both
on the user's GPU and keeps the faster.

Two builds (VARIANTS): "plain", the ops as torch's kernels; "chained", every op as
kernels/chained.py's Triton kernels (perop_chained.py runs them: linears with the LayerNorm or
RMSNorm they read applied in their own prologue, GLUs and gates, rotary appends, decode attention,
experts, Qwen 3.5's conv and delta rule), one launch an op, which on sm_90+ start while the launch
before them finishes (programmatic dependent launch; "chained-unlinked": the same kernels as
ordinary launches, which engine_choice tries where PDL launches fail). Its attention reads only a
row's keys; its linears' outputs are fp32.

Capture-safe: fixed shapes, no host reads. A row's token and position come from dyn; attention
reads every slot of its caches under a mask of the row's keys (self: positions [0, position] or
the last `window` of them, a ring cache's slots holding those; cross: [0, cross length)), so a
step costs the caches' whole length, as a static-cache transformers step does; a row with no keys
gets zeros.

Numerics: linears and MoE experts run in the weights' dtype (bf16 weights: bf16 inputs, fp32
accumulation, as transformers runs them; FP8 experts dequantized by their row scales), attention
in the caches' dtype; norms, activations, rotary, recurrences and the argmax in fp32 through the
ops' eager references (ops/*.py `reference`). With fp32 weights and caches a step equals
eager.run_reference (test_perop_engine).

Guards as the megakernel's (issue 37): a token, position or rotary position outside its table
is clamped and flags the launch (raise_for names it); a row whose logits hold NaN reports
NON_FINITE (-2) and keeps its position; a row whose next position would pass its caches reports
FULL (-1) and keeps it.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F

from photon_core.megakernel.graph import CTRL_CLAIM, CTRL_COUNTERS, CTRL_ERROR
from photon_core.megakernel.ops import rule
from photon_core.megakernel.ops.base import Eager, eager_act
from photon_core.megakernel.stepgraph import Node

# Ops whose eager reference is capture-safe and cheap (fp32 work on vectors): run as they are.
REFERENCE_OPS = frozenset({"input", "layer_norm", "rms_norm", "glu", "mul", "act", "add_norm", "conv_step",
                           "delta_rule"})
# Weights streamed by rows in the weights' dtype; every other weight (norms, biases of norms,
# rotary tables, recurrent parameters) is held once in fp32.
_MATRIX_ARGS = {"linear": ("w", "b"), "embed": ("tok", "pos"), "moe": ("gate_up", "down")}


class PerOpKernel:
    """What CompiledStep.kernel_for gives under the "perop" engine: `launch()` runs the graph's nodes
    (all, or those computing `results`) on the step's buffers. Its control buffer reads as a
    megakernel's: one task, always claimed; the error word set when a launch clamped an index."""

    def __init__(self, step: Any, results: Iterable[str] | None = None, variant: str = "plain") -> None:
        """step: the compiler.CompiledStep whose buffers it runs on (the compiler makes this
        kernel, so this module does not import it). variant: VARIANTS' "plain" (torch's kernels)
        or "chained" (every op as kernels/chained.py's Triton kernels, chained by programmatic
        dependent launch on sm_90+)."""
        from photon_core.megakernel.layout import needed_nodes
        if variant not in VARIANTS:
            raise ValueError(f"the per-op engine's variants are {VARIANTS}, not {variant!r}")
        g, p, dev = step.graph_def, step.plan, step.state.device
        self.step, self.nodes, self.variant = step, needed_nodes(g, p, results), variant
        self.pdl = variant == "chained" and _pdl_for(dev)     # "chained-unlinked": ordinary launches
        # a chained linear's programs: two an SM keep every SM streaming weights
        self.programs = 2 * torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 0
        unknown = {n.op for n in self.nodes} - REFERENCE_OPS - set(OWN) - {"argmax"}
        if unknown:
            raise ValueError(f"{g.name}: the per-op engine does not run ops {sorted(unknown)}")
        if step.weights.dtype == torch.float16:   # fp16 inputs to its GEMMs could overflow
            raise ValueError(f"{g.name}: the per-op engine runs float32 or bfloat16 weights, not float16")
        self.arena = step.weights.data_ptr()   # the arena its views are of (CompiledStep.kernel_for)
        self.ctrl = torch.zeros(CTRL_COUNTERS, dtype=torch.int32, device=dev)
        self.ctrl[CTRL_CLAIM] = 1
        matrices = {n.args[k] for n in g.nodes for k in _MATRIX_ARGS.get(n.op, ()) if n.args.get(k)}
        self.weights: dict[str, torch.Tensor] = {}
        for k in g.weight_shapes:
            w = step.weight(k)
            if k in p.weight_offset:            # stored as (offset + w): the references add it
                w = w.float() - p.weight_offset[k]
            self.weights[k] = w if k in matrices else w.float().clone()
        # the rows of the rotary tables (every layer reads tables of one length): the clamp's bound
        self.rotary_rows = min((self.weights[n.args["rotary"].cos].shape[0] for n in self.nodes
                                if n.op == "kv_append" and n.args["rotary"] is not None), default=0)
        # tokens are clamped into the smallest token table (the chained build's step_begin)
        self.token_rows = min((self.weights[n.args["tok"]].shape[0] for n in self.nodes if n.op == "embed"),
                              default=0)
        self.caches = {name: step.view(name) for name in (*g.caches, *g.states)}
        self.inputs = {n.value.name: step.view(n.value.name) for n in g.nodes if n.op == "input"}
        self.results = step.out.view(step.batch, max(1, len(g.results)))
        # Values written to their regions: those the host reads (exposed: logits, hidden). The rest
        # live in the launch only; a copy each would be a kernel each (~2 us in a replay).
        self.observed = {v.name for v in g.exposed.values()}
        # the chained build's runners by node, and what its linears apply to their inputs themselves
        self.chained, self.prologues = (_chained_ops(g, self.nodes, self.observed) if variant.startswith("chained")
                                        else ({}, {}))
        self.outs = {name: step.view(name) for name in self.observed}   # where chained linears write them
        # the chained attention's tickets (kernels/chained.attention), this step's alone: every
        # launch leaves them at zero, and another step (another model, another thread) has its own
        heads = max((n.value.width // n.args["k"].spec.head_dim for n in self.nodes if n.op == "attention"), default=0)
        self.tickets = torch.zeros(step.batch * heads, dtype=torch.int32, device=dev)
        self.bad = torch.zeros(1, dtype=torch.int32, device=dev)

    def raise_for(self, err: int, claimed: int) -> None:
        """Raise for a launch's error word (as DeviceDecode reads it from `ctrl`)."""
        if err:
            raise RuntimeError(f"{self.step.graph_def.name} per-op step: a token, position or rotary position "
                               "was outside its table (clamped)")

    def raise_on_error(self) -> None:
        self.raise_for(int(self.ctrl[CTRL_ERROR].item()), 1)

    @property
    def graph(self):
        raise AttributeError("the per-op engine runs the step graph op by op: it has no task graph "
                             "(step.set_engine('megakernel') for the megakernel's)")

    def launch(self) -> None:
        step, B = self.step, self.step.batch
        dyn = step.dyn
        if self.chained:
            e = self._begin_chained()
        else:
            self.bad.zero_()
            pos = self._clamped(dyn[B:2 * B].long(), step.plan.max_position)
            rot = dyn[B:2 * B].long() + dyn[3 * B:4 * B].long()
            e = _Run(B, dyn.device, pos, rot, dyn[:B].long(), dyn[2 * B:3 * B].long(), self.weights, self.caches,
                     self.inputs, kernel=self)
            if self.rotary_rows:
                e.rot_pos = self._clamped(rot, self.rotary_rows)
        advance: list[tuple[torch.Tensor, torch.Tensor]] = []
        last: list[Node] = []        # the chained build's advancing argmax: after every reader of dyn
        for node in self.nodes:
            if node.op == "argmax":
                if not self.chained:
                    advance += self._argmax(e, node)
                elif node.args["advance"]:
                    last.append(node)
                else:
                    self._argmax_chained(e, node)
                continue
            if id(node) in self.chained:
                if self.chained[id(node)] is None:    # applied by its readers (prologues)
                    continue
                y = self.chained[id(node)](e, node)
            elif node.op in OWN:
                y = OWN[node.op](e, node)
            else:
                y = rule(node.op).reference(e, node)
            assert y is not None, node.op
            name = node.value.name
            if name in self.observed:
                view = step.view(name)
                if y.data_ptr() != view.data_ptr():   # a chained linear writes it in place
                    view.copy_(y.reshape(view.shape))
                y = view
            e.vals[name] = y
        for token, nxt in advance:           # after every reader of this step's tokens and positions
            dyn[:B].copy_(token)
            dyn[B:2 * B].copy_(nxt)
        for node in last:
            self._argmax_chained(e, node)
        if not self.chained or not any(n.op == "argmax" for n in self.nodes):   # else the argmax kernels copy it
            self.ctrl[CTRL_ERROR:CTRL_ERROR + 1].copy_(self.bad)

    def _begin_chained(self) -> "_Run":
        """The chained build's first launch: the rows' tokens, positions, rotary positions and cross
        lengths from dyn, clamped into their tables (the launch flagged where one was not)."""
        from photon_core.kernels import chained
        step, B = self.step, self.step.batch
        tok, pos, rot, cross = chained.step_begin(step.dyn, B, step.plan.max_position, self.rotary_rows,
                                                  self.token_rows, self.bad, self.pdl)
        e = _Run(B, step.dyn.device, pos, rot, tok, cross, self.weights, self.caches, self.inputs, kernel=self)
        e.outs = self.outs
        return e

    def _argmax_chained(self, e: "_Run", node: Node) -> None:
        """kernels/chained.argmax: the result column; advancing, dyn's tokens and positions too."""
        from photon_core.kernels import chained
        a, step = node.args, self.step
        col = self.results[:, step.graph_def.results.index(a["name"])]
        chained.argmax(e.val(a["x"]).float().contiguous(), a["c0"], a["c1"], col, step.dyn, step.batch, step.plan.max_position,
                       self.bad, self.ctrl[CTRL_ERROR:CTRL_ERROR + 1], a["advance"], self.pdl)

    def _clamped(self, index: torch.Tensor, rows: int) -> torch.Tensor:
        """index clamped into [0, rows), flagging the launch where it was not: a device value never
        becomes an address unchecked."""
        out = index.clamp(0, rows - 1)
        self.bad.copy_(torch.maximum(self.bad, (out != index).any().to(torch.int32)))
        return out

    def _argmax(self, e: "_Run", node: Node) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The result column (-2 for a row with NaN logits, whose fed token is column 0); with
        `advance`, (next tokens, next positions) for the end of the launch: a row whose next position
        would pass the caches reports -1 and keeps its position, as a NaN row does."""
        a, B = node.args, e.bsz
        x = e.val(a["x"])[:, a["c0"]:a["c1"]]
        nan = torch.isnan(x).any(1)
        best = torch.where(nan, 0, x.argmax(1))
        col = self.results[:, self.step.graph_def.results.index(a["name"])]
        if not a["advance"]:
            col.copy_(torch.where(nan, -2, best))
            return []
        pos = self.step.dyn[B:2 * B].long()
        full = pos + 1 >= self.step.plan.max_position
        col.copy_(torch.where(nan, -2, torch.where(full, -1, best)))
        return [(best, torch.where(full | nan, pos, pos + 1))]


class _Run(Eager):
    """One launch's values: Eager (what the ops' references read) with the rows' tokens and cross
    lengths as device tensors."""

    def __init__(self, bsz: int, dev: torch.device, pos: torch.Tensor, rot_pos: torch.Tensor, tokens: torch.Tensor,
                 cross_len: torch.Tensor, weights: dict, caches: dict, inputs: dict | None,
                 kernel: PerOpKernel | None) -> None:
        super().__init__(bsz, dev, pos, rot_pos, [], None, weights, caches, inputs)
        self.token_ids, self.lengths, self.kernel = tokens, cross_len, kernel
        self.outs: dict[str, torch.Tensor] = {}    # where the chained build writes observed values
        self.masks: dict[tuple, Any] = {}      # what a launch computes once: key masks, rotary rows

    def rotary(self, rot) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [B, 1, dims / 2] at the rows' rotary positions (gathered once a launch)."""
        key = ("rotary", rot.cos, rot.sin)
        if key not in self.masks:
            self.masks[key] = tuple(self.weights[t][self.rot_pos][:, None, :] for t in (rot.cos, rot.sin))
        return self.masks[key]

    def keys(self, lengths: str, window: int | None, length: int, ring: bool) -> torch.Tensor:
        """[B, T] which slots of a T-slot cache hold the row's keys (computed once a launch)."""
        key = (lengths, window, length, ring)
        if key not in self.masks:
            n = self.pos + 1 if lengths == "self" else self.lengths
            t = torch.arange(length, device=self.dev)[None, :]
            last = (n - 1)[:, None]
            # a ring slot holds the latest position <= last congruent to it (none: negative)
            at = last - torch.remainder(last - t, length) if ring else t
            valid = (at >= 0) & (at <= last)
            if window is not None:
                valid &= at >= (n - window)[:, None]
            self.masks[key] = valid
        return self.masks[key]


def _embed(e: _Run, node: Node) -> torch.Tensor:
    a = node.args
    table = e.weights[a["tok"]]
    assert e.kernel is not None
    y = table[e.kernel._clamped(e.token_ids, table.shape[0])].float() * a["scale"]
    if a["pos"] is not None:
        y = y + e.weights[a["pos"]][e.pos].float()
    return y


def _linear(e: _Run, node: Node) -> torch.Tensor:
    a = node.args
    b = None if a["b"] is None else e.weights[a["b"]]
    y = eager_act(gemm(e.val(a["x"]), e.weights[a["w"]], b), a["act"])
    return y if a["residual"] is None else y + e.val(a["residual"])


def gemm(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """x @ w.T + b in fp32 from x rounded to w's dtype: on CUDA the GEMM writes fp32 itself
    (torch.addmm's out_dtype; a bf16 output would round logits to 8 bits of mantissa, flipping
    near-ties), elsewhere or on a torch without it the bf16 output is widened."""
    if x.is_cuda and w.dtype != torch.float32 and _FP32_OUT.get(x.device, True):
        try:
            bias = torch.zeros(w.shape[0], device=x.device, dtype=torch.float32) if b is None else b.float()
            y = torch.addmm(bias, x.to(w.dtype), w.t(), out_dtype=torch.float32)
            _FP32_OUT[x.device] = True
            return y
        except (RuntimeError, TypeError, NotImplementedError):
            _FP32_OUT[x.device] = False
    return F.linear(x.to(w.dtype), w, b).float()     # the bias in the GEMM's epilogue


_FP32_OUT: dict[torch.device, bool] = {}   # whether addmm(out_dtype=float32) runs on a device


def rounds_outputs(dev: torch.device, dtype: torch.dtype) -> bool:
    """Whether the plain build's GEMMs with `dtype` weights round their outputs to that dtype on
    `dev` (16-bit weights where no GEMM writes fp32: the CPU)."""
    return dtype != torch.float32 and not (dev.type == "cuda" and _FP32_OUT.get(dev, True))


def _kv_append(e: _Run, node: Node) -> torch.Tensor:
    """q and k rotated together (adjacent heads of q|k|v), k and v written at each row's slot.
    A per-head norm or tau (Qwen3's, Gemma 4's, Moondream 3's) takes the eager reference."""
    a = node.args
    if a["tau"] is not None or a["norm"] is not None:
        q = rule("kv_append").reference(e, node)
        assert q is not None
        if a["append"]:        # what it appended, NaN made 0 (below)
            rows = torch.arange(e.bsz, device=e.dev)
            for c in (e.cache(a["k"]), e.cache(a["v"])):
                slot = e.pos % c.shape[2] if a["k"].spec.ring else e.pos
                c[rows, :, slot] = c[rows, :, slot].nan_to_num(0.0, 0.0, 0.0)
        return q
    spec, B = a["k"].spec, e.bsz
    dh, h = spec.head_dim, spec.heads
    hq = node.value.width // dh
    qk = e.val(a["qkv"]).view(B, -1, dh)[:, :hq + h if a["append"] else hq]
    rot = a["rotary"]
    if rot is not None:
        cos, sin = e.rotary(rot)                           # [B, 1, dims / 2]
        half = rot.dims // 2
        x1, x2 = qk[..., :half], qk[..., half:rot.dims]
        qk = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, qk[..., rot.dims:]], dim=-1)
    if a["append"]:
        k_c, v_c = e.cache(a["k"]), e.cache(a["v"])     # [B, H, T, Dh]
        slot = e.pos % k_c.shape[2] if spec.ring else e.pos
        rows = torch.arange(B, device=e.dev)
        # NaN stored as 0: attention here reads every slot under a mask, and NaN survives masking,
        # so a refused row's NaN would poison the next request that leaves the slot unread (the
        # row itself still ends with NaN logits through its residual stream, and is refused)
        k_c[rows, :, slot] = qk[:, hq:].nan_to_num(0.0, 0.0, 0.0).to(k_c.dtype)
        v_c[rows, :, slot] = e.val(a["qkv"]).view(B, -1, dh)[:, hq + h:].nan_to_num(0.0, 0.0, 0.0).to(v_c.dtype)
    return qk[:, :hq].reshape(B, hq * dh)


def _attention(e: _Run, node: Node) -> torch.Tensor:
    a = node.args
    k, v = e.cache(a["k"]), e.cache(a["v"])       # [B, Hkv, T, Dh] in the caches' dtype
    spec = a["k"].spec
    valid = e.keys(a["length"], a["window"], k.shape[2], spec.ring)
    q = e.val(a["q"]).view(e.bsz, -1, 1, spec.head_dim).to(k.dtype)
    y = F.scaled_dot_product_attention(q, k, v, attn_mask=valid[:, None, None, :], scale=a["scale"],
                                       enable_gqa=q.shape[1] != k.shape[1])
    # a row without keys: zeros (the ops contract), where softmax over nothing is NaN
    y = torch.where(valid.any(1)[:, None, None, None], y.float(), 0.0)
    return y.reshape(e.bsz, node.value.width)


def _moe(e: _Run, node: Node) -> torch.Tensor:
    """Every (row, slot)'s expert gathered and applied by batched GEMVs: reads the chosen experts
    (once per pair choosing them), never the others."""
    from photon_core.backends import reference as ref
    a = node.args
    gate_w, ids = ref.moe_route(e.val(a["logits"]), a["top_k"], a["renormalize"])
    pairs = ids.reshape(-1)
    xs = e.val(a["x"]).repeat_interleave(a["top_k"], 0)[:, :, None]      # [B*k, D, 1]

    def expert(w: str, x: torch.Tensor) -> torch.Tensor:
        t = e.weights[a[w]][pairs]
        scale = a.get(f"{w}_scale")
        if scale is not None:             # FP8 bytes times their row scale
            t = t.float() * e.weights[scale][pairs][:, :, None]
        return torch.bmm(t, x.to(t.dtype)).float()[:, :, 0]
    f = e.weights[a["down"]].shape[-1]
    gu = expert("gate_up", xs)
    h = ref.glu(gu[:, :f], gu[:, f:], a["act"], a["up_offset"])
    y = (expert("down", h[:, :, None]) * gate_w.reshape(-1, 1)).view(e.bsz, a["top_k"], -1).sum(1)
    return y if a["residual"] is None else y + e.val(a["residual"])


# Ops run here rather than by their eager reference (which reads the host or upcasts whole tables).
OWN = {"embed": _embed, "linear": _linear, "kv_append": _kv_append, "attention": _attention, "moe": _moe}

# "chained-unlinked": the chained build's kernels as ordinary launches, where a GPU offers PDL but
# its launches fail (in a CUDA graph's capture, say): engine_choice tries it then
VARIANTS = ("plain", "chained", "chained-unlinked")


def _pdl_for(dev: torch.device) -> bool:
    from photon_core.kernels.chained import pdl_for
    return pdl_for(dev)


def _chained_ops(graph: Any, nodes: list[Node], observed: set[str]) -> tuple[dict[int, Any], dict[int, Node]]:
    """The nodes the chained build runs as kernels/chained.py's kernels, each with its runner (None:
    a LayerNorm, RMSNorm, GLU, gate or activation that is not observed and whose every reader
    among `nodes` is a chained linear's input, which those linears apply themselves), and those
    linears' prologue nodes (argmax: _argmax_chained). Every node of every family's step has a
    chained kernel."""
    from photon_core.megakernel.perop_chained import CHAINED
    runners: dict[int, Any] = {id(n): CHAINED[n.op] for n in nodes if n.op in CHAINED}
    here = {id(n) for n in nodes}
    fused: dict[int, Node] = {}
    for n in nodes:
        if n.op not in ("layer_norm", "rms_norm", "glu", "mul", "act") or n.value.name in observed:
            continue
        readers = [c for c in graph.consumers(n.value) if id(c) in here]
        if readers and all(c.op == "linear" and id(c) in runners and c.args["x"] is n.value
                           and c.args["residual"] is not n.value for c in readers):
            fused.update({id(c): n for c in readers})
            runners[id(n)] = None
    return runners, fused


__all__ = ["PerOpKernel", "REFERENCE_OPS", "OWN", "VARIANTS", "rounds_outputs"]
