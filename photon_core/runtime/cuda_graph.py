"""Capturing a step function in a CUDA graph.

A decode step is dozens of small kernel launches; on a GPU at batch 1-8 their launch overhead is
comparable to the work itself. Captured once and replayed, the step costs one graph launch. The
function must be capture-safe: fixed shapes, no host synchronization, every per-step input read
from a device buffer that is updated in place before each replay.

A capture that fails must leave the process able to capture again. torch.cuda.graph's context
manager does not: when the capture was invalidated (a host synchronisation inside it, a launch
the capture refuses), its exit raises from capture_end before it restores the caller's stream,
and the caching allocator is left routing that stream's allocations to the graph's pool, after
which every empty_cache (and with it every later torch.cuda.graph) fails an internal assert. So
capture() drives the capture itself and, on any failure, ends it, gives the allocator its state
back (as far as torch lets a caller) and re-raises. Captures are serialised process-wide (two
threads capturing at once, a node's decode rounds and an encoder's graph, would share the one
capture stream).
"""
from __future__ import annotations

import threading
from typing import Any, Callable

import torch

_CAPTURING = threading.Lock()
_STREAMS: dict[int, torch.cuda.Stream] = {}
# Failed captures' graph objects, kept: the allocators may still hold their routing to a pool
# (pinned host memory's cannot be ended from Python), and its filter points at the graph
_FAILED: list[torch.cuda.CUDAGraph] = []


def capture(fn: Callable[[], Any], warmup: int = 3, pool: Any = None,
            errors: str = "thread_local") -> tuple[torch.cuda.CUDAGraph, Any]:
    """(graph, output of the captured call): replaying the graph reruns fn, writing its outputs
    into that same output's memory. Warm-up runs go on a side stream first (lazy initialization,
    Triton's first-launch compilation and autotuning must not happen during capture). pool: a
    memory pool shared with other graphs (torch.cuda.graph_pool_handle()), or None for its own.
    errors: the capture_error_mode. "thread_local" (torch's default is "global"): only this
    thread's calls that a capture forbids fail, not the work other threads of the process do
    meanwhile (another model's engine, a camera thread making crops on the GPU, which under
    "global" would fail on their first memory copy). A failed capture raises with the process
    left as it was (the module docstring says why that takes care)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    pool = pool if pool is not None else torch.cuda.graph_pool_handle()
    device = torch.cuda.current_device()
    with _CAPTURING:
        # as torch.cuda.graph: the cached blocks freed (a capture cannot release any), and one
        # capture stream a device (the allocator reuses a pool's blocks on the stream they were
        # made on: graphs sharing a pool share their temporaries only on one stream)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        if device not in _STREAMS:
            _STREAMS[device] = torch.cuda.Stream()
        stream = _STREAMS[device]
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            try:
                graph.capture_begin(pool=pool, capture_error_mode=errors)
            except BaseException:
                _abandon(graph, device, pool, end=False)
                raise
            try:
                out = fn()
            except BaseException:
                _abandon(graph, device, pool, end=True)
                raise
            try:
                graph.capture_end()
            except BaseException:
                _abandon(graph, device, pool, end=False)
                raise
        torch.cuda.current_stream().wait_stream(stream)
    return graph, out


def _abandon(graph: torch.cuda.CUDAGraph, device: int, pool: Any, end: bool) -> None:
    """A failed capture's clean-up: the stream out of capture mode (`end`: capture_end, which on an
    invalidated capture ends it and raises), then the allocator's routing of this capture to the
    pool ended where capture_end did not get that far. The pool's hold for this graph is kept (a
    little memory): giving it back by hand could release it twice where the graph object does too."""
    _FAILED.append(graph)
    if end:
        try:
            graph.capture_end()
            return   # a valid capture of a call that failed: capture_end ended the routing too
        except Exception:  # noqa: BLE001  the capture's own failure, already being raised
            pass
    try:   # "not currently recording" where capture_end did it before failing: fine
        torch._C._cuda_endAllocateToPool(device, pool)
    except Exception:  # noqa: BLE001
        pass
