"""Static checks of a task graph before it is ever launched.

A bad graph on the GPU is a hang (a program spinning on a counter nobody will raise) or a silent race;
under the interpreter it is a hang too. So the host proves, for every graph it builds:

1. well-formed: known ops, targets >= 1, counters that exist;
2. acyclic: the relation "signaler of c -> waiter on c" has no cycle (Kahn's algorithm);
3. every wait satisfiable by EARLIER tasks: tasks are claimed in list order, and a program never
   gives its task up, so a wait that needs a later task deadlocks once all programs are busy (and
   always under the interpreter, which runs one program to completion after another);
4. race-free: any two tasks touching an overlapping state region, one of them writing, are ordered by
   a chain of waits. A wait orders a task after the signalers of a counter only when its target is the
   counter's total number of signalers (otherwise which ones finished is unknown), so only such
   waits count as ordering edges.
5. tickets (graph.Task.ticket): the finale of a ticket group runs in whichever member finishes last,
   after that member's own work and before its signal. It is checked as one more node of the
   happens-before relation: after every member and every ancestor of one (the ticket's acq_rel
   increments order each member's work before the last member's finale), and before exactly the
   tasks ordered after ALL members (the only ones sure to follow whichever member was last). A
   finale's accesses are declared by every member alike (Task.last_reads / last_writes).
   A split-K slice also draws a tile ticket (Task.kticket) BEFORE its stage's ticket, so a tile's
   finale (the sum and epilogue) precedes the finale of any ticket whose group holds all the tile's
   slices (the stage's row statistics): its last slice ran it before taking that ticket.
6. finales as the kernel runs them: the declared finale accesses of 5. are only worth the proof if
   they are what the last member runs. The kernel draws a task's ticket where the task is an
   attention partial (its merge) or names a finale (`stout`: row statistics; `fin`/`nfin`: finale
   rows), so each member draws it exactly once, and a task with no ticket names no finale (it
   would draw the control word at -1, outside the buffer). Any member may be last, so all carry
   the same finale arguments. The finale rows a group's `fin` points at (TaskGraph.rows, run as
   rope_append rows whatever their op) are its own: the accesses derived from their arguments, as
   kernel._task_rope_append addresses them, are declared by the group (reads), and write exactly
   what it declares (writes); no row belongs to two groups.
7. caches apart from the state: tasks declare cache accesses in a namespace per cache (and layer,
   "{key}@cols": positions are dynamic, so they are position-free) that the race check of 4.
   takes to be disjoint from every other buffer, while the kernel addresses the cache inside the
   state arena. So each cache's span there (TaskGraph.caches: all rows, heads and positions of
   the layer) must overlap no other cache's span and no state region any task or finale declares.
   A graph without cache layouts (one built by hand, or read back from the build cache, which was
   proven when it was built) is checked without this, and its finale rows' cache writes are taken
   as the rows declare them.
"""
from __future__ import annotations

import bisect
import heapq
from collections import defaultdict, deque

from photon_core.megakernel.graph import CacheLayout, Region, Task, TaskGraph
from photon_core.megakernel.ops import KTICKET_OPS, OP_ATTN_PARTIAL, OP_NAMES, OP_ROPE_APPEND

# Buffers the finale rows address besides the caches: the state arena (compiler.plan's Arena) and the
# per-step dyn buffer (graph.DYN_*: positions at [B:2B], rotary offsets at [3B:4B]).
STATE, DYN = "state", "dyn"
# A task's finale arguments (kernel._step_tasks): whichever member is last runs the finale they name.
FINALE_ARGS = ("stout", "stx", "stn", "stkind", "stpart", "stnt", "fin", "nfin")


class GraphError(ValueError):
    pass


def tuple_of(r: Region) -> tuple[str, int, int]:
    return (r.buffer, r.start, r.end)


def _intervals(regions) -> dict[str, list[tuple[int, int]]]:
    """Regions as sorted, merged [start, end) intervals per buffer."""
    by: dict[str, list[tuple[int, int]]] = defaultdict(list)
    for r in regions:
        if r.start < r.end:
            by[r.buffer].append((r.start, r.end))
    out = {}
    for buf, iv in by.items():
        iv.sort()
        merged = [list(iv[0])]
        for a, b in iv[1:]:
            if a <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], b)
            else:
                merged.append([a, b])
        out[buf] = [(a, b) for a, b in merged]
    return out


