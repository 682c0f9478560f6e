"""What each piece of the GPU proof costs on an H200, as the first GPU run measured it, for the
time plan (gpu_proof.plan): the run of 2026-12-04, main at b1131fa, one H200 (132 SMs), Triton
3.6.0, torch 2.11 (/work/shared/gpu-runs/h200-2026-12-04/: proof-core.log, proof-others.log and
timing-core.log; copied to bench/gpu-runs/ with the next run). Seconds unless named otherwise.
Entries the run never reached (it was killed in the stress part of `core`, and its `others`
skipped timing) are estimates, each saying from what; `ESTIMATED` lists them."""
from __future__ import annotations

RUN = "h200-2026-12-04 (main at b1131fa; NVIDIA H200, Triton 3.6.0)"
SMS = 132

# gpu.sh's start to the proof's clock (Python, torch, CUDA, the version line): timing-core 84 - 68,
# others 173 - 163.5; plus the summary at the end.
START_S = 16.0
END_S = 1.0

# Lower + check + encode of one step (host, one process), (family, batch, advance); a pruned kernel
# of the caption/query graph ("token"). Where a step was built in more than one run, the slowest.
BUILD_S: dict[tuple[str, int, str], float] = {
    ("moondream2", 8, "plain"): 28.6, ("moondream2", 1, "plain"): 7.9,
    # core's build phase (43 s) less its listed builds (37.7 s): the one build not listed
    ("moondream2", 1, "token"): 5.3,
    ("whisper-tiny.en", 8, "advance"): 1.4, ("whisper-tiny.en", 8, "plain"): 1.1,
    ("whisper-tiny.en", 1, "advance"): 0.4, ("whisper-tiny.en", 1, "plain"): 0.5,
    ("moondream3", 1, "plain"): 9.2,
    ("moondream3", 1, "token"): 9.2,     # estimated: as its full graph (29613 of 29712 tasks)
    ("gemma4-e2b", 1, "advance"): 6.9, ("gemma4-e2b", 1, "plain"): 7.1,
    ("qwen3.5-0.8b", 1, "advance"): 6.7, ("qwen3.5-0.8b", 1, "plain"): 6.1,
    ("qwen3-asr-0.6b", 1, "advance"): 3.9, ("qwen3-asr-0.6b", 1, "plain"): 3.4,
    ("whisper-tiny.en/split", 8, "advance"): 2.8, ("whisper-tiny.en/split", 8, "plain"): 3.6,
    ("whisper-tiny.en/split", 1, "advance"): 0.9, ("whisper-tiny.en/split", 1, "plain"): 0.9,
    ("whisper-turbo", 8, "advance"): 2.4, ("whisper-turbo", 8, "plain"): 2.9,
    ("whisper-turbo", 1, "advance"): 0.7, ("whisper-turbo", 1, "plain"): 0.6,
}
# others' build phase (80 s) less its listed builds (63.9 s) and the two pruned kernels above:
# random weights (Moondream 3.1's 9B) and graphs
LOAD_S = 2.2
# After the last build, the compile pool's last job: the slowest compile of one variant measured in
# a worker (12-17 s; core waited 15 s after its builds); a warm cache (a second run) waits ~4 s.
COMPILE_TAIL_S = 17.0

