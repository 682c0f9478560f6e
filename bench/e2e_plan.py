"""The end-to-end run's plan: every configuration (family, task, concurrency, side) in the order the
run takes them, each with its estimated seconds on an H200, so a run prints what it expects to fit,
skips (saying so) what would overrun its budget, and a kill keeps the most important ones.

Order: the families in e2e_families.ORDER; within one, every task at concurrency 1 (ours, then the
peer), then 8, then 4 (the extremes say most); the `+compile` peers last of all (a compile of
minutes). A serial peer (one request at a time: the public Moondream reference) is measured at
concurrency 1 only; its other levels are derived from that (requests queue: mean latency (c+1)/2
times one request's, the same throughput), unless --measure-serial asks for them.

Estimates (seconds on an H200; GPU_COSTS): measured where the first GPU run measured them
(../shared/gpu-runs/h200-2026-12-04: decode step per launch at batch 1 and 8, the megakernel builds
and compiles), guesses elsewhere, each marked. A call is the non-decode work per request plus the
decode steps at the bucket's step time; a configuration is its warm-up call (per-op kernels compile
at the first call of a shape: FIRST_CALL_S), its repeats and one instrumented call. During the run
each family's estimates are scaled by what its configurations measured so far (Budget.learn).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from e2e_family import Task

# Per family: setup (weights, our loader, the peer), B1 build + compile of the decode megakernel
# (each bucket more: BUCKET_FACTOR; the rounds' pruned graph once more), our decode step (ms) at B1
# and B8, the non-decode ms per request (encoders, prefill; by input), the peer's step ms and
# non-decode ms (eager, static cache). m: measured on the first GPU run; g: a guess.
GPU_COSTS: dict[str, dict[str, Any]] = {
    "moondream2": dict(setup=8, build=6.0, compile=14, step=(7.7, 17.5),     # m: build, compile, steps
                       pre={"756x756": 150, "1920x1080": 300}, peer_step=25,
                       peer_pre={"756x756": 150, "1920x1080": 300}),
    "moondream3": dict(setup=30, build=9.2, compile=9, step=(11.5, 26),      # m: build, compile, B1 step
                       pre={"756x756": 200, "1920x1080": 400}, peer_step=0, peer_pre={}),
    "qwen3.5-0.8b": dict(setup=8, build=6.4, compile=15, step=(6.5, 15),     # m: build, compile, B1 step
                         pre={"756x756": 100, "1920x1080": 300}, peer_step=40,
                         peer_pre={"756x756": 100, "1920x1080": 300}),
    "gemma4-e2b": dict(setup=15, build=7.0, compile=10, step=(20.1, 45),     # m: build, compile, B1 step
                       pre={"756x756": 120, "1920x1080": 120}, peer_step=45,
                       peer_pre={"756x756": 120, "1920x1080": 120}),
    "whisper-large-v3-turbo": dict(setup=6, build=0.7, compile=13, step=(1.5, 3.2),   # m: build, B1/B8 steps
                                   pre={"5 s": 40, "30 s": 40}, peer_step=8, peer_pre={"5 s": 40, "30 s": 40}),
    "whisper-tiny.en": dict(setup=3, build=0.35, compile=13, step=(0.59, 1.06),       # m: all but pre
                            pre={"5 s": 8, "30 s": 8}, peer_step=6, peer_pre={"5 s": 8, "30 s": 8}),
    "parakeet-tdt-0.6b": dict(setup=6, build=0, compile=0, step=(2.0, 3.0),   # g: no megakernel (per-op TDT loop)
                              pre={"5 s": 20, "30 s": 60}, peer_step=3, peer_pre={"5 s": 20, "30 s": 60}),
    "qwen3-asr-0.6b": dict(setup=6, build=3.6, compile=11, step=(5.7, 12),   # m: build, compile, B1 step
                           pre={"5 s": 30, "30 s": 80}, peer_step=30, peer_pre={"5 s": 30, "30 s": 80}),
}
START_S = 20            # g: interpreter, imports, CUDA context
FIRST_CALL_S = 8        # g: per-op Triton compiles at a shape's first call (cached on disk after)
PEER_FIRST_CALL_S = 2   # g: cuBLAS / cuDNN choices at a shape's first call
BUCKET_FACTOR = {1: 1.0, 4: 2.5, 8: 4.8}   # m: Moondream 2's B8 build 28.6 s against B1's 6.0 s
COMPILE_PEER_S = 90     # g: torch.compile of a model's steps (Inductor, reduce-overhead)


@dataclass(frozen=True)
class Config:
    family: str
    task: Task
    concurrency: int
    side: str            # "ours", "peer" or "peer+compile"

    @property
    def key(self) -> str:
        return f"{self.family} | {self.task.name} | c{self.concurrency} | {self.side}"


def configs(families: list[str], tasks: dict[str, list[Task]], levels: tuple[int, ...], serial: set[str],
            no_peer: set[str], compile_peers: bool, measure_serial: bool) -> list[Config]:
    """Every configuration in run order (the module docstring). serial: families whose peer serves
    one request at a time; no_peer: families without one."""
    order = sorted(levels, key=lambda c: (c != 1, -c))    # 1 first, then the largest
    out: list[Config] = []
    for f in families:
        for c in order:
            for t in tasks[f]:
                out.append(Config(f, t, c, "ours"))
                if f not in no_peer and (c == 1 or f not in serial or measure_serial):
                    out.append(Config(f, t, c, "peer"))
    if compile_peers:
        for f in families:
            if f not in no_peer:
                out += [Config(f, t, 1, "peer+compile") for t in tasks[f][:1]]
    return out


def call_s(cfg: Config) -> float:
    """Estimated seconds of one call of the configuration (all its requests)."""
    k = GPU_COSTS[cfg.family]
    c, t = cfg.concurrency, cfg.task
    steps = t.tokens * (3 if t.skill == "detect" else 2 if t.skill == "point" else 1)
    if cfg.side == "ours":
        b1, b8 = k["step"]
        step = b1 + (b8 - b1) * (c - 1) / 7
        return (c * k["pre"].get(t.input, 100) + steps * step) / 1000
    # transformers batches the requests (a step of c rows costs a little more than one); the serial
    # reference runs them one after another
    per = (k["peer_pre"].get(t.input, 100) + steps * k["peer_step"]) / 1000
    return per * c if cfg.family.startswith("moondream") else per * (1 + 0.1 * (c - 1))


def repeats_for(call: float, wanted: int) -> int:
    """Timed repeats: `wanted` for calls under 0.5 s, fewer for slower ones (at least one)."""
    return wanted if call < 0.5 else max(1, min(wanted, 2)) if call < 2 else 1


def config_s(cfg: Config, repeats: int, first_of_shape: bool) -> float:
    """A configuration's seconds: warm-up, repeats and the instrumented call, plus first-call costs."""
    call = call_s(cfg)
    first = (FIRST_CALL_S if cfg.side == "ours" else PEER_FIRST_CALL_S) if first_of_shape else 0.0
    if cfg.side == "peer+compile":
        first += COMPILE_PEER_S
    return first + call * (2 + repeats_for(call, repeats))


