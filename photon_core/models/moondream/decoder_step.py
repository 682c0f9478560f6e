"""Moondream 2's text decode step (LM head and region heads included), stated once as a step graph
that megakernel.compiler lowers to ONE launch.

Per step, for B rows (batch bucket 1/2/4/8; each row at its own position, read from device memory):

    x = input embedding [B, D]          (word embedding, or an encoded coordinate / size: the host
                                          writes it; the Fourier region encoders are a few KFLOP)
    per layer (Phi-style parallel block, one LayerNorm feeds attention AND the MLP):
        h      = LN(x)
        q,k,v  = h @ Wqkv.T + b                         (linear tiles, LN fused in front)
        q,k    = partial rotary on the first rot_dim of each head at the row's position;
                 k, v appended to the KV cache [B, H, Tmax, Dh] at that position   (rope task)
        a      = softmax(q k^T / sqrt(Dh)) v over positions 0..pos  (split-KV partials + merge;
                 the image prefix is already in the cache and every decode position sees all of it)
        m      = x + GELU_tanh(h @ W1.T + b1) @ W2.T + b2          (MLP tiles, run beside attention)
        x      = a @ Wo.T + bo + m                                 (out-proj tiles, written in place)
    token      = argmax(post_ln(x) @ Wlm.T + blm + logit_bias[row])   (masks: -inf bias)
    coord bin  = argmax(GELU_tanh(x @ Wc1.T + bc1) @ Wc2.T + bc2)      (x BEFORE post_ln)
    size bins  = argmax per half of GELU_tanh(x @ Ws1.T + bs1) @ Ws2.T + bs2  (width, height)

so one launch yields the token, the coordinate bin and the two size bins of every row, and
`x` (the last hidden state before post_ln) stays in the state arena for the caller.

The LM head and both region heads read only the last hidden state, so their tiles run side by
side; `launch_step(region_heads=False)` runs the pruned graph without the region heads (caption, query).

`reference_step` is the same step with backends.reference ops on the model's own code paths
(text.forward / lm_logits / region heads), the ground truth for tests.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol

import torch

from photon_core.backends import reference as ref
from photon_core.megakernel.compiler import CompiledStep, Tiling
from photon_core.megakernel.graph import BATCH_BUCKETS, TaskGraph  # noqa: F401  (re-exported for callers)
from photon_core.megakernel.stepgraph import Rotary, StepGraph

from .vision import Linear

# Result columns of a step: the LM token, the coordinate bin, the width and height bins.
RESULTS = ("token", "coord", "width", "height")


@dataclass(frozen=True)
class Dims:
    d: int
    heads: int
    head_dim: int
    rot: int
    ff: int
    vocab: int
    layers: int
    region_inner: int
    coord_bins: int
    size_bins: int  # both halves (width bins + height bins)
    max_context: int


class DecoderDims(Protocol):
    """What the shared host side (MoondreamDecoderMegakernel, object rounds) reads of a decoder's
    dims: Moondream 2's Dims above and Moondream 3's both have it."""
    @property
    def d(self) -> int: ...
    @property
    def coord_bins(self) -> int: ...
    @property
    def size_bins(self) -> int: ...
    @property
    def max_context(self) -> int: ...


class MlpRegionHeads(Protocol):
    """Moondream 2's region heads (region.RegionWeights, or an object with its fields)."""
    coord_fc1: Linear
    coord_fc2: Linear
    size_fc1: Linear
    size_fc2: Linear


def dims_of(cfg: Any) -> Dims:
    """Dims from a MoondreamConfig (text and region sections)."""
    t, r = cfg.text, cfg.region
    if t.n_kv_heads != t.n_heads:
        raise NotImplementedError("the Moondream decode step compiles n_kv_heads == n_heads (moondream2) only")
    hd = t.dim // t.n_heads
    return Dims(t.dim, t.n_heads, hd, hd // 2, t.ff_dim, t.vocab_size, t.n_layers, r.inner_dim,
                r.coord_out_dim, r.size_out_dim, t.max_context)


def weight_shapes(dm: Dims) -> dict[str, tuple[int, ...]]:
    d = dm.d
    s: dict[str, tuple[int, ...]] = {}
    for li in range(dm.layers):
        s.update(block_shapes(f"L{li}", d, 3 * d))
        s.update(dense_mlp_shapes(f"L{li}", d, dm.ff))
    s.update(lm_shapes(dm))
    s.update({"c_fc1_w": (dm.region_inner, d), "c_fc1_b": (dm.region_inner,),
              "c_fc2_w": (dm.coord_bins, dm.region_inner), "c_fc2_b": (dm.coord_bins,),
              "s_fc1_w": (dm.region_inner, d), "s_fc1_b": (dm.region_inner,),
              "s_fc2_w": (dm.size_bins, dm.region_inner), "s_fc2_b": (dm.size_bins,)})
    return s


