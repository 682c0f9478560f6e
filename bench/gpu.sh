#!/usr/bin/env bash
# The decode megakernel on a GPU: where its time goes, then proved right and timed. Three calls of
# the device tool, each issued as soon as the one before returns (a machine left idle goes back
# after ~30 s; a fresh one costs 1-2 of the 15 minutes in all to start):
#
#   0. BENCH_OUT=$OUT bash bench/gpu.sh timeline          device tool timeout_s 280
#      bench/gpu_timeline.py: one traced launch of Moondream 2 and Whisper tiny.en at batch 1
#      (bf16), analysed by photon_core/megakernel/timeline.py (levels, per-program time,
#      signal-to-observe, the linear K step: the cost model's constants measured); every
#      KernelVariant and the split tiling timed, each checked against the plain build's logits;
#      the per-op engine, plain and chained (kernels/chained.py, PDL on sm_90), and auto's choice;
#      transformers in one CUDA graph timed in the same run; Moondream 2 batch 8 if time is left.
#      Writes gpu_timeline.json and traces.npz (after every row), and gpu.log. Run it first: the
#      next design step waits on it. Its CPU dry run: python bench/gpu_timeline.py --dry-run.
#   1. BENCH_OUT=$OUT bash bench/gpu.sh core --write      device tool timeout_s 260
#      Whisper tiny.en and Moondream 2 at batch 1 and 8, fp32 and bf16 weights: decode steps vs
#      their references (the first and last step also vs float64, by per-layer error profile),
#      time per step vs the HBM floor and vs the same step as per-op kernels in one CUDA graph
#      (Whisper), race stress with its positive control (Whisper), NaN poisoning.
#   2. BENCH_OUT=$OUT bash bench/gpu.sh others --write    device tool timeout_s 260
#      Whisper large-v3-turbo and tiny.en/split at batch 1 and 8; Qwen3-ASR 0.6B, Qwen 3.5 0.8B,
#      Gemma 4 E2B and Moondream 3.1 at batch 1 (bf16): steps, timing, stress (turbo), poisoning;
#      the production decode loop (rounds) of Qwen3-ASR, Whisper tiny.en and Moondream 2, each
#      family in a child process of its own beside the builds; liveness (a child too).
#   Optional, if device time is left: BENCH_OUT=$OUT bash bench/gpu.sh bench --write (timeout_s 300):
#      bench/gpu_bench.py, the per-op kernels vs eager and Whisper tiny's step at gpu_bench's tilings.
#
# Each mode runs bench/gpu_proof.py --profile <mode> (the bench mode gpu_bench.py) under a kill at
# GPU_SH_LIMIT_S (240 s from this script's start), with --budget-s 20 s under it: past the budget,
# the timing and rounds configurations left are skipped (saying so), never a correctness one.
# The results file is rewritten after every configuration, so a killed run keeps everything it
# finished; timing runs right after the steps, so a kill in a later part keeps the times too.
#
# Which machine: the device tool's default kind is an H100 (nvidia-h100-x1: 132 SMs, 80 GB, 3.35 TB/s);
# nvidia-h200 is an H200 (132 SMs, 141 GB, 4.8 TB/s). Every floor is computed at the device's own
# bandwidth, by its name (photon_core/gpu_proof/hbm.py; an unknown name keeps 4.8 TB/s and says so),
# and each json records it (hbm_tbps, hbm_source). Compare timings only between runs on the same kind.
#
# The time plan (python bench/gpu_proof.py --plan --profile core|others, on any CPU; every run
# prints it first): seconds on an H200 (the only kind measured so far) from the costs the first GPU
# run measured (photon_core/gpu_proof/costs.py: the run of 2026-12-04, ../shared/gpu-runs/h200-2026-12-04/),
# estimates where that run never got (float64 steps, core's poison and control, the others'
# timing, the child processes), tested to fit 240 s (test/test_gpu_proof_plan.py):
#                 start  build  compiles  steps  timing  stress  poison  control  total
#   core            16     47      17       56      15      42       6        9    208 s
#   others          16     70      17       44      16      19      13        -    195 s
#   start: gpu.sh's version line, imports, the compile pool (measured: 16 s). build: lower + check
#   + encode of every step, largest first (Moondream 2 B8 28.6 s). compiles: the last variant's
#   compile after the builds (the pool compiles beside them; 12-17 s each). stress: 1000 launches
#   per program count, cut by checks.launch_plan to 1 s with 1 or 3 programs (at least a plain
#   and a poisoned launch: Moondream 2 B8 takes 3.1 s a launch on one SM) and 4 s with #SMs or
#   2 x #SMs (Moondream 2: 94-314 launches; Whisper: the full 1000). others' rounds and liveness
#   children (30-40 s each) end long before the parent reaches them (0 s on its path). With a warm
#   Triton cache (a second call on the same machine) the compiles take ~4 s. If the compile pool
#   failed, each variant would compile at its first launch (12-17 s each): the kill would end the
#   run in its later parts, with everything before them written.
#   On an H100 (the default kind) the host work (start, build, compiles: CPU) takes what it takes on
#   the H200's machine; what the GPU's memory bounds takes up to 4.8 / 3.35 = 1.43x (stress is cut by
#   time, not launches). Were all of steps, timing, poison and control bandwidth-bound, core's 208 s
#   would be ~245 s (the kill at 240 s would cut control, its last part) and others' 195 s ~227 s;
#   the timeline's optional parts start only if the budget left covers them (gpu_timeline.OPTIONAL_S).
#
# Results go to BENCH_OUT (default bench/): gpu.log (everything printed), gpu_proof_<mode>.json
# (gpu_bench.json; the timeline: gpu_timeline.json and traces.npz) and, with --write, a copy of
# bench/RESULTS.md holding the mode's table (the device's working tree does not come back: take the
# section from that copy). The device tool brings back at most 8 files from $OUT (16 MiB each, 64 MiB
# in all, at most 2 folders down: /work/.library/device/README.md): every mode leaves at most 4 there
# (gpu.log, its results files, RESULTS.md with --write), 5 if the kill lands while a results file is
# being rewritten (its .tmp), as test/test_gpu_prepared_runs.py checks.
# The rounds children's results files and logs go to a temporary folder (their results are merged
# into the parent's json, their logs printed into gpu.log as each child ends). More arguments:
# PROOF_ARGS (e.g. "--parts steps,stress --families moondream2"), BENCH_ARGS (default "--batches 1,8").
set -uo pipefail
start=$SECONDS
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [ -f "$root/.venv/bin/activate" ] && [ -z "${VIRTUAL_ENV:-}" ]; then
  . "$root/.venv/bin/activate"
