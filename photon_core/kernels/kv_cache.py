"""KV-cache append: write this step's keys/values into a preallocated cache at per-row positions.

Layout: cache [B, H, T_max, D]; new [B, H, T_new, D]; pos [B] int32 on the device (the position of
each batch row's first new token), so the launch has no host-side values and can be graph-captured.
One program copies ONE (b, h, t) vector of D features (BLOCK_D = next_pow2(D)) for both K and V.
Bytes per vector: read 2*D*4, write 2*D*4. Positions past T_max are a caller bug: they are skipped
(masked) rather than written out of bounds, and `append` checks them on the host when asked.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _append_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, pos_ptr, H, T_NEW, T_MAX, D,
                   BLOCK_D: tl.constexpr):
    vec = tl.program_id(0).to(tl.int64)
    t = vec % T_NEW
    bh = vec // T_NEW
    b = bh // H
    p = tl.load(pos_ptr + b).to(tl.int64) + t
    d = tl.arange(0, BLOCK_D)
    pv = p + tl.zeros((BLOCK_D,), tl.int64)  # a vector, so the mask is a vector of bools
    m = (d < D) & (pv < T_MAX) & (pv >= 0)
    dst = (bh * T_MAX + p) * D + d
    tl.store(kc_ptr + dst, tl.load(k_ptr + vec * D + d, mask=m, other=0.0), mask=m)
    tl.store(vc_ptr + dst, tl.load(v_ptr + vec * D + d, mask=m, other=0.0), mask=m)


def append(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
           pos: torch.Tensor, check: bool = False) -> None:
    """k_cache[b, :, pos[b]:pos[b]+T_new] = k[b] (same for v), in place."""
    b, h, t_max, d = k_cache.shape
    if k.shape[0] != b or k.shape[1] != h or k.shape[3] != d or v.shape != k.shape:
        raise ValueError(f"kv append: new {tuple(k.shape)} does not fit cache {tuple(k_cache.shape)}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("kv append: caches must be contiguous")
    if check and int((pos.max() + k.shape[2]).item()) > t_max:
        raise ValueError(f"kv append: position {int(pos.max())} + {k.shape[2]} exceeds cache length {t_max}")
    t_new = k.shape[2]
    n = b * h * t_new
    if n:
        _append_kernel[(n,)](k.contiguous(), v.contiguous(), k_cache, v_cache,
                             pos.to(torch.int32).contiguous(), h, t_new, t_max, d,
                             BLOCK_D=triton.next_power_of_2(d))
