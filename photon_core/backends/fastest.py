"""The per-op backends' linear and attention for many rows (prefill, encoders): our Triton kernel or
torch's own, whichever is faster for the shape on this GPU (runtime/measured.py).

Our large-M kernels keep the ops contract's fp32 math (`tl.dot` in "ieee" precision: CUDA cores);
torch's run the vendor's GEMM on the tensor cores in the weights' dtype (bf16 weights: bf16 inputs,
fp32 accumulation, as transformers runs them) and flash / memory-efficient attention in the inputs'
dtype. Both meet the contract's shapes, masks and output dtype; the values differ by that rounding.
A decode step's rows (M <= kernels.linear.SMALL_M_MAX) always take our GEMV: it is what a captured
step replays, and bandwidth-bound, where the tensor cores win nothing.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from photon_core.backends import reference
from photon_core.kernels import attention as triton_attention
from photon_core.kernels import linear as triton_linear
from photon_core.runtime.measured import CHOICES, measurable

def torch_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 activation: str | None = None, residual: torch.Tensor | None = None) -> torch.Tensor:
    """The contract's linear by torch's GEMM in the weights' dtype; epilogue in fp32."""
    if activation == "sigmoid":   # a gate's activation, not a linear's (as reference.linear says)
        raise ValueError("linear: unknown activation 'sigmoid'")
    y = reference.activate(F.linear(x.to(weight.dtype), weight, None if bias is None else bias.to(weight.dtype)).float(),
                           activation)
    if residual is not None:
        y = y + residual.float()
    return y.to(torch.result_type(x, weight))


def _rows_bucket(m: int) -> int:
    """Row counts measured together: powers of two (a prompt's length varies request to request)."""
    return 1 << (m - 1).bit_length()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           activation: str | None = None, residual: torch.Tensor | None = None) -> torch.Tensor:
    """act(x @ weight.T + bias) + residual (backends/contract.py), by the faster implementation."""
    m = x.numel() // max(1, x.shape[-1])
    if m <= triton_linear.SMALL_M_MAX:
        return triton_linear.linear(x, weight, bias, activation, residual)
    key = ("linear", _rows_bucket(m), weight.shape[0], weight.shape[1], x.dtype, weight.dtype, activation,
           bias is not None, residual is not None, x.device)
    return CHOICES.run(key, {"triton": lambda: triton_linear.linear(x, weight, bias, activation, residual),
                             "torch": lambda: torch_linear(x, weight, bias, activation, residual)}, measurable(x))


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
              prefix_len: int = 0, scale: float | None = None, window: int | None = None,
              bias: torch.Tensor | None = None) -> torch.Tensor:
    """Softmax attention (backends/contract.py) by the faster of our kernel and torch's SDPA (the
    reference backend's, which states the contract's masks with SDPA)."""
    if q.shape[2] == 1:
        return triton_attention.attention(q, k, v, causal, prefix_len, scale, window, bias)
    key = ("attention", q.shape[0], q.shape[1], k.shape[1], _rows_bucket(q.shape[2]), _rows_bucket(k.shape[2]),
           q.shape[3], q.dtype, k.dtype, v.dtype, causal, prefix_len > 0, window is not None, bias is not None, q.device)
    args = (q, k, v, causal, prefix_len, scale, window, bias)
    return CHOICES.run(key, {"triton": lambda: triton_attention.attention(*args),
                             "torch": lambda: reference.attention(*args)}, measurable(q))


__all__ = ["linear", "attention", "torch_linear"]
