"""The gated delta rule (Gated DeltaNet, Qwen 3.5's linear-attention layers): a decode step and the
chunked prefill.

Semantics are backends.reference.gated_delta_step / gated_delta_chunk (transformers' recurrent and
chunked torch implementations): per (batch, value head) a [Dk, Dv] state S, and for each token
    S = exp(g) S;   S = S + k (beta (v - S^T k))^T;   o = S^T (scale * q)
with q, k optionally l2-normalised (x * rsqrt(sum x^2 + 1e-6)). Value head h reads q/k head h // G
(G = Hv / Hk); rows are laid out b-major, so the q/k row of value row bh is bh // G.

The state's columns are independent (column j of S only ever meets v_j), so both kernels split Dv
across programs: grid (B*Hv, cdiv(Dv, BLOCK_V)), each program owning S[:, v-block] as a
[BLOCK_K, BLOCK_V] fp32 tile (BLOCK_K = next_pow2(Dk) >= 16) and loading the whole q/k vectors.

* step (decode, one token): load the state tile, decay it, read S^T k with one reduction over Dk, write
  the rank-1 update, read the output with a second reduction, store output and new state.
  Bytes per (b, h): the state Dk*Dv*4 read and Dk*Dv*4 written dominate (q, k, v are tiny).
* chunk (prefill): tokens in chunks of C = CHUNK (16). With G_i the cumulative log decay inside the
  chunk and S the state entering it (see reference.gated_delta_chunk for the derivation):
      L  = strict_lower(beta_i exp(G_i - G_j) k_i.k_j)            [C, C]   one tl.dot
      T  = (I + L)^-1 = (I - L)(I + L^2)(I + L^4)(I + L^8)         log2(C) - 1 squarings: L is
                                                                   nilpotent (L^C = 0), so the product
                                                                   is the exact Neumann series
      U  = T (beta (V - exp(G) K S))                               what each token writes
      O  = exp(G) Q S + ((Q K^T) * D) U,   D_ij = exp(G_i - G_j) (j <= i)
      S' = exp(G_C) S + (K exp(G_C - G))^T U
  every product a tl.dot in fp32 "ieee" precision. Padded tail rows carry k = v = g = beta = 0,
  which write nothing and decay nothing. Bytes: q, k, v read once per program (q/k once per
  v-block), o written once, the state read and written once per sequence.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from photon_core.kernels import new_output


@triton.jit
def _l2norm_rows(x, L2: tl.constexpr):
    """Rows of a 2-D tile times rsqrt(sum of squares + 1e-6) when L2 (FLA's l2norm), else as they are."""
    if L2:
        x = x * (1.0 / tl.sqrt(tl.sum(x * x, axis=1) + 1e-6))[:, None]
    return x


@triton.jit
def gated_delta_head(qp, kp, vp, zp, bp, ap, a_log, dt_bias, norm_w, sbase, Dk, Dv, eps,
                     BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, CACHE: tl.constexpr):
    """One (row, value head) of a Gated DeltaNet decode step, its state updated in place, and its
    output: backends.reference.gated_delta_step with qk_l2norm, then rms_norm_gated(o, z). qp, kp,
    vp, zp: the head's q, k (Dk) and v, z (Dv) values; bp, ap: its beta and a inputs (beta =
    sigmoid(b), decay = exp(-exp(a_log) softplus(a + dt_bias))); norm_w [BLOCK_V]: the norm's
    weight, loaded; sbase: its [Dk, Dv] fp32 state. The state streams in [BLOCK_K, Dv] slabs twice:
    once for S^T k (the rule's prediction), once to write the decayed, corrected state and read
    o = S^T q from it; each slab is loaded and stored by the same threads (no barrier). CACHE:
    the values' loads' cache modifier (the megakernel's ".cg": written by other SMs in the same
    launch). Returns y [BLOCK_V] fp32. Bytes: 3 Dk Dv 4 of state, (2 Dk + 2 Dv) 4 of values."""
    vv = tl.arange(0, BLOCK_V)
    vmask = vv < Dv
    kk = tl.arange(0, BLOCK_K)
    sq = tl.zeros((BLOCK_K,), tl.float32)
    sk = tl.zeros((BLOCK_K,), tl.float32)
    for k0 in range(0, Dk, BLOCK_K):
        m = (k0 + kk) < Dk
        q = tl.load(qp + k0 + kk, mask=m, other=0.0, cache_modifier=CACHE)
        k = tl.load(kp + k0 + kk, mask=m, other=0.0, cache_modifier=CACHE)
        sq += q * q
        sk += k * k
    # FLA's l2norm (rsqrt(sum + 1e-6)), and q's 1/sqrt(Dk) scale folded into its factor.
    rq = 1.0 / tl.sqrt(tl.sum(sq, axis=0) + 1e-6) / tl.sqrt(Dk.to(tl.float32))
    rk = 1.0 / tl.sqrt(tl.sum(sk, axis=0) + 1e-6)
    beta = tl.sigmoid(tl.load(bp, cache_modifier=CACHE))
    sp = tl.load(ap, cache_modifier=CACHE) + dt_bias
    sp = tl.where(sp > 20.0, sp, tl.log(1.0 + tl.exp(tl.minimum(sp, 20.0))))   # softplus, threshold 20
    decay = tl.exp(-tl.exp(a_log) * sp)
    kv = tl.zeros((BLOCK_V,), tl.float32)
    for k0 in range(0, Dk, BLOCK_K):
        m = (k0 + kk) < Dk
        k = tl.load(kp + k0 + kk, mask=m, other=0.0, cache_modifier=CACHE) * rk
        s = tl.load(sbase + (k0 + kk)[:, None] * Dv + vv[None, :], mask=m[:, None] & vmask[None, :], other=0.0,
                    cache_modifier=CACHE)
        kv += tl.sum(s * k[:, None], axis=0)
    v = tl.load(vp + vv, mask=vmask, other=0.0, cache_modifier=CACHE)
    delta = beta * (v - decay * kv)
    o = tl.zeros((BLOCK_V,), tl.float32)
    for k0 in range(0, Dk, BLOCK_K):
        m = (k0 + kk) < Dk
        k = tl.load(kp + k0 + kk, mask=m, other=0.0, cache_modifier=CACHE) * rk
        q = tl.load(qp + k0 + kk, mask=m, other=0.0, cache_modifier=CACHE) * rq
        sm = m[:, None] & vmask[None, :]
        addr = sbase + (k0 + kk)[:, None] * Dv + vv[None, :]
        s = decay * tl.load(addr, mask=sm, other=0.0, cache_modifier=CACHE) + k[:, None] * delta[None, :]
        tl.store(addr, s, mask=sm)
        o += tl.sum(s * q[:, None], axis=0)
    # rms_norm_gated: norm over the head, scale, then silu(z).
    o = o / tl.sqrt(tl.sum(o * o, axis=0) / Dv + eps) * norm_w
    z = tl.load(zp + vv, mask=vmask, other=0.0, cache_modifier=CACHE)
    return o * z * tl.sigmoid(z)


@triton.jit
def _delta_step_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, s_ptr, o_ptr, ns_ptr, DK, DV, GROUP, scale,
                       L2: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr):
    bh = tl.program_id(0).to(tl.int64)
    kk = tl.arange(0, BLOCK_K)
    vv = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    kmask = kk < DK
    vmask = vv < DV
    qk_row = bh // GROUP
    q = tl.load(q_ptr + qk_row * DK + kk, mask=kmask, other=0.0).to(tl.float32)[None, :]
    k = tl.load(k_ptr + qk_row * DK + kk, mask=kmask, other=0.0).to(tl.float32)[None, :]
    q = tl.reshape(_l2norm_rows(q, L2), (BLOCK_K,)) * scale
    k = tl.reshape(_l2norm_rows(k, L2), (BLOCK_K,))
    decay = tl.exp(tl.load(g_ptr + bh).to(tl.float32))
    beta = tl.load(beta_ptr + bh).to(tl.float32)
    smask = kmask[:, None] & vmask[None, :]
    s_off = bh * DK * DV + kk[:, None] * DV + vv[None, :]
    s = tl.load(s_ptr + s_off, mask=smask, other=0.0).to(tl.float32) * decay
    v = tl.load(v_ptr + bh * DV + vv, mask=vmask, other=0.0).to(tl.float32)
    u = beta * (v - tl.sum(s * k[:, None], axis=0))  # beta (v - S^T k)
    s = s + k[:, None] * u[None, :]
    tl.store(o_ptr + bh * DV + vv, tl.sum(s * q[:, None], axis=0), mask=vmask)
    tl.store(ns_ptr + s_off, s, mask=smask)


