"""Phi-style text decoder: parallel blocks, partial rotary, a bidirectional image prefix, a KV cache.

Rotary: the public reference splits the first rot_dim features of each head into halves (a, b) and
writes the rotated pair back *interleaved*; ops.rotary ("rotate half") writes them back as halves.
Both rotate the same (a_i, b_i) pairs by the same angles; the results differ only by one fixed
permutation of the rotated features, applied to q and k alike, so every q.k score and therefore the
model's output is identical (test_moondream_reference checks this against the reference code).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from .config import TextConfig
from .vision import Linear, take

if TYPE_CHECKING:
    from .lora import LoraPair, Variant


@dataclass
class TextBlock:
    ln: Linear
    qkv: Linear
    proj: Linear
    fc1: Linear
    fc2: Linear


@dataclass
class TextWeights:
    wte: torch.Tensor  # [vocab, dim]
    blocks: list[TextBlock]
    post_ln: Linear
    lm_head: Linear
    cos: torch.Tensor  # [max_context, rot_dim/2], precomputed once
    sin: torch.Tensor

    @classmethod
    def from_state(cls, sd: dict[str, torch.Tensor], cfg: TextConfig) -> "TextWeights":
        blocks = [TextBlock(*(take(sd, f"text.blocks.{i}.{n}") for n in
                              ("ln", "attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2")))
                  for i in range(cfg.n_layers)]
        rot = rot_dim(cfg)
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, rot, 2, dtype=torch.float32) / rot))
        angles = torch.arange(cfg.max_context, dtype=torch.float32)[:, None] * inv_freq[None, :]
        dtype, device = sd["text.wte"].dtype, sd["text.wte"].device
        return cls(sd["text.wte"], blocks, take(sd, "text.post_ln"), take(sd, "text.lm_head"),
                   angles.cos().to(device, dtype), angles.sin().to(device, dtype))


def rot_dim(cfg: TextConfig) -> int:
    """Rotary covers the first half of each head (32 of 64 in moondream2)."""
    return cfg.dim // cfg.n_heads // 2


class KVCache:
    """Per-layer keys and values, [layers, batch, kv_heads, length, head_dim] (batch > 1 when several
    images are prefilled together or several requests decode together).

    Allocated per request or batch (torch.empty costs nothing until written), so requests never
    share state.
    """

    def __init__(self, cfg: TextConfig, length: int, dtype: torch.dtype, device, batch: int = 1) -> None:
        shape = (cfg.n_layers, batch, cfg.n_kv_heads, length, cfg.dim // cfg.n_heads)
        self.k = torch.empty(shape, dtype=dtype, device=device)
        self.v = torch.empty(shape, dtype=dtype, device=device)
        self.length = length

    def row(self, b: int) -> "KVCache":
        """Row b as a batch-1 cache sharing this one's memory (to prefill one request's prompt)."""
        view = object.__new__(KVCache)
        view.k, view.v, view.length = self.k[:, b:b + 1], self.v[:, b:b + 1], self.length
        return view

    def keep(self, rows: list[int]) -> None:
        """Drop the other rows (finished requests), so later steps stop paying for them."""
        index = torch.tensor(rows, device=self.k.device)
        self.k = self.k.index_select(1, index)
        self.v = self.v.index_select(1, index)


def embed(ids: torch.Tensor, w: TextWeights) -> torch.Tensor:
    return w.wte[ids]


def forward(x: torch.Tensor, pos: int | torch.Tensor, w: TextWeights, cfg: TextConfig, cache: KVCache,
            ops, lora: Variant | None = None) -> torch.Tensor:
    """Input embeddings [B, T, dim] -> hidden states [B, T, dim] *before* post_ln (the region heads
    read them; lm_logits applies post_ln). Writes k/v into the cache.

    pos: an int when every row is at positions pos..pos+T-1; or a [B] tensor of per-row positions
    for one decode step (T = 1) of requests at different lengths, each attending to its own first
    pos[b] + 1 cache positions.
    lora: a fine-tuned variant (lora.py) applied to every row, or None for the base model."""
    hq, hkv, hd = cfg.n_heads, cfg.n_kv_heads, cfg.dim // cfg.n_heads
    at = positions(pos, x.shape[1], w, cache)
    if lora is not None and len(lora.layers) != len(w.blocks):
        raise ValueError(f"variant {lora.name!r} has {len(lora.layers)} layers, the model {len(w.blocks)}")
    for i, b in enumerate(w.blocks):
        h = ops.layer_norm(x, *b.ln)  # one norm feeds attention and MLP: the parallel block
        d = lora.layers[i] if lora is not None else None
        qkv = ops.linear(h, *b.qkv) if d is None else ops.linear(h, *b.qkv, residual=_delta(h, d.qkv, ops))
        q, k, v = qkv.split([hq * hd, hkv * hd, hkv * hd], dim=-1)
        a = attend(q, k, v, i, at, cfg, cache, ops)
        if d is None:
            mlp = ops.linear(ops.linear(h, *b.fc1, activation="gelu_tanh"), *b.fc2)
            x = ops.linear(a, *b.proj, residual=x + mlp)
            continue
        # The delta joins fc1's output before the activation, which ops.linear applies before its
        # residual: take the activation apart. glu with up = 0 and offset 1 is exactly act(gate).
        pre = ops.linear(h, *b.fc1, residual=_delta(h, d.fc1, ops))
        mid = ops.glu(pre, torch.zeros_like(pre), "gelu_tanh", up_offset=1.0)
        mlp = ops.linear(mid, *b.fc2, residual=_delta(mid, d.fc2, ops))
        # The reference feeds the output projection's delta the block's normed input h, not the
        # attention output the base projection reads; adapters are trained against that code.
        x = ops.linear(a, *b.proj, residual=x + mlp + _delta(h, d.proj, ops))
    return x


def _delta(x: torch.Tensor, pair: LoraPair, ops) -> torch.Tensor:
    """A LoRA's contribution B (A x), unscaled as the reference adds it."""
    return ops.linear(ops.linear(x, pair.a), pair.b)


