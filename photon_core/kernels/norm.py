"""Row normalisation: LayerNorm (with or without bias) and RMSNorm, with an optional fused residual add
and an optional SiLU gate.

One program normalises ONE row of N features, held whole in registers: BLOCK_N = next_pow2(N) (N is a
model width or a head dim, 64..4096, so a row fits). With a residual, the program first forms
s = x + residual, writes s back (the new residual stream) and normalises s: the add costs no extra pass
over memory (a residual that broadcasts to x, e.g. [1, N], is first expanded to x's rows). The scale
is (offset + weight): offset 1.0 is the (1 + w) parametrisation of Qwen 3.5's RMSNorm; without a
weight there is no scale (Gemma 4's v_norm). With a gate (Qwen 3.5's gated RMSNorm),
y = rms_norm(x) * weight * silu(gate): one more row read, nothing more. Weight and bias are [N], the
gate of x's rows; other shapes are refused (ValueError), as a program reads exactly N of each.

Bytes moved per row (fp32): read N*4 (x) [+ N*4 residual] [+ N*4 gate] + 2*N*4 (weight, bias; cached
across rows), write N*4 (y) [+ N*4 the summed stream]. Memory-bound; the reduction is two tl.sum over
the block.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from photon_core.kernels import new_output


@triton.jit
def _norm_kernel(x_ptr, res_ptr, sum_ptr, w_ptr, b_ptr, gate_ptr, y_ptr, N, eps, offset,
                 HAS_RES: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_WEIGHT: tl.constexpr,
                 HAS_GATE: tl.constexpr, RMS: tl.constexpr, BLOCK_N: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    x = tl.load(x_ptr + row * N + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        x += tl.load(res_ptr + row * N + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(sum_ptr + row * N + cols, x, mask=mask)
    if RMS:
        xc = x
    else:
        mean = tl.sum(x, axis=0) / N
        # Masked lanes must not contribute to the variance, hence the where.
        xc = tl.where(mask, x - mean, 0.0)
    var = tl.sum(xc * xc, axis=0) / N
    rstd = 1.0 / tl.sqrt(var + eps)
    y = xc * rstd
    if HAS_WEIGHT:
        y = y * (offset + tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32))
    if HAS_BIAS:
        y += tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_GATE:
        z = tl.load(gate_ptr + row * N + cols, mask=mask, other=0.0).to(tl.float32)
        y = y * (z * tl.sigmoid(z))
    tl.store(y_ptr + row * N + cols, y, mask=mask)


def _launch(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float,
            residual: torch.Tensor | None, rms: bool, offset: float = 0.0,
            gate: torch.Tensor | None = None, op: str = "norm") -> tuple[torch.Tensor, torch.Tensor | None]:
    n = x.shape[-1]
    # The program reads N weight / bias values and one residual row per row of x: other shapes
    # would be read past their end (a broadcast residual [1, N] included, hence expand_as).
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and tuple(t.shape) != (n,):
            raise ValueError(f"{op}: {name} {tuple(t.shape)} for x {tuple(x.shape)}: not [{n}]")
    if residual is not None:
        try:
            residual = residual.expand_as(x)
        except RuntimeError:
            raise ValueError(f"{op}: residual {tuple(residual.shape)} does not broadcast to "
                             f"x {tuple(x.shape)}") from None
    x2 = x.reshape(-1, n).contiguous()
    y = new_output(x2.shape, x2.device, x2.dtype)
    res2 = residual.reshape(-1, n).contiguous() if residual is not None else None
    s = new_output(x2.shape, x2.device, x2.dtype) if residual is not None else None
    g2 = None
    if gate is not None:
        g2 = gate.reshape(-1, n).contiguous()
        if g2.shape != x2.shape:
            raise ValueError(f"{op}: gate {tuple(gate.shape)} does not match x {tuple(x.shape)}")
    if x2.shape[0] > 0:
        w = weight.contiguous() if weight is not None else x2
        _norm_kernel[(x2.shape[0],)](
            x2, res2 if res2 is not None else x2, s if s is not None else y,
            w, bias.contiguous() if bias is not None else w, g2 if g2 is not None else x2, y, n, eps,
            float(offset), HAS_RES=residual is not None, HAS_BIAS=bias is not None,
            HAS_WEIGHT=weight is not None, HAS_GATE=gate is not None, RMS=rms,
            BLOCK_N=triton.next_power_of_2(n))
    return y.view(x.shape), (s.view(x.shape) if s is not None else None)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               eps: float = 1e-5) -> torch.Tensor:
    """F.layer_norm over the last dim."""
    return _launch(x, weight, bias, eps, None, rms=False, op="layer_norm")[0]


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float = 1e-6, offset: float = 0.0) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * (offset + weight) over the last dim (no scale without a weight)."""
    return _launch(x, weight, None, eps, None, rms=True, offset=offset, op="rms_norm")[0]


def rms_norm_gated(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """rms_norm(x, weight, eps) * silu(gate)."""
    return _launch(x, weight, None, eps, None, rms=True, gate=gate, op="rms_norm_gated")[0]


def add_layer_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                   bias: torch.Tensor | None, eps: float = 1e-5,
                   rms: bool = False, offset: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (norm(x + residual), x + residual): the pre-norm block's residual add fused in."""
    y, s = _launch(x, weight, bias, eps, residual, rms=rms, offset=offset, op="add_layer_norm")
    assert s is not None
    return y, s