fi
py=python3
command -v python3 >/dev/null || py=python
out="${BENCH_OUT:-$root/bench}"
mkdir -p "$out"
exec > >(tee -a "$out/gpu.log") 2>&1
unset TRITON_INTERPRET
export PYTHONUNBUFFERED=1

mode=""
write=()
for a in "$@"; do
  case "$a" in
    core|others|all|bench|timeline) mode="$a" ;;
    --write) write=(--write) ;;
    *) echo "gpu.sh: unknown argument $a (modes: timeline, core, others, bench; flag --write; PROOF_ARGS / BENCH_ARGS)"; exit 2 ;;
  esac
done
if [ -z "$mode" ]; then
  echo "gpu.sh: name a mode: timeline (first call), core, others, or bench (optional); see the header"
  exit 2
fi
limit=${GPU_SH_LIMIT_S:-240}   # for the whole script, from its start
if [ "$mode" = timeline ]; then limit=${GPU_SH_LIMIT_S:-265}; fi

finish() {
  if [ ${#write[@]} -gt 0 ] && [ "$out" != "$root/bench" ]; then
    cp "$root/bench/RESULTS.md" "$out/RESULTS.md"
  fi
  echo "gpu.sh $mode: $1 after $((SECONDS - start)) s"
  exit "$2"
}

echo "gpu.sh $mode: limit ${limit} s; $($py -c 'import sys, torch, triton; print("Python", sys.version.split()[0], "torch", torch.__version__, "Triton", triton.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device")' 2>&1 | tail -1)"
left=$((limit - (SECONDS - start)))
if [ "$mode" = timeline ]; then
  timeout --kill-after=5 "$left" "$py" "$root/bench/gpu_timeline.py" --out "$out" --budget-s $((left - 30))
  rc=$?
elif [ "$mode" = bench ]; then
  # shellcheck disable=SC2086  # BENCH_ARGS is a word list on purpose
  timeout --kill-after=5 "$left" "$py" "$root/bench/gpu_bench.py" --json "$out/gpu_bench.json" \
    ${write[@]+"${write[@]}"} ${BENCH_ARGS---batches 1,8}
  rc=$?
else
  # shellcheck disable=SC2086  # PROOF_ARGS is a word list on purpose
  timeout --kill-after=5 "$left" "$py" "$root/bench/gpu_proof.py" --profile "$mode" --budget-s $((left - 20)) \
    --json "$out/gpu_proof_$mode.json" ${write[@]+"${write[@]}"} ${PROOF_ARGS:-}
  rc=$?
fi
if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
  finish "KILLED after ${left} s (the json holds every configuration that finished)" $rc
elif [ $rc -ne 0 ]; then
  finish "FAILED (exit $rc)" $rc
fi
finish "passed" 0