@triton.jit
def _delta_chunk_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, s_ptr, o_ptr, ns_ptr, T, HK, HV, DK, DV, GROUP,
                        scale, HAS_STATE: tl.constexpr, L2: tl.constexpr, CHUNK: tl.constexpr,
                        LOG_CHUNK: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr):
    bh = tl.program_id(0).to(tl.int64)
    b = bh // HV
    h = bh % HV
    hk = h // GROUP
    kk = tl.arange(0, BLOCK_K)
    vv = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    rr = tl.arange(0, CHUNK)
    kmask = kk < DK
    vmask = vv < DV
    smask = kmask[:, None] & vmask[None, :]
    s_off = bh * DK * DV + kk[:, None] * DV + vv[None, :]
    if HAS_STATE:
        s = tl.load(s_ptr + s_off, mask=smask, other=0.0).to(tl.float32)
    else:
        s = tl.zeros((BLOCK_K, BLOCK_V), tl.float32)
    eye = tl.where(rr[:, None] == rr[None, :], 1.0, 0.0)
    lower = rr[:, None] > rr[None, :]
    upto = rr[:, None] >= rr[None, :]
    for c0 in range(0, T, CHUNK):
        tt = c0 + rr
        tmask = tt < T
        tok = b * T + tt  # [CHUNK] token rows
        qk_off = (tok * HK + hk)[:, None] * DK + kk[None, :]
        qkmask = tmask[:, None] & kmask[None, :]
        q = _l2norm_rows(tl.load(q_ptr + qk_off, mask=qkmask, other=0.0).to(tl.float32), L2) * scale
        k = _l2norm_rows(tl.load(k_ptr + qk_off, mask=qkmask, other=0.0).to(tl.float32), L2)
        gv = tl.load(g_ptr + tok * HV + h, mask=tmask, other=0.0).to(tl.float32)
        bv = tl.load(beta_ptr + tok * HV + h, mask=tmask, other=0.0).to(tl.float32)
        v_off = (tok * HV + h)[:, None] * DV + vv[None, :]
        v = tl.load(v_ptr + v_off, mask=tmask[:, None] & vmask[None, :], other=0.0).to(tl.float32)
        gc = tl.cumsum(gv, axis=0)                                        # G_i
        decay = tl.exp(tl.where(upto, gc[:, None] - gc[None, :], float("-inf")))
        kkt = tl.dot(k, tl.trans(k), input_precision="ieee")
        p = tl.where(lower, -bv[:, None] * kkt * decay, 0.0)             # -L
        t_inv = eye + p
        for _ in tl.static_range(LOG_CHUNK - 1):
            p = tl.dot(p, p, input_precision="ieee")
            t_inv = tl.dot(t_inv, eye + p, input_precision="ieee")
        eg = tl.exp(gc)
        rhs = bv[:, None] * (v - eg[:, None] * tl.dot(k, s, input_precision="ieee"))
        u = tl.dot(t_inv, rhs, input_precision="ieee")                   # [CHUNK, BLOCK_V]
        qkt = tl.dot(q, tl.trans(k), input_precision="ieee") * decay
        o = eg[:, None] * tl.dot(q, s, input_precision="ieee") + tl.dot(qkt, u, input_precision="ieee")
        tl.store(o_ptr + v_off, o, mask=tmask[:, None] & vmask[None, :])
        g_end = tl.sum(gv, axis=0)
        k_dec = k * tl.exp(g_end - gc)[:, None]
        s = tl.exp(g_end) * s + tl.dot(tl.trans(k_dec), u, input_precision="ieee")
    tl.store(ns_ptr + s_off, s, mask=smask)


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor) -> int:
    hk, hv = k.shape[-2], v.shape[-2]
    if q.shape != k.shape or hv % hk or g.shape != v.shape[:-1] or beta.shape != g.shape \
            or q.shape[:-2] != v.shape[:-2]:
        raise ValueError(f"gated delta rule: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, "
                         f"g {tuple(g.shape)}, beta {tuple(beta.shape)} do not fit")
    return hv // hk


