"""The reference ops in plain PyTorch: the CPU path, and the definition other backends must match.

Shapes: activations are [..., features]; attention takes q [B, H, Tq, D] and k, v [B, H, Tk, D],
where the Tq queries are the last Tq of the Tk positions (decode: Tq = 1).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           activation: str | None = None, residual: torch.Tensor | None = None) -> torch.Tensor:
    """act(x @ weight.T + bias) + residual; activation is None, "gelu" (erf) or "gelu_tanh"."""
    y = F.linear(x, weight, bias)
    if activation == "gelu":
        y = F.gelu(y)
    elif activation == "gelu_tanh":
        y = F.gelu(y, approximate="tanh")
    elif activation is not None:
        raise ValueError(f"unknown activation {activation!r}")
    return y if residual is None else y + residual


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               eps: float = 1e-5) -> torch.Tensor:
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
              prefix_len: int = 0, scale: float | None = None) -> torch.Tensor:
    """Softmax attention. With `causal`, query i (absolute position Tk - Tq + i) sees keys up to its
    own position; the first `prefix_len` positions additionally see each other (a bidirectional
    prefix block, as Moondream's image tokens need)."""
    tq, tk = q.shape[-2], k.shape[-2]
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    mask = None
    if causal:
        qpos = torch.arange(tk - tq, tk, device=q.device)[:, None]
        kpos = torch.arange(tk, device=q.device)[None, :]
        mask = (kpos <= qpos) | ((qpos < prefix_len) & (kpos < prefix_len))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def kv_append(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              pos: torch.Tensor) -> None:
    """k_cache[b, :, pos[b]:pos[b]+T_new] = k[b] (same for v), in place: rows of a batch that are
    at different positions (requests of different lengths decoded together)."""
    t_new = k.shape[2]
    rows = torch.arange(k.shape[0], device=k.device)[:, None]
    cols = pos.to(device=k.device, dtype=torch.long)[:, None] + torch.arange(t_new, device=k.device)
    # advanced indices [B, T_new] on dims 0 and 2 put those dims first: [B, T_new, H, D]
    k_cache[rows, :, cols] = k.transpose(1, 2).to(k_cache.dtype)
    v_cache[rows, :, cols] = v.transpose(1, 2).to(v_cache.dtype)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     lengths: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """One query per (b, h): q [B, H, 1, D] over the first lengths[b] keys of k/v [B, H, T_max, D].
    Positions past a row's length are never read (they may hold anything, NaN included: a mask
    would still multiply them by zero), so each row attends over its own slice."""
    return torch.cat([F.scaled_dot_product_attention(q[b:b + 1], k_cache[b:b + 1, :, :n],
                                                     v_cache[b:b + 1, :, :n], scale=scale)
                      for b, n in enumerate(lengths.tolist())])


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rot_dim: int) -> torch.Tensor:
    """Rotary embedding on the first `rot_dim` features of each head (the rest pass through),
    rotating pairs (i, i + rot_dim/2) — the "rotate half" convention. cos/sin: [T, rot_dim/2]."""
    rot, rest = x[..., :rot_dim], x[..., rot_dim:]
    x1, x2 = rot.chunk(2, dim=-1)
    out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return torch.cat([out, rest], dim=-1)


def argmax(logits: torch.Tensor, allowed: torch.Tensor | None = None) -> torch.Tensor:
    """Greedy pick over the last dim; `allowed` (bool, broadcastable) masks out the rest."""
    if allowed is not None:
        logits = logits.masked_fill(~allowed, float("-inf"))
    return logits.argmax(dim=-1)
