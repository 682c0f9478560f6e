"""attention: split-KV partials per (row, query head, split); the last of a (row, head)'s partials
to finish merges them (a ticket: no merge task, no dependency level of its own)."""
from __future__ import annotations

import torch

from photon_core.megakernel.graph import Task
from photon_core.megakernel.ops.base import Eager, Lowering, OpRule, Stage, float_bits
from photon_core.megakernel.stepgraph import Node, StepGraph

OP_ATTN_PARTIAL = 3   # one query, keys of split s of S, for (b, h): writes (m, l, acc); the last of the
                      # S to finish (a ticket) merges them into the attention output
OP_ATTN_MERGE = 4     # merge the S partials of (b, h) into the attention output (hand-built graphs;
                      # the compiler fuses the merge into the last partial)
# Sequence-length sources of OP_ATTN_PARTIAL.
LEN_SELF, LEN_CROSS = 0, 1


def reference(e: Eager, node: Node) -> torch.Tensor:
    from photon_core.backends import reference as ref
    a, bsz, dev = node.args, e.bsz, e.dev
    # bf16 caches hold what the compiled step stores (rounded); attention reads fp32
    k_c, v_c = e.cache(a["k"]).float(), e.cache(a["v"]).float()
    dh = a["k"].spec.head_dim
    lengths = e.pos + 1 if a["length"] == "self" else torch.tensor(e.cross_len, device=dev)
    q = e.val(a["q"]).view(bsz, -1, 1, dh)
    if a["k"].spec.ring:   # unroll each row's ring into positions [n - window, n)
        w, ring = a["window"], a["k"].spec.length
        rows = []
        for r in range(bsz):
            n = int(lengths[r])
            slots = torch.arange(max(0, n - w), n, device=dev) % ring
            rows.append(ref.decode_attention(q[r:r + 1], k_c[r:r + 1, :, slots], v_c[r:r + 1, :, slots],
                                             torch.tensor([len(slots)], device=dev), a["scale"]))
        y = torch.cat(rows)
    else:
        y = ref.decode_attention(q, k_c, v_c, lengths, a["scale"], a["window"])
    return y.reshape(bsz, node.value.width)


def attention_splits(node: Node, batch: int, tiling) -> int:
    """KV splits a (row, query head) of this attention gets: the tiling's (self or cross), halved
    while the stage would keep at least Tiling.attn_min_tasks tasks (0: never). Splits exist to
    give every program work when (row, head) pairs are few (batch 1); once the pairs alone fill
    the GPU, a split only adds a task's fixed cost (claim, header, waits: ~5 us on the first GPU
    run) and a share of a merge (Moondream 2 at batch 8: 256 pairs x 4 splits = 1024 tasks a
    layer, where 256 fill 132 SMs). One split still stores its partial and merges it (the
    kernel's one path; the direct store it could make moved ptxas's allocation at the 255-register
    edge: 8 B of stack in the batch-1 FP8 streaming build under 3.9)."""
    splits = max(1, tiling.self_splits if node.args["length"] == "self" else tiling.cross_splits)
    pairs = batch * (node.value.width // node.args["k"].spec.head_dim)
    while splits > 1 and tiling.attn_min_tasks and pairs * (splits // 2) >= tiling.attn_min_tasks:
        splits //= 2
    return splits


def scratch(graph: StepGraph, node: Node, batch: int, tiling) -> dict[str, tuple[int, ...]]:
    """Each (row, head, split)'s partial (m, l, acc[Dh])."""
    spec = node.args["k"].spec
    splits = attention_splits(node, batch, tiling)
    return {f"{node.value.name}.part": (batch, node.value.width // spec.head_dim, splits, spec.head_dim + 2)}


def lower(lo: Lowering, node: Node) -> None:
    p, g, B, S = lo.p, lo.g, lo.B, lo.S
    a, name = node.args, node.value.name
    k, v, q = a["k"], a["v"], a["q"]
    H, dh = k.spec.heads, k.spec.head_dim
    d = node.value.width
    hq = d // dh                         # query heads; head h reads K/V head h // (hq / H)
    self_len = a["length"] == "self"
    splits = attention_splits(node, B, p.tiling)
    part = f"{name}.part"
    # No merge tasks: the last partial of each (row, head) to finish merges (a ticket per (row,
    # head)), so the stage's counter, which every partial signals, is complete only once every
    # merge is done, and the attention costs one dependency level instead of two.
    st = Stage(name, g.counter(name), ancestors=lo.ancestors([q], name))
    for r in range(B):
        for h in range(hq):
            hk = h // (hq // H)
            wait = lo.waits([q], head=h)
            b0 = (r * hq + h) * splits * (dh + 2)
            merge_reads = [S.region(part, b0, b0 + splits * (dh + 2))]
            merge_writes = [S.region(name, r * d + h * dh, r * d + (h + 1) * dh)]
            for s in range(splits):
                p0 = b0 + s * (dh + 2)
                g.add(Task(f"{name}.part[b{r},h{h},s{s}]", OP_ATTN_PARTIAL,
                           dict(x=S.off(q.name), K=d, N=hq, tile=hk, kc=lo.cache_off(k), vc=lo.cache_off(v), H=H,
                                Dh=dh, Tmax=k.spec.length, part=S.off(part), bi=r, hi=h, s=s, S=splits,
                                out=S.off(name), lenkind=LEN_SELF if self_len else LEN_CROSS,
                                window=a["window"] or 0, ring=int(k.spec.ring),
                                scale=-1 if a["scale"] is None else float_bits(a["scale"])),
                           wait, st.counter,
                           [S.region(q.name, r * d + h * dh, r * d + (h + 1) * dh),
                            lo.cache_cols(k, r, hk * dh, (hk + 1) * dh), lo.cache_cols(v, r, hk * dh, (hk + 1) * dh),
                            lo.dyn_pos if self_len else lo.dyn_xlen],
                           [S.region(part, p0, p0 + dh + 2)],
                           ticket=f"{name}.merge[b{r},h{h}]", last_reads=list(merge_reads),
                           last_writes=list(merge_writes)))
    lo.stage_of[name] = st


RULE = OpRule("attention", reference, lower, codes={OP_ATTN_PARTIAL: "attn_partial", OP_ATTN_MERGE: "attn_merge"},
              scratch=scratch)
