"""Qwen 3.5's text decode step, stated once as a step graph that megakernel.compiler lowers to ONE
launch (prefill and the vision encoder stay on the per-op path: text.py, vision.py).

Per step, for B rows (batch bucket 1/2/4/8; each row at its own cache position, read from device
memory, and its own rotary offset, the M-RoPE delta after an image):

    x = embed_tokens[token]
    per layer i, h = RMSNorm(x) * (1 + w_in)          (fused in front of the linears reading h)
      Gated DeltaNet layer:
        p      = h @ [W_qkv | W_z | W_b | W_a].T       (one linear: rows concatenated at load)
        c      = silu(causal depthwise conv of p[:, :conv_dim]) with the [C, W-1] conv state
        o      = gated delta rule (c = q|k|v, p[:, conv_dim:] = z|b|a, [Hv, Dk, Dv] state),
                 then the per-head gated RMSNorm with z
        x      = o @ W_out.T + x
      gated attention layer:
        q|k|v  = h @ [W_q | W_k | W_v].T (+ b)          (q_proj's rows de-interleaved at load:
        g      = h @ W_gate.T (+ b)                      each head's [q | gate] halves split)
        q, k   = per-head RMSNorm * (1 + w) (q_norm, k_norm), rotary on the first rot_dim features
                 at position + rotary offset; k, v appended to the layer's cache
        a      = softmax(q k^T / sqrt(hd)) v, GQA, over positions 0..pos
        x      = (a * sigmoid(g)) @ W_o.T (+ b) + x
      MLP: x = glu_silu(RMSNorm(x) * (1 + w_post) @ [W_gate | W_up].T) @ W_down.T + x
    logits = RMSNorm(x) * (1 + w_norm) @ W_lm.T        (exposed; W_lm is embed_tokens when tied)
    token  = argmax(logits)                            (result column, `advance`: it becomes the row's next
                                                        token and the position steps, so greedy requests
                                                        decode in rounds on the device; the host may
                                                        sample from the logits instead)

Weights keep the checkpoint's names (without the "text." prefix) where they are used as stored;
re-laid ones get their own names (in_proj, qkv_proj, gate_proj, gate_up_proj). The (1 + w) norm
scales are folded into the stored weights by the compiler (rms_norm / HeadNorm offset=1.0).
"""
from __future__ import annotations

from typing import Any

import torch

from photon_core.megakernel.compiler import CompiledStep, Tiling
from photon_core.megakernel.stepgraph import HeadNorm, Rotary, StepGraph

from . import text
from .config import TextConfig

RESULTS = ("token",)


def _p(i: int) -> str:
    return f"layers.{i}."


def lm_head_name(tied: bool) -> str:
    """A tied LM head streams the embedding table itself (one copy in the arena)."""
    return "embed_tokens.weight" if tied else "lm_head.weight"


