"""Causal depthwise conv1d over time with a carried state (Gated DeltaNet's short conv; the decode
step of any causal conv).

Semantics are backends.reference.causal_conv1d: x [B, T, C] time-major, weight [C, W], state
[B, W-1, C] (the W-1 inputs before x[:, 0], oldest first); with xp = [state; x] along time,
y[t, c] = act(bias[c] + sum_j weight[c, j] * xp[t + j, c]) and the new state is the last W-1 rows of xp.

One program computes a [BLOCK_T, BLOCK_C] tile of y for one batch row: for each of the W taps
(unrolled, W is a constexpr: 4 for Qwen 3.5) it loads the shifted [BLOCK_T, BLOCK_C] input tile, taking
rows before t = 0 from the state, and accumulates tap * input in fp32. Programs of the first time
block also write the new state (its rows come from the end of x, or from the old state when T < W-1).
Grid: (B, cdiv(T, BLOCK_T), cdiv(C, BLOCK_C)); channels are contiguous, so every load is coalesced.
Bytes: x read W times per tile (the re-reads hit L1/L2; W*T*C*4 at worst), state (W-1)*C*4 read and
written per batch row, y T*C*4 written. At decode (T = 1) that is one pass over state and weights.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from photon_core.kernels import new_output
from photon_core.kernels.linear import apply_activation


@triton.jit
def conv_decode_step(x, sbase, taps, jj, cmask, W, act, CACHE: tl.constexpr):
    """One decode step of a tile of channels, the state shifted in place: x [C_tile] this step's
    inputs, sbase [C_tile, 1] each channel's W-1 state entries (oldest first, channel-major),
    taps [C_tile, 8] (W <= 8) at columns jj [1, 8]; y = act(sum_j taps[c, j] xp[c, j]) with xp the
    state then x (linear.apply_activation's code `act`), returned in fp32. CACHE: the loads'
    cache modifier (the megakernel's ".cg")."""
    hist = tl.load(sbase + jj, mask=cmask[:, None] & (jj < W - 1), other=0.0, cache_modifier=CACHE)
    nxt = tl.load(sbase + jj + 1, mask=cmask[:, None] & (jj < W - 2), other=0.0, cache_modifier=CACHE)
    y = apply_activation(tl.sum(tl.where(jj == W - 1, x[:, None], hist) * taps, axis=1), act)
    # Every thread's loads of the old state must land before any thread overwrites it.
    tl.debug_barrier()
    tl.store(sbase + jj, tl.where(jj == W - 2, x[:, None], nxt), mask=cmask[:, None] & (jj < W - 1))
    return y


@triton.jit
def _causal_conv1d_kernel(x_ptr, w_ptr, b_ptr, s_ptr, y_ptr, ns_ptr, T, C,
                          W: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_STATE: tl.constexpr, SILU: tl.constexpr,
                          BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_S: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    tb = tl.program_id(1)
    tt = tb * BLOCK_T + tl.arange(0, BLOCK_T)
    cc = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
    tmask = tt < T
    cmask = cc < C
    acc = tl.zeros((BLOCK_T, BLOCK_C), tl.float32)
    for j in tl.static_range(W):
        src = tt + j - (W - 1)  # row of x this tap reads; negative rows live in the state
        tap = tl.load(w_ptr + cc * W + j, mask=cmask, other=0.0).to(tl.float32)
        in_x = tmask & (src >= 0)
        xv = tl.load(x_ptr + (b * T + src)[:, None] * C + cc[None, :], mask=in_x[:, None] & cmask[None, :],
                     other=0.0).to(tl.float32)
        if HAS_STATE:
            in_s = tmask & (src < 0)
            xv += tl.load(s_ptr + (b * (W - 1) + (W - 1) + src)[:, None] * C + cc[None, :],
                          mask=in_s[:, None] & cmask[None, :], other=0.0).to(tl.float32)
        acc += tap[None, :] * xv
    if HAS_BIAS:
        acc += tl.load(b_ptr + cc, mask=cmask, other=0.0).to(tl.float32)[None, :]
    if SILU:
        acc = acc * tl.sigmoid(acc)
    tl.store(y_ptr + (b * T + tt)[:, None] * C + cc[None, :], acc, mask=tmask[:, None] & cmask[None, :])
    if tb == 0:
        ii = tl.arange(0, BLOCK_S)
        imask = ii < W - 1
        # (names differ from the loop's: a runtime branch may not re-type a variable)
        row = T - (W - 1) + ii  # new state row i = xp row T + i = x row T - (W-1) + i
        from_x = imask & (row >= 0)
        sv = tl.load(x_ptr + (b * T + row)[:, None] * C + cc[None, :], mask=from_x[:, None] & cmask[None, :],
                     other=0.0)
        if HAS_STATE:
            from_s = imask & (row < 0)
            sv += tl.load(s_ptr + (b * (W - 1) + T + ii)[:, None] * C + cc[None, :],
                          mask=from_s[:, None] & cmask[None, :], other=0.0)
        tl.store(ns_ptr + (b * (W - 1) + ii)[:, None] * C + cc[None, :], sv, mask=imask[:, None] & cmask[None, :])


# Time steps and channels per program.
CONV_BLOCK_T, CONV_BLOCK_C = 16, 64


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  state: torch.Tensor | None = None,
                  activation: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as backends.reference.causal_conv1d: returns (y [B, T, C], new_state [B, W-1, C])."""
    if activation not in (None, "silu"):
        raise ValueError(f"causal_conv1d: unknown activation {activation!r}")
    bsz, t, c = x.shape
    w = weight.shape[1]
    if weight.shape[0] != c or (bias is not None and bias.shape != (c,)):
        raise ValueError(f"causal_conv1d: x {tuple(x.shape)}, weight {tuple(weight.shape)} do not fit")
    if state is not None and tuple(state.shape) != (bsz, w - 1, c):
        raise ValueError(f"causal_conv1d: state must be [{bsz}, {w - 1}, {c}], got {tuple(state.shape)}")
    xc = x.contiguous()
    y = new_output((bsz, t, c), x.device, x.dtype)
    new_state = new_output((bsz, w - 1, c), x.device, x.dtype)
    if bsz and c and t:
        s = state.to(x.dtype).contiguous() if state is not None else xc
        wt = weight.contiguous()
        _causal_conv1d_kernel[(bsz, triton.cdiv(t, CONV_BLOCK_T), triton.cdiv(c, CONV_BLOCK_C))](
            xc, wt, bias.contiguous() if bias is not None else wt, s, y, new_state, t, c,
            W=w, HAS_BIAS=bias is not None, HAS_STATE=state is not None, SILU=activation == "silu",
            BLOCK_T=CONV_BLOCK_T, BLOCK_C=CONV_BLOCK_C, BLOCK_S=max(1, triton.next_power_of_2(w - 1)))
    elif bsz and c and state is not None:
        new_state.copy_(state)
    elif bsz and c:
        new_state.zero_()
    return y, new_state
