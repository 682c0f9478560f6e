"""moe: a mixture of experts after the router's logits. Route tasks per row; expert tasks per
routed (row, slot) pair and span of column tiles, of which only the batch's first pair choosing an
expert reads it, for all rows choosing it (each chosen expert read once a step); sum tasks per row
and tile."""
from __future__ import annotations

import torch

from photon_core.kernels.linear import activation_code
from photon_core.megakernel.graph import Task
from photon_core.megakernel.ops.base import NORM_CODES, Eager, Lowering, OpRule, Stage, float_bits
from photon_core.megakernel.ops.linear import MODE_PLAIN
from photon_core.megakernel.stepgraph import Node, StepGraph, Value

OP_MOE_ROUTE = 12     # one row's top-k experts by its router logits, and their weights
# MoE expert tasks run only for the batch's first (row, slot) pair choosing their expert e, and then
# for every row choosing e at once: each chosen expert is read once a step.
OP_MOE_UP = 13        # (pair, tile of F): each row choosing e: act(x G_e) * (x U_e + offset)
OP_MOE_DOWN = 14      # (pair, tile of D): each row choosing e: its weight * h D_e, a partial
OP_MOE_SUM = 15       # (row, tile of D): the row's expert partials summed in slot order, + residual


def reference(e: Eager, node: Node) -> torch.Tensor:
    from photon_core.backends import reference as ref
    a, weights = node.args, e.weights
    weights_k, ids = ref.moe_route(e.val(a["logits"]), a["top_k"], a["renormalize"])
    xs = e.val(a["x"])
    f = weights[a["down"]].shape[-1]
    y = torch.zeros_like(xs)

    def expert(w: str, ex: int) -> torch.Tensor:   # FP8 experts dequantized: w * row scale
        sc = a.get(f"{w}_scale")
        t = weights[a[w]][ex].float()
        return t if sc is None else t * weights[sc][ex].float()[:, None]
    for r in range(e.bsz):
        for s in range(a["top_k"]):
            ex = int(ids[r, s])
            gu = ref.linear(xs[r:r + 1], expert("gate_up", ex))
            h = ref.glu(gu[:, :f], gu[:, f:], a["act"], a["up_offset"])
            y[r] += weights_k[r, s] * ref.linear(h, expert("down", ex))[0]
    if a["residual"] is not None:
        y = y + e.val(a["residual"])
    return y


