"""Child processes that build our compiled decode steps ahead of the measuring process.

A family's decode megakernel is built per batch bucket (1, 4, 8 for the concurrency levels run):
tens of seconds of host work per bucket (lowering, the race proof, encoding: Moondream 2's B8 took
28.6 s on the first GPU run) and a Triton compile of 10-15 s, one bucket after another in one
process. Each child here builds one (family, bucket) through the family's own path (its model, then
`warm_bucket`), so the steps land in the build cache (megakernel/build_cache.py) and the compiled
kernels in Triton's cache, both on disk and shared with the parent through PHOTON_CACHE_DIR and
TRITON_CACHE_DIR; the parent then reads them instead of building. Children work beside the parent's
measurements: host cores and GPU memory, and a few launches of their own (the rounds' capture), which
the results record as `children running` on each configuration.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Job:
    family: str
    bucket: int
    proc: subprocess.Popen | None = None
    started: float = 0.0
    result: dict[str, Any] | None = None
    out: Any = None      # the child's stdout and stderr files
    err: Any = None


@dataclass
class Prewarm:
    """Jobs run `workers` at a time, in the order given (the run's order)."""
    command: list[str]          # the child's command line, without --child/--bucket
    jobs: list[Job]
    workers: int
    env: dict[str, str]
    timeout_s: float = 600.0
    # Whether another child may start now (the GPU's free memory: each child holds a whole model).
    room: Callable[[], bool] = lambda: True
    results: list[dict[str, Any]] = field(default_factory=list)

    def pump(self) -> None:
        """Collect finished children and start queued ones while workers are free."""
        now = time.time()
        for j in self.jobs:
            if j.proc is not None and j.result is None:
                if j.proc.poll() is not None:
                    self._finish(j)
                elif now - j.started > self.timeout_s:
                    j.proc.kill()
                    self._finish(j, f"killed after {self.timeout_s:.0f} s")
        running = sum(1 for j in self.jobs if j.proc is not None and j.result is None)
        for j in self.jobs:
            if running >= self.workers or (running and not self.room()):
                break
            if j.proc is None:
                cmd = self.command + ["--child", j.family, "--bucket", str(j.bucket)]
                # files, not pipes: a child's warnings could fill a pipe nobody reads until it ends
                j.out, j.err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
                j.proc = subprocess.Popen(cmd, env=self.env, stdout=j.out, stderr=j.err, text=True)
                j.started = time.time()
                running += 1

    def running(self) -> int:
        return sum(1 for j in self.jobs if j.proc is not None and j.result is None)

    def wait(self, family: str, buckets: tuple[int, ...], timeout_s: float) -> None:
        """Until the family's children of these buckets have ended (or timeout_s): the parent then
        reads their steps instead of building them itself."""
        end = time.time() + timeout_s
        wanted = [j for j in self.jobs if j.family == family and j.bucket in buckets]
        while time.time() < end:
            self.pump()
            if all(j.result is not None for j in wanted):
                return
            time.sleep(0.2)

    def close(self) -> None:
        """End the children still running (this run's own, by their process)."""
        for j in self.jobs:
            if j.proc is not None and j.result is None:
                j.proc.kill()
                self._finish(j, "ended with the run")

    def _finish(self, j: Job, reason: str | None = None) -> None:
        out = err = ""
        if j.proc is not None:
            j.proc.wait()
            for f in (j.out, j.err):
                f.seek(0)
            out, err = j.out.read(), j.err.read()
            j.out.close()
            j.err.close()
        res: dict[str, Any] = dict(family=j.family, bucket=j.bucket, seconds=round(time.time() - j.started, 1),
                                   rc=j.proc.returncode if j.proc is not None else None)
        lines = [line for line in (out or "").splitlines() if line.startswith("{")]
        if lines:
            res.update(json.loads(lines[-1]))
        if reason or res["rc"]:
            res["error"] = reason or (err or "")[-1500:]
        j.result = res
        self.results.append(res)


def gpu_room(free_gib: float) -> Callable[[], bool]:
    """True while the GPU has `free_gib` free (a child's model, arenas and caches: up to ~25 GiB
    for Gemma 4 E2B or Moondream 3.1)."""
    def room() -> bool:
        import torch
        return torch.cuda.mem_get_info()[0] > free_gib * 2**30
    return room


def child_env(cache_dir: str) -> dict[str, str]:
    """The environment parent and children share: the build cache on, both caches in one folder
    (a user's own PHOTON_CACHE_DIR / TRITON_CACHE_DIR win)."""
    env = dict(os.environ)
    env["PHOTON_BUILD_CACHE"] = "1"
    env.setdefault("PHOTON_CACHE_DIR", os.path.join(cache_dir, "photon"))
    env.setdefault("TRITON_CACHE_DIR", os.path.join(cache_dir, "triton"))
    env["PYTHONUNBUFFERED"] = "1"
    return env


def script_command(script: str, args: list[str]) -> list[str]:
    return [sys.executable, script] + args
