"""The megakernel's weight-streaming K loop as compiled, per build variant and Triton version, read
from the SASS (no GPU), and what the cost model predicts each would take on the H200.

    python bench/k_loops.py [--versions 3.6.0 pinned] [--write]

Each variant is compiled for sm_90 in a subprocess under that Triton (`python -m
photon_core.kernels.compile_check --loops --usage`, side installs as bench/triton_versions.py);
photon_core/kernels/sass_loops.py reads the dense linear tasks' K loop (`_task_linear`) out of the
cubin: its weight loads by width, bytes a trip, bytes issued before the first of them is used (in
flight; in a software-pipelined loop, whose weights are copied into shared memory (cp.async), the
later trips' copies still in flight while a trip waits for its own), barriers and shared-memory
instructions inside a trip; a program moves `threads` times the per-thread figures.

Predictions: the cost model (photon_core/megakernel/cost_model.py, fitted to the first H200 run,
whose build is the plain variant under Triton 3.6) with each variant's trip in its own terms: a
trip moves W bytes a program with F of them in flight at once, so it covers W / W0 of the measured
build's K step (W0: the plain build's bytes a trip under 3.6) and takes W / F latencies
(k_step_scale = W / W0, tiles_in_flight = F / W); the programs per version as each launches them
(one an SM under 3.6, two under 3.9; one where a build's shared memory fits no more:
kernel.programs_per_sm); row statistics STATS_TILE elements a trip, as the builds
since that run read them (kernel.STATS_TILE: the plain rows are today's default build, not the
measured one), and in the aligned builds a linear stage's merged from its tiles' partials in one
trip (kernel.STATS_TILES). The model's other constants are unchanged, so the rows
differ only by what the K loop does (the static builds' rows also by their schedule, and by a
guessed per-task time: cost_model.STATIC_TASK); read them as +-15% and as the model's, until a GPU measures
the variants (bench/gpu_timeline.py).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

# Tiling() at head 64 (Moondream 2, Whisper), bf16 weights, fp32 KV: the builds the first run timed.
BASE = {1: "megakernel_b1_bf16_n32_k64_t32_d64", 8: "megakernel_b8_bf16_n32_k64_t32_d64"}
VARIANTS = {1: ("", "_aligned", "_unroll4_aligned", "_wide256_aligned", "_wide512_aligned", "_wide512_aligned_static",
                "_pipe4_aligned", "_pipe8_aligned", "_dot64_pipe4"),
            8: ("", "_unroll4_aligned", "_unroll8_aligned", "_unroll8_aligned_static", "_wide256_aligned",
                "_pipe15_aligned")}
# Builds with FP8 experts (Moondream 3 preview's), bf16 KV: their expert loops and what they cost the kernel.
FP8_BASE = {1: "megakernel_b1_bf16_kvbf16_fp8_n32_k64_t32_d64", 8: "megakernel_b8_bf16_kvbf16_fp8_n32_k64_t32_d64"}
FP8_VARIANTS = {1: ("", "_wide512_aligned"), 8: ("", "_unroll8_aligned")}
# Today's Tiling() (64 keys a step) with bf16 KV (CUDA's default): the attention key loop per build.
ATTN_BASE = {1: "megakernel_b1_bf16_kvbf16_n32_k64_t64_d64", 8: "megakernel_b8_bf16_kvbf16_n32_k64_t64_d64"}
ATTN_VARIANTS = {1: ("", "_wide512_aligned"), 8: ("", "_unroll8_aligned")}
MEASURED = "3.6.0"     # the Triton of the run the model is fitted to


def compile_all(versions: list[str]) -> dict[str, dict]:
    """version -> compile_check's JSON for every case, both versions compiling side by side."""
    import triton_versions as tv
    cases = ([BASE[b] + v for b in VARIANTS for v in VARIANTS[b]] + [FP8_BASE[b] + v for b in FP8_VARIANTS
                                                                     for v in FP8_VARIANTS[b]]
             + [ATTN_BASE[b] + v for b in ATTN_VARIANTS for v in ATTN_VARIANTS[b]])
    cache = Path(tempfile.mkdtemp(prefix="photon-kloops-"))
    procs = {}
    for v in versions:
        side = None if v == "pinned" else tv.side_install(v)
        cmd_cases = list(cases)
        procs[v] = tv.compile_cases(side, cmd_cases, [90], cache / v, report=False, usage=True, loops=True)
    return {v: tv.finish(p, 4 * 3600) for v, p in procs.items()}


from photon_core.kernels.sass_loops import dense_loop, dense_loops, expert_loops, streaming_bytes  # noqa: E402
from photon_core.megakernel.kernel import STATS_TILE, STATS_TILES, programs_per_sm  # noqa: E402  (STATS_*: the builds since that run read statistics so)

H200_SHARED_PER_SM = 228 * 1024


