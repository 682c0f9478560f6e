"""The proof's time plan: the seconds each part of a profile will take on an H200, predicted from
what the first GPU run measured (gpu_proof.costs) and the sizes the proof runs at, so that a
profile is sized to its call of the device tool before it runs (bench/gpu_proof.py --plan; the
dry run prints it too). A configuration without a measured or estimated cost is an error: every
part is planned, or the plan says what it lacks.

The driver describes the work (Work): the steps the parent builds, each part's configurations in
the order they run, the families whose rounds run in child processes, and whether the liveness
child runs. Children run beside the parent (gpu_proof.children): they count on the critical path
only for what is left of them when the parent reaches their part."""
from __future__ import annotations

from dataclasses import dataclass, field

from photon_core.gpu_proof import costs
from photon_core.gpu_proof.checks import Sizes, launch_plan


@dataclass
class Work:
    """What a profile runs (on a GPU). `configs`: (part, family, batch, dtype) in run order;
    `builds`: (family, batch, kind: advance / plain / token) the parent builds; `children`:
    family -> the builds its rounds child makes; `stress_dtype`: family -> the dtype stress-type
    parts run in; `perop`: families timed against a per-op step."""
    parts: list[str]
    configs: list[tuple[str, str, int, str]]
    builds: list[tuple[str, int, str]]
    children: dict[str, list[tuple[str, int, str]]] = field(default_factory=dict)
    stress_dtype: dict[str, str] = field(default_factory=dict)
    perop: set[str] = field(default_factory=set)
    liveness: bool = False


@dataclass
class Prediction:
    """Seconds per line of the plan ("start", "build", "compiles", each part, "end"), in order,
    what each line is made of, and the children's own durations (beside the parent)."""
    seconds: dict[str, float]
    detail: dict[str, list[str]]
    beside: dict[str, float]

    @property
    def total(self) -> float:
        return sum(self.seconds.values())

    def lines(self, limit_s: float | None = None, details: bool = False) -> list[str]:
        out = [f"time plan on an H200, from the costs measured by {costs.RUN}:"]
        for k, v in self.seconds.items():
            out.append(f"  {k:9s} {v:7.1f} s")
            if details:
                out += [f"              {d}" for d in self.detail.get(k, [])]
        out.append(f"  {'total':9s} {self.total:7.1f} s" + (f" (limit {limit_s:.0f} s)" if limit_s else ""))
        for k, v in self.beside.items():
            out.append(f"  beside the parent: {k} {v:.1f} s")
        return out


def _step_s(family: str, batch: int, dtype: str) -> float:
    return costs.STEPS_S[(family, batch, dtype)] / 64


def _f64_s(family: str, batch: int, dtype: str) -> float:
    return costs.F64_STEP_X * _step_s(family, batch, dtype) + costs.F64_STEP_S


def predict(work: Work, sizes: Sizes, sms: int = costs.SMS) -> Prediction:
    """The plan of `work` at `sizes` (raises KeyError naming a configuration with no cost)."""
    sec: dict[str, float] = {"start": costs.START_S}
    det: dict[str, list[str]] = {}

    def add(line: str, s: float, what: str) -> None:
        sec[line] = sec.get(line, 0.0) + s
        det.setdefault(line, []).append(f"{what}: {s:.1f} s")

    for f, b, kind in work.builds:
        add("build", costs.BUILD_S[(f, b, kind)], f"{f} B{b} {kind}")
    if work.builds:
        add("build", costs.LOAD_S, "weights and graphs")
        add("compiles", costs.COMPILE_TAIL_S, "the last compile after the builds")
    probed: set[tuple[str, int]] = set()
    scale = sizes.steps / 64
    reached: dict[str, float] = {}
    for part in work.parts:
        reached[part] = sum(sec.values())
        sec.setdefault(part, 0.0)
        for p, f, b, dt in (c for c in work.configs if c[0] == part):
            if part == "steps":
                n64 = 2   # the first and the last full step
                add(part, costs.STEPS_S[(f, b, dt)] * scale + costs.STEPS_PART_S + n64 * _f64_s(f, b, dt),
                    f"{f} B{b} {dt}: {sizes.steps} steps, {n64} in float64")
            elif part in ("stress", "poison", "control"):
                if (f, b) not in probed:
                    probed.add((f, b))
                    add(part, costs.PROBE_S + 6e-3 * costs.LAUNCH_MS[(f, b)] + _f64_s(f, b, work.stress_dtype[f]),
                        f"probe {f} B{b}")
                if part == "stress":
                    for programs in (1, 3, sms, 2 * sms):
                        t = costs.STRESS_LAUNCH_S[(f, b, programs)]
                        n, capped = launch_plan(t, programs, sms, sizes)
                        add(part, n * t, f"{f} B{b} {programs} programs: {n} launches{' (cap)' if capped else ''}")
                elif part == "poison":
                    add(part, costs.POISON_S[(f, b)] * sizes.poison_launches / 100, f"{f} B{b}")
                else:
                    add(part, costs.CONTROL_S[(f, b)], f"{f} B{b}")
            elif part == "timing":
                us = costs.TIMING_US.get((f, b, dt), costs.LAUNCH_MS[(f, b)] * 1e3)
                add(part, (sizes.iters + sizes.warmup) * us / 1e6 + costs.TIMING_EACH_S, f"{f} B{b} {dt}")
            elif part not in ("liveness", "rounds"):
                raise KeyError(f"no cost model for part {part!r}")
        if part == "timing":
            for f, b in dict.fromkeys((f, b) for p, f, b, _ in work.configs if p == "timing" and f in work.perop):
                add(part, (sizes.iters + sizes.warmup) * costs.PEROP_US[(f, b)] / 1e6 + costs.TIMING_EACH_S,
                    f"per-op {f} B{b}")
    beside: dict[str, float] = {}
    gpu_free = costs.START_S         # children start with the proof's clock, after gpu.sh's own start
    if work.liveness:
        beside["liveness child"] = costs.LIVENESS_S
        gpu_free += costs.LIVENESS_S
    done = gpu_free
    for f, builds in work.children.items():
        host = costs.CHILD_START_S + max(sum(costs.BUILD_S[x] for x in builds),
                                         costs.BUILD_S[builds[0]] + costs.COMPILE_TAIL_S)
        run = costs.ROUNDS_RUN_S[f]
        beside[f"rounds child {f}"] = host + run
        done = max(done, costs.START_S + host) + run      # GPU work one child at a time, after liveness
    for part, end in (("liveness", gpu_free), ("rounds", done)):
        if part in work.parts:
            wait = max(0.0, end - reached[part])
            add(part, wait, f"waiting for the children (they end at ~{end:.0f} s of the run)")
    sec["end"] = costs.END_S
    return Prediction(sec, det, beside)
