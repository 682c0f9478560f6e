"""Linear layer y = act(x @ W.T + b) + residual, with bias, activation and residual fused in the epilogue.

Two paths, chosen by the number of rows M:

* small-M (decode, M <= 16): GEMV-like. One program owns a [BLOCK_M, BLOCK_N] output tile holding ALL
  rows (BLOCK_M = next_pow2(M)) and BLOCK_N output features; it walks K in BLOCK_K steps, loading each
  [BLOCK_N, BLOCK_K] weight tile exactly once and applying it to every row with a broadcast multiply and
  a reduction over K (no tensor cores needed; the step is bandwidth-bound). Grid: cdiv(N, BLOCK_N).
  Bytes: the whole weight once (N*K*4) + x re-read per program (M*K*4, small) + M*N*4 written.
* large-M (prefill, encoder): classic tiled matmul with tl.dot, [BLOCK_M, BLOCK_N] tiles, K in
  BLOCK_K steps, fp32 "ieee" precision so results match the fp32 reference. Grid: cdiv(M,BM) x cdiv(N,BN).
  Bytes: x re-read cdiv(N,BN) times, W re-read cdiv(M,BM) times.

Activations: "gelu" (erf), "gelu_tanh" and "silu", as in backends/reference.py. The bias is [N]; the
residual broadcasts to the output [..., N] (expanded to whole rows before the launch); other shapes are
refused (ValueError).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from photon_core.kernels import new_output

ACT_NONE, ACT_GELU, ACT_GELU_TANH, ACT_SILU = 0, 1, 2, 3
ACT_SIGMOID = 4  # a gate activation (kernels/glu.py), not one `linear` offers
ACT_TANH = 5     # the megakernel's Moondream 3 tau projection, not one `linear` offers
_ACTS = {None: ACT_NONE, "gelu": ACT_GELU, "gelu_tanh": ACT_GELU_TANH, "silu": ACT_SILU}


def activation_code(activation: str | None) -> int:
    if activation not in _ACTS:
        raise ValueError(f"unknown activation {activation!r}")
    return _ACTS[activation]


@triton.jit
def apply_activation(y, ACT):
    """ACT is a runtime or constexpr code; both branches are cheap elementwise math."""
    if ACT == 1:
        y = 0.5 * y * (1.0 + tl.math.erf(y * 0.7071067811865476))
    elif ACT == 2:
        # tanh(u) = 2*sigmoid(2u) - 1, written with exp so it needs no libdevice tanh.
        u = 0.7978845608028654 * (y + 0.044715 * y * y * y)
        t = 2.0 / (1.0 + tl.exp(-2.0 * u)) - 1.0
        y = 0.5 * y * (1.0 + t)
    elif ACT == 3:
        y = y * tl.sigmoid(y)
    elif ACT == 4:
        y = tl.sigmoid(y)
    elif ACT == 5:
        y = 2.0 / (1.0 + tl.exp(-2.0 * y)) - 1.0
    return y


@triton.jit
def _epilogue(acc, rows, cols, rmask, cmask, b_ptr, r_ptr, y_ptr, N,
              HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, ACT: tl.constexpr):
    """Both kernels' tile finish: + bias, activation, + residual, store the [rows, cols] tile."""
    omask = rmask[:, None] & cmask[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
    acc = apply_activation(acc, ACT)
    offs = rows[:, None].to(tl.int64) * N + cols[None, :]
    if HAS_RES:
        acc += tl.load(r_ptr + offs, mask=omask, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs, acc, mask=omask)


@triton.jit
def _linear_gemv_kernel(x_ptr, w_ptr, b_ptr, r_ptr, y_ptr, M, N, K,
                        HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, ACT: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n = tl.program_id(0)
    rows = tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    rmask = rows < M
    cmask = cols < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + ks
        kmask = kk < K
        w = tl.load(w_ptr + cols[:, None].to(tl.int64) * K + kk[None, :],
                    mask=cmask[:, None] & kmask[None, :], other=0.0).to(tl.float32)
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * K + kk[None, :],
                    mask=rmask[:, None] & kmask[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)
    _epilogue(acc, rows, cols, rmask, cmask, b_ptr, r_ptr, y_ptr, N, HAS_BIAS, HAS_RES, ACT)


@triton.jit
def _linear_tiled_kernel(x_ptr, w_ptr, b_ptr, r_ptr, y_ptr, M, N, K,
                         HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, ACT: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    rmask = rows < M
    cmask = cols < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + ks
        kmask = kk < K
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * K + kk[None, :],
                    mask=rmask[:, None] & kmask[None, :], other=0.0).to(tl.float32)
        # W is [N, K] row-major; load its transpose tile [BLOCK_K, BLOCK_N] directly.
        wt = tl.load(w_ptr + cols[None, :].to(tl.int64) * K + kk[:, None],
                     mask=kmask[:, None] & cmask[None, :], other=0.0).to(tl.float32)
        acc = tl.dot(x, wt, acc, input_precision="ieee")
    _epilogue(acc, rows, cols, rmask, cmask, b_ptr, r_ptr, y_ptr, N, HAS_BIAS, HAS_RES, ACT)


SMALL_M_MAX = 16
# Tile of the small-M kernel: output features per program, K step (for M <= 4). Tests running
# whole models under the CPU interpreter (whose cost is per program and per step, not per byte)
# raise them to run far fewer, larger programs.
GEMV_BLOCK_N = 32
GEMV_BLOCK_K = 64


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           activation: str | None = None, residual: torch.Tensor | None = None) -> torch.Tensor:
    """act(x @ weight.T + bias) + residual, x [..., K], weight [N, K]; fp32 accumulation."""
    act = activation_code(activation)
    k = x.shape[-1]
    n = weight.shape[0]
    if weight.shape[1] != k:
        raise ValueError(f"linear: x has {k} features, weight is {tuple(weight.shape)}")
    out_shape = (*x.shape[:-1], n)
    # The epilogue reads N bias values and one [N] residual row per output row: other shapes would be
    # read past their end or mixed up (a residual [N, M] for an output [M, N] has the same size).
    if bias is not None and tuple(bias.shape) != (n,):
        raise ValueError(f"linear: bias {tuple(bias.shape)} for weight {tuple(weight.shape)}: not [{n}]")
    if residual is not None:
        try:
            residual = residual.expand(out_shape)   # a broadcast residual ([N], [1, N]) as whole rows
        except RuntimeError:
            raise ValueError(f"linear: residual {tuple(residual.shape)} does not broadcast to the output "
                             f"{out_shape} of x {tuple(x.shape)} and weight {tuple(weight.shape)}") from None
    x2 = x.reshape(-1, k).contiguous()
    m = x2.shape[0]
    out_dtype = torch.result_type(x, weight)
    y = new_output((m, n), x.device, torch.float32)
    r2 = None
    if residual is not None:
        r2 = residual.reshape(m, n).contiguous()
    w = weight.contiguous()
    b = bias.contiguous() if bias is not None else None
    if m > 0:
        args = (x2, w, b if b is not None else w, r2 if r2 is not None else y, y, m, n, k)
        flags = dict(HAS_BIAS=b is not None, HAS_RES=r2 is not None, ACT=act)
        if m <= SMALL_M_MAX:
            bm = max(1, triton.next_power_of_2(m))
            bn = GEMV_BLOCK_N
            bk = GEMV_BLOCK_K if bm <= 4 else 32
            _linear_gemv_kernel[(triton.cdiv(n, bn),)](*args, **flags, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk)
        else:
            bm, bn, bk = 32, 32, 32
            _linear_tiled_kernel[(triton.cdiv(m, bm), triton.cdiv(n, bn))](
                *args, **flags, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk)
    return y.to(out_dtype).view(*x.shape[:-1], n)
