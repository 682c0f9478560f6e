"""One LSTM cell step (Parakeet's prediction network), PyTorch's gate order (input, forget, cell, output).

gates = x @ w_ih.T + b_ih + h @ w_hh.T + b_hh, split into four [H] blocks i, f, g, o;
c' = sigmoid(f) c + sigmoid(i) tanh(g), h' = sigmoid(o) tanh(c').

One program owns BLOCK_B batch rows and BLOCK_H hidden units, i.e. the four gate rows
{q*H + j : q = 0..3, j in its BLOCK_H units} of both weight matrices, so the whole cell update is
fused: it walks I (then H) in BLOCK_K steps, loading each [BLOCK_H, BLOCK_K] weight tile once per
gate and applying it to every batch row (broadcast multiply, reduction over K), adds the biases and
does the pointwise update in registers. Grid: (cdiv(B, BLOCK_B), cdiv(H, BLOCK_H)).
Bytes: both weight matrices once (4H*(I+H)*4) per batch block, x and h re-read per program (small),
c read and h', c' written once: a bandwidth-bound GEMV at the batch sizes of a decoder loop.
tanh is written as 2*sigmoid(2x) - 1 (no libdevice call).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from photon_core.kernels import new_output


@triton.jit
def _gate_matvec(acc, a_ptr, w_ptr, rows, rmask, wrows, wmask, K,
                 BLOCK_K: tl.constexpr):
    """acc[BLOCK_B, BLOCK_H] += a[rows, :K] @ w[wrows, :K].T (a and w row-major with K columns)."""
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        kmask = kk < K
        a = tl.load(a_ptr + rows[:, None].to(tl.int64) * K + kk[None, :], mask=rmask[:, None] & kmask[None, :],
                    other=0.0).to(tl.float32)
        w = tl.load(w_ptr + wrows[:, None].to(tl.int64) * K + kk[None, :], mask=wmask[:, None] & kmask[None, :],
                    other=0.0).to(tl.float32)
        acc += tl.sum(a[:, None, :] * w[None, :, :], axis=2)
    return acc


@triton.jit
def _gate(x_ptr, h_ptr, wih_ptr, whh_ptr, bih_ptr, bhh_ptr, rows, rmask, units, umask, q, I, H,
          HAS_BIH: tl.constexpr, HAS_BHH: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_H: tl.constexpr,
          BLOCK_K: tl.constexpr):
    """Pre-activation of gate q (0..3) for [BLOCK_B rows, BLOCK_H units]."""
    wrows = q * H + units
    acc = tl.zeros((BLOCK_B, BLOCK_H), tl.float32)
    acc = _gate_matvec(acc, x_ptr, wih_ptr, rows, rmask, wrows, umask, I, BLOCK_K)
    acc = _gate_matvec(acc, h_ptr, whh_ptr, rows, rmask, wrows, umask, H, BLOCK_K)
    if HAS_BIH:
        acc += tl.load(bih_ptr + wrows, mask=umask, other=0.0).to(tl.float32)[None, :]
    if HAS_BHH:
        acc += tl.load(bhh_ptr + wrows, mask=umask, other=0.0).to(tl.float32)[None, :]
    return acc


@triton.jit
def _lstm_cell_kernel(x_ptr, h_ptr, c_ptr, wih_ptr, whh_ptr, bih_ptr, bhh_ptr, h_out_ptr, c_out_ptr, B, I, H,
                      HAS_BIH: tl.constexpr, HAS_BHH: tl.constexpr, BLOCK_B: tl.constexpr,
                      BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
    units = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    rmask = rows < B
    umask = units < H
    gi = _gate(x_ptr, h_ptr, wih_ptr, whh_ptr, bih_ptr, bhh_ptr, rows, rmask, units, umask, 0, I, H,
               HAS_BIH, HAS_BHH, BLOCK_B, BLOCK_H, BLOCK_K)
    gf = _gate(x_ptr, h_ptr, wih_ptr, whh_ptr, bih_ptr, bhh_ptr, rows, rmask, units, umask, 1, I, H,
               HAS_BIH, HAS_BHH, BLOCK_B, BLOCK_H, BLOCK_K)
    gg = _gate(x_ptr, h_ptr, wih_ptr, whh_ptr, bih_ptr, bhh_ptr, rows, rmask, units, umask, 2, I, H,
               HAS_BIH, HAS_BHH, BLOCK_B, BLOCK_H, BLOCK_K)
    go = _gate(x_ptr, h_ptr, wih_ptr, whh_ptr, bih_ptr, bhh_ptr, rows, rmask, units, umask, 3, I, H,
               HAS_BIH, HAS_BHH, BLOCK_B, BLOCK_H, BLOCK_K)
    gi, gf, go = tl.sigmoid(gi), tl.sigmoid(gf), tl.sigmoid(go)
    gg = 2.0 * tl.sigmoid(2.0 * gg) - 1.0
    off = rows[:, None].to(tl.int64) * H + units[None, :]
    omask = rmask[:, None] & umask[None, :]
    c = tl.load(c_ptr + off, mask=omask, other=0.0).to(tl.float32)
    c_new = gf * c + gi * gg
    h_new = go * (2.0 * tl.sigmoid(2.0 * c_new) - 1.0)
    tl.store(c_out_ptr + off, c_new, mask=omask)
    tl.store(h_out_ptr + off, h_new, mask=omask)


LSTM_BLOCK_H, LSTM_BLOCK_K = 32, 32


def lstm_cell(x: torch.Tensor, h: torch.Tensor, c: torch.Tensor, w_ih: torch.Tensor, w_hh: torch.Tensor,
              b_ih: torch.Tensor | None = None, b_hh: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as backends.reference.lstm_cell: returns (h', c')."""
    bsz, n_in = x.shape
    hid = h.shape[-1]
    if tuple(w_ih.shape) != (4 * hid, n_in) or tuple(w_hh.shape) != (4 * hid, hid) \
            or tuple(h.shape) != (bsz, hid) or tuple(c.shape) != (bsz, hid):
        raise ValueError(f"lstm_cell: x {tuple(x.shape)}, h {tuple(h.shape)}, c {tuple(c.shape)}, w_ih "
                         f"{tuple(w_ih.shape)}, w_hh {tuple(w_hh.shape)} do not fit")
    h_out = new_output((bsz, hid), x.device, x.dtype)
    c_out = new_output((bsz, hid), x.device, x.dtype)
    if bsz and hid:
        block_b = min(8, triton.next_power_of_2(bsz))
        wi, wh = w_ih.contiguous(), w_hh.contiguous()
        _lstm_cell_kernel[(triton.cdiv(bsz, block_b), triton.cdiv(hid, LSTM_BLOCK_H))](
            x.contiguous(), h.contiguous(), c.contiguous(), wi, wh,
            b_ih.contiguous() if b_ih is not None else wi, b_hh.contiguous() if b_hh is not None else wh,
            h_out, c_out, bsz, n_in, hid, HAS_BIH=b_ih is not None, HAS_BHH=b_hh is not None,
            BLOCK_B=block_b, BLOCK_H=LSTM_BLOCK_H, BLOCK_K=LSTM_BLOCK_K)
    return h_out, c_out
