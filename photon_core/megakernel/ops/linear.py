"""linear: act(x @ W.T + b) + residual, one task per tile of output columns, with the prologue of a
fused norm / glu / mul / act (ops/fused.py) in its loads and bias, activation and residual behind.
A stage with fewer tiles than Tiling.min_tasks gets narrower tiles, then split-K: K slices write
partial products to a scratch, and the last slice of each tile to finish (a ticket) sums them in a
fixed order and runs the epilogue: no reduce task, no dependency level of its own (stage_shape
decides, per stage). The store depends on the readers: a kv_append without rotary as the only
reader makes it a q|k|v store (q into the query buffer, k and v straight into the caches at the
row's position: no append task); an argmax reader makes it a logits store that also writes each
tile's (max, first index) per row; an append run as finales makes its tiles carry them."""
from __future__ import annotations

import torch

from photon_core.kernels.linear import activation_code
from photon_core.megakernel.graph import Task
from photon_core.megakernel.ops.base import NORM_CODES, Eager, Lowering, OpRule, Stage, act_code, own_lists
from photon_core.megakernel.ops.kv_append import append_finales, qkv_head
from photon_core.megakernel.stepgraph import Node

OP_LINEAR = 2         # [LN] -> x @ W.T tile -> +bias -> act -> +residual -> plain / QKV-scatter / LM-head store
OP_LINEAR_SPLIT = 7   # one K slice of a linear tile: the raw partial product into the stage's scratch; the
                      # last of the tile's slices to finish (a ticket) sums them in slot order and runs
                      # OP_LINEAR's epilogue (op 8, a reduce task of its own, is retired)
# Store modes of OP_LINEAR.
MODE_PLAIN, MODE_QKV, MODE_LOGITS = 0, 1, 2
# The most tiles of a stage whose partial row statistics its finale merges in one trip (the
# aligned builds: kernel._tile_stats, _merge_tile_stats): 64 covers a 2048-wide value in 32-column
# tiles; [8 rows, 64 tiles] x 3 floats is 6 registers a thread at batch 8. A stage of more tiles
# leaves none (compiler.plan), and its finale reads the value.
STATS_TILES = 64


