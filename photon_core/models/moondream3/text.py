"""Moondream 3's text decoder: Moondream 2's parallel block with MoE layers and tau attention.

Per layer, h = LayerNorm(x) feeds both branches and x <- x + proj(attn(h)) + mlp(h), as in Moondream 2
(whose `attend` does the partial rotary, the KV cache and the prefix-bidirectional attention):
- mlp: Moondream 2's dense GELU MLP on layers < moe.start_layer; after that a mixture of experts:
  router logits = h @ W_r.T + b_r, top-k experts, softmax over the k chosen logits, each expert a
  gated GELU gelu(h @ G_e.T) * (h @ U_e.T + 1) followed by D_e (ops.moe, activation "gelu",
  up_offset 1.0).
- tau attention: with qkv = h @ W_qkv.T + b and n = heads,
      t = tanh(gelu(qkv) @ tau_wqwv.T)                       [.., 2n]: t_q = t[:n], t_v = t[n:]
      p = sigmoid(tau_alpha * log(position + 1)) + 0.5       [n], position 0 for BOS
      q_h <- q_h * (t_q,h + p_h),  v_h <- v_h * (t_v,h + p_h)  (before rotary; v uses the first
                                                                 kv-heads entries)
  tau's gelu is the tanh approximation, as the makers' engine computes it (m87-labs/kestrel,
  kestrel/models/moondream/text.py `attn`, PR #162 "Fix Moondream tau GELU semantics"; vLLM and the
  3-preview code use the exact erf GELU here, and the two differ enough to flip greedy tokens). The
  dense MLP's gelu is the tanh approximation too, as in Moondream 2; the experts' stays the exact
  one (kestrel's MoE spec names activation "gelu"; its kernels' source is not public).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from photon_core.models.moondream import text as md2_text
from photon_core.models.moondream.text import KVCache, embed, lm_logits, rot_dim  # noqa: F401
from photon_core.models.moondream.vision import Linear, take

from .config import TextConfig


@dataclass
class TextBlock:
    ln: Linear
    qkv: Linear
    proj: Linear
    fc1: Linear | None = None          # dense layers
    fc2: Linear | None = None
    router: Linear | None = None       # MoE layers: [E, dim], [E]
    experts_gate_up: torch.Tensor | None = None   # [E, 2I, dim]: gate rows, then up rows
    experts_down: torch.Tensor | None = None      # [E, dim, I]
    experts_gate_up_scale: torch.Tensor | None = None   # FP8 experts kept as FP8: row scales [E, 2I]
    experts_down_scale: torch.Tensor | None = None      # [E, dim]
    tau_wqwv: torch.Tensor | None = None          # [2 * heads, qkv dim]
    tau_alpha: torch.Tensor | None = None         # [heads]

    # Which fields a layer has follows from the config (TextWeights.from_state); these give a
    # layer's group of weights, or a clear error where a caller asks a layer for what it lacks.
    def dense_mlp(self) -> tuple[Linear, Linear]:
        """(fc1, fc2) of a dense layer."""
        if self.fc1 is None or self.fc2 is None:
            raise ValueError("this layer has no dense MLP (it is a mixture-of-experts layer)")
        return self.fc1, self.fc2

    def experts(self) -> tuple[Linear, torch.Tensor, torch.Tensor]:
        """(router, gate_up, down) of a mixture-of-experts layer, the expert tables as stored."""
        if self.router is None or self.experts_gate_up is None or self.experts_down is None:
            raise ValueError("this layer has no experts (it is a dense layer)")
        return self.router, self.experts_gate_up, self.experts_down

    def expert_scales(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(gate_up, down) row scales of FP8 experts kept as FP8; None for float experts."""
        if self.experts_gate_up_scale is None and self.experts_down_scale is None:
            return None
        if self.experts_gate_up_scale is None or self.experts_down_scale is None:
            raise ValueError("FP8 experts need both row scales (gate_up and down), got one")
        return self.experts_gate_up_scale, self.experts_down_scale

    def tau(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(tau_wqwv, tau_alpha) of a layer with tau attention."""
        if self.tau_wqwv is None or self.tau_alpha is None:
            raise ValueError("this layer has no tau attention weights (config.text.tau_attn is false)")
        return self.tau_wqwv, self.tau_alpha


@dataclass
class TextWeights:
    wte: torch.Tensor
    blocks: list[TextBlock]
    post_ln: Linear
    lm_head: Linear
    cos: torch.Tensor
    sin: torch.Tensor

    @classmethod
    def from_state(cls, sd: dict[str, torch.Tensor], cfg: TextConfig) -> "TextWeights":
        blocks = []
        for i in range(cfg.n_layers):
            p = f"text.blocks.{i}."
            b = TextBlock(take(sd, p + "ln"), take(sd, p + "attn.qkv"), take(sd, p + "attn.proj"))
            if cfg.moe is not None and i >= cfg.moe.start_layer:
                b.router = take(sd, p + "router")
                b.experts_gate_up, b.experts_down = sd[p + "experts_gate_up"], sd[p + "experts_down"]
                b.experts_gate_up_scale = sd.get(p + "experts_gate_up_scale")
                b.experts_down_scale = sd.get(p + "experts_down_scale")
            else:
                b.fc1, b.fc2 = take(sd, p + "mlp.fc1"), take(sd, p + "mlp.fc2")
            if cfg.tau_attn:
                b.tau_wqwv, b.tau_alpha = sd[p + "tau_wqwv"], sd[p + "tau_alpha"]
            blocks.append(b)
        # Embedding, LM head and rotary tables exactly as Moondream 2 lays them out (same partial
        # rotary; theta and context from this config): its loader with no layers to read.
        dense = md2_text.TextWeights.from_state(sd, replace(cfg, n_layers=0))
        return cls(dense.wte, blocks, dense.post_ln, dense.lm_head, dense.cos, dense.sin)


def tau_position(alpha: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """[..., heads]: sigmoid(alpha * log(position + 1)) + 0.5 for positions [...], in float32.
    Computed per forward for the positions at hand: a table over the 32k context would cost
    24 layers x 32k x 32 heads (100 MB in float32) for a few elementwise ops per step."""
    logpos = (positions.to(torch.float32) + 1).log()
    return torch.sigmoid(alpha.float() * logpos[..., None]) + 0.5


def tau_scale(qkv: torch.Tensor, q: torch.Tensor, v: torch.Tensor, b: TextBlock, pos: int | torch.Tensor,
              n_heads: int, n_kv_heads: int, ops) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, T, n*hd], v [B, T, kv*hd] scaled per head by tau (see the module docstring)."""
    bsz, t, _ = q.shape
    wqwv, alpha = b.tau()
    tok = torch.tanh(ops.linear(F.gelu(qkv, approximate="tanh"), wqwv))   # [B, T, 2n]
    at = pos[:, None] if isinstance(pos, torch.Tensor) else torch.arange(pos, pos + t, device=q.device)[None]
    where = tau_position(alpha, at).to(tok.dtype)                   # [B or 1, T, n]
    tau_q = tok[..., :n_heads] + where                                     # [B, T, n]
    tau_v = tok[..., n_heads:n_heads + n_kv_heads] + where[..., :n_kv_heads]
    q = (q.view(bsz, t, n_heads, -1) * tau_q[..., None]).view(bsz, t, -1)
    v = (v.view(bsz, t, n_kv_heads, -1) * tau_v[..., None]).view(bsz, t, -1)
    return q, v


def expert_weights(b: TextBlock, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's (gate_up, down) expert tables in `dtype`; FP8 ones (kept for the megakernel)
    dequantized for this call only, w.float() * scale, so one layer's float copy exists at a time."""
    _, gate_up, down = b.experts()
    scales = b.expert_scales()
    if scales is None:
        return gate_up, down

    def deq(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        out = torch.empty(w.shape, dtype=dtype, device=w.device)
        for e in range(w.shape[0]):   # one expert's float32 at a time: the transient stays small
            out[e] = w[e].float() * scale[e, :, None]
        return out
    return deq(gate_up, scales[0]), deq(down, scales[1])


def forward(x: torch.Tensor, pos: int | torch.Tensor, w: TextWeights, cfg: TextConfig, cache: KVCache,
            ops, lora: object = None) -> torch.Tensor:
    """Input embeddings [B, T, dim] -> hidden states [B, T, dim] before post_ln; writes the KV cache.
    pos as in Moondream 2's text.forward (an int, or [B] per-row positions for one decode step).
    lora: only None (Moondream 2's signature; moondream/lora.py variant_for says why)."""
    if lora is not None:
        raise NotImplementedError("fine-tuned variants (LoRA) are not supported on Moondream 3 yet")
    hq, hkv, hd = cfg.n_heads, cfg.n_kv_heads, cfg.dim // cfg.n_heads
    at = md2_text.positions(pos, x.shape[1], w, cache)
    for i, b in enumerate(w.blocks):
        h = ops.layer_norm(x, *b.ln)
        qkv = ops.linear(h, *b.qkv)
        q, k, v = qkv.split([hq * hd, hkv * hd, hkv * hd], dim=-1)
        if b.tau_wqwv is not None:
            q, v = tau_scale(qkv, q, v, b, pos, hq, hkv, ops)
        a = md2_text.attend(q, k, v, i, at, cfg, cache, ops)
        if b.router is not None:
            if cfg.moe is None:
                raise ValueError(f"layer {i} has experts but config.text.moe is None")
            mlp = ops.moe(h, b.router[0], b.router[1], *expert_weights(b, h.dtype),
                          cfg.moe.experts_per_token, activation="gelu", up_offset=1.0, renormalize=True)
        else:
            fc1, fc2 = b.dense_mlp()
            mlp = ops.linear(ops.linear(h, *fc1, activation="gelu_tanh"), *fc2)
        x = ops.linear(a, *b.proj, residual=x + mlp)
    return x
