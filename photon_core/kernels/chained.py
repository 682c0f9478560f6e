"""A decode step's op kernels that chain: each launch starts while the launch before it finishes.

The per-op engine's "chained" build (megakernel/perop_engine.py) runs a step's linears, norms,
rotary appends and attention as these kernels, one launch an op. On sm_90 and later each is
launched with programmatic dependent launch (PDL: Triton's `launch_pdl`): its programs may start
while the kernel ahead of it in the stream is still running, and run up to `gdc_wait`, which
returns once that kernel has finished and its writes are visible. So a kernel reads only weights
before the wait (no kernel of a step writes a weight) and every value, cache slot and output after
it; straight after the wait it lets its own successor launch (`gdc_launch_dependents`). A launch's
start-up and its first weight bytes then overlap the previous op's tail: how ~100 ordinary kernels
in one CUDA graph came within 5% of a megakernel on an H200 (Hazy Research's Llama-1B). A CUDA
graph captures the programmatic edges (CUDA 12.3+).

Elsewhere (Triton's interpreter, GPUs before sm_90, a Triton without gdc: 3.3, or whose gdc does
not compile: 3.4) the same kernels run as ordinary launches, PDL compiled out (a constexpr).

Kernels (fp32 values in, fp32 out; weights and caches in their own dtype):
* linear_kernel: y[M, N] = act(x @ W.T + b) + r for a decode step's M <= 16 rows. A program owns
  BLOCK_N output features of every row and walks K in BLOCK_K steps; each step's weight tile is
  issued two steps before its products are formed (three tiles a program: 24 KB of bf16 at batch
  1), the first two before the wait. Bytes: W once (N x K in its dtype), x once a program from L2
  (M x K x 4; at batch 1 each column's copy of it from L1, in W's tile layout).
  A LayerNorm or RMSNorm whose only readers are linears is applied by each of them to its input
  (NORM): one more pass over x for the rows' statistics (at batch 1 one load of the row, from L2)
  instead of a launch; so is a GLU, a gate or an activation read only by linears (the MLP's down
  projection: its x loads read gate and up and multiply them).
* norm_kernel: LayerNorm / RMSNorm of one row a program (weight and bias loaded before the wait).
* gated_kernel: act(a) * b elementwise: a GLU's halves, a gate times a value's slice, or act(a).
* add_norm_kernel: x + an RMSNorm of z over chunks of its columns, scaled (Gemma 4's post-norms).
* rotary_append_kernel: one (row, head) of a fused q|k|v a program: per-head RMSNorms (Qwen3's,
  Gemma 4's) or tau's factors (Moondream 3's), rotary on q and k heads (half-split over the first
  `dims`), q out, k and v into the caches at the row's slot (NaN and infinities stored as 0, as the
  torch build stores them).
* conv_step_kernel, delta_step_kernel: Qwen 3.5's Gated DeltaNet at decode (the short conv with its
  state shifted in place; the gated delta rule per (row, value head) with its gates, state update
  and gated RMSNorm), the megakernel's task code (kernels/conv.py, kernels/delta_rule.py).
* moe_up_kernel + moe_down_kernel: a mixture of experts at decode (Moondream 3's): each program
  routes its row itself (top-k of the router's logits) and streams the chosen expert's rows (bf16,
  fp32, or FP8 bytes decoded in registers with their row scales); only chosen experts are read.
* step_begin_kernel, embed_kernel, argmax_partial_kernel + argmax_kernel: a step's first launches
  (its device tokens and positions clamped into their tables, the token embeddings) and its last
  (the picks, the next token and position of each row, the launch's error word), where the plain
  build runs ~40 small torch kernels.
* attention_kernel: one query head of one row over one split of its keys (online softmax,
  kernels/attention.decode_partial); the last split of a head to finish merges them (a ticket), so
  attention is one launch; a row without keys gives zeros.
"""
from __future__ import annotations

import inspect
import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from photon_core.kernels import new_output
from photon_core.kernels.attention import decode_merge, decode_partial, store_partial
from photon_core.kernels.conv import conv_decode_step
from photon_core.kernels.delta_rule import gated_delta_head
from photon_core.kernels.fp8 import FP8_UNSCALE, fp8_e4m3_over_256
from photon_core.kernels.linear import apply_activation
from photon_core.kernels.moe import route_top_k

try:   # Triton 3.4+
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
    # 3.4's gdc functions still take `_builder` where its frontend passes `_semantic`
    # (triton-lang/triton#7377, fixed in 3.5): every kernel calling them failed to compile (torch
    # 2.8's Triton, on an H100). There they are not called: PDL is a constexpr False. Read from
    # the function (a 3.4 build with the fix chains).
    _gdc_params = inspect.signature(getattr(gdc_wait, "fn", gdc_wait)).parameters
    HAS_GDC = "_semantic" in _gdc_params or "_builder" not in _gdc_params
except ImportError:   # never traced: PDL is a constexpr False wherever gdc is missing
    HAS_GDC = False

    @triton.jit
    def gdc_wait():
        pass

    @triton.jit
    def gdc_launch_dependents():
        pass


def pdl_for(device: torch.device) -> bool:
    """Whether launches on `device` chain by programmatic dependent launch: CUDA sm_90+, a Triton
    with gdc, not the interpreter."""
    if device.type != "cuda" or not HAS_GDC or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


@triton.jit
def _after_previous(PDL: tl.constexpr):
    """Wait for the kernel ahead (its writes visible), then let the next one start."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def round_bf16(x):
    """fp32 x rounded to the nearest bf16 (ties to even), kept in fp32: the bits a GPU's conversion
    gives, and the same under the interpreter (whose conversion truncates)."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    # a GPU's NaN is 0x7FFFFFFF, which the carry would make -0.0: NaN stays NaN
    return tl.where(x != x, x, bits.to(tl.float32, bitcast=True))


@triton.jit
def _row_stats(x_ptr, rows, rmask, K, eps, RMS: tl.constexpr, BLOCK_M: tl.constexpr, STATS_K: tl.constexpr):
    """(mean, 1 / std) of each of the rows of x [M, K] (mean 0 for RMSNorm) in one pass over x of
    STATS_K columns a step (at batch 1 the whole row: one trip to L2), each step's mean and sum of
    squared deviations merged into the running ones (Chan et al.: no E[x^2] - E[x]^2 cancellation)."""
    ks = tl.arange(0, STATS_K)
    mean = tl.zeros((BLOCK_M,), tl.float32)
    m2 = tl.zeros((BLOCK_M,), tl.float32)
    for k0 in range(0, K, STATS_K):
        kk = k0 + ks
        m = rmask[:, None] & (kk < K)[None, :]
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * K + kk[None, :], mask=m, other=0.0)
        if RMS:
            m2 += tl.sum(x * x, axis=1)
        else:
            n = tl.minimum(K - k0, STATS_K) * 1.0
            step_mean = tl.sum(x, axis=1) / n
            d = tl.where(m, x - step_mean[:, None], 0.0)
            delta = step_mean - mean
            seen = k0 * 1.0
            mean += delta * n / (seen + n)
            m2 += tl.sum(d * d, axis=1) + delta * delta * seen * n / (seen + n)
    return mean, 1.0 / tl.sqrt(m2 / K + eps)


@triton.jit
def _x_tile(x_ptr, g_ptr, nw_ptr, nb_ptr, rows, rmask, kk, K, stride_x, stride_g, NORM: tl.constexpr,
            HAS_NW: tl.constexpr, HAS_NB: tl.constexpr, GATE_ACT: tl.constexpr, HAS_G: tl.constexpr):
    """A K step's loads of x [rows, kk] and of the norm's weight and bias there (issued together)."""
    r = rows[:, None].to(tl.int64)
    x = _x_load(x_ptr, g_ptr, r * stride_x + kk[None, :], r * stride_g + kk[None, :],
                rmask[:, None] & (kk < K)[None, :], NORM, GATE_ACT, HAS_G)
    nw, nb = _norm_tile(nw_ptr, nb_ptr, kk, K, NORM, HAS_NW, HAS_NB)
    return x, nw, nb


@triton.jit
def _x_load(x_ptr, g_ptr, off_x, off_g, mask, NORM: tl.constexpr, GATE_ACT: tl.constexpr, HAS_G: tl.constexpr):
    """x at its offsets; where the linear applies a gate (NORM 3), act(x) times g at its offsets
    (HAS_G): a GLU's act(gate) * up, a gate's x * act(g), an activation alone."""
    x = tl.load(x_ptr + off_x, mask=mask, other=0.0)
    if NORM == 3:
        x = apply_activation(x, GATE_ACT)
        if HAS_G:
            x = x * tl.load(g_ptr + off_g, mask=mask, other=0.0)
    return x


