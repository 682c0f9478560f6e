#!/usr/bin/env bash
# Runs the whole test suite in the environment scripts/setup.sh built.
# Tests start real rclpy nodes: discovery stays on this machine, in a domain of this run's own.
set -eo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
if [ ! -f install/setup.bash ] || [ ! -x .venv/bin/python ]; then
  echo "[test] not set up yet: run scripts/setup.sh first" >&2
  exit 1
fi
. scripts/dev_env.sh
python -c 'import photon_ros.msg' || { echo "[test] generated interfaces missing: rerun scripts/setup.sh" >&2; exit 1; }
python -c 'import xdist' 2>/dev/null || { echo "[test] pytest-xdist missing (requirements changed): rerun scripts/setup.sh" >&2; exit 1; }
# Two worker processes (pytest-xdist), a test file's tests in one of them (module fixtures built
# once): the nodes' DDS waits and the single-threaded Triton compiles overlap on two cores.
# PHOTON_TEST_WORKERS=0 runs in this process (needed for --pdb); a -n N given here decides over it.
exec python -m pytest -n "${PHOTON_TEST_WORKERS:-2}" --dist loadfile "$@"
