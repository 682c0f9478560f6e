"""Moondream 2's text decode step (LM head and region heads included) as ONE megakernel launch.

Per step, for B rows (batch bucket 1/2/4/8; each row at its own position, read from device memory):

    x = input embedding [B, D]          (word embedding, or an encoded coordinate / size: the host
                                          writes it; the Fourier region encoders are a few KFLOP)
    per layer (Phi-style parallel block, one LayerNorm feeds attention AND the MLP):
        h      = LN(x)
        q,k,v  = h @ Wqkv.T + b                         (linear tiles, LN fused in front)
        q,k    = partial rotary on the first rot_dim of each head at the row's position;
                 k, v appended to the KV cache [B, H, Tmax, Dh] at that position   (rope task)
        a      = softmax(q k^T / sqrt(Dh)) v over positions 0..pos  (split-KV partials + merge;
                 the image prefix is already in the cache and every decode position sees all of it)
        m      = x + GELU_tanh(h @ W1.T + b1) @ W2.T + b2          (MLP tiles, run beside attention)
        x      = a @ Wo.T + bo + m                                 (out-proj tiles, written in place)
    token      = argmax(post_ln(x) @ Wlm.T + blm + logit_bias[row])   (masks: -inf bias)
    coord bin  = argmax(GELU_tanh(x @ Wc1.T + bc1) @ Wc2.T + bc2)      (x BEFORE post_ln)
    size bins  = argmax per half of GELU_tanh(x @ Ws1.T + bs1) @ Ws2.T + bs2  (width, height)

so one launch yields the token, the coordinate bin and the two size bins of every row, and
`x` (the last hidden state before post_ln) stays in the state arena for the caller.

Task kinds (the persistent kernel below claims them in list order, see kernel.py for the protocol):
  * OP_LINEAR tiles (kernel.py's `_task_linear`): one task = BLOCK_N output features of all B rows;
    bytes: BLOCK_N*K weights + B*K activations (+ one more B*K pass for fused LN statistics).
    LM-head / region-output tiles also write their per-row (max, first index) for the argmax.
  * OP_ROPE_APPEND (new, `_task_rope_append`): one task = one (row, head): reads that head's q/k/v
    (3*Dh floats) from the fused QKV output, rotates q and k, writes q and appends k/v to the cache;
    bytes ~ 3*Dh*4 in + 3*Dh*4 out + rot_dim*4 of cos/sin.
  * OP_ATTN_PARTIAL / OP_ATTN_MERGE (kernel.py): flash-decoding over the row's pos+1 keys,
    2*chunk*Dh*4 bytes per partial, S*(Dh+2)*4 per merge.
  * OP_ARGMAX_BINS (new, `_task_argmax_bins`): merges the (max, index) pairs of a run of output tiles
    into one int per row, written to column `out` of the int32 result [B, 4] =
    (token, coord bin, width bin, height bin).

Dependencies: the QKV and MLP-up tiles of a layer wait for the previous out-projection; the rope
tasks wait for the QKV tiles; attention partials of head h wait only for the rope tasks of head h;
the out-projection waits for the attention merges AND the MLP-down tiles (two waits). The LM head
and both region heads wait only on the last out-projection, so they run concurrently.

`reference_step` is the same step with backends.reference ops on the model's own code paths
(text.forward / lm_logits / region heads), the ground truth for tests.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from photon_core.backends import reference as ref
from photon_core.kernels.linear import ACT_GELU_TANH
from photon_core.megakernel import graph as _graph
from photon_core.megakernel.graph import (LEN_SELF, MODE_LOGITS, MODE_PLAIN, OP_ATTN_MERGE, OP_ATTN_PARTIAL,
                                          OP_LINEAR, BATCH_BUCKETS, Arena, Region, StateViews, Task, TaskGraph)
from photon_core.megakernel.kernel import CG, Megakernel, argmax_of_tiles, shared_tasks

# New op codes, far from kernel.py's 1..5 so a later generic op cannot collide; registered in
# graph.OP_NAMES so checker.check accepts them (the checker only needs the name).
OP_ROPE_APPEND = 101
OP_ARGMAX_BINS = 102
for _code, _name in ((OP_ROPE_APPEND, "rope_append"), (OP_ARGMAX_BINS, "argmax_bins")):
    if _graph.OP_NAMES.setdefault(_code, _name) != _name:
        raise RuntimeError(f"megakernel op code {_code} is already taken by {_graph.OP_NAMES[_code]!r}")

# Columns of the int32 result buffer [B, OUT_COLS].
OUT_TOKEN, OUT_COORD, OUT_WIDTH, OUT_HEIGHT = 0, 1, 2, 3
OUT_COLS = 4


# ---------------------------------------------------------------------------------------------------
# Device code: the two new task kinds and the dispatch loop


@triton.jit
def _task_rope_append(row, w_ptr, s_ptr, dyn_ptr, B, BLOCK_D: tl.constexpr):
    """(row b, head h): partial rotary of q and k on their first ROT features ("rotate half" pairs
    (i, i + ROT/2), as backends.reference.rotary), then q -> q buffer, k and v -> the KV caches at the
    row's position. The partner of each feature is gathered with a second (masked) load rather than a
    register permutation; both loads hit the same 256 bytes."""
    rot = tl.load(row + 7)
    D = tl.load(row + 8)
    x_off = tl.load(row + 10)
    cos_off = tl.load(row + 11)
    sin_off = tl.load(row + 12)
    out = tl.load(row + 18)
    kc = tl.load(row + 19)
    vc = tl.load(row + 20)
    H = tl.load(row + 21)
    Dh = tl.load(row + 22)
    Tmax = tl.load(row + 23)
    b = tl.load(row + 28)
    h = tl.load(row + 29)
    pos = tl.load(dyn_ptr + B + b, cache_modifier=CG).to(tl.int64)
    half = rot // 2
    dd = tl.arange(0, BLOCK_D)
    dmask = dd < Dh
    in_rot = dd < rot
    first = dd < half
    partner = tl.where(first, dd + half, dd - half)
    sign = tl.where(first, -1.0, 1.0)
    freq = tl.where(first, dd, dd - half)
    c = tl.load(w_ptr + cos_off + pos * half + freq, mask=in_rot, other=1.0).to(tl.float32)
    s = tl.load(w_ptr + sin_off + pos * half + freq, mask=in_rot, other=0.0).to(tl.float32)
    src = s_ptr + x_off + b * 3 * D + h * Dh
    q = tl.load(src + dd, mask=dmask, other=0.0, cache_modifier=CG)
    qp = tl.load(src + partner, mask=dmask & in_rot, other=0.0, cache_modifier=CG)
    k = tl.load(src + D + dd, mask=dmask, other=0.0, cache_modifier=CG)
    kp = tl.load(src + D + partner, mask=dmask & in_rot, other=0.0, cache_modifier=CG)
    v = tl.load(src + 2 * D + dd, mask=dmask, other=0.0, cache_modifier=CG)
    q = tl.where(in_rot, q * c + (sign * qp) * s, q)
    k = tl.where(in_rot, k * c + (sign * kp) * s, k)
    tl.store(s_ptr + out + b * D + h * Dh + dd, q, mask=dmask)
    cache = ((b * H + h) * Tmax + pos) * Dh + dd
    ok = dmask & ((dd.to(tl.int64) * 0 + pos) < Tmax)  # a vector mask (scalar & vector confuses the interpreter)
    tl.store(s_ptr + kc + cache, k, mask=ok)
    tl.store(s_ptr + vc + cache, v, mask=ok)


@triton.jit
def _task_argmax_bins(row, s_ptr, out_ptr, BLOCK_R: tl.constexpr):
    """Per row m < M: argmax over the (max, index) pairs of tiles [tile0, tile0 + S) (row stride
    `ntiles` tiles), minus the index offset n0, stored as int32 at out_ptr[m * K + out]. Ties keep
    the lowest index (the tiles report their first maximal column; later blocks must be strictly
    greater), like torch.argmax. An all -inf row yields the group's first index."""
    M = tl.load(row + 6)
    K = tl.load(row + 7)
    n0 = tl.load(row + 9)
    out = tl.load(row + 18)
    tile0 = tl.load(row + 24)
    part = tl.load(row + 25)
    ntiles = tl.load(row + 27)
    S = tl.load(row + 31)
    for m in range(0, M):
        best_i = argmax_of_tiles(s_ptr + part + (m * ntiles + tile0).to(tl.int64) * 2, S, BLOCK_R)
        tl.store(out_ptr + m * K + out, best_i - n0.to(tl.int32))


