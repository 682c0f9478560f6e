"""Device bytes of a compiled step, from its graph alone: the arenas plan() lays out (weights by
dtype, KV caches, recurrent states, values and partials), the task table and the small buffers,
computed without allocating anything (plan and lower only lay out and list; weights are shapes).
"""
from __future__ import annotations

from collections.abc import Iterable

import torch

from photon_core.megakernel.compiler import Tiling, lookup_tables, lower, plan
from photon_core.megakernel.graph import CTRL_COUNTERS, DYN_SECTIONS, NUM_FIELDS
from photon_core.megakernel.stepgraph import StepGraph

_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.uint8: "fp8"}


def step_memory(graph: StepGraph, batch: int, tiling: Tiling = Tiling(), weight_dtype: torch.dtype = torch.bfloat16,
                kv_dtype: torch.dtype = torch.bfloat16, tasks: bool = True,
                external: Iterable[str] | None = None) -> dict[str, int]:
    """Bytes a CompiledStep(graph, ..., batch, tiling, weight_dtype, kv_dtype) holds on the device,
    by part: "weights <dtype>" (FP8 experts as "weights fp8", their scales "weights fp32"; rows
    padded as the arena pads them), "kv caches", "states", "values" (activations, partials,
    scratch), "task table" (the encoded tasks, if `tasks`: lowering a real-size graph takes
    seconds) and "control" (dyn, results, counters, tickets). The weights arena is shared by every batch
    bucket of a model; the rest is per bucket. Tables in `external` (default: every token table
    only embeds read) are not counted: the step reads the caller's tensor in place
    (CompiledStep(read_in_place=...))."""
    p = plan(graph, batch, tiling, weight_dtype, kv_dtype, lookup_tables(graph) if external is None else external)
    W, S = p.warena, p.sarena
    out: dict[str, int] = {}
    used = 0
    for k in W.regions:
        dt = W.dtypes.get(k, weight_dtype)
        part = f"weights {_NAMES[dt]}"
        out[part] = out.get(part, 0) + W.regions[k][1] * W.unit
        used += W.regions[k][1]
    out["weights alignment"] = (W.size - used) * W.unit
    caches = sum(S.regions[c][1] for c in graph.caches) * S.unit
    states = sum(S.regions[s][1] for s in graph.states) * S.unit
    out["kv caches"] = caches
    out["states"] = states
    out["values"] = S.size * S.unit - caches - states
    counters = 0
    if tasks:
        g = lower(p)
        out["task table"] = (len(g.tasks) + len(g.rows)) * NUM_FIELDS * 8
        counters = g.ctrl_size() - CTRL_COUNTERS   # dependency counters and tickets
    out["control"] = 4 * (DYN_SECTIONS * batch + batch * max(1, len(graph.results)) + CTRL_COUNTERS + counters)
    return out


def format_bytes(parts: dict[str, int]) -> str:
    """One line per part and the total, in MiB and GiB."""
    rows = [f"  {k:<40} {v / 2**20:10.1f} MiB" for k, v in parts.items()]
    total = sum(parts.values())
    return "\n".join(rows + [f"  {'total':<40} {total / 2**20:10.1f} MiB = {total / 2**30:.2f} GiB"])
