"""Where a decode step's time goes: the analysis of one traced launch (Megakernel.traced_launch).

The trace has a row per task: the program and SM that ran it and four instants, claimed (its index
drawn from the claim counter), waited (its dependencies satisfied), ran (its body and any finale
done) and released (its signal sent). From those and the task graph this module derives:

* levels: a task's level is 1 + the highest level of the tasks it waits on (0: waits on nothing).
  A level's span runs from its first claim to its last release; the step is at least the sum of
  the spans of its critical levels, so a level much longer than its tasks' bytes warrant is where
  to look.
* programs: per program, time running task bodies, waiting on dependencies, and between a release
  and its next claim (the claim itself, the header's loads), and idle after its last task.
* signal-to-observe: for each wait that really waited (its target was reached after the claim),
  the time from the release that reached the target to the waiter seeing it.
* linear K steps: a linear task's body time over its K steps (the kernel's step, linear_k_step):
  the time one weight tile costs, the figure the K loop's design sets.

Times are the trace's units: nanoseconds on a GPU (%globaltimer), ticks of a logical clock under the
interpreter (which orders events but says nothing of their length)."""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from photon_core.megakernel.graph import TRACE_COLUMNS as COLUMNS
from photon_core.megakernel.graph import TaskGraph
from photon_core.megakernel.ops import OP_LINEAR, OP_LINEAR_SPLIT, OP_NAMES


def signalers(graph: TaskGraph) -> dict[str, list[int]]:
    """Counter -> the tasks that signal it."""
    out: dict[str, list[int]] = {}
    for i, t in enumerate(graph.tasks):
        if t.signal is not None:
            out.setdefault(t.signal, []).append(i)
    return out


def levels(graph: TaskGraph) -> list[int]:
    """Each task's dependency level (tasks are in a topological order: producers come first)."""
    by = signalers(graph)
    out: list[int] = []
    for t in graph.tasks:
        deps = [out[j] for c, _ in t.waits for j in by.get(c, [])]
        out.append(1 + max(deps) if deps else 0)
    return out


def _pct(values: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(values, dtype=np.float64), q)) if len(values) else float("nan")