def stage_shape(n: int, k: int, tiling, align: int | None = None, narrow: bool = True) -> tuple[int, int]:
    """(tile width, K slices) of a linear stage of n output columns over k inputs. Narrower tiles
    first (they read no extra bytes), split-K only if that is not enough (it adds a reduction).
    `align`: a size the width must divide (a head, so tiles can signal per head); `narrow=False`
    keeps block_n (argmax reads the stage on that tile grid)."""
    width, splits = tiling.block_n, 1
    if not tiling.min_tasks:
        return width, splits
    while (narrow and -(-n // width) < tiling.min_tasks and width // 2 >= tiling.min_block_n
           and (align is None or align % (width // 2) == 0)):
        width //= 2
    tiles = -(-n // width)
    if tiles < tiling.min_tasks:
        splits = max(1, min(tiling.max_split_k, -(-tiling.min_tasks // tiles), k // tiling.block_k))
    return width, splits


def stage_span(n: int, width: int, splits: int, tiling, align: int | None = None) -> int:
    """Tiles of `width` columns a task of the stage computes one after another (Tiling.linear_span,
    halved while the stage would have fewer than Tiling.linear_min_tasks tasks, or while a task's
    columns would not divide `align`, a head its readers wait on alone). One where the stage's tiles
    are narrowed or split in K (min_tasks: such a stage has too few tiles already)."""
    if splits > 1 or width != tiling.block_n:
        return 1
    span, tiles = tiling.linear_span, -(-n // width)
    while span > 1 and (-(-tiles // span) < tiling.linear_min_tasks or (align is not None and align % (span * width))):
        span //= 2
    return span


def reference(e: Eager, node: Node) -> torch.Tensor:
    from photon_core.backends import reference as ref
    a = node.args
    tanh = a["act"] == "tanh"    # not a linear activation of the ops contract
    y = ref.linear(e.val(a["x"]), e.weight(a["w"]), e.w(a["b"]), activation=None if tanh else a["act"])
    y = torch.tanh(y) if tanh else y
    if a["residual"] is not None:
        y = y + e.val(a["residual"])
    return y


def lower(lo: Lowering, node: Node) -> None:
    """Tiles of the stage's width; with K slices, split tasks (partial products into the stage's
    scratch) of which the last of each tile sums them in a fixed order and runs the epilogue."""
    p, g, graph, B, S, W = lo.p, lo.g, lo.graph, lo.B, lo.S, lo.W
    a, name = node.args, node.value.name
    N, K = graph.weight_shapes[a["w"]]
    width, splits, span = p.shape[name]
    cols = width * span     # a task's columns: `span` tiles, one after another (kernel._task_linear)
    norm, glu, mul, xact = p.norm_of.get(name), p.glu_of.get(name), p.mul_of.get(name), p.act_of.get(name)
    fused = norm or glu or mul or xact
    x = fused.args["x"] if fused else a["x"]
    reads_of = ([mul.args["x"], mul.args["g"]] if mul else [a["x"]]) + (
        [a["residual"]] if a["residual"] is not None else [])
    st_args, st_reads = lo.stats_read(norm)
    x_regions = [S.region(x.name)] + ([S.region(mul.args["g"].name)] if mul else []) + st_reads
    # The prologue's extra fields: a mul reads x's columns [c0, c0 + K) (row stride: x's width)
    # times act(g); an act applies its activation to the loads.
    pro = dict(xgate=S.off(mul.args["g"].name) if mul else -1, gact=act_code(mul.args["act"]) if mul else 0,
               xs=x.width if mul else -1, xc0=mul.args["c0"] if mul else 0,
               xact=act_code(xact.args["act"]) if xact else 0)
    kv = p.qkv_store.get(name)
    out = kv.value if kv is not None else node.value      # what the tiles write
    dh = lo.per_head(out)
    head_dim = dh if dh is not None and dh % cols == 0 else 0   # 0: one counter for the stage
    signal_heads = head_dim > 0
    d = out.width
    heads = -(-d // head_dim) if signal_heads else 0
    finales, rope = None, p.rope_groups.get(name, (None,))[0]
    if rope is not None:   # the append's rows run as finales of these tiles (it alone reads them)
        st, finales = append_finales(lo, name, lo.ancestors(reads_of, out.name))
    else:
        st = Stage(out.name, None if signal_heads else g.counter(out.name),
                   [g.counter(f"{out.name}.h{h}") for h in range(heads)] if signal_heads else None,
                   lo.ancestors(reads_of, out.name))
    wait = lo.waits(reads_of)
    mode = MODE_QKV if kv is not None else MODE_LOGITS if name in p.logits else MODE_PLAIN
    ntiles = -(-N // width)
    kpart = f"{name}.kpart"
    if splits > 1:
        step = -(-K // splits // p.tiling.block_k) * p.tiling.block_k   # slices on the K-step grid
        used = -(-K // step)
    for i, n0 in enumerate(range(0, N, cols)):
        n1 = min(N, n0 + cols)
        tiles = range(i * span, i * span + -(-(n1 - n0) // width))    # the task's tiles, by index
        args = dict(M=B, K=K, N=N, n0=n0, n1=n1, k0=0, k1=K, x=S.off(x.name), w=W.off(a["w"]), ldw=p.ldw[a["w"]],
                    b=W.off(a["b"]) if a["b"] else -1,
                    lnw=W.off(norm.args["w"]) if norm else -1,
                    lnb=W.off(norm.args["b"]) if norm and norm.args.get("b") else -1,
                    norm=NORM_CODES[norm.op] if norm else 0, xglu=activation_code(glu.args["act"]) if glu else 0,
                    **pro, **st_args, act=act_code(a["act"]),
                    res=S.off(a["residual"].name) if a["residual"] is not None else -1,
                    mode=mode, out=S.off(out.name))
        fa, fk = lo.stats_finale(out.name) if kv is None else ({}, {})
        args.update(fa)
        ta, tile_writes = lo.tile_stats(out.name, tiles) if kv is None else ({}, [])
        args.update(ta)
        # The epilogue's accesses: the whole tile's, or the finale of the slices' ticket.
        reads = []
        if a["residual"] is not None:
            reads += S.columns(a["residual"].name, B, N, n0, n1)
        writes = []
        if kv is not None:   # MODE_QKV
            kc, vc = kv.args["k"], kv.args["v"]
            H, hd = kc.spec.heads, kc.spec.head_dim
            kvw = H * hd                       # d (the query width) may be a multiple of it
            args.update(kc=lo.cache_off(kc), vc=lo.cache_off(vc), H=H, Dh=hd, Tmax=kc.spec.length)
            reads.append(lo.dyn_pos)
            for c0, c1, cache in ((0, d, None), (d, d + kvw, kc), (d + kvw, d + 2 * kvw, vc)):
                lo_, hi = max(n0, c0), min(n1, c1)
                if lo_ >= hi:
                    continue
                if cache is None:
                    writes += S.columns(out.name, B, d, lo_ - c0, hi - c0)
                else:
                    writes += [lo.cache_cols(cache, r, lo_ - c0, hi - c0) for r in range(B)]
        else:
            writes += S.columns(out.name, B, N, n0, n1) + tile_writes
        if mode == MODE_LOGITS:
            part = f"{name}.part"
            args.update(tile=tiles[0], part=S.off(part), ntiles=ntiles, rb=-1)
            writes += [S.region(part, (r * ntiles + j) * 2, (r * ntiles + j) * 2 + 2) for r in range(B) for j in tiles]
        if finales is not None and rope is not None:
            fa, fk, signal = finales[qkv_head(rope, n0)]
            args.update(fa)
        else:
            signal = st.heads[(n0 % d) // head_dim] if st.heads is not None else st.counter
        if splits == 1:
            g.add(Task(f"{name}[{n0}:{n1}]", OP_LINEAR, args, list(wait), signal, list(x_regions) + reads, writes,
                       **own_lists(fk)))
            continue
        # Split-K: the tile's slices, each a partial product into its slot of the scratch; the last
        # of them to finish (the tile's ticket) sums the slots and runs the epilogue above.
        slots = [S.region(kpart, (ks * B + r) * N + n0, (ks * B + r) * N + n1) for ks in range(used) for r in range(B)]
        for ks, k0 in enumerate(range(0, K, step)):
            g.add(Task(f"{name}.split[{n0}:{n1},k{k0}]", OP_LINEAR_SPLIT,
                       dict(args, k0=k0, k1=min(K, k0 + step), kpart=S.off(kpart), ksplit=ks),
                       list(wait), signal, list(x_regions), slots[ks * B:(ks + 1) * B],
                       kticket=f"{name}.sum[{n0}:{n1}]", ksum_reads=slots + reads, ksum_writes=list(writes),
                       **own_lists(fk)))
    lo.stage_of[st.name] = st


RULE = OpRule("linear", reference, lower, codes={OP_LINEAR: "linear", OP_LINEAR_SPLIT: "linear_split"},
              kticket_codes=frozenset({OP_LINEAR_SPLIT}), matrices=("w",), stats_finale=True)