def predictions(per_program: dict[tuple[str, int, str], tuple[int, int, int]]) -> dict:
    """(version, batch, variant) -> {model: us} from each build's (W, F) bytes a program a trip and
    its resident programs."""
    import cost_model as cmb

    from photon_core.megakernel import cost_model as cm
    gs = cmb.graphs()
    out = {}
    for (version, batch, variant), (w, f, programs) in per_program.items():
        w0 = per_program[(MEASURED, batch, "")][0]
        m = replace(cm.FITTED, tiles_in_flight=f / w, programs=programs)
        if variant.endswith("_static"):   # its K loop is the same build's; claims and headers leave the path
            m = replace(m, static=True, task=m.task * cmb.STATIC_TASK)
        row = {}
        for name in ("moondream2", "whisper-tiny.en"):
            graph, tiling = gs[name, batch]
            launch = cmb.launch(name, batch, "bf16", graph, tiling, k_step_scale=w / w0,
                                stats_chunk=STATS_TILE.value, stats_tiles=STATS_TILES.value * ("aligned" in variant))
            row[name] = cm.simulate(graph, launch, m)["seconds"] * 1e6
        out[version, batch, variant] = row
    return out


def loads_text(loads: dict[str, int]) -> str:
    """Loads a trip by width as the tables write them (e.g. "8 x 128"; a 4-byte load is "32")."""
    return ", ".join(f"{n} x {op.removeprefix('LDG.E.') if op != 'LDG.E' else '32'}" for op, n in sorted(loads.items()))


def builds(got: dict, versions: list[str], base: dict[int, str], variants: dict[int, tuple[str, ...]]):
    """(Triton version, batch, variant name, compile record) of each build of a table, in order."""
    for v in versions:
        for b in variants:
            for variant in variants[b]:
                yield got[v]["triton"], b, variant.lstrip("_") or "plain", got[v]["cases"][f"{base[b]}{variant}@sm_90"]


def experts_kb(rec: dict) -> str:
    """KB a program the expert tasks' K loops have in flight a trip (the least of their copies)."""
    loops = expert_loops(rec["k_loops"])
    return f"{min(lp['in_flight_bytes'] for lp in loops) * rec['threads'] / 1024:.1f}" if loops else "-"


