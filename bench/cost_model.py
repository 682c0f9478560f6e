"""The megakernel cost model (photon_core/megakernel/cost_model.py) against the first GPU run, and
its predictions for design changes, before any of them is built. No GPU needed: the graphs are
lowered from meta tensors (bench/roofline.py's builders).

    python bench/cost_model.py [--fit] [--write]

--fit searches the four round-trip constants that best reproduce the eight measured steps (least
squares on log time) and prints them (FITTED in the module holds the result); without it the
module's FITTED constants are used. The table: measured vs predicted per step; then each design
change's predicted step for Moondream 2 and Whisper tiny.en (batch 1 and 8, bf16), against the HBM
floor and against the peer measured in the same run (transformers in one CUDA graph).
"""
from __future__ import annotations

import argparse
import math
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from photon_core.megakernel import cost_model as cm  # noqa: E402

# The run's rows: positions, cross lengths (gpu_proof's fixed rows) and transformers' step (us).
ROWS = {"whisper-tiny.en": dict(start=224, spacing=-9, cross=lambda b: [1500 - 50 * r for r in range(b)]),
        "moondream2": dict(start=830, spacing=16, cross=lambda b: None),
        "moondream3": dict(start=830, spacing=16, cross=lambda b: None)}
PEER_US = {("whisper-tiny.en", 1): 365, ("whisper-tiny.en", 8): 382, ("moondream2", 1): 2981, ("moondream2", 8): 3316}
FLOOR_US = {("whisper-tiny.en", 1, "bf16"): 587 / 36.33, ("whisper-tiny.en", 8, "bf16"): 1060 / 24.74,
            ("moondream2", 1, "bf16"): 7670 / 11.99, ("moondream2", 8, "bf16"): 17543 / 15.21}


def measured_tiling() -> Any:
    """The tiling the run's builds had: Tiling() of 2026-12-04, before the attention followed the
    batch (Tiling.attn_min_tasks: 4 self / 8 cross splits at every batch then), took 64 keys a
    step (32 then) and ran batch 8's append rows as finales (Tiling.rope_finale_rows: batch 1's only
    then)."""
    from photon_core.megakernel.compiler import Tiling
    return Tiling(block_t=32, attn_min_tasks=0, rope_finale_rows=1)


def graphs(tiling: Any = None) -> dict[tuple[str, int], tuple[Any, Any]]:
    """(model, batch) -> (task graph, tiling) at `tiling` (default: the one the run used)."""
    import roofline

    from photon_core.megakernel.compiler import lower, plan
    tiling = tiling or measured_tiling()
    out = {}
    for name, make in (("whisper-tiny.en", lambda: roofline.whisper("tiny.en", 384, 6, 4, 51864)),
                       ("moondream2", roofline.moondream2)):
        g = make().graph
        for b in (1, 8):
            out[name, b] = (lower(plan(g, b, tiling)), tiling)
    return out


def launch(name: str, batch: int, weights: str, graph: Any, tiling: Any, k_step_scale: float = 1.0,
           stats_chunk: int = 0, expert_fp8: bool | None = None, expert_wide: int = 0,
           expert_pairs: int | None = None, stats_tiles: int = 0) -> cm.Launch:
    """The launch the run timed: Triton 3.6's K step (its register budgets), the run's rows;
    stats_chunk: the build's STATS_TILE (0: the run's build, BLOCK_K a row); stats_tiles: the
    build's STATS_TILES, where linear stages' finales merge their tiles' partials (0: the run's
    build, which read the value). A graph with MoE
    layers: expert_fp8 (its experts FP8, else in the arena's dtype), expert_wide (their wide step's
    elements; 0: the plain loop's step) and expert_pairs (cost_model.Launch)."""
    from photon_core.kernels.triton_versions import megakernel_tuning
    from photon_core.megakernel.kernel import linear_k_step, megakernel_meta
    r = ROWS[name]
    tiles = max((t.args.get("S", 1) for t in graph.tasks if t.op == cm.OP_ARGMAX), default=1)
    meta = megakernel_meta(batch, tiling.block_n, tiling.block_k, tiling.block_t, 64, 8, tiles)
    tuning = megakernel_tuning("3.6.0")
    k = int(linear_k_step(meta, tuning=tuning) * k_step_scale)
    unit = 4 if weights == "fp32" else 2
    experts = {} if expert_fp8 is None else dict(
        expert_k_step=expert_wide or linear_k_step(meta, fp8=expert_fp8, tuning=tuning),
        expert_bytes=1 if expert_fp8 else unit, expert_pairs=expert_pairs)
    return cm.launch_of(graph, tiling, batch, [r["start"] + r["spacing"] * i for i in range(batch)], r["cross"](batch),
                        unit, k, meta["BLOCK_R"],
                        cm.stats_row_chunk(batch, tiling.block_k, stats_chunk) if stats_chunk else 0, stats_tiles,
                        **experts)


