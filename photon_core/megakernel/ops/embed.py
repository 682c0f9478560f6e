"""embed: a row's token (and position) table rows into a value, one task per BLOCK_N columns."""
from __future__ import annotations

import torch

from photon_core.megakernel.graph import Task
from photon_core.megakernel.ops.base import Eager, Lowering, OpRule, Stage, float_bits
from photon_core.megakernel.stepgraph import Node

OP_EMBED = 1          # x[:, n0:n0+BN] = tok_emb[token] * scale + pos_emb[position]
# (rows / prows: the tables' row counts, so the kernel reads no row outside them, whatever the token)


def reference(e: Eager, node: Node) -> torch.Tensor:
    a = node.args
    y = e.weights[a["tok"]][torch.tensor(e.tokens, device=e.dev)].float() * a["scale"]
    if a["pos"] is not None:
        y = y + e.weights[a["pos"]][e.pos].float()
    return y


def lower(lo: Lowering, node: Node) -> None:
    p, g, a, B, S, W = lo.p, lo.g, node.args, lo.B, lo.S, lo.W
    st = Stage(node.value.name, g.counter(node.value.name), ancestors=frozenset({node.value.name}))
    d = node.value.width
    fa, fk = lo.stats_finale(node.value.name)
    for n0 in range(0, d, lo.bn):
        n1 = min(d, n0 + lo.bn)
        g.add(Task(f"{node.value.name}[{n0}:{n1}]", OP_EMBED,
                   dict(M=B, N=d, n0=n0, w=p.external[a["tok"]][0] if a["tok"] in p.external else W.off(a["tok"]),
                        b=W.off(a["pos"]) if a["pos"] else -1,
                        ldw=p.external[a["tok"]][1] if a["tok"] in p.external else p.ldw[a["tok"]],
                        scale=float_bits(a["scale"]), rows=lo.graph.weight_shapes[a["tok"]][0],
                        prows=lo.graph.weight_shapes[a["pos"]][0] if a["pos"] else 0,
                        out=S.off(node.value.name), **fa),
                   [], st.counter, [lo.dyn_tok, lo.dyn_pos], S.columns(node.value.name, B, d, n0, n1), **fk))
    lo.stage_of[node.value.name] = st


RULE = OpRule("embed", reference, lower, codes={OP_EMBED: "embed"}, matrices=("tok", "pos"), stats_finale=True)
