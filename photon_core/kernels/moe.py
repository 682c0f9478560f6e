"""Mixture of experts: softmax router with top-k, and the chosen experts' gated MLPs.

Semantics are backends.reference.moe_route / moe. Three kernels, launched in order:

* route, grid (N,): one program reads the E router logits of ONE token (BLOCK_E = next_pow2(E), so
  E <= a few thousand), computes the softmax, and picks the top_k experts by repeated argmax (the
  largest remaining logit; equal logits: the lowest id). Weights are the chosen softmax probabilities,
  divided by their sum when renormalising. Bytes: E*4 read, top_k*(4 + 8) written.
* experts up, grid (N*top_k, cdiv(F, BLOCK_F)): program (token, slot) reads ids[token, slot] = e and
  computes BLOCK_F features of h = act(G_e x) * (U_e x + up_offset), walking D in BLOCK_D steps with
  [BLOCK_F, BLOCK_D] accumulators for the gate and up rows (one reduction after the loop).
  experts_gate_up is [E, 2F, D]: gate rows [0, F), up rows [F, 2F) of expert e.
* experts down, grid (N, cdiv(D, BLOCK_N)): program (token, d-block) sums over its top_k slots, in
  slot order, weight * (Down_e h) for BLOCK_N output features (no atomics: deterministic).

Only the chosen experts' rows are ever addressed, so an expert no token chose is never read. Bytes at
decode (N tokens, each its own experts): N*top_k*3*F*D*4 of weights, the h scratch N*top_k*F*4 written
and read once. Prefill re-reads an expert's weights for every token that chose it; grouping tokens by
expert (a sort + grouped matmul) is the optimisation to add when prefill of MoE models matters.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from photon_core.kernels import new_output
from photon_core.kernels.glu import glu_code
from photon_core.kernels.linear import apply_activation, linear


@triton.jit
def route_top_k(logit_ptr, E, K, RENORM: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    """(ids [BLOCK_K] int32, weights [BLOCK_K] fp32) of one row's top K among its E router logits,
    by repeated argmax (the largest remaining logit; equal logits: the lower id first); weights
    the chosen softmax probabilities, divided by their sum when RENORM. A NaN logit ranks as -inf,
    so every id names an expert (one past the table would be read past the weights); the row's
    weights are then NaN, as the reference's, and poison its output."""
    ee = tl.arange(0, BLOCK_E)
    emask = ee < E
    logits = tl.load(logit_ptr + ee, mask=emask, other=float("-inf")).to(tl.float32)
    p = tl.where(emask, tl.exp(logits - tl.max(logits, axis=0)), 0.0)
    rank = tl.where(logits == logits, logits, float("-inf"))
    taken = ee >= E  # padding lanes can never be chosen
    slots = tl.arange(0, BLOCK_K)
    ids = tl.zeros((BLOCK_K,), tl.int32)
    ws = tl.zeros((BLOCK_K,), tl.float32)
    for slot in range(K):
        cand = tl.where(taken, float("-inf"), rank)
        best = tl.max(cand, axis=0)
        pick = tl.min(tl.where((cand == best) & (~taken), ee, BLOCK_E), axis=0)
        ids = tl.where(slots == slot, pick, ids)
        ws = tl.where(slots == slot, tl.sum(tl.where(ee == pick, p, 0.0), axis=0), ws)
        taken = taken | (ee == pick)
    if RENORM:
        ws = ws / tl.sum(ws, axis=0)
    else:
        ws = ws / tl.sum(p, axis=0)
    # NaN anywhere makes the softmax NaN (a GPU's max skips NaN, so the chosen weights could not tell)
    nan = tl.max(tl.where(emask & (logits != logits), 1, 0), axis=0)
    return ids, tl.where(nan > 0, float("nan"), ws)


