#!/usr/bin/env bash
# GPU benchmark: per-op Triton kernels vs PyTorch eager, and the Whisper decode step as eager vs
# per-op Triton in a CUDA graph vs the megakernel. Needs a CUDA GPU with torch + triton installed;
# finishes in a few minutes on an H200. Extra arguments go to bench/gpu_bench.py (see --help).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [ -f "$root/.venv/bin/activate" ] && [ -z "${VIRTUAL_ENV:-}" ]; then
  . "$root/.venv/bin/activate"
fi
unset TRITON_INTERPRET
exec timeout 570 python "$root/bench/gpu_bench.py" --json "${BENCH_JSON:-$root/bench/gpu_results.json}" "$@"
