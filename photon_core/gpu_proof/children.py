"""Parts of the proof run in child processes of their own, so that a CUDA error in one cannot take
the others down: an illegal memory access is sticky (every later CUDA call of the process fails
with it), and in the first GPU run one in the production decode loop's rounds (Whisper tiny.en)
failed Moondream 2's rounds after it. Each family's device rounds are a child: the proof's driver
run again for that family and part alone (`--in-child`), writing its own results file and log,
which the parent merges into its own as each child ends (Ctx.on_record, then the rounds part
waits for the rest). A child that crashes or overruns is a failed check of its own.

The children start with the run, beside the parent's builds (host work, the GPU idle), and run
their GPU work under the GPU lock (GpuLock: a file lock whose path the children inherit), which
the parent also takes while it times steps and holds at the start until the liveness child (a
kernel spinning for ~10 s) has exited: no timing of either shares the GPU with other work."""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

LOCK_ENV = "PHOTON_PROOF_GPU_LOCK"


@contextlib.contextmanager
def gpu_lock(path: str | None = None, wait_s: float | None = None) -> Iterator[bool]:
    """Hold the run's GPU lock (a no-op when the run has none: a proof run alone). With `wait_s`,
    go on without it after that long (yielding False): a child stuck under the lock must not keep
    the parent's timing from running at all."""
    path = path or os.environ.get(LOCK_ENV)
    if not path:
        yield True
        return
    with open(path, "a") as f:         # a separate open file: separate from any other holder
        t = time.time()
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | (fcntl.LOCK_NB if wait_s is not None else 0))
                held = True
                break
            except BlockingIOError:
                if time.time() - t >= (wait_s or 0.0):
                    held = False
                    break
                time.sleep(0.1)
        try:
            yield held
        finally:
            if held:
                fcntl.flock(f, fcntl.LOCK_UN)


@dataclass
class Child:
    """One child run: its command, results file and log, and how it ended."""
    label: str
    argv: list[str]
    json_path: Path
    log_path: Path
    timeout_s: float
    proc: subprocess.Popen | None = None
    started: float = 0.0
    ended: float = 0.0
    rc: int | None = None
    killed: bool = False
    merged: bool = False


@dataclass
class Children:
    """Starts `children` (all at once, or one after another when not `parallel`) on a thread of
    its own, which holds the GPU lock while `hold()` is true (the liveness child running); `done()`
    lists the ended children not yet merged."""
    children: list[Child]
    parallel: bool
    lock_path: str
    hold: Callable[[], bool] | None = None
    env: dict = field(default_factory=dict)
    _thread: threading.Thread | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self) -> None:
        held = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(held,), daemon=True)
        self._thread.start()
        held.wait(10.0)        # the lock is ours before the parent goes on

    def _run(self, held: threading.Event) -> None:
        with open(self.lock_path, "a") as f:
            if self.hold is not None:
                fcntl.flock(f, fcntl.LOCK_EX)
            held.set()
            pending = list(self.children)
            running: list[Child] = []
            released = self.hold is None
            while pending or running:
                if not released and not self.hold():       # type: ignore[misc]
                    fcntl.flock(f, fcntl.LOCK_UN)
                    released = True
                while pending and (self.parallel or not running):
                    running.append(self._launch(pending.pop(0)))
                for c in list(running):
                    if self._reap(c):
                        running.remove(c)
                time.sleep(0.2)
            while not released and self.hold():           # type: ignore[misc]
                time.sleep(0.2)
            if not released:
                fcntl.flock(f, fcntl.LOCK_UN)

    def _launch(self, c: Child) -> Child:
        env = dict(os.environ, **self.env)
        env[LOCK_ENV] = self.lock_path
        c.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(c.log_path, "w") as log:
            c.proc = subprocess.Popen(c.argv, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
        c.started = time.time()
        return c

    def _reap(self, c: Child) -> bool:
        assert c.proc is not None
        rc = c.proc.poll()
        if rc is None and time.time() - c.started > c.timeout_s:
            c.proc.kill()
            rc = c.proc.wait()
            c.killed = True
        if rc is None:
            return False
        with self._lock:
            c.rc, c.ended = rc, time.time()
        return True

    def done(self) -> list[Child]:
        """Children that have ended and are not merged yet."""
        with self._lock:
            return [c for c in self.children if c.rc is not None and not c.merged]

    def wait(self, timeout_s: float) -> None:
        """Until every child has ended (or `timeout_s`: then the ones left are killed)."""
        t = time.time()
        while any(c.rc is None for c in self.children) and time.time() - t < timeout_s:
            time.sleep(0.2)
        for c in self.children:
            if c.rc is None and c.proc is not None:
                c.proc.kill()
                c.killed = True
        if self._thread is not None:
            self._thread.join(5.0)


def merge(out: dict, checks: Any, child: Child, part: str) -> list[str]:
    """Add a child's results of `part`, its checks and compiles to the parent's (`out`, `checks`);
    a child that crashed, overran or wrote no results is a failed check. Returns its log's lines."""
    child.merged = True
    log = child.log_path.read_text(errors="replace").splitlines() if child.log_path.exists() else []
    try:
        res = json.loads(child.json_path.read_text())
    except (OSError, ValueError):
        res = {}
    entry = out.setdefault("parts", {}).setdefault(part, dict(seconds=0.0, results=[], failed=[]))
    entry["results"].extend(res.get("parts", {}).get(part, {}).get("results", []))
    got = res.get("checks", {})
    checks.passed += got.get("passed", 0)
    for f in got.get("failed", []):
        checks.expect(False, f)
    out.setdefault("compiles", []).extend(dict(c, label=f"{c['label']} (child {child.label})")
                                          for c in res.get("compiles", []))
    out.setdefault("skipped", []).extend(res.get("skipped", []))
    out.setdefault("children", []).append(dict(label=child.label, exit=child.rc, killed=child.killed,
                                               seconds=round(child.ended - child.started, 1),
                                               json=str(child.json_path), log=str(child.log_path)))
    # Exit 0 and 1 are the driver's own (passed, failed: its checks say which); anything else, or no
    # results, is the child dying: the configuration it was running is lost, not the parent's others.
    if child.killed or child.rc not in (0, 1) or not res:
        tail = " | ".join(line.strip() for line in log[-3:])[:400]
        how = f"killed after {child.timeout_s:.0f} s" if child.killed else f"exit status {child.rc}"
        checks.expect(False, f"{child.label} (child process): {how}{'' if res else ', no results'}: {tail}")
    return log
