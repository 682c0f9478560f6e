"""Whisper's decoder step, stated once as a step graph that megakernel.compiler lowers.

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

Cross-attention K/V are computed once per utterance (`set_encoder_output`) outside the step, as
Whisper does; the step graph declares them as caches the host fills.

`reference_step` is the same step written with backends.reference ops, the ground truth for tests;
`triton_perop_step` is the per-op Triton baseline (device-side positions, so it is graph-capturable).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields
from types import ModuleType
from typing import Any

import torch

from photon_core.backends import reference as ref
from photon_core.megakernel.compiler import CompiledStep, Tiling
from photon_core.megakernel.stepgraph import StepGraph


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
    def from_whisper(weights: Any) -> "WhisperDecoderWeights":
        """The decoder half of photon_core.models.whisper.model.WhisperWeights (duck-typed: dec_blocks
        with fused qkv / cross_kv, tok_emb, dec_pos, dec_ln, dims.n_text_head). Tensors are shared,
        not copied; the megakernel copies them into its arena."""
        def lin(x: Any) -> tuple[torch.Tensor, torch.Tensor]:
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
        """Bytes a decode step must read: its step graph's count (the tied LM head reads the token
        embedding whole; cross K/V projections run once per utterance, outside the step)."""
        return step_graph(self, self.positional_embedding.shape[0], 1).weight_bytes(
            self.token_embedding.element_size())


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
# The step graph, stated once; megakernel.compiler lowers it


def step_weights(wt: WhisperDecoderWeights) -> dict[str, torch.Tensor]:
    """name -> tensor of every weight the step reads (shared with `wt`, not copied)."""
    t = {"tok_emb": wt.token_embedding, "pos_emb": wt.positional_embedding, "ln_f.w": wt.ln_w, "ln_f.b": wt.ln_b}
    for li, lw in enumerate(wt.layers):
        t.update({f"L{li}.{f.name}": getattr(lw, f.name) for f in fields(lw) if not f.name.startswith("cross_kv")})
    return t


def step_graph(wt: WhisperDecoderWeights, max_len: int, enc_len: int, advance: bool = False,
               logit_bias: bool = False) -> StepGraph:
    """Whisper's decoder step (module docstring) as a graph of ops. Works on meta tensors, so real
    sizes can be compiled and proven without their memory."""
    d, h = wt.d_model, wt.n_heads
    g = StepGraph(f"whisper-decoder-d{d}-L{len(wt.layers)}-V{wt.vocab}",
                  {k: tuple(t.shape) for k, t in step_weights(wt).items()})
    x = g.embed("x0", "tok_emb", "pos_emb")
    for li in range(len(wt.layers)):
        L = f"L{li}"
        kc, vc = g.cache(f"{L}.kcache", h, max_len, d // h), g.cache(f"{L}.vcache", h, max_len, d // h)
        xk, xv = g.cache(f"{L}.xk", h, enc_len, d // h), g.cache(f"{L}.xv", h, enc_len, d // h)
        qkv = g.linear(f"{L}.qkv", g.layer_norm(f"{L}.attn_ln", x, f"{L}.attn_ln_w", f"{L}.attn_ln_b"),
                       f"{L}.qkv_w", f"{L}.qkv_b")
        q = g.kv_append(f"{L}.q", qkv, kc, vc)
        a = g.attention(f"{L}.self_attn", q, kc, vc, "self")
        x = g.linear(f"{L}.self_out", a, f"{L}.out_w", f"{L}.out_b", residual=x)
        cq = g.linear(f"{L}.cross_q", g.layer_norm(f"{L}.cross_ln", x, f"{L}.cross_ln_w", f"{L}.cross_ln_b"),
                      f"{L}.cross_q_w", f"{L}.cross_q_b")
        c = g.attention(f"{L}.cross_attn", cq, xk, xv, "cross")
        x = g.linear(f"{L}.cross_out", c, f"{L}.cross_out_w", f"{L}.cross_out_b", residual=x)
        hid = g.linear(f"{L}.mlp_up", g.layer_norm(f"{L}.mlp_ln", x, f"{L}.mlp_ln_w", f"{L}.mlp_ln_b"),
                       f"{L}.fc1_w", f"{L}.fc1_b", act="gelu")
        x = g.linear(f"{L}.mlp_down", hid, f"{L}.fc2_w", f"{L}.fc2_b", residual=x)
    bias = g.input("logit_bias", wt.vocab) if logit_bias else None
    logits = g.linear("logits", g.layer_norm("ln_f", x, "ln_f.w", "ln_f.b"), "tok_emb", residual=bias)
    g.expose("logits", logits)
    g.argmax("token", logits, advance=advance)
    return g


class WhisperDecoderMegakernel(CompiledStep):
    """Whisper's decoder step as one persistent launch, for a fixed batch bucket.

    Usage: mk = WhisperDecoderMegakernel(weights, batch=1, max_len=448, enc_len=1500)
           mk.set_encoder_output(enc)            # [B, T_enc, D], once per utterance
           tokens = mk.step(tokens, positions)   # returns argmax tokens; mk.logits holds [B, V]
    """

    def __init__(self, wt: WhisperDecoderWeights, batch: int, max_len: int, enc_len: int,
                 tiling: Tiling = Tiling(), advance: bool = False, logit_bias: bool = False,
                 check: bool = True, weight_dtype: torch.dtype = torch.float32,
                 shared_weights: torch.Tensor | None = None) -> None:
        """shared_weights: another bucket's weights arena (one copy of the weights for all)."""
        d, h = wt.d_model, wt.n_heads
        if d % h:
            raise ValueError(f"d_model {d} not divisible by {h} heads")
        if max_len > wt.positional_embedding.shape[0]:
            raise ValueError(f"max_len {max_len} exceeds the {wt.positional_embedding.shape[0]} learned positions")
        self.wt, self.max_len, self.enc_len = wt, max_len, enc_len
        super().__init__(step_graph(wt, max_len, enc_len, advance, logit_bias), step_weights(wt), batch,
                         tiling, weight_dtype, check=check, shared_weights=shared_weights)

    def set_encoder_output(self, enc: torch.Tensor, lengths: list[int] | None = None) -> None:
        """Cross-attention K/V for all layers from the encoder output [B, T, D], T <= enc_len."""
        b, t, d = enc.shape
        if b != self.batch or t > self.enc_len or d != self.wt.d_model:
            raise ValueError(f"encoder output {tuple(enc.shape)} does not fit batch {self.batch}, "
                             f"enc_len {self.enc_len}, d {self.wt.d_model}")
        for li, (k, v) in enumerate(reference_cross_kv(self.wt, enc.float())):
            self.view(f"L{li}.xk")[:, :, :t] = k
            self.view(f"L{li}.xv")[:, :, :t] = v
        self.set_cross_len(lengths if lengths is not None else [t] * b)

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
        self.set_cross_len(lengths if lengths is not None else [t] * self.batch)

    def step(self, tokens: list[int] | torch.Tensor, positions: list[int] | torch.Tensor) -> torch.Tensor:
        """Decode one token per row; returns the argmax tokens [B] (int32, on the device)."""
        self.set_step(tokens, positions)
        self.launch()
        return self.out
