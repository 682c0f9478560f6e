"""argmax: an int32 result column, the first index of the largest of a linear's columns [c0, c1),
from the (max, first index) its logits-store tiles wrote; with `advance`, the row's next token and
position too."""
from __future__ import annotations

from photon_core.megakernel.graph import Region, Task
from photon_core.megakernel.ops.base import Eager, Lowering, OpRule, Planning
from photon_core.megakernel.stepgraph import Node

OP_ARGMAX = 5         # merge LM-style tiles' (max, index) into a result column; optionally advance the step


def reference(e: Eager, node: Node) -> None:
    from photon_core.backends import reference as ref
    a = node.args
    e.results[a["name"]] = ref.argmax(e.val(a["x"])[:, a["c0"]:a["c1"]]).tolist()
    return None


def plan(pl: Planning, node: Node) -> None:
    """It reads a linear's tiles (which then store logits: max and index per tile), on their grid."""
    a, bn = node.args, pl.block_n
    src = pl.producer.get(a["x"].name)
    if src is None or src.op != "linear":
        raise ValueError(f"{pl.graph.name}: argmax {a['name']!r} must read a linear's output")
    n = src.value.width
    if a["c0"] % bn or (a["c1"] % bn and a["c1"] != n):
        raise ValueError(f"{pl.graph.name}: argmax {a['name']!r} over columns [{a['c0']}, {a['c1']}) "
                         f"does not fall on the {bn}-column tiles")
    pl.logits[src.value.name] = -(-n // bn)


def lower(lo: Lowering, node: Node) -> None:
    """One task per result column, over the tiles of the columns it covers."""
    p, g, a, B, S, bn = lo.p, lo.g, node.args, lo.B, lo.S, lo.bn
    src = a["x"]
    ntiles = p.logits[src.name]
    t0, t1 = a["c0"] // bn, -(-a["c1"] // bn)
    col = lo.graph.results.index(a["name"])
    R = len(lo.graph.results)
    reads = [S.region(f"{src.name}.part", (r * ntiles + t0) * 2, (r * ntiles + t1) * 2) for r in range(B)]
    writes = [Region("out", r * R + col, r * R + col + 1) for r in range(B)]
    if a["advance"]:
        reads += [lo.dyn_tok, lo.dyn_pos]
        writes += [lo.dyn_tok, lo.dyn_pos]
    g.add(Task(f"argmax.{a['name']}", OP_ARGMAX,
               dict(M=B, K=R, n0=a["c0"], out=col, tile=t0, part=S.off(f"{src.name}.part"),
                    ntiles=ntiles, S=t1 - t0, mode=1 if a["advance"] else 0, Tmax=p.max_position),
               lo.waits([src]), None, reads, writes))


RULE = OpRule("argmax", reference, lower, plan, codes={OP_ARGMAX: "argmax"})
