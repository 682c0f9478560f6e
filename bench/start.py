"""A node's start: process start -> its decode steps ready, cold (empty build cache) and warm (the
cache a first start filled: megakernel/build_cache.py), per family and batch bucket.

    python bench/start.py [--only NAME ...] [--batches 1,8] [--write]                (CPU)
    python bench/start.py --device cuda --dry-run --out /tmp/start                  (the GPU path on the CPU)
    BENCH_OUT=$OUT python bench/start.py --device cuda --warm 1 --only whisper-tiny.en moondream2
    BENCH_OUT=$OUT python bench/start.py --device cuda --warm 1 --only qwen3.5-0.8b gemma4-e2b
                                                                                    (GPU, device tool)
On a GPU, a family's cold start is its builds (the first GPU run: Moondream 2 6-8 s at batch 1,
23-29 s at batch 8) plus a Triton compile per bucket (12-16 s each), its warm start seconds: two
or three families a call of the device tool (timeout_s 400), Moondream 2's at most ~90 s.

Every start is its own process (the parent spawns it and times it from before the spawn), with its
own PHOTON_CACHE_DIR: empty for the cold start, as the cold start left it for the warm ones.

CPU: what a start pays before the first launch that is not the interpreter: Python and the
imports, the step graph from the config (real sizes, each family's production context), then per
bucket what CompiledStep.kernel_for does: plan, the key, then lower + checker.check + encode +
store (cold) or the entry read (warm). No arena is allocated (the real ones take up to tens of GB
here): the weights' share of a start is given as the bf16 arena's bytes at the rate this machine
reads a 1 GiB safetensors file from the page cache into an arena (measured here; a disk read of a
checkpoint is slower, and the same cold or warm).

GPU (--device cuda): the real path per family: random weights of the real shapes on the device,
then per bucket CompiledStep (arena fill, kernel built or read), its first launch (Triton compiles,
or reads its own cache: TRITON_CACHE_DIR is emptied for the cold start too) and a second launch;
inside the step, lower / check / encode / read timed by wrapping them. Results go to
--out/start.json after each family and --out/start.md at the end. --dry-run runs this path on
the CPU with a tiny Whisper under the interpreter (a check of the script, not a measurement).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from photon_core.gpu_proof.results_file import replace_whole  # noqa: E402   (the standard library only)


def graphs() -> dict[str, Callable[[], Any]]:
    """name -> the family's step graph at real sizes and the context its decode compiles by default."""
    import roofline as r

    def moondream3() -> Any:
        from photon_core.models.moondream3.decoder_step import dims_of, step_graph
        return step_graph(dims_of(r.moondream3_config(), fp8=True), 4096)   # MEGAKERNEL_MAX_LEN

    def qwen3_asr() -> Any:
        from photon_core.models.qwen3_asr.decoder_step import step_graph
        return step_graph(r.qwen3_asr_dims("Qwen3-ASR 0.6B"), 2048)

    def qwen3_5() -> Any:
        from photon_core.models.qwen3_5.decoder_step import step_graph
        return step_graph(r.qwen3_5_config("Qwen 3.5 0.8B"), 8192, tied=True)

    return {"whisper-tiny.en": lambda: r.whisper("Whisper tiny.en", 384, 6, 4, vocab=51864).graph,
            "whisper-large-v3-turbo": lambda: r.whisper("Whisper large-v3-turbo", 1280, 20, 4).graph,
            "moondream2": lambda: r.moondream2().graph, "qwen3-asr-0.6b": qwen3_asr, "qwen3.5-0.8b": qwen3_5,
            "gemma4-e2b": lambda: r.gemma4_e2b(4096).graph, "moondream3": moondream3}


# Buckets the CPU run leaves out: Moondream 3's batch-8 step is 173k tasks (lowered in ~55 s here),
# whose proof ran past 9 minutes and 12 GB on this 2-core machine before it was stopped.
CPU_SKIPS = {"moondream3": (8,)}


