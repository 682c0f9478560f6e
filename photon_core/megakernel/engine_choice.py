"""Which engine runs a compiled step on this GPU: the megakernel or the per-op engine, by measurement.

Issue 38.4: on CUDA, backend "auto" must never decode slower than the simple path. The first GPU run
measured the megakernel 1.6-5.3x slower than transformers in one CUDA graph, which is what the per-op
engine (perop_engine.py) runs. So when a bucket's step is built under the "auto" policy
(runtime.decode.CompiledSteps), both engines are timed as decode runs them: a CUDA graph of
`LAUNCHES` launches, captured after a warm-up and replayed `REPEATS` times (median), every row at
half the caches' length (where attention costs what a typical request's does) and cross attention
over its whole cache, all of it restored after. Moondream 2 B8's megakernel at 17.5 ms a step costs ~0.25 s; builds aside, well
under a second. The faster engine runs the step. An engine that fails to build or launch (a Triton
that cannot compile the megakernel, a CUDA error) is not chosen, with the reason in the record;
both failing raise.

Besides the plain megakernel, a step with bf16 (or fp16) weights (FP8 experts or not) also times the
megakernel's streaming build for its batch (STREAMING: wide512+aligned at batch 1, unroll8+aligned
above): the same task table, K loops compiled to keep 32 / 16-32 KB of weights in flight a program
where the plain build keeps 4 / 2 KB (their SASS: bench/RESULTS.md "Megakernel K loop from the
SASS"; the cost model predicts 1.9 ms for Moondream 2 at batch 1 against the plain build's 7.2).
Which is faster on a given GPU is measured, never assumed, and the streaming build must first compute
what the plain build does from the same state (same_as_plain: one launch each); it costs one more
Triton compile (12-16 s on an H200's host) at the first start only, and is chosen only where it
wins. A streaming build that fails (no compile, other values) while both engines run is recorded
as failed, so no later start compiles it again.

The per-op engine runs fp32 or bf16 weights (fp16 inputs to its GEMMs could overflow: an fp16 step
times the megakernel's builds only) and is timed in two builds too: "plain" (torch's kernels: its
vendor GEMMs, SDPA over the whole cache, norms as several kernels) and "chained" (linears, norms,
rotary appends and attention as kernels/chained.py's Triton kernels, one launch an op, chained by
programmatic dependent launch on sm_90+: each launch starts, and issues its weight loads, while the
one before it finishes). The chained build must compute what the plain one does (same_as_plain).

The choice is kept beside the build cache (build_cache.py: same folder, same key, i.e. graph,
bucket, tiling, dtypes, code, Triton and torch versions, GPU) as `<key>.engine.json`, written
atomically; the next start reads it and builds only the chosen engine (a per-op choice lowers and
compiles no megakernel). An unreadable record is measured again with a warning. Off the GPU nothing
is measured (the interpreter is a test mode): "auto" runs the megakernel there.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import statistics
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from photon_core.megakernel import build_cache
from photon_core.megakernel.compiler import ENGINES, PEROP_VARIANTS
from photon_core.megakernel.kernel import KernelVariant
from photon_core.runtime.decode import EngineChoice, engine_label

if TYPE_CHECKING:
    from photon_core.megakernel.compiler import CompiledStep

log = logging.getLogger(__name__)

LAUNCHES, REPEATS = 2, 5
# The megakernel's streaming build per batch (kernel.KernelVariant names), timed beside the plain one.
STREAMING = {1: "wide512+aligned"}
STREAMING_ABOVE_1 = "unroll8+aligned"
_measuring = threading.Lock()   # one measurement at a time: two at once would time each other
Timer = Callable[["CompiledStep"], float]   # ms per step of the step's current engine (and variant)


def candidates(step: "CompiledStep") -> list[tuple[str, str]]:
    """(engine, variant) pairs to time for `step`: the plain megakernel and the per-op engine, and
    for 16-bit weights the megakernel's streaming build. FP8 experts included. The streaming builds
    stream the expert tasks in wide steps too (kernel.expert_loop: the running Triton's bytes of an
    expert row a step per batch, 16 KB a program a trip at batch 1; FP8 two halves loaded before
    either is decoded; each step reduced only by the rows that chose the expert), where the plain
    build's FP8 trip is 1 KB at batch 1 and 0.5 KB at batch 8 (sm_90, bench/RESULTS.md "Megakernel
    K loop from the SASS": no spill inside any K loop under Triton 3.6 or 3.9)."""
    out = [("megakernel", "plain")]
    if step.plan.weight_dtype in (torch.bfloat16, torch.float16):
        out.append(("megakernel", STREAMING.get(step.batch, STREAMING_ABOVE_1)))
    if step.plan.weight_dtype != torch.float16:      # the per-op engine runs fp32 or bf16 weights
        out += [("perop", "plain"), ("perop", "chained")]
    return out