def expert_spans(n: int, pairs: int, tiling) -> list[tuple[int, int]]:
    """The column ranges of one pair's expert tasks over a stage of n columns: Tiling.expert_span
    tiles each, halved while the stage's `pairs` x ranges would fall under expert_min_tasks."""
    tiles, span = -(-n // tiling.block_n), max(1, tiling.expert_span)
    while span > 1 and pairs * -(-tiles // span) < tiling.expert_min_tasks:
        span //= 2
    width = tiling.block_n * span
    return [(n0, min(n, n0 + width)) for n0 in range(0, n, width)]


def tail_scratch(graph: StepGraph, node: Node, batch: int, tiling) -> dict[str, tuple[int, ...]]:
    """Per layer: the routing, every pair's hidden, every row's partial from every pair, and the
    weight elements each expert task loaded (see lower)."""
    k, (_, d, f) = node.args["top_k"], graph.weight_shapes[node.args["down"]]
    tiles = len(expert_spans(f, batch * k, tiling)) + len(expert_spans(d, batch * k, tiling))
    return {f"{node.value.name}.route": (batch, k, 2),          # per row: chosen (expert, weight)
            f"{node.value.name}.h": (batch * k, batch, f),      # pair j's expert, every row's hidden
            f"{node.value.name}.part": (batch, batch * k, d),   # row r's output from pair j's expert
            f"{node.value.name}.loads": (batch * k, tiles)}     # weight elements each expert task read


def lower(lo: Lowering, node: Node) -> None:
    """Four stages. Route: one task per row (top k of its logits, their weights). Up: one task per
    routed pair j = (row, slot) and span of F (Tiling.expert_span tiles, computed one after
    another); down: one per pair and span of D. Every row's route
    is done before any expert task starts, so an up or down task of pair j sees the whole batch's
    routing: only if j is the FIRST pair choosing its expert e does it read e's weight tile, once
    per K step, for every row choosing e at once (the other tasks exit), so a step reads each
    chosen expert once however many rows chose it. Up writes h[j, row] ([B*k, B, F]); down writes
    the weighted partial part[row, j] ([B, B*k, D]). Sum: one task per row and tile of D adds the
    partials of the row's slots in slot order (deterministic: no atomics), + residual. Which pair
    writes which h / part rows depends on the routing, so each task's declared writes are its own
    slab j (all rows) and readers declare the slabs they may read: the checker proves the graph
    for every routing. Each expert task also writes the weight elements it loaded (0 if not the
    first) to its cell of `{name}.loads`: CompiledStep.expert_bytes_read counts them."""
    p, g, graph, B, S, W, bn = lo.p, lo.g, lo.graph, lo.B, lo.S, lo.W, lo.bn
    waits, ancestors = lo.waits, lo.ancestors
    a, name = node.args, node.value.name
    E, F2, D = graph.weight_shapes[a["gate_up"]]
    F, k = F2 // 2, a["top_k"]
    P = B * k                                   # routed pairs
    spans_f, spans_d = expert_spans(F, P, lo.p.tiling), expert_spans(D, P, lo.p.tiling)
    tiles_f, tiles_d = len(spans_f), len(spans_d)
    norm = p.norm_of.get(name)
    x = norm.args["x"] if norm else a["x"]
    route, hid, part = Value(f"{name}.route", 2 * k), f"{name}.h", f"{name}.part"
    loads = f"{name}.loads"
    route_counter, up_counter, down_counter = g.counter(route.name), g.counter(hid), g.counter(part)
    stages = {route.name: Stage(route.name, route_counter, ancestors=ancestors([a["logits"]], route.name))}
    for r in range(B):
        g.add(Task(f"{route.name}[b{r}]", OP_MOE_ROUTE,
                   dict(N=E, x=S.off(a["logits"].name) + r * E, out=S.off(route.name) + r * 2 * k, S=k,
                        mode=int(a["renormalize"])),
                   waits([a["logits"]]), route_counter,
                   [S.region(a["logits"].name, r * E, (r + 1) * E)], [S.region(route.name, r * 2 * k, (r + 1) * 2 * k)]))
    all_routes = S.region(route.name)
    # the new stages are visible to waits() only once registered
    up = Stage(hid, up_counter, ancestors=ancestors([x], hid) | stages[route.name].ancestors)
    st_args, st_reads = lo.stats_read(norm)
    norm_args = dict(lnw=W.off(norm.args["w"]) if norm else -1,
                     lnb=W.off(norm.args["b"]) if norm and norm.args.get("b") else -1,
                     norm=NORM_CODES[norm.op] if norm else 0, **st_args)
    no_prologue = dict(xs=-1, xc0=0, xgate=-1, gact=0, xact=0, xglu=0)
    return_stages = dict(stages)
    route_st = stages[route.name]
    # x is ready once the route is, when the router read x (Moondream 3): then one wait.
    wait_up = [(route_counter, B)] + ([] if x.name in route_st.ancestors else waits([x]))
    for j in range(P):
        for t, (n0, n1) in enumerate(spans_f):
            cell = j * (tiles_f + tiles_d) + t
            g.add(Task(f"{hid}[p{j},{n0}:{n1}]", OP_MOE_UP,
                       dict(M=B, K=D, N=F, n0=n0, n1=n1, k0=0, k1=D, x=S.off(x.name), w=W.toff(a["gate_up"]),
                            wsc=W.toff(a["gate_up_scale"]) if a["gate_up_scale"] else -1,
                            ldw=p.ldw[a["gate_up"]], act=activation_code(a["act"]), scale=float_bits(a["up_offset"]),
                            tile=j, S=k, part=S.off(route.name), out=S.off(hid) + j * B * F,
                            loads=S.off(loads) + cell, **no_prologue, **norm_args),
                       list(wait_up), up.counter, [S.region(x.name), all_routes] + st_reads,
                       [S.region(hid, (j * B + r) * F + n0, (j * B + r) * F + n1) for r in range(B)]
                       + [S.region(loads, cell, cell + 1)]))
    return_stages[hid] = up
    down = Stage(part, down_counter, ancestors=up.ancestors | {part})
    n_up = g.signalers(up_counter)
    for j in range(P):
        for t, (n0, n1) in enumerate(spans_d):
            cell = j * (tiles_f + tiles_d) + tiles_f + t
            g.add(Task(f"{part}[p{j},{n0}:{n1}]", OP_MOE_DOWN,
                       dict(M=B, K=F, N=D, n0=n0, n1=n1, k0=0, k1=F, x=S.off(hid) + j * B * F, w=W.toff(a["down"]),
                            wsc=W.toff(a["down_scale"]) if a["down_scale"] else -1, ldw=p.ldw[a["down"]],
                            tile=j, S=k, part=S.off(route.name), out=S.off(part) + j * D, loads=S.off(loads) + cell,
                            lnw=-1, lnb=-1, norm=0, **no_prologue),
                       [(up_counter, n_up)], down_counter, [S.region(hid, j * B * F, (j + 1) * B * F), all_routes],
                       [S.region(part, (r * P + j) * D + n0, (r * P + j) * D + n1) for r in range(B)]
                       + [S.region(loads, cell, cell + 1)]))
    return_stages[part] = down
    res = a["residual"]
    out = Stage(name, g.counter(name), ancestors=down.ancestors | {name} | (
        ancestors([res], name) if res is not None else frozenset()))
    wait_sum = [(down_counter, g.signalers(down_counter))]
    if res is not None and res.name not in down.ancestors:
        wait_sum += waits([res])
    fa, fk = lo.stats_finale(name)
    for r in range(B):
        for n0 in range(0, D, bn):
            n1 = min(D, n0 + bn)
            # any pair's partial for this row may be read (which ones: the routing's first pairs)
            reads = [S.region(part, r * P * D, (r + 1) * P * D), all_routes]
            if res is not None:
                reads.append(S.region(res.name, r * D + n0, r * D + n1))
            g.add(Task(f"{name}[b{r},{n0}:{n1}]", OP_MOE_SUM,
                       dict(M=1, N=D, n0=n0, n1=n1, bi=r, S=k, part=S.off(route.name), kpart=S.off(part), b=-1,
                            act=0, res=S.off(res.name) + r * D if res is not None else -1, mode=MODE_PLAIN,
                            out=S.off(name) + r * D, **fa),
                       list(wait_sum), out.counter, reads, [S.region(name, r * D + n0, r * D + n1)], **fk))
    return_stages[name] = out
    lo.stage_of.update(return_stages)


RULE = OpRule("moe", reference, lower, codes={OP_MOE_ROUTE: "moe_route", OP_MOE_UP: "moe_up", OP_MOE_DOWN: "moe_down",
                                             OP_MOE_SUM: "moe_sum"}, tail_scratch=tail_scratch,
              matrices=("gate_up", "down"), stats_finale=True)
