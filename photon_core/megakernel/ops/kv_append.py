"""kv_append: per (row, query head), per-head RMSNorm, tau scaling and rotary on q (and k), q out,
k and v into the caches at the row's position (slot position % length for a ring cache). Where each
group of heads sharing q|k|v tiles has at most Tiling.rope_finale_rows of them, the (row, head)
work is not tasks: the last of the group's q|k|v tiles to finish runs it (a ticket finale over rows
of the task table that are never claimed; ops/linear.py). Without rotary, norms or tau, and with as
many K/V heads as query heads, the q|k|v linear stores into the caches itself (Planning.qkv_store)."""
from __future__ import annotations

import torch

from photon_core.megakernel.graph import TaskGraph, Task
from photon_core.megakernel.ops.base import Eager, Lowering, OpRule, Planning, Stage
from photon_core.megakernel.stepgraph import Node

OP_ROPE_APPEND = 6    # (row, head) of a fused q|k|v: rotary on q and k, q out, k and v into the caches


def qkv_head(node: Node, c: int) -> int:
    """The query head whose append task (kv_append `node`) reads column c of its q|k|v input."""
    dh, H, d = node.args["k"].spec.head_dim, node.args["k"].spec.heads, node.value.width
    return c // dh if c < d else (c - d) % (H * dh) // dh


