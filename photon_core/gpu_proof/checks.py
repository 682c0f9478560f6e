"""The proof's bookkeeping: how much each part does (Sizes), every check's outcome (Checks), the
run's shared state (Ctx: device, builds, results written after every configuration), the error
measures every part compares with, and CUDA-event timing."""
from __future__ import annotations

import json
import statistics
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

from photon_core.gpu_proof.results_file import replace_whole

# The parts in the order they run: timing right after the steps (which prove what it times), so a
# run killed in a later part still has its times; rounds last (they run in child processes beside
# the rest and are collected there).
PARTS = ("steps", "timing", "stress", "poison", "control", "liveness", "rounds")
# The floor of the tolerance against the fp32 reference at the steps not run in float64 (max |mk -
# ref| / max |ref|, both weight dtypes: the references use the arena's weights); above it the
# tolerance follows the noise the configuration's float64 steps measured (tolerance()).
TOL = 1e-3
# Polls before a wait gives up (~1 s; the longest legitimate wait, 3 programs behind a whole LM
# head, is milliseconds): a lost signal becomes an error, not a hang that eats the GPU session.
GPU_SPIN_LIMIT = 1 << 20
FP32_NOTE = 1e-4      # fp32 errors above this are flagged in the summary (expected: ~1e-6)

# ---------------------------------------------------------------------------------------------------
# The rule a step's values are judged by (issue 37, item 2)
#
# The megakernel and eager.run_reference are two fp32 computations of the same math; neither is
# the truth. At two steps of every configuration (the first, and the last that runs the whole
# graph, from the megakernel's own history: profile.float64_steps, build.adopt_history) and at the
# stress probe's fixed inputs, the reference is also run in float64 on the same weights (as the
# arena holds them), history and inputs (gpu_proof.float64), and both are measured against it: per value
# e = max |x - x64| / max |x64|; per layer (the values named L<i>., the K/V that layer appends and
# the states it updates; "in" before the first layer, "out" after the last) the worst of them, in
# graph order: the error profile (gpu_proof.profile).
#
# fp32 rounding grows smoothly with depth in both profiles alike (Gemma 4 E2B's 35 layers at real
# shapes: ~1.2x a layer, to ~1e-3 at the logits, which a fixed 1e-3 tolerance judged a failure). A
# defect (a wrong tile, a stale read, a perturbed weight) is an error the fp32 reference does not
# make: the megakernel's profile steps up at the layer it sits in and stays up. So a profile passes
# when at every layer
#     mk <= NOISE_RATIO * max(envelope, NOISE_FLOOR),  envelope = max of ref32 up to this layer
# and the first layer that breaks it is where the defect is (later ones inherit it). The envelope
# (a running maximum) because noise only accumulates with depth, while one value's error at one
# layer rises and falls with its magnitude (Gemma 4 E2B at real shapes on the CPU: ref32 2e-4 at
# one layer after 9e-4 at the one before). NOISE_FLOOR keeps layers the fp32 reference computes
# almost exactly (an embedding lookup: 0) from demanding exactness. NOISE_RATIO leaves room for
# another summation order (split-K, tiles, online softmax): a third fp32 computation with rounding
# of its own (every op's result moved by a random ulp) stayed within 3.7x of the reference's
# envelope at every layer of Gemma 4 E2B (35 layers, 4 seeds) and 1.4x of Qwen 3.5 0.8B's (24
# layers; 3 seeds), measured on the CPU at real shapes (bf16 weights); a defect is orders of
# magnitude above it. A profile whose fp32 reference is itself off by more than REF_NOISE_LIMIT is
# refused: there, noise would hide a defect.
#
# The other steps have only the fp32 reference; they are held to tolerance(profile): CAL times the
# largest error the float64 steps measured (mk or ref32, any layer), never less than TOL, i.e. the
# noise this very configuration showed, with room for the steps' other positions. Argmax picks
# that differ must be near-ties within the same tolerance.
NOISE_RATIO = 8.0
NOISE_FLOOR = 1e-6
REF_NOISE_LIMIT = 1e-2
CAL = 4.0