def replay_ms(step: "CompiledStep", launches: int = LAUNCHES, repeats: int = REPEATS) -> float:
    """Median ms per launch of the step's current engine, as CUDA-graph replays of `launches`
    launches at rows in the middle of the caches; the step's state is restored after."""
    from photon_core.megakernel.decode_loop import restoring
    from photon_core.runtime.cuda_graph import capture
    kernel = step.kernel_for(None)
    # on the step's GPU: on another one the graph and its events would time nothing of the step's
    with torch.cuda.device(step.state.device), typical_rows(step):
        with restoring(step, launches * (repeats + 2)):
            def run() -> None:
                for _ in range(launches):
                    kernel.launch()
            graph, _ = capture(run, warmup=1)
            graph.replay()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            times = []
            for _ in range(repeats):
                start.record()
                graph.replay()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / launches)
            kernel.raise_on_error()
    return statistics.median(times)


@contextlib.contextmanager
def typical_rows(step: "CompiledStep") -> Iterator[None]:
    """Every row at half the caches' length, cross attention over its whole cache (an encoder's
    output fills it: the megakernel reads only a row's keys, the plain per-op engine every slot,
    so zero keys would flatter the megakernel); dyn put back after."""
    B, g = step.batch, step.graph_def
    dyn = step.dyn.clone()
    step.dyn[B:2 * B] = step.plan.max_position // 2
    cross = [n.args["k"].spec.length for n in g.nodes if n.op == "attention" and n.args["length"] == "cross"]
    if cross:
        step.dyn[2 * B:3 * B] = min(cross)
    try:
        yield
    finally:
        step.dyn.copy_(dyn)


def record_path(step: "CompiledStep") -> Path | None:
    folder = build_cache.cache_dir()
    key = build_cache.entry_key(step.graph_def, step.batch, step.tiling, step.plan.weight_dtype, step.plan.kv_dtype,
                                None, step.state.device)
    return None if folder is None or key is None else folder / f"{key}.engine.json"


_TIMES = ("megakernel_ms", "perop_ms", "variant_ms", "chained_ms")


def _read(path: Path | None) -> dict | None:
    if path is None:
        return None
    try:
        if not path.is_file():   # inside: a folder this process may not open raises, a miss all the same
            return None
        rec = json.loads(path.read_text())
        if not isinstance(rec, dict):
            raise ValueError(f"a {type(rec).__name__}, not an object")
        for k in _TIMES:
            if not (rec.get(k) is None or type(rec[k]) in (int, float)):
                raise ValueError(f"{k} {rec[k]!r}")
        for k in ("note", "timed_variant"):
            if not isinstance(rec.get(k, ""), str):
                raise ValueError(f"{k} {rec[k]!r}")
        if rec.get("engine") not in ENGINES:
            raise ValueError(f"engine {rec.get('engine')!r}")
        variant = rec.setdefault("variant", "plain")   # a record before variants: the plain build
        if rec["engine"] == "perop":
            if variant not in PEROP_VARIANTS:
                raise ValueError(f"per-op variant {variant!r}")
        else:
            KernelVariant.parse(variant)
        return rec
    except Exception as e:  # noqa: BLE001  whatever is wrong with it, a measurement replaces it
        log.warning("decode engine record %s unreadable (%s: %s); measuring again", path, type(e).__name__, e)
        return None


def _write(path: Path | None, rec: dict) -> None:
    if path is None:
        return
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump(rec, f)
        os.replace(tmp, path)
        tmp = None
    except OSError as e:   # the choice stands; only the next start measures again
        log.warning("decode engine record %s not written (%s)", path, e)
    finally:
        if tmp is not None:   # a full disk: no half-written record left behind a start
            Path(tmp).unlink(missing_ok=True)