def predict(m: cm.Machine, gs: dict, **launch_kw: Any) -> dict[tuple[str, int, str], float]:
    out = {}
    for (name, b, w) in cm.MEASURED_US:
        graph, tiling = gs[name, b]
        out[name, b, w] = cm.simulate(graph, launch(name, b, w, graph, tiling, **launch_kw), m)["seconds"] * 1e6
    return out


FIT_BOUNDS = dict(k_step=(0.3, 3.0), l2=(0.2, 1.0), task=(0.0, 5.0), observe=(0.0, 5.0), launch=(0.0, 20.0))


def fit(gs: dict) -> cm.Machine:
    """Least squares on log time over the eight steps, each constant within physical bounds (us):
    an L2 trip no longer than an HBM one, a launch of at most 50 us."""
    import numpy as np
    from scipy.optimize import minimize
    keys = list(cm.MEASURED_US)
    want = np.log([cm.MEASURED_US[k] for k in keys])
    names = list(FIT_BOUNDS)

    def machine(x: Any) -> cm.Machine:
        return replace(cm.FITTED, **{n: float(v) * 1e-6 for n, v in zip(names, x)})

    def loss(x: Any) -> float:
        got = predict(machine(x), gs)
        return float(((np.log([got[k] for k in keys]) - want) ** 2).sum())
    x0 = np.array([getattr(cm.FITTED, n) * 1e6 for n in names])
    r = minimize(loss, x0, method="Powell", bounds=[FIT_BOUNDS[n] for n in names],
                 options=dict(xtol=1e-2, ftol=1e-5, maxfev=300))
    return machine(np.round(r.x, 3))