# Tokens per chunk of the prefill kernel (>= 16: tl.dot's smallest tile) and state columns per program.
DELTA_CHUNK = 16
DELTA_BLOCK_V = 32


def gated_delta_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     state: torch.Tensor, scale: float | None = None,
                     qk_l2norm: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as backends.reference.gated_delta_step: returns (o [B, Hv, Dv], new state)."""
    group = _check(q, k, v, g, beta)
    bsz, hv, dv = v.shape
    dk = k.shape[-1]
    if tuple(state.shape) != (bsz, hv, dk, dv):
        raise ValueError(f"gated_delta_step: state must be [{bsz}, {hv}, {dk}, {dv}], got {tuple(state.shape)}")
    scale = scale if scale is not None else dk ** -0.5
    o = new_output((bsz, hv, dv), v.device, v.dtype)
    new_state = new_output((bsz, hv, dk, dv), v.device, torch.float32)
    if bsz * hv:
        bv = min(DELTA_BLOCK_V, triton.next_power_of_2(dv))
        _delta_step_kernel[(bsz * hv, triton.cdiv(dv, bv))](
            q.contiguous(), k.contiguous(), v.contiguous(), g.contiguous(), beta.contiguous(),
            state.contiguous(), o, new_state, dk, dv, group, scale,
            L2=qk_l2norm, BLOCK_K=triton.next_power_of_2(dk), BLOCK_V=bv)
    return o, new_state


def gated_delta_chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                      state: torch.Tensor | None = None, scale: float | None = None,
                      qk_l2norm: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as backends.reference.gated_delta_chunk: returns (o [B, T, Hv, Dv], final state)."""
    group = _check(q, k, v, g, beta)
    bsz, t, hv, dv = v.shape
    hk, dk = k.shape[-2], k.shape[-1]
    if state is not None and tuple(state.shape) != (bsz, hv, dk, dv):
        raise ValueError(f"gated_delta_chunk: state must be [{bsz}, {hv}, {dk}, {dv}], got {tuple(state.shape)}")
    scale = scale if scale is not None else dk ** -0.5
    o = new_output((bsz, t, hv, dv), v.device, v.dtype)
    new_state = new_output((bsz, hv, dk, dv), v.device, torch.float32)
    if bsz * hv:
        bv = max(16, min(DELTA_BLOCK_V, triton.next_power_of_2(dv)))
        vc = v.contiguous()
        _delta_chunk_kernel[(bsz * hv, triton.cdiv(dv, bv))](
            q.contiguous(), k.contiguous(), vc, g.contiguous(), beta.contiguous(),
            state.contiguous() if state is not None else vc, o, new_state, t, hk, hv, dk, dv, group, scale,
            HAS_STATE=state is not None, L2=qk_l2norm, CHUNK=DELTA_CHUNK,
            LOG_CHUNK=DELTA_CHUNK.bit_length() - 1, BLOCK_K=max(16, triton.next_power_of_2(dk)), BLOCK_V=bv)
    return o, new_state