def weight_shapes(cfg: TextConfig, max_len: int, tied: bool) -> dict[str, tuple[int, ...]]:
    d, f = cfg.dim, cfg.intermediate
    s: dict[str, tuple[int, ...]] = {"embed_tokens.weight": (cfg.vocab_size, d), "norm.weight": (d,),
                                     "rope_cos": (max_len, cfg.rot_dim // 2), "rope_sin": (max_len, cfg.rot_dim // 2)}
    if not tied:
        s["lm_head.weight"] = (cfg.vocab_size, d)
    hq, hkv, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    hv, dv = cfg.lin_v_heads, cfg.lin_v_dim
    for i in range(cfg.n_layers):
        p = _p(i)
        s.update({p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,),
                  p + "mlp.gate_up_proj.weight": (2 * f, d), p + "mlp.down_proj.weight": (d, f)})
        if cfg.is_attention(i):
            a = p + "self_attn."
            s.update({a + "qkv_proj.weight": ((hq + 2 * hkv) * hd, d), a + "gate_proj.weight": (hq * hd, d),
                      a + "o_proj.weight": (d, hq * hd), a + "q_norm.weight": (hd,), a + "k_norm.weight": (hd,)})
            if cfg.attention_bias:
                s.update({a + "qkv_proj.bias": ((hq + 2 * hkv) * hd,), a + "gate_proj.bias": (hq * hd,),
                          a + "o_proj.bias": (d,)})
        else:
            a = p + "linear_attn."
            s.update({a + "in_proj.weight": (cfg.conv_dim + hv * dv + 2 * hv, d),
                      a + "conv1d.weight": (cfg.conv_dim, cfg.conv_kernel), a + "A_log": (hv,),
                      a + "dt_bias": (hv,), a + "norm.weight": (dv,), a + "out_proj.weight": (d, hv * dv)})
    return s


def step_graph(cfg: TextConfig, max_len: int, tied: bool) -> StepGraph:
    """The decode step (module docstring) from the config alone; caches hold `max_len` positions."""
    g = StepGraph(f"qwen3_5-decoder-d{cfg.dim}-L{cfg.n_layers}-V{cfg.vocab_size}",
                  weight_shapes(cfg, max_len, tied))
    eps = cfg.eps
    rope = Rotary("rope_cos", "rope_sin", cfg.rot_dim)
    x = g.embed("x0", "embed_tokens.weight")
    for i in range(cfg.n_layers):
        p, L = _p(i), f"L{i}"
        h = g.rms_norm(f"{L}.h", x, p + "input_layernorm.weight", eps, offset=1.0)
        if cfg.is_attention(i):
            a, bias = p + "self_attn.", cfg.attention_bias
            kc = g.cache(f"k{i}", cfg.n_kv_heads, max_len, cfg.head_dim)
            vc = g.cache(f"v{i}", cfg.n_kv_heads, max_len, cfg.head_dim)
            qkv = g.linear(f"{L}.qkv", h, a + "qkv_proj.weight", a + "qkv_proj.bias" if bias else None)
            gate = g.linear(f"{L}.gate", h, a + "gate_proj.weight", a + "gate_proj.bias" if bias else None)
            q = g.kv_append(f"{L}.q", qkv, kc, vc, rotary=rope, q_heads=cfg.n_heads,
                            norm=HeadNorm(q=a + "q_norm.weight", k=a + "k_norm.weight", eps=eps, offset=1.0))
            att = g.attention(f"{L}.attn", q, kc, vc, "self", scale=cfg.head_dim ** -0.5)
            x = g.linear(f"{L}.out", g.gate(f"{L}.gated", att, gate), a + "o_proj.weight",
                         a + "o_proj.bias" if bias else None, residual=x)
        else:
            a = p + "linear_attn."
            conv = g.state(f"conv{i}", cfg.conv_dim, cfg.conv_kernel - 1)
            rec = g.state(f"rec{i}", cfg.lin_v_heads, cfg.lin_k_dim, cfg.lin_v_dim)
            proj = g.linear(f"{L}.proj", h, a + "in_proj.weight")
            c = g.conv_step(f"{L}.conv", proj, conv, a + "conv1d.weight", 0, cfg.conv_dim, act="silu")
            o = g.delta_rule(f"{L}.delta", c, proj, rec, cfg.lin_k_heads, a + "A_log", a + "dt_bias",
                             a + "norm.weight", c0=cfg.conv_dim, eps=eps)
            x = g.linear(f"{L}.out", o, a + "out_proj.weight", residual=x)
        h = g.rms_norm(f"{L}.h2", x, p + "post_attention_layernorm.weight", eps, offset=1.0)
        gu = g.linear(f"{L}.gate_up", h, p + "mlp.gate_up_proj.weight")
        x = g.linear(f"{L}.down", g.glu(f"{L}.glu", gu, "silu"), p + "mlp.down_proj.weight", residual=x)
    g.expose("hidden", x)
    logits = g.linear("logits", g.rms_norm("final_norm", x, "norm.weight", eps, offset=1.0), lm_head_name(tied))
    g.expose("logits", logits)
    g.argmax("token", logits, advance=True)
    return g


def gather_weights(text_w: text.TextWeights, cfg: TextConfig, max_len: int, tied: bool) -> dict[str, torch.Tensor]:
    """name -> tensor for the weights arena, from text.TextWeights, re-laid as the graph reads them
    (the arena copies them; nothing here is kept)."""
    t: dict[str, torch.Tensor] = {"embed_tokens.weight": text_w.embed, "norm.weight": text_w.norm}
    if not tied:
        t["lm_head.weight"] = text_w.lm_head
    # The same tables text.decode computes per step (1-D positions: all M-RoPE axes alike).
    positions = torch.arange(max_len, device=text_w.embed.device)
    t["rope_cos"], t["rope_sin"] = text.rope(positions, text_w, torch.float32)
    hq, hd = cfg.n_heads, cfg.head_dim
    for i, lw in enumerate(text_w.layers):
        p = _p(i)
        t.update({p + "input_layernorm.weight": lw["input_layernorm.weight"],
                  p + "post_attention_layernorm.weight": lw["post_attention_layernorm.weight"],
                  p + "mlp.gate_up_proj.weight": lw["gate_up"], p + "mlp.down_proj.weight": lw["mlp.down_proj.weight"]})
        if cfg.is_attention(i):
            a = "self_attn."
            # q_proj holds per head [q (hd) | gate (hd)]: split the halves into q|k|v and a gate linear.
            qg = lw[a + "q_proj.weight"].reshape(hq, 2, hd, -1)
            t[p + a + "qkv_proj.weight"] = torch.cat([qg[:, 0].reshape(hq * hd, -1), lw[a + "k_proj.weight"],
                                                      lw[a + "v_proj.weight"]])
            t[p + a + "gate_proj.weight"] = qg[:, 1].reshape(hq * hd, -1)
            if cfg.attention_bias:
                qb = lw[a + "q_proj.bias"].reshape(hq, 2, hd)
                t[p + a + "qkv_proj.bias"] = torch.cat([qb[:, 0].reshape(-1), lw[a + "k_proj.bias"],
                                                        lw[a + "v_proj.bias"]])
                t[p + a + "gate_proj.bias"] = qb[:, 1].reshape(-1)
                t[p + a + "o_proj.bias"] = lw[a + "o_proj.bias"]
            for n in ("o_proj.weight", "q_norm.weight", "k_norm.weight"):
                t[p + a + n] = lw[a + n]
        else:
            a = "linear_attn."
            t[p + a + "in_proj.weight"] = torch.cat([lw[a + "in_proj_qkv.weight"], lw[a + "in_proj_z.weight"],
                                                     lw[a + "in_proj_b.weight"], lw[a + "in_proj_a.weight"]])
            t[p + a + "conv1d.weight"] = lw["conv"]
            # TextWeights keeps -exp(A_log) (fp32); the delta rule takes A_log itself.
            t[p + a + "A_log"] = torch.log(-lw["neg_A"])
            for n in ("dt_bias", "norm.weight", "out_proj.weight"):
                t[p + a + n] = lw[a + n]
    return t


class Qwen35DecoderStep(CompiledStep):
    """Qwen 3.5's decode step as one persistent launch for a fixed batch bucket. Caches and
    recurrent states live in the state arena: `load_state` copies a per-op DecodeState (after
    prefill) into rows of it and points the DecodeState's tensors at those rows, so the state stays
    the truth while the megakernel decodes it.

    Usage: mk = Qwen35DecoderStep(model.text_w, model.config, batch=1, max_len=T)
           mk.load_state(state)                     # after text.prefill
           logits = mk.step(ids, state)             # [B, V]; state.length advanced
    """

    def __init__(self, text_w: text.TextWeights, cfg: Any, batch: int, max_len: int, tiling: Tiling = Tiling(),
                 weight_dtype: torch.dtype = torch.float32, weights: torch.Tensor | None = None,
                 check: bool = True) -> None:
        tcfg: TextConfig = cfg.text
        # Tied checkpoints load lm_head as the embedding table (the same tensor, or an equal cast).
        tied = text_w.lm_head is text_w.embed or (text_w.lm_head.shape == text_w.embed.shape
                                                  and torch.equal(text_w.lm_head, text_w.embed))
        if not 0 < max_len <= tcfg.max_context:
            raise ValueError(f"max_len {max_len} must be in (0, {tcfg.max_context}] (the model's context)")
        self.cfg, self.max_len, self.tied = tcfg, max_len, tied
        super().__init__(step_graph(tcfg, max_len, tied), gather_weights(text_w, tcfg, max_len, tied), batch,
                         tiling, weight_dtype, shared_weights=weights, check=check)

    # -- state binding -----------------------------------------------------------------------------
    def _arena_tensors(self, rows: int, length: int) -> dict[str, dict[int, torch.Tensor]]:
        """The arena rows [0, rows) in DecodeState's layouts (k/v [rows, H, length, hd], conv
        [rows, W-1, C] as a transposed view of the channel-major arena state, rec [rows, Hv, Dk, Dv])."""
        out: dict[str, dict[int, torch.Tensor]] = {"k": {}, "v": {}, "conv": {}, "rec": {}}
        for i in range(self.cfg.n_layers):
            if self.cfg.is_attention(i):
                out["k"][i] = self.view(f"k{i}")[:rows, :, :length]
                out["v"][i] = self.view(f"v{i}")[:rows, :, :length]
            else:
                out["conv"][i] = self.view(f"conv{i}")[:rows].transpose(1, 2)
                out["rec"][i] = self.view(f"rec{i}")[:rows]
        return out

    def holds(self, state: text.DecodeState) -> bool:
        """Whether `state`'s tensors are this step's arena rows (bound by load_state, not replaced since)."""
        if state.batch > self.batch or state.max_len > self.max_len:
            return False
        mine = self._arena_tensors(state.batch, state.max_len)
        return all(getattr(state, kind)[i].data_ptr() == t.data_ptr() and getattr(state, kind)[i].shape == t.shape
                   for kind, d in mine.items() for i, t in d.items())

    def load_state(self, state: text.DecodeState) -> None:
        """Copy a DecodeState's caches and recurrent states into arena rows [0, B) and make its tensors
        views of them (fp32: the arena's type)."""
        if state.batch > self.batch:
            raise ValueError(f"a state of {state.batch} rows does not fit the batch-{self.batch} step")
        if state.max_len > self.max_len:
            raise ValueError(f"a state of {state.max_len} positions exceeds the megakernel's caches "
                             f"({self.max_len}); load the model with a larger max_len")
        mine = self._arena_tensors(state.batch, state.max_len)
        for kind, d in mine.items():
            src = getattr(state, kind)
            for i, t in d.items():
                t.copy_(src[i])
                src[i] = t

    def release(self, state: text.DecodeState) -> None:
        """Give a bound state its own copies again (another state is about to take these rows)."""
        for kind in ("k", "v", "conv", "rec"):
            d = getattr(state, kind)
            for i in d:
                d[i] = d[i].clone(memory_format=torch.contiguous_format)

    # -- a step --------------------------------------------------------------------------------------
    def step(self, ids: torch.Tensor, state: text.DecodeState) -> torch.Tensor:
        """One token per row of a bound state (ids [B] or [B, 1]) -> logits [B, V] (fp32, a copy);
        state.length advances. Rows past B decode token 0 at position 0 of their own (unused) rows."""
        if not self.holds(state):
            raise RuntimeError("the state is not bound to this megakernel step (call load_state first)")
        B, pad = state.batch, self.batch - state.batch
        toks = ids.reshape(-1).tolist()
        if len(toks) != B:
            raise ValueError(f"need one token per row ({B}), got {len(toks)}")
        if min(toks) < 0 or max(toks) >= self.cfg.vocab_size:
            raise ValueError(f"token ids must be in [0, {self.cfg.vocab_size})")
        if int(state.length.max()) >= state.max_len:
            raise ValueError(f"decode: the state is full ({state.max_len} tokens)")
        self.set_step(toks + [0] * pad, state.length.tolist() + [0] * pad)
        self.set_rotary_offsets(state.rope_delta.tolist() + [0] * pad)
        self.launch()
        state.length += 1
        return self.view("logits")[:B].clone()
