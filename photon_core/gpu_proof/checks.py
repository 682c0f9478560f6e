"""The proof's bookkeeping: how much each part does (Sizes), every check's outcome (Checks), the
run's shared state (Ctx: device, builds, results written after every configuration), the error
measures every part compares with, and CUDA-event timing."""
from __future__ import annotations

import json
import statistics
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

PARTS = ("steps", "stress", "poison", "control", "liveness", "rounds", "timing")
TOL = 1e-3            # max |mk - ref| / max |ref|, both dtypes (the references use the arena's weights)
# Polls before a wait gives up (~1 s; the longest legitimate wait, 3 programs behind a whole LM
# head, is milliseconds): a lost signal becomes an error, not a hang that eats the GPU session.
GPU_SPIN_LIMIT = 1 << 20
FP32_NOTE = 1e-4      # fp32 errors above this are flagged in the summary (expected: ~1e-6)


@dataclass(frozen=True)
class Sizes:
    """How much each part does. GPU sizes keep each configuration to seconds on an H200 (the time
    caps bound what an estimate cannot); dry-run ones a fraction of a second of the interpreter."""
    steps: int
    launches: int             # race stress per program count
    min_launches: int         # what a time cap may reduce a slow (few-program) stress to
    cap_few_s: float          # time cap per stress with fewer programs than SMs (they cannot race much)
    cap_many_s: float         # time cap per stress with >= #SMs programs
    poison_launches: int
    control_launches: int     # launches the dropped-wait stress gets to show a difference
    iters: int
    warmup: int
    liveness_timeout_s: float
    round_tokens: int         # tokens per request in the rounds part (launches: one fewer)
    round_repeats: int        # timed requests per way of decoding (median)


GPU_SIZES = Sizes(steps=64, launches=1000, min_launches=10, cap_few_s=3.0, cap_many_s=10.0, poison_launches=100,
                  control_launches=1000, iters=200, warmup=20, liveness_timeout_s=120.0, round_tokens=33,
                  round_repeats=5)
DRY_SIZES = Sizes(steps=2, launches=2, min_launches=2, cap_few_s=float("inf"), cap_many_s=float("inf"),
                  poison_launches=2, control_launches=2, iters=1, warmup=0, liveness_timeout_s=120.0,
                  round_tokens=4, round_repeats=1)


class Checks:
    """Every check's outcome; any failure makes the exit status 1."""

    def __init__(self) -> None:
        self.passed = 0
        self.failed: list[str] = []

    def expect(self, ok: bool, what: str) -> bool:
        if ok:
            self.passed += 1
        else:
            self.failed.append(what)
            print(f"    FAIL: {what}", flush=True)
        return bool(ok)


@dataclass
class Ctx:
    """One proof run: its device, sizes, checks and results (`out`, written to `json_path` after
    every configuration, so a run killed by a timeout keeps everything it finished), and what the
    parts share: compiled steps (`builds`), stress probes, weight arenas per dtype, the noise
    stream, and the parallel compiles (`warm`, a proof.prewarm.Prewarm, or None)."""
    dev: Any                   # torch.device
    cuda: bool
    sizes: Sizes
    sms: int
    budget_s: float = float("inf")
    json_path: str = ""
    hbm_tbps: float = 4.8
    checks: Checks = field(default_factory=Checks)
    out: dict = field(default_factory=dict)
    t0: float = field(default_factory=time.time)
    builds: dict = field(default_factory=dict)
    arenas: dict = field(default_factory=dict)     # id(first arena) -> {dtype: arena}
    probes: dict = field(default_factory=dict)
    noise: Any = None
    warm: Any = None

    def elapsed(self) -> float:
        return time.time() - self.t0

    def left(self) -> float:
        return self.budget_s - self.elapsed()

    def programs(self) -> tuple[int, ...]:
        return (1, 3, self.sms, 2 * self.sms) if self.cuda else (1, 3)

    def sync(self) -> None:
        if self.cuda:
            import torch
            torch.cuda.synchronize()

    def record(self, part: str, result: Any) -> None:
        """Add one configuration's result to its part and write the results file."""
        entry = self.out.setdefault("parts", {}).setdefault(part, dict(seconds=0.0, results=[], failed=[]))
        if result is not None:
            entry["results"].extend(result if isinstance(result, list) else [result])
        self.save()

    def save(self) -> None:
        self.out["seconds"] = round(self.elapsed(), 1)
        self.out["checks"] = dict(passed=self.checks.passed, failed=self.checks.failed)
        self.out["passed"] = not self.checks.failed
        if self.json_path:
            # Written whole to a side file, then renamed: a kill mid-write leaves the previous file.
            path = Path(self.json_path)
            tmp = path.with_suffix(path.suffix + ".tmp")
            tmp.write_text(json.dumps(self.out, indent=1, default=str))
            tmp.replace(path)


def guarded(ctx: Ctx, what: str, fn: Callable[[], Any]) -> Any:
    """Run one configuration; an exception is a failed check (with its traceback), not the end of the
    proof, so one broken configuration does not hide the others."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001
        traceback.print_exc()
        ctx.checks.expect(False, f"{what}: {type(e).__name__}: {e}")
        return None


def over_budget(ctx: Ctx, what: str, need_s: float = 20.0) -> bool:
    """Whether the run's budget leaves too little for one more configuration of `what` (then say so)."""
    if ctx.left() >= need_s:
        return False
    msg = f"{what} SKIPPED: {ctx.left():.0f} s left of the budget {ctx.budget_s:.0f} s"
    print(f"  {msg}", flush=True)
    ctx.out.setdefault("skipped", []).append(msg)
    return True


def rel_err(got, want) -> float:
    """max |got - want| / max |want| over the entries where `want` is finite; inf when the two
    disagree on which entries are finite (a NaN or a lost -inf mask)."""
    import torch
    got, want = got.float(), want.float()
    finite = torch.isfinite(want)
    if not torch.equal(torch.isfinite(got), finite) or not bool(
            torch.equal(got[~finite], want[~finite]) if (~finite).any() else True):
        return float("inf")
    if not finite.any():
        return 0.0
    return ((got[finite] - want[finite]).abs().max() / want[finite].abs().max().clamp_min(1e-30)).item()


def argmax_ok(chosen: list[int], values, tol: float | None = None) -> tuple[int, int]:
    """(exact, tolerated) of the kernel's argmax picks against the reference's values [B, C]: a
    pick that differs must be a near-tie (within tol x max |value|, default TOL) in the reference's
    own values."""
    import torch
    tol = TOL if tol is None else tol
    exact = tolerated = 0
    scale = values[torch.isfinite(values)].abs().max().item() if torch.isfinite(values).any() else 1.0
    for r, c in enumerate(chosen):
        row = values[r]
        best = int(row.argmax())
        if c == best:
            exact += 1
        elif 0 <= c < row.numel() and row[c].item() >= row[best].item() - tol * scale:
            tolerated += 1
    return exact, tolerated


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