def choose(step: "CompiledStep", timer: Timer | None = None) -> EngineChoice:
    """Put `step` on the faster engine for this GPU (recorded, or measured now by `timer`,
    default replay_ms) and say which and why."""
    name, B = step.graph_def.name, step.batch
    if timer is None and step.state.device.type != "cuda":
        step.set_engine("megakernel")
        return EngineChoice(name, B, "megakernel", "asked", note="nothing measured off a GPU")
    path = record_path(step)
    rec = _read(path)
    if rec is not None:
        try:
            step.set_engine(rec["engine"], rec["variant"])
            choice = EngineChoice(name, B, rec["engine"], "recorded", rec.get("megakernel_ms"), rec.get("perop_ms"),
                                  rec.get("note", ""), rec["variant"], rec.get("variant_ms"), rec.get("timed_variant", ""),
                                  rec.get("chained_ms"))
            log.info("%s B%d decodes on %s", name, B, choice.line())
            return choice
        except Exception as e:  # noqa: BLE001  what ran before no longer builds: measure both again
            log.warning("%s B%d: the recorded %s engine failed (%s: %s); measuring again", name, B, rec["engine"],
                        type(e).__name__, e)
    with _measuring:
        return _measure(step, path, timer)


def _links(step: "CompiledStep") -> bool:
    """Whether the per-op engine's chained build launches by PDL on this step's device."""
    from photon_core.kernels.chained import pdl_for
    return pdl_for(step.state.device)


def same_as_plain(step: "CompiledStep", variant: str, tolerance: float = 1e-3, engine: str = "megakernel") -> None:
    """Raise unless one launch of `engine` built as `variant` computes what its plain build does
    from the same state (every exposed value within `tolerance` of its largest, the same picks): a
    build that only its timing would judge could be fast and wrong on a Triton or GPU the tests
    never compiled it for. The state is restored after both launches."""
    from photon_core.megakernel.decode_loop import restoring
    got = []
    for v in ("plain", variant):
        step.set_engine(engine, v)
        with restoring(step, 1):
            step.kernel_for(None).launch()
            step.kernel_for(None).raise_on_error()
            got.append(({k: step.view(k).clone() for k in step.graph_def.exposed},
                        {r: step.result(r).tolist() for r in step.graph_def.results}))
    (plain, plain_picks), (mine, picks) = got
    for key, want in plain.items():
        barred = ~torch.isfinite(want)       # a logit rule's -inf columns: the same, exactly
        ok = torch.equal(mine[key][barred].nan_to_num(), want[barred].nan_to_num())
        err = ((mine[key][~barred] - want[~barred]).abs().max() / want[~barred].abs().max().clamp_min(1e-12)).item() \
            if (~barred).any() else 0.0
        if not ok or not err <= tolerance:
            raise RuntimeError(f"the {variant} build's {key} differs from the plain build's ({err:.1e} of its largest)")
    exposed_as = {id(v): k for k, v in step.graph_def.exposed.items()}
    for node in step.graph_def.nodes:
        if node.op != "argmax":
            continue
        a = node.args
        name, exposed = a["name"], exposed_as.get(id(a["x"]))
        scores = None if exposed is None else plain[exposed][:, a["c0"]:a["c1"]]
        if not picks_agree(plain_picks[name], picks[name], scores, tolerance):
            raise RuntimeError(f"the {variant} build picks {name} {picks[name]}, the plain build {plain_picks[name]}")


def _tolerance(step: "CompiledStep", engine: str) -> float:
    """How far a build may be from its plain build's values (of their largest): 1e-3, the rounding of
    sums, except where the plain per-op build rounds to bf16 what the chained one keeps in fp32:
    its attention with bf16 caches (q and the output in the caches' dtype, 2^-9 each): 1e-2; on
    the CPU its GEMMs' outputs with bf16 weights too: 2e-2 (bf16's rounding over a step)."""
    from photon_core.megakernel.perop_engine import rounds_outputs
    if engine != "perop":
        return 1e-3
    if rounds_outputs(step.state.device, step.weights.dtype):
        return 2e-2
    return 1e-2 if step.plan.kv_dtype != torch.float32 else 1e-3