def tiny_whisper() -> Any:
    """Whisper's step graph at toy sizes (--dry-run)."""
    import torch

    from photon_core.models.whisper.decoder_step import DecoderLayerWeights, WhisperDecoderWeights, step_graph

    def m(*shape: int) -> Any:
        return torch.empty(*shape, device="meta")
    d = 64
    layer = DecoderLayerWeights(m(d), m(d), m(3 * d, d), m(3 * d), m(d, d), m(d), m(d), m(d), m(d, d), m(d),
                                m(2 * d, d), m(2 * d), m(d, d), m(d), m(d), m(d), m(4 * d, d), m(4 * d),
                                m(d, 4 * d), m(d))
    return step_graph(WhisperDecoderWeights(m(96, d), m(16, d), [layer] * 2, m(d), m(d), 2), 16, 8, advance=True)


# ------------------------------------------------------------------------------- one start (child)


class Clock:
    """Seconds spent inside wrapped functions, by name (the parts of a build inside CompiledStep)."""

    def __init__(self) -> None:
        self.s: dict[str, float] = {}

    def wrap(self, owner: Any, attr: str, name: str) -> None:
        fn = getattr(owner, attr)

        def timed(*args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.s[name] = self.s.get(name, 0.0) + time.perf_counter() - t
        setattr(owner, attr, timed)


def build_cpu(graph: Any, batch: int) -> dict[str, float]:
    """CompiledStep.kernel_for's build of the whole step, without arenas (what the cache changes)."""
    import torch

    from photon_core.megakernel import build_cache
    from photon_core.megakernel.checker import check
    from photon_core.megakernel.compiler import Tiling, lower, plan
    parts: dict[str, float] = {}
    t = time.perf_counter()

    def lap(name: str) -> None:
        nonlocal t
        parts[name] = time.perf_counter() - t
        t = time.perf_counter()
    p = plan(graph, batch, Tiling())
    lap("plan")
    key = build_cache.entry_key(graph, batch, p.tiling, p.weight_dtype, p.kv_dtype, None, torch.device("cpu"))
    if key is None:
        raise RuntimeError("the build cache is off or cannot key this graph")
    lap("key")
    if build_cache.load(key) is not None:
        lap("read")
        return parts
    lap("miss")
    g = lower(p)
    lap("lower")
    check(g)
    lap("check")
    table = g.encode()
    lap("encode")
    build_cache.store(key, g, table)
    lap("store")
    return parts


def build_device(graph: Any, batch: int, dev: Any, shared: Any, clock: Clock) -> tuple[Any, dict[str, float]]:
    """CompiledStep on the device, then its first and second launch."""
    import torch

    from photon_core.megakernel.compiler import CompiledStep, Tiling
    parts: dict[str, float] = {}
    t = time.perf_counter()
    weights: dict[str, torch.Tensor] = {}
    if shared is None:   # random values of the real shapes (FP8 experts as FP8, their scales fp32)
        fp8 = graph.fp8_weights()
        g = torch.Generator(device=dev).manual_seed(0)
        for k, shape in graph.weight_shapes.items():
            w = torch.randn(*shape, generator=g, device=dev) * (0.02 if len(shape) > 1 else 0.1)
            if k in fp8:
                w = w.to(torch.float8_e4m3fn)
            elif k in fp8.values():   # row scales
                w = w.abs() + 1e-3
            weights[k] = w
    else:
        weights = {k: torch.empty(0) for k in graph.weight_shapes}
    torch.cuda.synchronize(dev) if dev.type == "cuda" else None
    parts["weights"] = time.perf_counter() - t
    before = dict(clock.s)
    t = time.perf_counter()
    step = CompiledStep(graph, weights, batch, Tiling(), torch.bfloat16, shared_weights=shared, device=dev,
                        kv_dtype=torch.bfloat16)
    parts["step"] = time.perf_counter() - t
    parts.update({k: v - before.get(k, 0.0) for k, v in clock.s.items()})
    del weights
    embeds = [n for n in graph.nodes if n.op == "embed"]
    step.set_step([0] * batch if embeds else None, [0] * batch)
    cross = [n.args["k"].spec.length for n in graph.nodes if n.op == "attention" and n.args["length"] == "cross"]
    if cross:
        step.set_cross_len([min(cross)] * batch)
    for launch in ("first_launch", "second_launch"):
        t = time.perf_counter()
        step.launch()
        torch.cuda.synchronize(dev) if dev.type == "cuda" else None
        parts[launch] = time.perf_counter() - t
    return step, parts


def child(name: str, device: str, batches: list[int], dry: bool) -> dict[str, Any]:
    t0 = float(os.environ["START_T0"])
    import torch

    from photon_core.megakernel import build_cache, checker, compiler
    from photon_core.megakernel.graph import TaskGraph
    out: dict[str, Any] = {"imports": time.time() - t0, "buckets": {}}
    graph = tiny_whisper() if dry else graphs()[name]()
    out["graph"] = time.time() - t0 - out["imports"]
    if device == "cpu":
        for b in batches:
            out["buckets"][b] = build_cpu(graph, b)
    else:
        clock = Clock()
        clock.wrap(compiler, "lower", "lower")
        clock.wrap(checker, "check", "check")
        clock.wrap(TaskGraph, "encode", "encode")
        clock.wrap(build_cache, "load", "read")
        clock.wrap(build_cache, "store", "store")
        dev = torch.device("cpu" if dry else "cuda")
        shared = None
        for b in batches:
            step, parts = build_device(graph, b, dev, shared, clock)
            shared = step.weights
            out["buckets"][b] = parts
    out["ready"] = time.time() - t0
    return out


# ------------------------------------------------------------------------------- the runs (parent)


def start(name: str, device: str, batches: list[int], env: dict[str, str], dry: bool) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--child", name, "--device", device, "--batches", ",".join(map(str, batches))]
    cmd += ["--dry-run"] * dry
    env = dict(env, START_T0=repr(time.time()))
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode:
        raise RuntimeError(f"{name}: the start failed:\n{done.stderr[-3000:]}")
    for line in done.stderr.splitlines():
        if "build cache" in line:   # a warning of build_cache's (the figures then say a build)
            print(f"{name}: {line}", file=sys.stderr)
    return json.loads(done.stdout.strip().splitlines()[-1])


def weights_rate() -> float:
    """Bytes a second this machine reads a 1 GiB bf16 safetensors file (just written, so from the
    page cache) into an arena."""
    import torch
    from safetensors.torch import load_file, save_file
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "w.safetensors"
        save_file({f"w{i}": torch.randn(2048, 8192).to(torch.bfloat16) for i in range(32)}, str(path))
        arena = torch.empty(32 * 2048 * 8192, dtype=torch.bfloat16)
        t = time.perf_counter()
        for i, w in enumerate(load_file(str(path)).values()):
            arena[i * w.numel():(i + 1) * w.numel()].copy_(w.view(-1))
        return arena.numel() * 2 / (time.perf_counter() - t)


def arena_bytes(name: str) -> int:
    import torch

    from photon_core.megakernel.compiler import Tiling, plan
    return plan(graphs()[name](), 1, Tiling(), torch.bfloat16).warena.size * 2


def table(results: dict[str, Any], device: str, rate: float | None) -> list[str]:
    cpu = device == "cpu"
    head = ("| family | bucket | start | imports + graph s | plan + key s | lower s | check s | encode s | "
            "store / read s | " + ("weights s (est.) | ready s |" if cpu else "weights s | step s | first launch s | ready s |"))
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for name, runs in results.items():
        for kind, run in runs.items():
            if kind == "arena_bytes":
                continue
            for b, p in run["buckets"].items():
                cells = [name, f"B{b}", kind, f"{run['imports'] + run['graph']:.1f}",
                         f"{p.get('plan', 0) + p.get('key', 0):.2f}", f"{p.get('lower', 0):.1f}",
                         f"{p.get('check', 0):.1f}", f"{p.get('encode', 0):.1f}",
                         f"{p.get('store', 0):.2f}" if kind == "cold" else f"{p.get('read', 0):.2f}"]
                if cpu:
                    cells += [f"{runs['arena_bytes'] / rate:.1f}" if rate else "", f"{run['ready']:.1f}"]
                else:
                    cells += [f"{p['weights']:.1f}", f"{p['step']:.1f}", f"{p['first_launch']:.1f}",
                              f"{run['ready']:.1f}"]
                lines.append("| " + " | ".join(cells) + " |")
    return lines


def family(name: str, device: str, batches: list[int], warm_starts: int, dry: bool) -> dict[str, Any]:
    """One cold start and `warm_starts` warm ones of `name`, on caches of their own."""
    with tempfile.TemporaryDirectory() as caches:
        env = dict(os.environ, PHOTON_BUILD_CACHE="1", PHOTON_CACHE_DIR=str(Path(caches) / "photon"),
                   TRITON_CACHE_DIR=str(Path(caches) / "triton"))
        if device == "cpu" or dry:
            env["TRITON_INTERPRET"] = "1"
        runs: dict[str, Any] = {"cold": start(name, device, batches, env, dry)}
        warm = [start(name, device, batches, env, dry) for _ in range(warm_starts)]
    runs["warm"] = min(warm, key=lambda r: r["ready"])
    built = [b for r in warm for b, p in r["buckets"].items() if p.get("lower")]
    if built:   # a warm start that built is the cache failing, not a figure
        raise RuntimeError(f"{name}: a warm start built buckets {built} (did photon_core/megakernel change in "
                           "between? Its sources are in the key: run from a snapshot, e.g. git archive HEAD)")
    if device == "cpu":
        runs["arena_bytes"] = arena_bytes(name)
    return runs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="*", help="families (default: all)")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--dry-run", action="store_true", help="--device cuda's path on the CPU, a tiny Whisper")
    ap.add_argument("--warm", type=int, default=2, help="warm starts per family (the fastest is reported)")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("BENCH_OUT", tempfile.gettempdir())))
    ap.add_argument("--write", action="store_true", help="replace this benchmark's section of bench/RESULTS.md")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    if args.child:
        print(json.dumps(child(args.child, args.device, batches, args.dry_run)))
        return 0
    names = ["whisper-tiny.en"] if args.dry_run else args.only or list(graphs())
    rate = weights_rate() if args.device == "cpu" else None
    results: dict[str, Any] = {}
    args.out.mkdir(parents=True, exist_ok=True)
    failed: dict[str, str] = {}
    for name in names:
        skip = CPU_SKIPS.get(name, ()) if args.device == "cpu" else ()
        try:
            results[name] = family(name, args.device, [b for b in batches if b not in skip], args.warm, args.dry_run)
        except Exception as e:  # noqa: BLE001  one family's failure (a CUDA error in its process) is recorded
            failed[name] = f"{type(e).__name__}: {e}"[-2000:]
            print(f"{name}: FAILED {failed[name]}", file=sys.stderr, flush=True)
        else:
            runs = results[name]
            print(f"{name}: cold {runs['cold']['ready']:.1f} s, warm {runs['warm']['ready']:.1f} s", flush=True)
        replace_whole(args.out / "start.json", json.dumps(dict(rate=rate, results=results, failed=failed), indent=1))
    from report import heading, publish
    where = "CPU" if args.device == "cpu" else "GPU path, a dry run on the CPU" if args.dry_run else "GPU"
    lines = heading(f"Start: process start to decode steps ready, cold and warm build cache ({where})") + [
        "Each start its own process, timed from before its spawn; cold: empty build cache (and Triton cache on a "
        "GPU), warm: the cache the cold start filled (the fastest of "
        f"{args.warm}). Real sizes at each family's default context; Tiling(); every bucket built in the one "
        "process, in order. " + (
            "CPU: no interpreter launch and no arena (kernel_for's build alone: plan, key, then lower + "
            "checker.check + encode + store, or the entry read); weights: the bf16 arena's bytes at the "
            f"rate this machine reads a page-cached safetensors file into an arena ({rate / 1e9:.1f} GB/s), "
            "an estimate, the same cold or warm, not in `ready`. Left out: "
            + "; ".join(f"{k} B{', B'.join(map(str, v))}" for k, v in CPU_SKIPS.items())
            + " (its proof takes more than 9 minutes and 12 GB on this machine)." if rate else
            "GPU: random weights of the real shapes on the device, CompiledStep (arena fill + kernel built or "
            "read), the first launch (Triton compile or its cache) and a second."), ""]
    lines += table(results, args.device, rate)
    lines += [f"\n{name} failed: {why}" for name, why in failed.items()]
    replace_whole(args.out / "start.md", "\n".join(lines) + "\n")
    publish(lines, args.write and args.device == "cpu")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