@triton.jit
def _norm_tile(nw_ptr, nb_ptr, idx, K, NORM: tl.constexpr, HAS_NW: tl.constexpr, HAS_NB: tl.constexpr):
    """A fused norm's weight and bias at k = idx (zeros where the norm has none)."""
    nw = tl.zeros_like(idx).to(tl.float32)
    nb = tl.zeros_like(idx).to(tl.float32)
    if NORM != 0:
        if HAS_NW:
            nw = tl.load(nw_ptr + idx, mask=idx < K, other=0.0)
        if HAS_NB:
            nb = tl.load(nb_ptr + idx, mask=idx < K, other=0.0)
    return nw, nb


@triton.jit
def _row_tile(x_ptr, g_ptr, nw_ptr, nb_ptr, idx, K, NORM: tl.constexpr, HAS_NW: tl.constexpr, HAS_NB: tl.constexpr,
              GATE_ACT: tl.constexpr, HAS_G: tl.constexpr):
    """Batch 1's K step loads of x (and the norm's weight and bias) at k = idx, a [BLOCK_N, BLOCK_K]
    index tile laid out as W's tile: every column's copy of the row, so the products need no layout
    change (the copies are the same addresses: one L1 line serves a warp's)."""
    x = _x_load(x_ptr, g_ptr, idx, idx, idx < K, NORM, GATE_ACT, HAS_G)
    nw, nb = _norm_tile(nw_ptr, nb_ptr, idx, K, NORM, HAS_NW, HAS_NB)
    return x, nw, nb


@triton.jit
def _x_ready(x, nw, nb, mean, rstd, offset, NORM: tl.constexpr, HAS_NW: tl.constexpr, HAS_NB: tl.constexpr,
             ROUND_X: tl.constexpr):
    """A K step's x as the products take it: normalised ((x - mean) / std * (offset + nw) + nb,
    mean, rstd, nw and nb broadcastable to x; a masked k's weight is 0, so what x becomes there
    does not count), rounded to bf16 for bf16 weights (as a 16-bit GEMM takes it)."""
    if NORM == 1 or NORM == 2:
        x = (x - mean) * rstd
        if HAS_NW:
            x = x * (offset + nw)
        if HAS_NB:
            x = x + nb
    if ROUND_X:
        x = round_bf16(x)
    return x