# Design changes, each as the constants or launch it changes (predicted before it is built).
def changes(m: cm.Machine) -> list[tuple[str, cm.Machine, dict]]:
    """(label, machine, launch keywords; "tiling": the row's own graphs, else the run's)."""
    from photon_core.megakernel.compiler import Tiling
    return [
        ("the measured build (2026-12-04)", m, {}),
        ("row statistics 1024 elements a trip (kernel.STATS_TILE: batch 1 built, batch 8 too since)", m,
         dict(stats_chunk=1024)),
        ("K loop 4 tiles in flight (KernelVariant(unroll=4, aligned=True), built, to measure)",
         replace(m, tiles_in_flight=4), {}),
        ("weights prefetched to L2 before the waits (K step at L2 latency)", replace(m, k_step=m.l2), {}),
        ("4 tiles in flight + K step 4x wider (tl.dot tiles, 16 KB a step)", replace(m, tiles_in_flight=4), dict(k_step_scale=4)),
        ("... + two programs an SM (Triton 3.8+: 264 programs)", replace(m, tiles_in_flight=4, programs=264), dict(k_step_scale=4)),
        ("... + claim/observe at half the trips (static lists, flags)", replace(m, tiles_in_flight=4, programs=264,
                                                                                task=m.task / 2, observe=m.observe / 2),
         dict(k_step_scale=4)),
        # The builds auto times now, each trip in its own terms from the 3.6 SASS (bench/k_loops.py):
        # B1 wide512+aligned 32 KB a trip, all in flight (8x the measured build's 4 KB); B8
        # unroll8+aligned 16 KB (8x its 2 KB).
        ("streaming builds (B1 wide512+aligned, B8 unroll8+aligned; built, auto times them)", m, STREAMING_KW),
        ("... + static shares, the next task's header loaded while one runs (KernelVariant static, built, to "
         "measure; guess: the claim's and the header's trips leave each task's path, task x 3/5)",
         replace(m, task=m.task * STATIC_TASK, static=True), STREAMING_KW),
        ("streaming builds + today's attention (built, the default): splits that follow the batch (Tiling."
         "attn_min_tasks 128: B8 one split a (row, head)), 64 keys a step, a step's K and V loads in flight "
         "together (16-byte loads and a softmax per key lane, no barrier a step, in the aligned builds; the "
         "model counts a step as one trip either way)", m, dict(STREAMING_KW, tiling=Tiling(rope_finale_rows=1))),
        ("... + statistics merged from the tiles' partials (built, in every aligned build: each tile of a linear "
         "whose output feeds a norm leaves its rows' count, mean and M2, and the stage's finale merges them in one "
         "trip, where it read the value twice, 128 elements a row a trip at batch 8)", m,
         dict(TODAY_KW, tiling=Tiling(rope_finale_rows=1))),
        ("... + batch 8's append rows as finales of their qkv tiles (Tiling.rope_finale_rows 8, the default: a "
         "head's 8 rows one after another in the program that finishes its qkv tiles, where 6144 append tasks a step "
         "each paid a task's fixed cost)", m, dict(TODAY_KW, tiling=Tiling())),
        ("... + dense linear tasks of 4 column tiles (Tiling(linear_span=4): a task's claim, header, waits and "
         "fields paid once for its tiles, the span halved while a stage would have under 128 tasks; built, "
         "kernel.LTILES, for the GPU to measure)", m, dict(TODAY_KW, tiling=Tiling(linear_span=4))),
    ]