# Part "steps": 64 steps of one configuration (family, batch, weight dtype), replay + references.
STEPS_S: dict[tuple[str, int, str], float] = {
    ("whisper-tiny.en", 1, "fp32"): 1.3, ("whisper-tiny.en", 1, "bf16"): 1.0,
    ("whisper-tiny.en", 8, "fp32"): 2.2, ("whisper-tiny.en", 8, "bf16"): 2.2,
    ("moondream2", 1, "fp32"): 5.1, ("moondream2", 1, "bf16"): 4.5,
    ("moondream2", 8, "fp32"): 13.7, ("moondream2", 8, "bf16"): 14.9,
    ("whisper-turbo", 1, "fp32"): 0.9, ("whisper-turbo", 1, "bf16"): 0.8,
    ("whisper-turbo", 8, "fp32"): 1.7, ("whisper-turbo", 8, "bf16"): 1.9,
    ("whisper-tiny.en/split", 1, "bf16"): 0.8, ("whisper-tiny.en/split", 8, "bf16"): 2.0,
    ("qwen3-asr-0.6b", 1, "bf16"): 6.1, ("qwen3.5-0.8b", 1, "bf16"): 3.9, ("moondream3", 1, "bf16"): 6.4,
    ("gemma4-e2b", 1, "bf16"): 8.0,      # estimated: it failed at step 0 (0.1 s), ~2x Qwen 3.5's per step
}
STEPS_PART_S = 0.2             # per configuration: capture, arena switch (core: 46.6 s for 44.9 listed)
# A float64 step (the rule of checks.judge_profile; never run on a GPU yet), estimated: the float64
# reference ~2x the fp32 one (Gemma 4 E2B at real shapes on the CPU: 6.3 s vs 3.0 s), the profile's
# comparisons about one more, so 3x a step of the part, plus widening the caches.
F64_STEP_X = 3.0
F64_STEP_S = 0.3

# Part "stress": seconds per launch in the stress loop (launch, reset, fingerprint compare, noise)
# at each program count, (family, batch, programs): the configuration's seconds / its launches.
STRESS_LAUNCH_S: dict[tuple[str, int, int], float] = {
    ("whisper-tiny.en", 1, 1): 5.11 / 117, ("whisper-tiny.en", 1, 3): 5.03 / 349,
    ("whisper-tiny.en", 1, 132): 1.21 / 1000, ("whisper-tiny.en", 1, 264): 1.39 / 1000,
    ("whisper-tiny.en", 8, 1): 5.07 / 45, ("whisper-tiny.en", 8, 3): 4.92 / 131,
    ("whisper-tiny.en", 8, 132): 2.09 / 1000, ("whisper-tiny.en", 8, 264): 2.09 / 1000,
    ("moondream2", 1, 1): 12.44 / 10, ("moondream2", 1, 3): 5.02 / 12,
    ("moondream2", 1, 132): 12.71 / 1000, ("moondream2", 1, 264): 15.44 / 1000,
    ("moondream2", 8, 1): 31.37 / 10, ("moondream2", 8, 3): 10.56 / 10,
    ("moondream2", 8, 132): 19.49 / 557,
    # estimated: the kill came first; B8 at 132 programs x B1's 264 / 132 ratio
    ("moondream2", 8, 264): 19.49 / 557 * (15.44 / 12.71),
    ("whisper-turbo", 1, 1): 5.17 / 31, ("whisper-turbo", 1, 3): 5.11 / 90,
    ("whisper-turbo", 1, 132): 2.6 / 1000, ("whisper-turbo", 1, 264): 3.27 / 1000,
    ("whisper-turbo", 8, 1): 4.96 / 11, ("whisper-turbo", 8, 3): 5.0 / 33,
    ("whisper-turbo", 8, 132): 6.51 / 1000, ("whisper-turbo", 8, 264): 6.51 / 1000,
}
# One plain launch at #SMs programs (the probe's measure), ms: the probe's own launches and the
# timing part's replays where the run timed none.
LAUNCH_MS: dict[tuple[str, int], float] = {
    ("whisper-tiny.en", 1): 0.60, ("whisper-tiny.en", 8): 1.12, ("moondream2", 1): 7.81, ("moondream2", 8): 17.88,
    ("whisper-turbo", 1): 1.50, ("whisper-turbo", 8): 3.24, ("qwen3-asr-0.6b", 1): 5.69,
    ("qwen3.5-0.8b", 1): 6.49, ("gemma4-e2b", 1): 20.08, ("moondream3", 1): 11.50,
    # estimated: tiny.en's ~0.25 us a task at the split tiling's task counts (4562, 8498)
    ("whisper-tiny.en/split", 1): 1.12, ("whisper-tiny.en/split", 8): 2.1,
}
# A stress probe: its fill, NaN scan, references and 6 launches (others' poison part: 10.4 s for
# 9.6 s of listed configurations and 4 probes), plus its float64 launch (F64_* above, at the
# configuration's per-step seconds of the steps part).
PROBE_S = 0.2

