"""A model's decode step stated once, as a graph of ops: what a family writes, what `eager.run_reference`
runs eagerly and what compiler.py lowers to megakernel tasks. Nothing here knows a model.

A step decodes one position for each of B rows (the batch belongs to the compiler, not the graph);
every Value is a per-row vector with a name and a width. The ops:

    input(name, width)                 a value the host writes before the step (input embeddings, a
                                       logit bias)
    embed(tok, pos, scale)             tok[token] * scale (+ pos[position]): the row's token and
                                       position come from the step's dynamic buffer
    layer_norm(x, w, b)                statistics over x's width; only linears may read its output, so
                                       the compiler fuses it in front of them
    rms_norm(x, w, offset)             x / rms(x) * (offset + w) (offset 1: Gemma's and Qwen 3.5's
                                       convention); fused like layer_norm
    linear(x, w, b, act, residual)     act(x @ w.T + b) + residual   (act: None, gelu, gelu_tanh, silu)
    glu(x, act)                        act(gate) * up of x = gate | up (SwiGLU: silu, GeGLU: gelu); only
                                       linears may read it, so the compiler fuses it into their loads
    mul(x, g, act, c0)                 x[c0:c0+w] * act(g), w = g's width (gate(x, g): act sigmoid, Qwen
                                       3.5's attention output gate; Gemma 4's per-layer input gate)
    act(x, act)                        act(x) (Moondream 3's gelu(qkv) into tau); mul, act, glu and the
                                       norms are read by linears only: the compiler fuses them into
                                       the linears' loads
    add_norm(x, z, w, chunk, scale)    (x + rms_norm(z) * (offset + w)) * scale, the norm over each
                                       `chunk` columns (default all): Gemma's post-norm residuals and
                                       per-layer inputs; a row task of its own
    kv_append(qkv, k, v, rotary, ...)  q|k|v = qkv split into heads (fewer K/V heads than query heads:
                                       grouped-query attention); optionally each head RMS-normalised
                                       (Qwen3 / Gemma 4 q_norm, k_norm, v_norm) and scaled by tau
                                       (Moondream 3); q and k rotated at the row's rotary position (its
                                       position + its rotary offset); k, v appended to the caches at the
                                       row's position -> q. append=False: qkv is q alone (a layer that
                                       reads another layer's cache, Gemma 4's shared KV)
    attention(q, k, v, length, window, scale)
                                       per head, softmax(scale * q k^T) v over the row's keys: "self"
                                       = the first position + 1, "cross" = its cross length; with a
                                       window only the last `window` of them (sliding-window layers)

A cache declared `ring=True` holds only its last `length` positions (position p in slot p % length):
a sliding-window layer's bounded cache. Only windowed attention (window <= length) may read one.
    conv_step(x, state, w, c0, c1)     causal depthwise conv of x[c0:c1] over time, one new input: the
                                       state [C, W-1] holds the last W-1 inputs, updated in place
    delta_rule(x, zba, state, ...)     one token of the gated delta rule (Gated DeltaNet): x = q|k|v,
                                       zba[c0:] = z|b|a, state [Hv, Dk, Dv] updated in place; out is
                                       the per-head gated RMSNorm of the read (rms_norm_gated)
    moe(x, logits, gate_up, down, k)   mixture of experts (ops.moe after the router's logits): the top k
                                       experts of each row by `logits`, act(x G_e) * (x U_e + offset)
                                       through D_e, weighted; only chosen experts' weights are read
    argmax(x, name, c0, c1, advance)   int32 result column `name`: argmax of x[c0:c1] (first of ties);
                                       `advance` also makes it the row's next token and steps the position

Caches are state the graph declares ([B, H, T, Dh] per layer, or [L, B, H, T, Dh] for `layers`):
the host fills them (prefill, cross K/V), kv_append appends to them. Recurrent states ([B, *shape],
`state()`) are fixed-size regions the host fills after prefill and conv_step / delta_rule update.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping


ACTIVATIONS = (None, "gelu", "gelu_tanh", "silu")
LINEAR_ACTIVATIONS = ACTIVATIONS + ("tanh",)
GATE_ACTIVATIONS = ACTIVATIONS + ("sigmoid", "tanh")
LENGTHS = ("self", "cross")


@dataclass(frozen=True)
class Value:
    name: str
    width: int


@dataclass(frozen=True)
class CacheSpec:
    name: str
    heads: int
    length: int
    head_dim: int
    layers: int | None = None     # one region [L, B, H, T, Dh] instead of [B, H, T, Dh]
    ring: bool = False            # position p lives in slot p % length (a sliding window's cache)

    def __getitem__(self, layer: int) -> "CacheRef":
        if self.layers is None or not 0 <= layer < self.layers:
            raise IndexError(f"cache {self.name!r} has no layer {layer}")
        return CacheRef(self, layer)


@dataclass(frozen=True)
class CacheRef:
    spec: CacheSpec
    layer: int | None = None

    @property
    def key(self) -> str:
        """Identifies this cache's memory for the checker (one layer of a layered cache)."""
        return self.spec.name if self.layer is None else f"{self.spec.name}[{self.layer}]"