def moondream3_table(m: cm.Machine) -> list[str]:
    """Moondream 3.1's step at batch 1 and 8, bf16 weights, its experts bf16 (3.1's safetensors) or
    FP8 (3 preview's, kept FP8 on the megakernel), per build: no GPU has run it, so these are the
    model's alone. The experts' K loop in each build's own terms (bench/k_loops.py's SASS): the plain
    loop, one tile in flight a trip (FP8 at batch 1: BLOCK_K / 2 bytes a row, 1 KB at 32 columns;
    at batch 8 16 bytes, 0.5 KB); the streaming builds' expert tasks in wide steps
    (kernel.expert_loop), every trip's tile in flight at once: under 3.6 512 bytes a row (FP8 512
    elements, 16-bit 256). Routing uniform: the first distinct-experts pairs compute
    (cost_model.body). Span: the column tiles an up / down task computes one after another, its
    fixed per-task time paid once for them (Tiling.expert_span; kernel.XTILES builds the loop):
    1 by default; fixed spans (expert_min_tasks 0), then span 4 halved while a stage would have
    under 128 tasks (Tiling(expert_span=4), built, for a GPU to measure against span 1)."""
    import roofline
    import triton

    from photon_core.kernels.triton_versions import megakernel_tuning
    from photon_core.megakernel.compiler import Tiling, lower, plan
    from photon_core.megakernel.kernel import KernelVariant, expert_step
    from photon_core.models.moondream3.decoder_step import dims_of, step_graph
    cfg = roofline.moondream3_config()
    experts, top_k = cfg.text.moe.num_experts, cfg.text.moe.experts_per_token
    lines = ["| Moondream 3.1 build (bf16 weights) | experts | span (up/down tiles) | batch | model us | floor us | "
             "x floor |", "|---|---|---:|---:|---:|---:|---:|"]
    # fixed spans (the halving rule off; span 1 is Tiling() itself: the same table, lowered once)
    fixed = [Tiling()] + [Tiling(expert_span=span, expert_min_tasks=0) for span in (2, 4, 8)]
    for fp8 in (False, True):
        dm = dims_of(cfg, fp8=fp8)
        g = step_graph(dm, dm.max_context)
        for b in (1, 8):
            floor = (g.weight_bytes(2, rows=b) + roofline.state_bytes(g, 1024) * b) / roofline.GPUS["H200"]
            name = "wide512+aligned" if b == 1 else "unroll8+aligned"
            stream = dict(TODAY_KW["by_batch"][b])
            # the streaming build's expert step under 3.6 (the fitted run's Triton), as the kernel derives it
            wide = expert_step(KernelVariant.parse(name), triton.next_power_of_2(b), 1 if fp8 else 2,
                               megakernel_tuning("3.6.0"))
            builds = [("plain", {}, 0, Tiling()), (f"{name}, experts in the plain loop", stream, 0, Tiling())]
            builds += [(f"{name}, experts in wide steps", stream, wide, t) for t in fixed]
            builds += [(f"{name}, experts in wide steps, Tiling(expert_span=4) (built, the GPU to measure)", stream,
                        wide, Tiling(expert_span=4))]
            graphs = {}
            for label, kw, wide, tiling in builds:
                if tiling not in graphs:
                    graphs[tiling] = lower(plan(g, b, tiling))
                graph = graphs[tiling]
                la = launch("moondream3", b, "bf16", graph, tiling, **kw, expert_fp8=fp8, expert_wide=wide,
                            expert_pairs=cm.distinct_experts(experts, top_k, b))
                us = cm.simulate(graph, la, m)["seconds"] * 1e6
                span = "/".join(str(max(t.args["n1"] - t.args["n0"] for t in graph.tasks if t.op == op)
                                    // tiling.block_n) for op in (cm.OP_MOE_UP, cm.OP_MOE_DOWN))
                lines.append(f"| {label} | {'FP8' if fp8 else 'bf16'} | {span} | {b} | {us:.0f} | {floor * 1e6:.0f} | "
                             f"{us / (floor * 1e6):.1f} |")
    return lines


STATIC_TASK = 3 / 5    # a static build's per-task fixed time, of the fitted one: a guess until a timeline measures it
STREAMING_KW = {"by_batch": {1: dict(k_step_scale=8, stats_chunk=1024), 8: dict(k_step_scale=8, stats_chunk=1024)}}
# Today's streaming builds: their linear stages' statistics merged from the tiles' partials (kernel.STATS_TILES).
TODAY_KW = {"by_batch": {b: dict(kw, stats_tiles=64) for b, kw in STREAMING_KW["by_batch"].items()}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--fit", action="store_true", help="fit the four constants to the eight measured steps")
    p.add_argument("--write", action="store_true", help="put the tables into bench/RESULTS.md")
    args = p.parse_args(argv)
    gs = graphs()
    m = fit(gs) if args.fit else cm.FITTED
    if args.fit:
        print("fitted: " + ", ".join(f"{n} {getattr(m, n) * 1e6:.3f} us" for n in FIT_BOUNDS))
    got = predict(m, gs)
    lines = ["| step (H200, Triton 3.6, 132 programs) | measured us | model us | model / measured |",
             "|---|---:|---:|---:|"]
    for k, us in cm.MEASURED_US.items():
        lines.append(f"| {k[0]} B{k[1]} {k[2]} | {us} | {got[k]:.0f} | {got[k] / us:.3f} |")
    worst = max(abs(got[k] / us - 1) for k, us in cm.MEASURED_US.items())
    lines.append(f"\nLargest error {worst:.1%}. Constants (us): "
                 + ", ".join(f"{n} {getattr(m, n) * 1e6:.2f}" for n in FIT_BOUNDS) + ".")
    lines += ["", "| design change (bf16) | Moondream 2 B1 us | x floor | / peer | Moondream 2 B8 us | B8 / B1 | "
                  "Whisper tiny.en B1 us | / peer |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    built = {}    # the graphs of a row's own tiling, lowered once
    # The last rows cut tasks or their fixed time, whose fitted constant (task) sits at its bound: the
    # same rows with a task's own trips at 1 us instead of 5, to read how much rests on it.
    rows = changes(m)
    rows += [("(task 1 us) " + label.split(" (")[0], replace(mm, task=1e-6), kw) for label, mm, kw in rows[-4:]]
    for label, mm, kw in rows:
        if "tiling" in kw and kw["tiling"] not in built:
            built[kw["tiling"]] = graphs(kw["tiling"])
        row_graphs = built[kw["tiling"]] if "tiling" in kw else gs
        pr = {}
        for name, b in (("moondream2", 1), ("moondream2", 8), ("whisper-tiny.en", 1)):
            graph, tiling = row_graphs[name, b]
            at = kw["by_batch"][b] if "by_batch" in kw else {k: v for k, v in kw.items() if k != "tiling"}
            pr[name, b] = cm.simulate(graph, launch(name, b, "bf16", graph, tiling, **at), mm)["seconds"] * 1e6
        md1, md8, wh1 = pr["moondream2", 1], pr["moondream2", 8], pr["whisper-tiny.en", 1]
        lines.append(f"| {label} | {md1:.0f} | {md1 / FLOOR_US['moondream2', 1, 'bf16']:.1f} | "
                     f"{md1 / PEER_US['moondream2', 1]:.2f} | {md8:.0f} | {md8 / md1:.2f} | {wh1:.0f} | "
                     f"{wh1 / PEER_US['whisper-tiny.en', 1]:.2f} |")
    lines += ["", "The (task 1 us) rows repeat the last four with a task's own trips (claim, header, fields) at 1 us "
              "instead of the fitted 5, a constant at its bound: what a change is worth if the fit put too much "
              "time there. The statistics partials and the append finales keep most of their batch-8 gain either "
              "way and are built in (the partials in every aligned build, the finales at every batch up to 8); the "
              "linear spans keep less of theirs and cost registers (sm_90, Triton 3.9: 240-264 B of stack outside "
              "the K loops of the wide512 / unroll8 span builds, none inside; the one-tile builds unchanged, "
              "kernel.LTILES), so Tiling.linear_span stays 1 until a GPU times the span builds "
              "(bench/gpu_timeline.py part 5) and a traced launch measures a task's fixed time."]
    lines += ["", "Moondream 3.1 (no GPU has run it: the model's alone; the experts' K loops per build in their own terms, "
              "from the SASS: see moondream3_table). Floor: bf16 weights, the experts the rows choose (uniform "
              "routing) once, bf16 KV at context 1024, at 4.8 TB/s.", ""] + moondream3_table(m)
    lines += ["", "Span 4 is built (expert tasks that loop over their tiles: kernel.XTILES, _task_moe_up_tiles) but "
              "not the default: those builds hold more registers (sm_90 SASS, 2026-12-05: no spill inside any K loop, "
              "but stack outside the loops of 0-136 B where the one-tile builds have 0-40: Triton 3.9 batch-1 "
              "wide512+aligned FP8 8 B (0), batch-8 unroll8+aligned FP8 16 (32), bf16 96 (40), plain FP8 batch 1 32 "
              "(0); Triton 3.6 batch 1 FP8 32 (24), batch 8 FP8 136 (0), bf16 0 (0); measured before the attention of "
              "2026-12-06, which moved the one-tile builds' stacks: see the K-loop section). bench/gpu_timeline.py "
              "times Moondream 3.1 at span 4 beside span 1 on the next GPU."]
    from report import heading, publish
    intro = ["The first GPU run's eight steps (../shared/gpu-runs/h200-2026-12-04) against the model "
             "(photon_core/megakernel/cost_model.py: the persistent kernel's schedule simulated over the task graph, "
             "time as round trips; 132 programs, Triton 3.6's K steps), then design changes predicted before any is "
             "built. Floors and peers are the run's (4.8 TB/s; transformers in one CUDA graph). Eight steps do not pin "
             "the five constants, and two sit at their bounds (see FITTED's comment): read the predictions as +-15%, "
             "and those of the claim/observe rows and the prefetch row (which turns on the L2 trip) as guesses, until "
             "a traced launch (bench/gpu_timeline.py) measures the constants directly.", ""]
    publish(heading("Megakernel cost model (fitted to the 2026-12-04 H200 run)") + intro + lines, args.write)
    return 0 if worst <= 0.15 else 1


if __name__ == "__main__":
    sys.exit(main())
