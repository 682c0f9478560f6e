"""Softmax attention: a tiled prefill kernel (causal + bidirectional prefix + sliding window, optional
additive score bias) and split-KV decode, both with grouped-query attention.

Semantics are backends.reference.attention: q [B, Hq, Tq, D], k/v [B, Hkv, Tk, D] with Hkv dividing Hq
(query head h reads kv head h // G, G = Hq // Hkv; since rows are laid out b-major, the kv row of
query row bh = b*Hq + h is simply bh // G). Query i sits at absolute position p = Tk - Tq + i; with
`causal` it sees keys in (p - window, p] (window = Tk when there is none), and the first `prefix_len`
positions also see each other (Moondream's image-prefix block). Causal attention with Tq > Tk puts
queries before position 0, which see no key unless the prefix block covers them: refused (ValueError)
when prefix_len or Tk is 0.

* prefill: one program owns BLOCK_M queries of one (b, h) and streams keys in BLOCK_N blocks with the
  online-softmax recurrence (running max m, normaliser l, accumulator acc [BLOCK_M, BLOCK_D]); QK^T and
  PV use tl.dot in fp32 "ieee" precision. Causal programs stop at the last key any of their queries (or
  the prefix) can see, and with a window start at the first key their first query can see: keys no
  query of the block can see are never loaded. Bytes: K and V re-read once per query block (and per
  query head of a group: prefill is compute-bound); Q read and O written once. With a `bias`
  [B or 1, Hq, Tq, Tk] (HAS_BIAS) each program also reads the [BLOCK_M, BLOCK_N] bias tile of every
  key block it visits and adds it to the scaled scores before the mask: at most Tq*Tk*4 bytes per
  (b, h), each bias element read once (a batch-1 bias is re-read by every b through stride 0).
  A call with a bias and Tq == 1 also runs this kernel (the decode kernels take no bias).
* decode (Tq == 1, also cross-attention over encoder K/V; `attention` with Tq == 1 and no bias comes
  here too, with its window only when the query is past the prefix block): "flash decoding". Phase 1,
  grid (B*Hq, S):
  program (bh, s) takes keys [lo + s*chunk, min(L, lo + (s+1)*chunk)) of its row in BLOCK_T blocks,
  lo = max(0, L - window), and writes a partial (m, l, acc[D]). Phase 2, grid (B*Hq): merges the S
  partials with the usual rescaling. Per-row lengths L come from device memory (`lengths`), so a KV
  cache of capacity T_max can be used directly. Bytes: K and V read exactly once per kv head
  ((L - lo)*D*4 each per row), partials S*(D+2)*4 written and read.
  With GQA (G > 1) phase 1 runs on grid (B*Hkv, S) instead: one program takes the G query heads that
  share a kv head as a [BLOCK_G, D] tile (BLOCK_G = max(16, next_pow2(G)), padded rows masked) and uses
  tl.dot for QK^T and PV, so each K/V block is loaded once for the whole group, not G times.
The two device helpers `decode_partial` / `decode_merge` are shared with the megakernel (which passes
CACHE=".cg": there the K/V and partials were written by other programs of the same launch).
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from photon_core.kernels import new_output


@triton.jit
def _prefill_kernel(q_ptr, k_ptr, v_ptr, o_ptr, bias_ptr, TQ, TK, D, PREFIX, scale, GROUP, WINDOW, HQ,
                    BIAS_SB, CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    bh = tl.program_id(0).to(tl.int64)
    kvh = bh // GROUP
    qb = tl.program_id(1)
    qi = qb * BLOCK_M + tl.arange(0, BLOCK_M)
    dd = tl.arange(0, BLOCK_D)
    qmask = qi < TQ
    dmask = dd < D
    q = tl.load(q_ptr + bh * TQ * D + qi[:, None] * D + dd[None, :],
                mask=qmask[:, None] & dmask[None, :], other=0.0).to(tl.float32)
    qpos = TK - TQ + qi
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    kv_start = 0
    kv_end = TK
    if CAUSAL:
        q_first = TK - TQ + qb * BLOCK_M
        kv_end = tl.minimum(TK, tl.maximum(q_first + BLOCK_M, PREFIX))
        # The block's first query sees back to q_first - WINDOW + 1 (unless it is in the prefix block).
        kv_start = tl.where(q_first >= PREFIX, tl.maximum(q_first - WINDOW + 1, 0), 0)
    for k0 in range(kv_start, kv_end, BLOCK_N):
        kj = k0 + tl.arange(0, BLOCK_N)
        kmask = kj < TK
        kv_off = kvh * TK * D + kj[:, None] * D + dd[None, :]
        k = tl.load(k_ptr + kv_off, mask=kmask[:, None] & dmask[None, :], other=0.0).to(tl.float32)
        v = tl.load(v_ptr + kv_off, mask=kmask[:, None] & dmask[None, :], other=0.0).to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        if HAS_BIAS:
            # bias row (b, h) = (bh // HQ, bh % HQ); BIAS_SB is 0 for a bias shared by the batch
            b_off = (bh // HQ) * BIAS_SB + (bh % HQ) * TQ * TK + qi[:, None].to(tl.int64) * TK + kj[None, :]
            s += tl.load(bias_ptr + b_off, mask=qmask[:, None] & kmask[None, :], other=0.0).to(tl.float32)
        ok = kmask[None, :]
        if CAUSAL:
            band = (kj[None, :] <= qpos[:, None]) & (kj[None, :] > qpos[:, None] - WINDOW)
            ok = ok & (band | ((qpos[:, None] < PREFIX) & (kj[None, :] < PREFIX)))
        s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # A row that has seen no visible key yet keeps m = -inf; guard the exp against inf - inf.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(o_ptr + bh * TQ * D + qi[:, None] * D + dd[None, :], out,
             mask=qmask[:, None] & dmask[None, :])


# The cache modifier of a plain load, as the helpers' default. A constexpr, not a bare "": Triton 3.6
# does not make a str default a constexpr, and a call that leaves the argument out fails to compile.
NO_CACHE_HINT: tl.constexpr = tl.constexpr("")


@triton.jit
def decode_partial(q_ptr, k_ptr, v_ptr, start, end, D, scale,
                   BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, CACHE: tl.constexpr = NO_CACHE_HINT, ring=0,
                   LANES: tl.constexpr = True):
    """Online softmax of one query (q_ptr, D values) over keys [start, end) of a [*, D] row-major
    K/V block; with ring > 0 key t lives in row t % ring (a sliding window's ring cache). Returns
    (m, l, acc[BLOCK_D]); an empty range gives (-inf, 0, 0). A step's K and V loads are both
    issued before either is used: one trip to memory a step.

    LANES: each of the BLOCK_T key lanes keeps its own running (m, l, acc[D]) over the keys lane,
    lane + BLOCK_T, ...; the lanes merge once at the end. A step then reduces only over D (within
    a warp): no reduction over the keys, which crosses warps (shared memory and barriers every
    step). It holds a [BLOCK_T, BLOCK_D] accumulator: the megakernel's builds that stream scalar
    loads keep the running (m, l, acc) of the whole block instead (LANES False: their registers
    would spill, sm_90 ptxas)."""
    dd = tl.arange(0, BLOCK_D)
    dmask = dd < D
    q = tl.load(q_ptr + dd, mask=dmask, other=0.0, cache_modifier=CACHE).to(tl.float32)
    if LANES:
        m_i = tl.full((BLOCK_T,), float("-inf"), tl.float32)
        l_i = tl.zeros((BLOCK_T,), tl.float32)
        acc = tl.zeros((BLOCK_T, BLOCK_D), tl.float32)
    else:
        m_i = tl.full([], float("-inf"), tl.float32)
        l_i = tl.full([], 0.0, tl.float32)
        acc = tl.zeros((BLOCK_D,), tl.float32)
    for t0 in range(start, end, BLOCK_T):
        tt = t0 + tl.arange(0, BLOCK_T)
        tmask = tt < end
        slot = tl.where(ring > 0, tt % tl.maximum(ring, 1), tt)
        off = slot[:, None].to(tl.int64) * D + dd[None, :]
        k = tl.load(k_ptr + off, mask=tmask[:, None] & dmask[None, :], other=0.0,
                    cache_modifier=CACHE).to(tl.float32)
        v = tl.load(v_ptr + off, mask=tmask[:, None] & dmask[None, :], other=0.0,
                    cache_modifier=CACHE).to(tl.float32)
        s = tl.where(tmask, tl.sum(k * q[None, :], axis=1) * scale, float("-inf"))
        if LANES:
            m_new = tl.maximum(m_i, s)
            # A lane that has seen no key yet stays at -inf: scale by 0, not by exp(-inf + inf).
            base = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m_i - base)
            p = tl.exp(s - base)
            l_i = l_i * alpha + p
            acc = acc * alpha[:, None] + p[:, None] * v
        else:
            m_new = tl.maximum(m_i, tl.max(s, axis=0))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new)
            l_i = l_i * alpha + tl.sum(p, axis=0)
            acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        m_i = m_new
    if LANES:
        m = tl.max(m_i, axis=0)
        w = tl.exp(m_i - tl.where(m == float("-inf"), 0.0, m))
        return m, tl.sum(l_i * w, axis=0), tl.sum(acc * w[:, None], axis=0)
    else:
        return m_i, l_i, acc


@triton.jit
def decode_merge(part_ptr, S, D, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, CACHE: tl.constexpr = NO_CACHE_HINT):
    """Merge S partials stored as rows [m, l, acc[0:D]] of stride D + 2; returns out[BLOCK_D]. No
    keys at all (every partial empty: l = 0) gives zeros, not 0 / 0 (decode_attention's contract)."""
    ss = tl.arange(0, BLOCK_S)
    dd = tl.arange(0, BLOCK_D)
    smask = ss < S
    row = ss.to(tl.int64) * (D + 2)
    m = tl.load(part_ptr + row, mask=smask, other=float("-inf"), cache_modifier=CACHE)
    l = tl.load(part_ptr + row + 1, mask=smask, other=0.0, cache_modifier=CACHE)
    acc = tl.load(part_ptr + row[:, None] + 2 + dd[None, :], mask=smask[:, None] & (dd[None, :] < D),
                  other=0.0, cache_modifier=CACHE)
    m_all = tl.max(m, axis=0)
    w = tl.where(m == float("-inf"), 0.0, tl.exp(m - m_all))
    l_all = tl.sum(l * w, axis=0)
    return tl.where(l_all > 0, tl.sum(acc * w[:, None], axis=0) / tl.where(l_all > 0, l_all, 1.0), 0.0)


@triton.jit
def store_partial(part_ptr, m, l, acc, D, BLOCK_D: tl.constexpr):
    dd = tl.arange(0, BLOCK_D)
    # m and l are written through a 2-lane vector so one code path serves interpreter and GPU.
    two = tl.arange(0, 2)
    tl.store(part_ptr + two, tl.where(two == 0, m, l))
    tl.store(part_ptr + 2 + dd, acc, mask=dd < D)


@triton.jit
def _split_range(len_ptr, b, s, T_MAX, S, WINDOW, BLOCK_T: tl.constexpr):
    """Keys [start, end) of split s of row b: the window [max(0, L - WINDOW), L) cut into S chunks."""
    # A length past the cache capacity would read the next row's keys: clamp, as the megakernel does.
    length = tl.minimum(tl.load(len_ptr + b), T_MAX)
    lo = tl.maximum(length - WINDOW, 0)
    chunk = tl.cdiv(tl.cdiv(length - lo, S), BLOCK_T) * BLOCK_T
    start = tl.minimum(lo + s * chunk, length)
    end = tl.minimum(start + chunk, length)
    return start, end


@triton.jit
def _decode_partial_kernel(q_ptr, k_ptr, v_ptr, len_ptr, part_ptr, H, T_MAX, D, S, scale, WINDOW,
                           BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    bh = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    start, end = _split_range(len_ptr, bh // H, s, T_MAX, S, WINDOW, BLOCK_T)
    base = bh * T_MAX * D
    m, l, acc = decode_partial(q_ptr + bh * D, k_ptr + base, v_ptr + base, start, end, D, scale,
                               BLOCK_T, BLOCK_D)
    store_partial(part_ptr + (bh * S + s) * (D + 2), m, l, acc, D, BLOCK_D)


@triton.jit
def _decode_partial_group_kernel(q_ptr, k_ptr, v_ptr, len_ptr, part_ptr, HKV, T_MAX, D, S, scale, WINDOW,
                                 GROUP, BLOCK_G: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    """GQA phase 1: the GROUP query heads of kv row `bkv` against keys [start, end), K/V loaded once."""
    bkv = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    start, end = _split_range(len_ptr, bkv // HKV, s, T_MAX, S, WINDOW, BLOCK_T)
    gg = tl.arange(0, BLOCK_G)
    dd = tl.arange(0, BLOCK_D)
    gmask = gg < GROUP
    dmask = dd < D
    qrow = bkv * GROUP + gg  # query rows b*Hq + h for the heads h of this group
    q = tl.load(q_ptr + qrow[:, None] * D + dd[None, :], mask=gmask[:, None] & dmask[None, :],
                other=0.0).to(tl.float32)
    m_i = tl.full((BLOCK_G,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_G,), tl.float32)
    acc = tl.zeros((BLOCK_G, BLOCK_D), tl.float32)
    base = bkv * T_MAX * D
    for t0 in range(start, end, BLOCK_T):
        tt = t0 + tl.arange(0, BLOCK_T)
        tmask = tt < end
        off = base + tt[:, None].to(tl.int64) * D + dd[None, :]
        k = tl.load(k_ptr + off, mask=tmask[:, None] & dmask[None, :], other=0.0).to(tl.float32)
        v = tl.load(v_ptr + off, mask=tmask[:, None] & dmask[None, :], other=0.0).to(tl.float32)
        sc = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        sc = tl.where(tmask[None, :], sc, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(sc, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(sc - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        m_i = m_new
    row = (qrow * S + s) * (D + 2)
    tl.store(part_ptr + row, m_i, mask=gmask)
    tl.store(part_ptr + row + 1, l_i, mask=gmask)
    tl.store(part_ptr + row[:, None] + 2 + dd[None, :], acc, mask=gmask[:, None] & dmask[None, :])


@triton.jit
def _decode_merge_kernel(part_ptr, o_ptr, S, D, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    bh = tl.program_id(0).to(tl.int64)
    out = decode_merge(part_ptr + bh * S * (D + 2), S, D, BLOCK_S, BLOCK_D)
    dd = tl.arange(0, BLOCK_D)
    tl.store(o_ptr + bh * D + dd, out, mask=dd < D)


# Keys per inner step of decode attention. Tests running whole models under the CPU interpreter
# (whose cost is per program and per step) raise it; the default split count follows it.
DECODE_BLOCK_T = 32


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     lengths: torch.Tensor, scale: float | None = None, window: int | None = None,
                     num_splits: int | None = None, block_t: int | None = None) -> torch.Tensor:
    """One query per (b, h): q [B, Hq, 1, D] over keys [max(0, n - window), n) of k/v [B, Hkv, T_max, D],
    n = lengths[b]. A row of length 0 gives zeros (decode_merge)."""
    b, h, tq, d = q.shape
    if tq != 1:
        raise ValueError("decode_attention takes exactly one query per row")
    hkv, t_max = k_cache.shape[1], k_cache.shape[2]
    if k_cache.shape != (b, hkv, t_max, d) or v_cache.shape != k_cache.shape or h % hkv:
        raise ValueError(f"decode_attention: q {tuple(q.shape)}, k/v caches {tuple(k_cache.shape)}, "
                         f"{tuple(v_cache.shape)} do not match")
    if window is not None and window < 1:
        raise ValueError(f"decode_attention: window must be >= 1, got {window}")
    if tuple(lengths.shape) != (b,):
        # phase 1 reads lengths[b] for every row b < B: fewer entries would be read past the end
        raise ValueError(f"decode_attention: lengths {tuple(lengths.shape)} for q {tuple(q.shape)}: "
                         f"one length per row, [{b}]")
    group = h // hkv
    win = t_max if window is None else min(int(window), t_max)
    block_t = block_t or DECODE_BLOCK_T
    scale = scale if scale is not None else 1.0 / math.sqrt(d)
    if num_splits is None:
        # Enough programs to fill a GPU at batch 1, but never splits shorter than a block.
        num_splits = max(1, min(16, triton.cdiv(t_max, 4 * block_t)))
    kc, vc = k_cache.contiguous(), v_cache.contiguous()
    part = new_output((b * h, num_splits, d + 2), q.device, torch.float32)
    out = new_output((b, h, 1, d), q.device, torch.float32)
    bd = triton.next_power_of_2(d)
    lens = lengths.to(torch.int32).contiguous()
    if group == 1:
        _decode_partial_kernel[(b * h, num_splits)](q.contiguous(), kc, vc, lens, part, h, t_max, d, num_splits,
                                                    scale, win, BLOCK_T=block_t, BLOCK_D=bd)
    else:
        _decode_partial_group_kernel[(b * hkv, num_splits)](
            q.contiguous(), kc, vc, lens, part, hkv, t_max, d, num_splits, scale, win, group,
            BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_T=max(16, block_t), BLOCK_D=max(16, bd))
    _decode_merge_kernel[(b * h,)](part, out, num_splits, d,
                                   BLOCK_S=triton.next_power_of_2(num_splits), BLOCK_D=bd)
    return out.to(q.dtype)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
              prefix_len: int = 0, scale: float | None = None, window: int | None = None,
              bias: torch.Tensor | None = None) -> torch.Tensor:
    """Same contract as backends.reference.attention (GQA when k/v have fewer heads than q)."""
    b, h, tq, d = q.shape
    hkv, tk = k.shape[1], k.shape[2]
    if k.shape != (b, hkv, tk, d) or v.shape != k.shape or h % hkv:
        raise ValueError(f"attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not match")
    if window is not None and not causal:
        raise ValueError("attention: a window needs causal=True")
    if window is not None and window < 1:
        raise ValueError(f"attention: window must be >= 1, got {window}")
    if bias is not None and (bias.dim() != 4 or bias.shape[0] not in (1, b) or tuple(bias.shape[1:]) != (h, tq, tk)):
        raise ValueError(f"attention: bias {tuple(bias.shape)} is not [B or 1, Hq, Tq, Tk] = "
                         f"[{b} or 1, {h}, {tq}, {tk}]")
    if causal and tq > tk and min(prefix_len, tk) < 1:
        # queries at positions < 0 would see no key at all (only the prefix block reaches them)
        raise ValueError(f"attention: causal with q {tuple(q.shape)} longer than k {tuple(k.shape)} "
                         f"(Tq {tq} > Tk {tk}) puts queries before position 0, which see no key "
                         f"(prefix_len {prefix_len})")
    scale = scale if scale is not None else 1.0 / math.sqrt(d)
    if tq == 1 and bias is None:
        # The single query is the last position p = Tk - 1: causal or not, it sees every key up to
        # itself, limited by the window only when it is past the prefix block (p >= prefix_len;
        # inside the block it sees the whole prefix, which holds every key).
        lengths = torch.full((b,), tk, device=q.device, dtype=torch.int32)
        return decode_attention(q, k, v, lengths, scale, window if causal and prefix_len < tk else None)
    out = new_output((b, h, tq, d), q.device, torch.float32)
    bm, bn = 16, 16
    win = tk if window is None else min(int(window), tk)
    if bias is not None:
        bias = bias.to(torch.float32).contiguous()
    bias_sb = 0 if bias is None or bias.shape[0] == 1 else h * tq * tk
    _prefill_kernel[(b * h, triton.cdiv(tq, bm))](q.contiguous(), k.contiguous(), v.contiguous(), out,
                                                 out if bias is None else bias,  # unread without HAS_BIAS
                                                 tq, tk, d, prefix_len, scale, h // hkv, win, h, bias_sb,
                                                 CAUSAL=causal, HAS_BIAS=bias is not None,
                                                 BLOCK_M=bm, BLOCK_N=bn,
                                                 BLOCK_D=max(16, triton.next_power_of_2(d)))
    return out.to(q.dtype)
