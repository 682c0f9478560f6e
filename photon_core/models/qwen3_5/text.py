"""The Qwen 3.5 hybrid text stack on the ops contract.

Layers are Gated DeltaNet (linear attention) or gated full attention, as config.layer_types says; every
layer is pre-norm with a SwiGLU MLP, and every RMSNorm outside DeltaNet's output norm scales by
(1 + weight) (the weights are stored centred at 0). Decode state per row: for DeltaNet layers the last
conv_kernel-1 conv inputs and the [Hv, Dk, Dv] recurrent state (fixed size), for attention layers a KV
cache. Rotary positions are 3-D (time, height, width; "interleaved" M-RoPE): text tokens have all
three equal, image tokens the grid coordinates; after the prompt every row continues at
length + rope_delta on all three axes.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .config import TextConfig


class TextWeights:
    """The text tensors by layer, with the MLP gate/up projections fused into one matrix."""

    def __init__(self, sd: dict[str, torch.Tensor], cfg: TextConfig) -> None:
        self.embed = sd["text.embed_tokens.weight"]
        self.norm = sd["text.norm.weight"]
        self.lm_head = sd["text.lm_head.weight"]
        self.layers: list[dict[str, torch.Tensor]] = []
        for i in range(cfg.n_layers):
            p = f"text.layers.{i}."
            layer = {k[len(p):]: v for k, v in sd.items() if k.startswith(p)}
            layer["gate_up"] = torch.cat([layer.pop("mlp.gate_proj.weight"), layer.pop("mlp.up_proj.weight")])
            if not cfg.is_attention(i):
                # A_log and dt_bias feed an fp32 decay in the reference; keep them fp32 whatever the dtype.
                layer["neg_A"] = -layer.pop("linear_attn.A_log").float().exp()
                layer["linear_attn.dt_bias"] = layer["linear_attn.dt_bias"].float()
                layer["conv"] = layer.pop("linear_attn.conv1d.weight")[:, 0]    # [C, W]
            self.layers.append(layer)
        rot = cfg.rot_dim
        self.inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, rot, 2, dtype=torch.float32) / rot))
        self.inv_freq = self.inv_freq.to(self.embed.device)
        # Interleaved M-RoPE: frequency k follows height when k % 3 == 1 (k < 3 * section[1]),
        # width when k % 3 == 2 (k < 3 * section[2]), time otherwise.
        k = torch.arange(rot // 2)
        axis = torch.zeros(rot // 2, dtype=torch.long)
        axis[(k % 3 == 1) & (k < 3 * cfg.mrope_section[1])] = 1
        axis[(k % 3 == 2) & (k < 3 * cfg.mrope_section[2])] = 2
        self.axis = axis.to(self.embed.device)


def rope(positions: torch.Tensor, w: TextWeights, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [N, rot/2] for positions [3, N] (time, height, width) or [N] (the same on all axes)."""
    if positions.dim() == 1:
        angles = positions.float()[:, None] * w.inv_freq[None, :]
    else:
        angles = positions.float()[w.axis].T * w.inv_freq[None, :]    # [N, rot/2], each freq its axis
    return angles.cos().to(dtype), angles.sin().to(dtype)