def head_groups(node: Node, width: int) -> list[list[int]]:
    """The query heads of kv_append `node` joined by the `width`-column tiles of its q|k|v input:
    an append task (row, head h) reads q head h and, while h < K/V heads, k and v head h; a tile
    whose columns reach two heads joins their groups."""
    a = node.args
    parent = list(range(node.value.width // a["k"].spec.head_dim))

    def root(h: int) -> int:
        while parent[h] != h:
            h = parent[h]
        return h

    n = a["qkv"].width
    for n0 in range(0, n, width):
        heads = {qkv_head(node, c) for c in range(n0, min(n, n0 + width))}
        first = root(min(heads))
        for h in heads:
            parent[root(h)] = first
    groups: dict[int, list[int]] = {}
    for h in range(len(parent)):
        groups.setdefault(root(h), []).append(h)
    return sorted(groups.values())


def reference(e: Eager, node: Node) -> torch.Tensor:
    from photon_core.backends import reference as ref
    a, bsz, pos, weights = node.args, e.bsz, e.pos, e.weights
    k_c, v_c = e.cache(a["k"]), e.cache(a["v"])
    h, dh = a["k"].spec.heads, a["k"].spec.head_dim
    hq = node.value.width // dh
    append = a["append"]
    qkv = e.val(a["qkv"])
    if not append:   # q alone: k, v stand-ins that are never stored
        qkv = torch.cat([qkv, qkv.new_zeros(bsz, 2 * h * dh)], dim=1)
    q, k, v = qkv.split([hq * dh, h * dh, h * dh], dim=1)
    q, k, v = q.reshape(bsz, hq, 1, dh), k.reshape(bsz, h, 1, dh), v.reshape(bsz, h, 1, dh)
    if a["tau"] is not None:
        tv = e.val(a["tau"].value)
        pos_f = torch.sigmoid(weights[a["tau"].alpha].float()[None] * torch.log(pos.float() + 1)[:, None]) + 0.5
        q = q * (tv[:, :hq] + pos_f).view(bsz, hq, 1, 1)
        v = v * (tv[:, hq:hq + h] + pos_f[:, :h]).view(bsz, h, 1, 1)
    hn = a["norm"]
    if hn is not None:
        def norm(x, w):
            return ref.rms_norm(x, None if w is None else weights[w].float(), hn.eps, hn.offset)
        q = q if hn.q is None else norm(q, hn.q)
        k = k if hn.k is None else norm(k, hn.k)
        v = norm(v, None) if hn.v else v
    rot = a["rotary"]
    if rot is not None:
        cos = weights[rot.cos].float()[e.rot_pos].view(bsz, 1, 1, -1)
        sin = weights[rot.sin].float()[e.rot_pos].view(bsz, 1, 1, -1)
        q, k = ref.rotary(q, cos, sin, rot.dims), ref.rotary(k, cos, sin, rot.dims)
    if append:
        ref.kv_append(k_c, v_c, k, v, pos % k_c.shape[2] if a["k"].spec.ring else pos)
    return q.reshape(bsz, hq * dh)


def plan(pl: Planning, node: Node) -> None:
    a, graph = node.args, pl.graph
    if a["norm"] is not None:
        hn = a["norm"]
        pl.eps.add(hn.eps)
        for w in (hn.q, hn.k):
            if w is not None and hn.offset:
                pl.fold_offset(node, w, hn.offset)
    elif a["rotary"] is None and a["k"].spec.heads * a["k"].spec.head_dim == node.value.width \
            and not a["k"].spec.ring and a["tau"] is None and a["append"]:
        # The linear stores q|k|v itself only with as many K/V heads as query heads (the
        # kernel's q|k|v store); grouped-query K/V go through append tasks.
        src = pl.producer.get(a["qkv"].name)
        readers = graph.consumers(src.value) if src is not None else []
        if src is not None and src.op == "linear" and len(readers) == 1 and readers[0] is node:
            pl.qkv_store[src.value.name] = node


def append_tasks(lo: Lowering, node: Node) -> dict[tuple[int, int], Task]:
    """kv_append's task per (row, query head), without waits or signal: per-head norms and rotary
    on q (and k), q out, k and v of K/V head h (h < K/V heads) into the caches."""
    S, W, B, a = lo.S, lo.W, lo.B, node.args
    k, v = a["k"], a["v"]
    H, dh = k.spec.heads, k.spec.head_dim
    d = node.value.width                 # Hq * dh: query heads may outnumber K/V heads
    hq, row = d // dh, d + 2 * H * dh
    rot, tau, append, hn = a["rotary"], a["tau"], a["append"], a["norm"]
    qkv = a["qkv"].name
    if not append:
        row = d                        # q alone: nothing goes into the (shared) caches
    tasks = {}
    for h in range(hq):                # query head h; K/V head h too while h < H
        for r in range(B):
            reads = [S.region(qkv, r * row + h * dh, r * row + (h + 1) * dh), lo.dyn_pos, lo.dyn_rot]
            writes = [S.region(node.value.name, r * d + h * dh, r * d + (h + 1) * dh)]
            if tau:
                tv = tau.value.name
                reads += [S.region(tv, r * 2 * hq + h, r * 2 * hq + h + 1)]
                if h < H:
                    reads += [S.region(tv, r * 2 * hq + hq + h, r * 2 * hq + hq + h + 1)]
            if h < H and append:
                reads += [S.region(qkv, r * row + d + c * H * dh + h * dh, r * row + d + c * H * dh + (h + 1) * dh)
                          for c in range(2)]
                writes += [lo.cache_cols(k, r, h * dh, (h + 1) * dh), lo.cache_cols(v, r, h * dh, (h + 1) * dh)]
            tasks[(r, h)] = Task(f"{node.value.name}[b{r},h{h}]", OP_ROPE_APPEND,
                                 dict(K=rot.dims if rot else 0, N=d, x=S.off(qkv),
                                      w=W.off(rot.cos) if rot else -1, b=W.off(rot.sin) if rot else -1,
                                      out=S.off(node.value.name), kc=lo.cache_off(k), vc=lo.cache_off(v), H=H, Dh=dh,
                                      Tmax=k.spec.length, bi=r, hi=h, ring=int(k.spec.ring),
                                      rows=lo.graph.weight_shapes[rot.cos][0] if rot else 0,
                                      lnw=W.off(hn.q) if hn is not None and hn.q else -1,
                                      lnb=W.off(hn.k) if hn is not None and hn.k else -1,
                                      norm=0 if hn is None else (hn.q is not None) | (hn.k is not None) << 1 | hn.v << 2,
                                      mode=0 if append else 1, tau=S.off(tau.value.name) if tau else -1,
                                      alpha=W.off(tau.alpha) if tau else -1),
                                 [], None, reads, writes)
    return tasks


def append_finales(lo: Lowering, name: str, ancestors: frozenset[str]) -> tuple[Stage, dict[int, tuple]]:
    """For a q|k|v linear in Plan.rope_groups: its append's stage, and per query head, what the
    tiles producing that head's columns carry: (task arguments, Task keywords, counter to signal).
    A group of heads shares a ticket whose finale runs the group's append rows (rows of the task
    table after the tasks, never claimed themselves)."""
    g: TaskGraph = lo.g
    node, groups = lo.p.rope_groups[name]
    tasks = append_tasks(lo, node)
    out = node.value.name
    heads = lo.per_head(node.value) is not None
    counters = [g.counter(f"{out}.g{i}") for i in range(len(groups))] if heads else []
    group_of = {h: i for i, grp in enumerate(groups) for h in grp}
    rst = Stage(out, None if heads else g.counter(out),
                [counters[group_of[h]] for h in sorted(group_of)] if heads else None, ancestors | {out})
    per_group = []
    for i, grp in enumerate(groups):
        rows = [tasks[(r, h)] for h in grp for r in range(lo.B)]
        per_group.append((dict(fin=len(g.rows), nfin=len(rows)),
                          dict(ticket=f"{out}.g{i}", last_reads=[x for t in rows for x in t.reads],
                               last_writes=[x for t in rows for x in t.writes]),
                          counters[i] if heads else rst.counter))
        g.rows += rows
    return rst, {h: per_group[group_of[h]] for h in group_of}


def lower(lo: Lowering, node: Node) -> None:
    """One task per (row, query head), unless its q|k|v linear stored it or runs it as finales."""
    g, a = lo.g, node.args
    if node.value.name in lo.stage_of:      # stored by its q|k|v linear, or run as its tiles' finales
        return
    H = a["k"].spec.heads
    tau = a["tau"]
    signal_heads = lo.per_head(node.value) is not None
    st = Stage(node.value.name, None if signal_heads else g.counter(node.value.name),
               [g.counter(f"{node.value.name}.h{h}") for h in range(H)] if signal_heads else None,
               lo.ancestors([a["qkv"]], node.value.name))
    wait = lo.waits([a["qkv"]] + ([tau.value] if tau else []))
    for (r, h), t in append_tasks(lo, node).items():
        t.waits, t.signal = list(wait), st.heads[h] if st.heads else st.counter
        g.add(t)
    lo.stage_of[node.value.name] = st


RULE = OpRule("kv_append", reference, lower, plan, codes={OP_ROPE_APPEND: "rope_append"})