def block_shapes(L: str, d: int, qkv: int) -> dict[str, tuple[int, ...]]:
    """A parallel block's LayerNorm, fused qkv and output projection (both Moondream decoders)."""
    return {f"{L}.ln.w": (d,), f"{L}.ln.b": (d,), f"{L}.qkv_w": (qkv, d), f"{L}.qkv_b": (qkv,),
            f"{L}.proj_w": (d, d), f"{L}.proj_b": (d,)}


def dense_mlp_shapes(L: str, d: int, ff: int) -> dict[str, tuple[int, ...]]:
    return {f"{L}.fc1_w": (ff, d), f"{L}.fc1_b": (ff,), f"{L}.fc2_w": (d, ff), f"{L}.fc2_b": (d,)}


def lm_shapes(dm: Any) -> dict[str, tuple[int, ...]]:
    """post_ln, the LM head and the rotary tables (a Dims of either Moondream decoder)."""
    d = dm.d
    return {"post_ln.w": (d,), "post_ln.b": (d,), "lm_w": (dm.vocab, d), "lm_b": (dm.vocab,),
            "rope_cos": (dm.max_context, dm.rot // 2), "rope_sin": (dm.max_context, dm.rot // 2)}


def block_input(g: StepGraph, L: str, x: Any) -> tuple[Any, Any]:
    """h = LN(x), which feeds attention and the MLP, and qkv = h @ Wqkv.T + b."""
    h = g.layer_norm(f"{L}.h", x, f"{L}.ln.w", f"{L}.ln.b")
    return h, g.linear(f"{L}.qkv", h, f"{L}.qkv_w", f"{L}.qkv_b")


def lm_head(g: StepGraph, x: Any, vocab: int) -> None:
    """Exposes the last hidden state and the biased logits; the token is their argmax."""
    g.expose("hidden", x)
    bias = g.input("logit_bias", vocab)
    logits = g.linear("logits", g.layer_norm("post_ln", x, "post_ln.w", "post_ln.b"), "lm_w", "lm_b",
                      residual=bias)
    g.expose("logits", logits)
    g.argmax("token", logits)


def size_argmax(g: StepGraph, size: Any, size_bins: int) -> None:
    """Width and height bins: the argmax of each half of the size logits."""
    half = size_bins // 2
    g.argmax("width", size, 0, half)
    g.argmax("height", size, half, size_bins)


def step_graph(dm: Dims, max_len: int) -> StepGraph:
    """The decode step (module docstring) as a graph of ops, from the dims alone."""
    d, H, dh = dm.d, dm.heads, dm.head_dim
    g = StepGraph(f"moondream-decoder-d{d}-L{dm.layers}-V{dm.vocab}", weight_shapes(dm))
    kc, vc = g.cache("kcache", H, max_len, dh, layers=dm.layers), g.cache("vcache", H, max_len, dh, layers=dm.layers)
    rope = Rotary("rope_cos", "rope_sin", dm.rot)
    x = g.input("x", d)
    for li in range(dm.layers):
        L = f"L{li}"
        h, qkv = block_input(g, L, x)
        hid = g.linear(f"{L}.mlp_up", h, f"{L}.fc1_w", f"{L}.fc1_b", act="gelu_tanh")
        q = g.kv_append(f"{L}.rope", qkv, kc[li], vc[li], rotary=rope)
        a = g.attention(f"{L}.attn", q, kc[li], vc[li], "self")
        m = g.linear(f"{L}.mlp_down", hid, f"{L}.fc2_w", f"{L}.fc2_b", residual=x)
        # x + attn_out + mlp, in the reference's order: proj(a) + (x + mlp).
        x = g.linear(f"{L}.proj", a, f"{L}.proj_w", f"{L}.proj_b", residual=m)
    lm_head(g, x, dm.vocab)
    coord = g.linear("coord_logits", g.linear("coord_hid", x, "c_fc1_w", "c_fc1_b", act="gelu_tanh"),
                     "c_fc2_w", "c_fc2_b")
    g.argmax("coord", coord)
    size = g.linear("size_logits", g.linear("size_hid", x, "s_fc1_w", "s_fc1_b", act="gelu_tanh"),
                    "s_fc2_w", "s_fc2_b")
    size_argmax(g, size, dm.size_bins)
    return g


def gather_weights(text_w: Any, region_w: Any) -> dict[str, torch.Tensor]:
    """name -> tensor for the weights arena, from moondream text.TextWeights and region.RegionWeights
    (tensors are shared here; the arena copies them)."""
    t: dict[str, torch.Tensor] = {}
    for li, b in enumerate(text_w.blocks):
        t.update(block_weights(f"L{li}", b))
        t.update(dense_mlp_weights(f"L{li}", b))
    t.update(lm_weights(text_w))
    t.update({"c_fc1_w": region_w.coord_fc1[0], "c_fc1_b": region_w.coord_fc1[1],
              "c_fc2_w": region_w.coord_fc2[0], "c_fc2_b": region_w.coord_fc2[1],
              "s_fc1_w": region_w.size_fc1[0], "s_fc1_b": region_w.size_fc1[1],
              "s_fc2_w": region_w.size_fc2[0], "s_fc2_b": region_w.size_fc2[1]})
    return t


def block_weights(L: str, b: Any) -> dict[str, torch.Tensor]:
    return {f"{L}.ln.w": b.ln[0], f"{L}.ln.b": b.ln[1], f"{L}.qkv_w": b.qkv[0], f"{L}.qkv_b": b.qkv[1],
            f"{L}.proj_w": b.proj[0], f"{L}.proj_b": b.proj[1]}


def dense_mlp_weights(L: str, b: Any) -> dict[str, torch.Tensor]:
    return {f"{L}.fc1_w": b.fc1[0], f"{L}.fc1_b": b.fc1[1], f"{L}.fc2_w": b.fc2[0], f"{L}.fc2_b": b.fc2[1]}


def lm_weights(text_w: Any) -> dict[str, torch.Tensor]:
    return {"post_ln.w": text_w.post_ln[0], "post_ln.b": text_w.post_ln[1], "lm_w": text_w.lm_head[0],
            "lm_b": text_w.lm_head[1], "rope_cos": text_w.cos, "rope_sin": text_w.sin}


class ArenaKVCache:
    """One row of the megakernel's KV caches in text.KVCache's shape [layers, 1, H, Tmax, Dh]: a view
    into the state arena, so per-op prefill (text.forward) writes straight where the decode step reads."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k, self.v = k, v
        self.length = k.shape[3]


@dataclass
class StepResult:
    tokens: list[int]            # LM argmax under each row's logit bias
    coord_bins: list[int] | None  # region coordinate bin (None without region heads)
    size_bins: list[tuple[int, int]] | None  # (width bin, height bin)
    hidden: torch.Tensor         # [B, D] last hidden state before post_ln (a copy)


class MoondreamDecoderMegakernel(CompiledStep):
    """Moondream 2's decode step as one persistent launch for a fixed batch bucket.

    One weight arena and one KV cache serve both variants: the full step (LM head and region heads,
    for detect/point) and the pruned text step (caption/query).

    Usage: mk = MoondreamDecoderMegakernel(model.text_w, model.region_w, model.config, batch=1, max_len=T)
           mk.cache(row).k[:, :, :, :p] = ...          # prefix / prefill K/V of that row
           res = mk.step(embeddings [B, D], positions, bias=None, region_heads=True)
    The launch reads every step-dependent value (input embeddings, positions, logit bias) from device
    buffers written before it, so it can be captured in a CUDA graph and replayed.

    The decoder it compiles comes from the members below (dims_of, graph_of, gather_weights, the
    region heads' weight prefixes); a variant with another decoder (Moondream 3) overrides them and
    keeps the rest: the KV-cache rows, the logit bias, the launch and the step results.
    """

    gather_weights = staticmethod(gather_weights)
    region_prefixes: tuple[str, ...] = ("c_", "s_")   # weights only the region heads read

    def dims_of(self, cfg: Any) -> DecoderDims:
        return dims_of(cfg)

    def graph_of(self, cfg: Any, max_len: int) -> StepGraph:
        return step_graph(dims_of(cfg), max_len)

    def __init__(self, text_w: Any, region_w: Any, cfg: Any, batch: int, max_len: int | None = None,
                 tiling: Tiling = Tiling(), check: bool = True, weight_dtype: torch.dtype = torch.float32,
                 weights: torch.Tensor | None = None, device: torch.device | str | None = None) -> None:
        dm = self.dims_of(cfg)
        max_len = dm.max_context if max_len is None else max_len
        if not 0 < max_len <= dm.max_context:
            raise ValueError(f"max_len {max_len} must be in (0, {dm.max_context}] (the rotary table)")
        half = dm.size_bins // 2
        if half % tiling.block_n:
            raise ValueError(f"block_n {tiling.block_n} must divide the {half} bins of each size half")
        self.dm, self.max_len = dm, max_len
        super().__init__(self.graph_of(cfg, max_len), self.gather_weights(text_w, region_w), batch, tiling,
                         weight_dtype, shared_weights=weights, check=check, device=device)

    def weight_bytes_per_step(self, skip: tuple[str, ...] = (), *, region_heads: bool = True) -> int:
        """Bytes of weights one step must stream (the roofline floor's numerator): every weight once,
        except the rotary tables (one row per step), `skip` and, for text steps, the region heads."""
        if not region_heads:
            skip += tuple(k for k in self.warena.regions if k.startswith(self.region_prefixes))
        return super().weight_bytes_per_step(skip)

    def cache(self, row: int) -> ArenaKVCache:
        return ArenaKVCache(self.view("kcache")[:, row:row + 1], self.view("vcache")[:, row:row + 1])

    def set_bias(self, bias: torch.Tensor | None) -> None:
        """Per-row logit bias [B, vocab] or [vocab], float (added: 0 allowed, -inf masked) or bool (an
        allowed-token mask, turned into 0 / -inf); None clears it."""
        lb = self.view("logit_bias")
        if bias is None:
            lb.zero_()
            return
        bias = bias.to(lb.device)
        if bias.dtype == torch.bool:
            bias = torch.zeros(bias.shape, device=lb.device).masked_fill(~bias, float("-inf"))
        lb.copy_(bias.to(torch.float32).expand_as(lb))

    def launch_step(self, embeddings: torch.Tensor, positions: list[int] | torch.Tensor,
                    region_heads: bool = True) -> None:
        """Write the inputs and run one step (no host sync unless `check`)."""
        B, d = self.batch, self.dm.d
        if tuple(embeddings.shape) != (B, d):
            raise ValueError(f"need embeddings [{B}, {d}], got {tuple(embeddings.shape)}")
        self.set_step(None, positions)
        self.view("x").copy_(embeddings.to(torch.float32))
        super().launch(None if region_heads else ("token",))

    def step(self, embeddings: torch.Tensor, positions: list[int] | torch.Tensor,
             bias: torch.Tensor | None = None, region_heads: bool = True) -> StepResult:
        """Decode one position per row; `bias` (optional) replaces the logit bias first. Without
        `region_heads` the text graph runs and the bins are None."""
        if bias is not None:
            self.set_bias(bias)
        self.launch_step(embeddings, positions, region_heads)
        out = self.out.view(self.batch, len(RESULTS)).tolist()
        return StepResult([o[0] for o in out],
                          [o[1] for o in out] if region_heads else None,
                          [(o[2], o[3]) for o in out] if region_heads else None,
                          self.view("hidden").clone())


def reference_step(text_w: Any, region_w: MlpRegionHeads, cfg: Any, caches: list[Any], embeddings: torch.Tensor,
                   positions: list[int],
                   bias: torch.Tensor | None = None) -> dict[str, Any]:
    """The same step with backends.reference ops, one row at a time through the model's own
    text.forward (which appends to each row's cache) and region decoders' math. Returns hidden [B, D],
    logits [B, V] (bias added), tokens, coord bins and size bins."""
    from photon_core.models.moondream import text as text_mod

    def region_logits(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return (ref.linear(ref.linear(h, *region_w.coord_fc1, activation="gelu_tanh"), *region_w.coord_fc2),
                ref.linear(ref.linear(h, *region_w.size_fc1, activation="gelu_tanh"), *region_w.size_fc2))

    return reference_rows(text_mod, text_w, cfg, caches, embeddings, positions, bias, region_logits)


def reference_rows(text_mod: Any, text_w: Any, cfg: Any, caches: list[Any], embeddings: torch.Tensor,
                   positions: list[int], bias: torch.Tensor | None,
                   region_logits: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]) -> dict[str, Any]:
    """reference_step of either Moondream decoder: its text module's forward and lm_logits, then its
    region heads' (coordinate, size) logits, one row at a time."""
    hidden, logits, tokens, cbins, sbins = [], [], [], [], []
    for r, p in enumerate(positions):
        h = text_mod.forward(embeddings[r].view(1, 1, -1), p, text_w, cfg.text, caches[r], ref)[:, -1]
        lg = text_mod.lm_logits(h, text_w, ref)[0]
        if bias is not None:
            lg = lg + bias[r] if bias.dim() == 2 else lg + bias
        c, s = region_logits(h)
        hidden.append(h[0])
        logits.append(lg)
        tokens.append(int(lg.argmax()))
        cbins.append(int(c.argmax()))
        sb = s.view(2, -1).argmax(-1)
        sbins.append((int(sb[0]), int(sb[1])))
    return dict(hidden=torch.stack(hidden), logits=torch.stack(logits), tokens=tokens, coord_bins=cbins,
                size_bins=sbins)
