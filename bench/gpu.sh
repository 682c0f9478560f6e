#!/usr/bin/env bash
# The decode megakernel on a GPU, in ONE command that fits a lent GPU session's 10-minute call:
#
#     BENCH_OUT=$OUT bash bench/gpu.sh --write          (device tool: timeout_s 600)
#
# 1. bench/gpu_proof.py proves the megakernel right, then times it: decode steps of every compiled
#    family (Whisper tiny.en, large-v3-turbo, Moondream 2; then, through its generic GraphFamily,
#    Qwen3-ASR 0.6B, Qwen 3.5 0.8B, Gemma 4 E2B and Moondream 3.1 9B-A2B in bf16, steps / poison /
#    timing only; random weights of real shapes) against the references, race stress with a
#    positive control, stale-data poisoning, liveness, the production decode loop (host-driven
#    steps vs one replay per token vs rounds of 8 steps per replay: same tokens, time per token),
#    then time per step vs the HBM floor and the per-op CUDA graph. A failed check ends the script here, with
#    the proof's non-zero exit status: nothing is timed on a kernel that is not right.
# 2. bench/gpu_bench.py: the per-op kernels vs eager, and Whisper tiny's step (eager, per-op graph,
#    megakernel at gpu_bench's tilings), in the time the proof left.
# Both share one budget, GPU_SH_BUDGET_S (570 s, under the call's 600): the proof gets
# PROOF_BUDGET_S (420 s; past it the proof skips its timing part, never a correctness part, and
# says so) and is killed 90 s after it; the bench gets what is left (skipped, saying so, if under
# 60 s). Expected on an H200 (estimated: nothing has run on one yet): the proof 5-7 minutes for
# Whisper and Moondream 2, a minute or two of it CPU work (compiling the kernels; lowering and
# checking Moondream 2's 20-53K-task graphs); the four GraphFamily families add builds of 18-90K
# tasks each (about 5-15 s of CPU each here, per batch) and their kernels' compiles, so the whole
# proof may run into PROOF_BUDGET_S (then timing is skipped, never a correctness part) or past it.
# If it does, split it over two calls: PROOF_ARGS="--families whisper-tiny.en,whisper-turbo,
# whisper-tiny.en/split,moondream2", then PROOF_ARGS="--families qwen3-asr-0.6b,qwen3.5-0.8b,
# gemma4-e2b,moondream3" (each call with its own BENCH_OUT).
#
# Results go to BENCH_OUT (default bench/): gpu.log (everything printed), gpu_proof.json (rewritten
# after every part, so a killed run keeps what it proved), gpu_bench.json and, with --write, a copy
# of bench/RESULTS.md holding both tables (the device's working tree does not come back: take the
# two sections from that copy). More arguments: PROOF_ARGS, e.g. "--parts steps,stress --families
# moondream2"; BENCH_ARGS (default "--batches 1,8").
set -uo pipefail
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

write=()
for a in "$@"; do
  case "$a" in
    --write) write=(--write) ;;
    *) echo "gpu.sh: unknown argument $a (use PROOF_ARGS / BENCH_ARGS)"; exit 2 ;;
  esac
done
budget=${GPU_SH_BUDGET_S:-570}
proof_budget=${PROOF_BUDGET_S:-420}
start=$SECONDS

finish() {
  if [ ${#write[@]} -gt 0 ] && [ "$out" != "$root/bench" ]; then
    cp "$root/bench/RESULTS.md" "$out/RESULTS.md"
  fi
  echo "gpu.sh: $1 after $((SECONDS - start)) s"
  exit "$2"
}

echo "gpu.sh: proof (budget ${proof_budget} s of ${budget} s), $($py -c 'import torch; print(torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device")' 2>&1 | tail -1)"
# shellcheck disable=SC2086  # PROOF_ARGS / BENCH_ARGS are word lists on purpose
timeout --kill-after=10 $((proof_budget + 90)) "$py" "$root/bench/gpu_proof.py" --budget-s "$proof_budget" \
  --json "$out/gpu_proof.json" ${write[@]+"${write[@]}"} ${PROOF_ARGS:-}
rc=$?
if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
  finish "PROOF TIMED OUT (killed at $((proof_budget + 90)) s; gpu_proof.json holds the parts that finished): the bench is not run" $rc
elif [ $rc -ne 0 ]; then
  finish "PROOF FAILED (exit $rc): the bench is not run" $rc
fi

left=$((budget - (SECONDS - start)))
if [ $left -lt 60 ]; then
  finish "proof passed; bench SKIPPED (${left} s left of ${budget} s)" 0
fi
echo "gpu.sh: proof passed; bench with the ${left} s left"
# shellcheck disable=SC2086
timeout --kill-after=10 "$left" "$py" "$root/bench/gpu_bench.py" --json "$out/gpu_bench.json" \
  ${write[@]+"${write[@]}"} ${BENCH_ARGS---batches 1,8}
rc=$?
if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
  finish "proof passed; bench TIMED OUT at ${left} s (no gpu_bench.json)" $rc
fi
finish "proof passed; bench exit $rc" $rc
