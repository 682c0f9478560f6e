"""The persistent decode megakernel: ONE launch runs a whole task graph (graph.py).

Each program loops: claim the next task index with tl.atomic_add on the claim counter; wait until the
task's dependency counters reach their targets (acquire loads, done as atomic_add(ptr, 0)); run the
task; make its stores visible (barrier, then a release atomic_add on its counter). A task of a ticket
group (an attention partial, a split-K slice) also takes a ticket (acq_rel atomic_add) after its own
stores; the one that draws the last ticket of its group runs the group's finale (the merge, the
slices' sum and epilogue) before it signals. Tasks are claimed in
topological order, so a waiting program only waits on tasks already claimed by running programs: with
no more programs than can be resident at once, that cannot deadlock; under TRITON_INTERPRET=1 (programs
run one after another) program 0 simply runs every task in order.

Data lives in three flat buffers, addressed by element offsets from the task table: the weights
arena (fp32, bf16 or fp16), the fp32 state arena (residual stream, activations, KV caches, partials, logits) and the int32
dyn buffer of per-step values (tokens, positions, cross lengths; graph.DYN_*). Nothing step-dependent is
a kernel argument, so the launch (plus the zeroing of the control buffer) can be captured in a CUDA
graph and replayed; with `advance` the argmax task writes the next token and position itself.
Regions of another dtype live inside those buffers and are read through a cast pointer, at offsets
in their own elements: FP8 experts (bytes) and their fp32 row scales in a bf16 weights arena, bf16
KV caches in the fp32 state; a token table only looked up may lie outside the arena altogether (its
offset then reaches the caller's tensor from the weights pointer).

What one task moves (fp32, M rows, tile width BN): linear tile N_tile*K*4 weight bytes + M*K*4
activations (+ a fused norm: M*2*4 of row statistics, which the last task of x's producer stage
computed once: 2*M*K*4 read by one task instead of by every tile); attention partial 2*chunk*Dh*4, and for
the last partial of a (row, head) to finish its merge, S*(Dh+2)*4; embed 2*M*BN*4; MoE expert tile: the tile of ONE expert, once for all the rows that
chose it (only the batch's first (row, slot) pair choosing the expert loads it). Waits are
bounded by `spin_limit` iterations: a wait that times out sets the
error flag (task index + 1) and the task is skipped rather than hanging the GPU; the host raises.
"""
from __future__ import annotations

import functools
import re
import warnings
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from photon_core.kernels.attention import decode_merge, decode_partial, store_partial
from photon_core.kernels.conv import conv_decode_step
from photon_core.kernels.delta_rule import gated_delta_head
from photon_core.kernels.fp8 import FP8_UNSCALE, fp8_e4m3_over_256
from photon_core.kernels.linear import apply_activation
from photon_core.kernels.triton_versions import (MegakernelTuning, check_supported, interpreting, megakernel_options,
                                                 megakernel_tuning)
from photon_core.megakernel import ops
from photon_core.megakernel.graph import (CTRL_CLAIM, CTRL_ERROR, ERR_KINDS, NUM_FIELDS, TRACE_COLUMNS, TRACE_WIDTH, F,
                                          TaskGraph, decode_error)
from photon_core.megakernel.graph import ERR_OP as _ERR_OP
from photon_core.megakernel.graph import ERR_RANGE as _ERR_RANGE
from photon_core.megakernel.graph import ERR_WAIT as _ERR_WAIT

# Loads of data other programs wrote during this launch bypass L1 (".cg": cached in L2 only), so no
# SM can read a stale line of an activation, cache entry or partial; weights keep the default path.
CG: tl.constexpr = tl.constexpr(".cg")
# Elements per task-table row: finale rows are addressed from the row of the task that runs them.
NF_ROW: tl.constexpr = tl.constexpr(NUM_FIELDS)
TW: tl.constexpr = tl.constexpr(TRACE_WIDTH)
# The interpreter multiplies dot operands in fp32 (it has no bf16 dot): see _linear_dot_steps.
INTERP: tl.constexpr = tl.constexpr(interpreting())
ERR_WAIT: tl.constexpr = tl.constexpr(_ERR_WAIT)
ERR_OP: tl.constexpr = tl.constexpr(_ERR_OP)
ERR_RANGE: tl.constexpr = tl.constexpr(_ERR_RANGE)
# Register budget of the largest tiles, per the running Triton (triton_versions.megakernel_tuning):
# the most elements of a linear task's [M, N, K step] product and [N, K step] weight tile, and of
# an attention task's [keys, head] K / V tile. A wider tiling (batch 8 at 32 columns, 512-wide
# heads) runs more, shorter steps. The interpreter has no registers to spare: there the tiles stay
# as tiled (a shorter step only costs it time; test_megakernel_tile_budgets.py sets small budgets).
_BUDGET = megakernel_tuning() if not interpreting() else MegakernelTuning(linear_tile=1 << 30, weight_tile=1 << 30,
                                                                          attn_tile=1 << 30, fp8_weight_tile=1 << 30)
LINEAR_TILE: tl.constexpr = tl.constexpr(_BUDGET.linear_tile)
WEIGHT_TILE: tl.constexpr = tl.constexpr(_BUDGET.weight_tile)
FP8_WEIGHT_TILE: tl.constexpr = tl.constexpr(_BUDGET.fp8_weight_tile)
ATTN_TILE: tl.constexpr = tl.constexpr(_BUDGET.attn_tile)
# Elements of x a batch-1 row-statistics finale reads a trip; above batch 1 each row reads
# STATS_TILE / BLOCK_M, at most 2 x BLOCK_K, at least BLOCK_K (Tiling(): 128 a row at batch 2-8;
# _task_row_stats). 1024, not 2048: wider tiles tipped
# builds at the edge of the register file into spilling (ptxas -v: Triton 3.6 batch 8 fp32 4-40 B,
# 3.9 batch 1 FP8 experts 24 B).
STATS_TILE: tl.constexpr = tl.constexpr(1024)
# The most tiles whose partial statistics a finale merges in one trip (ops.linear.STATS_TILES).
STATS_TILES: tl.constexpr = tl.constexpr(ops.linear.STATS_TILES)

# Task-table fields by name: one constant per field of graph.FIELDS (the one layout), so a task
# body reads `tl.load(row + F_M)`, never a literal column.
F_op: tl.constexpr = tl.constexpr(F["op"])
F_w0: tl.constexpr = tl.constexpr(F["w0"])
F_t0: tl.constexpr = tl.constexpr(F["t0"])
F_w1: tl.constexpr = tl.constexpr(F["w1"])
F_t1: tl.constexpr = tl.constexpr(F["t1"])
F_sig: tl.constexpr = tl.constexpr(F["sig"])
F_M: tl.constexpr = tl.constexpr(F["M"])
F_K: tl.constexpr = tl.constexpr(F["K"])
F_N: tl.constexpr = tl.constexpr(F["N"])
F_n0: tl.constexpr = tl.constexpr(F["n0"])
F_x: tl.constexpr = tl.constexpr(F["x"])
F_w: tl.constexpr = tl.constexpr(F["w"])
F_b: tl.constexpr = tl.constexpr(F["b"])
F_lnw: tl.constexpr = tl.constexpr(F["lnw"])
F_lnb: tl.constexpr = tl.constexpr(F["lnb"])
F_act: tl.constexpr = tl.constexpr(F["act"])
F_res: tl.constexpr = tl.constexpr(F["res"])
F_mode: tl.constexpr = tl.constexpr(F["mode"])
F_out: tl.constexpr = tl.constexpr(F["out"])
F_kc: tl.constexpr = tl.constexpr(F["kc"])
F_vc: tl.constexpr = tl.constexpr(F["vc"])
F_H: tl.constexpr = tl.constexpr(F["H"])
F_Dh: tl.constexpr = tl.constexpr(F["Dh"])
F_Tmax: tl.constexpr = tl.constexpr(F["Tmax"])
F_tile: tl.constexpr = tl.constexpr(F["tile"])
F_part: tl.constexpr = tl.constexpr(F["part"])
F_rb: tl.constexpr = tl.constexpr(F["rb"])
F_ntiles: tl.constexpr = tl.constexpr(F["ntiles"])
F_bi: tl.constexpr = tl.constexpr(F["bi"])
F_hi: tl.constexpr = tl.constexpr(F["hi"])
F_s: tl.constexpr = tl.constexpr(F["s"])
F_S: tl.constexpr = tl.constexpr(F["S"])
F_lenkind: tl.constexpr = tl.constexpr(F["lenkind"])
F_n1: tl.constexpr = tl.constexpr(F["n1"])
F_k0: tl.constexpr = tl.constexpr(F["k0"])
F_k1: tl.constexpr = tl.constexpr(F["k1"])
F_kpart: tl.constexpr = tl.constexpr(F["kpart"])
F_ksplit: tl.constexpr = tl.constexpr(F["ksplit"])
F_ldw: tl.constexpr = tl.constexpr(F["ldw"])
F_norm: tl.constexpr = tl.constexpr(F["norm"])
F_xglu: tl.constexpr = tl.constexpr(F["xglu"])
F_xgate: tl.constexpr = tl.constexpr(F["xgate"])
F_window: tl.constexpr = tl.constexpr(F["window"])
F_ring: tl.constexpr = tl.constexpr(F["ring"])
F_scale: tl.constexpr = tl.constexpr(F["scale"])
F_xs: tl.constexpr = tl.constexpr(F["xs"])
F_xc0: tl.constexpr = tl.constexpr(F["xc0"])
F_gact: tl.constexpr = tl.constexpr(F["gact"])
F_xact: tl.constexpr = tl.constexpr(F["xact"])
F_tau: tl.constexpr = tl.constexpr(F["tau"])
F_alpha: tl.constexpr = tl.constexpr(F["alpha"])
F_sw: tl.constexpr = tl.constexpr(F["sw"])
F_chunk: tl.constexpr = tl.constexpr(F["chunk"])
F_wsc: tl.constexpr = tl.constexpr(F["wsc"])
F_loads: tl.constexpr = tl.constexpr(F["loads"])
F_ticket: tl.constexpr = tl.constexpr(F["ticket"])
F_tickets: tl.constexpr = tl.constexpr(F["tickets"])
F_lnst: tl.constexpr = tl.constexpr(F["lnst"])
F_stx: tl.constexpr = tl.constexpr(F["stx"])
F_stn: tl.constexpr = tl.constexpr(F["stn"])
F_stout: tl.constexpr = tl.constexpr(F["stout"])
F_stkind: tl.constexpr = tl.constexpr(F["stkind"])
F_kticket: tl.constexpr = tl.constexpr(F["kticket"])
F_ktickets: tl.constexpr = tl.constexpr(F["ktickets"])
F_fin: tl.constexpr = tl.constexpr(F["fin"])
F_nfin: tl.constexpr = tl.constexpr(F["nfin"])
F_rows: tl.constexpr = tl.constexpr(F["rows"])
F_prows: tl.constexpr = tl.constexpr(F["prows"])
F_stpart: tl.constexpr = tl.constexpr(F["stpart"])
F_stnt: tl.constexpr = tl.constexpr(F["stnt"])
F_sttile: tl.constexpr = tl.constexpr(F["sttile"])
# Kernel op codes, as the op modules declare them (ops/<op>.py; ops.OP_NAMES).
OP_EMBED: tl.constexpr = tl.constexpr(ops.OP_EMBED)
OP_LINEAR: tl.constexpr = tl.constexpr(ops.OP_LINEAR)
OP_ATTN_PARTIAL: tl.constexpr = tl.constexpr(ops.OP_ATTN_PARTIAL)
OP_ATTN_MERGE: tl.constexpr = tl.constexpr(ops.OP_ATTN_MERGE)
OP_ARGMAX: tl.constexpr = tl.constexpr(ops.OP_ARGMAX)
OP_ROPE_APPEND: tl.constexpr = tl.constexpr(ops.OP_ROPE_APPEND)
OP_LINEAR_SPLIT: tl.constexpr = tl.constexpr(ops.OP_LINEAR_SPLIT)
OP_CONV_STEP: tl.constexpr = tl.constexpr(ops.OP_CONV_STEP)
OP_DELTA_STEP: tl.constexpr = tl.constexpr(ops.OP_DELTA_STEP)
OP_ADD_NORM: tl.constexpr = tl.constexpr(ops.OP_ADD_NORM)
OP_MOE_ROUTE: tl.constexpr = tl.constexpr(ops.OP_MOE_ROUTE)
OP_MOE_UP: tl.constexpr = tl.constexpr(ops.OP_MOE_UP)
OP_MOE_DOWN: tl.constexpr = tl.constexpr(ops.OP_MOE_DOWN)
OP_MOE_SUM: tl.constexpr = tl.constexpr(ops.OP_MOE_SUM)
# XLOOP's flag (above KernelVariant.loop's fields): the expert tasks span several column tiles
# (_task_moe_up_tiles); without it the build keeps the one-tile tasks, their registers unchanged.
# (_step_tasks says it as 33554432: the interpreter takes no constexpr in constexpr arithmetic.)
XTILES = 1 << 25
# LOOP's flag (above KernelVariant.loop's fields), set by the host for an aligned build of a table
# whose caches have head dims and offsets that are multiples of 16 elements (kv_aligned): the
# attention tasks say so, and their K / V loads become 16-byte vectors (scalar 2- or 4-byte loads
# without it: the offsets are loaded fields) with a softmax per key lane (decode_partial's LANES:
# no barrier a step). _step_tasks says it as 33554432, as XTILES.
KV16 = 1 << 25
# LOOP's flag, set by the host for a table whose dense linear tasks span several column tiles
# (Tiling.linear_span > 1, spans_linear_tiles): _task_linear loops over them. Without it the build
# keeps the one-tile task, its registers unchanged (the loop cost the plain batch-1 bf16 build 48 B
# of stack under Triton 3.9). _step_tasks says it as 67108864.
LTILES = 1 << 26


@triton.jit
def _f32(bits):
    """A float constant the compiler stored as its fp32 bit pattern in the int64 task table."""
    return bits.to(tl.int32).to(tl.float32, bitcast=True)