@triton.jit
def moondream_tasks(op, row, w_ptr, s_ptr, dyn_ptr, out_ptr, B, ln_eps, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
                    BLOCK_S: tl.constexpr, BLOCK_R: tl.constexpr):
    """Moondream's task table for kernel._megakernel: the shared linear and attention tasks, plus
    rotary + KV append and the argmax with region bins. 0 for an unknown op."""
    ran = shared_tasks(op, row, w_ptr, s_ptr, dyn_ptr, B, ln_eps, BLOCK_M, BLOCK_N, BLOCK_K, BLOCK_T,
                       BLOCK_D, BLOCK_S)
    if ran == 0:
        ran = 1
        if op == 101:
            _task_rope_append(row, w_ptr, s_ptr, dyn_ptr, B, BLOCK_D)
        elif op == 102:
            _task_argmax_bins(row, s_ptr, out_ptr, BLOCK_R)
        else:
            ran = 0
    return ran


class _MoondreamKernel(Megakernel):
    """kernel.Megakernel's checking, encoding, buffers and dispatch loop, with Moondream's tasks."""

    run_task = moondream_tasks


# ---------------------------------------------------------------------------------------------------
# The graph


@dataclass(frozen=True)
class Tiling:
    block_n: int = 32   # output features per linear task (must divide size_out_dim / 2)
    block_k: int = 64   # K step inside a linear task
    block_t: int = 32   # keys per attention inner step
    splits: int = 4     # KV splits per (row, head)