class RotaryTables(Protocol):
    """The rotary angle tables [max_context, rot_dim/2] positions() reads: Moondream 2's TextWeights
    and Moondream 3's both hold them."""
    cos: torch.Tensor
    sin: torch.Tensor


@dataclass
class Positions:
    """Where one forward's tokens sit: rows at pos..end-1 (an int pos), or one token per row at its
    own position (a [B] tensor pos, `ragged`); the rotary angles of those positions."""
    pos: int | torch.Tensor
    ragged: bool
    end: int
    cos: torch.Tensor
    sin: torch.Tensor


def positions(pos: int | torch.Tensor, t: int, w: RotaryTables, cache: KVCache) -> Positions:
    ragged = isinstance(pos, torch.Tensor)
    if ragged and t != 1:
        raise ValueError("per-row positions take one token per row")
    end = int(pos.max()) + 1 if isinstance(pos, torch.Tensor) else pos + t
    if end > cache.length:
        raise RuntimeError(f"sequence of {end} tokens exceeds the KV cache ({cache.length})")
    cos, sin = (w.cos[pos], w.sin[pos]) if ragged else (w.cos[pos:end], w.sin[pos:end])
    return Positions(pos, ragged, end, cos, sin)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, at: Positions, cfg: TextConfig,
           cache: KVCache, ops) -> torch.Tensor:
    """One layer's attention from its projections q [B, T, hq*hd], k, v [B, T, hkv*hd] (before rotary):
    partial rotary on q and k, k/v written to the cache, causal attention with the bidirectional
    image prefix. Returns [B, T, dim] (before the output projection)."""
    bsz, t, _ = q.shape
    hq, hkv = cfg.n_heads, cfg.n_kv_heads
    hd = cfg.dim // hq
    rot, pos, ragged = rot_dim(cfg), at.pos, at.ragged
    q = _rotary(q.reshape(bsz, t, hq, hd).transpose(1, 2), at.cos, at.sin, rot, ragged, ops)
    k = _rotary(k.reshape(bsz, t, hkv, hd).transpose(1, 2), at.cos, at.sin, rot, ragged, ops)
    v = v.reshape(bsz, t, hkv, hd).transpose(1, 2)
    if ragged:
        ops.kv_append(cache.k[layer], cache.v[layer], k, v, pos)
    else:
        cache.k[layer, :, :, pos:at.end] = k
        cache.v[layer, :, :, pos:at.end] = v
    # decode_attention reads only each row's own length: give it the whole (contiguous) cache
    keys, values = (cache.k[layer], cache.v[layer]) if ragged else \
        (cache.k[layer, :, :, :at.end], cache.v[layer, :, :, :at.end])
    if hkv != hq:
        keys = keys.repeat_interleave(hq // hkv, dim=1)
        values = values.repeat_interleave(hq // hkv, dim=1)
    if ragged:
        a = ops.decode_attention(q, keys, values, pos + 1)
    else:
        a = ops.attention(q, keys, values, causal=True, prefix_len=cfg.prefix_attn)
    return a.transpose(1, 2).reshape(bsz, t, hq * hd)


def _rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rot: int, ragged: bool, ops) -> torch.Tensor:
    """ops.rotary on [B, H, T, hd]. With one position per row (ragged, T = 1) the rows are put
    where ops.rotary expects positions: [H, B, hd] against cos/sin [B, rot/2]."""
    if not ragged:
        return ops.rotary(x, cos, sin, rot)
    return ops.rotary(x[:, :, 0].transpose(0, 1), cos, sin, rot).transpose(0, 1)[:, :, None]


def lm_logits(hidden: torch.Tensor, w: TextWeights, ops) -> torch.Tensor:
    """Hidden states [..., dim] (before post_ln) -> logits [..., vocab], in float32 for sampling."""
    return ops.linear(ops.layer_norm(hidden, *w.post_ln), *w.lm_head).float()
