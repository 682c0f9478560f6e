"""One launched step's error profile against the float64 reference (the rule: checks.judge_profile).

Every value the megakernel keeps in its state arena (all but those fused into their readers) is
compared with the float64 reference, and so is the fp32 reference's; so are the K/V entries each
row appended and the recurrent states. Entries are grouped by the layer whose node made them
(the L<i>. prefix of the node's value; "in" before the first layer, "out" after the last).
"""
from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from photon_core.gpu_proof.build import appended_refs, cache_of, slot
from photon_core.gpu_proof.checks import Profile, rel_err
from photon_core.gpu_proof.float64 import reference64

_LAYER = re.compile(r"^(L\d+)\.")


def layers_of(graph: Any) -> dict[int, str]:
    """id(node) -> its layer: the L<i> its value (or the first value it reads) is named after;
    "in" before the first such node, "out" after."""
    from photon_core.megakernel.stepgraph import Value
    out: dict[int, str] = {}
    seen = False
    for node in graph.nodes:
        names = ([node.value.name] if node.out is not None else []) + [
            v.name for v in node.args.values() if isinstance(v, Value)]
        m = next((m for m in map(_LAYER.match, names) if m), None)
        seen = seen or m is not None
        out[id(node)] = m.group(1) if m else ("out" if seen else "in")
    return out


def step_profile(step: Any, want32: Mapping[str, Any], want64: Mapping[str, Any], caches32: Mapping[str, Any],
                 caches64: Mapping[str, Any], positions: list[int]) -> Profile:
    """The profile of the step just launched: `want32` / `want64` the fp32 / float64 references'
    values, `caches32` / `caches64` their caches after the step (each appended its own K/V)."""
    import torch

    from photon_core.megakernel.stepgraph import StateSpec
    g = step.graph_def
    layer = layers_of(g)
    order: list[str] = []
    mk: dict[str, float] = {}
    ref: dict[str, float] = {}

    def add(where: str, got: Any, r32: Any, r64: Any) -> None:
        if where not in mk:
            order.append(where)
            mk[where] = ref[where] = 0.0
        mk[where] = max(mk[where], rel_err(got, r64))
        ref[where] = max(ref[where], rel_err(r32, r64))

    rows = torch.arange(step.batch, device=step.state.device)
    at = torch.tensor(positions, device=step.state.device)
    for node in g.nodes:
        where = layer[id(node)]
        if node.out is not None and node.value.name in step.shapes and node.value.name in want64:
            name = node.value.name
            add(where, step.view(name), want32[name], want64[name])
        if node.op == "kv_append" and node.args["append"]:
            for ref_ in (node.args["k"], node.args["v"]):
                s = slot(ref_, at)

                def entry(tensors: Any, r: Any = ref_, s: Any = s) -> Any:
                    return cache_of(tensors, r)[rows, :, s]
                add(where, entry(step.view), entry(caches32.__getitem__), entry(caches64.__getitem__))
        for spec in node.args.values():
            if isinstance(spec, StateSpec):
                add(where, step.view(spec.name), caches32[spec.name], caches64[spec.name])
    return Profile(order, [mk[k] for k in order], [ref[k] for k in order])


def profile_launch(step: Any, weights: Mapping[str, Any], caches64: Mapping[str, Any], want32: Mapping[str, Any],
                   caches32: Mapping[str, Any], tokens: list[int], positions: list[int],
                   cross_len: list[int] | None, inputs: Mapping[str, Any] | None) -> Profile:
    """Run the float64 reference of the step just launched (`caches64`: float64 copies of the
    history taken before the fp32 reference ran; updated in place) and profile the launch."""
    want64 = reference64(step.graph_def, weights, caches64, tokens, positions, cross_len, inputs)
    return step_profile(step, want32, want64, caches32, caches64, positions)


def float64_steps(full_at: list[int]) -> set[int]:
    """The steps run in float64: the first and the last that runs the whole graph (`full_at`: the
    steps whose kernel computes every value; a pruned one leaves the others stale)."""
    return {full_at[0], full_at[-1]} if full_at else set()