def _uncovered(regions, cover) -> Region | None:
    """The first piece of `regions` outside `cover` (both lists of Region), or None."""
    cov = _intervals(cover)
    for buf, iv in _intervals(regions).items():
        c = cov.get(buf, [])
        for a, b in iv:
            k = 0
            while a < b:
                while k < len(c) and c[k][1] <= a:
                    k += 1
                if k == len(c) or c[k][0] > a:
                    return Region(buf, a, b if k == len(c) else min(b, c[k][0]))
                a = c[k][1]
    return None


def _row_accesses(row: Task, batch: int, caches: dict[str, CacheLayout]) -> tuple[list[Region], list[Region]]:
    """(reads, writes) of a finale row as kernel._task_rope_append addresses them from its
    arguments: (row b, query head h) of a q|k|v row at `x`, q head h out, k and v head h (h < H) into
    the caches at kc / vc, any position. Weights are read-only and not declared. The cache writes
    map to their namespace through `caches` (by kc / vc); without layouts they are the row's own."""
    a = row.args

    def arg(k: str) -> int:
        if k not in a:
            raise GraphError(f"finale row {row.name!r}: no argument {k!r}")
        return a[k]
    rot, D, x, out, H, Dh, b, h = (arg(k) for k in ("K", "N", "x", "out", "H", "Dh", "bi", "hi"))
    if Dh <= 0 or H <= 0 or D <= 0:
        raise GraphError(f"finale row {row.name!r}: heads {H} of {Dh} features, width {D}")
    q_only = a.get("mode", -1) == 1
    width = D if q_only else D + 2 * H * Dh
    half = rot // 2
    ext = Dh if rot <= 0 else max(Dh, min(Dh, half) + half)   # a feature, or its rotary partner
    q = x + b * width
    reads = [Region(STATE, q + h * Dh, q + h * Dh + ext), Region(DYN, batch + b, batch + b + 1),
             Region(DYN, 3 * batch + b, 3 * batch + b + 1)]
    writes = [Region(STATE, out + b * D + h * Dh, out + b * D + (h + 1) * Dh)]
    tau = a.get("tau", -1)
    if tau >= 0:
        hq = D // Dh
        reads += [Region(STATE, tau + b * 2 * hq + h, tau + b * 2 * hq + h + 1),
                  Region(STATE, tau + b * 2 * hq + hq + min(h, H - 1), tau + b * 2 * hq + hq + min(h, H - 1) + 1)]
    if h < H and not q_only:
        reads += [Region(STATE, q + D + h * Dh, q + D + h * Dh + ext),
                  Region(STATE, q + D + H * Dh + h * Dh, q + D + (H + h + 1) * Dh)]
        if not caches:
            writes += [r for r in row.writes if r.buffer.endswith("@cols")]
        for key in ("kc", "vc") if caches else ():
            ns = next((n for n, lay in caches.items() if lay.toff == arg(key)), None)
            lay = caches.get(ns) if ns is not None else None
            if ns is None or lay is None or (lay.heads, lay.length, lay.head_dim) != (H, arg("Tmax"), Dh) or not 0 <= b < batch:
                raise GraphError(f"finale row {row.name!r}: {key} {arg(key)} (row {b}, head {h} of {H}, "
                                 f"{arg('Tmax')} positions of {Dh}) is not a row and head of any cache's layout")
            writes.append(Region(ns, (b * H + h) * Dh, (b * H + h + 1) * Dh))
    return reads, writes


