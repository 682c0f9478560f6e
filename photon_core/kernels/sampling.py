"""Token choice from logits: argmax (optionally masked) and temperature / top-p (nucleus) sampling.

* argmax: one program scans ONE row of V logits in BLOCK_V blocks, keeping the running best value and
  the FIRST index that reaches it (torch.argmax's tie rule). With a mask, disallowed entries count as
  -inf; an all-masked row returns 0, as torch does. Bytes per row: V*4 (+ V mask bytes).
* sample: one program per row, no sort. e_i = exp(logit_i/T - max) (pass 1: max, pass 2: Z = sum e).
  The nucleus is {i : e_i >= theta} for the largest theta whose kept mass is >= top_p * Z, found by
  N_BISECT bisection passes over the row (each V*4 bytes, L2-resident at decode batch sizes). Then
  target = u * kept_mass and the token is the first index, in vocabulary order, whose running kept mass
  exceeds target (tl.cumsum inside the block that crosses it). The uniform draw u per row comes from
  device memory so the step stays capturable. `backends.reference.sample` is the same definition in
  PyTorch.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from photon_core.kernels import new_output

N_BISECT = 40


@triton.jit
def row_argmax(x_ptr, m_ptr, V, HAS_MASK: tl.constexpr, BLOCK_V: tl.constexpr):
    """(best value, first index of it) over x_ptr[0:V]; m_ptr[i] == 0 marks a disallowed entry."""
    best = tl.full([], float("-inf"), tl.float32)
    best_i = tl.full([], 0, tl.int32)
    for v0 in range(0, V, BLOCK_V):
        idx = v0 + tl.arange(0, BLOCK_V)
        ok = idx < V
        x = tl.load(x_ptr + idx, mask=ok, other=float("-inf")).to(tl.float32)
        if HAS_MASK:
            keep = tl.load(m_ptr + idx, mask=ok, other=0) != 0
            x = tl.where(keep, x, float("-inf"))
        bmax = tl.max(x, axis=0)
        bidx = tl.min(tl.where(x == bmax, idx, 2147483647), axis=0)
        better = bmax > best
        best_i = tl.where(better, bidx, best_i)
        best = tl.where(better, bmax, best)
    return best, best_i


@triton.jit
def _argmax_kernel(x_ptr, m_ptr, out_ptr, V, HAS_MASK: tl.constexpr, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    _, i = row_argmax(x_ptr + row * V, m_ptr + row * V, V, HAS_MASK, BLOCK_V)
    tl.store(out_ptr + row, i.to(tl.int64))


@triton.jit
def _kept_mass(x_ptr, V, row_max, inv_t, theta, BLOCK_V: tl.constexpr):
    mass = tl.full([], 0.0, tl.float32)
    for v0 in range(0, V, BLOCK_V):
        idx = v0 + tl.arange(0, BLOCK_V)
        x = tl.load(x_ptr + idx, mask=idx < V, other=float("-inf")).to(tl.float32)
        e = tl.exp((x - row_max) * inv_t)
        mass += tl.sum(tl.where(e >= theta, e, 0.0), axis=0)
    return mass


@triton.jit
def _sample_kernel(x_ptr, u_ptr, out_ptr, V, inv_t, top_p,
                   USE_TOP_P: tl.constexpr, N_ITER: tl.constexpr, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_ptr += row * V
    row_max, _ = row_argmax(x_ptr, x_ptr, V, False, BLOCK_V)
    z = _kept_mass(x_ptr, V, row_max, inv_t, 0.0, BLOCK_V)
    theta = tl.full([], 0.0, tl.float32)
    if USE_TOP_P:
        lo = tl.full([], 0.0, tl.float32)
        hi = tl.full([], 1.0, tl.float32)
        for _ in range(N_ITER):
            mid = 0.5 * (lo + hi)
            ok = _kept_mass(x_ptr, V, row_max, inv_t, mid, BLOCK_V) >= top_p * z
            lo = tl.where(ok, mid, lo)
            hi = tl.where(ok, hi, mid)
        theta = lo
    kept = _kept_mass(x_ptr, V, row_max, inv_t, theta, BLOCK_V)
    target = tl.load(u_ptr + row).to(tl.float32) * kept
    run = tl.full([], 0.0, tl.float32)
    choice = tl.full([], -1, tl.int32)
    last_kept = tl.full([], 0, tl.int32)
    for v0 in range(0, V, BLOCK_V):
        idx = v0 + tl.arange(0, BLOCK_V)
        x = tl.load(x_ptr + idx, mask=idx < V, other=float("-inf")).to(tl.float32)
        e = tl.exp((x - row_max) * inv_t)
        e = tl.where(e >= theta, e, 0.0)
        c = run + tl.cumsum(e, axis=0)
        hit = tl.min(tl.where((c > target) & (e > 0.0), idx, 2147483647), axis=0)
        choice = tl.where((choice < 0) & (hit < 2147483647), hit, choice)
        last_kept = tl.maximum(last_kept, tl.max(tl.where(e > 0.0, idx, 0), axis=0))
        run += tl.sum(e, axis=0)
    # Rounding can leave target == kept with no crossing: the last kept token is the right answer.
    choice = tl.where(choice < 0, last_kept, choice)
    tl.store(out_ptr + row, choice.to(tl.int64))


def _rows(logits: torch.Tensor) -> torch.Tensor:
    return logits.reshape(-1, logits.shape[-1]).contiguous()


def argmax(logits: torch.Tensor, allowed: torch.Tensor | None = None) -> torch.Tensor:
    """Same as backends.reference.argmax: greedy pick over the last dim, `allowed` masks the rest."""
    v = logits.shape[-1]
    x = _rows(logits)
    out = new_output((x.shape[0],), logits.device, torch.int64)
    mask = x
    if allowed is not None:
        mask = torch.broadcast_to(allowed, logits.shape).reshape(-1, v).to(torch.uint8).contiguous()
    if x.shape[0]:
        _argmax_kernel[(x.shape[0],)](x, mask, out, v, HAS_MASK=allowed is not None,
                                      BLOCK_V=min(1024, triton.next_power_of_2(v)))
    return out.view(logits.shape[:-1])


def sample(logits: torch.Tensor, temperature: float, top_p: float, uniform: torch.Tensor) -> torch.Tensor:
    """Temperature + nucleus sampling with caller-supplied uniforms in [0, 1), one per row.
    temperature <= 0 means greedy."""
    if temperature <= 0:
        return argmax(logits)
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    v = logits.shape[-1]
    x = _rows(logits)
    out = new_output((x.shape[0],), logits.device, torch.int64)
    u = uniform.reshape(-1).to(torch.float32).contiguous()
    if u.numel() != x.shape[0]:
        raise ValueError(f"sample: need {x.shape[0]} uniforms, got {u.numel()}")
    if x.shape[0]:
        _sample_kernel[(x.shape[0],)](x, u, out, v, 1.0 / temperature, top_p,
                                      USE_TOP_P=top_p < 1.0, N_ITER=N_BISECT,
                                      BLOCK_V=min(1024, triton.next_power_of_2(v)))
    return out.view(logits.shape[:-1])