@dataclass
class Profile:
    """One step's per-layer errors against the float64 reference, in graph order: the megakernel's
    (`mk`) and the fp32 reference's (`ref32`) worst relative error over each layer's entries."""
    layers: list[str]
    mk: list[float]
    ref32: list[float]

    def envelope(self) -> list[float]:
        """The fp32 reference's error as noise accumulates: its running maximum over the layers."""
        out, m = [], 0.0
        for r in self.ref32:
            m = max(m, r)
            out.append(m)
        return out

    def bound(self, i: int) -> float:
        return NOISE_RATIO * max(self.envelope()[i], NOISE_FLOOR)

    def worst_ratio(self) -> tuple[float, str]:
        """The largest mk / max(envelope, floor) over the layers, and its layer."""
        env = self.envelope()
        ratios = [(self.mk[i] / max(env[i], NOISE_FLOOR), self.layers[i]) for i in range(len(self.layers))]
        return max(ratios, default=(0.0, "-"))

    def summary(self) -> dict:
        ratio, where = self.worst_ratio()
        return dict(layers=self.layers, mk=self.mk, ref32=self.ref32, worst_ratio=ratio, worst_layer=where)


def judge_profile(p: Profile) -> str | None:
    """None when the profile is fp32 noise by the rule above, else why not (naming the layer)."""
    worst_ref = max(p.ref32, default=0.0)
    if not worst_ref <= REF_NOISE_LIMIT:     # inf / NaN too: finite patterns that disagree
        at = p.layers[p.ref32.index(worst_ref)] if worst_ref in p.ref32 else "?"
        return (f"the fp32 reference itself is off by {worst_ref:.1e} from float64 at layer {at} "
                f"(limit {REF_NOISE_LIMIT:.0e}): noise this large would hide a defect")
    for i, layer in enumerate(p.layers):
        if not p.mk[i] <= p.bound(i):
            return (f"layer {layer}: megakernel error {p.mk[i]:.1e} against float64, fp32 reference "
                    f"{p.ref32[i]:.1e} (bound {p.bound(i):.1e} = {NOISE_RATIO:g} x max(its envelope, "
                    f"{NOISE_FLOOR:.0e})): a step in the profile, not fp32 noise")
    return None


def tolerance(profiles: list[Profile]) -> float:
    """The tolerance against the fp32 reference at the other steps (the rule above)."""
    noise = max((max(p.mk + p.ref32, default=0.0) for p in profiles), default=0.0)
    return max(TOL, CAL * noise)


@dataclass(frozen=True)
class Sizes:
    """How much each part does. GPU sizes keep each configuration to seconds on an H200 (the time
    caps bound what an estimate cannot); dry-run ones a fraction of a second of the interpreter."""
    steps: int
    launches: int             # race stress per program count
    min_launches: int         # what a time cap may reduce a stress to (one plain, one after a NaN-fill)
    cap_few_s: float          # time cap per stress with fewer programs than SMs (they cannot race much)
    cap_many_s: float         # time cap per stress with >= #SMs programs
    poison_launches: int
    control_launches: int     # launches the dropped-wait stress gets to show a difference
    iters: int                # timed CUDA-graph replays (0: the checking launch's own time, none more)
    warmup: int
    liveness_timeout_s: float
    round_tokens: int         # tokens per request in the rounds part (launches: one fewer)
    round_repeats: int        # timed requests per way of decoding (median)
    object_rounds: tuple[int, ...]   # Moondream 2's detect/point rounds, steps each (launches: their sum, per way)


# The stress caps fit the proof's call (gpu_proof.plan): 1000 launches where a launch takes up to
# 4 ms (Whisper's steps); Moondream 2's steps (8-18 ms a launch at #SMs, each 19-47K tasks where
# Whisper's has 2.5-4.5K) get 4 s per program count, and with 1 or 3 programs (0.4-3.1 s a launch:
# one SM streams the whole model) a plain launch and a poisoned one.
GPU_SIZES = Sizes(steps=64, launches=1000, min_launches=2, cap_few_s=1.0, cap_many_s=4.0, poison_launches=100,
                  control_launches=1000, iters=200, warmup=20, liveness_timeout_s=120.0, round_tokens=33,
                  round_repeats=5, object_rounds=(3, 5, 8))
