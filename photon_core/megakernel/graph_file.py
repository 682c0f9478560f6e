"""A built task graph (graph.TaskGraph) and its encoded table as one safetensors file: the build
cache's entry (build_cache.py). Reading one runs no code: safetensors holds raw int64 arrays and a
JSON header (no pickle), and everything read is checked against a digest written with it.

The graph is stored whole (every task's accesses too, not only the table the kernel reads), so a
graph read back equals the one lower() built, field for field: what a step offers as `step.graph`
(error messages name its tasks, tools copy and edit it, checker.check can prove it again) is the
same on a cache hit as after a build.

Layout (int64 tensors): "table" [rows, NUM_FIELDS] as TaskGraph.encode gave it; per task then
finale row, "ints" [op, signal, ticket, kticket, #args, #waits, #regions of each access list];
"args" [(field index in graph.FIELDS, value)]; "waits" [(counter index, target)]; "region_ids"
(into "regions" [(buffer, start, end)], each distinct region once). The header's "graph" entry (JSON)
holds the strings: model, batch, counter and ticket names in index order, buffers, task names.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from photon_core.megakernel.graph import FIELDS, Region, Task, TaskGraph

FORMAT = "1"
ACCESSES = ("reads", "writes", "last_reads", "last_writes", "ksum_reads", "ksum_writes")
_INTS = 6   # op, signal, ticket, kticket, its arguments' keyset, #waits (then one count per access list)


class EntryError(ValueError):
    """A file that is not a well-formed entry (truncated, edited, another format)."""


def write(path: Path, graph: TaskGraph, table: torch.Tensor, header: dict[str, str]) -> None:
    """Write `graph` and `table` to `path` (the caller makes it atomic), with `header` entries."""
    from safetensors.torch import save_file
    tensors, strings = _pack(graph, table)
    meta = dict(header, format=FORMAT, graph=json.dumps(strings))
    meta["digest"] = _digest(tensors, meta)
    save_file(tensors, str(path), metadata=meta)


def read(path: Path) -> tuple[TaskGraph, torch.Tensor, dict[str, str]]:
    """The graph, table and header of the entry at `path`; EntryError if it is not a whole, intact
    entry of this format (OSError if it cannot be read)."""
    from safetensors import SafetensorError, safe_open
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = dict(f.metadata() or {})
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except SafetensorError as e:
        raise EntryError(f"not a safetensors file: {e}") from e
    if meta.get("format") != FORMAT:
        raise EntryError(f"format {meta.get('format')!r}, not {FORMAT!r}")
    digest = meta.pop("digest", None)
    if digest != _digest(tensors, meta):
        raise EntryError("its contents do not match their digest")
    try:
        graph = _unpack(tensors, json.loads(meta.pop("graph")))
    except (KeyError, IndexError, TypeError, ValueError) as e:
        raise EntryError(f"malformed graph: {e!r}") from e
    table = tensors["table"]
    if table.dtype != torch.int64 or tuple(table.shape) != (len(graph.tasks) + len(graph.rows), table.shape[1]):
        raise EntryError(f"a table of {tuple(table.shape)} {table.dtype} for {len(graph.tasks) + len(graph.rows)} rows")
    return graph, table, meta


def _digest(tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> str:
    # A flipped bit in the table would launch a task graph nobody proved: every byte is covered.
    h = hashlib.sha256(json.dumps(meta, sort_keys=True).encode())
    for k in sorted(tensors):
        t = tensors[k]
        h.update(f"{k}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.contiguous().view(torch.uint8).numpy().data)
    return h.hexdigest()


def _indices(names: dict[str, int], what: str) -> list[str]:
    order = list(names)
    if [names[n] for n in order] != list(range(len(order))):
        raise ValueError(f"{what} indices are not their insertion order")
    return order


def _pack(g: TaskGraph, table: torch.Tensor) -> tuple[dict[str, torch.Tensor], dict]:
    counters, tickets = _indices(g.counters, "counter"), _indices(g.tickets, "ticket")
    keysets: dict[tuple[str, ...], int] = {}   # tasks of one op name the same arguments: stored once
    regions: dict[Region, int] = {}
    buffers: dict[str, int] = {}
    ints: list[list[int]] = []
    vals: list[int] = []
    waits: list[tuple[int, int]] = []
    rids: list[int] = []
    for t in g.tasks + g.rows:
        for k, v in t.args.items():
            if k not in FIELDS or type(v) is not int:   # noqa: E721  (a float would not come back as it went)
                raise ValueError(f"task {t.name}: argument {k} = {v!r} is not an int field")
        ints.append([t.op, -1 if t.signal is None else g.counters[t.signal],
                     -1 if t.ticket is None else g.tickets[t.ticket], -1 if t.kticket is None else g.tickets[t.kticket],
                     keysets.setdefault(tuple(t.args), len(keysets)), len(t.waits)]
                    + [len(getattr(t, a)) for a in ACCESSES])
        vals += t.args.values()
        waits += [(g.counters[c], target) for c, target in t.waits]
        for a in ACCESSES:
            for r in getattr(t, a):
                rids.append(regions.setdefault(r, len(regions)))
                buffers.setdefault(r.buffer, len(buffers))

    def i64(rows: list, width: int | None = None) -> torch.Tensor:
        t = torch.tensor(rows, dtype=torch.int64)
        return t if width is None else t.reshape(-1, width)
    tensors = {"table": table.detach().to("cpu", torch.int64).contiguous(), "ints": i64(ints, _INTS + len(ACCESSES)),
               "args": i64(vals), "waits": i64(waits, 2), "region_ids": i64(rids),
               "region_buffers": i64([buffers[r.buffer] for r in regions]),
               "region_starts": i64([r.start for r in regions]), "region_ends": i64([r.end for r in regions])}
    strings = dict(model=g.model, batch=g.batch, tasks=len(g.tasks), counters=counters, tickets=tickets,
                   buffers=list(buffers), keysets=list(keysets), names=[t.name for t in g.tasks + g.rows])
    return tensors, strings


def _unpack(tensors: dict[str, torch.Tensor], s: dict) -> TaskGraph:
    def ints(k: str) -> list:
        return tensors[k].numpy().tolist()   # numpy's tolist: a few times faster than torch's
    counters, tickets, keysets, names = s["counters"], s["tickets"], s["keysets"], s["names"]
    buffers = s["buffers"]
    regions = list(map(Region, [buffers[b] for b in ints("region_buffers")], ints("region_starts"),
                       ints("region_ends")))
    rids, vals, waits, rows = ints("region_ids"), ints("args"), ints("waits"), ints("ints")
    if len(rows) != len(names) or not 0 <= s["tasks"] <= len(names):
        raise ValueError(f"{len(rows)} task rows for {len(names)} names")
    out: list[Task] = []
    ai = wi = ri = 0
    for name, (op, sig, ticket, kticket, keyset, nw, *nr) in zip(names, rows):
        accesses = {}
        for a, n in zip(ACCESSES, nr):
            accesses[a] = [regions[i] for i in rids[ri:ri + n]]
            ri += n
        keys = keysets[keyset]
        out.append(Task(name, op, dict(zip(keys, vals[ai:ai + len(keys)])),
                        [(counters[c], target) for c, target in waits[wi:wi + nw]],
                        None if sig < 0 else counters[sig], ticket=None if ticket < 0 else tickets[ticket],
                        kticket=None if kticket < 0 else tickets[kticket], **accesses))
        ai, wi = ai + len(keys), wi + nw
    if (ai, wi, ri) != (len(vals), len(waits), len(rids)):
        raise ValueError("counts do not add up to the stored arrays")
    return TaskGraph(model=s["model"], batch=s["batch"], tasks=out[:s["tasks"]],
                     counters={c: i for i, c in enumerate(counters)}, tickets={t: i for i, t in enumerate(tickets)},
                     rows=out[s["tasks"]:])