def analyse(graph: TaskGraph, trace: Any, k_step: int) -> dict[str, Any]:
    """The summary of one traced launch of `graph` (trace: [tasks, len(COLUMNS)] ints, the kernel's
    rows); k_step: the K step of its linear tasks (kernel.linear_k_step for the launch's meta)."""
    tr = np.asarray(trace, dtype=np.int64)
    if tr.shape[0] != len(graph.tasks) or tr.shape[1] < len(COLUMNS):
        raise ValueError(f"trace {tr.shape} does not match {len(graph.tasks)} tasks x {len(COLUMNS)} columns")
    col = {name: tr[:, i] for i, name in enumerate(COLUMNS)}
    if (col["released"] == 0).any():
        missing = int((col["released"] == 0).sum())
        raise ValueError(f"{missing} tasks have no trace row: the launch did not run them all (or was not traced)")
    t0 = int(col["claimed"].min())
    total = int(col["released"].max()) - t0
    lv = levels(graph)

    by_level: dict[int, list[int]] = {}
    for i, level in enumerate(lv):
        by_level.setdefault(level, []).append(i)
    level_rows = []
    for level in sorted(by_level):
        ids = by_level[level]
        body = col["ran"][ids] - col["waited"][ids]
        slowest = ids[int(np.argmax(body))]
        level_rows.append(dict(level=level, tasks=len(ids),
                               ops=sorted({OP_NAMES.get(graph.tasks[i].op, str(graph.tasks[i].op)) for i in ids}),
                               start=int(col["claimed"][ids].min()) - t0, end=int(col["released"][ids].max()) - t0,
                               span=int(col["released"][ids].max() - col["claimed"][ids].min()),
                               body_median=float(np.median(body)), body_max=int(body.max()),
                               slowest=graph.tasks[slowest].name))

    programs = []
    for p in np.unique(col["program"]):
        mine = np.nonzero(col["program"] == p)[0]
        order = mine[np.argsort(col["claimed"][mine])]
        run = int((col["ran"][order] - col["waited"][order]).sum())
        wait = int((col["waited"][order] - col["claimed"][order]).sum())
        gaps = int((col["claimed"][order[1:]] - col["released"][order[:-1]]).clip(min=0).sum())
        programs.append(dict(program=int(p), sm=int(col["sm"][order[0]]), tasks=len(order), run=run, wait=wait,
                             between=gaps + int((col["released"][order] - col["ran"][order]).sum()),
                             idle_end=int(col["released"].max() - col["released"][order[-1]]),
                             idle_start=int(col["claimed"][order[0]]) - t0))

    by = signalers(graph)
    observe = []
    for i, t in enumerate(graph.tasks):
        for counter, target in t.waits:
            rel = np.sort(col["released"][by.get(counter, [])])
            if target < 1 or len(rel) < target:
                continue
            reached = int(rel[target - 1])
            if reached > col["claimed"][i]:      # it really waited: the last signal came after the claim
                observe.append(int(col["waited"][i]) - reached)

    per_step = []
    for i, t in enumerate(graph.tasks):
        if t.op in (OP_LINEAR, OP_LINEAR_SPLIT) and "k0" in t.args:
            steps = math.ceil((t.args["k1"] - t.args["k0"]) / k_step)
            if steps > 0:
                per_step.append((col["ran"][i] - col["waited"][i]) / steps)

    run_all = sum(p["run"] for p in programs)
    span_all = total * len(programs)
    return dict(
        tasks=len(graph.tasks), programs=len(programs), total=total, levels=len(level_rows),
        level_rows=level_rows,
        program_rows=programs,
        share=dict(run=run_all / span_all if span_all else float("nan"),
                   wait=sum(p["wait"] for p in programs) / span_all if span_all else float("nan"),
                   between=sum(p["between"] for p in programs) / span_all if span_all else float("nan"),
                   idle=sum(p["idle_end"] + p["idle_start"] for p in programs) / span_all if span_all else float("nan")),
        observe=dict(count=len(observe), median=_pct(observe, 50), p90=_pct(observe, 90), max=max(observe, default=0)),
        linear_step=dict(count=len(per_step), median=_pct(per_step, 50), p10=_pct(per_step, 10),
                         p90=_pct(per_step, 90), k_step=k_step),
        failed=int((col["status"] != 0).sum()))


def report(name: str, a: dict[str, Any], unit: str = "ns", top: int = 12) -> str:
    """A readable summary: totals, the shares of program time, the longest levels."""
    lines = [f"{name}: {a['tasks']} tasks on {a['programs']} programs, {a['levels']} levels, "
             f"{a['total']} {unit} claim to last release"]
    s = a["share"]
    lines.append(f"  program time: run {s['run']:.0%}, wait {s['wait']:.0%}, claim/release {s['between']:.0%}, "
                 f"idle {s['idle']:.0%}")
    o, k = a["observe"], a["linear_step"]
    lines.append(f"  signal -> observed: median {o['median']:.0f} {unit}, p90 {o['p90']:.0f}, max {o['max']} "
                 f"({o['count']} waits that waited)")
    lines.append(f"  linear K step ({k['k_step']} wide): median {k['median']:.0f} {unit}, p10 {k['p10']:.0f}, "
                 f"p90 {k['p90']:.0f} ({k['count']} tasks)")
    lines.append(f"  longest levels (of {a['levels']}):")
    for r in sorted(a["level_rows"], key=lambda r: -r["span"])[:top]:
        lines.append(f"    level {r['level']:3d} {'/'.join(r['ops']):22s} {r['tasks']:5d} tasks  span {r['span']:8d} "
                     f"body median {r['body_median']:8.0f} max {r['body_max']:8d}  slowest {r['slowest']}")
    return "\n".join(lines)


__all__ = ["COLUMNS", "signalers", "levels", "analyse", "report"]
