"""The per-op engine's chained build: step-graph nodes run as kernels/chained.py's Triton kernels.

Each runner takes what the plain build's op takes (perop_engine._Run's values, weights, caches,
the launch's clamped positions) and returns the node's value [B, width] in fp32; the kernel
object (e.kernel) says whether launches chain (PDL) and how many programs a linear aims for.
"""
from __future__ import annotations

import math

import torch

from photon_core.kernels import chained
from photon_core.kernels.linear import ACT_SIGMOID, ACT_TANH, activation_code
from photon_core.megakernel.stepgraph import Node


def _act(name: str | None) -> int:
    """kernels/linear.apply_activation's code of a step graph's activation."""
    return {"sigmoid": ACT_SIGMOID, "tanh": ACT_TANH}.get(name) or activation_code(name)  # type: ignore[arg-type]


def _linear(e, node: Node) -> torch.Tensor:
    """A linear; where its input is a norm, GLU, gate or activation the build fused
    (kernel.prologues), of that node's inputs."""
    a, k = node.args, e.kernel
    res = None if a["residual"] is None else e.val(a["residual"]).float().contiguous()
    fused = k.prologues.get(id(node))
    x, norm, gate = None, None, None
    if fused is None:
        x = e.val(a["x"]).float().contiguous()
    elif fused.op in ("layer_norm", "rms_norm"):
        n, rms = fused.args, fused.op == "rms_norm"
        x = e.val(n["x"]).float().contiguous()
        norm = chained.Norm(None if n["w"] is None else e.weights[n["w"]],
                            None if rms or n["b"] is None else e.weights[n["b"]], n["eps"], rms,
                            n["offset"] if rms else 0.0)
    else:
        gate = _gate(e, fused)
    return chained.linear(x, e.weights[a["w"]], None if a["b"] is None else e.weights[a["b"]], _act(a["act"]), res,
                          k.pdl, k.programs, norm, out=e.outs.get(node.value.name), gate=gate)


def _gate(e, node: Node) -> chained.Gate:
    """A glu, mul or act node as act(a) * b: what a linear reading it applies, or _gated launches."""
    a, w = node.args, node.value.width
    if node.op == "glu":
        x = e.val(a["x"]).float().contiguous()
        return chained.Gate(x[:, :w], x[:, w:], _act(a["act"]))
    if node.op == "mul":
        x = e.val(a["x"]).float().contiguous()
        return chained.Gate(e.val(a["g"]).float().contiguous(), x[:, a["c0"]:a["c0"] + w], _act(a["act"]))
    return chained.Gate(e.val(a["x"]).float().contiguous(), None, _act(a["act"]))


def _gated(e, node: Node) -> torch.Tensor:
    """A glu, mul or act node whose value is not only a linear's input: its own launch."""
    g = _gate(e, node)
    return chained.gated(g.a, g.b, g.act, e.kernel.pdl)


def _layer_norm(e, node: Node) -> torch.Tensor:
    a = node.args
    return chained.norm(e.val(a["x"]).float().contiguous(), e.weights[a["w"]],
                        None if a["b"] is None else e.weights[a["b"]], a["eps"], False, 0.0, e.kernel.pdl)


def _rms_norm(e, node: Node) -> torch.Tensor:
    a = node.args
    return chained.norm(e.val(a["x"]).float().contiguous(), None if a["w"] is None else e.weights[a["w"]],
                        None, a["eps"], True, a["offset"], e.kernel.pdl)


def _embed(e, node: Node) -> torch.Tensor:
    a = node.args
    return chained.embed(e.token_ids, e.pos, e.weights[a["tok"]], None if a["pos"] is None else e.weights[a["pos"]],
                         a["scale"], e.kernel.pdl)


def _add_norm(e, node: Node) -> torch.Tensor:
    a = node.args
    return chained.add_norm(e.val(a["x"]).float().contiguous(), e.val(a["z"]).float().contiguous(),
                            e.weights[a["w"]], a["eps"], a["offset"], a["chunk"], a["scale"],
                            None if a["scale_w"] is None else e.weights[a["scale_w"]], e.kernel.pdl)