@triton.jit
def _route_kernel(logit_ptr, w_ptr, id_ptr, E, K, RENORM: tl.constexpr, BLOCK_E: tl.constexpr,
                  BLOCK_K: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    ids, ws = route_top_k(logit_ptr + row * E, E, K, RENORM, BLOCK_E, BLOCK_K)
    slots = tl.arange(0, BLOCK_K)
    kmask = slots < K
    tl.store(w_ptr + row * K + slots, ws, mask=kmask)
    tl.store(id_ptr + row * K + slots, ids.to(tl.int64), mask=kmask)


@triton.jit
def _experts_up_kernel(x_ptr, wgu_ptr, id_ptr, h_ptr, D, F, K, up_offset,
                       ACT: tl.constexpr, BLOCK_F: tl.constexpr, BLOCK_D: tl.constexpr):
    nk = tl.program_id(0).to(tl.int64)  # token * K + slot
    token = nk // K
    e = tl.load(id_ptr + nk).to(tl.int64)
    ff = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    fmask = ff < F
    gate_rows = (e * 2 * F + ff).to(tl.int64) * D
    up_rows = (e * 2 * F + F + ff).to(tl.int64) * D
    acc_g = tl.zeros((BLOCK_F, BLOCK_D), tl.float32)
    acc_u = tl.zeros((BLOCK_F, BLOCK_D), tl.float32)
    for d0 in range(0, D, BLOCK_D):
        dd = d0 + tl.arange(0, BLOCK_D)
        dmask = dd < D
        x = tl.load(x_ptr + token * D + dd, mask=dmask, other=0.0).to(tl.float32)
        wmask = fmask[:, None] & dmask[None, :]
        wg = tl.load(wgu_ptr + gate_rows[:, None] + dd[None, :], mask=wmask, other=0.0).to(tl.float32)
        wu = tl.load(wgu_ptr + up_rows[:, None] + dd[None, :], mask=wmask, other=0.0).to(tl.float32)
        acc_g += wg * x[None, :]
        acc_u += wu * x[None, :]
    g = tl.sum(acc_g, axis=1)
    u = tl.sum(acc_u, axis=1)
    tl.store(h_ptr + nk * F + ff, apply_activation(g, ACT) * (u + up_offset), mask=fmask)


@triton.jit
def _experts_down_kernel(h_ptr, wd_ptr, id_ptr, w_ptr, y_ptr, D, F, K,
                         BLOCK_N: tl.constexpr, BLOCK_F: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    nn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = nn < D
    out = tl.zeros((BLOCK_N,), tl.float32)
    for slot in range(K):
        e = tl.load(id_ptr + token * K + slot).to(tl.int64)
        weight = tl.load(w_ptr + token * K + slot)
        rows = (e * D + nn).to(tl.int64) * F
        acc = tl.zeros((BLOCK_N, BLOCK_F), tl.float32)
        for f0 in range(0, F, BLOCK_F):
            ff = f0 + tl.arange(0, BLOCK_F)
            fmask = ff < F
            h = tl.load(h_ptr + (token * K + slot) * F + ff, mask=fmask, other=0.0)
            wd = tl.load(wd_ptr + rows[:, None] + ff[None, :], mask=nmask[:, None] & fmask[None, :],
                         other=0.0).to(tl.float32)
            acc += wd * h[None, :]
        out += weight * tl.sum(acc, axis=1)
    tl.store(y_ptr + token * D + nn, out, mask=nmask)


def moe_route(logits: torch.Tensor, top_k: int, renormalize: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights fp32 [N, top_k], ids int64 [N, top_k]) of the top_k experts of each row of logits [N, E]."""
    e = logits.shape[-1]
    if not 1 <= top_k <= e:
        raise ValueError(f"moe_route: top_k {top_k} must be in [1, {e}]")
    x = logits.reshape(-1, e).contiguous()
    n = x.shape[0]
    weights = new_output((n, top_k), logits.device, torch.float32)
    ids = new_output((n, top_k), logits.device, torch.int64)
    if n:
        _route_kernel[(n,)](x, weights, ids, e, top_k, RENORM=renormalize,
                            BLOCK_E=triton.next_power_of_2(e), BLOCK_K=triton.next_power_of_2(top_k))
    return weights.view(*logits.shape[:-1], top_k), ids.view(*logits.shape[:-1], top_k)


# Tiles of the expert kernels (output features per program, reduction step).
UP_BLOCK_F, UP_BLOCK_D = 32, 64
DOWN_BLOCK_N, DOWN_BLOCK_F = 32, 64


def moe(x: torch.Tensor, router_w: torch.Tensor, router_b: torch.Tensor | None, experts_gate_up: torch.Tensor,
        experts_down: torch.Tensor, top_k: int, activation: str = "silu", up_offset: float = 0.0,
        renormalize: bool = True) -> torch.Tensor:
    """Same contract as backends.reference.moe; reads only the chosen experts' weights."""
    act = glu_code(activation)
    d = x.shape[-1]
    n_exp, two_f, d_in = experts_gate_up.shape
    f = two_f // 2
    if d_in != d or two_f != 2 * f or tuple(experts_down.shape) != (n_exp, d, f) \
            or tuple(router_w.shape) != (n_exp, d):
        raise ValueError(f"moe: x [..., {d}], router {tuple(router_w.shape)}, gate_up "
                         f"{tuple(experts_gate_up.shape)}, down {tuple(experts_down.shape)} do not fit")
    x2 = x.reshape(-1, d).contiguous()
    n = x2.shape[0]
    y = new_output((n, d), x.device, x.dtype)
    if n == 0:
        return y.view(x.shape)
    weights, ids = moe_route(linear(x2, router_w, router_b), top_k, renormalize)
    h = new_output((n * top_k, f), x.device, torch.float32)
    _experts_up_kernel[(n * top_k, triton.cdiv(f, UP_BLOCK_F))](
        x2, experts_gate_up.contiguous(), ids, h, d, f, top_k, float(up_offset),
        ACT=act, BLOCK_F=UP_BLOCK_F, BLOCK_D=UP_BLOCK_D)
    _experts_down_kernel[(n, triton.cdiv(d, DOWN_BLOCK_N))](
        h, experts_down.contiguous(), ids, weights, y, d, f, top_k, BLOCK_N=DOWN_BLOCK_N, BLOCK_F=DOWN_BLOCK_F)
    return y.view(x.shape)
