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
"""
from __future__ import annotations

import heapq
from collections import defaultdict, deque

from photon_core.megakernel.graph import Region, TaskGraph
from photon_core.megakernel.ops import KTICKET_OPS, OP_NAMES


class GraphError(ValueError):
    pass


def tuple_of(r: Region) -> tuple[str, int, int]:
    return (r.buffer, r.start, r.end)


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
