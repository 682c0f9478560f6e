"""Helpers shared by the GPU scripts (bench/gpu_bench.py, bench/gpu_proof.py): timing with CUDA
events and CUDA-graph capture. Both fall back to plain calls on the CPU, so each script's
`--dry-run` runs the same code paths under TRITON_INTERPRET=1."""
from __future__ import annotations

import statistics
import time
from typing import Callable


def timer(fn: Callable[[], object], iters: int, warmup: int, cuda: bool) -> float:
    """Median seconds per call: CUDA events around each call on a GPU (the host clock on CPU)."""
    import torch
    for _ in range(warmup):
        fn()
    times = []
    if cuda:
        torch.cuda.synchronize()
        for _ in range(iters):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
    else:
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def graphed(fn: Callable[[], object], cuda: bool) -> Callable[[], object]:
    """fn captured in a CUDA graph (photon_core.runtime.cuda_graph), or fn itself on CPU. Capture
    runs fn a few times first (warm-up on a side stream): callers whose fn changes state save and
    restore it around this call."""
    if not cuda:
        return fn
    from photon_core.runtime.cuda_graph import capture
    return capture(fn)[0].replay
