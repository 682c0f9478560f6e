"""Qwen3-ASR's text decode step (a Qwen3 stack) stated once as a step graph that
megakernel.compiler lowers to ONE launch per token.

Per step, for B rows (batch bucket 1/2/4/8; each row at its own position):

    x = embed_tokens[token]                                  (no scale)
    per layer:
        q|k|v = RMSNorm(x) @ Wqkv.T                          (q, k, v projections stacked: one linear)
        q, k  = per-head RMSNorm (q_norm, k_norm), then rotary "rotate half" over the whole head at
                the row's position; k, v appended to the layer's KV cache there
        a     = softmax(q k^T / sqrt(Dh)) v over positions 0..pos  (GQA: Hq / Hkv query heads per K/V head)
        x     = x + a @ Wo.T
        x     = x + (silu(g) * u) @ Wdown.T,  g|u = RMSNorm(x) @ Wgate_up.T
    logits = RMSNorm(x) @ W_lm.T  (W_lm = embed_tokens unless the checkpoint has its own lm_head)
    token  = argmax(logits)       (`advance`: it becomes the row's next token, the position steps)

The audio never enters the step: it is part of the prompt embeddings, prefilled per-op; the host
then copies the prefilled K/V into the step's caches (megakernel_decode.py).

Weights keep the checkpoint's schema names (checkpoint.py); the only re-layouts are the stacked
q|k|v and gate|up rows, under the names `...self_attn.qkv_proj.weight` and `...mlp.gate_up_proj.weight`,
and the rotary tables `rope.cos` / `rope.sin`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from photon_core.megakernel.compiler import CompiledStep, Tiling
from photon_core.megakernel.stepgraph import HeadNorm, Rotary, StepGraph

from .config import TextConfig

PREFIX = "language_model."
EMBED = PREFIX + "embed_tokens.weight"
FINAL_NORM = PREFIX + "norm.weight"
LM_HEAD = "lm_head.weight"
ROPE_COS, ROPE_SIN = "rope.cos", "rope.sin"


def layer_names(i: int) -> dict[str, str]:
    """The step's weight names of layer i (the two fused ones are this module's re-layouts)."""
    p = f"{PREFIX}layers.{i}."
    return {"in_norm": p + "input_layernorm.weight", "qkv": p + "self_attn.qkv_proj.weight",
            "q_norm": p + "self_attn.q_norm.weight", "k_norm": p + "self_attn.k_norm.weight",
            "o": p + "self_attn.o_proj.weight", "post_norm": p + "post_attention_layernorm.weight",
            "gate_up": p + "mlp.gate_up_proj.weight", "down": p + "mlp.down_proj.weight"}


@dataclass(frozen=True)
class Dims:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    layers: int
    eps: float
    rope_theta: float
    tied: bool            # the LM head is the embedding table

    @classmethod
    def of(cls, cfg: TextConfig, tied: bool) -> "Dims":
        if cfg.n_heads % cfg.n_kv_heads:
            raise ValueError(f"{cfg.n_heads} query heads are not a multiple of {cfg.n_kv_heads} K/V heads")
        return cls(cfg.hidden, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.intermediate, cfg.vocab_size,
                   cfg.n_layers, cfg.rms_eps, cfg.rope_theta, tied)


def weight_shapes(dm: Dims, max_len: int) -> dict[str, tuple[int, ...]]:
    d, dh = dm.hidden, dm.head_dim
    s: dict[str, tuple[int, ...]] = {EMBED: (dm.vocab, d), FINAL_NORM: (d,),
                                     ROPE_COS: (max_len, dh // 2), ROPE_SIN: (max_len, dh // 2)}
    if not dm.tied:
        s[LM_HEAD] = (dm.vocab, d)
    for i in range(dm.layers):
        n = layer_names(i)
        s.update({n["in_norm"]: (d,), n["qkv"]: ((dm.heads + 2 * dm.kv_heads) * dh, d),
                  n["q_norm"]: (dh,), n["k_norm"]: (dh,), n["o"]: (d, dm.heads * dh), n["post_norm"]: (d,),
                  n["gate_up"]: (2 * dm.intermediate, d), n["down"]: (d, dm.intermediate)})
    return s


def step_graph(dm: Dims, max_len: int, advance: bool = True) -> StepGraph:
    """The decode step (module docstring) from the dims alone: sizes only, no memory."""
    g = StepGraph(f"qwen3-asr-decoder-d{dm.hidden}-L{dm.layers}-V{dm.vocab}", weight_shapes(dm, max_len))
    kc = g.cache("kcache", dm.kv_heads, max_len, dm.head_dim, layers=dm.layers)
    vc = g.cache("vcache", dm.kv_heads, max_len, dm.head_dim, layers=dm.layers)
    rope = Rotary(ROPE_COS, ROPE_SIN, dm.head_dim)
    x = g.embed("x", EMBED)
    for i in range(dm.layers):
        n, L = layer_names(i), f"L{i}"
        qkv = g.linear(f"{L}.qkv", g.rms_norm(f"{L}.h", x, n["in_norm"], dm.eps), n["qkv"])
        q = g.kv_append(f"{L}.q", qkv, kc[i], vc[i], rotary=rope, q_heads=dm.heads,
                        norm=HeadNorm(q=n["q_norm"], k=n["k_norm"], eps=dm.eps, offset=0.0))
        a = g.attention(f"{L}.attn", q, kc[i], vc[i], "self", scale=dm.head_dim ** -0.5)
        x = g.linear(f"{L}.attn_out", a, n["o"], residual=x)
        gu = g.linear(f"{L}.gate_up", g.rms_norm(f"{L}.h2", x, n["post_norm"], dm.eps), n["gate_up"])
        x = g.linear(f"{L}.mlp_out", g.glu(f"{L}.glu", gu, "silu"), n["down"], residual=x)
    g.expose("hidden", x)
    logits = g.linear("logits", g.rms_norm("final_norm", x, FINAL_NORM, dm.eps), EMBED if dm.tied else LM_HEAD)
    g.expose("logits", logits)
    g.argmax("token", logits, advance=advance)
    return g


def rope_tables(dm: Dims, max_len: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [max_len, Dh/2] in float32, with decoder.TextDecoder.rope's arithmetic (positions x
    inverse frequencies in float32), so a table row equals the per-op path's rotation."""
    d = dm.head_dim
    inv_freq = 1.0 / (dm.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32, device=device) / d))
    angles = torch.arange(max_len, device=device).to(torch.float32)[:, None] * inv_freq[None, :]
    return angles.cos(), angles.sin()


