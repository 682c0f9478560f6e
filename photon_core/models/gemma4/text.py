"""The Gemma 4 text decoder on the ops contract: prefill of a whole prompt and batched one-token
decode steps over a KV cache.

Per layer: RMSNorm'd q/k (and scale-free v) heads, rotary (default on sliding layers, "proportional"
on full ones: only the first share of frequency pairs rotates), attention with scale 1, norms after
attention and after the gated-GELU MLP, then the per-layer input (PLE) branch and a learned layer
scalar. Sliding layers keep a ring of `sliding_window` slots (position p lives in slot p % W), full
layers a linear cache. The last `num_kv_shared_layers` layers compute no keys/values: they attend
over the cache of the last earlier layer of their kind.
"""
from __future__ import annotations

import torch

from .config import LayerSpec, Rope, TextConfig

Tensor = torch.Tensor


def inv_freq(rope: Rope, head_dim: int) -> Tensor:
    """[head_dim / 2] frequencies; the pairs past the rotated share have frequency 0 (cos 1, sin 0)."""
    if rope.kind == "default":
        return 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
    angles = int(rope.partial * head_dim // 2)
    f = torch.zeros(head_dim // 2)
    f[:angles] = 1.0 / (rope.theta ** (torch.arange(0, 2 * angles, 2, dtype=torch.float) / head_dim))
    return f / rope.factor


class Rotary:
    """cos/sin tables per layer kind, made on demand for the positions asked."""

    def __init__(self, cfg: TextConfig, device: torch.device) -> None:
        self.freqs: dict[str, Tensor] = {}
        for L in cfg.layers:
            if L.kind not in self.freqs:
                self.freqs[L.kind] = inv_freq(cfg.rope[L.kind], L.head_dim).to(device)

    def tables(self, positions: Tensor, dtype: torch.dtype) -> dict[str, tuple[Tensor, Tensor]]:
        out = {}
        for kind, f in self.freqs.items():
            ang = positions.float()[:, None] * f[None]
            out[kind] = (ang.cos().to(dtype), ang.sin().to(dtype))
        return out


class KVCache:
    """Keys/values of every layer that makes its own: [B, Hkv, S, D], S = max_len for full layers and
    min(sliding_window, max_len) ring slots for sliding layers."""

    def __init__(self, cfg: TextConfig, batch: int, max_len: int, dtype: torch.dtype, device: torch.device) -> None:
        self.cfg, self.batch, self.max_len = cfg, batch, max_len
        self.k: dict[int, Tensor] = {}
        self.v: dict[int, Tensor] = {}
        for i, L in enumerate(cfg.layers):
            if L.kv_source == i:
                slots = min(cfg.sliding_window, max_len) if L.sliding else max_len
                shape = (batch, L.n_kv_heads, slots, L.head_dim)
                self.k[i] = torch.zeros(shape, dtype=dtype, device=device)
                self.v[i] = torch.zeros(shape, dtype=dtype, device=device)

    def slots(self, layer: int) -> int:
        return self.k[layer].shape[2]

    def copy_row(self, row: int, other: "KVCache", other_row: int = 0) -> None:
        """Row `row` takes `other`'s row (a request prefilled alone joining a batch)."""
        for i in self.k:
            n = min(self.slots(i), other.slots(i))
            if self.cfg.layers[i].sliding and other.slots(i) != self.slots(i):
                raise ValueError("sliding caches of different sizes cannot be merged")
            self.k[i][row, :, :n] = other.k[i][other_row, :, :n]
            self.v[i][row, :, :n] = other.v[i][other_row, :, :n]


def embed(ids: Tensor, w: dict[str, Tensor], cfg: TextConfig) -> Tensor:
    table = w["text.embed_tokens.weight"]
    # The scale is rounded to the weights' dtype first, as the reference does (bf16: sqrt(dim) rounded).
    return table[ids] * torch.tensor(cfg.embed_scale, dtype=table.dtype)


def per_layer_inputs(ids: Tensor, x: Tensor, w: dict[str, Tensor], cfg: TextConfig, ops) -> Tensor | None:
    """[B, T, layers, ple_dim]: the token's own per-layer embedding plus a projection of its input
    embedding x (which, for image tokens, is the image feature; their ids are the pad id)."""
    if not cfg.ple_dim:
        return None
    table = w["text.embed_tokens_per_layer.weight"]
    tok = table[ids] * torch.tensor(cfg.ple_dim ** 0.5, dtype=table.dtype)
    tok = tok.view(*ids.shape, cfg.n_layers, cfg.ple_dim)
    proj = ops.linear(x, w["text.per_layer_model_projection.weight"]) * (cfg.dim ** -0.5)
    proj = ops.rms_norm(proj.view(*ids.shape, cfg.n_layers, cfg.ple_dim),
                        w["text.per_layer_projection_norm.weight"], cfg.eps)
    return (proj + tok) * (2.0 ** -0.5)


def _heads(x: Tensor, n: int, d: int) -> Tensor:
    return x.view(*x.shape[:-1], n, d)


def _rotate(x: Tensor, cos: Tensor, sin: Tensor, ops, per_row: bool) -> Tensor:
    """x [B, H, T, D]; cos/sin [T, D/2], or with per_row (decode: one token per row, each at its own
    position) [B, D/2], where the rows play the role of time for `rotary`."""
    if per_row:
        y = ops.rotary(x[:, :, 0].transpose(0, 1).contiguous(), cos, sin, x.shape[-1])
        return y.transpose(0, 1).unsqueeze(2)
    return ops.rotary(x, cos, sin, x.shape[-1])


def _qkv(h: Tensor, i: int, L: LayerSpec, w: dict, cfg: TextConfig, ops, cos: Tensor, sin: Tensor,
         per_row: bool = False):
    """q [B, H, T, D] normed and rotated; k, v [B, Hkv, T, D] (None on layers that share another's)."""
    p = f"text.layers.{i}.self_attn."
    nq = cfg.n_heads * L.head_dim
    if L.kv_source != i:
        y, q = None, ops.linear(h, w[p + "q_proj.weight"])
    else:
        y = ops.linear(h, w[p + "qkv.weight"])
        q = y[..., :nq]
    q = ops.rms_norm(_heads(q, cfg.n_heads, L.head_dim), w[p + "q_norm.weight"], cfg.eps).transpose(1, 2)
    q = _rotate(q, cos, sin, ops, per_row)
    if y is None:
        return q, None, None
    nk = L.n_kv_heads * L.head_dim
    k_raw = _heads(y[..., nq:nq + nk], L.n_kv_heads, L.head_dim)
    v_raw = k_raw if L.k_eq_v else _heads(y[..., nq + nk:], L.n_kv_heads, L.head_dim)
    k = _rotate(ops.rms_norm(k_raw, w[p + "k_norm.weight"], cfg.eps).transpose(1, 2), cos, sin, ops, per_row)
    v = ops.rms_norm(v_raw, None, cfg.eps).transpose(1, 2)
    return q, k.contiguous(), v.contiguous()


def _block_tail(x: Tensor, attn: Tensor, i: int, L: LayerSpec, w: dict, cfg: TextConfig, ops,
                ple: Tensor | None) -> Tensor:
    """Everything after attention: o_proj, post-attention norm, MLP, per-layer input, layer scalar."""
    p = f"text.layers.{i}."
    o = ops.linear(attn.transpose(1, 2).reshape(*x.shape[:-1], -1), w[p + "self_attn.o_proj.weight"])
    x = x + ops.rms_norm(o, w[p + "post_attention_layernorm.weight"], cfg.eps)
    h = ops.rms_norm(x, w[p + "pre_feedforward_layernorm.weight"], cfg.eps)
    gu = ops.linear(h, w[p + "mlp.gate_up.weight"])
    m = ops.glu(gu[..., :L.ff_dim], gu[..., L.ff_dim:], cfg.activation)
    m = ops.linear(m, w[p + "mlp.down_proj.weight"])
    x = x + ops.rms_norm(m, w[p + "post_feedforward_layernorm.weight"], cfg.eps)
    if ple is not None:
        g = ops.linear(x, w[p + "per_layer_input_gate.weight"], activation=cfg.activation) * ple
        g = ops.linear(g, w[p + "per_layer_projection.weight"])
        x = x + ops.rms_norm(g, w[p + "post_per_layer_input_norm.weight"], cfg.eps)
    return x * w[p + "layer_scalar"]


def prefill(x: Tensor, ple: Tensor | None, w: dict, cfg: TextConfig, cache: KVCache, rotary: Rotary,
            ops, last_only: bool = False) -> Tensor:
    """Input embeddings x [B, T, dim] at positions 0..T-1 (every row the same length) through the
    stack, filling `cache`; returns the final-normed hidden states [B, T, dim], or with `last_only`
    [B, 1, dim] of the last position."""
    B, T, _ = x.shape
    if T > cache.max_len:
        raise ValueError(f"prompt of {T} tokens exceeds the cache ({cache.max_len})")
    tables = rotary.tables(torch.arange(T, device=x.device), x.dtype)
    full_kv: dict[int, tuple[Tensor, Tensor]] = {}
    for i, L in enumerate(cfg.layers):
        if last_only and L.kv_source != i and x.shape[1] > 1:
            # KV-shared layers (the last ones, config.py) write no cache, so the other positions'
            # states past this point are never read: only the last goes on (E2B: 20 of 35 layers).
            x, ple = x[:, -1:], None if ple is None else ple[:, -1:]
            tables = {kind: (c[-1:], s[-1:]) for kind, (c, s) in tables.items()}
        cos, sin = tables[L.kind]
        h = ops.rms_norm(x, w[f"text.layers.{i}.input_layernorm.weight"], cfg.eps)
        q, k, v = _qkv(h, i, L, w, cfg, ops, cos, sin)
        if k is None:
            k, v = full_kv[L.kv_source]
        else:
            full_kv[i] = (k, v)
            _store_prefill(cache, i, L, k, v, ops)
        window = cfg.sliding_window if L.sliding else None
        attn = ops.attention(q, k, v, causal=True, scale=1.0, window=window)
        x = _block_tail(x, attn, i, L, w, cfg, ops, None if ple is None else ple[:, :, i])
    return ops.rms_norm(x, w["text.norm.weight"], cfg.eps)


def _store_prefill(cache: KVCache, i: int, L: LayerSpec, k: Tensor, v: Tensor, ops) -> None:
    T = k.shape[2]
    if not L.sliding:
        zero = torch.zeros(k.shape[0], dtype=torch.long, device=k.device)
        ops.kv_append(cache.k[i], cache.v[i], k, v, zero)
        return
    # Only the last `slots` positions stay visible to later tokens; each goes to its ring slot.
    slots = cache.slots(i)
    keep = torch.arange(max(0, T - slots), T, device=k.device)
    cache.k[i][:, :, keep % slots] = k[:, :, keep].to(cache.k[i].dtype)
    cache.v[i][:, :, keep % slots] = v[:, :, keep].to(cache.v[i].dtype)


def decode_step(x: Tensor, ple: Tensor | None, pos: Tensor, w: dict, cfg: TextConfig, cache: KVCache,
                rotary: Rotary, ops) -> Tensor:
    """One token per row: x [B, 1, dim] at positions pos [B] (int64, each < cache.max_len: the
    caller's bookkeeping, not checked here to spare a device sync per step) -> final-normed hidden
    [B, 1, dim]."""
    tables = rotary.tables(pos, x.dtype)
    lengths: dict[int, Tensor] = {}
    for i, L in enumerate(cfg.layers):
        cos, sin = tables[L.kind]
        h = ops.rms_norm(x, w[f"text.layers.{i}.input_layernorm.weight"], cfg.eps)
        q, k, v = _qkv(h, i, L, w, cfg, ops, cos, sin, per_row=True)
        src = L.kv_source
        if k is not None:
            slots = cache.slots(i)
            ops.kv_append(cache.k[i], cache.v[i], k, v, pos % slots if L.sliding else pos)
            # A ring slot count below the window only happens when the whole cache is shorter than
            # the window, so the ring then never wraps: every stored position is visible.
            lengths[i] = torch.clamp(pos + 1, max=slots).to(torch.int32) if L.sliding else (pos + 1).to(torch.int32)
        attn = ops.decode_attention(q, cache.k[src], cache.v[src], lengths[src], scale=1.0)
        x = _block_tail(x, attn, i, L, w, cfg, ops, None if ple is None else ple[:, :, i])
    return ops.rms_norm(x, w["text.norm.weight"], cfg.eps)


def logits(hidden: Tensor, w: dict, cfg: TextConfig, ops) -> Tensor:
    head = w.get("text.lm_head.weight", w["text.embed_tokens.weight"])
    out = ops.linear(hidden, head)
    if cfg.final_softcap:
        c = float(cfg.final_softcap)
        out = torch.tanh(out / c) * c
    return out
