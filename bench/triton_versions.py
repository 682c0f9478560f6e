"""The megakernel under every supported Triton, without a GPU: registers, spills and compile times
per variant, version and target, and the plan / lower / check times of real-size step graphs.

    python bench/triton_versions.py [--versions 3.3.1 3.6.0 pinned] [--arch 90 87 80] [--quick] [--write]

Users run the Triton their platform's torch brings (torch 2.7 -> 3.3 ... 2.10/2.11 -> 3.6); the
project pins a newer one. Each other version is installed from the package registry into a
directory of its own (side_install: ~/.cache/photon/triton-<version>, reused when present) and put
first on PYTHONPATH, so it shadows the venv's Triton while torch stays the venv's CPU build. Every
compile runs in a subprocess under that Triton (python -m photon_core.kernels.compile_check) and
ptxas -v of that version's bundled ptxas reports registers and spills. test_triton_versions.py
compiles a subset of this matrix in the test suite.

Variants (compile_check's names): the roofline's GPU tiling (64-column tiles, K step 128 / batch),
which the compile tests check, and Tiling() (what photon_core builds today: 32 columns, K step 64,
32 keys), at the head sizes of the families (64: Whisper, Moondream; 128: Qwen3; 256: Qwen 3.5;
512: Gemma 4's global layers), fp32 and bf16 weights, bf16 KV caches and FP8 experts.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "test"))

from side_install import side_install as install  # noqa: E402  (test/: the one side-install mechanism)

from photon_core.kernels.compile_check import compile_env  # noqa: E402

# Oldest supported (torch 2.7's) and the GPU machine's (torch 2.10 / 2.11); "pinned" is the venv's own.
VERSIONS = ("3.3.1", "3.6.0")
CACHE = Path(os.environ.get("PHOTON_TRITON_CACHE", Path.home() / ".cache" / "photon"))
ROOFLINE = ("megakernel_b1_fp32", "megakernel_b8_fp32", "megakernel_b1_bf16", "megakernel_b1_bf16_kvbf16_fp8")
TILING = tuple(f"megakernel_b{b}_bf16_kvbf16_n32_k64_t32_d{d}" for b in (1, 8) for d in (64, 128, 256, 512))
# Per target: everything on the H100 / H200 (sm_90); on the Orin (sm_87) what a 16 GB Orin runs
# (bf16 at batch 1, Moondream 3's FP8 variant), on the A100 (sm_80) Tiling() at head 64.
MATRIX = {90: ROOFLINE + TILING,
          87: ("megakernel_b1_bf16", "megakernel_b1_bf16_kvbf16_fp8", TILING[0]),
          80: (TILING[0], TILING[4])}
QUICK = {90: ("megakernel_b1_fp32", "megakernel_b8_bf16_kvbf16_n32_k64_t32_d64")}


def side_install(version: str, cache: Path = CACHE) -> Path:
    """A directory holding triton==version alone (test/side_install.py). --no-deps: nothing else may
    land there and shadow the venv's packages (Triton needs none of its own at compile time)."""
    return install(f"triton-{version}", [f"triton=={version}"], pip_args=("--no-deps",), cache=cache)


def imported_triton(side: Path | None) -> tuple[str, str]:
    """(version, file) of the triton a subprocess with compile_env(side) imports."""
    r = subprocess.run([sys.executable, "-c", "import triton; print(triton.__version__); print(triton.__file__)"],
                       env=compile_env(side), capture_output=True, text=True, timeout=120, check=True)
    version, path = r.stdout.split()[-2:]
    return version, path


def compile_cases(side: Path | None, cases: list[str], archs: list[int], cache_dir: Path, report: bool = True,
                  ptx: bool = False, usage: bool = False, loops: bool = False) -> subprocess.Popen:
    """Start compile_check on `cases` x `archs` under the side Triton, its kernel cache in cache_dir
    (options as compile_check's flags); its stdout is the JSON (finish)."""
    cmd = [sys.executable, "-m", "photon_core.kernels.compile_check", "--arch", *map(str, archs), "--cases", *cases]
    cmd += ["--report"] * report + ["--ptx"] * ptx + ["--usage"] * usage + ["--loops"] * loops
    return subprocess.Popen(cmd, env=compile_env(side, cache_dir), cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen, timeout: float) -> dict:
    out, err = proc.communicate(timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"compile_check failed ({proc.returncode}):\n{err[-4000:]}")
    return json.loads(out.strip().splitlines()[-1])


def graph_times(quick: bool) -> list[dict]:
    """plan, lower and check of real-size step graphs (meta tensors, bench/roofline.py's models):
    the host-side part of building a megakernel (pure Python), the same under every Triton."""
    import roofline

    from photon_core.megakernel.checker import check
    from photon_core.megakernel.compiler import Tiling, lower, plan
    # The GPU proof's core families at batch 1 and 8; the others at batch 1 (batch 8 of the larger
    # graphs takes minutes of this machine).
    models = [(roofline.whisper("Whisper tiny", 384, 6, 4), (1, 8))]
    if not quick:
        models += [(roofline.whisper("Whisper large-v3-turbo", 1280, 20, 4), (1, 8)), (roofline.moondream2(), (1, 8)),
                   (roofline.qwen3_asr("Qwen3-ASR 0.6B"), (1,)), (roofline.qwen3_5("Qwen 3.5 0.8B"), (1,)),
                   (roofline.gemma4_e2b(), (1,))]
        models += [(m, (1,)) for m in [roofline.moondream3()] if m is not None]
    rows = []
    for m, batches in models:
        for b in batches:
            t0 = time.perf_counter()
            p = plan(m.graph, b, Tiling())
            t1 = time.perf_counter()
            g = lower(p)
            t2 = time.perf_counter()
            check(g)
            t3 = time.perf_counter()
            rows.append(dict(model=m.name, batch=b, tasks=len(g.tasks), plan=t1 - t0, lower=t2 - t1, check=t3 - t2))
            print(f"{m.name} b{b}: {len(g.tasks)} tasks, plan {t1 - t0:.2f} s, lower {t2 - t1:.2f} s, "
                  f"check {t3 - t2:.2f} s", flush=True)
    return rows