# The dry run launches on the interpreter (~0.3 s a launch) and times nothing real: a timed step is
# its checking launch (iters 0); object rounds are one that ends an object and one that goes on from
# the phase it left (on a GPU, rounds of 3 and 5 also replay several graphs a round; the interpreter
# launches each step eagerly either way).
DRY_SIZES = Sizes(steps=2, launches=2, min_launches=2, cap_few_s=float("inf"), cap_many_s=float("inf"),
                  poison_launches=2, control_launches=2, iters=0, warmup=0, liveness_timeout_s=120.0,
                  round_tokens=4, round_repeats=1, object_rounds=(3, 2))


def launch_plan(per_launch_s: float, programs: int, sms: int, sizes: Sizes) -> tuple[int, bool]:
    """(launches, capped) of one stress: the target, unless that passes the time cap for this
    program count, then as many as the cap holds but at least min_launches. The stress sizes
    itself by this from its first launch, and the time plan predicts it from the measured costs."""
    cap = sizes.cap_many_s if programs >= sms else sizes.cap_few_s
    if per_launch_s * sizes.launches <= cap:
        return sizes.launches, False
    return max(sizes.min_launches, int(cap / per_launch_s)), True


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
    # Set when a configuration left this process's CUDA context unusable (a sticky error such as an
    # illegal memory access): the configurations after it are skipped, saying why, instead of each
    # failing with the same error; parts in child processes are not affected (gpu_proof.children).
    broken: str | None = None
    on_record: Callable[[], None] | None = None     # called before each record (the children's results)

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
        if self.on_record is not None:
            self.on_record()
        entry = self.out.setdefault("parts", {}).setdefault(part, dict(seconds=0.0, results=[], failed=[]))
        if result is not None:
            entry["results"].extend(result if isinstance(result, list) else [result])
        self.save()

    def save(self) -> None:
        # Parts in run order (a child's rounds are merged whenever the child ends).
        parts = self.out.get("parts", {})
        self.out["parts"] = {k: parts[k] for k in sorted(parts, key=lambda k: PARTS.index(k) if k in PARTS else 99)}
        self.out["seconds"] = round(self.elapsed(), 1)
        self.out["checks"] = dict(passed=self.checks.passed, failed=self.checks.failed)
        self.out["passed"] = not self.checks.failed
        if self.json_path:
            replace_whole(self.json_path, json.dumps(self.out, indent=1, default=str))


def guarded(ctx: Ctx, what: str, fn: Callable[[], Any]) -> Any:
    """Run one configuration; an exception is a failed check (with its traceback), not the end of the
    proof, so one broken configuration does not hide the others. After one that broke the CUDA
    context, the rest are skipped (saying so): they could only fail with its error."""
    if ctx.broken is not None:
        skip(ctx, f"{what} SKIPPED: this process's CUDA context is unusable since {ctx.broken}")
        return None
    try:
        return fn()
    except Exception as e:  # noqa: BLE001
        traceback.print_exc()
        ctx.checks.expect(False, f"{what}: {type(e).__name__}: {e}")
        if ctx.cuda and not cuda_usable():
            ctx.broken = what
        return None


def cuda_usable() -> bool:
    """Whether this process can still run CUDA work (after a sticky error it cannot: every call
    raises the error again)."""
    import torch
    try:
        (torch.ones(1, device="cuda") + 1).item()
        torch.cuda.synchronize()
        return True
    except Exception:  # noqa: BLE001
        return False


def skip(ctx: Ctx, msg: str) -> None:
    """Record (and print) a configuration not run, and why."""
    print(f"  {msg}", flush=True)
    ctx.out.setdefault("skipped", []).append(msg)


def over_budget(ctx: Ctx, what: str, need_s: float = 20.0) -> bool:
    """Whether the run's budget leaves too little for one more configuration of `what` (then say so)."""
    if ctx.left() >= need_s:
        return False
    skip(ctx, f"{what} SKIPPED: {ctx.left():.0f} s left of the budget {ctx.budget_s:.0f} s")
    return True


def rel_err(got, want) -> float:
    """max |got - want| / max |want| over the entries where `want` is finite; inf when the two
    disagree on which entries are finite (a NaN or a lost -inf mask). In float64 when `want` is
    (the float64 reference), else in fp32."""
    import torch
    dt = torch.float64 if want.dtype == torch.float64 else torch.float32
    got, want = got.to(dt), want.to(dt)
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