def family_setup_s(family: str, buckets: tuple[int, ...], prewarmed: bool) -> float:
    """Setting a family up, plus its buckets' builds and compiles when no prewarm child made them."""
    k = GPU_COSTS[family]
    s = k["setup"]
    # backend auto's engine choice compiles the megakernel's streaming build beside the plain one
    # (engine_choice.candidates: every family's 16-bit weights, FP8 experts or not)
    if not prewarmed:
        s += sum((2 * k["build"] * BUCKET_FACTOR.get(b, 1.0) + 2 * k["compile"]) for b in buckets)
    else:
        s += 3 * len(buckets)    # g: the entries read and the rounds captured
    return s


@dataclass
class Budget:
    """Seconds left and the estimates, scaled per (family, side) by what was measured so far."""
    total_s: float
    start: float
    scale: dict[tuple[str, str], float] = field(default_factory=dict)

    def left(self, now: float) -> float:
        return self.total_s - (now - self.start)

    def estimate(self, cfg: Config, repeats: int, first_of_shape: bool) -> float:
        return config_s(cfg, repeats, first_of_shape) * self.scale.get((cfg.family, cfg.side), 1.0)

    def learn(self, cfg: Config, repeats: int, first_of_shape: bool, took_s: float) -> None:
        """Scale this family's side by measured / estimated (a running mean of the ratios)."""
        est = config_s(cfg, repeats, first_of_shape)
        if est > 0:
            key = (cfg.family, cfg.side)
            ratio = took_s / est
            self.scale[key] = ratio if key not in self.scale else 0.5 * (self.scale[key] + ratio)


def family_starts(plan: list[Config], repeats: int, setups: dict[str, float]) -> dict[str, float]:
    """When each family's setup is expected to start (seconds from the run's start)."""
    starts: dict[str, float] = {}
    total = START_S
    seen: set[tuple[str, str, str]] = set()
    for cfg in plan:
        if cfg.family not in starts:
            starts[cfg.family] = total
            total += setups.get(cfg.family, 0.0)
        shape = (cfg.family, cfg.task.input, cfg.side)
        total += config_s(cfg, repeats, shape not in seen)
        seen.add(shape)
    return starts


def table(plan: list[Config], repeats: int, setups: dict[str, float]) -> list[str]:
    """The plan as printed lines: per family its setup, configurations and cumulative seconds."""
    lines, total = [], START_S
    seen: set[tuple[str, str, str]] = set()
    lines.append(f"plan (estimated seconds on an H200; start {START_S} s):")
    family = None
    for cfg in plan:
        if cfg.family != family:
            family = cfg.family
            total += setups.get(family, 0.0)
            lines.append(f"  {family}: setup {setups.get(family, 0.0):.0f} s -> at {total:.0f} s")
        shape = (cfg.family, cfg.task.input, cfg.side)
        s = config_s(cfg, repeats, shape not in seen)
        seen.add(shape)
        total += s
        lines.append(f"    {cfg.task.name:18s} c{cfg.concurrency} {cfg.side:13s} {s:6.1f} s -> at {total:6.0f} s")
    lines.append(f"  total {total:.0f} s")
    return lines