def picks_agree(want: list[int], got: list[int], scores: torch.Tensor | None, tolerance: float) -> bool:
    """Whether two builds' argmax picks (one a row) agree: the same, or, where they differ, a tie
    within `tolerance` of the largest score in the plain build's own `scores` of that argmax ([rows,
    columns]; None: not exposed, so only the same picks agree). Rounding may break a near tie either
    way (a state whose logits are flat, as at a step's first launch, has many), and refusing the
    build for it would cost its speed for nothing. Markers (negative picks: NaN, a full context)
    agree only when the same."""
    if want == got:
        return True
    if scores is None or len(want) != len(got):
        return False
    finite = scores[torch.isfinite(scores)]
    scale = finite.abs().max().item() if finite.numel() else 0.0
    for row, (w, g) in enumerate(zip(want, got)):
        if w == g:
            continue
        if w < 0 or g < 0:
            return False
        if not abs(scores[row, w].item() - scores[row, g].item()) <= tolerance * max(scale, 1e-12):
            return False
    return True


def _measure(step: "CompiledStep", path: Path | None, timer: Timer | None) -> EngineChoice:
    name, B = step.graph_def.name, step.batch
    times: dict[tuple[str, str], float] = {}
    failed: dict[str, str] = {}
    tried = candidates(step)
    streaming = next((v for (e, v) in tried if e == "megakernel" and v != "plain"), None)

    def attempt(engine: str, variant: str) -> None:
        try:
            if variant != "plain":     # checked where it is timed: the rows mid-cache, cross keys full
                with typical_rows(step):
                    same_as_plain(step, variant, _tolerance(step, engine), engine=engine)
            step.set_engine(engine, variant)
            times[engine, variant] = (timer or replay_ms)(step)
        except Exception as e:  # noqa: BLE001  another engine may still run the step
            label = engine_label(engine, variant)
            failed[label] = f"{type(e).__name__}: {e}"
            log.warning("%s B%d: the %s engine failed (%s)", name, B, label, failed[label])

    for engine, variant in tried:
        attempt(engine, variant)
    if engine_label("perop", "chained") in failed and _links(step):
        # PDL is an optimisation: its launches failing (a Triton or driver that cannot capture
        # them) leaves the same kernels as ordinary launches
        tried.append(("perop", "chained-unlinked"))
        attempt("perop", "chained-unlinked")
    if not times:
        raise RuntimeError(f"{name} B{B}: no decode engine runs here: {failed}")
    best, variant = min(times, key=times.__getitem__)
    step.set_engine(best, variant)
    note = "; ".join(f"{k} failed: {v}"[:300] for k, v in failed.items())
    choice = EngineChoice(name, B, best, "measured" if not failed else "fallback", times.get(("megakernel", "plain")),
                          times.get(("perop", "plain")), note, variant,
                          times.get(("megakernel", streaming)) if streaming else None, streaming or "",
                          times.get(("perop", "chained"), times.get(("perop", "chained-unlinked"))))
    rec = dict(engine=best, variant=variant, megakernel_ms=choice.megakernel_ms, perop_ms=choice.perop_ms,
               variant_ms=choice.variant_ms, timed_variant=choice.timed_variant, chained_ms=choice.chained_ms,
               note=note)
    log.info("%s B%d decodes on %s", name, B, choice.line())
    # A failure may be passing (memory, a busy GPU): measured again at the next start. Not so a
    # build beside a plain one (the megakernel's streaming build, the per-op engine's chained one)
    # failing while both engines' plain builds ran: a build that does not compile or computes
    # otherwise here will not next time either, and retrying costs a compile a start.
    builds = {engine_label(e, v) for e, v in tried if v != "plain"}
    plains = {(e, v) for e, v in tried if v == "plain"}
    if not failed or set(failed) <= builds and plains <= set(times):
        _write(path, rec)
    return choice


__all__ = ["choose", "candidates", "same_as_plain", "picks_agree", "replay_ms", "record_path", "LAUNCHES", "REPEATS", "STREAMING",
           "STREAMING_ABOVE_1"]
