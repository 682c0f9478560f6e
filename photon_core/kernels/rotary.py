"""Rotary position embedding, "rotate half" convention, on the first rot_dim features of each head
(partial rotary, as Moondream/Phi use; rot_dim == head_dim is the full case). The rest pass through.

One program handles ONE (row, position) vector of D features: it loads the two halves x1 = x[:R/2],
x2 = x[R/2:R] (BLOCK_R = next_pow2(R/2)) and the pass-through tail (BLOCK_D = next_pow2(D)), and writes
[x1*cos - x2*sin, x2*cos + x1*sin, tail]. cos/sin rows [T, R/2] are indexed by the vector's position.

Bytes per vector: read D*4 + R*4 (cos, sin; cached), write D*4.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from photon_core.kernels import new_output


@triton.jit
def _rotary_kernel(x_ptr, cos_ptr, sin_ptr, y_ptr, T, D, HALF,
                   BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    vec = tl.program_id(0).to(tl.int64)
    t = vec % T
    base = vec * D
    r = tl.arange(0, BLOCK_R)
    rmask = r < HALF
    x1 = tl.load(x_ptr + base + r, mask=rmask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + base + HALF + r, mask=rmask, other=0.0).to(tl.float32)
    c = tl.load(cos_ptr + t * HALF + r, mask=rmask, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + t * HALF + r, mask=rmask, other=0.0).to(tl.float32)
    tl.store(y_ptr + base + r, x1 * c - x2 * s, mask=rmask)
    tl.store(y_ptr + base + HALF + r, x2 * c + x1 * s, mask=rmask)
    d = tl.arange(0, BLOCK_D)
    tmask = (d >= 2 * HALF) & (d < D)
    tail = tl.load(x_ptr + base + d, mask=tmask, other=0.0)
    tl.store(y_ptr + base + d, tail, mask=tmask)


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rot_dim: int) -> torch.Tensor:
    """Same as backends.reference.rotary: x [..., T, D], cos/sin [T, rot_dim/2]."""
    if rot_dim % 2 or rot_dim > x.shape[-1]:
        raise ValueError(f"rotary: rot_dim {rot_dim} must be even and <= head dim {x.shape[-1]}")
    t, d = x.shape[-2], x.shape[-1]
    half = rot_dim // 2
    if tuple(cos.shape) != (t, half) or tuple(sin.shape) != (t, half):
        raise ValueError(f"rotary: cos/sin must be [{t}, {half}], got {tuple(cos.shape)}")
    xc = x.contiguous()
    y = new_output(xc.shape, xc.device, xc.dtype)
    n_vec = xc.numel() // d if d else 0
    if n_vec:
        _rotary_kernel[(n_vec,)](xc, cos.contiguous(), sin.contiguous(), y, t, d, half,
                                 BLOCK_R=max(1, triton.next_power_of_2(half)),
                                 BLOCK_D=triton.next_power_of_2(d))
    return y