class DecodeState:
    """Per-row decode state: conv and recurrent state for DeltaNet layers, KV cache for attention
    layers, how many tokens each row holds and its rotary offset (M-RoPE delta)."""

    def __init__(self, cfg: TextConfig, batch: int, max_len: int, dtype: torch.dtype, device) -> None:
        self.cfg, self.max_len = cfg, max_len
        self.conv: dict[int, torch.Tensor] = {}
        self.rec: dict[int, torch.Tensor] = {}
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}
        for i in range(cfg.n_layers):
            if cfg.is_attention(i):
                shape = (batch, cfg.n_kv_heads, max_len, cfg.head_dim)
                self.k[i] = torch.zeros(shape, dtype=dtype, device=device)
                self.v[i] = torch.zeros(shape, dtype=dtype, device=device)
            else:
                self.conv[i] = torch.zeros(batch, cfg.conv_kernel - 1, cfg.conv_dim, dtype=dtype, device=device)
                self.rec[i] = torch.zeros(batch, cfg.lin_v_heads, cfg.lin_k_dim, cfg.lin_v_dim,
                                          dtype=torch.float32, device=device)
        self.length = torch.zeros(batch, dtype=torch.long, device=device)
        self.rope_delta = torch.zeros(batch, dtype=torch.long, device=device)

    @property
    def batch(self) -> int:
        return self.length.shape[0]

    @classmethod
    def merge(cls, rows: list["DecodeState"], max_len: int) -> "DecodeState":
        """One state holding each single-row state as a row (after separate prefills)."""
        first = rows[0]
        some = next(iter((first.k or first.conv).values()))
        out = cls(first.cfg, len(rows), max_len, some.dtype, some.device)
        for b, r in enumerate(rows):
            n = int(r.length[0])
            for i in out.k:
                out.k[i][b, :, :n] = r.k[i][0, :, :n]
                out.v[i][b, :, :n] = r.v[i][0, :, :n]
            for i in out.conv:
                out.conv[i][b] = r.conv[i][0]
                out.rec[i][b] = r.rec[i][0]
            out.length[b], out.rope_delta[b] = r.length[0], r.rope_delta[0]
        return out

    def keep(self, rows: list[int]) -> None:
        """Drop the other rows (finished requests) so later steps stop paying for them."""
        idx = torch.tensor(rows, device=self.length.device)
        for d in (self.k, self.v, self.conv, self.rec):
            for i in d:
                d[i] = d[i].index_select(0, idx)
        self.length, self.rope_delta = self.length[idx], self.rope_delta[idx]


def embed(ids: torch.Tensor, w: TextWeights) -> torch.Tensor:
    return w.embed[ids]


def prefill(x: torch.Tensor, positions: torch.Tensor, state: DecodeState, w: TextWeights, cfg: TextConfig,
            ops) -> torch.Tensor:
    """Input embeddings [B, T, dim] of rows that all hold state.length[0] tokens -> hidden states
    [B, T, dim] (after the final norm). positions: [3, T] or [T] rotary positions, shared by the rows."""
    start = int(state.length[0])
    if bool((state.length != start).any()):
        raise ValueError("prefill: every row must hold the same number of tokens")
    t = x.shape[1]
    if start + t > state.max_len:
        raise ValueError(f"prefill: {start + t} tokens exceed the state's capacity ({state.max_len})")
    cos, sin = rope(positions, w, x.dtype)
    x = _stack(x, state, w, cfg, ops, cos, sin, start=start)
    state.length += t
    return ops.rms_norm(x, w.norm, cfg.eps, offset=1.0)


def decode(x: torch.Tensor, state: DecodeState, w: TextWeights, cfg: TextConfig, ops) -> torch.Tensor:
    """One token per row, x [B, 1, dim], rows at their own lengths -> hidden states [B, 1, dim]."""
    if x.shape[1] != 1:
        raise ValueError("decode takes one token per row")
    if int(state.length.max()) >= state.max_len:
        raise ValueError(f"decode: the state is full ({state.max_len} tokens)")
    cos, sin = rope(state.length + state.rope_delta, w, x.dtype)    # [B, rot/2]
    x = _stack(x, state, w, cfg, ops, cos, sin, start=None)
    state.length += 1
    return ops.rms_norm(x, w.norm, cfg.eps, offset=1.0)


def logits(hidden: torch.Tensor, w: TextWeights, ops) -> torch.Tensor:
    """Final-normed hidden states [..., dim] -> logits [..., vocab] in fp32."""
    return ops.linear(hidden, w.lm_head).float()


def _stack(x, state, w, cfg, ops, cos, sin, start):
    h = ops.rms_norm(x, w.layers[0]["input_layernorm.weight"], cfg.eps, offset=1.0)
    for i, lw in enumerate(w.layers):
        if cfg.is_attention(i):
            out = _attention(h, i, lw, state, cfg, ops, cos, sin, start)
        else:
            out = _delta_net(h, i, lw, state, cfg, ops)
        h, x = ops.add_layer_norm(out, x, lw["post_attention_layernorm.weight"], None, cfg.eps, rms=True, offset=1.0)
        gu = ops.linear(h, lw["gate_up"])
        f = cfg.intermediate
        mlp = ops.glu(gu[..., :f], gu[..., f:], "silu")
        x = ops.linear(mlp, lw["mlp.down_proj.weight"], residual=x)
        if i + 1 < cfg.n_layers:
            h = ops.rms_norm(x, w.layers[i + 1]["input_layernorm.weight"], cfg.eps, offset=1.0)
    return x


