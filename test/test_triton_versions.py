"""The kernels under the older Tritons users have, not only the pinned one: the oldest supported
(3.3.1, torch 2.7's) and the GPU machine's (3.6.0, torch 2.10 / 2.11).

Each version is installed from the package registry into a directory of its own (~/.cache/photon,
reused when present; bench/triton_versions.side_install, test/side_install.py) and put first on PYTHONPATH of a
subprocess, so it shadows the venv's Triton while torch stays the venv's CPU build. A failed
install fails the test: it needs the registry, as scripts/setup.sh does.

A megakernel compile takes 15-60 s on 2 cores, so each version compiles a representative subset
(the whole matrix, every variant x sm_80/87/90, is bench/triton_versions.py):
* 3.6.0, sm_90 (the H200 machine): the per-op decode attention kernels (3.6 does not make a str
  default a constexpr: their CACHE argument), the megakernel at batch 8 (roofline tiling, fp32
  weights: the variant that spilled most there before the per-version launch options) and the
  wide512+aligned build at batch 1 (its K loop's bytes in flight, from the SASS) and the
  unroll8+aligned build with FP8 experts at batch 8 (Moondream 3's streaming build: its expert
  steps, the tuning table's for 3.4-3.7), and the default build with FP8 experts at batch 1 (its
  expert loops' loads).
* 3.3.1, sm_87 (a Jetson Orin on an older torch): the same per-op kernels and the megakernel in bf16
  at batch 1 (what a 16 GB Orin runs; where 3.3 needs triton_versions' narrower weight tile).
  sm_80 compiles the per-op kernels.
Each megakernel build must show the PTX properties test_kernels_compile_sm90.py checks under the
pinned version and keep every value in registers (no stack: no spill). The CPU interpreter runs a
compiled step under each version too (before 3.7 it needs photon_core's fix for NumPy >= 2.4).
"""
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

# Compiles and interpreter runs go to subprocesses with their own environments; in this process
# triton is only imported, as an interpreter, like the other test modules import it.
os.environ["TRITON_INTERPRET"] = "1"  # must precede the first import of triton (the kernels it defines)

import pytest  # noqa: E402

from test_kernels_compile_sm90 import (assert_claims_relaxed_and_header_before_branches,  # noqa: E402
                                       assert_experts_stream, assert_no_spills, assert_vector_weight_loads,
                                       assert_waits_acquire_and_signals_release)

from photon_core.kernels.compile_check import compile_env  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PER_OP = ["attn_decode_partial", "attn_decode_partial_gqa", "attn_decode_merge"]
PLAN = {   # version -> [(cases, targets)]
    "3.6.0": [(PER_OP + ["chained_linear", "chained_attention", "chained_moe_up", "megakernel_b8_fp32", "megakernel_b1_bf16_n32_k64_t32_d64_wide512_aligned",
                         "megakernel_b8_bf16_kvbf16_fp8_n32_k64_t32_d64_unroll8_aligned", "megakernel_b1_bf16_kvbf16_fp8"],
               [90])],
    "3.3.1": [(PER_OP + ["chained_linear_orin", "megakernel_b1_bf16"], [87]), (PER_OP, [80])],
}
# Triton's kernel cache: 3.6's key holds the global constexprs a kernel reads (the megakernel's
# per-version tile budgets), so its builds go to Triton's own cache, as the pinned version's do in
# test_kernels_compile_sm90 and test_megakernel_variants: a run after no kernel edit loads them
# (~90 s of compiles on 2 cores otherwise) and every check still reads the PTX, cubin and SASS of
# the current source. 3.3's key misses those globals: 3.3.1 compiles into a fresh cache every run.
FRESH_CACHE = {"3.3.1"}
INTERPRETED = "test/test_megakernel_compiler.py::test_compiled_step_equals_the_eager_graph[1-True-tiling0-rms]"