def main(argv: list[str] | None = None) -> int:
    from report import heading, publish

    from photon_core.kernels.triton_versions import megakernel_tuning
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--versions", nargs="+", default=[MEASURED, "pinned"], help="Triton versions ('pinned': the venv's)")
    p.add_argument("--write", action="store_true", help="replace this benchmark's section of bench/RESULTS.md")
    p.add_argument("--compiled", type=Path, default=None,
                   help="a JSON of an earlier run's compiles: read if it exists (no compiling), else written")
    args = p.parse_args(argv)
    if MEASURED not in args.versions:
        raise SystemExit(f"the predictions are relative to Triton {MEASURED}'s plain build: keep it in --versions")
    t0 = time.time()
    if args.compiled is not None and args.compiled.exists():
        got = json.loads(args.compiled.read_text())
    else:
        got = compile_all(args.versions)
        got["seconds"] = round(time.time() - t0)
        if args.compiled is not None:
            args.compiled.write_text(json.dumps(got))
    names = {v: got[v]["triton"] for v in args.versions}
    # an H200's 132 SMs, each holding the tuning's programs or as many as the build's shared memory fits
    per_sm = {names[v]: megakernel_tuning(names[v]).programs_per_sm for v in args.versions}
    table, per_program = [], {}
    for v in args.versions:
        version = names[v]
        for b in VARIANTS:
            for variant in VARIANTS[b]:
                rec = got[v]["cases"][f"{BASE[b]}{variant}@sm_90"]
                lp = dense_loop(rec["k_loops"])
                w, f = lp["weight_bytes"] * rec["threads"], streaming_bytes(lp) * rec["threads"]
                resident = 132 * programs_per_sm(per_sm[version], rec.get("shared_memory", 0), H200_SHARED_PER_SM)
                per_program[version, b, variant] = (w, f, resident)
                table.append((version, b, variant, rec, lp, w, f))
    pred = predictions(per_program)
    import cost_model as cmb
    floor = {b: cmb.FLOOR_US["moondream2", b, "bf16"] for b in VARIANTS}
    peer = cmb.PEER_US
    lines = heading("Megakernel K loop from the SASS, and the cost model's prediction per build (no GPU)") + [
        __doc__.split("\n\n", 2)[2].strip().replace("\n", " "), "",
        f"Compiled for sm_90 ({got['seconds']} s for all, two compiles at once). Per build: threads a "
        "program; registers / stack bytes (cuobjdump); shared memory a program (KB: with the registers, how many "
        "programs an SM holds); the dense linear task's K loop: weight loads a trip per "
        "thread by width (LDGSTS: copies into shared memory, cp.async); KB of weights a trip and KB in flight "
        "(issued before the first is used; in a pipelined loop, tl.range's stages, the later trips' copies still in "
        "flight when a trip's own are waited for: sass_loops.streaming_bytes), a program; "
        "barriers, shared-memory instructions and spill loads / stores (local) a trip; the expert tasks' K loops "
        "(MoE up and down, 16-bit experts: every build holds them): KB in flight a program a trip, the least of "
        "their copies. Predicted: the cost "
        "model's step (us) at the first run's rows, bf16 weights, against the floor and the peer that run measured (transformers in one CUDA "
        "graph).", "",
        "| Triton | batch | variant | threads | regs / stack | smem KB | weight loads a trip (per thread) | KB a trip | "
        "KB in flight | barriers | shared | local | experts KB in flight | Moondream 2 us | x floor | / peer | "
        "Whisper tiny.en us | / peer |",
        "|---|---:|---|---:|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for version, b, variant, rec, lp, w, f in table:
        pr = pred[version, b, variant]
        loads = loads_text(lp["loads"])
        md, wh = pr["moondream2"], pr["whisper-tiny.en"]
        lines.append(f"| {version} | {b} | {variant.lstrip('_') or 'plain'} | {rec['threads']} | {rec['registers']} / "
                     f"{rec['stack']} | {rec.get('shared_memory', 0) / 1024:.1f} | {loads} | {w / 1024:.1f} | "
                     f"{f / 1024:.1f} | {lp['barriers']} | {lp['shared']} | "
                     f"{lp['local']} | {experts_kb(rec)} | "
                     f"{md:.0f} | {md / floor[b]:.1f} | {md / peer['moondream2', b]:.2f} | {wh:.0f} | "
                     f"{wh / peer['whisper-tiny.en', b]:.2f} |")
    lines += ["", "Reading the pipelined builds (pipeN_aligned): Triton's pipeliner turns the aligned builds' 16-byte "
              "weight loads into copies into shared memory (the plain build's 2-byte loads it leaves as loads), "
              "so their bytes in flight cost shared memory, not registers; a pipelined aligned build takes the "
              "register budgets' K step (kernel.linear_k_step), as wide as at batch 1 with N stages, at batch 8 still "
              "the product's 2 KB a trip, hence 15 stages there. The model prices any program with about 32 KB in "
              "flight as bound by the bandwidth at its fitted trip latency, and charges each task one first trip, "
              "which for a pipelined build moves one small trip: it cannot rank them above the register builds. "
              "Under load the HBM's latency exceeds that fitted trip; whether 48 KB (batch 1) and 26 KB (batch 8) "
              "in flight beat 32 and 16 is what bench/gpu_timeline.py measures (both are in its variants)."]
    lines += ["", "Builds with FP8 experts (bf16 weights and KV, as Moondream 3 preview runs): registers / stack, spill "
              "loads / stores inside the dense K loop (the most of its copies), and the expert tasks' K loops (MoE up "
              "and down): weight loads a trip per thread and KB in flight a program (the copy with the least in flight), "
              "spill loads / stores a trip (the most of their copies).", "",
              "| Triton | batch | variant | threads | regs / stack | dense loop local | expert loads a trip | "
              "experts KB in flight | experts local |", "|---|---:|---|---:|---|---:|---|---:|---:|"]
    for version, b, variant, rec in builds(got, args.versions, FP8_BASE, FP8_VARIANTS):
        ex = expert_loops(rec["k_loops"])
        least = min(ex, key=lambda lp: lp["in_flight_bytes"]) if ex else None
        lines.append(f"| {version} | {b} | {variant} | {rec['threads']} | {rec['registers']} / {rec['stack']} | "
                     f"{max(lp['local'] for lp in dense_loops(rec['k_loops']))} | "
                     f"{loads_text(least['loads']) if least else '-'} | "
                     f"{experts_kb(rec)} | {max((lp['local'] for lp in ex), default=0)} |")
    lines += ["", "Attention (decode_partial inlined in _task_attn_partial) in today's builds: Tiling() (64 keys a "
              "step, head 64), bf16 KV as on CUDA by default. Per step and thread: K / V loads by width; KB a step and "
              "KB in flight a program; barriers, shared-memory instructions and spill loads / stores a step. The "
              "aligned builds say the caches' alignment (kernel.KV16: 16-byte loads) and keep a softmax per key lane "
              "(no reduction across warps a step); the plain build keeps the block's.", "",
              "| Triton | batch | variant | threads | regs / stack | K / V loads a step (per thread) | KB a step | "
              "KB in flight | barriers | shared | local |", "|---|---:|---|---:|---|---|---:|---:|---:|---:|---:|"]
    for version, b, variant, rec in builds(got, args.versions, ATTN_BASE, ATTN_VARIANTS):
        for lp in rec["attention_loops"]:
            lines.append(f"| {version} | {b} | {variant} | {rec['threads']} | {rec['registers']} / {rec['stack']} | "
                         f"{loads_text(lp['loads'])} | {lp['weight_bytes'] * rec['threads'] / 1024:.1f} | "
                         f"{lp['in_flight_bytes'] * rec['threads'] / 1024:.1f} | {lp['barriers']} | {lp['shared']} | "
                         f"{lp['local']} |")
    lines += ["", f"Load average {os.getloadavg()[0]:.1f} at the end (compile times are not the point here)."]
    publish(lines, args.write)
    return 0


if __name__ == "__main__":
    sys.exit(main())
