"""Packages the venv must not hold (another OpenCV, an older Triton) installed beside it: `pip install
--target` into a folder of their own under ~/.cache/photon, once, which a subprocess then puts first
on PYTHONPATH. Used by side_opencv.py (the tests) and bench/triton_versions.py (the benchmark and
test_triton_versions.py)."""
from __future__ import annotations

import fcntl
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

CACHE = Path.home() / ".cache" / "photon"
_DONE = ".photon-complete"


def side_install(name: str, requirements: Sequence[str], pip_args: Sequence[str] = (), cache: Path = CACHE,
                 timeout: float = 900) -> Path:
    """cache/name holding `requirements`, installed by pip (with `pip_args`) on first use. A stamp
    naming the requirements marks a finished install: a half-done one, or one of other requirements,
    is redone. A lock file makes concurrent callers (parallel test runs) wait for one install
    instead of replacing each other's. Raises RuntimeError with pip's message when pip fails (no
    package registry reachable)."""
    if not requirements:
        raise ValueError(f"side install {name!r}: no requirements given")
    target = cache / name
    stamp, wanted = target / _DONE, " ".join(requirements)
    if stamp.exists() and stamp.read_text() == wanted:
        return target
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if stamp.exists() and stamp.read_text() == wanted:   # another process finished it while this one waited
            return target
        partial = cache / f"{name}.partial"
        shutil.rmtree(partial, ignore_errors=True)
        r = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                            *pip_args, "--target", str(partial), *requirements],
                           capture_output=True, text=True, timeout=timeout)
        if r.returncode != 0:
            shutil.rmtree(partial, ignore_errors=True)
            raise RuntimeError(f"pip could not install {wanted} into {partial} (is the package registry "
                               f"reachable?):\n{r.stdout[-1500:]}{r.stderr[-3000:]}")
        (partial / _DONE).write_text(wanted)
        shutil.rmtree(target, ignore_errors=True)
        partial.rename(target)   # whole or absent: an interrupted install is redone
    return target
