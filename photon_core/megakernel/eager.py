"""The eager reference of a step graph: the same graph run op by op with backends.reference (each
op's reference is in its module under ops/), what every compiled step is checked against."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from photon_core.megakernel.ops import Eager, rule
from photon_core.megakernel.stepgraph import StepGraph


def run_reference(graph: StepGraph, weights: Mapping[str, torch.Tensor], caches: Mapping[str, torch.Tensor],
                  tokens: list[int], positions: list[int], cross_len: list[int] | None = None,
                  inputs: Mapping[str, torch.Tensor] | None = None,
                  rotary_offsets: list[int] | None = None) -> dict[str, Any]:
    """One step for B = len(positions) rows. `caches` maps cache and state names to tensors in the
    layout the graph declares ([B, H, T, Dh], or [L, B, H, T, Dh]; states [B, *shape]); the step
    updates them in place. Rotary
    tables are read at position + rotary offset (default 0). Returns every value ([B, width]) by
    name, and the argmax results under "results" ({name: [B] ints})."""
    bsz = len(positions)
    dev = next(iter(weights.values())).device
    pos = torch.tensor(positions, device=dev)
    rot_pos = pos + torch.tensor(rotary_offsets or [0] * bsz, device=dev)
    e = Eager(bsz, dev, pos, rot_pos, tokens, cross_len, weights, caches, inputs)
    for node in graph.nodes:
        y = rule(node.op).reference(e, node)
        if node.out is not None:
            if y is None:
                raise ValueError(f"{graph.name}: the reference of {node.op} {node.value.name!r} gave no value")
            e.vals[node.value.name] = y
    return {**e.vals, "results": e.results}


__all__ = ["run_reference"]