def _bench():
    spec = importlib.util.spec_from_file_location("triton_versions_bench", ROOT / "bench" / "triton_versions.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Per version: (imported version, compile JSON, interpreter run's return code and output). The
    compiles and interpreter runs of both versions go side by side (one core each), each version's
    builds in Triton's own kernel cache or a fresh one (FRESH_CACHE)."""
    bench = _bench()
    fresh = tmp_path_factory.mktemp("triton-cache")
    cache = {v: fresh / v if v in FRESH_CACHE else None for v in PLAN}   # None: Triton's own
    sides = {v: bench.side_install(v) for v in PLAN}
    procs = {v: [bench.compile_cases(sides[v], cases, archs, cache[v], report=False, ptx=True, usage=True, loops=True)
                 for cases, archs in PLAN[v]]
             for v in PLAN}
    env = {v: dict(compile_env(sides[v], cache[v]), TRITON_INTERPRET="1") for v in PLAN}
    interp = {v: subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", INTERPRETED],
                                  env=env[v], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
              for v in PLAN}
    out = {}
    try:
        imported = {v: bench.imported_triton(side) for v, side in sides.items()}   # while they run
        for v in PLAN:
            cases = {}
            for p in procs[v]:
                cases.update(bench.finish(p, 900)["cases"])
            text, _ = interp[v].communicate(timeout=900)
            out[v] = dict(side=sides[v], imported=imported[v], cases=cases, interp=(interp[v].returncode, text))
    finally:   # a failure or the test timeout leaves nothing running
        for p in [p for ps in procs.values() for p in ps] + list(interp.values()):
            p.kill()
    return out


@pytest.mark.parametrize("version", list(PLAN))
def test_the_side_install_shadows_the_pinned_triton(runs, version):
    got, path = runs[version]["imported"]
    assert got == version and Path(path).is_relative_to(runs[version]["side"]), (got, path)


@pytest.mark.parametrize("version", list(PLAN))
def test_every_planned_kernel_compiles(runs, version):
    cases = runs[version]["cases"]
    for names, archs in PLAN[version]:
        for name in names:
            for arch in archs:
                assert cases[f"{name}@sm_{arch}"]["cubin"] > 0, (version, name, arch)


@pytest.mark.parametrize("version", list(PLAN))
def test_megakernel_ptx_properties_hold(runs, version):
    mega = {k: r for k, r in runs[version]["cases"].items() if k.startswith("megakernel")}
    assert mega
    for key, rec in mega.items():
        ptx = rec["ptx"]
        assert_waits_acquire_and_signals_release(key, ptx)
        assert_claims_relaxed_and_header_before_branches(key, ptx)
        assert_vector_weight_loads(key, ptx)


@pytest.mark.parametrize("version", list(PLAN))
def test_megakernel_keeps_every_value_in_registers(runs, version):
    mega = {k: r for k, r in runs[version]["cases"].items() if k.startswith("megakernel")}
    assert mega
    for key, rec in mega.items():
        assert_no_spills(f"triton {version} {key}", rec)


def test_the_streaming_build_keeps_32_kb_in_flight_under_the_gpu_machines_triton(runs):
    """Triton 3.6 (the H200 machine's; 8 warps, one program an SM): the wide512+aligned build's dense
    K loop issues 32 KB of weights a program as 16-byte loads before it uses the first (its SASS,
    sass_loops), as under the pinned version (test_megakernel_variants.py)."""
    rec = runs["3.6.0"]["cases"]["megakernel_b1_bf16_n32_k64_t32_d64_wide512_aligned@sm_90"]
    from photon_core.kernels.sass_loops import dense_loop
    worst = dense_loop(rec["k_loops"])
    assert worst["in_flight_bytes"] * rec["threads"] >= 32 * 1024 and set(worst["loads"]) == {"LDG.E.128"}, worst


def test_the_experts_stream_in_the_tables_steps_under_the_gpu_machines_triton(runs):
    """Triton 3.6, batch 8, FP8 experts (unroll8+aligned, what backend auto times above batch 1): the
    expert tasks' K loops (MoE up and down) issue the tuning's bytes of an expert row a step at 32
    columns (kernel.expert_loop; 512: 16 KB a program) as 16-byte loads before using the first, and
    no K loop, dense or expert, spills inside a trip (the plain loop's FP8 trip is 0.5 KB)."""
    from photon_core.kernels.triton_versions import megakernel_tuning
    name = "megakernel_b8_bf16_kvbf16_fp8_n32_k64_t32_d64_unroll8_aligned@sm_90"
    assert_experts_stream(name, runs["3.6.0"]["cases"][name], megakernel_tuning("3.6.0").fp8_expert_bytes[3])


def test_the_default_builds_fp8_experts_load_16_bytes_under_the_gpu_machines_triton(runs):
    """Triton 3.6, batch 1, the default (plain loop) build with FP8 experts: the expert tasks' K loops
    load 16 bytes a thread (LDG.E.128, SASS) and spill nothing in a trip. Their weight tile was half
    of the 8-warp weight budget, 2 KB over 256 threads: 8-byte loads (issue 38's list of 3.6 defects;
    MegakernelTuning.fp8_weight_tile)."""
    from photon_core.kernels.sass_loops import expert_loops
    rec = runs["3.6.0"]["cases"]["megakernel_b1_bf16_kvbf16_fp8@sm_90"]
    loops = expert_loops(rec["k_loops"])
    assert {lp["task"] for lp in loops} == {"_task_moe_up", "_task_moe_down"}, rec["k_loops"]
    for lp in loops:
        assert set(lp["loads"]) == {"LDG.E.128"} and lp["local"] == 0, lp


def test_the_chained_kernels_chain_under_the_gpu_machines_triton_and_compile_without_gdc(runs):
    """The per-op engine's chained kernels: Triton 3.6 (the H200 machine's) emits the programmatic
    launch's wait and go; 3.3.1 has no gdc and builds the kernel without them (kernels/chained.py)."""
    for name in ("chained_linear", "chained_attention", "chained_moe_up"):
        ptx = runs["3.6.0"]["cases"][f"{name}@sm_90"]["ptx"]
        assert 0 < ptx.find("griddepcontrol.wait") < ptx.find("griddepcontrol.launch_dependents"), name
    assert "ld.global.v4.b32" in runs["3.6.0"]["cases"]["chained_moe_up@sm_90"]["ptx"]    # FP8: 16 bytes a load
    assert "griddepcontrol" not in runs["3.3.1"]["cases"]["chained_linear_orin@sm_87"]["ptx"]


@pytest.mark.parametrize("version", list(PLAN))
def test_the_interpreter_runs_a_compiled_step(runs, version):
    code, text = runs[version]["interp"]
    assert code == 0 and "1 passed" in text, text[-4000:]


def test_the_chained_kernels_compile_under_triton_3_4_without_its_broken_gdc():
    """Triton 3.4 (torch 2.8's) has gdc, but its gdc_wait takes `_builder` where its frontend passes
    `_semantic` (triton-lang/triton#7377): every chained kernel failed to compile on an H100, and
    auto's per-op candidate with it. There they launch without PDL (chained.HAS_GDC False)."""
    bench = _bench()
    side = bench.side_install("3.4.0")
    assert bench.imported_triton(side)[0] == "3.4.0"
    out = bench.finish(bench.compile_cases(side, ["chained_gated", "chained_linear"], [90], None, report=False,
                                           ptx=True), 600)
    for name in ("chained_gated", "chained_linear"):
        rec = out["cases"][f"{name}@sm_90"]
        assert rec["cubin"] > 0 and "griddepcontrol" not in rec["ptx"], name