def _conv_step(e, node: Node) -> torch.Tensor:
    """Qwen 3.5's causal conv step, its state ([B, C, W-1] in the arena) shifted in place."""
    a = node.args
    return chained.conv_step(e.val(a["x"]).float().contiguous(), a["c0"], e.weights[a["w"]], e.caches[a["state"].name],
                             _act(a["act"]), e.kernel.pdl)


def _delta_rule(e, node: Node) -> torch.Tensor:
    """Qwen 3.5's gated delta rule step with its gates and gated RMSNorm, the state in place."""
    a = node.args
    return chained.delta_step(e.val(a["x"]).float().contiguous(), e.val(a["zba"]).float().contiguous(), a["c0"],
                              a["k_heads"], e.weights[a["a_log"]], e.weights[a["dt_bias"]], e.weights[a["norm_w"]],
                              a["eps"], e.caches[a["state"].name], e.kernel.pdl)


def _kv_append(e, node: Node) -> torch.Tensor:
    a = node.args
    dh = a["k"].spec.head_dim
    rot = a["rotary"]
    cos = sin = None
    if rot is not None:
        cos, sin = e.weights[rot.cos], e.weights[rot.sin]
        if cos.shape[-1] != rot.dims // 2 or not cos.is_contiguous() or not sin.is_contiguous():
            raise ValueError(f"{node.value.name}: rotary tables {tuple(cos.shape)} for {rot.dims} dims")
    hn = a["norm"]
    norm = None if hn is None else chained.HeadNorm(None if hn.q is None else e.weights[hn.q],
                                                    None if hn.k is None else e.weights[hn.k], hn.v, hn.eps, hn.offset)
    tau = a["tau"]
    if tau is not None:
        tau = chained.Tau(e.val(tau.value).float().contiguous(), e.weights[tau.alpha])
    return chained.rotary_append(e.val(a["qkv"]).float().contiguous(), node.value.width // dh, e.cache(a["k"]),
                                 e.cache(a["v"]), e.pos, e.rot_pos, cos, sin, 0 if rot is None else rot.dims,
                                 a["k"].spec.ring, a["append"], e.kernel.pdl, norm, tau)


def _attention(e, node: Node) -> torch.Tensor:
    a = node.args
    spec = a["k"].spec
    scale = a["scale"] if a["scale"] is not None else 1.0 / math.sqrt(spec.head_dim)
    self_keys = a["length"] == "self"
    return chained.attention(e.val(a["q"]).float().contiguous(), e.cache(a["k"]), e.cache(a["v"]),
                             e.pos if self_keys else e.lengths, self_keys, a["window"], spec.ring, scale,
                             e.kernel.pdl, tickets=e.kernel.tickets)


def _moe(e, node: Node) -> torch.Tensor:
    """Moondream 3's experts: only the chosen ones read, FP8 ones as bytes with their row scales."""
    a = node.args
    scales = None if a["gate_up_scale"] is None else (e.weights[a["gate_up_scale"]], e.weights[a["down_scale"]])
    res = None if a["residual"] is None else e.val(a["residual"]).float().contiguous()
    return chained.moe(e.val(a["x"]).float().contiguous(), e.val(a["logits"]), e.weights[a["gate_up"]],
                       e.weights[a["down"]], a["top_k"], _act(a["act"]), a["up_offset"], a["renormalize"], res,
                       e.kernel.pdl, e.kernel.programs, scales)


CHAINED = {"embed": _embed, "linear": _linear, "layer_norm": _layer_norm, "rms_norm": _rms_norm, "glu": _gated,
           "mul": _gated, "act": _gated, "add_norm": _add_norm, "kv_append": _kv_append, "attention": _attention,
           "conv_step": _conv_step, "delta_rule": _delta_rule, "moe": _moe}

__all__ = ["CHAINED"]