@triton.jit
def linear_kernel(x_ptr, w_ptr, b_ptr, r_ptr, y_ptr, M, N, K, stride_w, nw_ptr, nb_ptr, eps, offset,
                  g_ptr, stride_x, stride_g,
                  HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, ACT: tl.constexpr, ROUND_X: tl.constexpr,
                  NORM: tl.constexpr, HAS_NW: tl.constexpr, HAS_NB: tl.constexpr, STATS_K: tl.constexpr,
                  GATE_ACT: tl.constexpr, HAS_G: tl.constexpr, PDL: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """NORM 1 / 2: x is a LayerNorm's / RMSNorm's input, normalised here ((x - mean) / std *
    (offset + nw) + nb) rather than by a launch of its own; NORM 3: the product takes act(x) (code
    GATE_ACT) times g (HAS_G), rows of stride_x and stride_g: a GLU, gate or activation applied
    here. W streams two steps ahead: steps 0 and 1's tiles are issued before the wait, and step k's
    products are formed with k + 1's and k + 2's tiles in flight (and k + 1's x and norm loads,
    from L2)."""
    pid = tl.program_id(0)
    rows = tl.arange(0, BLOCK_M)
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    rmask, cmask = rows < M, cols < N
    w_rows = w_ptr + cols[:, None].to(tl.int64) * stride_w
    w = tl.load(w_rows + ks[None, :], mask=cmask[:, None] & (ks < K)[None, :], other=0.0)
    w1 = tl.load(w_rows + (BLOCK_K + ks)[None, :], mask=cmask[:, None] & (BLOCK_K + ks < K)[None, :], other=0.0)
    _after_previous(PDL)
    mean = tl.zeros((BLOCK_M,), tl.float32)
    rstd = tl.full((BLOCK_M,), 1.0, tl.float32)
    if NORM == 1 or NORM == 2:
        mean, rstd = _row_stats(x_ptr, rows, rmask, K, eps, NORM == 2, BLOCK_M, STATS_K)
    # products summed in the load layout: no reduction across threads (shared memory, barriers)
    # inside the loop, one after it
    if BLOCK_M == 1:     # x loaded in W's tile layout (_row_tile): no layout change in the loop either
        idx = cols[:, None] * 0 + ks[None, :]
        mean1, rstd1 = tl.sum(mean, axis=0), tl.sum(rstd, axis=0)
        x, nw, nb = _row_tile(x_ptr, g_ptr, nw_ptr, nb_ptr, idx, K, NORM, HAS_NW, HAS_NB, GATE_ACT, HAS_G)
        x = _x_ready(x, nw, nb, mean1, rstd1, offset, NORM, HAS_NW, HAS_NB, ROUND_X)
        acc2 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            far = k0 + 2 * BLOCK_K + ks
            w2 = tl.load(w_rows + far[None, :], mask=cmask[:, None] & (far < K)[None, :], other=0.0)
            x_next, nw, nb = _row_tile(x_ptr, g_ptr, nw_ptr, nb_ptr, idx + k0 + BLOCK_K, K, NORM, HAS_NW, HAS_NB,
                                       GATE_ACT, HAS_G)
            acc2 += x * w.to(tl.float32)
            x = _x_ready(x_next, nw, nb, mean1, rstd1, offset, NORM, HAS_NW, HAS_NB, ROUND_X)
            w, w1 = w1, w2
        acc = tl.sum(acc2, axis=1)[None, :]
    else:
        x, nw, nb = _x_tile(x_ptr, g_ptr, nw_ptr, nb_ptr, rows, rmask, ks, K, stride_x, stride_g, NORM, HAS_NW, HAS_NB,
                            GATE_ACT, HAS_G)
        x = _x_ready(x, nw[None, :], nb[None, :], mean[:, None], rstd[:, None], offset, NORM, HAS_NW, HAS_NB, ROUND_X)
        acc3 = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            far = k0 + 2 * BLOCK_K + ks
            w2 = tl.load(w_rows + far[None, :], mask=cmask[:, None] & (far < K)[None, :], other=0.0)
            x_next, nw, nb = _x_tile(x_ptr, g_ptr, nw_ptr, nb_ptr, rows, rmask, k0 + BLOCK_K + ks, K, stride_x,
                                     stride_g, NORM, HAS_NW, HAS_NB, GATE_ACT, HAS_G)
            acc3 += x[:, None, :] * w.to(tl.float32)[None, :, :]
            x = _x_ready(x_next, nw[None, :], nb[None, :], mean[:, None], rstd[:, None], offset, NORM, HAS_NW,
                         HAS_NB, ROUND_X)
            w, w1 = w1, w2
        acc = tl.sum(acc3, axis=2)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
    acc = apply_activation(acc, ACT)
    offs = rows[:, None].to(tl.int64) * N + cols[None, :]
    omask = rmask[:, None] & cmask[None, :]
    if HAS_RES:
        acc += tl.load(r_ptr + offs, mask=omask, other=0.0)
    tl.store(y_ptr + offs, acc, mask=omask)


@triton.jit
def norm_kernel(x_ptr, w_ptr, b_ptr, y_ptr, N, eps, offset,
                HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, RMS: tl.constexpr, PDL: tl.constexpr,
                BLOCK_N: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    scale = tl.full((BLOCK_N,), 1.0, tl.float32)
    bias = tl.zeros((BLOCK_N,), tl.float32)
    if HAS_WEIGHT:
        scale = offset + tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        bias = tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    _after_previous(PDL)
    x = tl.load(x_ptr + row * N + cols, mask=mask, other=0.0)
    if RMS:
        xc = x
    else:
        xc = tl.where(mask, x - tl.sum(x, axis=0) / N, 0.0)
    y = xc / tl.sqrt(tl.sum(xc * xc, axis=0) / N + eps) * scale + bias
    tl.store(y_ptr + row * N + cols, y, mask=mask)


@triton.jit
def _head(x_ptr, n_ptr, cos_ptr, sin_ptr, DH, HALF, NORM, eps, offset, mult, ROTARY: tl.constexpr,
          HEAD_NORM: tl.constexpr, BLOCK_D: tl.constexpr):
    """One head's DH values times `mult` (tau's factor; 1 without), RMSNorm over them (NORM 1:
    scaled by offset + n; 2: no scale) where HEAD_NORM and NORM, then rotary on the first 2 x HALF
    (pairs (i, i + HALF)) where ROTARY."""
    dd = tl.arange(0, BLOCK_D)
    x = tl.load(x_ptr + dd, mask=dd < DH, other=0.0) * mult
    partner = tl.where(dd < HALF, dd + HALF, dd - HALF)
    rot = dd < 2 * HALF
    if ROTARY:
        xp = tl.load(x_ptr + partner, mask=rot, other=0.0) * mult
    if HEAD_NORM:
        r = tl.where(NORM != 0, 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / DH + eps), 1.0)
        # n_ptr is a valid buffer at least DH long even where NORM != 1 (then unused)
        w = tl.where(NORM == 1, offset + tl.load(n_ptr + dd, mask=dd < DH, other=0.0), 1.0)
        x = x * r * w
        if ROTARY:
            wp = tl.where(NORM == 1, offset + tl.load(n_ptr + partner, mask=rot, other=0.0), 1.0)
            xp = xp * r * wp
    if ROTARY:
        i = tl.where(dd < HALF, dd, dd - HALF)
        c = tl.load(cos_ptr + i, mask=rot, other=1.0)
        s = tl.load(sin_ptr + i, mask=rot, other=0.0)
        x = tl.where(rot, x * c + tl.where(dd < HALF, -xp, xp) * s, x)
    return x


@triton.jit
def _tau(t_ptr, alpha_ptr, pos, h):
    """Moondream 3's tau factor of head h: t[h] + sigmoid(alpha[h] x log(pos + 1)) + 0.5."""
    z = tl.load(alpha_ptr + h) * tl.log(pos.to(tl.float32) + 1.0)
    return tl.load(t_ptr) + 1.0 / (1.0 + tl.exp(-z)) + 0.5


@triton.jit
def rotary_append_kernel(qkv_ptr, q_ptr, kc_ptr, vc_ptr, pos_ptr, rpos_ptr, cos_ptr, sin_ptr, qn_ptr, kn_ptr,
                         t_ptr, alpha_ptr, HQ, H, DH, HALF, QKV_W, RING, sk_b, sk_h, sk_t, sv_b, sv_h, sv_t, QN, KN, VN,
                         eps, offset, ROTARY: tl.constexpr, HEAD_NORM: tl.constexpr, TAU: tl.constexpr,
                         APPEND: tl.constexpr, BF16_CACHE: tl.constexpr, PDL: tl.constexpr, BLOCK_D: tl.constexpr):
    """Program (row b, head j): j < HQ the query head j, else K/V head j - HQ. Per-head norms
    (HEAD_NORM: QN / KN / VN 0 none, 1 scaled by offset + its weight, 2 unscaled) before rotary;
    TAU: query head h and value head h scaled by _tau (t [rows, 2 x HQ]: q's factors, then v's)."""
    b = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    dd = tl.arange(0, BLOCK_D)
    dmask = dd < DH
    _after_previous(PDL)
    src = qkv_ptr + b * QKV_W + j * DH
    pos = tl.load(pos_ptr + b).to(tl.int64)
    r = 0
    if ROTARY:
        r = tl.load(rpos_ptr + b).to(tl.int64) * HALF
    if j < HQ:
        mult = 1.0
        if TAU:
            mult = _tau(t_ptr + b * 2 * HQ + j, alpha_ptr, pos, j)
        x = _head(src, qn_ptr, cos_ptr + r, sin_ptr + r, DH, HALF, QN, eps, offset, mult, ROTARY, HEAD_NORM, BLOCK_D)
        tl.store(q_ptr + b * HQ * DH + j * DH + dd, x, mask=dmask)
    elif APPEND:
        h = j - HQ
        x = _head(src, kn_ptr, cos_ptr + r, sin_ptr + r, DH, HALF, KN, eps, offset, 1.0, ROTARY, HEAD_NORM, BLOCK_D)
        slot = tl.where(RING > 0, pos % tl.maximum(RING, 1), pos)
        mult = 1.0
        if TAU:
            mult = _tau(t_ptr + b * 2 * HQ + HQ + h, alpha_ptr, pos, h)
        v = _head(qkv_ptr + b * QKV_W + (HQ + H + h) * DH, kn_ptr, cos_ptr, sin_ptr, DH, HALF, VN, eps, 0.0, mult,
                  False, HEAD_NORM, BLOCK_D)
        # NaN and infinities stored as 0, as nan_to_num(0, 0, 0) (perop_engine._kv_append says why)
        x = tl.where(tl.abs(x) < float("inf"), x, 0.0)
        v = tl.where(tl.abs(v) < float("inf"), v, 0.0)
        if BF16_CACHE:
            x, v = round_bf16(x), round_bf16(v)
        tl.store(kc_ptr + b * sk_b + h * sk_h + slot * sk_t + dd, x.to(kc_ptr.dtype.element_ty), mask=dmask)
        tl.store(vc_ptr + b * sv_b + h * sv_h + slot * sv_t + dd, v.to(vc_ptr.dtype.element_ty), mask=dmask)


@triton.jit
def attention_kernel(q_ptr, k_ptr, v_ptr, len_ptr, part_ptr, tick_ptr, o_ptr, HQ, GROUP, DH, S, scale, WINDOW,
                     T, RING, sk_b, sk_h, sv_b, sv_h, SELF: tl.constexpr, PDL: tl.constexpr, BLOCK_T: tl.constexpr,
                     BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    """Program (row b x query head, split s): keys [start, end) of the row's [lo, n), n its
    position + 1 (SELF) or its cross length, lo = n - WINDOW (0 at least); a ring cache holds key
    t in slot t % T (RING). Its partial (m, l, acc) goes to part; the last of the S splits of a
    (row, head) to finish (a ticket: tick_ptr's counter, back to 0 after it) merges them into o,
    so attention is one launch. Bytes: the split's K and V, the partials twice (L2)."""
    bh = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    b, hq = bh // HQ, bh % HQ
    kvh = hq // GROUP
    _after_previous(PDL)
    n = tl.load(len_ptr + b).to(tl.int32)
    if SELF:
        n += 1
    n = tl.where(RING == 0, tl.minimum(n, T), n)
    lo = tl.maximum(n - WINDOW, 0)
    chunk = tl.cdiv(tl.cdiv(n - lo, S), BLOCK_T) * BLOCK_T
    start = tl.minimum(lo + s * chunk, n)
    end = tl.minimum(start + chunk, n)
    m, l, acc = decode_partial(q_ptr + bh * DH, k_ptr + b * sk_b + kvh * sk_h, v_ptr + b * sv_b + kvh * sv_h,
                               start, end, DH, scale, BLOCK_T, BLOCK_D, ring=RING)
    store_partial(part_ptr + (bh * S + s) * (DH + 2), m, l, acc, DH, BLOCK_D)
    # every thread's partial stored before the ticket is taken (its release publishes them)
    tl.debug_barrier()
    if tl.atomic_add(tick_ptr + bh, 1, sem="acq_rel") == S - 1:
        # the other splits' partials, past this SM's L1 (written by other SMs in this launch)
        out = decode_merge(part_ptr + bh * S * (DH + 2), S, DH, BLOCK_S, BLOCK_D, CACHE=".cg")
        dd = tl.arange(0, BLOCK_D)
        tl.store(o_ptr + bh * DH + dd, out, mask=dd < DH)
        tl.store(tick_ptr + bh, 0)


@triton.jit
def gated_kernel(a_ptr, b_ptr, y_ptr, W, stride_a, stride_b, ACT: tl.constexpr, HAS_B: tl.constexpr,
                 PDL: tl.constexpr, BLOCK: tl.constexpr):
    """y[row, i] = act(a[row, i]) * b[row, i], i < W: a GLU (a the gate half, b the up half of one
    value), a gate (a the gate, b a slice of another value) or, without b, an activation.
    Program (row, block of BLOCK)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < W
    _after_previous(PDL)
    y = apply_activation(tl.load(a_ptr + row * stride_a + cols, mask=mask, other=0.0), ACT)
    if HAS_B:
        y = y * tl.load(b_ptr + row * stride_b + cols, mask=mask, other=0.0)
    tl.store(y_ptr + row * W + cols, y, mask=mask)


@triton.jit
def add_norm_kernel(x_ptr, z_ptr, w_ptr, sw_ptr, y_ptr, W, CHUNK, eps, offset, scale,
                    HAS_SW: tl.constexpr, PDL: tl.constexpr, BLOCK: tl.constexpr):
    """Program (row, chunk c): y = (x + rms_norm(z) * (offset + w)) * scale (* sw[0]) over the
    row's columns [c x CHUNK, (c + 1) x CHUNK), the norm over the chunk (Gemma 4's post-norms)."""
    row = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK)
    mask = i < CHUNK
    w = offset + tl.load(w_ptr + i, mask=mask, other=0.0)
    sw = 1.0
    if HAS_SW:
        sw = tl.load(sw_ptr)
    _after_previous(PDL)
    at = row * W + tl.program_id(1) * CHUNK + i
    z = tl.load(z_ptr + at, mask=mask, other=0.0)
    zn = z / tl.sqrt(tl.sum(z * z, axis=0) / CHUNK + eps) * w
    tl.store(y_ptr + at, (tl.load(x_ptr + at, mask=mask, other=0.0) + zn) * scale * sw, mask=mask)


@triton.jit
def _weights(w_ptr, rows, cmask, kk, D):
    """An expert's [rows, kk] weight tile as loaded (FP8: its bytes)."""
    return tl.load(w_ptr + rows[:, None].to(tl.int64) + kk[None, :], mask=cmask[:, None] & (kk < D)[None, :],
                   other=0)


@triton.jit
def _weights_f32(w, FP8: tl.constexpr):
    """A loaded tile's values in fp32 (FP8: 2^-8 of them; the caller scales the sums back)."""
    if FP8:
        return fp8_e4m3_over_256(w)
    return w.to(tl.float32)


@triton.jit
def moe_up_kernel(x_ptr, logit_ptr, w_ptr, s_ptr, h_ptr, id_ptr, rw_ptr, D, F, E, K, stride_e, stride_w, up_offset,
                  ACT: tl.constexpr, FP8: tl.constexpr, ROUND_X: tl.constexpr, RENORM: tl.constexpr,
                  PDL: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_F: tl.constexpr,
                  BLOCK_D: tl.constexpr):
    """Program (pair = row x K + slot, feature block): the row's slot-th expert e (kernels/moe.route_top_k
    of the router's logits, as the per-op route kernel picks it), then BLOCK_F features of
    h = act(G_e x) * (U_e x + up_offset) over D in BLOCK_D steps, gate and up tiles streamed two
    steps ahead. The first feature block writes the
    pair's expert and weight for moe_down_kernel. Nothing is loaded before the wait: which rows
    of which expert to read is the router's output. Bytes: 2 x BLOCK_F x D of the expert (its
    dtype), x from L2."""
    pair = tl.program_id(0).to(tl.int64)
    fb = tl.program_id(1)
    row, slot = pair // K, pair % K
    ff = fb * BLOCK_F + tl.arange(0, BLOCK_F)
    dd = tl.arange(0, BLOCK_D)
    fmask = ff < F
    _after_previous(PDL)
    ids, ws = route_top_k(logit_ptr + row * E, E, K, RENORM, BLOCK_E, BLOCK_K)   # the row's routing, again
    slots = tl.arange(0, BLOCK_K)
    e = tl.sum(tl.where(slots == slot, ids, 0), axis=0)
    weight = tl.sum(tl.where(slots == slot, ws, 0.0), axis=0)
    if fb == 0:
        tl.store(id_ptr + pair, e)
        tl.store(rw_ptr + pair, weight)
    g_rows = ff.to(tl.int64) * stride_w + e.to(tl.int64) * stride_e
    u_rows = g_rows + F * stride_w
    g = _weights(w_ptr, g_rows, fmask, dd, D)
    u = _weights(w_ptr, u_rows, fmask, dd, D)
    g1 = _weights(w_ptr, g_rows, fmask, BLOCK_D + dd, D)
    u1 = _weights(w_ptr, u_rows, fmask, BLOCK_D + dd, D)
    idx = ff[:, None] * 0 + dd[None, :]     # x in the tiles' layout (linear_kernel's _row_tile)
    x = tl.load(x_ptr + row * D + idx, mask=idx < D, other=0.0)
    acc_g = tl.zeros((BLOCK_F, BLOCK_D), tl.float32)
    acc_u = tl.zeros((BLOCK_F, BLOCK_D), tl.float32)
    for d0 in range(0, D, BLOCK_D):
        g2 = _weights(w_ptr, g_rows, fmask, d0 + 2 * BLOCK_D + dd, D)
        u2 = _weights(w_ptr, u_rows, fmask, d0 + 2 * BLOCK_D + dd, D)
        x_next = tl.load(x_ptr + row * D + idx + d0 + BLOCK_D, mask=idx + d0 + BLOCK_D < D, other=0.0)
        if ROUND_X:
            x = round_bf16(x)
        acc_g += x * _weights_f32(g, FP8)
        acc_u += x * _weights_f32(u, FP8)
        x = x_next
        g, g1 = g1, g2
        u, u1 = u1, u2
    gs = tl.sum(acc_g, axis=1)
    us = tl.sum(acc_u, axis=1)
    if FP8:
        scales = s_ptr + e.to(tl.int64) * 2 * F
        gs *= tl.load(scales + ff, mask=fmask, other=0.0) * FP8_UNSCALE
        us *= tl.load(scales + F + ff, mask=fmask, other=0.0) * FP8_UNSCALE
    tl.store(h_ptr + pair * F + ff, apply_activation(gs, ACT) * (us + up_offset), mask=fmask)


@triton.jit
def _down_tile(w_ptr, id_ptr, row, K, i, steps, nn, nmask, ff, F, stride_e, stride_w, BLOCK_F: tl.constexpr):
    """Step i of a row's walk over (slot, F step): the slot's expert's [BLOCK_N, BLOCK_F] tile of
    its down rows nn (none past the walk's last step)."""
    slot = tl.minimum(i // steps, K - 1)
    e = tl.load(id_ptr + row * K + slot).to(tl.int64)
    kk = (i % steps) * BLOCK_F + ff
    live = nmask & (nn * 0 + i < K * steps)
    return _weights(w_ptr, nn.to(tl.int64) * stride_w + e * stride_e, live, kk, F)


@triton.jit
def moe_down_kernel(h_ptr, id_ptr, rw_ptr, w_ptr, s_ptr, r_ptr, y_ptr, D, F, K, stride_e, stride_w,
                    FP8: tl.constexpr, ROUND_H: tl.constexpr, HAS_RES: tl.constexpr, PDL: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_F: tl.constexpr):
    """Program (row, output block): y[row, nn] = sum over the row's K slots, in order, of weight x
    (Down_e h_slot)[nn] (+ the residual), walking (slot, F step) as one loop so the weight tiles
    stream two steps ahead across slots; each slot's routing weight is folded into its h, an FP8
    expert's row scales into its tile. Bytes: K x BLOCK_N x F of the experts, h from L2."""
    row = tl.program_id(0).to(tl.int64)
    nn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ff = tl.arange(0, BLOCK_F)
    nmask = nn < D
    _after_previous(PDL)
    steps = tl.cdiv(F, BLOCK_F)
    w = _down_tile(w_ptr, id_ptr, row, K, 0, steps, nn, nmask, ff, F, stride_e, stride_w, BLOCK_F)
    w1 = _down_tile(w_ptr, id_ptr, row, K, 1, steps, nn, nmask, ff, F, stride_e, stride_w, BLOCK_F)
    idx = nn[:, None] * 0 + ff[None, :]
    acc = tl.zeros((BLOCK_N, BLOCK_F), tl.float32)
    for i in range(0, K * steps):
        w2 = _down_tile(w_ptr, id_ptr, row, K, i + 2, steps, nn, nmask, ff, F, stride_e, stride_w, BLOCK_F)
        slot = i // steps
        f0 = (i % steps) * BLOCK_F
        h = tl.load(h_ptr + (row * K + slot) * F + f0 + idx, mask=f0 + idx < F, other=0.0)
        if ROUND_H:      # bf16 experts take h in bf16, as up took x (a 16-bit GEMM's inputs)
            h = round_bf16(h)
        wv = _weights_f32(w, FP8)
        if FP8:
            e = tl.load(id_ptr + row * K + slot).to(tl.int64)
            wv = wv * (tl.load(s_ptr + e * D + nn, mask=nmask, other=0.0) * FP8_UNSCALE)[:, None]
        acc += wv * (h * tl.load(rw_ptr + row * K + slot))
        w, w1 = w1, w2
    y = tl.sum(acc, axis=1)
    if HAS_RES:
        y += tl.load(r_ptr + row * D + nn, mask=nmask, other=0.0)
    tl.store(y_ptr + row * D + nn, y, mask=nmask)


@triton.jit
def conv_step_kernel(x_ptr, w_ptr, s_ptr, y_ptr, C, X_W, c0, W, ACT: tl.constexpr, PDL: tl.constexpr,
                     BLOCK_N: tl.constexpr):
    """Program (row b, channel block): Qwen 3.5's causal conv at decode on channels of x[b, c0:]
    (kernels/conv.conv_decode_step: its [B, C, W-1] state shifted in place); the taps [C, W] are
    loaded before the wait."""
    b = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < C
    jj = tl.arange(0, 8)[None, :]     # W <= 8 (stepgraph.conv_step)
    taps = tl.load(w_ptr + cols[:, None] * W + jj, mask=cmask[:, None] & (jj < W), other=0.0).to(tl.float32)
    _after_previous(PDL)
    x = tl.load(x_ptr + b * X_W + c0 + cols, mask=cmask, other=0.0)
    y = conv_decode_step(x, s_ptr + (b * C + cols[:, None]) * (W - 1), taps, jj, cmask, W, ACT, "")
    tl.store(y_ptr + b * C + cols, y, mask=cmask)


@triton.jit
def delta_step_kernel(x_ptr, zba_ptr, alog_ptr, dtb_ptr, nw_ptr, s_ptr, y_ptr, X_W, Z_W, c0, HK, HV, DK, DV, eps,
                      PDL: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr):
    """Program (row b, value head h): Qwen 3.5's gated delta rule and gated RMSNorm at decode
    (kernels/delta_rule.gated_delta_head: the head's [DK, DV] fp32 state updated in place), its
    q, k, v in x[b] (q and k of key head h // (HV / HK)), z, b and a in zba[b, c0:]; the head's
    a_log, dt_bias and the norm's weight loaded before the wait."""
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    vv = tl.arange(0, BLOCK_V)
    a_log = tl.load(alog_ptr + h).to(tl.float32)
    dt_bias = tl.load(dtb_ptr + h).to(tl.float32)
    nw = tl.load(nw_ptr + vv, mask=vv < DV, other=0.0).to(tl.float32)
    _after_previous(PDL)
    j = h // (HV // HK)
    xr = x_ptr + b * X_W
    zr = zba_ptr + b * Z_W + c0
    y = gated_delta_head(xr + j * DK, xr + (HK + j) * DK, xr + 2 * HK * DK + h * DV, zr + h * DV, zr + HV * DV + h,
                         zr + HV * DV + HV + h, a_log, dt_bias, nw, s_ptr + (b * HV + h) * DK * DV, DK, DV, eps,
                         BLOCK_K, BLOCK_V, "")
    tl.store(y_ptr + (b * HV + h) * DV + vv, y, mask=vv < DV)


@triton.jit
def step_begin_kernel(dyn_ptr, tok_ptr, pos_ptr, rot_ptr, cross_ptr, bad_ptr, B, POS_ROWS, ROT_ROWS, TOK_ROWS,
                      PDL: tl.constexpr, BLOCK_B: tl.constexpr):
    """One program: the step's device values (dyn: tokens, positions, cross lengths, rotary offsets;
    B each) as int64 indices, each clamped into its table (positions below POS_ROWS, rotary
    positions below ROT_ROWS, tokens below TOK_ROWS; a bound of 0: not clamped), and bad = 1 where
    any was outside (a device value never becomes an address unchecked)."""
    i = tl.arange(0, BLOCK_B)
    m = i < B
    _after_previous(PDL)
    tok = tl.load(dyn_ptr + i, mask=m, other=0).to(tl.int64)
    pos = tl.load(dyn_ptr + B + i, mask=m, other=0).to(tl.int64)
    cross = tl.load(dyn_ptr + 2 * B + i, mask=m, other=0).to(tl.int64)
    rot = pos + tl.load(dyn_ptr + 3 * B + i, mask=m, other=0).to(tl.int64)
    pos_c = tl.minimum(tl.maximum(pos, 0), POS_ROWS - 1)
    rot_c = tl.where(ROT_ROWS > 0, tl.minimum(tl.maximum(rot, 0), ROT_ROWS - 1), rot)
    tok_c = tl.where(TOK_ROWS > 0, tl.minimum(tl.maximum(tok, 0), TOK_ROWS - 1), tok)
    off = (pos_c != pos) | (rot_c != rot) | (tok_c != tok)
    tl.store(tok_ptr + i, tok_c, mask=m)
    tl.store(pos_ptr + i, pos_c, mask=m)
    tl.store(rot_ptr + i, rot_c, mask=m)
    tl.store(cross_ptr + i, cross, mask=m)
    flag = tl.max(tl.where(m & off, 1, 0), axis=0).to(tl.int32)
    tl.store(bad_ptr + i, tl.where(i == 0, flag, 0), mask=i < 1)


@triton.jit
def embed_kernel(tok_ptr, pos_ptr, table_ptr, stride_t, ptable_ptr, stride_p, y_ptr, D, scale,
                 HAS_POS: tl.constexpr, PDL: tl.constexpr, BLOCK: tl.constexpr):
    """Program (row, block of BLOCK): table[token] * scale (+ ptable[position]) in fp32."""
    b = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < D
    _after_previous(PDL)
    y = tl.load(table_ptr + tl.load(tok_ptr + b) * stride_t + cols, mask=mask, other=0.0).to(tl.float32) * scale
    if HAS_POS:
        y += tl.load(ptable_ptr + tl.load(pos_ptr + b) * stride_p + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + b * D + cols, y, mask=mask)


@triton.jit
def argmax_partial_kernel(x_ptr, stride_x, C0, C1, pv_ptr, pi_ptr, S, PDL: tl.constexpr, BLOCK: tl.constexpr):
    """Program (row b, block s): the largest of x[b, C0 + s x BLOCK ...] within [C0, C1) (NaN if the
    block holds one) and the first column holding it (from C0), into partial b x S + s."""
    b = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    cols = C0 + s * BLOCK + tl.arange(0, BLOCK)
    m = cols < C1
    _after_previous(PDL)
    x = tl.load(x_ptr + b * stride_x + cols, mask=m, other=float("-inf"))
    nan = tl.max(tl.where(m & (x != x), 1, 0), axis=0)
    v = tl.max(tl.where(x != x, float("-inf"), x), axis=0)
    i = tl.min(tl.where(m & (x == v), cols, C1), axis=0) - C0
    tl.store(pv_ptr + b * S + s, tl.where(nan > 0, float("nan"), v))
    tl.store(pi_ptr + b * S + s, i)


@triton.jit
def argmax_kernel(pv_ptr, pi_ptr, S, res_ptr, res_stride, dyn_ptr, B, MAX_POS, bad_ptr, err_ptr,
                  ADVANCE: tl.constexpr, PDL: tl.constexpr, BLOCK_S: tl.constexpr):
    """Program b: row b's pick from its S partials (argmax_partial_kernel): the first column of
    the largest value, -2 where the row holds NaN; with ADVANCE, -1 where the row's next position
    would pass MAX_POS, and the row's next token (NaN: column 0) and position (kept where NaN or
    full) written into dyn. Program 0 also copies the launch's bad flag into the error word."""
    b = tl.program_id(0).to(tl.int64)
    ss = tl.arange(0, BLOCK_S)
    sm = ss < S
    _after_previous(PDL)
    pv = tl.load(pv_ptr + b * S + ss, mask=sm, other=float("-inf"))
    pi = tl.load(pi_ptr + b * S + ss, mask=sm, other=2147483647)
    nan = tl.max(tl.where(sm & (pv != pv), 1, 0), axis=0)
    v = tl.max(tl.where(pv != pv, float("-inf"), pv), axis=0)
    best = tl.where(nan > 0, 0, tl.min(tl.where(sm & (pv == v), pi, 2147483647), axis=0))
    res = tl.where(nan > 0, -2, best)
    if ADVANCE:
        pos = tl.load(dyn_ptr + B + b)
        full = pos + 1 >= MAX_POS
        res = tl.where(nan > 0, -2, tl.where(full, -1, best))
        tl.store(dyn_ptr + b, best)
        tl.store(dyn_ptr + B + b, tl.where(full | (nan > 0), pos, pos + 1))
    tl.store(res_ptr + b * res_stride, res)
    if b == 0:
        tl.store(err_ptr, tl.load(bad_ptr))


# A linear's weight tile a K step (three a program: the step reduced and the next two), and
# the most [rows, BLOCK_N, BLOCK_K] products a step holds in registers (4-warp programs).
LINEAR_TILE_BYTES = 8192
LINEAR_PRODUCTS = 8192
# x values a fused norm's statistics load at a time (all rows): a whole row of up to 4096 at batch 1
STATS_ELEMENTS = 4096
# Keys a step of an attention partial: 32 keeps its online softmax in registers under Triton 3.6
# (64: 255 registers and 8 B of stack at 4 warps, sm_90; 3.9 fits either)
ATTENTION_BLOCK_T = 32
# Elements of an expert's weight tile a MoE up step loads (a gate and an up tile): at 4 warps 16
# bytes a thread of FP8 (one 128-bit load), 32 of bf16; three steps in flight a program
MOE_UP_TILE = 2048
# Bytes of a MoE down step's tile: 32 a thread, so a program's walk over K slots x F takes half the
# trips 2048 elements of FP8 took (Moondream 3: 16 of 8 x 512; 136 registers, no spill, sm_90)
MOE_DOWN_TILE_BYTES = 4096
# Channels a conv step program takes (Qwen 3.5 0.8B's 6144: 24 programs a row)
CONV_BLOCK = 256
# Elements of a delta rule state slab a step (Qwen 3.5: 32 x 128, 32 a thread): its K loops' bytes
DELTA_SLAB = 4096
ARGMAX_BLOCK = 4096       # columns an argmax partial reads (one load: 32 a thread)


def linear_blocks(M: int, N: int, K: int, elem_bytes: int, programs: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K) of a chained linear: all M rows in a program; BLOCK_N from 64 down
    to 8 while the programs would not reach `programs` (0: the interpreter's few, large programs); BLOCK_K filling LINEAR_TILE_BYTES, within
    LINEAR_PRODUCTS (at batch 1, bf16: 16 x 256 or 8 x 512, 8 KB a step)."""
    block_m, block_n = max(1, triton.next_power_of_2(M)), 64
    if not programs:      # Triton's interpreter (no GPU): its cost is per program and per step
        return block_m, min(128, triton.next_power_of_2(N)), min(512, triton.next_power_of_2(K))
    while block_n > 8 and triton.cdiv(N, block_n) < programs:
        block_n //= 2
    block_k = min(LINEAR_TILE_BYTES // (elem_bytes * block_n), LINEAR_PRODUCTS // (block_m * block_n))
    return block_m, block_n, max(16, min(block_k, triton.next_power_of_2(K)))


def _launch(kernel, grid, pdl: bool, *args, **meta) -> None:
    if pdl:
        kernel[grid](*args, **meta, PDL=True, launch_pdl=True)
    else:
        kernel[grid](*args, **meta, PDL=False)


class Norm(NamedTuple):
    """A norm a linear applies to its input itself: RMSNorm (rms) or LayerNorm, scaled by
    (offset + w) where there is a w, + b."""
    w: torch.Tensor | None
    b: torch.Tensor | None
    eps: float
    rms: bool
    offset: float = 0.0


class Gate(NamedTuple):
    """What a linear applies to its input itself: act(a) (an activation code) times b where there
    is a b; a and b [M, K] fp32 views with unit column stride (a GLU's halves, a gate's slice)."""
    a: torch.Tensor
    b: torch.Tensor | None
    act: int


def linear(x: torch.Tensor | None, w: torch.Tensor, b: torch.Tensor | None, act: int,
           residual: torch.Tensor | None, pdl: bool, programs: int = 0, norm: Norm | None = None,
           out: torch.Tensor | None = None, gate: Gate | None = None) -> torch.Tensor:
    """act(norm(x) @ w.T + b) + residual: x [M, K] fp32 contiguous (M <= 16), w [N, K] fp32 or bf16
    (x then rounded to bf16) with unit stride along K, fp32 out (written into `out` where that is a
    contiguous fp32 tensor of M x N). `programs`: how many programs to aim for (a GPU's SMs x 2:
    enough to keep every SM streaming; 0: one program per 64 features). gate (x None, no norm):
    the product takes gate.act(gate.a) * gate.b."""
    N, K = w.shape
    if gate is not None:
        x, g = gate.a, gate.b
    else:
        g = None
    if x is None or x.dim() != 2 or x.shape[1] != K or x.shape[0] > 16 or x.stride(1) != 1 or w.stride(1) != 1 \
            or w.dtype not in (torch.float32, torch.bfloat16) or (gate is not None and norm is not None) \
            or (norm is not None and not x.is_contiguous()) \
            or (g is not None and (g.shape != x.shape or g.stride(1) != 1)):
        raise ValueError(f"chained linear: x {None if x is None else (tuple(x.shape), x.stride())}, w "
                         f"{tuple(w.shape)} stride {w.stride()}, gate {None if g is None else tuple(g.shape)}, "
                         f"norm {norm is not None}")
    M = x.shape[0]
    block_m, block_n, block_k = linear_blocks(M, N, K, w.element_size(), programs)
    if out is not None and out.dtype == torch.float32 and out.is_contiguous() and out.numel() == M * N:
        y = out.view(M, N)
    else:
        y = new_output((M, N), x.device, torch.float32)
    nw, nb = (None, None) if norm is None else (norm.w, norm.b)
    _launch(linear_kernel, (triton.cdiv(N, block_n),), pdl, x, w, w if b is None else b,
            y if residual is None else residual, y, M, N, K, w.stride(0), x if nw is None else nw,
            x if nb is None else nb, 0.0 if norm is None else norm.eps, 0.0 if norm is None else float(norm.offset),
            x if g is None else g, x.stride(0), x.stride(0) if g is None else g.stride(0),
            HAS_BIAS=b is not None, HAS_RES=residual is not None, ACT=act, ROUND_X=w.dtype == torch.bfloat16,
            NORM=3 if gate is not None else 0 if norm is None else 2 if norm.rms else 1, HAS_NW=nw is not None,
            HAS_NB=nb is not None, STATS_K=min(triton.next_power_of_2(K), STATS_ELEMENTS // block_m),
            GATE_ACT=0 if gate is None else gate.act, HAS_G=g is not None, BLOCK_M=block_m, BLOCK_N=block_n,
            BLOCK_K=block_k)
    return y


def gated(a: torch.Tensor, b: torch.Tensor | None, act: int, pdl: bool) -> torch.Tensor:
    """act(a) * b (b None: act(a)) for [M, W] fp32 views whose rows are contiguous (slices of wider
    values)."""
    M, W = a.shape
    if (b is not None and (b.shape != a.shape or b.stride(1) != 1)) or a.stride(1) != 1:
        raise ValueError(f"chained gated: {tuple(a.shape)} {a.stride()} and "
                         f"{None if b is None else (tuple(b.shape), b.stride())}")
    y = new_output((M, W), a.device, torch.float32)
    block = min(1024, triton.next_power_of_2(W))
    _launch(gated_kernel, (M, triton.cdiv(W, block)), pdl, a, a if b is None else b, y, W, a.stride(0),
            a.stride(0) if b is None else b.stride(0), ACT=act, HAS_B=b is not None, BLOCK=block)
    return y


def add_norm(x: torch.Tensor, z: torch.Tensor, w: torch.Tensor, eps: float, offset: float, chunk: int, scale: float,
             scale_w: torch.Tensor | None, pdl: bool) -> torch.Tensor:
    """(x + rms_norm(z) * (offset + w)) * scale (* scale_w[0]), the norm over each `chunk` columns of
    z with the one [chunk] weight w; x, z [M, W] fp32 contiguous."""
    M, W = x.shape
    if W % chunk or w.numel() != chunk:
        raise ValueError(f"chained add_norm: width {W}, chunk {chunk}, weight {tuple(w.shape)}")
    y = new_output((M, W), x.device, torch.float32)
    _launch(add_norm_kernel, (M, W // chunk), pdl, x, z, w, w if scale_w is None else scale_w, y, W, chunk, eps,
            float(offset), float(scale), HAS_SW=scale_w is not None, BLOCK=triton.next_power_of_2(chunk))
    return y


def moe_blocks(pairs: int, F: int, rows: int, D: int, programs: int, elem_bytes: int) -> tuple[int, int, int, int]:
    """(BLOCK_F, BLOCK_D) of moe_up_kernel and (BLOCK_N, BLOCK_F) of moe_down_kernel: output blocks
    from 64 down to 8 while the programs would not reach `programs` (0: the interpreter's few, large
    programs), the reduction steps filling MOE_UP_TILE elements and MOE_DOWN_TILE_BYTES."""
    if not programs:
        return (min(128, triton.next_power_of_2(F)), min(512, triton.next_power_of_2(D)),
                min(128, triton.next_power_of_2(D)), min(512, triton.next_power_of_2(F)))
    up, down = 64, 64
    while up > 8 and pairs * triton.cdiv(F, up) < programs:
        up //= 2
    while down > 8 and rows * triton.cdiv(D, down) < programs:
        down //= 2
    return (up, max(16, min(MOE_UP_TILE // up, triton.next_power_of_2(D))),
            down, max(16, min(MOE_DOWN_TILE_BYTES // (elem_bytes * down), triton.next_power_of_2(F))))


def moe(x: torch.Tensor, logits: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, top_k: int, act: int,
        up_offset: float, renormalize: bool, residual: torch.Tensor | None, pdl: bool, programs: int = 0,
        scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """The step graph's moe for x [M, D] fp32 contiguous: each row's top_k experts by its router
    logits [M, E], sum of weight x down_e(act(gate_e x) * (up_e x + up_offset)) (+ residual). gate_up
    [E, 2F, D] and down [E, D, F] with unit stride along their last dim (rows may be padded); fp32
    or bf16 (x and h then rounded to bf16), or float8_e4m3fn with `scales` ([E, 2F] and [E, D] fp32:
    W_e = W_e.float() x its row's scale). Two launches: experts up (routing in each program), then
    down."""
    M, D = x.shape
    E, F2, _ = gate_up.shape
    F = F2 // 2
    fp8 = scales is not None
    if (tuple(gate_up.shape) != (E, 2 * F, D) or tuple(down.shape) != (E, D, F) or gate_up.stride(2) != 1
            or down.stride(2) != 1 or tuple(logits.shape) != (M, E) or not 1 <= top_k <= E
            or fp8 != (gate_up.dtype == torch.float8_e4m3fn)
            or (scales is not None and (tuple(scales[0].shape) != (E, 2 * F) or tuple(scales[1].shape) != (E, D)))):
        raise ValueError(f"chained moe: x {tuple(x.shape)}, logits {tuple(logits.shape)}, gate_up "
                         f"{tuple(gate_up.shape)} {gate_up.dtype}, down {tuple(down.shape)}, top {top_k}, "
                         f"scales {None if scales is None else [tuple(t.shape) for t in scales]}")
    wgu, wd = (gate_up.view(torch.uint8), down.view(torch.uint8)) if fp8 else (gate_up, down)
    sgu, sd = scales if scales is not None else (x, x)
    pairs = M * top_k
    bf, bd, bn, bfd = moe_blocks(pairs, F, M, D, programs, gate_up.element_size())
    h = new_output((pairs, F), x.device, torch.float32)
    ids = new_output((pairs,), x.device, torch.int32)
    rw = new_output((pairs,), x.device, torch.float32)
    y = new_output((M, D), x.device, torch.float32)
    _launch(moe_up_kernel, (pairs, triton.cdiv(F, bf)), pdl, x, logits.float().contiguous(), wgu, sgu, h, ids, rw,
            D, F, E, top_k, wgu.stride(0), wgu.stride(1), float(up_offset), ACT=act, FP8=fp8,
            ROUND_X=gate_up.dtype == torch.bfloat16, RENORM=renormalize, BLOCK_E=triton.next_power_of_2(E),
            BLOCK_K=triton.next_power_of_2(top_k), BLOCK_F=bf, BLOCK_D=bd)
    _launch(moe_down_kernel, (M, triton.cdiv(D, bn)), pdl, h, ids, rw, wd, sd, y if residual is None else residual,
            y, D, F, top_k, wd.stride(0), wd.stride(1), FP8=fp8, ROUND_H=down.dtype == torch.bfloat16,
            HAS_RES=residual is not None, BLOCK_N=bn, BLOCK_F=bfd)
    return y


def conv_step(x: torch.Tensor, c0: int, w: torch.Tensor, state: torch.Tensor, act: int, pdl: bool) -> torch.Tensor:
    """A causal depthwise conv's decode step on x[:, c0:c0 + C] (x [M, *] fp32 contiguous): taps w
    [C, W] fp32 contiguous, state [M, C, W-1] fp32 contiguous, shifted in place; fp32 [M, C] out."""
    M, C, w1 = state.shape
    if tuple(w.shape) != (C, w1 + 1) or not (w.is_contiguous() and state.is_contiguous()) or w1 + 1 > 8 \
            or x.shape[0] != M or c0 + C > x.shape[1]:
        raise ValueError(f"chained conv_step: x {tuple(x.shape)} at {c0}, taps {tuple(w.shape)}, "
                         f"state {tuple(state.shape)}")
    y = new_output((M, C), x.device, torch.float32)
    block = min(CONV_BLOCK, triton.next_power_of_2(C))
    _launch(conv_step_kernel, (M, triton.cdiv(C, block)), pdl, x, w, state, y, C, x.shape[1], c0, w1 + 1, ACT=act,
            BLOCK_N=block)
    return y


def delta_step(x: torch.Tensor, zba: torch.Tensor, c0: int, k_heads: int, a_log: torch.Tensor,
               dt_bias: torch.Tensor, norm_w: torch.Tensor, eps: float, state: torch.Tensor, pdl: bool) -> torch.Tensor:
    """Gated DeltaNet's decode step (stepgraph.delta_rule): x [M, 2 HK DK + HV DV] = q | k | v,
    zba [M, *] holding z [HV DV], b [HV], a [HV] from column c0, state [M, HV, DK, DV] updated in
    place; all fp32 contiguous. fp32 [M, HV DV] out: each head's output RMSNorm'd and gated."""
    M, hv, dk, dv = state.shape
    if (x.shape != (M, 2 * k_heads * dk + hv * dv) or zba.shape[0] != M or c0 + hv * (dv + 2) > zba.shape[1]
            or hv % k_heads or not state.is_contiguous() or norm_w.numel() != dv):
        raise ValueError(f"chained delta_step: x {tuple(x.shape)}, zba {tuple(zba.shape)} at {c0}, "
                         f"state {tuple(state.shape)}, {k_heads} key heads")
    y = new_output((M, hv * dv), x.device, torch.float32)
    bv = triton.next_power_of_2(dv)
    _launch(delta_step_kernel, (M, hv), pdl, x, zba, a_log, dt_bias, norm_w, state, y, x.shape[1], zba.shape[1], c0,
            k_heads, hv, dk, dv, eps, BLOCK_K=max(1, min(triton.next_power_of_2(dk), DELTA_SLAB // bv)), BLOCK_V=bv)
    return y


def norm(x: torch.Tensor, w: torch.Tensor | None, b: torch.Tensor | None, eps: float, rms: bool,
         offset: float, pdl: bool) -> torch.Tensor:
    """LayerNorm (rms False) or RMSNorm of each row of x [M, N] fp32 contiguous, scaled by
    (offset + w) where there is a w, + b."""
    M, N = x.shape
    y = new_output(x.shape, x.device, torch.float32)
    _launch(norm_kernel, (M,), pdl, x, x if w is None else w, x if b is None else b, y, N, eps, float(offset),
            HAS_WEIGHT=w is not None, HAS_BIAS=b is not None, RMS=rms, BLOCK_N=triton.next_power_of_2(N))
    return y


class HeadNorm(NamedTuple):
    """RMSNorm of each head before rotary: q's and k's scaled by (offset + their weight) where
    given (None: that head type not normalised), v's unscaled where `v`."""
    q: torch.Tensor | None
    k: torch.Tensor | None
    v: bool
    eps: float
    offset: float = 0.0


class Tau(NamedTuple):
    """Moondream 3's tau scaling: t [rows, 2 x Hq] fp32 contiguous (tanh of its projection: the
    query heads' factors, then the value heads'), alpha [Hq] fp32."""
    t: torch.Tensor
    alpha: torch.Tensor


def rotary_append(qkv: torch.Tensor, hq: int, k_cache: torch.Tensor, v_cache: torch.Tensor, pos: torch.Tensor,
                  rot_pos: torch.Tensor | None, cos: torch.Tensor | None, sin: torch.Tensor | None, dims: int,
                  ring: bool, append: bool, pdl: bool, head_norm: HeadNorm | None = None,
                  tau: Tau | None = None) -> torch.Tensor:
    """q [M, hq x Dh] from a fused q|k|v [M, *] (tau's factors, or per-head norms, where given, then
    rotary over the first `dims` of each q and k head at rot_pos where cos/sin are given); with
    `append`, k and v written into the [M, H, T, Dh] caches at slot pos (pos % T for a ring)."""
    M, H, T, dh = k_cache.shape
    if k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError("chained rotary_append: a cache's head dim must be contiguous")
    if tau is not None and (tuple(tau.t.shape) != (M, 2 * hq) or not tau.t.is_contiguous() or tau.alpha.numel() < hq):
        raise ValueError(f"chained rotary_append: tau t {tuple(tau.t.shape)}, alpha {tuple(tau.alpha.shape)} "
                         f"for {M} rows of {hq} heads")
    q = new_output((M, hq * dh), qkv.device, torch.float32)
    rotary, hn = cos is not None, head_norm
    flags = (0, 0, 0) if hn is None else (int(hn.q is not None), int(hn.k is not None), 2 * int(hn.v))
    _launch(rotary_append_kernel, (M, hq + (H if append else 0)), pdl, qkv, q, k_cache, v_cache, pos,
            rot_pos if rotary else pos, cos if rotary else q, sin if rotary else q,
            q if hn is None or hn.q is None else hn.q, q if hn is None or hn.k is None else hn.k,
            q if tau is None else tau.t, q if tau is None else tau.alpha,
            hq, H, dh, dims // 2, qkv.stride(0), T if ring else 0, *k_cache.stride()[:3], *v_cache.stride()[:3],
            *flags, 0.0 if hn is None else hn.eps, 0.0 if hn is None else float(hn.offset),
            ROTARY=rotary, HEAD_NORM=hn is not None, TAU=tau is not None, APPEND=append,
            BF16_CACHE=k_cache.dtype == torch.bfloat16, BLOCK_D=triton.next_power_of_2(dh))
    return q


def attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, lengths: torch.Tensor,
              self_keys: bool, window: int | None, ring: bool, scale: float, pdl: bool,
              splits: int = 0, tickets: torch.Tensor | None = None) -> torch.Tensor:
    """Decode attention of q [M, Hq x Dh] over [M, Hkv, T, Dh] caches: row b's keys are positions
    [lo, n) with n = lengths[b] + 1 (self_keys: lengths are positions) or lengths[b] (cross),
    lo = n - window; slot t % T in a ring. fp32 [M, Hq x Dh] out; a row without keys gives zeros.
    Query head h reads kv head h // (Hq / Hkv): Hq not a multiple of Hkv is refused (ValueError).
    tickets: int32 zeros, at least M x Hq, that only this caller's launches use (each launch leaves
    them at zero; None: fresh ones). A launch stopped part way (a sticky CUDA error, after which the
    context is lost anyway) would leave some above zero."""
    M, H, T, dh = k_cache.shape
    hq = q.shape[1] // dh if q.dim() == 2 else 0
    # query head h reads kv head h // (Hq // Hkv), row b of q and lengths[b] for every cache row b < M:
    # anything else would read a kv head, a query row or a length that does not exist
    if (q.dim() != 2 or q.shape != (M, hq * dh) or not q.is_contiguous() or hq < 1 or hq % H
            or v_cache.shape != k_cache.shape or lengths.numel() < M):
        raise ValueError(f"chained attention: q {tuple(q.shape)} is not a contiguous [M, Hq x Dh] with Hq a "
                         f"multiple of Hkv for caches {tuple(k_cache.shape)}, {tuple(v_cache.shape)} "
                         f"[M, Hkv, T, Dh] and lengths {tuple(lengths.shape)}")
    if k_cache.stride(2) != dh or v_cache.stride(2) != dh or k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError("chained attention: a cache's slots must be rows of Dh contiguous values")
    if tickets is None:
        tickets = torch.zeros(M * hq, dtype=torch.int32, device=q.device)
    elif tickets.dtype != torch.int32 or tickets.numel() < M * hq:
        raise ValueError(f"chained attention: tickets {tickets.dtype} x {tickets.numel()} for {M * hq} heads")
    # a ring holds the last T positions: no window reaches further back
    bound = min(T, window or T) if ring else (window or T + 1)
    keys = min(T, bound)
    splits = splits or max(1, min(16, triton.cdiv(keys, 4 * ATTENTION_BLOCK_T)))
    part = new_output((M * hq, splits, dh + 2), q.device, torch.float32)
    out = new_output((M, hq * dh), q.device, torch.float32)
    _launch(attention_kernel, (M * hq, splits), pdl, q, k_cache, v_cache, lengths, part, tickets, out, hq, hq // H,
            dh, splits, scale, bound, T, T if ring else 0,
            k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
            SELF=self_keys, BLOCK_T=ATTENTION_BLOCK_T, BLOCK_S=triton.next_power_of_2(splits),
            BLOCK_D=triton.next_power_of_2(dh))
    return out


def step_begin(dyn: torch.Tensor, B: int, pos_rows: int, rot_rows: int, tok_rows: int, bad: torch.Tensor,
               pdl: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tokens, positions, rotary positions, cross lengths) [B] int64 from a step's dyn buffer, each
    clamped into its table (a bound of 0: not clamped; positions always), bad[0] = 1 where any was
    not (else 0)."""
    out = new_output((4, B), dyn.device, torch.int64)
    _launch(step_begin_kernel, (1,), pdl, dyn, out[0], out[1], out[2], out[3], bad, B, pos_rows, rot_rows, tok_rows,
            BLOCK_B=max(2, triton.next_power_of_2(B)))
    return out[0], out[1], out[2], out[3]


def embed(tokens: torch.Tensor, positions: torch.Tensor, table: torch.Tensor, ptable: torch.Tensor | None,
          scale: float, pdl: bool) -> torch.Tensor:
    """table[tokens] * scale (+ ptable[positions]) as fp32 [B, D]: indices already clamped (step_begin)."""
    B, D = tokens.shape[0], table.shape[1]
    if table.stride(1) != 1 or (ptable is not None and ptable.stride(1) != 1):
        raise ValueError("chained embed: a table's rows must be contiguous")
    y = new_output((B, D), table.device, torch.float32)
    block = min(1024, triton.next_power_of_2(D))
    _launch(embed_kernel, (B, triton.cdiv(D, block)), pdl, tokens, positions, table, table.stride(0),
            table if ptable is None else ptable, table.stride(0) if ptable is None else ptable.stride(0), y, D,
            float(scale), HAS_POS=ptable is not None, BLOCK=block)
    return y


def argmax(x: torch.Tensor, c0: int, c1: int, result: torch.Tensor, dyn: torch.Tensor, B: int, max_pos: int,
           bad: torch.Tensor, err: torch.Tensor, advance: bool, pdl: bool) -> None:
    """result[b] = the first largest column of x[b, c0:c1] (from c0), -2 for a row with NaN; with
    `advance`, -1 for a row whose next position would reach max_pos, and dyn's token and position
    of each row advanced (kept where NaN or full; a NaN row's token 0). err[0] = bad[0]. Two
    launches: blocks of ARGMAX_BLOCK columns side by side (a vocabulary of 51200: 13 programs a
    row, one load each, where one program's loop would make 50 trips to L2), then their merge."""
    if x.stride(1) != 1:
        raise ValueError("chained argmax: a row of x must be contiguous")
    block = min(ARGMAX_BLOCK, triton.next_power_of_2(max(1, c1 - c0)))
    splits = triton.cdiv(max(1, c1 - c0), block)
    pv = new_output((B, splits), x.device, torch.float32)
    pi = new_output((B, splits), x.device, torch.int32)
    _launch(argmax_partial_kernel, (B, splits), pdl, x, x.stride(0), c0, c1, pv, pi, splits, BLOCK=block)
    _launch(argmax_kernel, (B,), pdl, pv, pi, splits, result, result.stride(0), dyn, B, max_pos, bad, err,
            ADVANCE=advance, BLOCK_S=max(2, triton.next_power_of_2(splits)))

__all__ = ["HAS_GDC", "pdl_for", "step_begin", "embed", "argmax", "linear_blocks", "Norm", "HeadNorm", "linear", "gated", "add_norm", "norm", "rotary_append", "attention"]