@dataclass(frozen=True)
class Rotary:
    cos: str          # weight names of [T, rot/2] tables
    sin: str
    dims: int         # rotated features per head (pairs (i, i + dims/2), "rotate half")


@dataclass(frozen=True)
class StateSpec:
    """A fixed-size per-row recurrent state ([B, *shape] in the arena), kept across steps."""
    name: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class HeadNorm:
    """RMSNorm of each head of q, k and/or v over its Dh features, before rotary: y = x / rms(x) *
    (offset + w), or no scale at all where the weight is None (Gemma 4's v_norm)."""
    q: str | None = None          # weight names of [Dh] scales
    k: str | None = None
    v: bool = False               # v normalised without a scale
    eps: float = 1e-6
    offset: float = 0.0


@dataclass(frozen=True)
class Tau:
    """Moondream 3's tau attention: with t = tanh(gelu(qkv) @ W_tau.T) ([2 * Hq], the `value`) and
    p_h = sigmoid(alpha_h * log(position + 1)) + 0.5, query head h is scaled by t[h] + p_h and
    value head h by t[Hq + h] + p_h, before rotary and the append."""
    value: "Value"
    alpha: str         # weight name of [Hq]


@dataclass
class Node:
    op: str
    out: Value | None          # None for argmax only (it writes a result column, not a value)
    args: dict[str, Any] = field(default_factory=dict)

    @property
    def value(self) -> Value:
        """The value this node defines (every op but argmax)."""
        if self.out is None:
            raise ValueError(f"a {self.op} node defines no value")
        return self.out


def _cache(c: CacheSpec | CacheRef) -> CacheRef:
    return c if isinstance(c, CacheRef) else CacheRef(c)