# Part "poison": 100 poisoned launches at 2 x #SMs programs, (family, batch).
POISON_S: dict[tuple[str, int], float] = {
    ("whisper-turbo", 1): 0.3, ("whisper-turbo", 8): 0.65, ("qwen3-asr-0.6b", 1): 1.13,
    ("qwen3.5-0.8b", 1): 1.29, ("gemma4-e2b", 1): 3.98, ("moondream3", 1): 2.27,
    # estimated: 100 x the stress loop's launch at 264 programs (core never reached poison)
    ("whisper-tiny.en", 1): 0.139, ("whisper-tiny.en", 8): 0.209, ("moondream2", 1): 1.544,
    ("moondream2", 8): 100 * 19.49 / 557 * (15.44 / 12.71),
}

# Part "control", (family, batch): estimated, core never reached it: at most 1000 launches at
# each of #SMs and 2 x #SMs at the stress loop's rate (it stops at the first difference), the
# forced ordering's 4 and the 2 after, the graph copies.
CONTROL_S: dict[tuple[str, int], float] = {("whisper-tiny.en", 1): 3.5, ("whisper-tiny.en", 8): 5.0}

# Part "timing": median CUDA-graph replay, us per step, (family, batch, dtype), as timing-core
# measured; the others' from LAUNCH_MS (a plain launch: fp32 and bf16 weights took the same time).
TIMING_US: dict[tuple[str, int, str], float] = {
    ("whisper-tiny.en", 1, "fp32"): 577.9, ("whisper-tiny.en", 1, "bf16"): 587.4,
    ("whisper-tiny.en", 8, "fp32"): 1040.8, ("whisper-tiny.en", 8, "bf16"): 1060.3,
    ("moondream2", 1, "fp32"): 7766.4, ("moondream2", 1, "bf16"): 7670.1,
    ("moondream2", 8, "fp32"): 17241.8, ("moondream2", 8, "bf16"): 17542.6,
}
PEROP_US: dict[tuple[str, int], float] = {
    ("whisper-tiny.en", 1): 538.0, ("whisper-tiny.en", 8): 1283.2,
    # estimated: turbo's decoder (d 1280, 4 layers) per op ~2x tiny.en's (d 384)
    ("whisper-turbo", 1): 1100.0, ("whisper-turbo", 8): 2600.0,
}
# per timed configuration (and per-op graph): capture, fill, the first launch's flags (core: 14.5 s
# for 12.2 s of replays over 10)
TIMING_EACH_S = 0.23

# Parts in child processes, beside the parent's builds (gpu_proof.children): a child's start
# (Python, torch, CUDA, the families' graphs: estimated from START_S less gpu.sh's version line),
# its builds (BUILD_S), one cold compile in its own worker (COMPILE_TAIL_S) overlapping them, and
# its GPU work under the lock.
CHILD_START_S = 10.0
# The rounds of one family: Qwen3-ASR's took 4.1 s (4 ways x 5 repeats x 32 tokens at 5.7 ms, and
# its captures); Whisper tiny.en's (0.6 ms a step) and Moondream 2's (feed and object rounds at 7.8
# ms a step) estimated the same way.
ROUNDS_RUN_S: dict[str, float] = {"qwen3-asr-0.6b": 4.1, "whisper-tiny.en": 2.0, "moondream2": 5.0}
# The liveness child: a cold compile of its tiny kernel and the ~10 s launch (9.8 s measured).
LIVENESS_S = CHILD_START_S + COMPILE_TAIL_S + 9.8

ESTIMATED = ("moondream3 token build", "gemma4-e2b steps", "float64 steps", "moondream2 B8 stress at 264",
             "core's poison and control", "timing of the others", "per-op turbo", "child starts and rounds")
