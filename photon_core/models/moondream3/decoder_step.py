"""Moondream 3's text decode step (LM head and region heads included) as a step graph that
megakernel.compiler lowers to ONE launch; the host side (KV-cache rows, logit bias, launch, results)
is Moondream 2's MoondreamDecoderMegakernel, which this module feeds another decoder.

Per step, for B rows (batch bucket 1/2/4/8; each row at its own position):

    x = input embedding [B, D]            (a word, or an encoded coordinate / size: the host writes it)
    per layer (Moondream 2's parallel block: one LayerNorm feeds attention and the MLP):
        h      = LN(x)
        qkv    = h @ Wqkv.T + b
        t      = tanh(gelu_tanh(qkv) @ Wtau.T)                  [2H]   (no bias; tanh GELU as text.py)
        q_h   *= t[h] + p_h,  v_h *= t[H + h] + p_h,  p_h = sigmoid(alpha_h * log(pos + 1)) + 0.5
                 (pos: the row's cache position, 0 = BOS, as text.tau_position), then partial rotary
                 on q and k; k, v appended to the caches at pos      (one append task per row, head)
        a      = softmax(q k^T / sqrt(Dh)) v over positions 0..pos  (grouped K/V heads allowed)
        m      = x + GELU_tanh(h @ W1.T + b1) @ W2.T + b2           (dense layers < moe.start_layer)
               = x + sum_top-k w_e * D_e(gelu(h G_e) * (h U_e + 1)) (MoE layers: router h @ Wr.T + br,
                                                                   softmax over the k chosen logits)
        x      = a @ Wo.T + bo + m
    token      = argmax(post_ln(x) @ Wlm.T + blm + logit_bias[row])
    coord bin  = argmax(LN_r(x) @ Wc.T + bc)                       (x BEFORE post_ln)
    size bins  = argmax per half of LN_r(x) @ Ws.T + bs            (width, height)

`reference_step` is the same step on the model's own code (text.forward / lm_logits / region
heads) with backends.reference ops, the ground truth for tests.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

import torch

from photon_core.backends import reference as ref
from photon_core.megakernel.compiler import CompiledStep
from photon_core.megakernel.stepgraph import Rotary, StepGraph, Tau
from photon_core.models.moondream import decoder_step as md2_step
from photon_core.models.moondream.decoder_step import MoondreamDecoderMegakernel

from . import region as md3_region
from . import text as md3_text


@dataclass(frozen=True)
class Dims:
    d: int
    heads: int
    kv_heads: int
    head_dim: int
    rot: int
    ff: int              # dense layers' MLP width
    vocab: int
    layers: int
    moe_start: int       # layers >= moe_start are MoE (layers when there is no MoE)
    experts: int
    expert_ff: int
    top_k: int
    tau: bool
    coord_bins: int
    size_bins: int       # both halves (width bins + height bins)
    max_context: int
    fp8: bool = False    # FP8 experts with per-row scales (kept FP8 in the compiled step)

    @property
    def qkv(self) -> int:
        return (self.heads + 2 * self.kv_heads) * self.head_dim


def dims_of(cfg: Any, fp8: bool = False) -> Dims:
    """Dims from a Moondream3Config (fp8: the experts are FP8 with row scales)."""
    t, r, m = cfg.text, cfg.region, cfg.text.moe
    hd = t.dim // t.n_heads
    return Dims(t.dim, t.n_heads, t.n_kv_heads, hd, md3_text.rot_dim(t), t.ff_dim, t.vocab_size, t.n_layers,
                m.start_layer if m is not None else t.n_layers, m.num_experts if m is not None else 0,
                m.expert_inner_dim if m is not None else 0, m.experts_per_token if m is not None else 0,
                t.tau_attn, r.coord_out_dim, r.size_out_dim, t.max_context, fp8)


def weight_shapes(dm: Dims) -> dict[str, tuple[int, ...]]:
    d = dm.d
    s: dict[str, tuple[int, ...]] = {}
    for li in range(dm.layers):
        L = f"L{li}"
        s.update(md2_step.block_shapes(L, d, dm.qkv))
        if li >= dm.moe_start:
            s.update({f"{L}.router_w": (dm.experts, d), f"{L}.router_b": (dm.experts,),
                      f"{L}.gate_up": (dm.experts, 2 * dm.expert_ff, d), f"{L}.down": (dm.experts, d, dm.expert_ff)})
            if dm.fp8:
                s.update({f"{L}.gate_up_scale": (dm.experts, 2 * dm.expert_ff), f"{L}.down_scale": (dm.experts, d)})
        else:
            s.update(md2_step.dense_mlp_shapes(L, d, dm.ff))
        if dm.tau:
            s.update({f"{L}.tau_w": (2 * dm.heads, dm.qkv), f"{L}.tau_alpha": (dm.heads,)})
    s.update(md2_step.lm_shapes(dm))
    s.update({"r_ln.w": (d,), "r_ln.b": (d,), "r_coord_w": (dm.coord_bins, d), "r_coord_b": (dm.coord_bins,),
              "r_size_w": (dm.size_bins, d), "r_size_b": (dm.size_bins,)})
    return s


def step_graph(dm: Dims, max_len: int) -> StepGraph:
    """The decode step (module docstring) as a graph of ops, from the dims alone."""
    d, dh = dm.d, dm.head_dim
    g = StepGraph(f"moondream3-decoder-d{d}-L{dm.layers}-V{dm.vocab}", weight_shapes(dm))
    kc = g.cache("kcache", dm.kv_heads, max_len, dh, layers=dm.layers)
    vc = g.cache("vcache", dm.kv_heads, max_len, dh, layers=dm.layers)
    rope = Rotary("rope_cos", "rope_sin", dm.rot)
    x = g.input("x", d)
    for li in range(dm.layers):
        L = f"L{li}"
        h, qkv = md2_step.block_input(g, L, x)
        tau = None
        if dm.tau:
            # tanh GELU, as the makers' engine (m87-labs/kestrel PR #162; text.py's docstring)
            t = g.linear(f"{L}.tau", g.act(f"{L}.qkv_gelu", qkv, "gelu_tanh"), f"{L}.tau_w", act="tanh")
            tau = Tau(t, f"{L}.tau_alpha")
            # Exposed so that the pruned text graph (launch without the region heads) keeps it:
            # layout.needed_nodes follows Value arguments only, not the Value inside a Tau.
            g.expose(f"{L}.tau", t)
        q = g.kv_append(f"{L}.rope", qkv, kc[li], vc[li], rotary=rope, q_heads=dm.heads, tau=tau)
        a = g.attention(f"{L}.attn", q, kc[li], vc[li], "self")
        if li >= dm.moe_start:
            route = g.linear(f"{L}.router", h, f"{L}.router_w", f"{L}.router_b")
            scales = dict(gate_up_scale=f"{L}.gate_up_scale", down_scale=f"{L}.down_scale") if dm.fp8 else {}
            m = g.moe(f"{L}.moe", h, route, f"{L}.gate_up", f"{L}.down", dm.top_k, act="gelu", up_offset=1.0,
                      renormalize=True, residual=x, **scales)
        else:
            hid = g.linear(f"{L}.mlp_up", h, f"{L}.fc1_w", f"{L}.fc1_b", act="gelu_tanh")
            m = g.linear(f"{L}.mlp_down", hid, f"{L}.fc2_w", f"{L}.fc2_b", residual=x)
        # x + attn_out + mlp, in the reference's order: proj(a) + (x + mlp).
        x = g.linear(f"{L}.proj", a, f"{L}.proj_w", f"{L}.proj_b", residual=m)
    md2_step.lm_head(g, x, dm.vocab)
    rh = g.layer_norm("region_ln", x, "r_ln.w", "r_ln.b")
    g.argmax("coord", g.linear("coord_logits", rh, "r_coord_w", "r_coord_b"))
    md2_step.size_argmax(g, g.linear("size_logits", rh, "r_size_w", "r_size_b"), dm.size_bins)
    return g


def gather_weights(text_w: md3_text.TextWeights, region_w: md3_region.RegionWeights) -> dict[str, torch.Tensor]:
    """name -> tensor for the weights arena (tensors shared; the arena copies them)."""
    t: dict[str, torch.Tensor] = {}
    for li, b in enumerate(text_w.blocks):
        L = f"L{li}"
        t.update(md2_step.block_weights(L, b))
        if b.router is not None:
            router, gate_up, down = b.experts()
            t.update({f"{L}.router_w": router[0], f"{L}.router_b": router[1], f"{L}.gate_up": gate_up,
                      f"{L}.down": down})
            scales = b.expert_scales()
            if scales is not None:
                t.update({f"{L}.gate_up_scale": scales[0], f"{L}.down_scale": scales[1]})
        else:
            t.update(md2_step.dense_mlp_weights(L, b))
        if b.tau_wqwv is not None:
            tau_w, tau_alpha = b.tau()
            t.update({f"{L}.tau_w": tau_w, f"{L}.tau_alpha": tau_alpha})
    t.update(md2_step.lm_weights(text_w))
    t.update({"r_ln.w": region_w.ln[0], "r_ln.b": region_w.ln[1], "r_coord_w": region_w.coord_head[0],
              "r_coord_b": region_w.coord_head[1], "r_size_w": region_w.size_head[0],
              "r_size_b": region_w.size_head[1]})
    return t


def map_tensors(x: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """x with every tensor t inside it (dataclass fields, lists in place, tuples rebuilt) replaced by
    fn(t); dataclasses and lists are changed in place and returned."""
    if isinstance(x, torch.Tensor):
        return fn(x)
    if isinstance(x, tuple):
        return type(x)(map_tensors(y, fn) for y in x)
    if isinstance(x, list):
        x[:] = [map_tensors(y, fn) for y in x]
    elif dataclasses.is_dataclass(x):
        for f in dataclasses.fields(x):
            setattr(x, f.name, map_tensors(getattr(x, f.name), fn))
    return x


def share_arena(mk: CompiledStep, text_w: md3_text.TextWeights, region_w: md3_region.RegionWeights) -> int:
    """Rebind every tensor of text_w / region_w that the compiled step's weights arena holds as it is
    (same dtype, same contiguous layout, no folded offset) to its view in the arena, so the per-op
    prefill and the compiled step read ONE copy (the originals are freed once nothing else holds
    them): on a 16 GB GPU the FP8 experts could not be held twice. The originals may be the CPU
    copies the arena was filled from (load_moondream3 with the megakernel reads the checkpoint to
    the CPU): the arena is on the model's device, so their views take them there. Returns the bytes
    shared."""
    swap: dict[int, torch.Tensor] = {}
    for k, t in gather_weights(text_w, region_w).items():
        v = mk.weight(k)
        already = v.device == t.device and v.data_ptr() == t.data_ptr()
        if k not in mk.plan.weight_offset and v.dtype == t.dtype and v.is_contiguous() and not already:
            swap[id(t)] = v
    map_tensors(text_w, lambda x: swap.get(id(x), x))
    map_tensors(region_w, lambda x: swap.get(id(x), x))
    return sum(v.numel() * v.element_size() for v in swap.values())


class Moondream3DecoderMegakernel(MoondreamDecoderMegakernel):
    """Moondream 3's decode step as one persistent launch for a fixed batch bucket; everything but
    the decoder (cache rows, logit bias, step, the pruned text graph) is Moondream 2's class."""

    gather_weights = staticmethod(gather_weights)
    region_prefixes = ("r_",)

    def __init__(self, text_w: md3_text.TextWeights, region_w: md3_region.RegionWeights, cfg: Any, *args: Any,
                 **kwargs: Any) -> None:
        # FP8 experts (loaded for the megakernel) stay FP8 in the arena: the graph carries their scales
        self.fp8 = any(b.experts_gate_up_scale is not None for b in text_w.blocks)
        super().__init__(text_w, region_w, cfg, *args, **kwargs)

    def dims_of(self, cfg: Any) -> Dims:
        return dims_of(cfg, self.fp8)

    def graph_of(self, cfg: Any, max_len: int) -> StepGraph:
        return step_graph(self.dims_of(cfg), max_len)


def reference_step(text_w: md3_text.TextWeights, region_w: md3_region.RegionWeights, cfg: Any, caches: list[Any],
                   embeddings: torch.Tensor, positions: list[int], bias: torch.Tensor | None = None) -> dict[str, Any]:
    """The same step with backends.reference ops, one row at a time through Moondream 3's own
    text.forward (which appends to each row's cache) and region head. Returns hidden [B, D],
    logits [B, V] (bias added), tokens, coord bins and size bins."""
    def region_logits(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rh = ref.layer_norm(h, *region_w.ln)
        return ref.linear(rh, *region_w.coord_head), ref.linear(rh, *region_w.size_head)

    return md2_step.reference_rows(md3_text, text_w, cfg, caches, embeddings, positions, bias, region_logits)
