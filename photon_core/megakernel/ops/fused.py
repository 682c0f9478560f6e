"""Ops with no task of their own: a host input, and the prologues fused into the loads of the
linears (and MoE experts) that read them: layer_norm / rms_norm (row statistics, then the affine),
glu (act(gate) * up), mul (x * act(g)) and act. Their rules check that only such readers read them
and record, per reading linear, what it fuses (Planning.norm_of / glu_of / mul_of / act_of); the
linear's lowering writes the prologue's fields."""
from __future__ import annotations

import torch

from photon_core.megakernel.ops.base import FUSED, Eager, OpRule, Planning, eager_act
from photon_core.megakernel.stepgraph import Node


def input_reference(e: Eager, node: Node) -> torch.Tensor:
    if e.inputs is None or node.value.name not in e.inputs:
        raise ValueError(f"the step's input {node.value.name!r} was not given")
    return e.inputs[node.value.name].float().reshape(e.bsz, node.value.width)


def layer_norm_reference(e: Eager, node: Node) -> torch.Tensor:
    from photon_core.backends import reference as ref
    a = node.args
    return ref.layer_norm(e.val(a["x"]), e.weight(a["w"]), e.w(a["b"]), a["eps"])


def rms_norm_reference(e: Eager, node: Node) -> torch.Tensor:
    from photon_core.backends import reference as ref
    a = node.args
    return ref.rms_norm(e.val(a["x"]), e.w(a["w"]), a["eps"], a["offset"])


def glu_reference(e: Eager, node: Node) -> torch.Tensor:
    from photon_core.backends import reference as ref
    gate, up = e.val(node.args["x"]).chunk(2, dim=-1)
    return ref.glu(gate, up, node.args["act"])


def mul_reference(e: Eager, node: Node) -> torch.Tensor:
    a, w = node.args, node.value.width
    return e.val(a["x"])[:, a["c0"]:a["c0"] + w] * eager_act(e.val(a["g"]), a["act"])


def act_reference(e: Eager, node: Node) -> torch.Tensor:
    return eager_act(e.val(node.args["x"]), node.args["act"])


def norm_plan(pl: Planning, node: Node) -> None:
    """Only a linear's (or MoE's) input, not its residual, can take a fused norm."""
    a, graph = node.args, pl.graph
    pl.eps.add(a["eps"])
    if node.op == "rms_norm" and a["offset"]:
        # (offset + w) is folded into the stored weight at load time.
        pl.fold_offset(node, a["w"], a["offset"])
    for c in graph.consumers(node.value):
        if c.op not in ("linear", "moe") or c.args["x"] is not node.out or c.args["residual"] is node.out:
            raise ValueError(f"{graph.name}: {node.op} {node.value.name!r} is read by {c.op} "
                             f"{c.value.name if c.out else c.args.get('name')!r}: only a linear's input "
                             "can take a fused LayerNorm")
        pl.norm_of[c.value.name] = node


def prologue_plan(pl: Planning, node: Node) -> None:
    """glu, mul and act: read by a linear's input only (one prologue a linear), never chained."""
    a, graph = node.args, pl.graph
    for arg in ("x", "g") if node.op == "mul" else ("x",):
        src = pl.producer.get(a[arg].name)
        if src is not None and src.op in FUSED:
            raise ValueError(f"{graph.name}: {node.op} {node.value.name!r} reads {src.op} "
                             f"{src.value.name!r}; fused ops cannot be chained")
    for c in graph.consumers(node.value):
        if c.op != "linear" or c.args["x"] is not node.out or c.args["residual"] is node.out \
                or c.value.name in pl.norm_of:
            raise ValueError(f"{graph.name}: {node.op} {node.value.name!r} is read by {c.op} "
                             f"{c.value.name if c.out else c.args.get('name')!r}: only a linear's input "
                             f"can take a fused {'GLU' if node.op == 'glu' else node.op}")
        {"glu": pl.glu_of, "mul": pl.mul_of, "act": pl.act_of}[node.op][c.value.name] = node


RULES = (OpRule("input", input_reference),
         OpRule("layer_norm", layer_norm_reference, plan=norm_plan),
         OpRule("rms_norm", rms_norm_reference, plan=norm_plan),
         OpRule("glu", glu_reference, plan=prologue_plan),
         OpRule("mul", mul_reference, plan=prologue_plan),
         OpRule("act", act_reference, plan=prologue_plan))