def _delta_net(h, i, lw, state, cfg, ops):
    """Gated DeltaNet: conv on q/k/v, gated delta rule with per-head decay, gated RMSNorm, out proj."""
    bsz, t, _ = h.shape
    hk, hv, dk, dv = cfg.lin_k_heads, cfg.lin_v_heads, cfg.lin_k_dim, cfg.lin_v_dim
    qkv = ops.linear(h, lw["linear_attn.in_proj_qkv.weight"])
    z = ops.linear(h, lw["linear_attn.in_proj_z.weight"])
    b = ops.linear(h, lw["linear_attn.in_proj_b.weight"])
    a = ops.linear(h, lw["linear_attn.in_proj_a.weight"])
    qkv, state.conv[i] = ops.causal_conv1d(qkv, lw["conv"], None, state=state.conv[i], activation="silu")
    q, k, v = qkv.split([hk * dk, hk * dk, hv * dv], dim=-1)
    q, k, v = q.reshape(bsz, t, hk, dk), k.reshape(bsz, t, hk, dk), v.reshape(bsz, t, hv, dv)
    beta = torch.sigmoid(b)
    g = lw["neg_A"] * F.softplus(a.float() + lw["linear_attn.dt_bias"])    # log decay <= 0, fp32
    if t == 1:
        o, state.rec[i] = ops.gated_delta_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], state.rec[i],
                                               qk_l2norm=True)
        o = o[:, None]
    else:
        o, state.rec[i] = ops.gated_delta_chunk(q, k, v, g, beta, state.rec[i], qk_l2norm=True)
    o = ops.rms_norm_gated(o, z.reshape(bsz, t, hv, dv), lw["linear_attn.norm.weight"], cfg.eps)
    return ops.linear(o.reshape(bsz, t, hv * dv), lw["linear_attn.out_proj.weight"])


def _attention(h, i, lw, state, cfg, ops, cos, sin, start):
    """Gated attention: per-head RMSNorm on q and k, partial rotary, GQA, sigmoid output gate."""
    bsz, t, _ = h.shape
    hq, hkv, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    qg = ops.linear(h, lw["self_attn.q_proj.weight"], lw.get("self_attn.q_proj.bias")).view(bsz, t, hq, 2 * hd)
    q, gate = qg[..., :hd], qg[..., hd:]
    k = ops.linear(h, lw["self_attn.k_proj.weight"], lw.get("self_attn.k_proj.bias")).view(bsz, t, hkv, hd)
    v = ops.linear(h, lw["self_attn.v_proj.weight"], lw.get("self_attn.v_proj.bias")).view(bsz, t, hkv, hd)
    q = ops.rms_norm(q, lw["self_attn.q_norm.weight"], cfg.eps, offset=1.0).transpose(1, 2)
    k = ops.rms_norm(k, lw["self_attn.k_norm.weight"], cfg.eps, offset=1.0).transpose(1, 2)
    v = v.transpose(1, 2)
    if start is None:   # decode: one position per row, rotated as [H, B, hd] against cos [B, rot/2]
        q = ops.rotary(q[:, :, 0].transpose(0, 1), cos, sin, cfg.rot_dim).transpose(0, 1)[:, :, None]
        k = ops.rotary(k[:, :, 0].transpose(0, 1), cos, sin, cfg.rot_dim).transpose(0, 1)[:, :, None]
        ops.kv_append(state.k[i], state.v[i], k, v, state.length)
        a = ops.decode_attention(q, state.k[i], state.v[i], state.length + 1)
    else:
        q, k = ops.rotary(q, cos, sin, cfg.rot_dim), ops.rotary(k, cos, sin, cfg.rot_dim)
        end = start + t
        state.k[i][:, :, start:end] = k
        state.v[i][:, :, start:end] = v
        a = ops.attention(q, state.k[i][:, :, :end], state.v[i][:, :, :end], causal=True)
    a = a.transpose(1, 2).reshape(bsz, t, hq * hd) * torch.sigmoid(gate.reshape(bsz, t, hq * hd))
    return ops.linear(a, lw["self_attn.o_proj.weight"], lw.get("self_attn.o_proj.bias"))
