"""Gated linear units: y = act(gate) * (up + up_offset), elementwise.

The op behind SwiGLU (Qwen: silu), GeGLU (Gemma: gelu_tanh), Moondream 3's expert activation
(gelu(h) * (g + 1): gelu with up_offset 1) and the conformer's GLU (sigmoid of the second half times
the first). gate and up are [M, F] row-major views that may sit inside one fused [M, 2F] projection
output (row strides passed separately), so splitting a gate-up projection costs no copy.

One program handles BLOCK_F features of ONE row. Grid: (M, cdiv(F, BLOCK_F)). Bytes per element:
read 2*4, write 4 (fp32): purely memory-bound.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from photon_core.kernels import new_output
from photon_core.kernels.linear import ACT_GELU, ACT_GELU_TANH, ACT_SIGMOID, ACT_SILU, apply_activation

GLU_ACTS = {"silu": ACT_SILU, "gelu": ACT_GELU, "gelu_tanh": ACT_GELU_TANH, "sigmoid": ACT_SIGMOID}


def glu_code(activation: str) -> int:
    if activation not in GLU_ACTS:
        raise ValueError(f"glu: unknown activation {activation!r}; choose one of {tuple(GLU_ACTS)}")
    return GLU_ACTS[activation]


@triton.jit
def _glu_kernel(g_ptr, u_ptr, y_ptr, F, stride_g, stride_u, up_offset,
                ACT: tl.constexpr, BLOCK_F: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    mask = cols < F
    g = tl.load(g_ptr + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * F + cols, apply_activation(g, ACT) * (u + up_offset), mask=mask)


def _rows(t: torch.Tensor) -> torch.Tensor:
    t2 = t.reshape(-1, t.shape[-1])  # a view when t is a slice of a wider row-major tensor
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def glu(gate: torch.Tensor, up: torch.Tensor, activation: str = "silu", up_offset: float = 0.0) -> torch.Tensor:
    """act(gate) * (up + up_offset); gate and up of one shape, last dim contiguous (or copied)."""
    act = glu_code(activation)
    if gate.shape != up.shape:
        raise ValueError(f"glu: gate {tuple(gate.shape)} and up {tuple(up.shape)} differ")
    f = gate.shape[-1]
    g2, u2 = _rows(gate), _rows(up)
    m = g2.shape[0]
    y = new_output((m, f), gate.device, gate.dtype)
    if m and f:
        block = min(1024, triton.next_power_of_2(f))
        _glu_kernel[(m, triton.cdiv(f, block))](g2, u2, y, f, g2.stride(0), u2.stride(0), float(up_offset),
                                                ACT=act, BLOCK_F=block)
    return y.view(gate.shape)