@dataclass(frozen=True)
class Dims:
    d: int
    heads: int
    head_dim: int
    rot: int
    ff: int
    vocab: int
    layers: int
    region_inner: int
    coord_bins: int
    size_bins: int  # both halves (width bins + height bins)
    max_context: int


def dims_of(cfg: Any) -> Dims:
    """Dims from a MoondreamConfig (text and region sections)."""
    t, r = cfg.text, cfg.region
    if t.n_kv_heads != t.n_heads:
        raise NotImplementedError("the Moondream decode megakernel handles n_kv_heads == n_heads (moondream2) only")
    hd = t.dim // t.n_heads
    return Dims(t.dim, t.n_heads, hd, hd // 2, t.ff_dim, t.vocab_size, t.n_layers, r.inner_dim,
                r.coord_out_dim, r.size_out_dim, t.max_context)


def plan_arenas(dm: Dims, batch: int, max_len: int, tiling: Tiling,
                tensors: dict[str, torch.Tensor] | None = None,
                ) -> tuple[Arena, Arena, dict[str, tuple[int, ...]]]:
    """Where every weight and state tensor lives (no memory allocated). `tensors` (name -> tensor)
    gives the weight sizes; without it the sizes follow from the dims."""
    wa, sa = Arena("weights"), Arena("state")
    sizes = {k: t.numel() for k, t in tensors.items()} if tensors is not None else _weight_sizes(dm)
    for k, n in sizes.items():
        wa.alloc(k, n)
    bn = tiling.block_n
    shapes: dict[str, tuple[int, ...]] = {
        "x": (batch, dm.d), "qkv": (batch, 3 * dm.d), "q": (batch, dm.d), "attn": (batch, dm.d),
        "hid": (batch, dm.ff), "xm": (batch, dm.d),
        "part": (batch, dm.heads, tiling.splits, dm.head_dim + 2),
        "kcache": (dm.layers, batch, dm.heads, max_len, dm.head_dim),
        "vcache": (dm.layers, batch, dm.heads, max_len, dm.head_dim),
        "logits": (batch, dm.vocab), "logit_bias": (batch, dm.vocab), "lm_part": (batch, -(-dm.vocab // bn), 2),
        "chid": (batch, dm.region_inner), "clogits": (batch, dm.coord_bins),
        "cpart": (batch, -(-dm.coord_bins // bn), 2),
        "shid": (batch, dm.region_inner), "slogits": (batch, dm.size_bins),
        "spart": (batch, -(-dm.size_bins // bn), 2)}
    for k, shp in shapes.items():
        sa.alloc(k, math.prod(shp))
    return wa, sa, shapes


def _weight_sizes(dm: Dims) -> dict[str, int]:
    d = dm.d
    s: dict[str, int] = {}
    for li in range(dm.layers):
        L = f"L{li}"
        s.update({f"{L}.ln.w": d, f"{L}.ln.b": d, f"{L}.qkv_w": 3 * d * d, f"{L}.qkv_b": 3 * d,
                  f"{L}.proj_w": d * d, f"{L}.proj_b": d, f"{L}.fc1_w": dm.ff * d, f"{L}.fc1_b": dm.ff,
                  f"{L}.fc2_w": d * dm.ff, f"{L}.fc2_b": d})
    s.update({"post_ln.w": d, "post_ln.b": d, "lm_w": dm.vocab * d, "lm_b": dm.vocab,
              "rope_cos": dm.max_context * (dm.rot // 2), "rope_sin": dm.max_context * (dm.rot // 2),
              "c_fc1_w": dm.region_inner * d, "c_fc1_b": dm.region_inner,
              "c_fc2_w": dm.coord_bins * dm.region_inner, "c_fc2_b": dm.coord_bins,
              "s_fc1_w": dm.region_inner * d, "s_fc1_b": dm.region_inner,
              "s_fc2_w": dm.size_bins * dm.region_inner, "s_fc2_b": dm.size_bins})
    return s


def build_graph(dm: Dims, batch: int, max_len: int, tiling: Tiling, warena: Arena, sarena: Arena,
                region_heads: bool = True) -> TaskGraph:
    """The task graph of one decode step (see the module docstring). The arenas must hold the regions
    named here (plan_arenas). Without `region_heads` the coordinate/size heads are left out (text
    decoding: caption, query), saving their 2 x (D*inner + inner*bins) weight bytes per step."""
    d, H, dh, v = dm.d, dm.heads, dm.head_dim, dm.vocab
    bn, B, S, W = tiling.block_n, batch, sarena, warena
    if region_heads and (dm.size_bins // 2) % bn:
        raise ValueError(f"block_n {bn} must divide the {dm.size_bins // 2} bins of each size half")
    g = TaskGraph(model=f"moondream-decoder-d{d}-L{dm.layers}-V{v}{'-region' if region_heads else ''}", batch=B)
    dyn_pos = Region("dyn", B, 2 * B)
    kv_layer = B * H * max_len * dh

    def tiles(n: int) -> range:
        return range(0, n, bn)

    def cache_cols(key: str, r: int, h: int) -> Region:
        """Head h of row r of a layer's KV cache at ANY position: positions are dynamic, so cache
        accesses are declared position-free; two accesses overlap exactly when (row, head) match."""
        return Region(f"{key}@heads", r * H + h, r * H + h + 1)

    def linear_stage(name: str, waits: list[str], K: int, N: int, x: str, w: str, b: str | None,
                     ln: str | None = None, act: int = 0, res: str | None = None, mode: int = MODE_PLAIN,
                     out: str = "", part: str | None = None) -> str:
        """One OP_LINEAR task per BLOCK_N output columns. mode MODE_LOGITS also writes per-tile
        (max, index) pairs into `part` ([B, ntiles, 2]) for an OP_ARGMAX_BINS reduction."""
        sig = g.counter(name)
        wait_list = [(c, g.signalers(c)) for c in waits]
        ntiles = len(tiles(N))
        for i, n0 in enumerate(tiles(N)):
            n1 = min(N, n0 + bn)
            args = dict(M=B, K=K, N=N, n0=n0, x=S.off(x), w=W.off(w), b=W.off(b) if b else -1,
                        lnw=W.off(ln + ".w") if ln else -1, lnb=W.off(ln + ".b") if ln else -1, act=act,
                        res=S.off(res) if res else -1, mode=mode, out=S.off(out))
            reads = [S.region(x)] + (S.columns(res, B, N, n0, n1) if res else [])
            writes = S.columns(out, B, N, n0, n1)
            if mode == MODE_LOGITS:
                assert part is not None
                rb = S.off("logit_bias") if name == "lm_head" else -1
                args.update(tile=i, part=S.off(part), ntiles=ntiles, rb=rb)
                writes += [S.region(part, (r * ntiles + i) * 2, (r * ntiles + i) * 2 + 2) for r in range(B)]
                if rb >= 0:
                    reads += S.columns("logit_bias", B, N, n0, n1)
            g.add(Task(f"{name}[{n0}:{n1}]", OP_LINEAR, args, list(wait_list), sig, reads, writes))
        return sig

    def argmax_stage(name: str, wait: str, part: str, ntiles: int, tile0: int, count: int, col: int,
                     index_offset: int) -> None:
        g.add(Task(name, OP_ARGMAX_BINS,
                   dict(M=B, K=OUT_COLS, n0=index_offset, out=col, tile=tile0, part=S.off(part),
                        ntiles=ntiles, S=count),
                   [(wait, g.signalers(wait))], None,
                   [S.region(part, (r * ntiles + tile0) * 2, (r * ntiles + tile0 + count) * 2) for r in range(B)],
                   [Region("out", r * OUT_COLS + col, r * OUT_COLS + col + 1) for r in range(B)]))

    prev: str | None = None  # counter of the previous layer's out-projection (None: x is the input)
    for li in range(dm.layers):
        L = f"L{li}"
        kc, vc = S.off("kcache") + li * kv_layer, S.off("vcache") + li * kv_layer
        waits = [prev] if prev else []
        qkv = linear_stage(f"{L}.qkv", waits, d, 3 * d, "x", f"{L}.qkv_w", f"{L}.qkv_b", ln=f"{L}.ln", out="qkv")
        up = linear_stage(f"{L}.mlp_up", waits, d, dm.ff, "x", f"{L}.fc1_w", f"{L}.fc1_b", ln=f"{L}.ln",
                          act=ACT_GELU_TANH, out="hid")
        n_qkv = g.signalers(qkv)
        for hh in range(H):
            rope = g.counter(f"{L}.rope.h{hh}")
            for r in range(B):
                g.add(Task(f"{L}.rope[b{r},h{hh}]", OP_ROPE_APPEND,
                           dict(K=dm.rot, N=d, x=S.off("qkv"), w=W.off("rope_cos"), b=W.off("rope_sin"),
                                out=S.off("q"), kc=kc, vc=vc, H=H, Dh=dh, Tmax=max_len, bi=r, hi=hh),
                           [(qkv, n_qkv)], rope,
                           [S.region("qkv", r * 3 * d + c * d + hh * dh, r * 3 * d + c * d + (hh + 1) * dh)
                            for c in range(3)] + [dyn_pos],
                           [S.region("q", r * d + hh * dh, r * d + (hh + 1) * dh),
                            cache_cols(f"{L}.k", r, hh), cache_cols(f"{L}.v", r, hh)]))
        sig_p = g.counter(f"{L}.attn.part")
        for r in range(B):
            for hh in range(H):
                for s in range(tiling.splits):
                    p0 = ((r * H + hh) * tiling.splits + s) * (dh + 2)
                    g.add(Task(f"{L}.attn.part[b{r},h{hh},s{s}]", OP_ATTN_PARTIAL,
                               dict(x=S.off("q"), K=d, kc=kc, vc=vc, H=H, Dh=dh, Tmax=max_len,
                                    part=S.off("part"), bi=r, hi=hh, s=s, S=tiling.splits, lenkind=LEN_SELF),
                               [(f"{L}.rope.h{hh}", B)], sig_p,
                               [S.region("q", r * d + hh * dh, r * d + (hh + 1) * dh),
                                cache_cols(f"{L}.k", r, hh), cache_cols(f"{L}.v", r, hh), dyn_pos],
                               [S.region("part", p0, p0 + dh + 2)]))
        n_part = g.signalers(sig_p)
        att = g.counter(f"{L}.attn")
        for r in range(B):
            for hh in range(H):
                p0 = (r * H + hh) * tiling.splits * (dh + 2)
                g.add(Task(f"{L}.attn.merge[b{r},h{hh}]", OP_ATTN_MERGE,
                           dict(K=d, out=S.off("attn"), H=H, Dh=dh, part=S.off("part"), bi=r, hi=hh,
                                S=tiling.splits),
                           [(sig_p, n_part)], att, [S.region("part", p0, p0 + tiling.splits * (dh + 2))],
                           [S.region("attn", r * d + hh * dh, r * d + (hh + 1) * dh)]))
        down = linear_stage(f"{L}.mlp_down", [up], dm.ff, d, "hid", f"{L}.fc2_w", f"{L}.fc2_b", res="x", out="xm")
        # x + attn_out + mlp, in the reference's order: proj(a) + (x + mlp). In place into x: every
        # reader of this layer's x (QKV, MLP-up, MLP-down residual) is ordered before via the waits.
        prev = linear_stage(f"{L}.proj", [att, down], d, d, "attn", f"{L}.proj_w", f"{L}.proj_b", res="xm", out="x")
    waits = [prev] if prev else []
    lm_tiles = len(tiles(v))
    lm = linear_stage("lm_head", waits, d, v, "x", "lm_w", "lm_b", ln="post_ln", mode=MODE_LOGITS,
                      out="logits", part="lm_part")
    argmax_stage("lm_argmax", lm, "lm_part", lm_tiles, 0, lm_tiles, OUT_TOKEN, 0)
    if region_heads:
        c1 = linear_stage("coord_fc1", waits, d, dm.region_inner, "x", "c_fc1_w", "c_fc1_b",
                          act=ACT_GELU_TANH, out="chid")
        c_tiles = len(tiles(dm.coord_bins))
        c2 = linear_stage("coord_fc2", [c1], dm.region_inner, dm.coord_bins, "chid", "c_fc2_w", "c_fc2_b",
                          mode=MODE_LOGITS, out="clogits", part="cpart")
        argmax_stage("coord_argmax", c2, "cpart", c_tiles, 0, c_tiles, OUT_COORD, 0)
        s1 = linear_stage("size_fc1", waits, d, dm.region_inner, "x", "s_fc1_w", "s_fc1_b",
                          act=ACT_GELU_TANH, out="shid")
        s_tiles = len(tiles(dm.size_bins))
        s2 = linear_stage("size_fc2", [s1], dm.region_inner, dm.size_bins, "shid", "s_fc2_w", "s_fc2_b",
                          mode=MODE_LOGITS, out="slogits", part="spart")
        half = s_tiles // 2
        argmax_stage("width_argmax", s2, "spart", s_tiles, 0, half, OUT_WIDTH, 0)
        argmax_stage("height_argmax", s2, "spart", s_tiles, half, half, OUT_HEIGHT, dm.size_bins // 2)
    return g


# ---------------------------------------------------------------------------------------------------
# Host side


def gather_weights(text_w: Any, region_w: Any) -> dict[str, torch.Tensor]:
    """name -> tensor for the weights arena, from moondream text.TextWeights and region.RegionWeights
    (tensors are shared here; the arena copies them)."""
    t: dict[str, torch.Tensor] = {}
    for li, b in enumerate(text_w.blocks):
        L = f"L{li}"
        t.update({f"{L}.ln.w": b.ln[0], f"{L}.ln.b": b.ln[1], f"{L}.qkv_w": b.qkv[0], f"{L}.qkv_b": b.qkv[1],
                  f"{L}.proj_w": b.proj[0], f"{L}.proj_b": b.proj[1], f"{L}.fc1_w": b.fc1[0],
                  f"{L}.fc1_b": b.fc1[1], f"{L}.fc2_w": b.fc2[0], f"{L}.fc2_b": b.fc2[1]})
    t.update({"post_ln.w": text_w.post_ln[0], "post_ln.b": text_w.post_ln[1], "lm_w": text_w.lm_head[0],
              "lm_b": text_w.lm_head[1], "rope_cos": text_w.cos, "rope_sin": text_w.sin,
              "c_fc1_w": region_w.coord_fc1[0], "c_fc1_b": region_w.coord_fc1[1],
              "c_fc2_w": region_w.coord_fc2[0], "c_fc2_b": region_w.coord_fc2[1],
              "s_fc1_w": region_w.size_fc1[0], "s_fc1_b": region_w.size_fc1[1],
              "s_fc2_w": region_w.size_fc2[0], "s_fc2_b": region_w.size_fc2[1]})
    return t


class ArenaKVCache:
    """One row of the megakernel's KV caches in text.KVCache's shape [layers, 1, H, Tmax, Dh]: a view
    into the state arena, so per-op prefill (text.forward) writes straight where the decode step reads."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k, self.v = k, v
        self.length = k.shape[3]


@dataclass
class StepResult:
    tokens: list[int]            # LM argmax under each row's logit bias
    coord_bins: list[int] | None  # region coordinate bin (None without region heads)
    size_bins: list[tuple[int, int]] | None  # (width bin, height bin)
    hidden: torch.Tensor         # [B, D] last hidden state before post_ln (a copy)


class MoondreamDecoderMegakernel(StateViews):
    """Moondream 2's decode step as one persistent launch for a fixed batch bucket.

    Two graphs over the SAME arenas (one copy of the weights, one KV cache): the full step (LM head
    and region heads, for detect/point) and the text step without the region heads (caption/query).

    Usage: mk = MoondreamDecoderMegakernel(model.text_w, model.region_w, model.config, batch=1, max_len=T)
           mk.cache(row).k[:, :, :, :p] = ...          # prefix / prefill K/V of that row
           res = mk.step(embeddings [B, D], positions, bias=None, region_heads=True)
    The launch reads every step-dependent value (input embeddings, positions, logit bias) from device
    buffers written before it, so it can be captured in a CUDA graph and replayed.
    """

    def __init__(self, text_w: Any, region_w: Any, cfg: Any, batch: int, max_len: int | None = None,
                 tiling: Tiling = Tiling(), check: bool = True, weight_dtype: torch.dtype = torch.float32,
                 weights: torch.Tensor | None = None) -> None:
        if batch not in BATCH_BUCKETS:
            raise ValueError(f"batch {batch} is not a bucket {BATCH_BUCKETS}; pad rows up to the next bucket")
        dm = dims_of(cfg)
        max_len = dm.max_context if max_len is None else max_len
        if not 0 < max_len <= dm.max_context:
            raise ValueError(f"max_len {max_len} must be in (0, {dm.max_context}] (the rotary table)")
        dev = text_w.wte.device
        self.dm, self.batch, self.max_len, self.tiling = dm, batch, max_len, tiling
        tensors = gather_weights(text_w, region_w)
        wa, sa, shapes = plan_arenas(dm, batch, max_len, tiling, tensors)
        if weights is not None:
            # Another bucket's weight arena: the layout does not depend on the batch, so every
            # bucket of one model shares one copy of the weights.
            if weights.numel() != wa.size or weights.dtype != weight_dtype:
                raise ValueError("shared weight arena does not match this model's layout and dtype")
            self.weights = weights
        else:
            # bf16/fp16 weights halve the bytes a step streams; all math and the state stay fp32.
            self.weights = torch.zeros(wa.size, dtype=weight_dtype, device=dev)
            for k, t in tensors.items():
                off, n = wa.regions[k]
                self.weights[off:off + n] = t.detach().reshape(-1).to(weight_dtype)
        self.shapes = shapes
        self.state = torch.zeros(sa.size, dtype=torch.float32, device=dev)
        self.dyn = torch.zeros(2 * batch, dtype=torch.int32, device=dev)
        self.out = torch.zeros(batch * OUT_COLS, dtype=torch.int32, device=dev)
        self.warena, self.sarena = wa, sa
        max_tiles = max(-(-n // tiling.block_n) for n in (dm.vocab, dm.coord_bins, dm.size_bins))
        self.graphs: dict[bool, TaskGraph] = {}
        self.kernels: dict[bool, _MoondreamKernel] = {}
        for region_heads in (True, False):
            g = build_graph(dm, batch, max_len, tiling, wa, sa, region_heads)
            self.graphs[region_heads] = g
            self.kernels[region_heads] = _MoondreamKernel(
                g, self.weights, self.state, self.dyn, self.out, block_m=batch, block_n=tiling.block_n,
                block_k=tiling.block_k, block_t=tiling.block_t, head_dim=dm.head_dim,
                max_splits=tiling.splits, max_tiles=max_tiles)
        self.check = check

    @property
    def graph(self) -> TaskGraph:
        """The full graph (with region heads)."""
        return self.graphs[True]

    def weight_bytes_per_step(self, region_heads: bool = True) -> int:
        """Bytes of weights one step must stream (the roofline floor's numerator): every weight once,
        except the rotary tables (one row per step) and, for text steps, the region heads."""
        skip = {"rope_cos", "rope_sin"} | (set() if region_heads else
                                           {k for k in self.warena.regions if k.startswith(("c_", "s_"))})
        n = sum(numel for k, (_, numel) in self.warena.regions.items() if k not in skip)
        return n * self.weights.element_size()


    def cache(self, row: int) -> ArenaKVCache:
        return ArenaKVCache(self.view("kcache")[:, row:row + 1], self.view("vcache")[:, row:row + 1])

    def set_bias(self, bias: torch.Tensor | None) -> None:
        """Per-row logit bias [B, vocab] or [vocab], float (added: 0 allowed, -inf masked) or bool (an
        allowed-token mask, turned into 0 / -inf); None clears it."""
        lb = self.view("logit_bias")
        if bias is None:
            lb.zero_()
            return
        bias = bias.to(lb.device)
        if bias.dtype == torch.bool:
            bias = torch.zeros(bias.shape, device=lb.device).masked_fill(~bias, float("-inf"))
        lb.copy_(bias.to(torch.float32).expand_as(lb))

    def launch(self, embeddings: torch.Tensor, positions: list[int] | torch.Tensor, region_heads: bool = True) -> None:
        """Write the inputs and run one step (no host sync unless `check`)."""
        B, d = self.batch, self.dm.d
        if tuple(embeddings.shape) != (B, d):
            raise ValueError(f"need embeddings [{B}, {d}], got {tuple(embeddings.shape)}")
        pos = torch.as_tensor(positions, dtype=torch.int32)
        if pos.numel() != B or int(pos.min()) < 0 or int(pos.max()) >= self.max_len:
            raise ValueError(f"need {B} positions in [0, {self.max_len})")
        self.view("x").copy_(embeddings.to(torch.float32))
        self.dyn[B:2 * B] = pos.to(self.dyn.device)
        kernel = self.kernels[region_heads]
        kernel.launch()
        if self.check:
            kernel.raise_on_error()

    def step(self, embeddings: torch.Tensor, positions: list[int] | torch.Tensor,
             bias: torch.Tensor | None = None, region_heads: bool = True) -> StepResult:
        """Decode one position per row; `bias` (optional) replaces the logit bias first. Without
        `region_heads` the text graph runs and the bins are None."""
        if bias is not None:
            self.set_bias(bias)
        self.launch(embeddings, positions, region_heads)
        out = self.out.view(self.batch, OUT_COLS).tolist()
        return StepResult([o[OUT_TOKEN] for o in out],
                          [o[OUT_COORD] for o in out] if region_heads else None,
                          [(o[OUT_WIDTH], o[OUT_HEIGHT]) for o in out] if region_heads else None,
                          self.view("x").clone())


def reference_step(text_w: Any, region_w: Any, cfg: Any, caches: list[Any], embeddings: torch.Tensor,
                   positions: list[int],
                   bias: torch.Tensor | None = None) -> dict[str, Any]:
    """The same step with backends.reference ops, one row at a time through the model's own
    text.forward (which appends to each row's cache) and region decoders' math. Returns hidden [B, D],
    logits [B, V] (bias added), tokens, coord bins and size bins."""
    from photon_core.models.moondream import text as text_mod
    hidden, logits, tokens, cbins, sbins = [], [], [], [], []
    for r, p in enumerate(positions):
        h = text_mod.forward(embeddings[r].view(1, 1, -1), p, text_w, cfg.text, caches[r], ref)[:, -1]
        lg = text_mod.lm_logits(h, text_w, ref)[0]
        if bias is not None:
            lg = lg + bias[r] if bias.dim() == 2 else lg + bias
        c = ref.linear(ref.linear(h, *region_w.coord_fc1, activation="gelu_tanh"), *region_w.coord_fc2)
        s = ref.linear(ref.linear(h, *region_w.size_fc1, activation="gelu_tanh"), *region_w.size_fc2)
        hidden.append(h[0])
        logits.append(lg)
        tokens.append(int(lg.argmax()))
        cbins.append(int(c.argmax()))
        sb = s.view(2, -1).argmax(-1)
        sbins.append((int(sb[0]), int(sb[1])))
    return dict(hidden=torch.stack(hidden), logits=torch.stack(logits), tokens=tokens, coord_bins=cbins,
                size_bins=sbins)