def main() -> None:
    from report import heading, publish
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--versions", nargs="+", default=[*VERSIONS, "pinned"],
                    help="Triton versions ('pinned': the venv's)")
    ap.add_argument("--arch", type=int, nargs="+", default=[90, 87, 80])
    ap.add_argument("--quick", action="store_true", help=f"only {', '.join(QUICK[90])} on sm_90 (a smoke run)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="compiles at once (default: CPU count)")
    ap.add_argument("--write", action="store_true", help="replace this benchmark's section of bench/RESULTS.md")
    args = ap.parse_args()
    matrix = {a: cases for a, cases in (QUICK if args.quick else MATRIX).items() if a in args.arch}
    load = os.getloadavg()[0]
    sides, names, results = {}, {}, {}
    for v in args.versions:
        t0 = time.perf_counter()
        sides[v] = None if v == "pinned" else side_install(v)
        got, where = imported_triton(sides[v])
        if v != "pinned" and got != v:
            raise RuntimeError(f"PYTHONPATH={sides[v]} imported triton {got} from {where}, not {v}")
        names[v] = got
        results[v] = {}
        print(f"triton {got} from {where} (install or reuse: {time.perf_counter() - t0:.0f} s)", flush=True)
    # Jobs of a few variants each, --jobs at a time: Triton compiles one kernel at a time.
    jobs = [(v, a, list(cases[i:i + 3])) for v in args.versions for a, cases in matrix.items()
            for i in range(0, len(cases), 3)]
    running: list[tuple[str, subprocess.Popen]] = []
    cache = Path(tempfile.mkdtemp(prefix="photon-triton-cache-"))   # cold: compile times are real
    while jobs or running:
        while jobs and len(running) < args.jobs:
            v, a, cases = jobs.pop(0)
            running.append((v, compile_cases(sides[v], cases, [a], cache / v)))
        v, p = running.pop(0)
        got = finish(p, 6 * 3600)
        results[v].update(got["cases"])
        for k, r in got["cases"].items():
            print(f"  triton {got['triton']} {k}: {r['registers']} registers, {r['spill_stores']} B spilled, "
                  f"compile {r['seconds']:.1f} s, ptxas -v {r['ptxas_seconds']:.1f} s", flush=True)
    shutil.rmtree(cache, ignore_errors=True)
    results = {names[v]: r for v, r in results.items()}
    graphs = graph_times(args.quick)

    from photon_core.kernels import triton_versions
    lines = heading("Megakernel under each supported Triton (compile-only, no GPU)") + [
        "Registers per thread and bytes spilled (ptxas -v of each version's own ptxas) per megakernel variant, "
        "compiled in a subprocess under that Triton (side installs on PYTHONPATH, torch the venv's CPU build). "
        "Variants: roofline GPU tiling (64-column tiles, K step 128 / batch, 64 keys, head 64) and Tiling() "
        "(32 columns, K step 64, 32 keys) at head sizes 64-512, bf16 weights and KV; `_fp8`: FP8 experts. "
        "Launch options per version (photon_core/kernels/triton_versions.py): "
        + "; ".join(f"{v}: {triton_versions.megakernel_options(v)}" for v in results) + ". "
        f"Compile s: Triton's whole pipeline to a cubin, {args.jobs} compiles at once (load average "
        f"{load:.1f} when this run began: a shared machine; a GPU host's 16 cores compile variants in parallel).",
        "",
        "| variant | target | " + " | ".join(f"Triton {v}: regs / spill B / compile s" for v in results) + " |",
        "|---|---|" + "---:|" * len(results)]
    keys = list(dict.fromkeys(k for r in results.values() for k in r))
    for k in keys:
        name, target = k.split("@")
        cells = []
        for v in results:
            r = results[v].get(k)
            cells.append("—" if r is None else f"{r['registers']} / {r['spill_stores']} / {r['seconds']:.0f}")
        lines.append(f"| {name.removeprefix('megakernel_')} | {target} | " + " | ".join(cells) + " |")
    lines += ["", "Host side of building a megakernel at real sizes (Tiling(), meta tensors; the same under every "
              "Triton): plan, lower to the task table, check (the dependency proof).", "",
              "| model | batch | tasks | plan s | lower s | check s |", "|---|---:|---:|---:|---:|---:|"]
    for r in graphs:
        lines.append(f"| {r['model']} | {r['batch']} | {r['tasks']} | {r['plan']:.2f} | {r['lower']:.2f} | "
                     f"{r['check']:.2f} |")
    publish(lines, args.write)


if __name__ == "__main__":
    main()
