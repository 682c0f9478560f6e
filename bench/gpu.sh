#!/usr/bin/env bash
# The decode megakernel proved right on a GPU, then timed: two calls of the device tool, each at
# most 5 minutes, the second issued as soon as the first returns (a machine left idle goes back
# after ~30 s, and a fresh one costs 1-2 of the 15 minutes in all to start: 1-2 + 5 + 5 <= 12):
#
#   1. BENCH_OUT=$OUT bash bench/gpu.sh core --write      device tool timeout_s 300
#      Whisper tiny.en and Moondream 2 at batch 1 and 8, fp32 and bf16 weights: decode steps vs
#      their references, race stress with its positive control (Whisper), NaN poisoning, time per
#      step vs the HBM floor and vs the same step as per-op kernels in one CUDA graph (Whisper).
#   2. BENCH_OUT=$OUT bash bench/gpu.sh others --write    device tool timeout_s 300
#      Whisper large-v3-turbo and tiny.en/split at batch 1 and 8; Qwen3-ASR 0.6B, Qwen 3.5 0.8B,
#      Gemma 4 E2B and Moondream 3.1 at batch 1 (bf16); the production decode loop (rounds) of
#      Qwen3-ASR, Whisper tiny.en and Moondream 2; liveness.
#   Optional, if device time is left: BENCH_OUT=$OUT bash bench/gpu.sh bench --write (timeout_s 300):
#      bench/gpu_bench.py, the per-op kernels vs eager and Whisper tiny's step at gpu_bench's tilings.
#
# Each mode runs bench/gpu_proof.py --profile <mode> (the bench mode gpu_bench.py) under a kill at
# GPU_SH_LIMIT_S (285 s from this script's start, inside the tool's 300), with --budget-s 30 s under
# it: past the budget, the timing and rounds configurations left are skipped (saying so), never a
# correctness one. The results file is rewritten after every configuration, so a killed run keeps
# everything it finished.
#
# Time of the core call, estimated (nothing has run on a GPU yet) from times measured on the 2-core
# development machine (bench/RESULTS.md, "Megakernel under each supported Triton": lower + check at
# real sizes; one megakernel compile 13-22 s under Triton 3.6):
#   start: Python, torch, CUDA, the 512 MB noise buffers                                    ~15 s
#   builds, host work in one process, largest first: Moondream 2 B8 14.1 + 18.1 = 32 s, B1 1.2 +
#     3.7 = 5 s and its text graph ~3 s, weights ~2 s, Whisper tiny B8 + B1 (advance and plain)
#     2 x (0.8 + 0.2) = 2 s                                                                  ~44 s
#   compiles: 14 megakernel variants + 2 per-op warm-ups on 14 worker processes, each submitted as
#     its kernel is built, so they overlap the builds: the critical path adds one compile  ~30 s
#   checks: steps 8 configurations x 64 steps (~10-40 ms each with the references) ~16 s; stress
#     2 families x 2 batches x 4 program counts (1000 launches, 1-3 programs capped at 3 s, #SMs
#     and 2 x #SMs at 10 s) ~30 s (at most ~90 s); poison ~2 s; control ~4 s                 ~52 s
#   timing: 8 megakernel configurations + 2 per-op graphs, 220 replays each                 ~12 s
#   total ~15 + 44 + 30 + 52 + 12 = ~153 s expected; ~200 s with every stress at its cap. If the
#   compile pool failed, the 16 variants would compile one after another at first launch
#   (~16 x 20 = 320 s): timing would be skipped and the kill would end the correctness parts.
# Time of the others call: start ~15 s; builds ~65 s (Qwen 3.5 and Gemma 4 B1 6.5 + 7 s, each
#   twice: advance and plain steps; Moondream 3.1 B1 12 s; Qwen3-ASR B1 2 x 2.7 s; Whisper turbo
#   B1 + B8 2 x 2.6 s; tiny.en/split ~3 s; Moondream 2 B1 ~8 s; random weights, 9B of them for
#   Moondream 3.1, ~5 s); ~27 compile jobs on 14 workers beside them, tail ~30 s; checks, rounds,
#   timing ~60 s: ~170 s expected. (Batch 8 of the step-graph families is left out: lowering and
#   checking Qwen3-ASR's 33K-task batch-8 graph alone took minutes here; `all` has it.)
#
# Results go to BENCH_OUT (default bench/): gpu.log (everything printed), gpu_proof_<mode>.json
# (gpu_bench.json) and, with --write, a copy of bench/RESULTS.md holding the mode's table (the
# device's working tree does not come back: take the section from that copy). More arguments:
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
    core|others|all|bench) mode="$a" ;;
    --write) write=(--write) ;;
    *) echo "gpu.sh: unknown argument $a (modes: core, others, bench; flag --write; PROOF_ARGS / BENCH_ARGS)"; exit 2 ;;
  esac
done
if [ -z "$mode" ]; then
  echo "gpu.sh: name a mode: core (first call), others (second call) or bench (optional); see the header"
  exit 2
fi
limit=${GPU_SH_LIMIT_S:-285}   # for the whole script, from its start

finish() {
  if [ ${#write[@]} -gt 0 ] && [ "$out" != "$root/bench" ]; then
    cp "$root/bench/RESULTS.md" "$out/RESULTS.md"
  fi
  echo "gpu.sh $mode: $1 after $((SECONDS - start)) s"
  exit "$2"
}

echo "gpu.sh $mode: limit ${limit} s; $($py -c 'import sys, torch, triton; print("Python", sys.version.split()[0], "torch", torch.__version__, "Triton", triton.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device")' 2>&1 | tail -1)"
left=$((limit - (SECONDS - start)))
if [ "$mode" = bench ]; then
  # shellcheck disable=SC2086  # BENCH_ARGS is a word list on purpose
  timeout --kill-after=5 "$left" "$py" "$root/bench/gpu_bench.py" --json "$out/gpu_bench.json" \
    ${write[@]+"${write[@]}"} ${BENCH_ARGS---batches 1,8}
  rc=$?
else
  # shellcheck disable=SC2086  # PROOF_ARGS is a word list on purpose
  timeout --kill-after=5 "$left" "$py" "$root/bench/gpu_proof.py" --profile "$mode" --budget-s $((left - 30)) \
    --json "$out/gpu_proof_$mode.json" ${write[@]+"${write[@]}"} ${PROOF_ARGS:-}
  rc=$?
fi
if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
  finish "KILLED after ${left} s (the json holds every configuration that finished)" $rc
elif [ $rc -ne 0 ]; then
  finish "FAILED (exit $rc)" $rc
fi
finish "passed" 0