@triton.jit
def bf16_rne(x):
    """fp32 -> bf16 rounded to nearest even, with integer ops: the GPU's conversion rounds so, the
    interpreter's truncates; this is the same on both (NaN stays NaN; past the largest finite: inf)."""
    bits = x.to(tl.uint32, bitcast=True)
    r = bits + 0x7FFF + ((bits >> 16) & 1)
    r = tl.where(x != x, 0x7FC00000, r)
    return (r >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _wait(ctr_ptr, target, spin_limit):
    v = tl.atomic_add(ctr_ptr, 0, sem="acquire")
    n = 0
    while (v < target) & (n < spin_limit):
        v = tl.atomic_add(ctr_ptr, 0, sem="acquire")
        n += 1
    return v >= target


@triton.jit
def _task_embed(row, w_ptr, s_ptr, dyn_ptr, B, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    M = tl.load(row + F_M)
    N = tl.load(row + F_N)
    n0 = tl.load(row + F_n0)
    tok_off = tl.load(row + F_w)
    pos_off = tl.load(row + F_b)
    out = tl.load(row + F_out)
    rows = tl.arange(0, BLOCK_M)
    cols = n0 + tl.arange(0, BLOCK_N)
    rmask = rows < M
    mask = rmask[:, None] & (cols[None, :] < N)
    tok = tl.load(dyn_ptr + rows, mask=rmask, other=0, cache_modifier=CG).to(tl.int64)
    pos = tl.load(dyn_ptr + B + rows, mask=rmask, other=0, cache_modifier=CG).to(tl.int64)
    # Tokens and positions are values of this launch (the host's, or the previous step's argmax):
    # one outside its table is read as row 0 and reported (the caller's results are then refused),
    # never used as an address. No position table (pos_off = -1): positions are not read.
    tok_ok = (tok >= 0) & (tok < tl.load(row + F_rows))
    pos_ok = ((pos * 0 + pos_off) < 0) | ((pos >= 0) & (pos < tl.load(row + F_prows)))
    # (no ~ on the masks: Triton 3.3's interpreter lacks it for booleans)
    bad = tl.max(tl.where(rmask, tl.where(tok_ok & pos_ok, 0, 1), 0), axis=0)
    tok = tl.where(tok_ok, tok, 0)
    pos = tl.where(pos_ok, pos, 0)
    ldw = tl.load(row + F_ldw)   # the tables' padded row stride
    e = tl.load(w_ptr + tok_off + tok[:, None] * ldw + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    e = e * _f32(tl.load(row + F_scale))   # Gemma's sqrt(d) embedding scale (1.0 elsewhere)
    # No position table (pos_off = -1): load nothing, add zero.
    pmask = mask & ((cols[None, :].to(tl.int64) * 0 + pos_off) >= 0)   # vector mask: see _task_rope_append
    p = tl.load(w_ptr + tl.maximum(pos_off, 0) + pos[:, None] * ldw + cols[None, :], mask=pmask,
                other=0.0).to(tl.float32)
    tl.store(s_ptr + out + rows[:, None].to(tl.int64) * N + cols[None, :], e + p, mask=mask)
    return bad


@triton.jit
def _row_stats(x_rows, rmask, K, norm, eps, BLOCK_M: tl.constexpr, BK: tl.constexpr):
    """Each row's (mean, rstd) of the [BLOCK_M, K] rows at x_rows (row pointers, [BLOCK_M, 1]):
    LayerNorm's two passes (mean, then the variance about it), or RMSNorm's one (norm code 2:
    the mean held at 0)."""
    ks = tl.arange(0, BK)
    s1 = tl.zeros((BLOCK_M,), tl.float32)
    if norm != 2:
        for kb in range(0, K, BK):
            kk = kb + ks
            xm = rmask[:, None] & (kk[None, :] < K)
            s1 += tl.sum(tl.load(x_rows + kk[None, :], mask=xm, other=0.0, cache_modifier=CG), axis=1)
    mean = s1 / K
    s2 = tl.zeros((BLOCK_M,), tl.float32)
    for kb in range(0, K, BK):
        kk = kb + ks
        xm = rmask[:, None] & (kk[None, :] < K)
        xv = tl.load(x_rows + kk[None, :], mask=xm, other=0.0, cache_modifier=CG)
        xc = tl.where(xm, xv - mean[:, None], 0.0)
        s2 += tl.sum(xc * xc, axis=1)
    return mean, 1.0 / tl.sqrt(s2 / K + eps)


@triton.jit
def _norm_stats(s_ptr, lnw, lnst, norm, x_rows, rmask, K, eps, BLOCK_M: tl.constexpr, BK: tl.constexpr):
    """The (mean, rstd) a fused norm applies to each of a task's rows (0 and 1 without one). The
    last task of x's producer stage wrote them (field lnst, _task_row_stats): 8 bytes a row instead
    of two passes over K; x without such a producer (a host input) has lnst = -1: computed here."""
    rows = tl.arange(0, BLOCK_M)
    mean = tl.zeros((BLOCK_M,), tl.float32)
    rstd = tl.full((BLOCK_M,), 1.0, tl.float32)
    if lnw >= 0:
        if lnst >= 0:
            st = s_ptr + lnst + 2 * rows
            mean = tl.load(st, mask=rmask, other=0.0, cache_modifier=CG)
            rstd = tl.load(st + 1, mask=rmask, other=1.0, cache_modifier=CG)
        else:
            mean, rstd = _row_stats(x_rows, rmask, K, norm, eps, BLOCK_M, BK)
    return mean, rstd


@triton.jit
def _tile_stats(row, acc, omask, rows, rmask, s_ptr, stpart, width, sub):
    """A tile's share of its rows' statistics, from the values it just stored (still in registers):
    per row, the count of its columns (`width`), their mean and M2 (the sum of squares about that mean: two
    passes over registers, exact) into slot `sttile` + sub of the stage's [B, stnt, 3] partials, which
    the stage's finale merges (_merge_tile_stats) instead of reading the whole value again."""
    stnt = tl.load(row + F_stnt)
    tile = tl.load(row + F_sttile) + sub
    mean = tl.sum(tl.where(omask, acc, 0.0), axis=1) / width
    dev = tl.where(omask, acc - mean[:, None], 0.0)
    p = s_ptr + stpart + (rows.to(tl.int64) * stnt + tile) * 3
    tl.store(p, rows * 0 + width.to(tl.float32), mask=rmask)
    tl.store(p + 1, mean, mask=rmask)
    tl.store(p + 2, tl.sum(dev * dev, axis=1), mask=rmask)


@triton.jit
def _merge_tile_stats(parts, nt, rmask, K, norm, eps, BLOCK_M: tl.constexpr):
    """Each row's (mean, rstd) from its `nt` <= STATS_TILES tiles' (count, mean, M2) at `parts`
    ([BLOCK_M, nt, 3]), read in one trip: the mean of the tiles' means by their counts, and M2 as
    the tiles' M2 plus each tile's count times its mean's squared distance from that mean (Chan et
    al.'s pairwise combination). No sum of squares about zero is ever subtracted, so a row whose
    mean is large against its spread keeps its variance (E[x^2] - E[x]^2 in fp32 would cancel).
    RMSNorm (norm code 2): the mean square is M2 / K + mean^2, a sum of non-negative terms, and
    the mean held at 0."""
    rows = tl.arange(0, BLOCK_M)
    tiles = tl.arange(0, STATS_TILES)
    tm = rmask[:, None] & (tiles < nt)[None, :]
    p = parts + (rows[:, None].to(tl.int64) * nt + tiles[None, :]) * 3
    c = tl.load(p, mask=tm, other=0.0, cache_modifier=CG)
    m = tl.load(p + 1, mask=tm, other=0.0, cache_modifier=CG)
    q = tl.load(p + 2, mask=tm, other=0.0, cache_modifier=CG)
    mu = tl.sum(c * m, axis=1) / K
    dm = m - mu[:, None]
    var = tl.sum(q + c * dm * dm, axis=1) / K
    if norm == 2:
        var += mu * mu
        mu = tl.zeros((BLOCK_M,), tl.float32)
    return mu, 1.0 / tl.sqrt(var + eps)


@triton.jit
def _task_row_stats(row, s_ptr, B, eps, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, MERGE: tl.constexpr = False):
    """The finale of a stage whose output x feeds a fused LayerNorm / RMSNorm (run by the stage's
    last task to finish, see _step_tasks): each of the B rows' (mean, rstd) of x ([B, stn] at stx)
    into stout ([B, 2]), so the linear's tiles read 2 floats a row instead of 2 passes over K.
    MERGE (the aligned builds, the GPU's candidates): a linear stage's tiles left their partial
    statistics (stpart >= 0, _tile_stats), and one trip merges them (Moondream 2 at batch 8: 1 trip
    where the passes over x take 32). The plain builds, and other stages' finales, read x: each
    pass STATS_TILE elements a trip over the rows, not BLOCK_K a row (K 2048, BLOCK_K 64: 2 trips a
    pass instead of 32 at batch 1, 16 at batch 8). (Plain builds only: their code stays as it was,
    at the edge of the register file: with the merge, Triton 3.6's plain fp32 batch-8 build
    spilled 24 B.)
    Bytes: 2*B*K*4 read (L2: the stage just wrote x), or 12*B*stnt from the partials; 8*B written."""
    # Above batch 1 at most twice BLOCK_K a row: a wider tile spilled the roofline tiling's batch-8
    # fp32 build under Triton 3.6 (40 B; BLOCK_K 16 there, 64 in Tiling()).
    WIDE_CH: tl.constexpr = STATS_TILE // BLOCK_M if STATS_TILE // BLOCK_M <= 2 * BLOCK_K else 2 * BLOCK_K
    CH: tl.constexpr = STATS_TILE if BLOCK_M == 1 else (WIDE_CH if WIDE_CH >= BLOCK_K else BLOCK_K)
    K = tl.load(row + F_stn)
    stpart = tl.load(row + F_stpart)
    kind = tl.load(row + F_stkind)
    rows = tl.arange(0, BLOCK_M)
    rmask = rows < B
    x_rows = s_ptr + tl.load(row + F_stx) + rows[:, None].to(tl.int64) * K
    if MERGE:
        if stpart >= 0:
            mean, rstd = _merge_tile_stats(s_ptr + stpart, tl.load(row + F_stnt), rmask, K, kind, eps, BLOCK_M)
        else:
            mean, rstd = _row_stats(x_rows, rmask, K, kind, eps, BLOCK_M, CH)
    else:
        mean, rstd = _row_stats(x_rows, rmask, K, kind, eps, BLOCK_M, CH)
    out = s_ptr + tl.load(row + F_stout) + 2 * rows
    tl.store(out, mean, mask=rmask)
    tl.store(out + 1, rstd, mask=rmask)


@triton.jit
def _sixteens(v):
    """v, a multiple of 16 by construction (compiler.plan: weight offsets, row strides, K slices),
    said in arithmetic that the alignment analysis keeps. tl.multiple_of on a load is an attribute
    of that load, which passes that rebuild it drop: in the MoE tasks' inlined copies of _linear_acc
    (Triton 3.9 TTGIR) k0 and ldw lost theirs, and FP8 experts loaded their weights a byte at a
    time. Only the expert tasks use it (FP8 ones, and all in the streaming builds' wide steps, where
    the 16-bit ones otherwise loaded 2 bytes): said this way elsewhere the fp32 build spills (152 B at
    batch 1, 3.9), and the other tasks keep their hints."""
    return v // 16 * 16


@triton.jit
def _linear_acc(row, w_ptr, s_ptr, ln_eps, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                w_shift=0, x_shift=0, FP8: tl.constexpr = False, row_sel=-1, LOOP: tl.constexpr = 0,
                EXPERT: tl.constexpr = False, n_shift=0, mean_in=0.0, rstd_in=1.0, STATS: tl.constexpr = False):
    """[BLOCK_M, BLOCK_N] fp32 product of this task's rows of x (LayerNorm'd when the task fuses
    one) with its tile of W, over K range [k0, k1). The tile is columns [n0, n1): stages of few
    columns use narrower tiles (more tasks), and a split-K task sees a slice of K. w_shift /
    x_shift move W and x by a run-time amount (an expert's rows, a slot's hidden vector); row_sel
    is a bitmask of the rows to compute (an expert's tasks: the rows that chose it; the others'
    x is not loaded and their output is 0). FP8
    (expert tasks of FP8 experts): W is e4m3 bytes (offsets in bytes) decoded in registers, and the
    product is 2^-8 of the true one without the row scales, which the caller's epilogue applies.
    LOOP: the K loop's build (KernelVariant.loop): pipelined stages; UNROLL: weight tiles loaded
    before the first is multiplied (several steps' bytes in flight); DOT > 0 (bf16 weights;
    BLOCK_M >= 16, rows past M masked): steps of DOT on the tensor cores, see _linear_dot_steps;
    WIDE > 0: steps of WIDE reduced as they come, see _linear_wide_steps. EXPERT: an expert task's
    call that says its alignment in arithmetic (see _sixteens). n_shift: the tile starts that many
    columns past the task's n0 (an expert task's tiles, one after another; masked at its n1).
    STATS: the fused norm's row statistics are the caller's (mean_in, rstd_in: _norm_stats, read
    once for all of its tiles)."""
    PIPE: tl.constexpr = LOOP % 16
    UNROLL: tl.constexpr = (LOOP // 16) % 16
    DOT: tl.constexpr = (LOOP // 256) % 256 * 16
    WIDE: tl.constexpr = LOOP // 65536 % 256 * 16
    ALIGNED: tl.constexpr = LOOP // 16777216 % 2
    # FP8 tiles take half the K step: a byte tile decoded to fp32 holds the bytes and the floats at
    # once, and at batch 1 (BLOCK_K 128) the full step spills registers (ptxas -v); for the same
    # reason they get half of the product budget, and a weight tile of their own (fp8_weight_tile:
    # 16 bytes a thread at 8 warps too). A step keeps the product and the weight tile within
    # them, and at least 16 elements (the weights' alignment, see k1w).
    BK0: tl.constexpr = BLOCK_K // 2 if FP8 else BLOCK_K
    FIT_MNK: tl.constexpr = LINEAR_TILE // (BLOCK_M * BLOCK_N) // (2 if FP8 else 1)
    FIT_NK: tl.constexpr = (FP8_WEIGHT_TILE if FP8 else WEIGHT_TILE) // BLOCK_N
    FIT: tl.constexpr = FIT_MNK if FIT_MNK <= FIT_NK else FIT_NK
    # A pipelined loop of 16-byte loads (PIPE with ALIGNED) stages its later steps' tiles in shared
    # memory, not registers: it takes the budgets' widest step, up to 256 (block_k 64 gave it 4 KB a
    # trip at batch 1; the budgets' 8 KB under 3.6, 16 under 3.9, SASS; 256 under the interpreter).
    PIPE_WIDE: tl.constexpr = 0 if FP8 else ((ALIGNED if UNROLL + DOT + WIDE == 0 else 0) if PIPE > 0 else 0)
    FIT256: tl.constexpr = FIT if FIT <= 256 else 256
    BK1: tl.constexpr = BK0 if PIPE_WIDE == 0 else (BK0 if FIT256 <= BK0 else FIT256)   # widened, never narrowed
    BK: tl.constexpr = BK1 if BK1 <= FIT else (FIT if FIT >= 16 else 16)
    # Every field first, before any branch on one: independent loads issue together (one trip to
    # L2 for the task row) where a load behind each branch would wait for the one before.
    M = tl.load(row + F_M)
    K = tl.load(row + F_K)
    n0 = tl.load(row + F_n0) + n_shift
    x_off = tl.load(row + F_x) + x_shift
    # The compiler aligns weight offsets, row strides and K slices to 16 elements (compiler.plan):
    # saying so is meant to make every weight load a 128-bit vector load. Said of `offset +
    # w_shift` (the default build), a dense task's shift of 0 folds the add away and the hint with
    # it: its weights stream as 2-byte loads (PTX, Triton 3.9 and 3.6; only MoE tasks, whose shift
    # is real, load 16 bytes). ALIGNED says it of the loaded offset itself: the dense tasks load 16
    # bytes (the expert tasks say theirs in arithmetic where they stream: EXPERT): a variant for
    # the GPU to measure (KernelVariant.aligned), not yet the default.
    if EXPERT:
        w_off = _sixteens(tl.load(row + F_w)) + w_shift
    elif ALIGNED:
        w_off = tl.multiple_of(tl.load(row + F_w), 16) + w_shift
    else:
        w_off = tl.multiple_of(tl.load(row + F_w) + w_shift, 16)
    lnw = tl.load(row + F_lnw)
    lnb = tl.load(row + F_lnb)
    lnst = tl.load(row + F_lnst)
    norm = tl.load(row + F_norm)
    xglu = tl.load(row + F_xglu)
    xgate = tl.load(row + F_xgate)
    xs = tl.load(row + F_xs)
    xc0 = tl.load(row + F_xc0)
    gact = tl.load(row + F_gact)
    xact = tl.load(row + F_xact)
    n1 = tl.load(row + F_n1)
    k0 = tl.multiple_of(tl.load(row + F_k0), 16)
    k1 = tl.load(row + F_k1)
    ldw = tl.multiple_of(tl.load(row + F_ldw), 16)
    if EXPERT:
        k0 = _sixteens(k0)
        ldw = _sixteens(ldw)
    # Weights are masked at k1 rounded up into the row padding (zeros, multiplied by x masked to 0),
    # so the mask is the same for every 16 consecutive elements and does not split a vector.
    k1w = tl.multiple_of((k1 + 15) // 16 * 16, 16)
    rows = tl.arange(0, BLOCK_M)
    rmask = (rows < M) & (((row_sel >> rows) & 1) != 0)
    cols = n0 + tl.arange(0, BLOCK_N)
    cmask = cols < n1
    ks = tl.arange(0, BK)
    # x is [M, K] unless a fused mul reads a column slice [c0, c0 + K) of a wider value (stride xs).
    x_rows = s_ptr + x_off + xc0 + rows[:, None].to(tl.int64) * tl.where(xs >= 0, xs, K)
    if STATS:      # the caller read them once for all its tiles
        mean, rstd = mean_in, rstd_in
    else:
        mean, rstd = _norm_stats(s_ptr, lnw, lnst, norm, x_rows, rmask, K, ln_eps, BLOCK_M, BK)
    # Accumulate elementwise and reduce over K once after the loop: a reduction per K step costs
    # a round of shuffles across the warp for every BLOCK_K weights loaded.
    # A gated input (SwiGLU / GeGLU fused in, code xglu = the gate's activation): each row of x is
    # gate | up, 2K wide, and the product reads act(gate) * up.
    if xglu > 0:
        x_rows = s_ptr + x_off + rows[:, None].to(tl.int64) * (2 * K)
    # A gated input x * act(g), g another [M, K] value (Qwen 3.5's attention output gate: sigmoid;
    # Gemma 4's per-layer input: gelu_tanh), or an activation on the loads (Moondream 3's gelu(qkv)).
    g_rows = s_ptr + tl.maximum(xgate, 0) + rows[:, None].to(tl.int64) * K
    if WIDE > 0:
        # Row m of x at x_base + m * x_stride (the same rows as x_rows, by base and stride); the
        # rows to compute as bits of one scalar (rmask's), which a loop over the rows can branch on.
        rbits = row_sel & ((1 << M) - 1)
        x_base = s_ptr + x_off + tl.where(xglu > 0, 0, xc0)
        x_stride = tl.where(xglu > 0, 2 * K, tl.where(xs >= 0, xs, K)).to(tl.int64)
        return _linear_wide_steps(k0, k1, k1w, K, rows, rbits, x_base, x_stride, s_ptr + tl.maximum(xgate, 0), xglu,
                                  xact, xgate, gact, lnw, lnb, mean, rstd, w_ptr, w_off, cols, cmask, ldw, BLOCK_M,
                                  BLOCK_N, WIDE, FP8)
    if DOT > 0:
        return _linear_dot_steps(k0, k1, k1w, K, rmask, x_rows, g_rows, xglu, xact, xgate, gact, lnw, lnb, mean,
                                 rstd, w_ptr, w_off, cols, cmask, ldw, BLOCK_M, BLOCK_N, DOT,
                                 PIPE if PIPE > 0 else 3)
    acc3 = tl.zeros((BLOCK_M, BLOCK_N, BK), tl.float32)
    if UNROLL == 2:
        # UNROLL weight tiles issued before the first is used (independent loads: all in flight
        # at once, where the plain loop has one), then each multiplied as the plain loop does.
        for kb in range(k0, k1, BK * 2):
            w0 = _w_tile(kb, ks, k1w, w_ptr, w_off, cols, cmask, ldw, FP8)
            w1 = _w_tile(kb + BK, ks, k1w, w_ptr, w_off, cols, cmask, ldw, FP8)
            acc3 = _xw_step(acc3, w0, kb, ks, k1, K, rmask, x_rows, g_rows, xglu, xact, xgate, gact, lnw, lnb, mean,
                            rstd, w_ptr, FP8)
            acc3 = _xw_step(acc3, w1, kb + BK, ks, k1, K, rmask, x_rows, g_rows, xglu, xact, xgate, gact, lnw, lnb,
                            mean, rstd, w_ptr, FP8)
    elif UNROLL > 2:
        # 4 or 8 tiles, in groups of 4: every group's loads issue before the first tile is used.
        tl.static_assert(UNROLL == 4 or UNROLL == 8, "unroll 2, 4 or 8 (KernelVariant)")
        for kb in range(k0, k1, BK * UNROLL):
            w0, w1, w2, w3 = _w_tiles4(kb, BK, ks, k1w, w_ptr, w_off, cols, cmask, ldw, FP8)
            if UNROLL == 8:
                w4, w5, w6, w7 = _w_tiles4(kb + 4 * BK, BK, ks, k1w, w_ptr, w_off, cols, cmask, ldw, FP8)
            acc3 = _xw_steps4(acc3, w0, w1, w2, w3, kb, BK, ks, k1, K, rmask, x_rows, g_rows, xglu, xact, xgate, gact,
                              lnw, lnb, mean, rstd, w_ptr, FP8)
            if UNROLL == 8:
                acc3 = _xw_steps4(acc3, w4, w5, w6, w7, kb + 4 * BK, BK, ks, k1, K, rmask, x_rows, g_rows, xglu, xact,
                                  xgate, gact, lnw, lnb, mean, rstd, w_ptr, FP8)
    elif PIPE > 0:
        # Software-pipelined: the loads of later K steps are in flight while one is consumed
        # (Triton's pipeliner stages them through shared memory: PIPE - 2 steps' copies outstanding
        # at a step's wait, PIPE - 1 once the next is issued, SASS), so a tile streams with several
        # steps' weights outstanding instead of one, none of them in registers. The weights
        # are staged only where they load 16 bytes (ALIGNED: cp.async of 16 bytes, SASS under 3.6 and
        # 3.9); the plain build's 2-byte loads stay loads, and only x's 4-byte loads are staged.
        for kb in tl.range(k0, k1, BK, num_stages=PIPE):
            acc3 = _linear_k_step(acc3, kb, ks, k1, k1w, K, rmask, x_rows, g_rows, xglu, xact, xgate, gact, lnw, lnb,
                                  mean, rstd, w_ptr, w_off, cols, cmask, ldw, FP8)
    else:
        for kb in range(k0, k1, BK):
            acc3 = _linear_k_step(acc3, kb, ks, k1, k1w, K, rmask, x_rows, g_rows, xglu, xact, xgate, gact, lnw, lnb,
                                  mean, rstd, w_ptr, w_off, cols, cmask, ldw, FP8)
    return tl.sum(acc3, axis=2)


@triton.jit
def _x_tile(kk, kmask, K, rmask, x_rows, g_rows, xglu, xact, xgate, gact, lnw, lnb, mean, rstd, w_ptr):
    """x's [M, BK] at K columns kk, with its fused norm, gate or activation applied as it loads
    (0 past K and in masked rows)."""
    xm = rmask[:, None] & kmask[None, :]
    x = tl.load(x_rows + kk[None, :], mask=xm, other=0.0, cache_modifier=CG)
    if xglu > 0:
        x = apply_activation(x, xglu) * tl.load(x_rows + K + kk[None, :], mask=xm, other=0.0, cache_modifier=CG)
    if xact > 0:
        x = apply_activation(x, xact)
    if xgate >= 0:
        x = x * apply_activation(tl.load(g_rows + kk[None, :], mask=xm, other=0.0, cache_modifier=CG), gact)
    if lnw >= 0:
        g = tl.load(w_ptr + lnw + kk, mask=kmask, other=0.0).to(tl.float32)
        # A LayerNorm without bias has lnb = -1: load from 0 and zero it (scalar masks are awkward).
        be = (tl.load(w_ptr + tl.maximum(lnb, 0) + kk, mask=kmask, other=0.0).to(tl.float32)
              * tl.where(lnb >= 0, 1.0, 0.0))
        x = tl.where(xm, (x - mean[:, None]) * rstd[:, None] * g[None, :] + be[None, :], 0.0)
    return x


@triton.jit
def _linear_k_step(acc3, kb, ks, k1, k1w, K, rmask, x_rows, g_rows, xglu, xact, xgate, gact, lnw, lnb, mean, rstd,
                   w_ptr, w_off, cols, cmask, ldw, FP8: tl.constexpr):
    """One K step of _linear_acc: x's [M, BK] times the [BN, BK] weight tile, accumulated
    elementwise."""
    kk = kb + ks
    x = _x_tile(kk, kk < k1, K, rmask, x_rows, g_rows, xglu, xact, xgate, gact, lnw, lnb, mean, rstd, w_ptr)
    # the load in _w_tile, whose lines sass_loops counts whole (ptxas 3.9 recorded this loop's FP8
    # byte loads past the marked line when it was written here)
    w = _w_tile(kb, ks, k1w, w_ptr, w_off, cols, cmask, ldw, FP8)
    w = fp8_e4m3_over_256(w) if FP8 else w.to(tl.float32)
    return acc3 + x[:, None, :] * w[None, :, :]


@triton.jit
def _w_tile(kb, ks, k1w, w_ptr, w_off, cols, cmask, ldw, FP8: tl.constexpr):
    """The [BN, BK] weight tile at K columns kb + ks, as loaded (bf16, fp16, fp32 or FP8 bytes)."""
    kk = kb + ks
    wp = cols[:, None].to(tl.int64) * ldw + kk[None, :]
    wm = cmask[:, None] & (kk < k1w)[None, :]
    # One load for either element type. ptxas (Triton 3.9) records the FP8 loads a few lines after
    # the load (the `return` when the load sat in an if/else, now past the function's last line):
    # sass_loops counts every line of a leaf function whose loads are all weight loads.
    w_ptr_as = w_ptr.to(tl.pointer_type(tl.uint8)) if FP8 else w_ptr
    return tl.load(w_ptr_as + w_off + wp, mask=wm, other=0)


@triton.jit
def _w_tiles4(kb, BK: tl.constexpr, ks, k1w, w_ptr, w_off, cols, cmask, ldw, FP8: tl.constexpr):
    """Four consecutive weight tiles from K column kb (_w_tile), loaded before any is used."""
    return (_w_tile(kb, ks, k1w, w_ptr, w_off, cols, cmask, ldw, FP8),
            _w_tile(kb + BK, ks, k1w, w_ptr, w_off, cols, cmask, ldw, FP8),
            _w_tile(kb + 2 * BK, ks, k1w, w_ptr, w_off, cols, cmask, ldw, FP8),
            _w_tile(kb + 3 * BK, ks, k1w, w_ptr, w_off, cols, cmask, ldw, FP8))


@triton.jit
def _xw_steps4(acc3, w0, w1, w2, w3, kb, BK: tl.constexpr, ks, k1, K, rmask, x_rows, g_rows, xglu, xact, xgate, gact,
               lnw, lnb, mean, rstd, w_ptr, FP8: tl.constexpr):
    """_xw_step over four loaded tiles (_w_tiles4) from K column kb."""
    acc3 = _xw_step(acc3, w0, kb, ks, k1, K, rmask, x_rows, g_rows, xglu, xact, xgate, gact, lnw, lnb, mean, rstd,
                    w_ptr, FP8)
    acc3 = _xw_step(acc3, w1, kb + BK, ks, k1, K, rmask, x_rows, g_rows, xglu, xact, xgate, gact, lnw, lnb, mean,
                    rstd, w_ptr, FP8)
    acc3 = _xw_step(acc3, w2, kb + 2 * BK, ks, k1, K, rmask, x_rows, g_rows, xglu, xact, xgate, gact, lnw, lnb, mean,
                    rstd, w_ptr, FP8)
    return _xw_step(acc3, w3, kb + 3 * BK, ks, k1, K, rmask, x_rows, g_rows, xglu, xact, xgate, gact, lnw, lnb, mean,
                    rstd, w_ptr, FP8)


@triton.jit
def _xw_step(acc3, w, kb, ks, k1, K, rmask, x_rows, g_rows, xglu, xact, xgate, gact, lnw, lnb, mean, rstd, w_ptr,
             FP8: tl.constexpr):
    """acc3 + x's [M, BK] at kb times a loaded weight tile (_w_tile), elementwise."""
    kk = kb + ks
    x = _x_tile(kk, kk < k1, K, rmask, x_rows, g_rows, xglu, xact, xgate, gact, lnw, lnb, mean, rstd, w_ptr)
    if FP8:
        wf = fp8_e4m3_over_256(w)
    else:
        wf = w.to(tl.float32)
    return acc3 + x[:, None, :] * wf[None, :, :]


@triton.jit
def _x_row(kk, kmask, K, x_row, g_row, xglu, xact, xgate, gact, lnw, gn, be, mean, rstd):
    """One row of x at K columns kk ([BK]), as _x_tile makes a tile's (x_row: the row's start;
    g_row: its gate's; gn, be: the fused norm's weight and bias at kk, loaded once for every row;
    mean, rstd: the row's statistics)."""
    x = tl.load(x_row + kk, mask=kmask, other=0.0, cache_modifier=CG)
    if xglu > 0:
        x = apply_activation(x, xglu) * tl.load(x_row + K + kk, mask=kmask, other=0.0, cache_modifier=CG)
    if xact > 0:
        x = apply_activation(x, xact)
    if xgate >= 0:
        x = x * apply_activation(tl.load(g_row + kk, mask=kmask, other=0.0, cache_modifier=CG), gact)
    if lnw >= 0:
        x = tl.where(kmask, (x - mean) * rstd * gn + be, 0.0)
    return x


@triton.jit
def _linear_wide_steps(k0, k1, k1w, K, rows, rbits, x_base, x_stride, g_base, xglu, xact, xgate, gact, lnw, lnb, mean,
                       rstd, w_ptr, w_off, cols, cmask, ldw, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BK: tl.constexpr, FP8: tl.constexpr = False):
    """The K loop with wide steps: each step loads a [BLOCK_N, BK] weight tile (dense BK of 256-512:
    16-32 KB of bf16 at 32 columns; an expert's step is expert_step's, 128-512 elements), issued at
    once as 16-byte loads (aligned builds), so a step has that much in flight where the elementwise
    loop has one BLOCK_K tile, then each row's x slice as a
    [BK] vector, and reduces w * x_row over K into the row's outputs at once: a few shuffles a row,
    against a memory trip of a microsecond. Each row's x still moves into the weight tile's layout
    through shared memory (SASS: 10 barriers a step at batch 1, 64 at batch 8; bench/RESULTS.md
    "Megakernel K loop from the SASS"), after the step's weight loads are issued. Bytes a step:
    BLOCK_N * BK weights + M * BK x (L2). FP8 (an FP8 expert's bytes): the step's two halves are
    loaded before either is decoded, and each is decoded and reduced in turn: the step's bytes in
    flight at once, its fp32 values half a step at a time (a whole step's, 128 a thread under Triton
    3.9, spilled 216 B). Above batch 1 the rows take turns in a loop (_wide_rows), skipping those
    not in rbits: an expert task's tile is reduced by the rows that chose the expert."""
    HALF: tl.constexpr = BK // 2 if FP8 else BK
    ks = tl.arange(0, HALF)
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for kb in range(k0, k1, BK):
        w = _w_tile(kb, ks, k1w, w_ptr, w_off, cols, cmask, ldw, FP8)
        if FP8:
            w2 = _w_tile(kb + HALF, ks, k1w, w_ptr, w_off, cols, cmask, ldw, FP8)
            acc = _wide_rows(acc, fp8_e4m3_over_256(w), kb + ks, k1, K, rows, rbits, x_base, x_stride, g_base, xglu,
                             xact, xgate, gact, lnw, lnb, mean, rstd, w_ptr, BLOCK_M)
            acc = _wide_rows(acc, fp8_e4m3_over_256(w2), kb + HALF + ks, k1, K, rows, rbits, x_base, x_stride, g_base,
                             xglu, xact, xgate, gact, lnw, lnb, mean, rstd, w_ptr, BLOCK_M)
        else:
            acc = _wide_rows(acc, w.to(tl.float32), kb + ks, k1, K, rows, rbits, x_base, x_stride, g_base, xglu, xact,
                             xgate, gact, lnw, lnb, mean, rstd, w_ptr, BLOCK_M)
    return acc


@triton.jit
def _wide_rows(acc, w, kk, k1, K, rows, rbits, x_base, x_stride, g_base, xglu, xact, xgate, gact, lnw, lnb, mean, rstd,
               w_ptr, BLOCK_M: tl.constexpr):
    """acc + each row's x at K columns kk times the loaded tile w ([BLOCK_N, len(kk)], fp32), reduced
    over K (one wide step of _linear_wide_steps; for FP8, half of one), for the rows set in rbits
    (bit m: row m is live and, in an expert task, chose the expert)."""
    kmask = kk < k1
    # The fused norm's weight and bias are the same for every row: loaded (and moved into the
    # rows' layout) once a step, not once a row (8 layout changes a step at batch 8, SASS).
    gn = tl.load(w_ptr + tl.maximum(lnw, 0) + kk, mask=kmask & ((kk * 0 + lnw) >= 0), other=0.0).to(tl.float32)
    be = tl.load(w_ptr + tl.maximum(lnb, 0) + kk, mask=kmask & ((kk * 0 + lnb) >= 0), other=0.0).to(tl.float32)
    if BLOCK_M == 1:
        acc = _wide_row(acc, w, 0, rbits & 1, kk, kmask, K, rows, x_base, x_stride, g_base, xglu, xact, xgate, gact,
                        lnw, gn, be, mean, rstd)
    else:
        # A loop over the rows, not a copy of the row's code for each: eight copies each held their
        # x and product and spilled (batch 8: 688 B under Triton 3.6, 800-1344 B under 3.9). Rows
        # not in rbits are skipped: in an expert task most are (an expert is chosen by ~1.6 of 8
        # rows under uniform routing), and each costs a layout change and a reduction.
        for m in range(0, BLOCK_M):
            if ((rbits >> m) & 1) != 0:
                acc = _wide_row(acc, w, m, 1, kk, kmask, K, rows, x_base, x_stride, g_base, xglu, xact, xgate, gact,
                                lnw, gn, be, mean, rstd)
    return acc


@triton.jit
def _wide_row(acc, w, m, ok, kk, kmask, K, rows, x_base, x_stride, g_base, xglu, xact, xgate, gact, lnw, gn, be, mean,
              rstd):
    """acc with row m's x at kk times w added to its row m (x not loaded where ok is 0)."""
    one = rows == m
    mean_m = tl.sum(tl.where(one, mean, 0.0), axis=0)
    rstd_m = tl.sum(tl.where(one, rstd, 0.0), axis=0)
    # a vector mask: scalar & vector confuses the interpreter
    x = _x_row(kk, kmask & ((kk * 0 + ok) > 0), K, x_base + m * x_stride, g_base + m * K, xglu, xact, xgate, gact,
               lnw, gn, be, mean_m, rstd_m)
    part = tl.sum(w * x[None, :], axis=1)
    return tl.where(one[:, None], acc + part[None, :], acc)


@triton.jit
def _linear_dot_steps(k0, k1, k1w, K, rmask, x_rows, g_rows, xglu, xact, xgate, gact, lnw, lnb, mean, rstd, w_ptr,
                      w_off, cols, cmask, ldw, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BK: tl.constexpr,
                      STAGES: tl.constexpr):
    """The K loop on the tensor cores: [BLOCK_M (>= 16), BK] of x times the [BK, BLOCK_N] weight
    tile per step, tl.dot accumulating in fp32, the loop pipelined over STAGES (the weight tiles
    of STAGES - 1 later steps in flight through shared memory while one is multiplied: with BK 256
    and 32 bf16 columns, 16 KB a step, 32 KB ahead).

    The weights are 16-bit and exact as MMA operands; x is fp32, so it is split into two bf16
    terms, x = hi + lo + r with |r| <= 2^-17 |x| (round to nearest even both times, bf16_rne), and
    each term is multiplied exactly: the product is x @ W to about fp32's accuracy (the dropped r,
    2^-17 relative, is below the fp32 accumulation's own error over K of a few thousand), not
    bf16's. Rows past M are zero (masked loads) and cost only tensor-core time, of which a
    decode step has plenty. Under the interpreter (no bf16 dot there) the same two terms are
    multiplied in fp32, exactly as the tensor cores multiply them."""
    ks = tl.arange(0, BK)
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for kb in tl.range(k0, k1, BK, num_stages=STAGES):
        # k0 and BK are multiples of 16 (compiler.plan): said again for the loop variable, so the
        # weight tile's mask (constant over 16 elements, see k1w) keeps its copies 16 bytes wide.
        kk = tl.multiple_of(kb, 16) + ks
        x = _x_tile(kk, kk < k1, K, rmask, x_rows, g_rows, xglu, xact, xgate, gact, lnw, lnb, mean, rstd, w_ptr)
        wm = cmask[:, None] & (kk < k1w)[None, :]
        w = tl.load(w_ptr + w_off + cols[:, None].to(tl.int64) * ldw + kk[None, :], mask=wm, other=0.0)
        hi = bf16_rne(x)
        lo = bf16_rne(x - hi.to(tl.float32))
        if INTERP:
            wt = tl.trans(w.to(tl.float32))
            acc = tl.dot(hi.to(tl.float32), wt, acc, input_precision="ieee")
            acc = tl.dot(lo.to(tl.float32), wt, acc, input_precision="ieee")
        else:
            wt = tl.trans(w.to(tl.bfloat16))
            acc = tl.dot(hi, wt, acc)
            acc = tl.dot(lo, wt, acc)
    return acc


@triton.jit
def _linear_epilogue(row, acc, w_ptr, s_ptr, dyn_ptr, B, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     KV_BF16: tl.constexpr = False, TILE_STATS: tl.constexpr = False, sub=0):
    """Finish a tile: + bias, activation, + residual, then store by mode: plain, q|k|v (q to its
    buffer, k and v into the caches at each row's position) or logits (plus the tile's per-row
    (max, first index) for the argmax). TILE_STATS (the aligned builds' linear tasks, see
    _task_row_stats): a plain tile of a stage whose output feeds a norm also stores its share of the
    rows' statistics (_tile_stats). sub: the tile's place in its task's span (columns from
    n0 + sub * BLOCK_N; tile indices from the task's first)."""
    M = tl.load(row + F_M)
    N = tl.load(row + F_N)
    n0 = tl.load(row + F_n0) + sub * BLOCK_N
    b_off = tl.load(row + F_b)
    act = tl.load(row + F_act)
    res = tl.load(row + F_res)
    mode = tl.load(row + F_mode)
    out = tl.load(row + F_out)
    n1 = tl.load(row + F_n1)
    stpart = tl.load(row + F_stpart)
    rows = tl.arange(0, BLOCK_M)
    rmask = rows < M
    cols = n0 + tl.arange(0, BLOCK_N)
    cmask = cols < n1
    omask = rmask[:, None] & cmask[None, :]
    if b_off >= 0:
        acc += tl.load(w_ptr + b_off + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
    acc = apply_activation(acc, act)
    flat = rows[:, None].to(tl.int64) * N + cols[None, :]
    if res >= 0:
        acc += tl.load(s_ptr + res + flat, mask=omask, other=0.0, cache_modifier=CG)
    if mode == 0:
        tl.store(s_ptr + out + flat, acc, mask=omask)
        if TILE_STATS:
            if stpart >= 0:    # the stage's output feeds a norm: this tile's share of the statistics
                _tile_stats(row, acc, omask, rows, rmask, s_ptr, stpart, tl.minimum(n1 - n0, BLOCK_N), sub)
    elif mode == 1:
        # QKV: columns [0, D) are q (row-major [M, D] at out), [D, 2D) / [2D, 3D) go straight into the
        # K / V caches [B, H, Tmax, Dh] at each row's position: the cache append costs no extra task.
        kc = tl.load(row + F_kc)
        vc = tl.load(row + F_vc)
        H = tl.load(row + F_H)
        Dh = tl.load(row + F_Dh)
        Tmax = tl.load(row + F_Tmax)
        # Equal q, k and v heads only (the compiler stores grouped-query q|k|v with rope tasks).
        D = N // 3
        sec = cols // D
        within = cols - sec * D
        h = within // Dh
        j = within - h * Dh
        pos = tl.load(dyn_ptr + B + rows, mask=rmask, other=0, cache_modifier=CG).to(tl.int64)
        cache = ((rows[:, None].to(tl.int64) * H + h[None, :]) * Tmax + pos[:, None]) * Dh + j[None, :]
        q_addr = out + rows[:, None].to(tl.int64) * D + within[None, :]
        ok = omask & ((sec[None, :] == 0) | ((pos[:, None] >= 0) & (pos[:, None] < Tmax)))
        if KV_BF16:
            # bf16 caches (offsets in bf16 elements): q to the fp32 state, k and v rounded to bf16
            tl.store(s_ptr + q_addr, acc, mask=ok & (sec[None, :] == 0))
            tl.store(s_ptr.to(tl.pointer_type(tl.bfloat16)) + tl.where(sec[None, :] == 1, kc + cache, vc + cache),
                     bf16_rne(acc), mask=ok & (sec[None, :] > 0))
        else:
            addr = tl.where(sec[None, :] == 0, q_addr, tl.where(sec[None, :] == 1, kc + cache, vc + cache))
            tl.store(s_ptr + addr, acc, mask=ok)
    else:
        # Logits: the tile's (max, first index) per row for the argmax reduction.
        tl.store(s_ptr + out + flat, acc, mask=omask)
        tile = tl.load(row + F_tile) + sub
        part = tl.load(row + F_part)
        ntiles = tl.load(row + F_ntiles)
        vals = tl.where(omask, acc, float("-inf"))
        tmax = tl.max(vals, axis=1)
        tidx = tl.min(tl.where(vals == tmax[:, None], cols[None, :], 2147483647), axis=1)
        # An all -inf tile reports its first column, so an all-masked row still yields index 0.
        tidx = tl.where(tidx == 2147483647, n0, tidx)
        # A NaN logit makes the tile's max NaN whatever max() does with NaN (the GPU's ignores it,
        # NumPy's keeps it), so the argmax sees the row as non-finite (argmax_of_tiles).
        tmax = tl.where(tl.max(tl.where(omask & (acc != acc), 1, 0), axis=1) > 0, float("nan"), tmax)
        p = s_ptr + part + (rows.to(tl.int64) * ntiles + tile) * 2
        tl.store(p, tmax, mask=rmask)
        tl.store(p + 1, tidx.to(tl.float32), mask=rmask)


@triton.jit
def _task_linear(row, w_ptr, s_ptr, dyn_ptr, B, ln_eps,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, KV_BF16: tl.constexpr = False,
                 LOOP: tl.constexpr = 0, TILES: tl.constexpr = 0):
    """A task's tiles of BLOCK_N columns (one; with TILES, a span of them: Tiling.linear_span), one
    after another: each its product over all of K, then the epilogue; the claim, header, waits and
    fields paid once for them. Bytes a tile: BLOCK_N*K weights + M*K x."""
    # The tensor-core loop over bf16 weights only: fp32 and fp16 arenas keep the exact loop.
    LP: tl.constexpr = LOOP if w_ptr.dtype.element_ty == tl.bfloat16 else LOOP - 256 * ((LOOP // 256) % 256)
    BM: tl.constexpr = (16 if BLOCK_M < 16 else BLOCK_M) if (LP // 256) % 256 > 0 else BLOCK_M
    TS: tl.constexpr = LOOP // 16777216 % 2    # an aligned build: tiles leave partial statistics
    if TILES:
        for sub in range(0, tl.cdiv(tl.load(row + F_n1) - tl.load(row + F_n0), BLOCK_N)):
            acc = _linear_acc(row, w_ptr, s_ptr, ln_eps, BM, BLOCK_N, BLOCK_K, LOOP=LP, n_shift=sub * BLOCK_N)
            _linear_epilogue(row, acc, w_ptr, s_ptr, dyn_ptr, B, BM, BLOCK_N, KV_BF16, TS, sub)
    else:
        acc = _linear_acc(row, w_ptr, s_ptr, ln_eps, BM, BLOCK_N, BLOCK_K, LOOP=LP)
        _linear_epilogue(row, acc, w_ptr, s_ptr, dyn_ptr, B, BM, BLOCK_N, KV_BF16, TS)


@triton.jit
def _task_linear_split(row, w_ptr, s_ptr, ctrl_ptr, dyn_ptr, B, ln_eps, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, KV_BF16: tl.constexpr = False,
                       LOOP: tl.constexpr = 0):
    """One K slice of a tile (split-K, for stages with too few tiles to fill the GPU): the raw
    partial product into slot `ks` of the stage's [splits, M, N] scratch. Then the tile's ticket:
    the LAST of its slices to finish sums the slots in slot order (a fixed order: the same bits
    whichever slice is last) and runs the epilogue, so the reduction costs no task and no
    dependency level of its own. Bytes: (n1-n0)*(k1-k0) weights + M*(k1-k0) x + M*BN*4 out; the
    last slice also reads the tile's slices*M*BN*4 of partials (L2)."""
    M = tl.load(row + F_M)
    N = tl.load(row + F_N)
    n0 = tl.load(row + F_n0)
    n1 = tl.load(row + F_n1)
    kpart = tl.load(row + F_kpart)
    ks = tl.load(row + F_ksplit)
    # The ticket's fields before the acquire, which would send a later read of them to L2.
    kticket = tl.load(row + F_kticket)
    nslices = tl.load(row + F_ktickets)
    # The tensor-core loop over bf16 weights only: fp32 and fp16 arenas keep the exact loop.
    LP: tl.constexpr = LOOP if w_ptr.dtype.element_ty == tl.bfloat16 else LOOP - 256 * ((LOOP // 256) % 256)
    BM: tl.constexpr = (16 if BLOCK_M < 16 else BLOCK_M) if (LP // 256) % 256 > 0 else BLOCK_M
    TS: tl.constexpr = LOOP // 16777216 % 2    # an aligned build: tiles leave partial statistics
    acc = _linear_acc(row, w_ptr, s_ptr, ln_eps, BM, BLOCK_N, BLOCK_K, LOOP=LP)
    rows = tl.arange(0, BM)
    cols = n0 + tl.arange(0, BLOCK_N)
    omask = (rows < M)[:, None] & (cols < n1)[None, :]
    tile = s_ptr + kpart + rows[:, None].to(tl.int64) * N + cols[None, :]
    tl.store(tile + ks * M * N, acc, mask=omask)
    if kticket >= 0:
        # As the attention partial's ticket: the barrier completes every thread's stores, the
        # acq_rel increment releases them and acquires the slices released before it.
        tl.debug_barrier()
        drawn = tl.atomic_add(ctrl_ptr + kticket, 1, sem="acq_rel")
        tl.debug_barrier()
        if drawn == nslices - 1:
            total = tl.zeros((BM, BLOCK_N), tl.float32)
            for s in range(0, nslices):
                total += tl.load(tile + s * M * N, mask=omask, other=0.0, cache_modifier=CG)
            _linear_epilogue(row, total, w_ptr, s_ptr, dyn_ptr, B, BM, BLOCK_N, KV_BF16, TS)


@triton.jit
def _task_attn_partial(row, s_ptr, ctrl_ptr, dyn_ptr, B, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
                       BLOCK_S: tl.constexpr, KV_BF16: tl.constexpr = False, KV_ALIGNED: tl.constexpr = False):
    """Split s of the keys of (row b, query head h): the online-softmax partial (m, l, acc); then,
    if this is the LAST of the (b, h)'s S partials to finish, their merge into the attention output
    (the merge costs no task and no dependency level of its own). KV_BF16: the caches are bf16
    (offsets in bf16 elements), read as fp32. KV_ALIGNED (KV16): the head dim and the cache offsets
    are multiples of 16, said in arithmetic (_sixteens), so each key's row loads as 16-byte vectors,
    and the keys are reduced per lane (decode_partial's LANES).
    Bytes: 2*chunk*Dh K/V + (Dh+2)*4 out; the last one also S*(Dh+2)*4 of partials (L2) and Dh*4
    of output."""
    q_off = tl.load(row + F_x)
    stride = tl.load(row + F_K)
    kc = tl.load(row + F_kc)
    vc = tl.load(row + F_vc)
    H = tl.load(row + F_H)
    Dh = tl.load(row + F_Dh)
    Tmax = tl.load(row + F_Tmax)
    part = tl.load(row + F_part)
    b = tl.load(row + F_bi)
    h = tl.load(row + F_hi)
    s = tl.load(row + F_s)
    S = tl.load(row + F_S)
    kind = tl.load(row + F_lenkind)
    # The rest of the row now too, before the first branch on a field (one trip to L2), and the
    # merge's fields before the ticket's acquire (which would send them to L2 again).
    window = tl.load(row + F_window)
    ring = tl.load(row + F_ring)
    Hq = tl.load(row + F_N)
    hk = tl.load(row + F_tile)
    bits = tl.load(row + F_scale)
    ticket = tl.load(row + F_ticket)
    tickets = tl.load(row + F_tickets)
    out = tl.load(row + F_out)
    if KV_ALIGNED:
        Dh = _sixteens(Dh)
        kc = _sixteens(kc)
        vc = _sixteens(vc)
    if kind == 0:
        length = tl.load(dyn_ptr + B + b, cache_modifier=CG).to(tl.int64) + 1
    else:
        length = tl.load(dyn_ptr + 2 * B + b, cache_modifier=CG).to(tl.int64)
    # Keys [lo, length): lo > 0 with a sliding window. A ring cache holds position t in slot
    # t % Tmax (the window never exceeds the ring, so no two visible keys share a slot); a plain
    # cache never holds more than Tmax.
    if ring == 0:
        length = tl.minimum(length, Tmax)
    # A negative position or length (a state not yet written) reads no keys: the output is zeros.
    length = tl.maximum(length, 0)
    lo = tl.where(window > 0, tl.maximum(length - window, 0), 0)
    chunk = tl.cdiv(tl.cdiv(length - lo, S), BLOCK_T) * BLOCK_T
    start = tl.minimum(lo + s * chunk, length)
    end = tl.minimum(start + chunk, length)
    # Query head h of Hq reads K/V head hk (h // (Hq / H) with grouped-query attention): the
    # compiler writes both into the row rather than have every task divide.
    base = (b * H + hk) * Tmax * Dh
    scale = tl.where(bits == -1, 1.0 / tl.sqrt(Dh.to(tl.float32)), bits.to(tl.int32).to(tl.float32, bitcast=True))
    kv_ptr = s_ptr.to(tl.pointer_type(tl.bfloat16)) if KV_BF16 else s_ptr
    # Keys per step: BLOCK_T, fewer for a head so wide that the K / V tile would pass ATTN_TILE.
    BT: tl.constexpr = BLOCK_T if BLOCK_T * BLOCK_D <= ATTN_TILE else (
        ATTN_TILE // BLOCK_D if ATTN_TILE >= 2 * BLOCK_D else 2)
    # Key lanes of their own (no barrier a step) where the loads are vectors: the builds of scalar
    # loads would spill their accumulators (decode_partial's LANES).
    m, l, acc = decode_partial(s_ptr + q_off + b * stride + h * Dh, kv_ptr + kc + base, kv_ptr + vc + base,
                               start, end, Dh, scale, BT, BLOCK_D, CG, tl.where(ring != 0, Tmax, 0), KV_ALIGNED)
    bh = s_ptr + part + (b * Hq + h) * S * (Dh + 2)
    store_partial(bh + s * (Dh + 2), m, l, acc, Dh, BLOCK_D)
    if ticket >= 0:
        # The (b, h)'s ticket, as a signal and a wait in one: the barrier completes every thread's
        # partial stores, the acq_rel increment (one thread) releases them and acquires the other
        # partials released by earlier increments; the S - 1'th increment is the last partial's.
        tl.debug_barrier()
        drawn = tl.atomic_add(ctrl_ptr + ticket, 1, sem="acq_rel")
        # All threads read the other partials only after the acquire (as after a wait).
        tl.debug_barrier()
        if drawn == tickets - 1:
            # The merge reads the S partials in split order, whichever finished last: the same
            # bits every launch. Its stores are published by this task's signal.
            o = decode_merge(bh, S, Dh, BLOCK_S, BLOCK_D, CG)
            dd = tl.arange(0, BLOCK_D)
            tl.store(s_ptr + out + b * stride + h * Dh + dd, o, mask=dd < Dh)


@triton.jit
def _task_attn_merge(row, s_ptr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    """Merge the S partials of (b, h) into the attention output: a task of its own, for graphs that
    do not fuse it into the last partial (the compiler always does)."""
    stride = tl.load(row + F_K)
    out = tl.load(row + F_out)
    H = tl.load(row + F_H)
    Dh = tl.load(row + F_Dh)
    part = tl.load(row + F_part)
    b = tl.load(row + F_bi)
    h = tl.load(row + F_hi)
    S = tl.load(row + F_S)
    o = decode_merge(s_ptr + part + (b * H + h) * S * (Dh + 2), S, Dh, BLOCK_S, BLOCK_D, CG)
    dd = tl.arange(0, BLOCK_D)
    tl.store(s_ptr + out + b * stride + h * Dh + dd, o, mask=dd < Dh)


@triton.jit
def argmax_of_tiles(p, count, BLOCK_R: tl.constexpr):
    """(index, non-finite) of the largest of `count` (max, index) fp32 pairs at p, which linear
    tiles of this launch wrote (read past L1). Ties keep the lowest index (each tile reports its
    first maximal column; a later block must be strictly greater), like torch.argmax; all -inf
    gives the first pair's index. A NaN max (a tile with a NaN logit) sets `non-finite` (1) and
    the index is then the first pair's: always one of the tiles' columns, never past them."""
    best = tl.full([], float("-inf"), tl.float32)
    best_i = tl.full([], 0, tl.int32)
    first_i = tl.full([], 0, tl.int32)
    nan = tl.full([], 0, tl.int32)
    for t0 in range(0, count, BLOCK_R):
        tt = t0 + tl.arange(0, BLOCK_R)
        ok = tt < count
        v = tl.load(p + tt.to(tl.int64) * 2, mask=ok, other=float("-inf"), cache_modifier=CG)
        i = tl.load(p + tt.to(tl.int64) * 2 + 1, mask=ok, other=0.0, cache_modifier=CG).to(tl.int32)
        nan = tl.maximum(nan, tl.max(tl.where(ok & (v != v), 1, 0), axis=0))
        v = tl.where(v != v, float("-inf"), v)
        bmax = tl.max(v, axis=0)
        bi = tl.min(tl.where(ok & (v == bmax), i, 2147483647), axis=0)
        if t0 == 0:
            first_i = tl.min(tl.where(tt == 0, i, 2147483647), axis=0)
        better = (bmax > best) | (t0 == 0)
        best_i = tl.where(better, bi, best_i)
        best = tl.where(better, bmax, best)
    return tl.where(nan > 0, first_i, best_i), nan


@triton.jit
def _task_argmax(row, s_ptr, dyn_ptr, out_ptr, B, BLOCK_R: tl.constexpr):
    """Per row m < M: argmax over the (max, index) pairs of LM-style tiles [tile0, tile0 + S) (row
    stride `ntiles`), minus the column offset n0, stored as int32 at out[m * K + out_col]. With
    mode 1 ("advance") it also becomes the row's next token and the position steps by one."""
    M = tl.load(row + F_M)
    K = tl.load(row + F_K)
    n0 = tl.load(row + F_n0)
    advance = tl.load(row + F_mode)
    col = tl.load(row + F_out)
    tile0 = tl.load(row + F_tile)
    part = tl.load(row + F_part)
    ntiles = tl.load(row + F_ntiles)
    S = tl.load(row + F_S)
    for m in range(0, M):
        best_i, nan = argmax_of_tiles(s_ptr + part + (m * ntiles + tile0).to(tl.int64) * 2, S, BLOCK_R)
        best_i = best_i - n0.to(tl.int32)
        # A row with a NaN logit has no argmax: its result is NON_FINITE (-2: the host refuses the
        # row with that reason) and the token it feeds on is the first column's, which every
        # table holds: a NaN never becomes an address.
        tl.store(out_ptr + m * K + col, tl.where(nan > 0, -2, best_i))
        if advance != 0:
            # Every reader of this step's token/position is ordered before this task (checker-proven),
            # so the next step's values can be written in place: a replayed launch decodes onwards.
            # Positions advance on the device, so the range check is here: a row whose next position
            # would pass the caches (Tmax) keeps its position and reports token -1 (the host raises)
            # instead of a later launch writing and reading past its cache. A non-finite row stays
            # where it is too.
            nxt = tl.load(dyn_ptr + B + m, cache_modifier=CG) + 1
            full = nxt >= tl.load(row + F_Tmax)
            tl.store(out_ptr + m * K + col, tl.where(nan > 0, -2, tl.where(full, -1, best_i)))
            tl.store(dyn_ptr + m, best_i)
            tl.store(dyn_ptr + B + m, tl.where(full | (nan > 0), nxt - 1, nxt))


@triton.jit
def _task_rope_append(row, w_ptr, s_ptr, dyn_ptr, B, eps, BLOCK_D: tl.constexpr, KV_BF16: tl.constexpr = False):
    """(row b, head h) of a fused q|k|v row: optional per-head RMSNorm of q, k, v, then rotary on the
    first ROT features of q and k ("rotate half" pairs (i, i + ROT/2), as backends.reference.rotary;
    ROT = 0 rotates nothing) at the row's position + rotary offset, then q -> the q buffer, k and
    v -> the KV caches at the row's position (slot position % Tmax in a ring cache). The partner of each feature is gathered
    with a second (masked) load rather than a register permutation; both loads hit the same 256 bytes.
    Bytes: 3*Dh*4 in, 3*Dh*4 out, ROT*4 of cos/sin."""
    rot = tl.load(row + F_K)
    D = tl.load(row + F_N)
    x_off = tl.load(row + F_x)
    cos_off = tl.load(row + F_w)
    sin_off = tl.load(row + F_b)
    out = tl.load(row + F_out)
    kc = tl.load(row + F_kc)
    vc = tl.load(row + F_vc)
    H = tl.load(row + F_H)
    Dh = tl.load(row + F_Dh)
    Tmax = tl.load(row + F_Tmax)
    b = tl.load(row + F_bi)
    h = tl.load(row + F_hi)
    pos = tl.load(dyn_ptr + B + b, cache_modifier=CG).to(tl.int64)
    rpos = pos + tl.load(dyn_ptr + 3 * B + b, cache_modifier=CG).to(tl.int64)   # + rotary offset
    # A rotary position outside the tables (rows of them) reads row 0 and is reported; a position
    # outside the cache is not stored (below): no device value becomes an address unchecked.
    bad = tl.where((rot > 0) & ((rpos < 0) | (rpos >= tl.load(row + F_rows))), 1, 0)
    rpos = tl.where(bad > 0, 0, rpos)
    half = rot // 2
    dd = tl.arange(0, BLOCK_D)
    dmask = dd < Dh
    in_rot = dd < rot
    first = dd < half
    partner = tl.where(first, dd + half, dd - half)
    sign = tl.where(first, -1.0, 1.0)
    freq = tl.where(first, dd, dd - half)
    c = tl.load(w_ptr + tl.maximum(cos_off, 0) + rpos * half + freq, mask=in_rot, other=1.0).to(tl.float32)
    s = tl.load(w_ptr + tl.maximum(sin_off, 0) + rpos * half + freq, mask=in_rot, other=0.0).to(tl.float32)
    # The row is q (D = Hq*Dh) | k | v (H*Dh each). Query head h also carries K/V head h when h < H
    # (grouped-query attention has fewer K/V heads than query heads).
    # q_only (mode 1): the row is q alone and nothing is appended (Gemma 4's shared-KV layers).
    q_only = tl.load(row + F_mode) == 1
    row_q = s_ptr + x_off + b * tl.where(q_only, D, D + 2 * H * Dh)
    src = row_q + h * Dh
    kv = row_q + D + h * Dh
    has_kv = dmask & ((dd * 0 + h) < H) & ((dd * 0 + q_only.to(tl.int32)) == 0)   # vector masks: scalar & vector confuses the interpreter
    q = tl.load(src + dd, mask=dmask, other=0.0, cache_modifier=CG)
    qp = tl.load(src + partner, mask=dmask & in_rot, other=0.0, cache_modifier=CG)
    k = tl.load(kv + dd, mask=has_kv, other=0.0, cache_modifier=CG)
    kp = tl.load(kv + partner, mask=has_kv & in_rot, other=0.0, cache_modifier=CG)
    v = tl.load(kv + H * Dh + dd, mask=has_kv, other=0.0, cache_modifier=CG)
    # Per-head RMSNorm (Qwen3 / Gemma 4 q_norm, k_norm; v_norm has no scale) before rotary: one
    # statistic per head, applied to a feature and to the copy loaded as its rotary partner alike.
    # The stored scale already holds (offset + w) (folded at load time).
    norm = tl.load(row + F_norm)
    if (norm & 1) != 0:
        qw = w_ptr + tl.load(row + F_lnw)
        rq = 1.0 / tl.sqrt(tl.sum(q * q, axis=0) / Dh + eps)
        q = q * rq * tl.load(qw + dd, mask=dmask, other=0.0).to(tl.float32)
        qp = qp * rq * tl.load(qw + partner, mask=dmask & in_rot, other=0.0).to(tl.float32)
    if (norm & 2) != 0:
        kw = w_ptr + tl.load(row + F_lnb)
        rk = 1.0 / tl.sqrt(tl.sum(k * k, axis=0) / Dh + eps)
        k = k * rk * tl.load(kw + dd, mask=has_kv, other=0.0).to(tl.float32)
        kp = kp * rk * tl.load(kw + partner, mask=has_kv & in_rot, other=0.0).to(tl.float32)
    if (norm & 4) != 0:
        v = v / tl.sqrt(tl.sum(v * v, axis=0) / Dh + eps)
    tau = tl.load(row + F_tau)
    if tau >= 0:
        # Moondream 3's tau: q head h times t[h] + p_h, v head h times t[Hq + h] + p_h, with
        # p_h = sigmoid(alpha_h * log(position + 1)) + 0.5 (a feature and its partner alike).
        Hq = D // Dh
        p_h = tl.sigmoid(tl.load(w_ptr + tl.load(row + F_alpha) + h).to(tl.float32) * tl.log(pos.to(tl.float32) + 1.0)) + 0.5
        tq = tl.load(s_ptr + tau + b * 2 * Hq + h, cache_modifier=CG) + p_h
        q = q * tq
        qp = qp * tq
        tv = tl.load(s_ptr + tau + b * 2 * Hq + Hq + tl.minimum(h, H - 1), cache_modifier=CG) + p_h
        v = v * tv
    q = tl.where(in_rot, q * c + (sign * qp) * s, q)
    k = tl.where(in_rot, k * c + (sign * kp) * s, k)
    tl.store(s_ptr + out + b * D + h * Dh + dd, q, mask=dmask)
    ring = tl.load(row + F_ring)
    slot = tl.where(ring != 0, pos % Tmax, pos)
    cache = ((b * H + h) * Tmax + slot) * Dh + dd
    ok = has_kv & ((dd.to(tl.int64) * 0 + slot) < Tmax) & ((dd.to(tl.int64) * 0 + slot) >= 0)
    if KV_BF16:   # bf16 caches: stores round, offsets in bf16 elements
        kv_ptr = s_ptr.to(tl.pointer_type(tl.bfloat16))
        tl.store(kv_ptr + kc + cache, bf16_rne(k), mask=ok)
        tl.store(kv_ptr + vc + cache, bf16_rne(v), mask=ok)
    else:
        tl.store(s_ptr + kc + cache, k, mask=ok)
        tl.store(s_ptr + vc + cache, v, mask=ok)
    return bad


@triton.jit
def _task_conv_step(row, w_ptr, s_ptr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Channels [n0, n1) of a causal depthwise conv, one new input per row: xp = the state's W-1
    inputs (oldest first) then x; y = act(sum_j w[c, j] * xp[c, j]); the state becomes xp[1:]
    (kernels/conv.conv_decode_step, as the chained build runs it). The state is channel-major
    [B, C, W-1], so a tile's state is one contiguous span per row.
    Bytes: C_tile*W weights, M*C_tile*(2W-1) state and values."""
    M = tl.load(row + F_M)
    K = tl.load(row + F_K)
    C = tl.load(row + F_N)
    n0 = tl.load(row + F_n0)
    x_off = tl.load(row + F_x)
    w_off = tl.load(row + F_w)
    act = tl.load(row + F_act)
    out = tl.load(row + F_out)
    st = tl.load(row + F_kc)
    W = tl.load(row + F_Dh)
    n1 = tl.load(row + F_n1)
    c0 = tl.load(row + F_k0)
    cols = n0 + tl.arange(0, BLOCK_N)
    cmask = cols < n1
    jj = tl.arange(0, 8)[None, :]     # W <= 8 (stepgraph.conv_step)
    wt = tl.load(w_ptr + w_off + cols[:, None].to(tl.int64) * W + jj, mask=cmask[:, None] & (jj < W),
                 other=0.0).to(tl.float32)
    for m in range(0, M):
        sbase = s_ptr + st + (m * C + cols[:, None]).to(tl.int64) * (W - 1)
        x = tl.load(s_ptr + x_off + m * K + c0 + cols, mask=cmask, other=0.0, cache_modifier=CG)
        y = conv_decode_step(x, sbase, wt, jj, cmask, W, act, CG)
        tl.store(s_ptr + out + m * C + cols, y, mask=cmask)


@triton.jit
def _task_delta_step(row, w_ptr, s_ptr, eps, BLOCK_V: tl.constexpr):
    """(row b, value head h) of the gated delta rule, then rms_norm_gated(o, z):
    kernels/delta_rule.gated_delta_head (the per-op engine's chained build runs it too). A state
    slab is 1024 elements (8 per thread): the task shares the kernel's register budget with the
    linear tiles."""
    # Not max(): Triton 3.3 compiles max() in a kernel to tl.maximum, a tensor, not a constexpr.
    BLOCK_K: tl.constexpr = 1024 // BLOCK_V if BLOCK_V <= 1024 else 1
    K = tl.load(row + F_K)
    N = tl.load(row + F_N)
    x_off = tl.load(row + F_x)
    a_log = tl.load(row + F_w)
    dt_bias = tl.load(row + F_b)
    norm_w = tl.load(row + F_lnw)
    zba = tl.load(row + F_res)
    out = tl.load(row + F_out)
    st = tl.load(row + F_kc)
    Hk = tl.load(row + F_H)
    Dk = tl.load(row + F_Dh)
    Dv = tl.load(row + F_Tmax)
    Hv = tl.load(row + F_ntiles)
    b = tl.load(row + F_bi)
    h = tl.load(row + F_hi)
    c0 = tl.load(row + F_k0)
    j = h // (Hv // Hk)
    xr = s_ptr + x_off + b * K
    zr = s_ptr + zba + b * N + c0
    vv = tl.arange(0, BLOCK_V)
    nw = tl.load(w_ptr + norm_w + vv, mask=vv < Dv, other=0.0).to(tl.float32)
    y = gated_delta_head(xr + j * Dk, xr + (Hk + j) * Dk, xr + 2 * Hk * Dk + h * Dv, zr + h * Dv, zr + Hv * Dv + h,
                         zr + Hv * Dv + Hv + h, tl.load(w_ptr + a_log + h).to(tl.float32),
                         tl.load(w_ptr + dt_bias + h).to(tl.float32), nw,
                         s_ptr + st + (b * Hv + h).to(tl.int64) * Dk * Dv, Dk, Dv, eps, BLOCK_K, BLOCK_V, CG)
    tl.store(s_ptr + out + (b * Hv + h) * Dv + vv, y, mask=vv < Dv)


@triton.jit
def _task_add_norm(row, w_ptr, s_ptr, eps, BLOCK_K: tl.constexpr):
    """Row b: y = (x + rms_norm(z) * w) * scale (* scale weight), the norm over each `chunk`
    columns of z with the one [chunk] weight (Gemma 4: post-norm residuals, chunk = N; per-layer
    inputs, chunk = P). Two passes over z per chunk. Bytes: 4N*4 (x, z twice, y) + chunk*4."""
    N = tl.load(row + F_N)
    x = s_ptr + tl.load(row + F_x)
    z = s_ptr + tl.load(row + F_res)
    w = w_ptr + tl.load(row + F_lnw)
    out = s_ptr + tl.load(row + F_out)
    b = tl.load(row + F_bi)
    sw = tl.load(row + F_sw)
    chunk = tl.load(row + F_chunk)
    scale = _f32(tl.load(row + F_scale))
    if sw >= 0:
        scale = scale * tl.load(w_ptr + sw).to(tl.float32)
    kk = tl.arange(0, BLOCK_K)
    base = b * N
    for c0 in range(0, N, chunk):
        ss = tl.zeros((BLOCK_K,), tl.float32)
        for j in range(0, chunk, BLOCK_K):
            m = (j + kk) < chunk
            zv = tl.load(z + base + c0 + j + kk, mask=m, other=0.0, cache_modifier=CG)
            ss += zv * zv
        r = 1.0 / tl.sqrt(tl.sum(ss, axis=0) / chunk + eps)
        for j in range(0, chunk, BLOCK_K):
            m = (j + kk) < chunk
            zv = tl.load(z + base + c0 + j + kk, mask=m, other=0.0, cache_modifier=CG)
            xv = tl.load(x + base + c0 + j + kk, mask=m, other=0.0, cache_modifier=CG)
            wv = tl.load(w + j + kk, mask=m, other=0.0).to(tl.float32)
            tl.store(out + base + c0 + j + kk, (xv + zv * r * wv) * scale, mask=m)


@triton.jit
def _task_moe_route(row, s_ptr, BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr):
    """One row: the top S of its E router logits (descending; equal logits: lower expert first, as
    backends.reference.moe_route), stored as S (expert id, weight) pairs. Weights: softmax over the
    chosen logits (renormalised, mode 1) or over all E. S passes over the logits, E*4 bytes each."""
    E = tl.load(row + F_N)
    lg = s_ptr + tl.load(row + F_x)
    renorm = tl.load(row + F_mode)
    out = s_ptr + tl.load(row + F_out)
    S = tl.load(row + F_S)
    ss = tl.arange(0, BLOCK_S)
    chosen = tl.full((BLOCK_S,), float("-inf"), tl.float32)
    ids = tl.zeros((BLOCK_S,), tl.float32)
    prev_v = tl.full([], float("inf"), tl.float32)
    prev_i = tl.full([], -1, tl.int32)
    mx = tl.full([], float("-inf"), tl.float32)
    for s in range(0, S):
        best = tl.full([], float("-inf"), tl.float32)
        best_i = tl.full([], 2147483647, tl.int32)
        for e0 in range(0, E, BLOCK_R):
            ee = (e0 + tl.arange(0, BLOCK_R)).to(tl.int32)
            m = ee < E
            l = tl.load(lg + ee, mask=m, other=float("-inf"), cache_modifier=CG)
            if s == 0:
                mx = tl.maximum(mx, tl.max(l, axis=0))
            # the next in (logit descending, id ascending) order after the previous pick
            cand = m & ((l < prev_v) | ((l == prev_v) & (ee > prev_i)))
            lv = tl.where(cand, l, float("-inf"))
            bm = tl.max(lv, axis=0)
            bi = tl.min(tl.where(cand & (lv == bm), ee, 2147483647), axis=0)
            better = (bm > best) | ((bm == best) & (bi < best_i))
            best = tl.where(better, bm, best)
            best_i = tl.where(better, bi, best_i)
        # NaN logits match no candidate: expert 0 rather than an id past the table (the NaN then
        # shows in the output instead of a read out of bounds)
        best_i = tl.where(best_i < E, best_i, 0)
        chosen = tl.where(ss == s, best, chosen)
        ids = tl.where(ss == s, best_i.to(tl.float32), ids)
        prev_v = best
        prev_i = best_i
    total = tl.full([], 0.0, tl.float32)
    for e0 in range(0, E, BLOCK_R):
        ee = e0 + tl.arange(0, BLOCK_R)
        l = tl.load(lg + ee, mask=ee < E, other=float("-inf"), cache_modifier=CG)
        total += tl.sum(tl.exp(l - mx), axis=0)
    p = tl.exp(chosen - mx)            # -inf past S: weight 0
    w = tl.where(renorm != 0, p / tl.sum(p, axis=0), p / total)
    sm = ss < S
    tl.store(out + 2 * ss, ids, mask=sm)
    tl.store(out + 2 * ss + 1, w, mask=sm)


@triton.jit
def _moe_pair(route, j, B, S, BLOCK_M: tl.constexpr, BLOCK_S: tl.constexpr):
    """Pair j (= row * S + slot) of the batch's B*S routed (expert id, weight) pairs, seen against
    all of them: its expert e; `first`: no pair before j chose e (the pair whose tasks read e's
    weights for the whole batch); `rsel`: bitmask of the rows choosing e; `wsum`: [BLOCK_M] each
    row's summed weight over its slots choosing e (one slot, unless NaN logits made a row choose
    expert 0 in several). Reads the B*S*2 route floats (L2: every routing task wrote them)."""
    rows = tl.arange(0, BLOCK_M)
    ss = tl.arange(0, BLOCK_S)
    pair = rows[:, None] * S + ss[None, :]
    valid = (rows[:, None] < B) & (ss[None, :] < S)
    ids = tl.load(route + 2 * pair, mask=valid, other=-1.0, cache_modifier=CG)
    wts = tl.load(route + 2 * pair + 1, mask=valid, other=0.0, cache_modifier=CG)
    e = tl.load(route + 2 * j, cache_modifier=CG)
    match = valid & (ids == e)
    earlier = tl.sum(tl.sum((match & (pair < j)).to(tl.int32), axis=1), axis=0)
    chose = tl.max(match.to(tl.int32), axis=1) > 0
    rsel = tl.sum(tl.where(chose, 1 << rows, 0), axis=0)
    wsum = tl.sum(tl.where(match, wts, 0.0), axis=1)
    return e.to(tl.int64), earlier == 0, rsel, wsum


@triton.jit
def _task_moe_up(row, w_ptr, s_ptr, B, ln_eps, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, BLOCK_S: tl.constexpr, FP8: tl.constexpr = False, LOOP: tl.constexpr = 0):
    """(pair j = (row, slot), columns [n0, n1) of F). e = pair j's expert. Only the FIRST pair of
    the batch choosing e computes (the others record 0 loads and exit): for every row r choosing
    e at once, h[j, r] = act(x_r G_e) * (x_r U_e + offset), G_e, U_e = rows e*2F + [n0, n1) and
    e*2F + F + [n0, n1) of the [E*2F, D] gate|up table (each row's LayerNorm fused in), one
    [BLOCK_M, BLOCK_N] product per K step (rows not choosing e masked: their x is not loaded).
    Bytes: 2*(n1-n0)*D weights of e ONCE however many rows chose it (+ 2*(n1-n0) fp32 scales for
    FP8) + D x per choosing row; h is [B*S, B, F] (slab j, row r). The weight elements loaded go
    to this task's cell of the loads record (the host's count of expert bytes a step read)."""
    # LOOP: the experts' K loop (expert_loop, on the host). Alignment said in arithmetic (_sixteens)
    # for FP8 experts, and for 16-bit ones in wide steps (their loads were 2 bytes and the build
    # spilled: Triton 3.9, 32 B); elsewhere as it was.
    XALIGN: tl.constexpr = True if FP8 else LOOP > 0
    D = tl.load(row + F_K)
    F = tl.load(row + F_N)
    n0 = tl.load(row + F_n0)
    act = tl.load(row + F_act)
    out = tl.load(row + F_out)
    j = tl.load(row + F_tile)
    route = s_ptr + tl.load(row + F_part)
    S = tl.load(row + F_S)
    n1 = tl.load(row + F_n1)
    ldw = tl.load(row + F_ldw)
    if XALIGN:
        ldw = _sixteens(ldw)      # the expert's shift e * rows * ldw then known aligned
    loads = s_ptr + tl.load(row + F_loads)
    e, first, rsel, _ = _moe_pair(route, j, B, S, BLOCK_M, BLOCK_S)
    if first:
        base = e * 2 * F * ldw
        cols = n0 + tl.arange(0, BLOCK_N)
        rows = tl.arange(0, BLOCK_M)
        wsc = tl.load(row + F_wsc)   # FP8 experts: fp32 row scales [E, 2F] at wsc
        # gate then up rows, in a loop so the product is compiled once (each inlined copy of the
        # linear tile costs compile time and code size in the one megakernel)
        g = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        u = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for half in range(0, 2):
            acc = _linear_acc(row, w_ptr, s_ptr, ln_eps, BLOCK_M, BLOCK_N, BLOCK_K, base + half * F * ldw, 0, FP8,
                              rsel, LOOP=LOOP, EXPERT=XALIGN)
            if FP8:   # the epilogue of an FP8 product: each output row's scale, once
                sc = tl.load(w_ptr.to(tl.pointer_type(tl.float32)) + wsc + e * 2 * F + half * F + cols,
                             mask=cols < n1, other=0.0)
                acc = acc * (sc * FP8_UNSCALE)[None, :]
            g = tl.where(half == 0, acc, g)
            u = tl.where(half == 1, acc, u)
        h = apply_activation(g, act) * (u + _f32(tl.load(row + F_scale)))
        chosen = ((rsel >> rows) & 1) != 0
        tl.store(s_ptr + out + rows[:, None].to(tl.int64) * F + cols[None, :], h,
                 mask=chosen[:, None] & (cols < n1)[None, :])
        tl.store(loads, (2 * (n1 - n0) * D).to(tl.float32))
    else:
        tl.store(loads, 0.0)


@triton.jit
def _task_moe_down(row, w_ptr, s_ptr, B, ln_eps, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, BLOCK_S: tl.constexpr, FP8: tl.constexpr = False, LOOP: tl.constexpr = 0):
    """(pair j, columns [n0, n1) of D). As the up task, only the first pair of the batch choosing
    expert e computes: for every row r choosing e, part[r, j] = wsum_r * (h[j, r] D_e^T), D_e =
    rows e*D + [n0, n1) of the [E*D, F] down table, wsum_r the row's routing weight of e; part is
    [B, B*S, D] (row r, pair j). Bytes: (n1-n0)*F weights of e ONCE (+ (n1-n0) fp32 scales for
    FP8) + F hidden per choosing row. A sum task per (row, tile) adds the row's partials."""
    XALIGN: tl.constexpr = True if FP8 else LOOP > 0   # as _task_moe_up's
    F = tl.load(row + F_K)
    D = tl.load(row + F_N)
    out = tl.load(row + F_out)
    j = tl.load(row + F_tile)
    route = s_ptr + tl.load(row + F_part)
    S = tl.load(row + F_S)
    n1 = tl.load(row + F_n1)
    ldw = tl.load(row + F_ldw)
    if XALIGN:
        ldw = _sixteens(ldw)      # the expert's shift e * rows * ldw then known aligned
    loads = s_ptr + tl.load(row + F_loads)
    e, first, rsel, wsum = _moe_pair(route, j, B, S, BLOCK_M, BLOCK_S)
    if first:
        n0 = tl.load(row + F_n0)
        cols = n0 + tl.arange(0, BLOCK_N)
        cmask = cols < n1
        rows = tl.arange(0, BLOCK_M)
        wsc = tl.load(row + F_wsc)   # FP8 experts: fp32 row scales [E, D] at wsc
        part = _linear_acc(row, w_ptr, s_ptr, ln_eps, BLOCK_M, BLOCK_N, BLOCK_K, e * D * ldw, 0, FP8, rsel,
                           LOOP=LOOP, EXPERT=XALIGN)
        if FP8:
            sc = tl.load(w_ptr.to(tl.pointer_type(tl.float32)) + wsc + e * D + cols, mask=cmask, other=0.0)
            part = part * (sc * FP8_UNSCALE)[None, :]
        chosen = ((rsel >> rows) & 1) != 0
        tl.store(s_ptr + out + rows[:, None].to(tl.int64) * (B * S * D) + cols[None, :], wsum[:, None] * part,
                 mask=chosen[:, None] & cmask[None, :])
        tl.store(loads, ((n1 - n0) * F).to(tl.float32))
    else:
        tl.store(loads, 0.0)


@triton.jit
def _moe_span(row, s_ptr, B, BLOCK_M: tl.constexpr, BLOCK_S: tl.constexpr, XALIGN: tl.constexpr):
    """An expert task of several tiles: its K, N, columns [n0, n1), the expert's row stride (XALIGN:
    said aligned in arithmetic, as the one-tile tasks say it), S slots, and its pair seen against
    the batch's routing (_moe_pair: expert, first, rows choosing it, their weights). The one-tile
    tasks keep their own field loads, in their own order: their builds' registers stay as measured."""
    K = tl.load(row + F_K)
    N = tl.load(row + F_N)
    n0 = tl.load(row + F_n0)
    n1 = tl.load(row + F_n1)
    S = tl.load(row + F_S)
    ldw = tl.load(row + F_ldw)
    if XALIGN:
        ldw = _sixteens(ldw)      # the expert's shift e * rows * ldw then known aligned
    e, first, rsel, wsum = _moe_pair(s_ptr + tl.load(row + F_part), tl.load(row + F_tile), B, S, BLOCK_M, BLOCK_S)
    return K, N, n0, n1, ldw, S, e, first, rsel, wsum


@triton.jit
def _task_moe_up_tiles(row, w_ptr, s_ptr, B, ln_eps, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, BLOCK_S: tl.constexpr, FP8: tl.constexpr = False,
                       LOOP: tl.constexpr = 0):
    """_task_moe_up over a span of columns [n0, n1) of any width (Tiling.expert_span > 1: XTILES),
    one BLOCK_N tile after another, gate rows then up rows of each, in one loop: the task's claim,
    header, waits and routing read are paid once for all of its tiles (the cost model's expert
    tasks spent about half their time on them). Bytes as _task_moe_up's over the whole span."""
    XALIGN: tl.constexpr = True if FP8 else LOOP > 0   # as _task_moe_up's
    D, F, n0, n1, ldw, _, e, first, rsel, _ = _moe_span(row, s_ptr, B, BLOCK_M, BLOCK_S, XALIGN)
    if first:
        rows = tl.arange(0, BLOCK_M)
        # The rows' norm statistics are read once, before the loop, and the epilogue's fields
        # after each product, not held across its K loop (which takes every register): held, or
        # the statistics read by each product, they spilled more of the kernel (Triton 3.9, sm_90).
        # Only the gate product is carried to its tile's up product.
        rmask = (rows < tl.load(row + F_M)) & (((rsel >> rows) & 1) != 0)
        mean, rstd = _norm_stats(s_ptr, tl.load(row + F_lnw), tl.load(row + F_lnst), tl.load(row + F_norm),
                                 s_ptr + tl.load(row + F_x) + rows[:, None].to(tl.int64) * D, rmask, D, ln_eps,
                                 BLOCK_M, BLOCK_K)
        g = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for it in range(0, 2 * tl.cdiv(n1 - n0, BLOCK_N)):
            half = it % 2
            c = it // 2 * BLOCK_N
            acc = _linear_acc(row, w_ptr, s_ptr, ln_eps, BLOCK_M, BLOCK_N, BLOCK_K, e * 2 * F * ldw + half * F * ldw,
                              0, FP8, rsel, LOOP=LOOP, EXPERT=XALIGN, n_shift=c, mean_in=mean, rstd_in=rstd,
                              STATS=True)
            cols = n0 + c + tl.arange(0, BLOCK_N)
            if FP8:   # each output row's scale (fp32 [E, 2F] at wsc), once a tile
                sc = tl.load(w_ptr.to(tl.pointer_type(tl.float32)) + tl.load(row + F_wsc) + e * 2 * F + half * F
                             + cols, mask=cols < n1, other=0.0)
                acc = acc * (sc * FP8_UNSCALE)[None, :]
            if half == 1:
                h = apply_activation(g, tl.load(row + F_act)) * (acc + _f32(tl.load(row + F_scale)))
                chosen = ((rsel >> rows) & 1) != 0
                tl.store(s_ptr + tl.load(row + F_out) + rows[:, None].to(tl.int64) * F + cols[None, :], h,
                         mask=chosen[:, None] & (cols < n1)[None, :])
            g = acc
    tl.store(s_ptr + tl.load(row + F_loads), tl.where(first, 2 * (n1 - n0) * D, 0).to(tl.float32))


@triton.jit
def _task_moe_down_tiles(row, w_ptr, s_ptr, B, ln_eps, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, BLOCK_S: tl.constexpr, FP8: tl.constexpr = False,
                         LOOP: tl.constexpr = 0):
    """_task_moe_down over a span of columns [n0, n1) of any width, one BLOCK_N tile after another
    (as _task_moe_up_tiles)."""
    XALIGN: tl.constexpr = True if FP8 else LOOP > 0   # as _task_moe_up's
    F, D, n0, n1, ldw, S, e, first, rsel, wsum = _moe_span(row, s_ptr, B, BLOCK_M, BLOCK_S, XALIGN)
    if first:
        rows = tl.arange(0, BLOCK_M)
        for c in range(0, n1 - n0, BLOCK_N):
            part = _linear_acc(row, w_ptr, s_ptr, ln_eps, BLOCK_M, BLOCK_N, BLOCK_K, e * D * ldw, 0, FP8, rsel,
                               LOOP=LOOP, EXPERT=XALIGN, n_shift=c)
            # the epilogue's fields read here, not held across the K loop (see _task_moe_up_tiles)
            cols = n0 + c + tl.arange(0, BLOCK_N)
            cmask = cols < n1
            if FP8:   # FP8 experts: fp32 row scales [E, D] at wsc
                sc = tl.load(w_ptr.to(tl.pointer_type(tl.float32)) + tl.load(row + F_wsc) + e * D + cols, mask=cmask,
                             other=0.0)
                part = part * (sc * FP8_UNSCALE)[None, :]
            chosen = ((rsel >> rows) & 1) != 0
            tl.store(s_ptr + tl.load(row + F_out) + rows[:, None].to(tl.int64) * (B * S * D) + cols[None, :],
                     wsum[:, None] * part, mask=chosen[:, None] & cmask[None, :])
    tl.store(s_ptr + tl.load(row + F_loads), tl.where(first, (n1 - n0) * F, 0).to(tl.float32))


@triton.jit
def _task_moe_sum(row, w_ptr, s_ptr, dyn_ptr, B, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_S: tl.constexpr):
    """(row r, columns [n0, n1) of D): the sum over r's slots, in slot order, of the partial its
    slot's expert wrote for it (at pair j = the batch's first choosing that expert; a slot
    repeating an earlier slot's expert adds nothing: that partial holds both weights), then the
    linear epilogue (+ residual). A fixed order and no atomics: the same bits every launch.
    Bytes: S*(n1-n0) partials + the residual tile."""
    D = tl.load(row + F_N)
    n0 = tl.load(row + F_n0)
    r = tl.load(row + F_bi)
    route = s_ptr + tl.load(row + F_part)
    part = s_ptr + tl.load(row + F_kpart)
    S = tl.load(row + F_S)
    n1 = tl.load(row + F_n1)
    rows = tl.arange(0, BLOCK_M)
    ss = tl.arange(0, BLOCK_S)
    pair = rows[:, None] * S + ss[None, :]
    ids = tl.load(route + 2 * pair, mask=(rows[:, None] < B) & (ss[None, :] < S), other=-1.0, cache_modifier=CG)
    cols = n0 + tl.arange(0, BLOCK_N)
    cmask = cols < n1
    acc = tl.zeros((BLOCK_N,), tl.float32)
    for s in range(0, S):
        e = tl.load(route + 2 * (r * S + s), cache_modifier=CG)
        match = ids == e
        jf = tl.min(tl.min(tl.where(match, pair, 2147483647), axis=1), axis=0)
        again = tl.sum(tl.sum((match & (pair >= r * S) & (pair < r * S + s)).to(tl.int32), axis=1), axis=0)
        # a vector mask: scalar & vector confuses the interpreter
        p = tl.load(part + (r * B * S + jf).to(tl.int64) * D + cols, mask=cmask & ((cols * 0 + again) == 0),
                    other=0.0, cache_modifier=CG)
        acc += p
    _linear_epilogue(row, acc[None, :] + tl.zeros((BLOCK_M, BLOCK_N), tl.float32), w_ptr, s_ptr, dyn_ptr, B,
                     BLOCK_M, BLOCK_N)


@triton.jit
def _step_tasks(op, row, w_ptr, s_ptr, ctrl_ptr, dyn_ptr, out_ptr, B, ln_eps, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
                BLOCK_S: tl.constexpr, BLOCK_R: tl.constexpr, KV_BF16: tl.constexpr, FP8: tl.constexpr,
                LOOP: tl.constexpr, XLOOP: tl.constexpr = 0):
    """The task table of every compiled decode step (compiler.py emits only these ops): runs task
    `op`; 0 for an unknown op (the host raises). KV_BF16 (caches in bf16) and FP8 (FP8 experts)
    pick the variant at compile time: the one megakernel is at the edge of the register file, and
    a run-time choice between variants would hold both and spill (ptxas -v). Returns 0, or the
    task's failure (graph.ERR_OP, ERR_RANGE). LOOP: the dense linear tasks' K loop, + KV16 where
    the caches are aligned, + LTILES where the linear tasks span several tiles; XLOOP: the expert tasks' (expert_loop, chosen on the host), + XTILES
    where they span several tiles."""
    XTILED: tl.constexpr = XLOOP // 33554432 % 2
    XK: tl.constexpr = XLOOP % 33554432
    KVA: tl.constexpr = LOOP // 33554432 % 2
    LT: tl.constexpr = LOOP // 67108864 % 2
    LK: tl.constexpr = LOOP % 33554432
    MERGE: tl.constexpr = LOOP // 16777216 % 2    # an aligned build: statistics merged from the tiles' partials
    status = tl.full([], 0, tl.int32)
    if op == OP_LINEAR:
        _task_linear(row, w_ptr, s_ptr, dyn_ptr, B, ln_eps, BLOCK_M, BLOCK_N, BLOCK_K, KV_BF16, LK, LT)
    elif op == OP_ATTN_PARTIAL:
        _task_attn_partial(row, s_ptr, ctrl_ptr, dyn_ptr, B, BLOCK_T, BLOCK_D, BLOCK_S, KV_BF16, KVA)
    elif op == OP_ATTN_MERGE:
        _task_attn_merge(row, s_ptr, BLOCK_S, BLOCK_D)
    elif op == OP_EMBED:
        status = (_task_embed(row, w_ptr, s_ptr, dyn_ptr, B, BLOCK_M, BLOCK_N) * ERR_RANGE).to(tl.int32)
    elif op == OP_ARGMAX:
        _task_argmax(row, s_ptr, dyn_ptr, out_ptr, B, BLOCK_R)
    elif op == OP_ROPE_APPEND:
        pass   # below, where finale rows run it too: one inlined copy (the kernel is at the edge of the register file)
    elif op == OP_LINEAR_SPLIT:
        _task_linear_split(row, w_ptr, s_ptr, ctrl_ptr, dyn_ptr, B, ln_eps, BLOCK_M, BLOCK_N, BLOCK_K, KV_BF16, LK)
    elif op == OP_CONV_STEP:
        _task_conv_step(row, w_ptr, s_ptr, BLOCK_M, BLOCK_N)
    elif op == OP_DELTA_STEP:
        _task_delta_step(row, w_ptr, s_ptr, ln_eps, BLOCK_D)
    elif op == OP_ADD_NORM:
        _task_add_norm(row, w_ptr, s_ptr, ln_eps, BLOCK_K)
    elif op == OP_MOE_ROUTE:
        _task_moe_route(row, s_ptr, BLOCK_R, BLOCK_S)
    elif op == OP_MOE_UP:
        if XTILED:   # tasks of several column tiles (a build of a table that has them)
            _task_moe_up_tiles(row, w_ptr, s_ptr, B, ln_eps, BLOCK_M, BLOCK_N, BLOCK_K, BLOCK_S, FP8, XK)
        else:
            _task_moe_up(row, w_ptr, s_ptr, B, ln_eps, BLOCK_M, BLOCK_N, BLOCK_K, BLOCK_S, FP8, XK)
    elif op == OP_MOE_DOWN:
        if XTILED:
            _task_moe_down_tiles(row, w_ptr, s_ptr, B, ln_eps, BLOCK_M, BLOCK_N, BLOCK_K, BLOCK_S, FP8, XK)
        else:
            _task_moe_down(row, w_ptr, s_ptr, B, ln_eps, BLOCK_M, BLOCK_N, BLOCK_K, BLOCK_S, FP8, XK)
    elif op == OP_MOE_SUM:
        _task_moe_sum(row, w_ptr, s_ptr, dyn_ptr, B, BLOCK_M, BLOCK_N, BLOCK_S)
    else:
        status = tl.full([], ERR_OP, tl.int32)
    stout = tl.load(row + F_stout)
    fin = tl.load(row + F_fin)
    # The append rows to run: this task's own (op 6), or the finale rows of a q|k|v tile that
    # drew its heads' last ticket.
    arow = row
    napp = tl.where(op == OP_ROPE_APPEND, 1, 0).to(tl.int64)
    if (stout >= 0) | (fin >= 0):
        # A task of a stage whose output feeds a fused norm, or of the q|k|v tiles of a group of
        # heads: a ticket as the attention partial's, and the last task of the group to finish
        # computes the rows' statistics, or runs the heads' append rows (finale rows `fin`
        # elements from this row), before it signals. The readers wait for the whole group, so
        # neither costs a level. (The fields before the acquire, which would send them to L2 again.)
        ticket = tl.load(row + F_ticket)
        tickets = tl.load(row + F_tickets)
        nfin = tl.load(row + F_nfin)
        tl.debug_barrier()
        drawn = tl.atomic_add(ctrl_ptr + ticket, 1, sem="acq_rel")
        tl.debug_barrier()
        if drawn == tickets - 1:
            if stout >= 0:
                _task_row_stats(row, s_ptr, B, ln_eps, BLOCK_M, BLOCK_K, MERGE)
            else:
                arow = row + fin
                napp = nfin
    for j in range(0, napp):
        if _task_rope_append(arow + j * NF_ROW, w_ptr, s_ptr, dyn_ptr, B, ln_eps, BLOCK_D, KV_BF16) != 0:
            status = tl.full([], ERR_RANGE, tl.int32)
    return status


@triton.jit
def step_tasks(op, row, w_ptr, s_ptr, ctrl_ptr, dyn_ptr, out_ptr, B, ln_eps, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
               BLOCK_S: tl.constexpr, BLOCK_R: tl.constexpr, LOOP: tl.constexpr = 0,
               XLOOP: tl.constexpr = 0):
    """fp32 KV caches, float experts (step_tasks_for picks the variant of a plan)."""
    return _step_tasks(op, row, w_ptr, s_ptr, ctrl_ptr, dyn_ptr, out_ptr, B, ln_eps, BLOCK_M, BLOCK_N, BLOCK_K, BLOCK_T,
                       BLOCK_D, BLOCK_S, BLOCK_R, False, False, LOOP, XLOOP)


@triton.jit
def step_tasks_bf16_kv(op, row, w_ptr, s_ptr, ctrl_ptr, dyn_ptr, out_ptr, B, ln_eps, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
                       BLOCK_S: tl.constexpr, BLOCK_R: tl.constexpr, LOOP: tl.constexpr = 0,
                       XLOOP: tl.constexpr = 0):
    """bf16 KV caches, float experts."""
    return _step_tasks(op, row, w_ptr, s_ptr, ctrl_ptr, dyn_ptr, out_ptr, B, ln_eps, BLOCK_M, BLOCK_N, BLOCK_K, BLOCK_T,
                       BLOCK_D, BLOCK_S, BLOCK_R, True, False, LOOP, XLOOP)


@triton.jit
def step_tasks_fp8(op, row, w_ptr, s_ptr, ctrl_ptr, dyn_ptr, out_ptr, B, ln_eps, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
                   BLOCK_S: tl.constexpr, BLOCK_R: tl.constexpr, LOOP: tl.constexpr = 0,
                   XLOOP: tl.constexpr = 0):
    """fp32 KV caches, FP8 experts."""
    return _step_tasks(op, row, w_ptr, s_ptr, ctrl_ptr, dyn_ptr, out_ptr, B, ln_eps, BLOCK_M, BLOCK_N, BLOCK_K, BLOCK_T,
                       BLOCK_D, BLOCK_S, BLOCK_R, False, True, LOOP, XLOOP)


@triton.jit
def step_tasks_bf16_kv_fp8(op, row, w_ptr, s_ptr, ctrl_ptr, dyn_ptr, out_ptr, B, ln_eps, BLOCK_M: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_T: tl.constexpr,
                           BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_R: tl.constexpr,
                           LOOP: tl.constexpr = 0, XLOOP: tl.constexpr = 0):
    """bf16 KV caches, FP8 experts (Moondream 3 on a GPU)."""
    return _step_tasks(op, row, w_ptr, s_ptr, ctrl_ptr, dyn_ptr, out_ptr, B, ln_eps, BLOCK_M, BLOCK_N, BLOCK_K, BLOCK_T,
                       BLOCK_D, BLOCK_S, BLOCK_R, True, True, LOOP, XLOOP)


def step_tasks_for(kv_bf16: bool, fp8: bool):
    """The task table compiled for a step's KV dtype and expert format."""
    return {(False, False): step_tasks, (True, False): step_tasks_bf16_kv, (False, True): step_tasks_fp8,
            (True, True): step_tasks_bf16_kv_fp8}[(kv_bf16, fp8)]


@triton.jit
def _now(clock_ptr, GPU_CLOCK: tl.constexpr):
    """A trace timestamp: the GPU's global nanosecond timer, or under the interpreter (no inline
    assembly there) a logical clock, one tick per reading, which orders events as they happened."""
    if GPU_CLOCK:
        t = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False,
                                      pack=1)
    else:
        t = tl.atomic_add(clock_ptr, 1)
    return t


@triton.jit
def _sm_id(GPU_CLOCK: tl.constexpr):
    """The SM running this program (-1 under the interpreter)."""
    if GPU_CLOCK:
        sm = tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=tl.int32, is_pure=True, pack=1)
    else:
        sm = tl.full([], -1, tl.int32)
    return sm


@triton.jit
def _prefetch_weights(row, w_ptr, BLOCK_N: tl.constexpr, PREFETCH: tl.constexpr):
    """Start moving a linear task's weight tile, rows [n0, n1) x K range [k0, k1), from HBM into L2
    before the task waits on its inputs: weights never depend on activations, so the task's first
    K steps find them in L2 instead of paying a miss each, and the SM's few loads in flight no
    longer bound the stream. PREFETCH 2 (sm_90): one bulk prefetch per row (cp.async.bulk.prefetch.L2,
    the copy engine walks the row); 1 (sm_80 / sm_87): prefetch.global.L2 per 128-byte line, 32
    lines of each row per trip. Nothing waits for them: a prefetch that has not landed only costs
    the miss the load would have paid anyway."""
    ELT: tl.constexpr = w_ptr.dtype.element_ty.primitive_bitwidth // 8
    n0 = tl.load(row + F_n0)
    n1 = tl.load(row + F_n1)
    k0 = tl.load(row + F_k0)
    k1 = tl.load(row + F_k1)
    ldw = tl.load(row + F_ldw)
    w_off = tl.load(row + F_w)
    cols = n0 + tl.arange(0, BLOCK_N)
    cols = tl.where(cols < n1, cols, n0)   # rows past the tile repeat its first (no mask on asm)
    first = w_ptr + w_off + cols.to(tl.int64) * ldw + k0
    nbytes = ((k1 - k0 + 15) // 16 * 16) * ELT   # the row's K slice, padded as the arena pads it
    if PREFETCH == 2:
        tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], $2;\n\tmov.u32 $0, 0;", "=r,l,r",
                                  [first.to(tl.int64, bitcast=True), nbytes + cols * 0], dtype=tl.int32,
                                  is_pure=False, pack=1)
    else:
        lines = tl.arange(0, 32)
        for c0 in range(0, nbytes, 32 * 128):
            at = first.to(tl.pointer_type(tl.int8))[:, None] + (c0 + lines * 128)[None, :]
            at = tl.where((c0 + lines * 128)[None, :] < nbytes, at, first.to(tl.pointer_type(tl.int8))[:, None])
            tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l",
                                      [at.to(tl.int64, bitcast=True)], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _header(row, live):
    """A task's header (op, two waits, signal) as independent loads, one round trip; where `live`
    is false (past the last task) it reads as no task: op 0, no waits, no signal."""
    return (tl.load(row + F_op, mask=live, other=0), tl.load(row + F_w0, mask=live, other=-1),
            tl.load(row + F_t0, mask=live, other=0), tl.load(row + F_w1, mask=live, other=-1),
            tl.load(row + F_t1, mask=live, other=0), tl.load(row + F_sig, mask=live, other=-1))


@triton.jit
def _megakernel(tasks_ptr, num_tasks, ctrl_ptr, dyn_ptr, w_ptr, s_ptr, out_ptr, B, ln_eps, spin_limit, trace_ptr,
                NF: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
                BLOCK_R: tl.constexpr, RUN_TASK: tl.constexpr, TRACE: tl.constexpr = 0,
                PREFETCH: tl.constexpr = 0, LOOP: tl.constexpr = 0, STATIC: tl.constexpr = 0,
                XLOOP: tl.constexpr = 0):
    """Claim, wait, run (RUN_TASK: the task table, resolved at compile time), release.

    The claim is a relaxed atomic: it only hands out indices, and every ordering a task needs comes
    from its acquire waits and its producers' release signals (an acq_rel claim would add a fence
    per task on the dependency chain). The header (op, two waits, signal) is read in one group of
    independent loads before any branch on it: one round trip to L2 instead of one per branch (the
    acquire polls invalidate L1, so a field read after a wait goes to L2 again).

    A failing task raises the error flag to graph.error_code(num_tasks, task, kind) (atomic max:
    the lowest failing task, the root of a cascade, wins). TRACE (1: GPU timer, 2: the
    interpreter's logical clock; 0 compiles it out) writes each task's row of the trace buffer
    (timeline.TRACE_COLUMNS): program, SM, claimed, waited, ran, released, status. PREFETCH: see
    _prefetch_weights (0: none). LOOP: how a dense linear task's K loop is built (KernelVariant.loop);
    XLOOP: an expert task's (expert_loop).

    STATIC (KernelVariant.static): no claims; program p runs tasks p, p + P, p + 2P, ... (P
    programs), and the next one's header is loaded while this one waits and runs, so neither the
    claim's round trip nor the header's sits before a task's waits. Tasks stay in topological
    order, so by induction on the index every task's producers finish, provided all P programs are
    resident at once (the launch keeps to residency; a program held off the GPU by other work
    holds its tasks up until it starts, where a claimed schedule would hand them to others). Each
    program adds the tasks it ran to the claim counter as it leaves (raise_for's count)."""
    GPU_CLOCK: tl.constexpr = TRACE == 1
    if STATIC:
        t = tl.program_id(0)
        ran_here = 0
        h_op, h_c0, h_t0, h_c1, h_t1, h_sig = _header(tasks_ptr + t.to(tl.int64) * NF, t < num_tasks)
    else:
        t = tl.atomic_add(ctrl_ptr, 1, sem="relaxed")
    while t < num_tasks:
        if TRACE:
            claimed = _now(trace_ptr + num_tasks * TW, GPU_CLOCK)
        row = tasks_ptr + t.to(tl.int64) * NF
        if STATIC:
            op, c0, t0, c1, t1, sig = h_op, h_c0, h_t0, h_c1, h_t1, h_sig
            h_op, h_c0, h_t0, h_c1, h_t1, h_sig = _header(row + tl.num_programs(0).to(tl.int64) * NF,
                                                          t + tl.num_programs(0) < num_tasks)
        else:
            op = tl.load(row + F_op)
            c0 = tl.load(row + F_w0)
            t0 = tl.load(row + F_t0)
            c1 = tl.load(row + F_w1)
            t1 = tl.load(row + F_t1)
            sig = tl.load(row + F_sig)
        if PREFETCH > 0:
            if (op == OP_LINEAR) | (op == OP_LINEAR_SPLIT):
                _prefetch_weights(row, w_ptr, BLOCK_N, PREFETCH)
        ok = tl.full([], 1, tl.int32)
        if c0 >= 0:
            ok = _wait(ctrl_ptr + 2 + c0, t0, spin_limit).to(tl.int32)
        if c1 >= 0:
            ok = ok * _wait(ctrl_ptr + 2 + c1, t1, spin_limit).to(tl.int32)
        # All threads must see the producers' data before any of them reads it.
        tl.debug_barrier()
        if TRACE:
            waited = _now(trace_ptr + num_tasks * TW, GPU_CLOCK)
        status = tl.full([], 0, tl.int32)
        if ok == 0:
            status = tl.full([], ERR_WAIT, tl.int32)
        else:
            status = RUN_TASK(op, row, w_ptr, s_ptr, ctrl_ptr, dyn_ptr, out_ptr, B, ln_eps, BLOCK_M, BLOCK_N,
                              BLOCK_K, BLOCK_T, BLOCK_D, BLOCK_S, BLOCK_R, LOOP, XLOOP).to(tl.int32)
        if status != 0:
            tl.atomic_max(ctrl_ptr + 1, (num_tasks - t) * 4 + status)
        # Every thread's stores must be done before the release that publishes them.
        tl.debug_barrier()
        if TRACE:
            ran = _now(trace_ptr + num_tasks * TW, GPU_CLOCK)
        if sig >= 0:
            tl.atomic_add(ctrl_ptr + 2 + sig, 1, sem="release")
        if TRACE:
            tr = trace_ptr + t.to(tl.int64) * TW
            tl.store(tr, tl.program_id(0).to(tl.int64))
            tl.store(tr + 1, _sm_id(GPU_CLOCK).to(tl.int64))
            tl.store(tr + 2, claimed)
            tl.store(tr + 3, waited)
            tl.store(tr + 4, ran)
            tl.store(tr + 5, _now(trace_ptr + num_tasks * TW, GPU_CLOCK))
            tl.store(tr + 6, status.to(tl.int64))
        if STATIC:
            t += tl.num_programs(0)
            ran_here += 1
        else:
            t = tl.atomic_add(ctrl_ptr, 1, sem="relaxed")
    if STATIC:
        tl.atomic_add(ctrl_ptr, ran_here, sem="relaxed")


def resident_programs(device: torch.device, num_tasks: int, programs_per_sm: int) -> int:
    """How many programs to launch: no more than can be resident at once. (Tasks are claimed when a
    program starts running, so a program that is not yet resident holds no task and cannot block
    anyone; staying within residency keeps every claimed task on an SM all the same.) Under the
    pinned Triton, compiled for sm_90, the kernel needs <= 255 registers x 128 threads and a few KB
    of shared memory, so two programs fit on every SM; more in-flight loads per SM is what a
    bandwidth-bound step needs. Older Tritons build it with 8 warps, one program an SM
    (triton_versions.megakernel_tuning). A pipelined build's stages can fit fewer: a static build
    launches what Megakernel.resident_for finds."""
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        return max(1, min(sms * programs_per_sm, num_tasks))
    # Interpreter: programs run one after another; a few exercise the claim loop's exit path.
    return max(1, min(4, num_tasks))


def programs_per_sm(tuned: int, shared: int, smem_per_sm: int) -> int:
    """Programs of a build one SM holds: the tuning's (registers), fewer where its shared memory
    (bytes a program, + the 1 KB the hardware reserves for each block since sm_80) does not fit
    that many; at least one."""
    if shared <= 0:
        return tuned
    return max(1, min(tuned, smem_per_sm // (shared + 1024)))


def shared_memory_per_sm(device: torch.device) -> int:
    """Bytes of shared memory an SM of `device` has (torch's property; Triton's per-block limit
    plus the block's reserve where torch lacks it)."""
    props = torch.cuda.get_device_properties(device)
    per_sm = getattr(props, "shared_memory_per_multiprocessor", 0)
    if per_sm:
        return int(per_sm)
    index = torch.cuda.current_device() if device.index is None else device.index
    return int(triton.runtime.driver.active.utils.get_device_properties(index)["max_shared_mem"]) + 1024


def linear_k_step(meta: dict[str, int], fp8: bool = False, tuning: MegakernelTuning | None = None,
                  variant: "KernelVariant | None" = None) -> int:
    """The K step _linear_acc takes at a launch's constexprs (BLOCK_K, shrunk to the register
    budgets of `tuning`: the running Triton's, none under the interpreter; a pipelined aligned
    `variant` widens it to the budgets' step, up to 256: as _linear_acc, for bf16 weights, where a
    dot variant keeps its own loop), for the timeline."""
    budget = tuning or _BUDGET
    bk0 = meta["BLOCK_K"] // 2 if fp8 else meta["BLOCK_K"]
    fit = min(budget.linear_tile // (meta["BLOCK_M"] * meta["BLOCK_N"]) // (2 if fp8 else 1),
              (budget.fp8_weight_tile if fp8 else budget.weight_tile) // meta["BLOCK_N"])
    v = variant or KernelVariant()
    if v.pipeline and v.aligned and not (v.unroll or v.dot or v.wide or fp8):
        bk0 = max(bk0, min(fit, 256))
    return bk0 if bk0 <= fit else max(fit, 16)


def megakernel_meta(batch: int, block_n: int, block_k: int, block_t: int, head_dim: int, max_splits: int,
                    max_tiles: int) -> dict[str, int]:
    """The megakernel's constexprs for a graph of `batch` rows at a tiling: what a launch compiles
    (Megakernel) and what compile_check compiles without a GPU. BLOCK_S holds a step's most decode
    splits, BLOCK_R its most tiles of one linear (an argmax's partials; capped at 1024)."""
    return dict(NF=NUM_FIELDS, BLOCK_M=max(1, triton.next_power_of_2(batch)), BLOCK_N=block_n, BLOCK_K=block_k,
                BLOCK_T=block_t, BLOCK_D=triton.next_power_of_2(head_dim),
                BLOCK_S=triton.next_power_of_2(max(1, max_splits)),
                BLOCK_R=min(1024, triton.next_power_of_2(max(1, max_tiles))))


@dataclass(frozen=True)
class KernelVariant:
    """How the one megakernel is built beyond its tiling: choices measured against each other on a
    GPU (bench/gpu_timeline.py) before one becomes the default. pipeline: stages of a dense linear
    task's K loop (0: a plain loop; 3 with dot; with aligned the weights are copied into shared
    memory pipeline - 2 trips ahead of the one in use, bench/RESULTS.md "Megakernel K loop");
    prefetch: its weight tile into L2 before its dependency wait (0: off; 1: a prefetch per
    128-byte line, sm_80+; 2: one bulk prefetch per row, sm_90+); dot: its K loop on the tensor cores, `dot` elements a step (bf16 weights; 0: the
    elementwise loop; see _linear_dot_steps); wide: steps of `wide` elements reduced as they come
    (_linear_wide_steps); unroll: 2, 4 or 8 weight tiles loaded before the first is multiplied;
    aligned: the weight offsets' alignment said so that the dense tasks' loads are 16 bytes (see
    _linear_acc); static: each program runs a fixed share of the tasks, the next one's header
    loaded while this one runs (no claims; see _megakernel: every program must be resident)."""
    pipeline: int = 0
    prefetch: int = 0
    dot: int = 0
    wide: int = 0
    unroll: int = 0
    aligned: bool = False
    static: bool = False

    def __post_init__(self) -> None:
        one_loop = sum(bool(v) for v in (self.dot, self.wide, self.unroll)) <= 1
        if (not 0 <= self.pipeline < 16 or self.unroll not in (0, 2, 4, 8) or not one_loop
                or any(v % 16 or not 0 <= v < 4096 for v in (self.dot, self.wide))):
            raise ValueError(f"not a K loop: {self} (pipeline < 16; unroll 2, 4 or 8; dot, wide multiples of 16 "
                             "below 4096; one of dot, wide, unroll)")

    @property
    def loop(self) -> int:
        """The K loop's build as one constexpr (the kernel decodes it: _linear_acc)."""
        return (self.pipeline + 16 * self.unroll + 256 * (self.dot // 16) + 65536 * (self.wide // 16)
                + 16777216 * int(self.aligned))

    def constexprs(self) -> dict[str, int]:
        return dict(LOOP=self.loop, PREFETCH=self.prefetch, STATIC=int(self.static))

    def name(self) -> str:
        parts = [f"dot{self.dot}"] * bool(self.dot) + [f"wide{self.wide}"] * bool(self.wide)
        parts += [f"unroll{self.unroll}"] * bool(self.unroll) + ["aligned"] * self.aligned
        parts += [f"pipe{self.pipeline}"] * bool(self.pipeline) + [f"prefetch{self.prefetch}"] * bool(self.prefetch)
        parts += ["static"] * self.static
        return "+".join(parts) or "plain"

    @classmethod
    def parse(cls, name: str) -> "KernelVariant":
        """The variant `name()` names (e.g. "wide512+aligned"; "plain": the default build)."""
        fields = {"dot": "dot", "wide": "wide", "unroll": "unroll", "pipe": "pipeline", "prefetch": "prefetch"}
        kw: dict = {}
        bad = ValueError(f"not a kernel variant: {name!r} (e.g. 'plain', 'wide512+aligned')")
        for part in ([] if name == "plain" else name.split("+")):
            m = re.fullmatch(r"(dot|wide|unroll|pipe|prefetch)(\d+)|aligned|static", part)
            if m is None:
                raise bad
            if part in ("aligned", "static"):
                kw[part] = True
            else:
                kw[fields[m.group(1)]] = int(m.group(2))
        variant = cls(**kw)
        if variant.name() != name:      # "wide0", parts repeated or out of order: not a name name() gives
            raise bad
        return variant




def expert_step(variant: KernelVariant, block_m: int, weight_bytes: int, tuning: MegakernelTuning) -> int:
    """Elements of an expert row the expert tasks' K loop reads a wide step in a build (0: the plain
    loop): in the streaming builds (aligned) tuning.expert_bytes bytes at this row block
    (weight_bytes a weight: 1 for FP8 experts, else the arena's); elsewhere, or where the table
    says 0, none. Experts are sparse in a batch (at batch 8 under uniform routing each expert is
    chosen by ~1.6 of the rows), so a wide step's tile is reduced only by the rows that chose its
    expert (_wide_rows)."""
    if not variant.aligned:
        return 0
    table = tuning.fp8_expert_bytes if weight_bytes == 1 else tuning.expert_bytes
    step = table[min(3, max(1, block_m).bit_length() - 1)] // weight_bytes
    return step if step >= 16 else 0


@functools.lru_cache(maxsize=None)
def expert_loop(variant: KernelVariant, block_m: int, weight_bytes: int, tuning: MegakernelTuning,
                tiles: bool = False) -> int:
    """The expert tasks' loops (XLOOP): their K loop in KernelVariant.loop's terms (wide steps of
    expert_step's elements with the alignment said, or the plain loop: 0), + XTILES where a task
    spans several column tiles (`tiles`: its table has such tasks, Tiling.expert_span). Cached:
    every launch asks."""
    step = expert_step(variant, block_m, weight_bytes, tuning)
    return (KernelVariant(wide=step, aligned=True).loop if step else 0) + (XTILES if tiles else 0)


def kv_aligned(graph: TaskGraph) -> bool:
    """Whether every attention task's head dim and cache offsets are multiples of 16 elements (the
    arena aligns every region to 16 units; head dims are the model's: 64, 128, 256 in every family
    here), so an aligned build may say so to its K / V loads (KV16)."""
    return all(t.args["Dh"] % 16 == 0 and t.args["kc"] % 16 == 0 and t.args["vc"] % 16 == 0
               for t in graph.tasks if t.op == ops.OP_ATTN_PARTIAL)


def spans_linear_tiles(graph: TaskGraph, block_n: int) -> bool:
    """Whether some dense linear task spans several column tiles (Tiling.linear_span > 1): its build
    must loop over them (LTILES)."""
    return any(t.op == ops.OP_LINEAR and t.args["n1"] - t.args["n0"] > block_n for t in graph.tasks)


def spans_expert_tiles(graph: TaskGraph, block_n: int) -> bool:
    """Whether some expert task spans several column tiles (Tiling.expert_span > 1): its build
    must loop over them (XTILES)."""
    return any(t.op in (ops.OP_MOE_UP, ops.OP_MOE_DOWN) and t.args["n1"] - t.args["n0"] > block_n
               for t in graph.tasks)


class Megakernel:
    """A checked, encoded graph bound to its buffers; `launch()` runs one decode step."""

    run_task = step_tasks
    variant = KernelVariant()
    expert_tiles = False           # the table's expert tasks span several tiles (spans_expert_tiles)
    linear_tiles = False           # the table's dense linear tasks span several tiles (spans_linear_tiles)
    kv_aligned = False             # the table's caches are 16-aligned (kv_aligned)
    tuning = megakernel_tuning()   # programs an SM under the running Triton
    options = megakernel_options()   # its launch options (num_warps, maxnreg): those compile_check compiles with

    def __init__(self, graph: TaskGraph, weights: torch.Tensor, state: torch.Tensor, dyn: torch.Tensor,
                 out: torch.Tensor, block_m: int, block_n: int, block_k: int, block_t: int,
                 head_dim: int, max_splits: int, max_tiles: int, ln_eps: float = 1e-5,
                 spin_limit: int | None = None, run_task=None) -> None:
        from photon_core.megakernel.checker import check
        check(graph)
        self.graph = graph
        self.expert_tiles = spans_expert_tiles(graph, block_n)
        self.linear_tiles = spans_linear_tiles(graph, block_n)
        self.kv_aligned = kv_aligned(graph)
        if run_task is not None:   # a variant of the task table (step_tasks_for)
            self.run_task = run_task
        dev = weights.device
        if state.dtype != torch.float32 or not state.is_contiguous():
            raise ValueError("megakernel state arena must be contiguous fp32")
        if weights.dtype not in (torch.float32, torch.bfloat16, torch.float16) or not weights.is_contiguous():
            raise ValueError("megakernel weights arena must be contiguous fp32, bf16 or fp16")
        self.tasks = graph.encode().to(dev)
        self.ctrl = torch.zeros(graph.ctrl_size(), dtype=torch.int32, device=dev)
        self.weights, self.state, self.dyn, self.out = weights, state, dyn, out
        self.batch = graph.batch
        self.ln_eps = ln_eps
        check_supported()
        self.num_programs = resident_programs(dev, len(graph.tasks), self.tuning.programs_per_sm)
        interp = dev.type == "cpu"
        # Under the interpreter any wait is satisfied at once or never: fail fast instead of hanging.
        # On a GPU ~2^20 polls are about a second, far past any real dependency wait (microseconds
        # to milliseconds): a lost signal becomes a reported error, not a minutes-long hang.
        self.spin_limit = spin_limit if spin_limit is not None else (2 if interp else 1 << 20)
        self.meta = megakernel_meta(graph.batch, block_n, block_k, block_t, head_dim, max_splits, max_tiles)
        if block_m and block_m < self.meta["BLOCK_M"]:
            raise ValueError(f"block_m {block_m} < batch {graph.batch}")

    def launch(self, trace: torch.Tensor | None = None) -> None:
        """Zero the control buffer and run the graph once (both capturable in a CUDA graph). With
        `trace` (trace_buffer()), the traced build runs and writes each task's row into it."""
        if self.variant.prefetch and self.weights.device.type != "cuda":
            raise ValueError("the prefetch variant is GPU code (inline PTX): the interpreter cannot run it")
        self.ctrl.zero_()
        cuda = self.weights.device.type == "cuda"
        mode = 0 if trace is None else (1 if cuda else 2)
        args = (self.tasks, len(self.graph.tasks), self.ctrl, self.dyn, self.weights, self.state, self.out,
                self.batch, self.ln_eps, self.spin_limit, self.ctrl if trace is None else trace)
        kw = dict(RUN_TASK=self.run_task, TRACE=mode, **dict(self.variant.constexprs(), LOOP=self.loop()),
                  XLOOP=self.expert_loop(), **self.options, **self.meta)
        # The interpreter runs programs one after another: a static share waiting on another
        # program's task would never see it run, so there one program runs them all.
        programs = self.num_programs if cuda or not self.variant.static else 1
        if cuda and self.variant.static:
            programs = min(programs, self.resident_for(args, kw))
        _megakernel[(programs,)](*args, **kw)

    def resident_for(self, args: tuple, kw: dict) -> int:
        """Programs of this build the GPU holds at once: fewer than num_programs where the compiled
        build's shared memory leaves room for fewer programs an SM than the tuning's (a pipelined
        build's stages: aligned+pipe8 takes 122 KB a program under Triton 3.9, one an SM, not two).
        A static build launches no more (a share whose program is not yet running would block its
        waiters); a claiming one may (its extra programs start late and claim what is left).
        Compiled once per build (the compile its launch would do), before its first launch."""
        known = self.__dict__.setdefault("_resident", {})   # keyed by all the build depends on
        key = (str(self.weights.device), self.weights.dtype, len(self.graph.tasks),
               tuple(sorted((k, getattr(v, "__name__", v)) for k, v in kw.items())))
        if key not in known:
            try:
                shared = int(_megakernel.warmup(*args, grid=(1,), **kw).metadata.shared)
            except (AttributeError, TypeError) as e:   # a Triton without warmup's compiled kernel
                warnings.warn(f"megakernel: the build's shared memory is unknown ({e!r}); assuming the "
                              f"tuning's {self.tuning.programs_per_sm} programs an SM", stacklevel=2)
                shared = 0
            per_sm = programs_per_sm(self.tuning.programs_per_sm, shared, shared_memory_per_sm(self.weights.device))
            known[key] = resident_programs(self.weights.device, len(self.graph.tasks), per_sm)
        return known[key]

    def loop(self) -> int:
        """This launch's LOOP: the variant's dense K loop, + KV16 where an aligned build's caches
        are aligned, + LTILES where the table's linear tasks span several tiles."""
        return (self.variant.loop + (KV16 if self.variant.aligned and self.kv_aligned else 0)
                + (LTILES if self.linear_tiles else 0))

    def expert_loop(self, weight_bytes: int | None = None) -> int:
        """This launch's expert K loop (expert_loop: the variant's, at this batch and expert format;
        weight_bytes: an arena of another dtype's, default this one's)."""
        fp8 = self.run_task in (step_tasks_fp8, step_tasks_bf16_kv_fp8)
        size = weight_bytes or self.weights.element_size()
        return expert_loop(self.variant, self.meta["BLOCK_M"], 1 if fp8 else size, self.tuning, self.expert_tiles)

    def trace_buffer(self) -> torch.Tensor:
        """Zeros for a traced launch: a row of TRACE_WIDTH int64 per task, then the interpreter's clock."""
        return torch.zeros((len(self.graph.tasks) + 1) * TRACE_WIDTH, dtype=torch.int64, device=self.ctrl.device)

    def traced_launch(self) -> torch.Tensor:
        """One launch of the traced build; [tasks, len(TRACE_COLUMNS)] int64 on the host (times in ns
        on a GPU, ticks of a logical clock under the interpreter). Not for CUDA-graph capture."""
        buf = self.trace_buffer()
        self.launch(buf)
        return buf.view(-1, TRACE_WIDTH)[:len(self.graph.tasks), :len(TRACE_COLUMNS)].cpu()

    def claims_at_exit(self, programs: int | None = None) -> int:
        """The claim counter after a whole launch with `programs` programs (this kernel's if None): the
        plain build's programs each end on one claim that finds no task; a static build adds exactly
        its task count."""
        return len(self.graph.tasks) + (0 if self.variant.static else
                                        (self.num_programs if programs is None else programs))

    def raise_on_error(self) -> None:
        """Synchronising check of the error flag (a failed task: see raise_for)."""
        self.raise_for(int(self.ctrl[CTRL_ERROR].item()), int(self.ctrl[CTRL_CLAIM].item()))

    def raise_for(self, err: int, claimed: int) -> None:
        """Raise for a launch's error flag and claim count, as read from its control buffer: the
        failed task of lowest index (the root of a cascade of waits that gave up) and what failed."""
        if err:
            task, kind = decode_error(len(self.graph.tasks), err)
            if not 0 <= task < len(self.graph.tasks) or kind not in ERR_KINDS:
                raise RuntimeError(f"megakernel: error flag {err} names no task of this graph")
            t = self.graph.tasks[task]
            raise RuntimeError(f"megakernel: task {task} {t.name!r} (waits {t.waits}) {ERR_KINDS[kind]}")
        if claimed < len(self.graph.tasks):
            raise RuntimeError(f"megakernel: only {claimed} of {len(self.graph.tasks)} tasks were claimed")