class StepGraph:
    """Builder and container of one decode step. `weights` maps every weight name the step reads to
    its shape (meta tensors' shapes are enough: graphs of real sizes cost no memory)."""

    def __init__(self, name: str, weights: Mapping[str, tuple[int, ...]]) -> None:
        self.name = name
        self.weight_shapes = {k: tuple(v) for k, v in weights.items()}
        self.nodes: list[Node] = []
        self.values: dict[str, Value] = {}
        self.caches: dict[str, CacheSpec] = {}
        self.states: dict[str, StateSpec] = {}
        self.results: list[str] = []          # argmax result columns, in order
        self.exposed: dict[str, Value] = {}   # values the host reads after a step (logits, hidden)

    # -- declarations --------------------------------------------------------------------------
    def cache(self, name: str, heads: int, length: int, head_dim: int, layers: int | None = None,
              ring: bool = False) -> CacheSpec:
        if name in self.caches:
            raise ValueError(f"cache {name!r} declared twice")
        spec = CacheSpec(name, heads, length, head_dim, layers, ring)
        self.caches[name] = spec
        return spec

    def state(self, name: str, *shape: int) -> StateSpec:
        if name in self.caches or name in self.states:
            raise ValueError(f"state {name!r} declared twice")
        spec = StateSpec(name, tuple(shape))
        self.states[name] = spec
        return spec

    def expose(self, name: str, value: Value) -> Value:
        """Let the host read `value` after each step under `name`."""
        self.exposed[name] = value
        return value

    # -- ops -----------------------------------------------------------------------------------
    def input(self, name: str, width: int) -> Value:
        return self._add("input", name, width)

    def embed(self, name: str, tok: str, pos: str | None = None, scale: float = 1.0) -> Value:
        v, d = self._shape(tok, 2)
        if pos is not None and self._shape(pos, 2)[1] != d:
            raise ValueError(f"{pos!r} width {self.weight_shapes[pos][1]} != {tok!r} width {d}")
        return self._add("embed", name, d, tok=tok, pos=pos, scale=scale)

    def layer_norm(self, name: str, x: Value, w: str, b: str | None = None, eps: float = 1e-5) -> Value:
        self._vector(w, x.width)
        if b is not None:
            self._vector(b, x.width)
        return self._add("layer_norm", name, x.width, x=x, w=w, b=b, eps=eps)

    def rms_norm(self, name: str, x: Value, w: str, eps: float = 1e-6, offset: float = 0.0) -> Value:
        self._vector(w, x.width)
        return self._add("rms_norm", name, x.width, x=x, w=w, eps=eps, offset=offset)

    def glu(self, name: str, x: Value, act: str = "silu") -> Value:
        if act not in ACTIVATIONS[1:] or x.width % 2:
            raise ValueError(f"glu {name!r}: needs an activation of {ACTIVATIONS[1:]} and an even width")
        return self._add("glu", name, x.width // 2, x=x, act=act)

    def mul(self, name: str, x: Value, g: Value, act: str | None = "sigmoid", c0: int = 0) -> Value:
        """x[:, c0:c0 + w] * act(g), w = g.width."""
        if not 0 <= c0 <= x.width - g.width:
            raise ValueError(f"mul {name!r}: columns [{c0}, {c0 + g.width}) outside {x.name!r} of width {x.width}")
        if act not in GATE_ACTIVATIONS:
            raise ValueError(f"mul {name!r}: activation {act!r} is not one of {GATE_ACTIVATIONS}")
        return self._add("mul", name, g.width, x=x, g=g, act=act, c0=c0)

    def gate(self, name: str, x: Value, g: Value) -> Value:
        """x * sigmoid(g)."""
        if g.width != x.width:
            raise ValueError(f"gate {name!r}: {g.name!r} has width {g.width}, {x.name!r} has {x.width}")
        return self.mul(name, x, g, "sigmoid")

    def act(self, name: str, x: Value, act: str) -> Value:
        if act not in ACTIVATIONS[1:]:
            raise ValueError(f"act {name!r}: activation {act!r} is not one of {ACTIVATIONS[1:]}")
        return self._add("act", name, x.width, x=x, act=act)

    def add_norm(self, name: str, x: Value, z: Value, w: str, eps: float = 1e-6, offset: float = 0.0,
                 chunk: int | None = None, scale: float = 1.0, scale_w: str | None = None) -> Value:
        """(x + rms_norm(z) * (offset + w)) * scale (* scale_w[0]), the norm taken over each `chunk`
        columns of z (all of them by default) with one shared [chunk] weight."""
        chunk = z.width if chunk is None else chunk
        if x.width != z.width or z.width % chunk:
            raise ValueError(f"add_norm {name!r}: {x.name!r} ({x.width}) and {z.name!r} ({z.width}) must have "
                             f"one width, a multiple of the chunk {chunk}")
        self._vector(w, chunk)
        if scale_w is not None:
            self._vector(scale_w, 1)
        return self._add("add_norm", name, x.width, x=x, z=z, w=w, eps=eps, offset=offset, chunk=chunk,
                         scale=scale, scale_w=scale_w)

    def linear(self, name: str, x: Value, w: str, b: str | None = None, act: str | None = None,
               residual: Value | None = None) -> Value:
        n, k = self._shape(w, 2)
        if k != x.width:
            raise ValueError(f"linear {name!r}: {w!r} takes {k} features, {x.name!r} has {x.width}")
        if b is not None:
            self._vector(b, n)
        if act not in LINEAR_ACTIVATIONS:
            raise ValueError(f"linear {name!r}: activation {act!r} is not one of {LINEAR_ACTIVATIONS}")
        if residual is not None and residual.width != n:
            raise ValueError(f"linear {name!r}: residual {residual.name!r} has width {residual.width}, not {n}")
        return self._add("linear", name, n, x=x, w=w, b=b, act=act, residual=residual)

    def kv_append(self, name: str, qkv: Value, k: CacheSpec | CacheRef, v: CacheSpec | CacheRef,
                  rotary: Rotary | None = None, q_heads: int | None = None, norm: HeadNorm | None = None,
                  tau: Tau | None = None, append: bool = True) -> Value:
        """`qkv` is q (q_heads heads; default: the caches' heads) | k | v (the caches' heads each):
        grouped-query attention when q_heads is a multiple of the K/V heads. `norm`: per-head RMSNorm
        of q / k / v before rotary."""
        k, v = _cache(k), _cache(v)
        h, dh = k.spec.heads, k.spec.head_dim
        hq = h if q_heads is None else q_heads
        if (v.spec.heads, v.spec.head_dim) != (h, dh) or hq % h or qkv.width != (hq + (2 * h if append else 0)) * dh:
            raise ValueError(f"kv_append {name!r}: {qkv.name!r} of width {qkv.width} is not q|k|v of "
                             f"{hq} query and {h} key/value heads of {dh}")
        if rotary is not None:
            t, half = self._shape(rotary.cos, 2)
            if self._shape(rotary.sin, 2) != (t, half) or 2 * half != rotary.dims or rotary.dims > dh:
                raise ValueError(f"kv_append {name!r}: rotary tables must be [T, {rotary.dims // 2}], "
                                 f"rotating at most the {dh} features of a head")
        if k.spec.ring != v.spec.ring:
            raise ValueError(f"kv_append {name!r}: K and V caches must both be rings or neither")
        if norm is not None:
            for w in (norm.q, norm.k):
                if w is not None:
                    self._vector(w, dh)
        if tau is not None:
            if norm is not None:
                raise ValueError(f"kv_append {name!r}: tau and head norms together are not defined")
            if not append or tau.value.width != 2 * hq:
                raise ValueError(f"kv_append {name!r}: tau needs the append and a value of 2 x {hq} columns")
            self._vector(tau.alpha, hq)
        return self._add("kv_append", name, hq * dh, qkv=qkv, k=k, v=v, rotary=rotary, norm=norm, tau=tau,
                         append=append)

    def attention(self, name: str, q: Value, k: CacheSpec | CacheRef, v: CacheSpec | CacheRef,
                  length: str = "self", window: int | None = None, scale: float | None = None) -> Value:
        """`scale` defaults to 1/sqrt(Dh); `window`: only the last `window` keys (a ring cache needs
        one no longer than the ring)."""
        k, v = _cache(k), _cache(v)
        if length not in LENGTHS:
            raise ValueError(f"attention {name!r}: length {length!r} is not one of {LENGTHS}")
        if window is not None and (window < 1 or length != "self"):
            raise ValueError(f"attention {name!r}: a window (>= 1) applies to self-attention only")
        if k.spec.ring and (window is None or window > k.spec.length):
            raise ValueError(f"attention {name!r}: cache {k.spec.name!r} is a ring of {k.spec.length} "
                             f"positions; attention over it needs a window of at most that, not {window}")
        dims = (k.spec.heads, k.spec.head_dim, k.spec.length)
        hq, rest = divmod(q.width, k.spec.head_dim)
        if rest or hq % k.spec.heads or dims != (v.spec.heads, v.spec.head_dim, v.spec.length):
            raise ValueError(f"attention {name!r}: q {q.name!r} and caches disagree on heads / head size")
        return self._add("attention", name, q.width, q=q, k=k, v=v, length=length, window=window,
                         scale=scale)

    def conv_step(self, name: str, x: Value, state: StateSpec, w: str, c0: int = 0, c1: int | None = None,
                  act: str | None = "silu") -> Value:
        """y[c] = act(sum_j w[c, j] * xp[c, j]), xp = the state's W-1 inputs (oldest first) then
        x[c0 + c]; the state then drops its oldest input (ops.causal_conv1d, one step, no bias)."""
        c1 = x.width if c1 is None else c1
        ch, width = self._shape(w, 2)
        if not 0 <= c0 < c1 <= x.width or c1 - c0 != ch or state.shape != (ch, width - 1) or not 2 <= width <= 8:
            raise ValueError(f"conv_step {name!r}: {w!r} {ch}x{width} over columns [{c0}, {c1}) of "
                             f"{x.name!r} needs a state of ({ch}, {width - 1}) and 2 <= W <= 8")
        if act not in ACTIVATIONS:
            raise ValueError(f"conv_step {name!r}: activation {act!r} is not one of {ACTIVATIONS}")
        return self._add("conv_step", name, ch, x=x, state=state, w=w, c0=c0, act=act)

    def delta_rule(self, name: str, x: Value, zba: Value, state: StateSpec, k_heads: int, a_log: str,
                   dt_bias: str, norm_w: str, c0: int = 0, eps: float = 1e-6) -> Value:
        """Gated DeltaNet's token step. x = q (k_heads x Dk) | k (k_heads x Dk) | v (Hv x Dv), with
        state [Hv, Dk, Dv]; zba[c0:] = z (Hv x Dv) | b (Hv) | a (Hv). q, k are L2-normalised, q
        scaled by Dk^-0.5; beta = sigmoid(b), g = -exp(a_log) * softplus(a + dt_bias); value head h
        uses q/k head h // (Hv / k_heads) (ops.gated_delta_step). Out: rms_norm_gated(o, z, norm_w)
        per head, [Hv * Dv]."""
        if len(state.shape) != 3:
            raise ValueError(f"delta_rule {name!r}: state {state.name!r} must be [Hv, Dk, Dv]")
        hv, dk, dv = state.shape
        if hv % k_heads or x.width != 2 * k_heads * dk + hv * dv or zba.width < c0 + hv * dv + 2 * hv:
            raise ValueError(f"delta_rule {name!r}: {x.name!r} (width {x.width}) is not q|k|v of {k_heads} "
                             f"q/k heads of {dk} and {hv} value heads of {dv}, or {zba.name!r} lacks z|b|a at {c0}")
        for w_name in (a_log, dt_bias):
            self._vector(w_name, hv)
        self._vector(norm_w, dv)
        return self._add("delta_rule", name, hv * dv, x=x, zba=zba, state=state, k_heads=k_heads, a_log=a_log,
                         dt_bias=dt_bias, norm_w=norm_w, c0=c0, eps=eps)

    def moe(self, name: str, x: Value, logits: Value, gate_up: str, down: str, top_k: int, act: str = "silu",
            up_offset: float = 0.0, renormalize: bool = True, residual: Value | None = None,
            gate_up_scale: str | None = None, down_scale: str | None = None) -> Value:
        """gate_up [E, 2F, D] (gate rows, then up rows), down [E, D, F]; logits [E] per row (a
        linear's output). Out: [D] (+ residual). With scales ([E, 2F] and [E, D], both or neither)
        the experts are FP8 e4m3 with per-output-row scales: W_e = fp8.float() * scale_e[:, None];
        the compiled step keeps the bytes and scales each row's dot product after the K loop."""
        e, f2, d = self._shape(gate_up, 3)
        if self._shape(down, 3) != (e, d, f2 // 2) or x.width != d or logits.width != e or not 1 <= top_k <= e:
            raise ValueError(f"moe {name!r}: {gate_up!r} {self.weight_shapes[gate_up]} and {down!r} "
                             f"{self.weight_shapes[down]} do not fit x ({x.width}), logits ({logits.width}), k {top_k}")
        if act not in ACTIVATIONS[1:] or (residual is not None and residual.width != d):
            raise ValueError(f"moe {name!r}: activation {act!r} or residual width does not fit")
        if (gate_up_scale is None) != (down_scale is None):
            raise ValueError(f"moe {name!r}: FP8 experts need both scales (gate_up_scale and down_scale)")
        if gate_up_scale is not None and down_scale is not None and (
                self._shape(gate_up_scale, 2) != (e, f2) or self._shape(down_scale, 2) != (e, d)):
            raise ValueError(f"moe {name!r}: scales must be [{e}, {f2}] and [{e}, {d}] (one per expert output row)")
        return self._add("moe", name, d, x=x, logits=logits, gate_up=gate_up, down=down, top_k=top_k, act=act,
                         up_offset=up_offset, renormalize=renormalize, residual=residual,
                         gate_up_scale=gate_up_scale, down_scale=down_scale)

    def fp8_weights(self) -> dict[str, str]:
        """FP8 expert tables -> the name of their row scales."""
        return {n.args[w]: n.args[f"{w}_scale"] for n in self.nodes if n.op == "moe" and n.args["gate_up_scale"]
                for w in ("gate_up", "down")}

    def argmax(self, name: str, x: Value, c0: int = 0, c1: int | None = None, advance: bool = False) -> None:
        c1 = x.width if c1 is None else c1
        if not 0 <= c0 < c1 <= x.width:
            raise ValueError(f"argmax {name!r}: columns [{c0}, {c1}) outside {x.name!r} of width {x.width}")
        if name in self.results:
            raise ValueError(f"result {name!r} declared twice")
        self.results.append(name)
        self.nodes.append(Node("argmax", None, dict(x=x, name=name, c0=c0, c1=c1, advance=advance)))

    # -- helpers -------------------------------------------------------------------------------
    def _add(self, op: str, name: str, width: int, **args: Any) -> Value:
        if name in self.values:
            raise ValueError(f"value {name!r} defined twice (values are single-assignment)")
        value = Value(name, width)
        self.values[name] = value
        self.nodes.append(Node(op, value, args))
        return value

    def _shape(self, w: str, rank: int) -> tuple[int, ...]:
        if w not in self.weight_shapes:
            raise KeyError(f"{self.name}: weight {w!r} is not among the step's weights")
        shape = self.weight_shapes[w]
        if len(shape) != rank:
            raise ValueError(f"{self.name}: weight {w!r} has shape {shape}, expected rank {rank}")
        return shape

    def _vector(self, w: str, n: int) -> None:
        if self._shape(w, 1) != (n,):
            raise ValueError(f"{self.name}: weight {w!r} has shape {self.weight_shapes[w]}, expected ({n},)")

    def consumers(self, value: Value) -> list[Node]:
        return [n for n in self.nodes if any(a is value or (isinstance(a, Tau) and a.value is value)
                                             for a in n.args.values())]

    def weight_bytes(self, element_size: int = 4, skip: tuple[str, ...] = (), rows: int = 1) -> int:
        """Bytes of weights one step streams: every weight once, except tables the step only looks
        rows up in (embedding and position tables, rotary tables), which cost one row each; a table
        that is also a linear's weight (a tied LM head) is streamed whole; experts cost the
        DISTINCT experts the batch's rows choose (the compiled step reads an expert once however
        many rows chose it): one row, its top k of E; `rows` rows routing uniformly at random, the
        expected count E * (1 - (1 - k/E)^rows) (a row misses a given expert with probability
        1 - k/E), between k and min(E, rows * k). FP8 experts cost 1 byte a weight and their
        chosen rows' scales 4 bytes; the rest `element_size`. Rounded to whole bytes."""
        experts = {n.args[k]: n.args["top_k"] for n in self.nodes if n.op == "moe"
                   for k in ("gate_up", "down", "gate_up_scale", "down_scale") if n.args.get(k)}
        fp8 = self.fp8_weights()
        scales = set(fp8.values())
        looked_up = set()
        for n in self.nodes:
            if n.op == "embed":
                looked_up |= {n.args["tok"], n.args["pos"]}
            elif (r := n.args.get("rotary")) is not None:
                looked_up |= {r.cos, r.sin}
        streamed = {n.args[k] for n in self.nodes if n.op != "embed" for k in ("w", "b") if n.args.get(k)}
        total = 0.0
        for k, shape in self.weight_shapes.items():
            if k in skip:
                continue
            size = 1 if k in fp8 else 4 if k in scales else element_size
            if k in experts:
                total += expected_experts(shape[0], experts[k], rows) * math.prod(shape[1:]) * size
            else:
                total += (shape[-1] if k in looked_up and k not in streamed else math.prod(shape)) * size
        return round(total)


def expected_experts(num_experts: int, top_k: int, rows: int) -> float:
    """Expected number of distinct experts `rows` rows choose, each its top_k of num_experts,
    under uniform independent routing: each expert is missed by all rows with probability
    (1 - k/E)^rows. Exactly k for one row."""
    if rows == 1:
        return float(top_k)
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** rows)
