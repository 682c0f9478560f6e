"""Compile the proof's kernels in parallel, in worker processes, before the checks launch them.

Building a decode step is host work in one process (lowering and checking a graph, tens of
seconds at Moondream 2's batch 8), and Triton compiles a megakernel variant in 12-30 s of one core;
a proof launches about a dozen variants (batch, weight dtype, pruned graphs), and compiled one after
another on first launch they would take minutes. Triton's own async compile (3.6+) runs in threads
of one process, where the frontend holds the GIL; so each variant is compiled instead by
`JITFunction.warmup` in a process of a spawn pool (16 cores on the GPU host), while the main process
goes on building. Triton's on-disk cache hands the result over: the cache key depends only on the
kernel's source, its argument types and specialisations, constexprs, options, target and
environment, all of which warmup computes from the very arguments Megakernel.launch passes
(recorded, not restated: `launch_args`). Checked without a GPU under Triton 3.6 and 3.9, with a
stand-in driver reporting sm_90: a worker's warmup from the description and a warmup with the real
arguments land on the same cache entry (the second took 2 s and compiled nothing). A variant whose
key should still differ is compiled again at its first launch: slower, never wrong.
"""
from __future__ import annotations

import multiprocessing
import os
import time
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures import wait as wait_futures
from typing import Any, Callable


class _Recorder:
    """Stands in for the jitted kernel: `kernel[grid](*args, **kwargs)` records the call."""

    def __init__(self) -> None:
        self.call: tuple[tuple, dict] | None = None

    def __getitem__(self, grid: Any) -> Callable[..., None]:
        def record(*args: Any, **kwargs: Any) -> None:
            self.call = (args, kwargs)
        return record


def launch_args(kernel: Any) -> tuple[tuple, dict]:
    """The arguments a Megakernel's launch() passes to the jitted kernel, recorded by running
    launch() against a recorder (so they cannot drift from launch's own). launch() also zeroes the
    kernel's control buffer, which every launch does first anyway."""
    from photon_core.megakernel import kernel as mk
    rec, real = _Recorder(), mk._megakernel
    mk._megakernel = rec
    try:
        kernel.launch()
    finally:
        mk._megakernel = real
    if rec.call is None:
        raise RuntimeError("Megakernel.launch did not call the jitted kernel")
    return rec.call


def warmup_spec(kernel: Any, weight_dtype: Any) -> tuple:
    """A picklable description of one launch of `kernel` with its weights in `weight_dtype`:
    tensors by dtype (Triton specialises a pointer on its dtype and 16-byte alignment, and every
    buffer a Megakernel passes is a whole, aligned allocation), numbers as they are, the task table
    (a jitted function) by its name in the kernel module."""
    import torch

    from photon_core.megakernel import kernel as mk
    names = {id(v): k for k, v in vars(mk).items()}
    args, kwargs = launch_args(kernel)
    if "XLOOP" in kwargs:   # the expert step depends on the arena's dtype (kernel.expert_loop)
        kwargs = dict(kwargs, XLOOP=kernel.expert_loop(torch.empty(0, dtype=weight_dtype).element_size()))

    def enc(v: Any) -> tuple:
        if isinstance(v, torch.Tensor):
            dt = weight_dtype if v is kernel.weights else v.dtype
            return ("tensor", str(dt).removeprefix("torch."))
        if id(v) in names and callable(v):
            return ("jit", names[id(v)])
        return ("value", v)
    return tuple(enc(a) for a in args), tuple(sorted((k, enc(v)) for k, v in kwargs.items()))


def compile_megakernel(spec: tuple) -> float:
    """(In a worker.) Compile the variant `spec` describes into Triton's cache; seconds taken."""
    import torch

    from photon_core.megakernel import kernel as mk

    def dec(kind: str, v: Any) -> Any:
        return getattr(torch, v) if kind == "tensor" else getattr(mk, v) if kind == "jit" else v
    args = [dec(*a) for a in spec[0]]
    kwargs = {k: dec(*v) for k, v in spec[1]}
    t = time.perf_counter()
    mk._megakernel.warmup(*args, grid=(1,), **kwargs)
    return time.perf_counter() - t


class Prewarm:
    """A pool of compile processes, and what was submitted to it (label, submit time, future)."""

    def __init__(self, workers: int | None = None) -> None:
        n = workers or max(1, min(14, (os.cpu_count() or 2) - 2))
        # spawn: a CUDA context does not survive fork, and each worker needs one (Triton asks the
        # device for its target).
        self.pool = ProcessPoolExecutor(n, mp_context=multiprocessing.get_context("spawn"))
        self.workers = n
        self.jobs: dict[Any, tuple[str, float, Future]] = {}
        self.reported: set = set()
        self.done: list[dict] = []

    def submit(self, kernel: Any, weight_dtypes: list[Any], label: str) -> list:
        """Compile `kernel` for each weight dtype (one job per distinct launch signature); the jobs'
        keys (for wait(keys=...))."""
        keys = []
        for dt in weight_dtypes:
            spec = warmup_spec(kernel, dt)
            if spec not in self.jobs:
                self.jobs[spec] = (f"megakernel {label} {len(kernel.graph.tasks)} tasks "
                                   f"{str(dt).removeprefix('torch.')}", time.time(),
                                   self.pool.submit(compile_megakernel, spec))
            keys.append(spec)
        return keys

    def run(self, label: str, fn: Callable[..., float], *args: Any) -> None:
        """Run a module-level function in a worker (e.g. a per-op step, to compile its kernels)."""
        self.jobs[("call", label)] = (label, time.time(), self.pool.submit(fn, *args))

    def wait(self, timeout_s: float, keys: Any = None) -> list[dict]:
        """Wait for every job, or for the jobs `keys` names (submit's), at most timeout_s; print and
        return each finished job's record (any job's, not yet reported): label, compile seconds in its
        worker, seconds from submission to done, error if any."""
        wanted = self.jobs if keys is None else {k: self.jobs[k] for k in keys if k in self.jobs}
        pending = [f for _, _, f in wanted.values() if not f.done()]
        if pending:
            wait_futures(pending, timeout=max(0.0, timeout_s))
        new = []
        for key, (label, t0, f) in self.jobs.items():
            if key in self.reported or not f.done():
                continue
            self.reported.add(key)
            try:
                rec = dict(label=label, compile_s=round(f.result(timeout=0), 1), error=None)
            except FutureTimeout:
                continue
            except Exception as e:  # noqa: BLE001  a failed warm-up only costs a compile at launch
                rec = dict(label=label, compile_s=None, error=f"{type(e).__name__}: {e}"[:300])
            rec["done_after_s"] = round(time.time() - t0, 1)
            new.append(rec)
            print(f"  compiled {label}: " + (f"{rec['compile_s']} s in a worker" if rec["error"] is None else
                                            f"FAILED in the worker ({rec['error']}); compiled at first launch")
                  + f", done {rec['done_after_s']} s after submission", flush=True)
        self.done += new
        left = [label for label, _, f in wanted.values() if not f.done()]
        if left:
            print(f"  still compiling after the wait: {left} (compiled again at first launch if not done)", flush=True)
        return new

    def close(self) -> None:
        """Drop what is queued and end the compiles still running: at its exit Python waits for
        the pool's running and handed-out jobs (a build skipped for the budget kept a GPU run's
        process 12-17 s past its results). Triton writes its cache by rename: nothing half-written."""
        workers = list((getattr(self.pool, "_processes", None) or {}).values())
        self.pool.shutdown(wait=False, cancel_futures=True)
        for worker in workers:
            worker.terminate()
