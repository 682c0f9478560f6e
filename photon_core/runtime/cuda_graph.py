"""Capturing a step function in a CUDA graph.

A decode step is dozens of small kernel launches; on a GPU at batch 1-8 their launch overhead is
comparable to the work itself. Captured once and replayed, the step costs one graph launch. The
function must be capture-safe: fixed shapes, no host synchronization, every per-step input read
from a device buffer that is updated in place before each replay.
"""
from __future__ import annotations

from typing import Any, Callable

import torch


def capture(fn: Callable[[], Any], warmup: int = 3, pool: Any = None,
            errors: str = "thread_local") -> tuple[torch.cuda.CUDAGraph, Any]:
    """(graph, output of the captured call): replaying the graph reruns fn, writing its outputs
    into that same output's memory. Warm-up runs go on a side stream first (lazy initialization,
    Triton's first-launch compilation and autotuning must not happen during capture). pool: a
    memory pool shared with other graphs (torch.cuda.graph_pool_handle()), or None for its own.
    errors: torch.cuda.graph's capture_error_mode. "thread_local" (torch's default is "global"):
    only this thread's calls that a capture forbids fail, not the work other threads of the
    process do meanwhile (another model's engine, a camera thread making crops on the GPU, which
    under "global" would fail on their first memory copy)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, capture_error_mode=errors):
        out = fn()
    return graph, out
