"""Gemma 4's text decode step (E2B / E4B), stated once as a step graph that megakernel.compiler
lowers to ONE launch.

Per step, for B rows (batch bucket 1/2/4/8; each row at its own position, read from device memory):

    x    = embed[token] * sqrt(D)                                 (scale rounded to the weights' dtype)
    ple  = (embed_pl[token] * sqrt(P) + rms_norm_P(x @ (W_plp * D^-0.5).T) * w) * 2^-0.5
                                                                   [L * P]: norm per P-column chunk
    per layer i (post-norm residuals, scale 1 attention):
        h      = rms_norm(x, input_layernorm)
        q|k|v  = h @ Wqkv.T                   (k_eq_v layers: q|k|k, v is the raw key projection)
        q,k,v  = per-head RMSNorm (q_norm, k_norm, scale-free v), rotary on q and k (sliding layers:
                 default rotary; full layers: "proportional", tables whose unrotated tail is
                 cos 1 / sin 0); k, v appended (sliding layers: a ring of min(window, max_len))
                 KV-shared layers: q only, over their source layer's caches
        a      = attention(q, caches, window on sliding layers, scale 1)
        x      = x + rms_norm(a @ Wo.T, post_attention_layernorm)
        m      = down(gelu_tanh(h2 Wg) * h2 Wu),  h2 = rms_norm(x, pre_feedforward_layernorm)
        x      = x + rms_norm(m, post_feedforward_layernorm)
        x      = (x + rms_norm((gelu_tanh(x Wgate) * ple[i]) Wproj, post_per_layer_input_norm))
                 * layer_scalar                        (without per-layer inputs: the scalar on the MLP's)
    logits     = rms_norm(x, norm) @ E.T + logit_bias     (tied head; the bias bars placeholder ids)
    token      = argmax(logits)    (`advance`: it becomes the row's next token and the position steps,
                                    so greedy rows decode in rounds on the device, megakernel.decode_loop;
                                    the host-driven step sets both anyway)

The final logit softcap c * tanh(l / c) is monotone, so the in-kernel argmax is the greedy token;
the host applies the cap to the exposed logits when it samples.

Weight names are the family's own (weights.py's short names, fused q|k|v and gate|up) plus the
re-laid ones: `rope.<kind>.cos/sin` tables, `text.per_layer_model_projection.scaled` (the D^-0.5
folded in) and `self_attn.qkkv.weight` on k_eq_v layers. `step_graph` needs only the config, so a
graph of the real E2B size costs no memory (bench/roofline.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from photon_core.megakernel.compiler import CompiledStep, Tiling
from photon_core.megakernel.decode_loop import FULL
from photon_core.megakernel.stepgraph import HeadNorm, Rotary, StepGraph
from photon_core.runtime.decode import copy_prefilled_kv

from . import text
from .config import TextConfig

KINDS = ("sliding_attention", "full_attention")
PLE_PROJ = "text.per_layer_model_projection.scaled"


def rope_names(kind: str) -> tuple[str, str]:
    short = "sliding" if kind == "sliding_attention" else "full"
    return f"rope.{short}.cos", f"rope.{short}.sin"


def cache_names(layer: int) -> tuple[str, str]:
    return f"L{layer}.k", f"L{layer}.v"


def ring_slots(cfg: TextConfig, max_len: int) -> int:
    """Slots of a sliding layer's ring: the window, or the whole context when that is shorter
    (text.KVCache's rule, so prefilled caches copy slot for slot)."""
    return min(cfg.sliding_window, max_len)


def _qkv_name(i: int, cfg: TextConfig) -> str:
    L = cfg.layers[i]
    p = f"text.layers.{i}.self_attn."
    if L.kv_source != i:
        return p + "q_proj.weight"
    return p + ("qkkv.weight" if L.k_eq_v else "qkv.weight")


def weight_shapes(cfg: TextConfig, max_len: int) -> dict[str, tuple[int, ...]]:
    """Every weight the step reads, by name, with its shape (from the config alone)."""
    d = cfg.dim
    s: dict[str, tuple[int, ...]] = {}
    s["text.embed_tokens.weight"] = (cfg.vocab_size, d)
    s["text.norm.weight"] = (d,)
    if not cfg.tie_embeddings:
        s["text.lm_head.weight"] = (cfg.vocab_size, d)
    if cfg.ple_dim:
        s["text.embed_tokens_per_layer.weight"] = (cfg.ple_vocab, cfg.n_layers * cfg.ple_dim)
        s[PLE_PROJ] = (cfg.n_layers * cfg.ple_dim, d)
        s["text.per_layer_projection_norm.weight"] = (cfg.ple_dim,)
    # In the layers' order: a set's order changes with the process's string hashing, and the weights'
    # order is the arena's layout (another one in every process: the build cache never read).
    for kind in dict.fromkeys(L.kind for L in cfg.layers):
        hd = next(L.head_dim for L in cfg.layers if L.kind == kind)
        for name in rope_names(kind):
            s[name] = (max_len, hd // 2)
    for i, L in enumerate(cfg.layers):
        p = f"text.layers.{i}."
        for n in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                  "post_feedforward_layernorm"):
            s[p + n + ".weight"] = (d,)
        s[p + "layer_scalar"] = (1,)
        q_rows = cfg.n_heads * L.head_dim
        s[_qkv_name(i, cfg)] = (q_rows + (2 * L.n_kv_heads * L.head_dim if L.kv_source == i else 0), d)
        s[p + "self_attn.q_norm.weight"] = (L.head_dim,)
        if L.kv_source == i:
            s[p + "self_attn.k_norm.weight"] = (L.head_dim,)
        s[p + "self_attn.o_proj.weight"] = (d, q_rows)
        s[p + "mlp.gate_up.weight"] = (2 * L.ff_dim, d)
        s[p + "mlp.down_proj.weight"] = (d, L.ff_dim)
        if cfg.ple_dim:
            s[p + "per_layer_input_gate.weight"] = (cfg.ple_dim, d)
            s[p + "per_layer_projection.weight"] = (d, cfg.ple_dim)
            s[p + "post_per_layer_input_norm.weight"] = (d,)
    return s


def embed_scales(cfg: TextConfig, dtype: torch.dtype) -> tuple[float, float]:
    """sqrt(D) and sqrt(P) rounded to the weights' dtype, as text.embed and per_layer_inputs use them."""
    return (float(torch.tensor(cfg.embed_scale, dtype=dtype)),
            float(torch.tensor(cfg.ple_dim ** 0.5, dtype=dtype)) if cfg.ple_dim else 1.0)


def step_graph(cfg: TextConfig, max_len: int, dtype: torch.dtype = torch.float32) -> StepGraph:
    """The decode step (module docstring) as a graph of ops, from the config alone. `dtype`: the
    model's, for the embedding scales' rounding."""
    if max_len < 1:
        raise ValueError(f"max_len must be >= 1, got {max_len}")
    for kind in {L.kind for L in cfg.layers}:
        if len({L.head_dim for L in cfg.layers if L.kind == kind}) > 1:
            raise NotImplementedError(f"the Gemma 4 decode step shares one rotary table per layer kind; "
                                      f"{kind} layers of different head sizes are not supported yet")
    g = StepGraph(f"gemma4-decoder-d{cfg.dim}-L{cfg.n_layers}-V{cfg.vocab_size}", weight_shapes(cfg, max_len))
    eps, P = cfg.eps, cfg.ple_dim
    ring = ring_slots(cfg, max_len)
    caches = {}
    for i, L in enumerate(cfg.layers):
        if L.kv_source == i:
            length = ring if L.sliding else max_len
            kn, vn = cache_names(i)
            caches[i] = (g.cache(kn, L.n_kv_heads, length, L.head_dim, ring=L.sliding),
                         g.cache(vn, L.n_kv_heads, length, L.head_dim, ring=L.sliding))
    rot = {kind: Rotary(*rope_names(kind), next(L.head_dim for L in cfg.layers if L.kind == kind))
           for kind in {L.kind for L in cfg.layers}}
    s_emb, s_ple = embed_scales(cfg, dtype)
    x = g.embed("x", "text.embed_tokens.weight", scale=s_emb)
    ple = None
    if P:
        tok = g.embed("ple.tok", "text.embed_tokens_per_layer.weight", scale=s_ple)
        ple = g.add_norm("ple", tok, g.linear("ple.proj", x, PLE_PROJ), "text.per_layer_projection_norm.weight",
                         eps=eps, chunk=P, scale=2.0 ** -0.5)
    for i, L in enumerate(cfg.layers):
        p, n = f"text.layers.{i}.", f"L{i}."
        kc, vc = caches[L.kv_source]
        own = L.kv_source == i
        h = g.rms_norm(n + "h", x, p + "input_layernorm.weight", eps)
        qkv = g.linear(n + "qkv", h, _qkv_name(i, cfg))
        norm = HeadNorm(q=p + "self_attn.q_norm.weight", k=p + "self_attn.k_norm.weight" if own else None,
                        v=own, eps=eps)
        q = g.kv_append(n + "q", qkv, kc, vc, rot[L.kind], cfg.n_heads, norm, append=own)
        window = ring if L.sliding else None
        a = g.attention(n + "attn", q, kc, vc, window=window, scale=1.0)
        x = g.add_norm(n + "x_attn", x, g.linear(n + "o", a, p + "self_attn.o_proj.weight"),
                       p + "post_attention_layernorm.weight", eps)
        h2 = g.rms_norm(n + "h2", x, p + "pre_feedforward_layernorm.weight", eps)
        gu = g.linear(n + "gate_up", h2, p + "mlp.gate_up.weight")
        m = g.linear(n + "down", g.glu(n + "glu", gu, cfg.activation), p + "mlp.down_proj.weight")
        scalar = p + "layer_scalar"
        x = g.add_norm(n + "x_mlp", x, m, p + "post_feedforward_layernorm.weight", eps,
                       scale_w=None if ple is not None else scalar)
        if ple is not None:
            gate = g.linear(n + "ple.gate", x, p + "per_layer_input_gate.weight")
            gated = g.mul(n + "ple.gated", ple, gate, act=cfg.activation, c0=i * P)
            proj = g.linear(n + "ple.proj", gated, p + "per_layer_projection.weight")
            x = g.add_norm(n + "x_ple", x, proj, p + "post_per_layer_input_norm.weight", eps, scale_w=scalar)
    g.expose("hidden", x)
    head = "text.embed_tokens.weight" if cfg.tie_embeddings else "text.lm_head.weight"
    bias = g.input("logit_bias", cfg.vocab_size)
    logits = g.linear("logits", g.rms_norm("final", x, "text.norm.weight", eps), head, residual=bias)
    g.expose("logits", logits)
    g.argmax("token", logits, advance=True)
    return g


def rotary_tables(cfg: TextConfig, max_len: int, device: torch.device) -> dict[str, torch.Tensor]:
    """cos/sin [max_len, head_dim / 2] per layer kind, computed as text.Rotary computes them."""
    out = {}
    pos = torch.arange(max_len, device=device).float()
    for kind in {L.kind for L in cfg.layers}:
        hd = next(L.head_dim for L in cfg.layers if L.kind == kind)
        ang = pos[:, None] * text.inv_freq(cfg.rope[kind], hd).to(device)[None]
        cos, sin = rope_names(kind)
        out[cos], out[sin] = ang.cos(), ang.sin()
    return out


def gather_weights(w: dict[str, torch.Tensor], cfg: TextConfig, max_len: int) -> dict[str, torch.Tensor]:
    """name -> tensor for the weights arena, from the model's weights (weights.load_state): shared
    where the layout is the model's own, re-laid where the step needs it."""
    shapes = weight_shapes(cfg, max_len)
    dev = w["text.embed_tokens.weight"].device
    out = rotary_tables(cfg, max_len, dev)
    if cfg.ple_dim:
        proj = w["text.per_layer_model_projection.weight"]
        out[PLE_PROJ] = (proj.float() * cfg.dim ** -0.5).to(proj.dtype)
    for i, L in enumerate(cfg.layers):
        if L.kv_source == i and L.k_eq_v:
            # v is the raw key projection: repeat the key rows as value rows (v_norm has no scale).
            qk = w[f"text.layers.{i}.self_attn.qkv.weight"]
            nk = L.n_kv_heads * L.head_dim
            out[_qkv_name(i, cfg)] = torch.cat([qk, qk[-nk:]])
    for k in shapes:
        if k not in out:
            out[k] = w[k]
    return out


@dataclass
class StepOut:
    logits: torch.Tensor     # [B, vocab] fp32, softcapped, barred ids -inf (a copy)
    tokens: list[int]        # the in-kernel greedy token of each row (barred ids never chosen)


class Gemma4DecoderStep(CompiledStep):
    """Gemma 4's decode step compiled for one batch bucket: KV caches per layer that makes its own
    ([B, Hkv, slots, Dh] views, `view(cache_names(i)[0])`), a logit bias that bars the placeholder
    ids, the exposed logits. Every bucket of one model can share one weights arena (`weights`)."""

    def __init__(self, w: dict[str, torch.Tensor], cfg: TextConfig, batch: int, max_len: int,
                 tiling: Tiling = Tiling(), weight_dtype: torch.dtype | None = None,
                 weights: torch.Tensor | None = None, barred: tuple[int, ...] = (), check: bool = True,
                 model_dtype: torch.dtype = torch.float32) -> None:
        if not 0 < max_len <= cfg.max_context:
            raise ValueError(f"max_len {max_len} must be in (0, {cfg.max_context}] (the model's context)")
        self.cfg, self.max_len = cfg, max_len
        weight_dtype = weight_dtype or model_dtype
        tensors = {} if weights is not None else gather_weights(w, cfg, max_len)
        if weights is not None:   # the layout is known from the graph; no tensor is read
            tensors = {k: torch.empty(0) for k in weight_shapes(cfg, max_len)}
            # except the token tables the compiler may read in place (not in the arena): the
            # layout depends on which are, so every bucket must offer the same ones as the first.
            tensors.update({k: w[k] for k in ("text.embed_tokens.weight", "text.embed_tokens_per_layer.weight")
                            if k in w})
        super().__init__(step_graph(cfg, max_len, model_dtype), tensors, batch, tiling, weight_dtype,
                         shared_weights=weights, check=check,
                         device=w["text.embed_tokens.weight"].device)
        self.allowed = torch.ones(cfg.vocab_size, dtype=torch.bool, device=self.state.device)
        self.allowed[list(barred)] = False
        bias = torch.zeros(cfg.vocab_size, device=self.state.device).masked_fill(~self.allowed, float("-inf"))
        self.set_input("logit_bias", bias)

    def load_row(self, row: int, cache: text.KVCache, cache_row: int = 0) -> None:
        """Copy one row of a prefilled text.KVCache (any max_len up to this step's) into row `row`."""
        one = slice(cache_row, cache_row + 1)
        copy_prefilled_kv(self, cache_names, {i: (k[one], cache.v[i][one]) for i, k in cache.k.items()},
                          slice(row, row + 1))

    def step(self, tokens: list[int], positions: list[int]) -> StepOut:
        """Decode one position per row (all B rows of the bucket)."""
        self.set_step(tokens, positions)
        self.launch()
        logits = self.view("logits").clone()
        if self.cfg.final_softcap:
            c = float(self.cfg.final_softcap)
            logits = torch.tanh(logits / c) * c
        logits.masked_fill_(~self.allowed, float("-inf"))
        # The argmax advances: it wrote each row's token into the next step's input, also for a row at
        # the last compiled position, whose result column says -1 (no room for a next step); -2
        # says the row's logits held NaN (its input token then means nothing: the -2 is passed on).
        marks_col = self.result("token")
        marks, fed = torch.stack([marks_col, self.dyn[:self.batch].to(marks_col.dtype)]).tolist()   # one read
        return StepOut(logits, [t if m == FULL else m for t, m in zip(fed, marks)])


# google/gemma-4-E2B-it's text config (as bench/families.py states it): 35 layers x 1536, 8 heads /
# 1 KV head of 256 (full layers 512), 4 sliding : 1 full, window 512, the last 20 layers share
# K/V and have double-wide MLPs, per-layer inputs of 256, softcap 30.
E2B_TEXT = dict(
    vocab_size=262144, hidden_size=1536, intermediate_size=6144, num_hidden_layers=35, num_attention_heads=8,
    num_key_value_heads=1, head_dim=256, global_head_dim=512, sliding_window=512,
    layer_types=(["sliding_attention"] * 4 + ["full_attention"]) * 7, vocab_size_per_layer_input=262144,
    hidden_size_per_layer_input=256, num_kv_shared_layers=20, use_double_wide_mlp=True,
    final_logit_softcapping=30.0, max_position_embeddings=131072, rope_parameters={
        "full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1e6, "rope_type": "proportional"},
        "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"}})


def roofline_model(text_config: dict | None = None, context: int = 4096,
                   name: str = "Gemma 4 E2B") -> tuple[str, StepGraph, int]:
    """(name, step graph, fp32 KV bytes one row reads at half the context) for bench/roofline.py:
    the graph from the config alone (no weights), compiled for `context` positions. Every layer's
    attention counts, the KV-shared layers' reads of their source caches included."""
    cfg = TextConfig.from_dict(text_config or E2B_TEXT)
    half = context // 2
    kv = sum(2 * L.n_kv_heads * L.head_dim * 4 * (min(cfg.sliding_window, half) if L.sliding else half)
             for L in cfg.layers)
    return name, step_graph(cfg, context, torch.bfloat16), kv
