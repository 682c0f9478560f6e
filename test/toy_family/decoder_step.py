"""The toy Llama's decode step, stated once as a step graph that megakernel.compiler lowers to one
launch per token. Per step, for B rows (batch bucket 1/2/4/8, each row at its own position):

    x = embed_tokens[token]
    per layer:
        q|k|v = RMSNorm(x) @ Wqkv.T        (q, k, v projections stacked: one linear)
        q, k rotated at the row's position; k, v appended to the layer's cache there
        x = x + attention(q, cache, GQA) @ Wo.T
        x = x + (silu(g) * u) @ Wdown.T,   g|u = RMSNorm(x) @ Wgate_up.T
    logits = RMSNorm(x) @ W_lm.T            (W_lm = embed_tokens when tied)
    token  = argmax(logits)                 (advance: the row's next token, its position steps)

Weights keep Llama's names; the re-layouts are the stacked q|k|v and gate|up under
`...self_attn.qkv_proj.weight` / `...mlp.gate_up_proj.weight`, and the rotary tables.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from photon_core.megakernel.compiler import CompiledStep, Tiling
from photon_core.megakernel.stepgraph import Rotary, StepGraph

from .config import ToyConfig
from .weights import layer_tensors

if TYPE_CHECKING:
    from .model import ToyLlama

EMBED, FINAL_NORM, LM_HEAD = "model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"
ROPE_COS, ROPE_SIN = "rope.cos", "rope.sin"


def fused(i: int) -> dict[str, str]:
    p = f"model.layers.{i}."
    return {"qkv": p + "self_attn.qkv_proj.weight", "gate_up": p + "mlp.gate_up_proj.weight"}


def weight_shapes(cfg: ToyConfig, max_len: int) -> dict[str, tuple[int, ...]]:
    d, dh, f = cfg.hidden, cfg.head_dim, cfg.intermediate
    s: dict[str, tuple[int, ...]] = {EMBED: (cfg.vocab_size, d), FINAL_NORM: (d,),
                                     ROPE_COS: (max_len, dh // 2), ROPE_SIN: (max_len, dh // 2)}
    if not cfg.tie_embeddings:
        s[LM_HEAD] = (cfg.vocab_size, d)
    for i in range(cfg.n_layers):
        n, j = layer_tensors(i), fused(i)
        s.update({n["in_norm"]: (d,), j["qkv"]: ((cfg.n_heads + 2 * cfg.n_kv_heads) * dh, d),
                  n["o"]: (d, cfg.n_heads * dh), n["post_norm"]: (d,), j["gate_up"]: (2 * f, d), n["down"]: (d, f)})
    return s


def step_graph(cfg: ToyConfig, max_len: int) -> StepGraph:
    g = StepGraph(f"toy-llama-d{cfg.hidden}-L{cfg.n_layers}", weight_shapes(cfg, max_len))
    kc = g.cache("kcache", cfg.n_kv_heads, max_len, cfg.head_dim, layers=cfg.n_layers)
    vc = g.cache("vcache", cfg.n_kv_heads, max_len, cfg.head_dim, layers=cfg.n_layers)
    rope, eps = Rotary(ROPE_COS, ROPE_SIN, cfg.head_dim), cfg.rms_eps
    x = g.embed("x", EMBED)
    for i in range(cfg.n_layers):
        n, j, L = layer_tensors(i), fused(i), f"L{i}"
        qkv = g.linear(f"{L}.qkv", g.rms_norm(f"{L}.h", x, n["in_norm"], eps), j["qkv"])
        q = g.kv_append(f"{L}.q", qkv, kc[i], vc[i], rotary=rope, q_heads=cfg.n_heads)
        a = g.attention(f"{L}.attn", q, kc[i], vc[i], "self", scale=cfg.head_dim ** -0.5)
        x = g.linear(f"{L}.attn_out", a, n["o"], residual=x)
        gu = g.linear(f"{L}.gate_up", g.rms_norm(f"{L}.h2", x, n["post_norm"], eps), j["gate_up"])
        x = g.linear(f"{L}.mlp_out", g.glu(f"{L}.glu", gu, "silu"), n["down"], residual=x)
    logits = g.linear("logits", g.rms_norm("final_norm", x, FINAL_NORM, eps),
                      EMBED if cfg.tie_embeddings else LM_HEAD)
    g.expose("logits", logits)
    g.argmax("token", logits, advance=True)
    return g


def gather_weights(model: "ToyLlama", max_len: int) -> dict[str, torch.Tensor]:
    """name -> tensor for the weight arena: the per-op model's own prepared tensors (q|k|v and
    gate|up already stacked) and rotary tables from its inverse frequencies."""
    cfg = model.config
    t = {EMBED: model.embed, FINAL_NORM: model.norm}
    if not cfg.tie_embeddings:
        t[LM_HEAD] = model.lm_head
    for i, layer in enumerate(model.layers):
        n, j = layer_tensors(i), fused(i)
        t.update({n["in_norm"]: layer["in_norm"], j["qkv"]: layer["qkv"], n["o"]: layer["o"],
                  n["post_norm"]: layer["post_norm"], j["gate_up"]: layer["gate_up"], n["down"]: layer["down"]})
    # the per-op path's arithmetic (fp32 positions x inverse frequencies), kept in fp32
    angles = torch.arange(max_len, device=model.device).to(torch.float32)[:, None] * model.inv_freq[None, :]
    t[ROPE_COS], t[ROPE_SIN] = angles.cos(), angles.sin()
    return t


class ToyStep(CompiledStep):
    """The step graph compiled for one batch bucket."""

    def __init__(self, weights: dict[str, torch.Tensor], cfg: ToyConfig, batch: int, max_len: int,
                 tiling: Tiling, weight_dtype: torch.dtype, shared_weights: torch.Tensor | None = None) -> None:
        super().__init__(step_graph(cfg, max_len), weights, batch, tiling, weight_dtype, shared_weights=shared_weights)
