"""add_norm: (x + rms_norm(z) * (offset + w)) * scale, one task per row (Gemma's post-norm residuals)."""
from __future__ import annotations

import torch

from photon_core.megakernel.graph import Task
from photon_core.megakernel.ops.base import Eager, Lowering, OpRule, Planning, Stage, float_bits
from photon_core.megakernel.stepgraph import Node

OP_ADD_NORM = 11      # one row of (x + rms_norm(z) * w) * scale, chunk by chunk


def reference(e: Eager, node: Node) -> torch.Tensor:
    from photon_core.backends import reference as ref
    a = node.args
    z = e.val(a["z"])
    zn = ref.rms_norm(z.view(e.bsz, -1, a["chunk"]), e.w(a["w"]), a["eps"], a["offset"])
    y = (e.val(a["x"]) + zn.reshape(e.bsz, -1)) * a["scale"]
    if a["scale_w"] is not None:
        y = y * e.w(a["scale_w"])
    return y


def plan(pl: Planning, node: Node) -> None:
    a = node.args
    pl.eps.add(a["eps"])
    if a["offset"]:
        pl.fold_offset(node, a["w"], a["offset"])


def lower(lo: Lowering, node: Node) -> None:
    g, a, B, S, W = lo.g, node.args, lo.B, lo.S, lo.W
    st = Stage(node.value.name, g.counter(node.value.name), ancestors=lo.ancestors([a["x"], a["z"]], node.value.name))
    d = node.value.width
    fa, fk = lo.stats_finale(node.value.name)
    for r in range(B):
        g.add(Task(f"{node.value.name}[b{r}]", OP_ADD_NORM,
                   dict(N=d, x=S.off(a["x"].name), res=S.off(a["z"].name), lnw=W.off(a["w"]),
                        sw=W.off(a["scale_w"]) if a["scale_w"] else -1, scale=float_bits(a["scale"]),
                        chunk=a["chunk"], bi=r, out=S.off(node.value.name), **fa),
                   lo.waits([a["x"], a["z"]]), st.counter,
                   [S.region(a["x"].name, r * d, (r + 1) * d), S.region(a["z"].name, r * d, (r + 1) * d)],
                   [S.region(node.value.name, r * d, (r + 1) * d)], **fk))
    lo.stage_of[node.value.name] = st


RULE = OpRule("add_norm", reference, lower, plan, codes={OP_ADD_NORM: "add_norm"}, stats_finale=True)