def gather_weights(sd: dict[str, torch.Tensor], dm: Dims, max_len: int,
                   device: torch.device) -> dict[str, torch.Tensor]:
    """name -> tensor for the weight arena from the checkpoint's schema-named tensors
    (checkpoint.load_tensors): q|k|v and gate|up stacked, rotary tables computed."""
    missing: list[str] = []
    t: dict[str, torch.Tensor] = {}

    def take(name: str) -> None:
        if name in sd:
            t[name] = sd[name]
        else:
            missing.append(name)

    for name in (EMBED, FINAL_NORM) + (() if dm.tied else (LM_HEAD,)):
        take(name)
    for i in range(dm.layers):
        p, n = f"{PREFIX}layers.{i}.", layer_names(i)
        a, m = p + "self_attn.", p + "mlp."
        parts = {"qkv": [a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"],
                 "gate_up": [m + "gate_proj.weight", m + "up_proj.weight"]}
        for key, names in parts.items():
            missing += [k for k in names if k not in sd]
            if all(k in sd for k in names):
                t[n[key]] = torch.cat([sd[k] for k in names])
        for key in ("in_norm", "q_norm", "k_norm", "o", "post_norm", "down"):
            take(n[key])
    if missing:
        raise ValueError(f"Qwen3-ASR decode step: checkpoint lacks tensors {missing[:6]}")
    t[ROPE_COS], t[ROPE_SIN] = rope_tables(dm, max_len, device)
    return t


class Qwen3ASRDecoderMegakernel(CompiledStep):
    """Qwen3-ASR's decode step as one persistent launch for a fixed batch bucket.

    Usage: mk = Qwen3ASRDecoderMegakernel(weights, dims, batch=1, max_len=T)
           mk.view("kcache")[layer, row, :, :p] = ...      # prefilled K/V of each row
           mk.set_step(tokens, positions); mk.launch()     # then (advance) launch() again per token
           mk.result("token"), mk.logits
    """

    def __init__(self, weights: dict[str, torch.Tensor], dm: Dims, batch: int, max_len: int,
                 tiling: Tiling = Tiling(), weight_dtype: torch.dtype = torch.float32,
                 shared_weights: torch.Tensor | None = None, check: bool = True, advance: bool = True) -> None:
        self.dm, self.max_len = dm, max_len
        super().__init__(step_graph(dm, max_len, advance), weights, batch, tiling, weight_dtype,
                         shared_weights=shared_weights, check=check)

    @property
    def logits(self) -> torch.Tensor:
        """[B, vocab] logits of the last step (a view: the next launch overwrites it)."""
        return self.view("logits")


__all__ = ["Dims", "Qwen3ASRDecoderMegakernel", "step_graph", "gather_weights", "weight_shapes", "rope_tables",
           "layer_names"]
