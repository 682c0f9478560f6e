"""Whisper's decoder step as a megakernel task graph.

Per step, for B rows (batch bucket 1/2/4/8; rows at their own positions):
    x = tok_emb[token] + pos_emb[position]
    per layer:  q,k,v = LN1(x) @ Wqkv.T + b   (k, v appended to the self KV cache at `position`)
                a = softmax(q k^T / sqrt(Dh)) v over positions 0..position  (split-KV partials + merge)
                x = x + a @ Wo.T + bo
                cq = LN2(x) @ Wcq.T + bcq
                c = softmax(cq K_enc^T / sqrt(Dh)) V_enc over the encoder frames (partials + merge)
                x = x + c @ Wco.T + bco
                x = x + GELU(LN3(x) @ W1.T + b1) @ W2.T + b2
    logits = LN_f(x) @ tok_emb.T (+ optional per-row logit bias); token = argmax(logits)

Task kinds: embed tiles; linear tiles (LN fused in front; bias/GELU/residual fused behind; QKV tiles
write q and append k/v to the cache; LM-head tiles also emit per-tile (max, index)); attention partials
per (row, head, split) and merges per (row, head); one argmax reduction. Cross-attention K/V are computed
once per utterance (`set_encoder_output`) outside the step, as Whisper does.

`reference_step` is the same step written with backends.reference ops, the ground truth for tests;
`triton_perop_step` is the per-op Triton baseline (device-side positions, so it is graph-capturable).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields
from types import ModuleType

import torch

from photon_core.backends import reference as ref
from photon_core.megakernel.graph import (LEN_CROSS, LEN_SELF, MODE_LOGITS, MODE_PLAIN, MODE_QKV, OP_ARGMAX_REDUCE,
                                          OP_ATTN_MERGE, OP_ATTN_PARTIAL, OP_EMBED, OP_LINEAR, BATCH_BUCKETS, Arena,
                                          Region, StateViews, Task, TaskGraph)


@dataclass
class DecoderLayerWeights:
    attn_ln_w: torch.Tensor
    attn_ln_b: torch.Tensor
    qkv_w: torch.Tensor      # [3D, D]: rows q, k, v (openai's key has no bias: zeros in qkv_b)
    qkv_b: torch.Tensor
    out_w: torch.Tensor
    out_b: torch.Tensor
    cross_ln_w: torch.Tensor
    cross_ln_b: torch.Tensor
    cross_q_w: torch.Tensor
    cross_q_b: torch.Tensor
    cross_kv_w: torch.Tensor  # [2D, D]: rows k, v (applied to the encoder output once per utterance)
    cross_kv_b: torch.Tensor
    cross_out_w: torch.Tensor
    cross_out_b: torch.Tensor
    mlp_ln_w: torch.Tensor
    mlp_ln_b: torch.Tensor
    fc1_w: torch.Tensor
    fc1_b: torch.Tensor
    fc2_w: torch.Tensor
    fc2_b: torch.Tensor


@dataclass
class WhisperDecoderWeights:
    token_embedding: torch.Tensor       # [V, D], also the (tied) output projection
    positional_embedding: torch.Tensor  # [n_ctx, D]
    layers: list[DecoderLayerWeights]
    ln_w: torch.Tensor
    ln_b: torch.Tensor
    n_heads: int

    @property
    def d_model(self) -> int:
        return self.token_embedding.shape[1]

    @property
    def vocab(self) -> int:
        return self.token_embedding.shape[0]

    @staticmethod
    def random(d_model: int = 384, n_heads: int = 6, n_layers: int = 4, vocab: int = 51864,
               n_ctx: int = 448, seed: int = 0, device: torch.device | str = "cpu") -> "WhisperDecoderWeights":
        """Random weights of the given shapes (tiny.en by default), scaled so activations stay O(1)."""
        g = torch.Generator().manual_seed(seed)
        d = d_model

        def w(*shape: int, scale: float | None = None) -> torch.Tensor:
            s = scale if scale is not None else 1.0 / math.sqrt(shape[-1])
            return (torch.randn(*shape, generator=g) * s).to(device)

        def ln() -> tuple[torch.Tensor, torch.Tensor]:
            return (1 + 0.1 * torch.randn(d, generator=g)).to(device), (0.1 * torch.randn(d, generator=g)).to(device)

        layers = []
        for _ in range(n_layers):
            a, c, m = ln(), ln(), ln()
            qkv_b = w(3 * d, scale=0.1)
            qkv_b[d:2 * d] = 0
            kv_b = w(2 * d, scale=0.1)
            kv_b[:d] = 0
            layers.append(DecoderLayerWeights(
                a[0], a[1], w(3 * d, d), qkv_b, w(d, d), w(d, scale=0.1),
                c[0], c[1], w(d, d), w(d, scale=0.1), w(2 * d, d), kv_b, w(d, d), w(d, scale=0.1),
                m[0], m[1], w(4 * d, d), w(4 * d, scale=0.1), w(d, 4 * d), w(d, scale=0.1)))
        f = ln()
        return WhisperDecoderWeights(w(vocab, d, scale=0.2), w(n_ctx, d, scale=0.2), layers, f[0], f[1], n_heads)

    @staticmethod
    def from_whisper(weights: object) -> "WhisperDecoderWeights":
        """The decoder half of photon_core.models.whisper.model.WhisperWeights (duck-typed: dec_blocks
        with fused qkv / cross_kv, tok_emb, dec_pos, dec_ln, dims.n_text_head). Tensors are shared,
        not copied; the megakernel copies them into its arena."""
        def lin(x: object) -> tuple[torch.Tensor, torch.Tensor]:
            b = x.bias if x.bias is not None else torch.zeros(x.weight.shape[0], dtype=x.weight.dtype,
                                                                device=x.weight.device)
            return x.weight, b

        layers = []
        for blk in weights.dec_blocks:
            layers.append(DecoderLayerWeights(
                blk.attn_ln.weight, blk.attn_ln.bias, *lin(blk.qkv), *lin(blk.attn_out),
                blk.cross_ln.weight, blk.cross_ln.bias, *lin(blk.cross_q), *lin(blk.cross_kv),
                *lin(blk.cross_out), blk.mlp_ln.weight, blk.mlp_ln.bias, *lin(blk.fc1), *lin(blk.fc2)))
        return WhisperDecoderWeights(weights.tok_emb.contiguous(), weights.dec_pos, layers, weights.dec_ln.weight,
                                     weights.dec_ln.bias, int(weights.dims.n_text_head))

    def weight_bytes_per_step(self) -> int:
        """Bytes a decode step must read (each weight once; embeddings: the LM head reads them all;
        cross K/V projections are per utterance, not per step)."""
        n = self.token_embedding.numel() + self.ln_w.numel() + self.ln_b.numel()
        for lw in self.layers:
            n += sum(getattr(lw, f.name).numel() for f in fields(lw) if not f.name.startswith("cross_kv"))
        return n * self.token_embedding.element_size()


# ---------------------------------------------------------------------------------------------------
# Reference and per-op steps


def reference_cross_kv(wt: WhisperDecoderWeights, enc: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (K, V) [B, H, T_enc, Dh] from the encoder output enc [B, T_enc, D]."""
    b, t, d = enc.shape
    h = wt.n_heads
    out = []
    for lw in wt.layers:
        kv = ref.linear(enc, lw.cross_kv_w, lw.cross_kv_b)
        k, v = kv[..., :d], kv[..., d:]
        out.append((k.view(b, t, h, d // h).transpose(1, 2).contiguous(),
                    v.view(b, t, h, d // h).transpose(1, 2).contiguous()))
    return out


def reference_step(wt: WhisperDecoderWeights, tokens: list[int], positions: list[int],
                   self_kv: list[tuple[torch.Tensor, torch.Tensor]],
                   cross_kv: list[tuple[torch.Tensor, torch.Tensor]],
                   cross_len: list[int] | None = None) -> torch.Tensor:
    """One decode step with backends.reference ops; self_kv caches [B, H, Tmax, Dh] are updated in
    place at `positions`. Returns logits [B, V]."""
    d, h = wt.d_model, wt.n_heads
    dh = d // h
    bsz = len(tokens)
    dev = wt.token_embedding.device
    tok = torch.tensor(tokens, device=dev)
    pos = torch.tensor(positions, device=dev)
    x = wt.token_embedding[tok] + wt.positional_embedding[pos]
    for lw, (kc, vc), (ck, cv) in zip(wt.layers, self_kv, cross_kv):
        qkv = ref.linear(ref.layer_norm(x, lw.attn_ln_w, lw.attn_ln_b), lw.qkv_w, lw.qkv_b)
        q, k, v = (qkv[:, i * d:(i + 1) * d].view(bsz, h, 1, dh) for i in range(3))
        att = []
        for r, p in enumerate(positions):
            kc[r, :, p] = k[r, :, 0]
            vc[r, :, p] = v[r, :, 0]
            att.append(ref.attention(q[r:r + 1], kc[r:r + 1, :, :p + 1], vc[r:r + 1, :, :p + 1], causal=True))
        x = ref.linear(torch.cat(att).reshape(bsz, d), lw.out_w, lw.out_b, residual=x)
        cq = ref.linear(ref.layer_norm(x, lw.cross_ln_w, lw.cross_ln_b), lw.cross_q_w, lw.cross_q_b)
        cq = cq.view(bsz, h, 1, dh)
        catt = []
        for r in range(bsz):
            n = ck.shape[2] if cross_len is None else cross_len[r]
            catt.append(ref.attention(cq[r:r + 1], ck[r:r + 1, :, :n], cv[r:r + 1, :, :n]))
        x = ref.linear(torch.cat(catt).reshape(bsz, d), lw.cross_out_w, lw.cross_out_b, residual=x)
        hid = ref.linear(ref.layer_norm(x, lw.mlp_ln_w, lw.mlp_ln_b), lw.fc1_w, lw.fc1_b, activation="gelu")
        x = ref.linear(hid, lw.fc2_w, lw.fc2_b, residual=x)
    return ref.linear(ref.layer_norm(x, wt.ln_w, wt.ln_b), wt.token_embedding)


def triton_perop_step(ops: ModuleType, wt: WhisperDecoderWeights, tokens: torch.Tensor, positions: torch.Tensor,
                      self_kv: list[tuple[torch.Tensor, torch.Tensor]],
                      cross_kv: list[tuple[torch.Tensor, torch.Tensor]], cross_len: torch.Tensor,
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """The same step from per-op kernels (the triton backend); tokens/positions/cross_len are device
    tensors, so the whole step can be captured in a CUDA graph. Returns (logits, argmax)."""
    d, h = wt.d_model, wt.n_heads
    dh = d // h
    bsz = tokens.shape[0]
    pos = positions.long()
    x = wt.token_embedding[tokens.long()] + wt.positional_embedding[pos]
    lengths = positions.to(torch.int32) + 1
    for lw, (kc, vc), (ck, cv) in zip(wt.layers, self_kv, cross_kv):
        qkv = ops.linear(ops.layer_norm(x, lw.attn_ln_w, lw.attn_ln_b), lw.qkv_w, lw.qkv_b)
        q, k, v = (qkv[:, i * d:(i + 1) * d].reshape(bsz, h, 1, dh) for i in range(3))
        ops.kv_append(kc, vc, k, v, positions)
        a = ops.decode_attention(q, kc, vc, lengths)
        x = ops.linear(a.reshape(bsz, d), lw.out_w, lw.out_b, residual=x)
        cq = ops.linear(ops.layer_norm(x, lw.cross_ln_w, lw.cross_ln_b), lw.cross_q_w, lw.cross_q_b)
        c = ops.decode_attention(cq.reshape(bsz, h, 1, dh), ck, cv, cross_len)
        x = ops.linear(c.reshape(bsz, d), lw.cross_out_w, lw.cross_out_b, residual=x)
        hid = ops.linear(ops.layer_norm(x, lw.mlp_ln_w, lw.mlp_ln_b), lw.fc1_w, lw.fc1_b, activation="gelu")
        x = ops.linear(hid, lw.fc2_w, lw.fc2_b, residual=x)
    logits = ops.linear(ops.layer_norm(x, wt.ln_w, wt.ln_b), wt.token_embedding)
    return logits, ops.argmax(logits)


# ---------------------------------------------------------------------------------------------------
# The graph


@dataclass(frozen=True)
class Tiling:
    block_n: int = 32        # output features per linear / embed task
    block_k: int = 64        # K step inside a linear task
    block_t: int = 32        # keys per attention inner step
    self_splits: int = 4     # KV splits of self-attention (per row and head)
    cross_splits: int = 8    # KV splits of cross-attention


def build_graph(wt: WhisperDecoderWeights, batch: int, max_len: int, enc_len: int, tiling: Tiling,
                warena: Arena, sarena: Arena, advance: bool = False,
                logit_bias: bool = False) -> TaskGraph:
    """The task graph of one decode step. The arenas must already hold the regions named here
    (WhisperDecoderMegakernel allocates them)."""
    d, h, v = wt.d_model, wt.n_heads, wt.vocab
    dh = d // h
    bn = tiling.block_n
    B = batch
    g = TaskGraph(model=f"whisper-decoder-d{d}-L{len(wt.layers)}-V{v}", batch=B)
    dyn_tok, dyn_pos, dyn_xlen = Region("dyn", 0, B), Region("dyn", B, 2 * B), Region("dyn", 2 * B, 3 * B)
    S = sarena

    def tiles(n: int) -> range:
        return range(0, n, bn)

    def cache_cols(key: str, r: int, c0: int, c1: int) -> Region:
        """Feature columns [c0, c1) (head-major, as in the projection) of row r of a KV cache, at ANY
        position. Positions are dynamic, so cache accesses are declared in this position-free view:
        two accesses can touch the same memory exactly when their (row, column) sets overlap."""
        return Region(f"{key}@cols", r * d + c0, r * d + c1)

    # Per-head counters need every projection tile inside one head's columns.
    heads_split = dh % bn == 0

    def linear_stage(name: str, wait: str, K: int, N: int, x: str, w: str, b: str | None,
                     ln: str | None = None, act: int = 0, res: str | None = None, mode: int = MODE_PLAIN,
                     out: str = "", extra: dict[str, int] | None = None,
                     extra_writes=None, extra_reads=None, per_head: bool = False) -> str:
        """One task per output tile. With `per_head` (and tiles that never straddle a head), tiles
        signal one counter per attention head ("name.hN"): that head's attention can start as soon
        as its own q/k/v columns are done instead of waiting for the whole projection."""
        sig = g.counter(name)
        n_tasks = len(tiles(N))
        wait_target = g.signalers(wait)
        for i, n0 in enumerate(tiles(N)):
            n1 = min(N, n0 + bn)
            args = dict(M=B, K=K, N=N, n0=n0, x=S.off(x), w=warena.off(w),
                        b=warena.off(b) if b else -1, lnw=warena.off(ln + ".w") if ln else -1,
                        lnb=warena.off(ln + ".b") if ln else -1, act=act, res=S.off(res) if res else -1,
                        mode=mode, out=S.off(out))
            args.update(extra or {})
            reads = [S.region(x)] + (S.columns(res, B, N, n0, n1) if res else [])
            writes = S.columns(out, B, N, n0, n1) if mode != MODE_QKV else []
            if extra_writes:
                writes += extra_writes(i, n0, n1)
            if extra_reads:
                reads += extra_reads(i, n0, n1)
            tile_sig = g.counter(f"{name}.h{(n0 % d) // dh}") if per_head and heads_split else sig
            g.add(Task(f"{name}[{n0}:{n1}]", OP_LINEAR, args, [(wait, wait_target)], tile_sig, reads, writes))
        if not (per_head and heads_split):
            assert g.signalers(sig) == n_tasks
        return sig

    def attention_stage(name: str, wait: str, q: str, kc: str, vc: str, tmax: int, splits: int,
                        kind: int, part: str, out: str) -> str:
        sig_p = g.counter(name + ".part")
        waits = [f"{wait}.h{hh}" if heads_split else wait for hh in range(h)]
        targets = [g.signalers(c) for c in waits]
        for r in range(B):
            for hh in range(h):
                head_wait = [(waits[hh], targets[hh])]
                for s in range(splits):
                    p0 = ((r * h + hh) * splits + s) * (dh + 2)
                    g.add(Task(f"{name}.part[b{r},h{hh},s{s}]", OP_ATTN_PARTIAL,
                               dict(x=S.off(q), K=d, kc=S.off(kc), vc=S.off(vc), H=h, Dh=dh, Tmax=tmax,
                                    part=S.off(part), bi=r, hi=hh, s=s, S=splits, lenkind=kind),
                               head_wait, sig_p,
                               [S.region(q, r * d + hh * dh, r * d + (hh + 1) * dh),
                                cache_cols(kc, r, hh * dh, (hh + 1) * dh), cache_cols(vc, r, hh * dh, (hh + 1) * dh),
                                dyn_pos if kind == LEN_SELF else dyn_xlen],
                               [S.region(part, p0, p0 + dh + 2)]))
        sig = g.counter(name)
        n_part = g.signalers(sig_p)
        for r in range(B):
            for hh in range(h):
                p0 = (r * h + hh) * splits * (dh + 2)
                g.add(Task(f"{name}.merge[b{r},h{hh}]", OP_ATTN_MERGE,
                           dict(K=d, out=S.off(out), H=h, Dh=dh, part=S.off(part), bi=r, hi=hh, S=splits),
                           [(sig_p, n_part)], sig,
                           [S.region(part, p0, p0 + splits * (dh + 2))],
                           [S.region(out, r * d + hh * dh, r * d + (hh + 1) * dh)]))
        return sig

    sig = g.counter("embed")
    for n0 in tiles(d):
        n1 = min(d, n0 + bn)
        g.add(Task(f"embed[{n0}:{n1}]", OP_EMBED,
                   dict(M=B, N=d, n0=n0, w=warena.off("tok_emb"), b=warena.off("pos_emb"), out=S.off("x")),
                   [], sig, [dyn_tok, dyn_pos], S.columns("x", B, d, n0, n1)))
    prev = sig
    for li in range(len(wt.layers)):
        L = f"L{li}"
        kc, vc = f"{L}.kcache", f"{L}.vcache"

        def kv_writes(i: int, n0: int, n1: int, kc: str = kc, vc: str = vc) -> list[Region]:
            regs = []
            for c0, c1, key in ((0, d, "q"), (d, 2 * d, kc), (2 * d, 3 * d, vc)):
                lo, hi = max(n0, c0), min(n1, c1)
                if lo >= hi:
                    continue
                if key == "q":
                    regs += S.columns("q", B, d, lo - c0, hi - c0)
                else:
                    regs += [cache_cols(key, r, lo - c0, hi - c0) for r in range(B)]
            return regs

        qkv = linear_stage(f"{L}.qkv", prev, d, 3 * d, "x", f"{L}.qkv_w", f"{L}.qkv_b", ln=f"{L}.attn_ln",
                           mode=MODE_QKV, out="q",
                           extra=dict(kc=S.off(kc), vc=S.off(vc), H=h, Dh=dh, Tmax=max_len),
                           extra_writes=kv_writes, extra_reads=lambda i, n0, n1: [dyn_pos], per_head=True)
        sa = attention_stage(f"{L}.self_attn", qkv, "q", kc, vc, max_len, tiling.self_splits, LEN_SELF,
                             "self_part", "attn")
        so = linear_stage(f"{L}.self_out", sa, d, d, "attn", f"{L}.out_w", f"{L}.out_b", res="x", out="x")
        cq = linear_stage(f"{L}.cross_q", so, d, d, "x", f"{L}.cross_q_w", f"{L}.cross_q_b",
                          ln=f"{L}.cross_ln", out="cq", per_head=True)
        ca = attention_stage(f"{L}.cross_attn", cq, "cq", f"{L}.xk", f"{L}.xv", enc_len, tiling.cross_splits,
                             LEN_CROSS, "cross_part", "cattn")
        co = linear_stage(f"{L}.cross_out", ca, d, d, "cattn", f"{L}.cross_out_w", f"{L}.cross_out_b",
                          res="x", out="x")
        up = linear_stage(f"{L}.mlp_up", co, d, 4 * d, "x", f"{L}.fc1_w", f"{L}.fc1_b", ln=f"{L}.mlp_ln",
                          act=1, out="hid")
        prev = linear_stage(f"{L}.mlp_down", up, 4 * d, d, "hid", f"{L}.fc2_w", f"{L}.fc2_b", res="x", out="x")

    ntiles = len(tiles(v))

    def lm_writes(i: int, n0: int, n1: int) -> list[Region]:
        return [S.region("argmax_part", (r * ntiles + i) * 2, (r * ntiles + i) * 2 + 2) for r in range(B)]

    def lm_reads(i: int, n0: int, n1: int) -> list[Region]:
        return S.columns("logit_bias", B, v, n0, n1) if logit_bias else []

    lm = linear_stage("lm_head", prev, d, v, "x", "tok_emb", None, ln="ln_f", mode=MODE_LOGITS, out="logits",
                      extra=dict(ntiles=ntiles, part=S.off("argmax_part"),
                                 rb=S.off("logit_bias") if logit_bias else -1),
                      extra_writes=lm_writes, extra_reads=lm_reads)
    # The LM tiles need their own index: linear_stage numbers tasks in order, patch it in.
    for i, t in enumerate(g.tasks[-ntiles:]):
        t.args["tile"] = i
    g.add(Task("argmax", OP_ARGMAX_REDUCE,
               dict(M=B, N=v, part=S.off("argmax_part"), ntiles=ntiles, mode=1 if advance else 0),
               [(lm, g.signalers(lm))], None, [S.region("argmax_part")],
               [Region("out", 0, B)] + ([dyn_tok, dyn_pos] if advance else [])))
    if advance:
        # The reduction overwrites tokens/positions: declare the reads it must come after.
        g.tasks[-1].reads += [dyn_tok, dyn_pos]
    return g


def plan_arenas(wt: WhisperDecoderWeights, batch: int, max_len: int, enc_len: int, tiling: Tiling,
                logit_bias: bool = False) -> tuple[Arena, Arena, dict[str, torch.Tensor], dict[str, tuple[int, ...]]]:
    """Where every weight and state tensor lives in the two flat arenas (no memory allocated): the
    weights to copy in, and the state shapes. Works on meta tensors, so graphs of real sizes can be
    built and checked without their memory."""
    d, h, v = wt.d_model, wt.n_heads, wt.vocab
    dh = d // h
    wa, sa = Arena("weights"), Arena("state")
    tensors: dict[str, torch.Tensor] = {"tok_emb": wt.token_embedding, "pos_emb": wt.positional_embedding,
                                        "ln_f.w": wt.ln_w, "ln_f.b": wt.ln_b}
    for li, lw in enumerate(wt.layers):
        L = f"L{li}"
        tensors.update({f"{L}.attn_ln.w": lw.attn_ln_w, f"{L}.attn_ln.b": lw.attn_ln_b,
                        f"{L}.qkv_w": lw.qkv_w, f"{L}.qkv_b": lw.qkv_b, f"{L}.out_w": lw.out_w,
                        f"{L}.out_b": lw.out_b, f"{L}.cross_ln.w": lw.cross_ln_w,
                        f"{L}.cross_ln.b": lw.cross_ln_b, f"{L}.cross_q_w": lw.cross_q_w,
                        f"{L}.cross_q_b": lw.cross_q_b, f"{L}.cross_out_w": lw.cross_out_w,
                        f"{L}.cross_out_b": lw.cross_out_b, f"{L}.mlp_ln.w": lw.mlp_ln_w,
                        f"{L}.mlp_ln.b": lw.mlp_ln_b, f"{L}.fc1_w": lw.fc1_w, f"{L}.fc1_b": lw.fc1_b,
                        f"{L}.fc2_w": lw.fc2_w, f"{L}.fc2_b": lw.fc2_b})
    for k, t in tensors.items():
        wa.alloc(k, t.numel())
    ntiles = -(-v // tiling.block_n)
    shapes: dict[str, tuple[int, ...]] = {
        "x": (batch, d), "q": (batch, d), "attn": (batch, d), "cq": (batch, d), "cattn": (batch, d),
        "hid": (batch, 4 * d), "self_part": (batch, h, tiling.self_splits, dh + 2),
        "cross_part": (batch, h, tiling.cross_splits, dh + 2), "logits": (batch, v),
        "argmax_part": (batch, ntiles, 2)}
    if logit_bias:
        shapes["logit_bias"] = (batch, v)
    for li in range(len(wt.layers)):
        shapes.update({f"L{li}.kcache": (batch, h, max_len, dh), f"L{li}.vcache": (batch, h, max_len, dh),
                       f"L{li}.xk": (batch, h, enc_len, dh), f"L{li}.xv": (batch, h, enc_len, dh)})
    for k, shp in shapes.items():
        sa.alloc(k, math.prod(shp))
    return wa, sa, tensors, shapes


class WhisperDecoderMegakernel(StateViews):
    """Whisper's decoder step as one persistent launch, for a fixed batch bucket.

    Usage: mk = WhisperDecoderMegakernel(weights, batch=1, max_len=448, enc_len=1500)
           mk.set_encoder_output(enc)            # [B, T_enc, D], once per utterance
           tokens = mk.step(tokens, positions)   # returns argmax tokens; mk.logits holds [B, V]
    """

    def __init__(self, wt: WhisperDecoderWeights, batch: int, max_len: int, enc_len: int,
                 tiling: Tiling = Tiling(), advance: bool = False, logit_bias: bool = False,
                 check: bool = True, weight_dtype: torch.dtype = torch.float32) -> None:
        if batch not in BATCH_BUCKETS:
            raise ValueError(f"batch {batch} is not a bucket {BATCH_BUCKETS}; pad rows up to the next bucket")
        d, h, v = wt.d_model, wt.n_heads, wt.vocab
        if d % h:
            raise ValueError(f"d_model {d} not divisible by {h} heads")
        if max_len > wt.positional_embedding.shape[0]:
            raise ValueError(f"max_len {max_len} exceeds the {wt.positional_embedding.shape[0]} learned positions")
        dev = wt.token_embedding.device
        self.wt, self.batch, self.max_len, self.enc_len, self.tiling = wt, batch, max_len, enc_len, tiling
        dh = d // h
        wa, sa, tensors, shapes = plan_arenas(wt, batch, max_len, enc_len, tiling, logit_bias)
        # bf16/fp16 weights halve the bytes a step streams; all math and the state stay fp32.
        self.weights = torch.zeros(wa.size, dtype=weight_dtype, device=dev)
        for k, t in tensors.items():
            off, n = wa.regions[k]
            self.weights[off:off + n] = t.detach().reshape(-1).to(weight_dtype)
        ntiles = -(-v // tiling.block_n)
        self.shapes = shapes
        self.state = torch.zeros(sa.size, dtype=torch.float32, device=dev)
        self.dyn = torch.zeros(3 * batch, dtype=torch.int32, device=dev)
        self.out = torch.zeros(batch, dtype=torch.int32, device=dev)
        self.warena, self.sarena = wa, sa
        self.graph = build_graph(wt, batch, max_len, enc_len, tiling, wa, sa, advance, logit_bias)
        from photon_core.megakernel.kernel import Megakernel
        self.kernel = Megakernel(self.graph, self.weights, self.state, self.dyn, self.out,
                                 block_m=batch, block_n=tiling.block_n, block_k=tiling.block_k,
                                 block_t=tiling.block_t, head_dim=dh,
                                 max_splits=max(tiling.self_splits, tiling.cross_splits), max_tiles=ntiles)
        self.check = check


    def set_encoder_output(self, enc: torch.Tensor, lengths: list[int] | None = None) -> None:
        """Cross-attention K/V for all layers from the encoder output [B, T, D], T <= enc_len."""
        b, t, d = enc.shape
        if b != self.batch or t > self.enc_len or d != self.wt.d_model:
            raise ValueError(f"encoder output {tuple(enc.shape)} does not fit batch {self.batch}, "
                             f"enc_len {self.enc_len}, d {self.wt.d_model}")
        for li, (k, v) in enumerate(reference_cross_kv(self.wt, enc.float())):
            self.view(f"L{li}.xk")[:, :, :t] = k
            self.view(f"L{li}.xv")[:, :, :t] = v
        lens = lengths if lengths is not None else [t] * b
        self.dyn[2 * b:3 * b] = torch.tensor(lens, dtype=torch.int32)

    def set_cross_kv(self, cross: list[tuple[torch.Tensor, torch.Tensor]],
                     lengths: list[int] | None = None) -> None:
        """Use cross-attention K/V computed elsewhere (e.g. WhisperNet.new_cache(...).cross):
        per layer (K, V) [B, H, T, Dh], T <= enc_len."""
        if len(cross) != len(self.wt.layers):
            raise ValueError(f"need cross K/V for {len(self.wt.layers)} layers, got {len(cross)}")
        t = cross[0][0].shape[2]
        for li, (k, v) in enumerate(cross):
            if k.shape[0] != self.batch or t > self.enc_len:
                raise ValueError(f"cross K/V {tuple(k.shape)} do not fit batch {self.batch}, enc_len {self.enc_len}")
            self.view(f"L{li}.xk")[:, :, :t] = k.float()
            self.view(f"L{li}.xv")[:, :, :t] = v.float()
        lens = lengths if lengths is not None else [t] * self.batch
        self.dyn[2 * self.batch:3 * self.batch] = torch.tensor(lens, dtype=torch.int32)

    def set_step(self, tokens: list[int] | torch.Tensor, positions: list[int] | torch.Tensor) -> None:
        tok = torch.as_tensor(tokens, dtype=torch.int32)
        pos = torch.as_tensor(positions, dtype=torch.int32)
        if tok.numel() != self.batch or pos.numel() != self.batch:
            raise ValueError(f"need {self.batch} tokens and positions")
        if int(pos.max()) >= self.max_len or int(pos.min()) < 0:
            raise ValueError(f"positions must be in [0, {self.max_len})")
        self.dyn[:self.batch] = tok.to(self.dyn.device)
        self.dyn[self.batch:2 * self.batch] = pos.to(self.dyn.device)

    def step(self, tokens: list[int] | torch.Tensor, positions: list[int] | torch.Tensor) -> torch.Tensor:
        """Decode one token per row; returns the argmax tokens [B] (int32, on the device)."""
        self.set_step(tokens, positions)
        self.kernel.launch()
        if self.check:
            self.kernel.raise_on_error()
        return self.out