def check(graph: TaskGraph) -> None:
    """Raise GraphError with a precise message if the graph is not safe to launch."""
    tasks = graph.tasks
    if not tasks:
        raise GraphError(f"{graph.model}: empty graph")
    names = [t.name for t in tasks]
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})[:3]
        raise GraphError(f"{graph.model}: duplicate task names {dup}")
    signalers: dict[str, list[int]] = defaultdict(list)
    for i, t in enumerate(tasks):
        if t.op not in OP_NAMES:
            raise GraphError(f"task {i} {t.name!r}: unknown op {t.op}")
        if t.signal is not None:
            if t.signal not in graph.counters:
                raise GraphError(f"task {i} {t.name!r}: signals unknown counter {t.signal!r}")
            signalers[t.signal].append(i)
        for c, target in t.waits:
            if c not in graph.counters:
                raise GraphError(f"task {i} {t.name!r}: waits on unknown counter {c!r}")
            if target < 1:
                raise GraphError(f"task {i} {t.name!r}: wait target {target} on {c!r} must be >= 1")
        fin, stout = t.args.get("fin", -1), t.args.get("stout", -1)
        if fin >= 0 and stout >= 0:
            raise GraphError(f"task {i} {t.name!r}: both row statistics (stout) and finale rows (fin): "
                             "one finale per ticket")
        if t.ticket is None and (fin >= 0 or stout >= 0):
            raise GraphError(f"task {i} {t.name!r}: names a finale ({'fin' if fin >= 0 else 'stout'}) without a "
                             "ticket: the kernel would draw it at control word -1, outside the control buffer")
        draws = (t.op == OP_ATTN_PARTIAL) + (fin >= 0 or stout >= 0)
        if t.ticket is not None and draws != 1:
            raise GraphError(f"task {i} {t.name!r}: draws its ticket {t.ticket!r} {draws} times (once: as an "
                             "attention partial, or for the finale its fin / stout names)")

    # Cache layouts (7. above) disjoint: spans in bytes, sorted by start, each against the next.
    caches = graph.caches
    spans = sorted((lay.buffer, *lay.byte_span(graph.batch), ns) for ns, lay in caches.items())
    for (b0, s0, e0, n0), (b1, s1, e1, n1) in zip(spans, spans[1:]):
        if b0 == b1 and s1 < e0:
            u = caches[n1].unit
            raise GraphError(f"caches {n0.removesuffix('@cols')!r} and {n1.removesuffix('@cols')!r} overlap at "
                             f"{b0}[{s1 // u}:{-(-min(e0, e1) // u)}]: the checker takes their namespaces "
                             "to be disjoint")

    # Ordering edges, and the cycle check over them (all waits, whatever their target).
    succ: dict[int, set[int]] = defaultdict(set)
    indeg = [0] * len(tasks)
    for i, t in enumerate(tasks):
        for c, _ in t.waits:
            for j in signalers[c]:
                if i not in succ[j]:
                    succ[j].add(i)
                    indeg[i] += 1
    queue = deque(i for i in range(len(tasks)) if indeg[i] == 0)
    seen = 0
    while queue:
        j = queue.popleft()
        seen += 1
        for i in succ[j]:
            indeg[i] -= 1
            if indeg[i] == 0:
                queue.append(i)
    if seen != len(tasks):
        stuck = [tasks[i].name for i in range(len(tasks)) if indeg[i] > 0][:6]
        raise GraphError(f"{graph.model}: dependency cycle; tasks on or behind it include {stuck}")

    for i, t in enumerate(tasks):
        for c, target in t.waits:
            total = len(signalers[c])
            earlier = sum(1 for j in signalers[c] if j < i)
            if target > total:
                raise GraphError(f"task {i} {t.name!r}: waits for {c!r} to reach {target} but only {total} "
                                 "tasks ever signal it: the wait can never be satisfied")
            if target > earlier:
                raise GraphError(f"task {i} {t.name!r}: waits for {c!r} to reach {target} but only {earlier} "
                                 f"of its signalers come earlier in the list: a later task must run first, "
                                 "which deadlocks the persistent kernel")

    # Happens-before as bitsets of ancestors and descendants. Ordering edges only go from lower to
    # higher list index (checked above), so one forward and one backward pass suffice.
    anc = [0] * len(tasks)
    ordered_succ: dict[int, list[int]] = defaultdict(list)
    for i, t in enumerate(tasks):
        a = 0
        for c, target in t.waits:
            if target >= len(signalers[c]):
                for j in signalers[c]:
                    a |= anc[j] | (1 << j)
                    ordered_succ[j].append(i)
        anc[i] = a
    desc = [0] * len(tasks)
    for j in range(len(tasks) - 1, -1, -1):
        dsc = 0
        for i in ordered_succ[j]:
            dsc |= desc[i] | (1 << i)
        desc[j] = dsc

    # Ticket finales as nodes n, n+1, ... after the tasks (see 5. above): tile tickets (kticket)
    # first, so a stage ticket's node can name the tile finales it follows.
    def accesses_of(t, kind):
        return (t.ksum_reads, t.ksum_writes) if kind == "kticket" else (t.last_reads, t.last_writes)

    groups: dict[tuple[str, str], list[int]] = defaultdict(list)
    for ticket in ("kticket", "ticket"):
        for i, t in enumerate(tasks):
            reads, writes = accesses_of(t, ticket)
            if getattr(t, ticket) is not None:
                if ticket == "kticket" and t.op not in KTICKET_OPS:
                    raise GraphError(f"task {i} {t.name!r}: only split-K slices run a tile's sum (kticket)")
                groups[(ticket, getattr(t, ticket))].append(i)
                if not reads and not writes:
                    raise GraphError(f"task {i} {t.name!r}: {ticket} {getattr(t, ticket)!r} without a finale's accesses")
            elif reads or writes:
                raise GraphError(f"task {i} {t.name!r}: finale accesses declared without a {ticket}")
    both = {name for kind, name in groups if kind == "kticket"} & {name for kind, name in groups if kind == "ticket"}
    if both:   # one control-buffer counter per name: the two groups would draw from one count
        raise GraphError(f"tickets {sorted(both)[:3]} name both a tile's sum and a stage's finale")
    row_owner: dict[int, str] = {}

    def finale_rows(name: str, m: int, fin: int, nfin: int) -> None:
        """Rows [fin, fin + nfin) are ticket `name`'s finale (member m declares it), as 6. above."""
        if not (0 <= fin and 0 < nfin <= len(graph.rows) - fin):
            raise GraphError(f"ticket {name!r}: task {m} {tasks[m].name!r} names finale rows [{fin}, {fin}+{nfin}) "
                             f"of the graph's {len(graph.rows)}")
        reads: list[Region] = []
        writes: list[Region] = []
        for k in range(fin, fin + nfin):
            row = graph.rows[k]
            if k in row_owner:
                raise GraphError(f"finale row {k} {row.name!r} is run by tickets {row_owner[k]!r} and {name!r}")
            row_owner[k] = name
            if row.op != OP_ROPE_APPEND:
                raise GraphError(f"finale row {k} {row.name!r} of ticket {name!r}: op {OP_NAMES.get(row.op, row.op)}, "
                                 "but the kernel runs finale rows as rope_append")
            r, w = _row_accesses(row, graph.batch, caches)
            t = tasks[m]
            for what, mine, declared in (("reads", r, t.last_reads + t.last_writes), ("writes", w, t.last_writes)):
                bad = _uncovered(mine, declared)
                if bad is not None:
                    raise GraphError(f"ticket {name!r}: its finale row {k} {row.name!r} {what} {bad.buffer}"
                                     f"[{bad.start}:{bad.end}], which the ticket's members do not declare "
                                     f"(task {m} {t.name!r}: fin {fin}, nfin {nfin})")
            reads += r
            writes += w
        bad = _uncovered(tasks[m].last_writes, writes)
        if bad is not None:
            raise GraphError(f"ticket {name!r}: its members declare the finale writes {bad.buffer}"
                             f"[{bad.start}:{bad.end}] but none of its finale rows [{fin}, {fin}+{nfin}) writes there")

    n = len(tasks)
    finale: list[tuple[str, list[int], tuple[list[Region], list[Region]]]] = []
    sum_of: dict[int, int] = {}   # task -> the node of its tile sum's finale (kticket groups come first)
    for (kind, name), members in groups.items():
        first = accesses_of(tasks[members[0]], kind)
        for j in members[1:]:
            if any(sorted(map(tuple_of, x)) != sorted(map(tuple_of, y))
                   for x, y in zip(accesses_of(tasks[j], kind), first)):
                raise GraphError(f"ticket {name!r}: tasks {tasks[members[0]].name!r} and {tasks[j].name!r} declare "
                                 "different finale accesses (any member may be the one that runs it)")
        if kind == "ticket":
            fa = [(k, tasks[members[0]].args.get(k, -1)) for k in FINALE_ARGS]
            for j in members[1:]:
                diff = [(k, v, tasks[j].args.get(k, -1)) for k, v in fa if tasks[j].args.get(k, -1) != v]
                if diff:
                    k, v, w = diff[0]
                    raise GraphError(f"ticket {name!r}: tasks {tasks[members[0]].name!r} and {tasks[j].name!r} run "
                                     f"different finales ({k} {v} and {w}; any member may be the one that runs it)")
            fin, nfin = dict(fa)["fin"], dict(fa)["nfin"]
            if fin >= 0:
                finale_rows(name, members[0], fin, nfin)
        a, d = 0, -1
        for j in members:
            a |= anc[j] | (1 << j)
            d &= desc[j]
        if kind == "kticket":
            sum_of.update((j, n + len(finale)) for j in members)
        else:
            inside = set(members)
            for v in {sum_of[j] for j in members if j in sum_of}:
                if all(m in inside for m in finale[v - n][1]):
                    a |= 1 << v
        anc.append(a)
        desc.append(d)
        finale.append((name, members, first))
    virtual = ((1 << len(finale)) - 1) << n

    def label(i: int) -> str:
        return f"task {i} {tasks[i].name!r}" if i < n else f"the finale of ticket {finale[i - n][0]!r}"

    def ordered(i: int, j: int) -> bool:
        """Happens-before either way between nodes i and j (tasks or finales)."""
        if i >= n and j >= n:   # a finale precedes another when a task after it precedes the other,
            # or when it is a tile's sum and the other a ticket all of the tile's slices draw after it
            return (bool(desc[i] & anc[j]) or bool(desc[j] & anc[i]) or bool(anc[j] >> i & 1)
                    or bool(anc[i] >> j & 1))
        if j >= n:
            i, j = j, i
        return bool((anc[i] | desc[i]) >> j & 1)

    accesses: dict[str, list[tuple[int, int, int, bool]]] = defaultdict(list)
    for i, t in enumerate(tasks):
        for r in t.reads:
            accesses[r.buffer].append((r.start, r.end, i, False))
        for r in t.writes:
            accesses[r.buffer].append((r.start, r.end, i, True))
    for v, (_, _, (reads, writes)) in enumerate(finale):
        for r in reads:
            accesses[r.buffer].append((r.start, r.end, n + v, False))
        for r in writes:
            accesses[r.buffer].append((r.start, r.end, n + v, True))
    # Caches apart from the state (7. above): no declared state access in a cache's span.
    for buf in accesses:
        if caches and buf.endswith("@cols") and buf not in caches:
            raise GraphError(f"{buf!r}: accessed, but no cache layout says where it lies in the state arena")
    for buf, units in {lay.buffer: lay.unit for lay in caches.values()}.items():
        mine = [(s0, e0, ns) for b0, s0, e0, ns in spans if b0 == buf]   # disjoint (above): ends sorted too
        ends = [e0 for _, e0, _ in mine]
        for a0, a1, ai, aw in accesses.get(buf, ()):
            at = bisect.bisect_right(ends, a0 * units)   # the first span ending past the access's start
            if at < len(mine) and mine[at][0] < a1 * units:
                s0, e0, ns = mine[at]
                raise GraphError(
                    f"{label(ai)} {'writes' if aw else 'reads'} {buf}[{a0}:{a1}], inside the memory of cache "
                    f"{ns.removesuffix('@cols')!r} ({buf}[{s0 // units}:{-(-e0 // units)}]): the tasks that "
                    f"address it there declare it as {ns!r}, so the two would race unchecked")

    for buf, acc in accesses.items():
        acc.sort()
        # Sweep by start offset over the accesses still open there (heaps by end), with the open
        # tasks also kept as bitsets: an access races with any open task (any open writer, for a
        # read) that is neither its ancestor nor its descendant, so each access costs a few big-int
        # operations however many thousands of tile tasks read the same rows.
        heaps: tuple[list, list] = ([], [])
        counts: tuple[dict[int, int], dict[int, int]] = ({}, {})
        masks = [0, 0]
        for a0, a1, ai, aw in acc:
            for side in (0, 1):
                heap, cnt = heaps[side], counts[side]
                while heap and heap[0][0] <= a0:
                    _, _, bi = heapq.heappop(heap)
                    cnt[bi] -= 1
                    if cnt[bi] == 0:
                        masks[side] &= ~(1 << bi)
            candidates = (masks[1] | (masks[0] if aw else 0)) & ~(1 << ai)
            bad = candidates & ~(anc[ai] | desc[ai])
            # A finale's bit is in no task's anc/desc: test those pairs one by one (few overlap).
            vb = bad & virtual
            while vb:
                b = (vb & -vb).bit_length() - 1
                vb &= vb - 1
                if ordered(ai, b):
                    bad &= ~(1 << b)
            if bad:
                bi = (bad & -bad).bit_length() - 1
                b0, b1 = next((s0, e) for side in (1, 0) for e, s0, k in heaps[side] if k == bi)
                i, j = min(ai, bi), max(ai, bi)
                raise GraphError(
                    f"race on {buf}[{max(a0, b0)}:{min(a1, b1)}]: {label(i)} and {label(j)} "
                    f"access it (one writes) but no chain of waits orders them")
            side = 1 if aw else 0
            heapq.heappush(heaps[side], (a1, a0, ai))
            counts[side][ai] = counts[side].get(ai, 0) + 1
            masks[side] |= 1 << ai
