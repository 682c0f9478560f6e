"""The test-only interface packages (test/workspaces/), built and made importable.

Each workspace is one package: the two `audio_common_msgs` families (same package name, so they
cannot share an install space), `vision_msgs` and `bond`. `workspace_env(name)` builds the package with
colcon into ~/.cache/photon/ws-<name>-<hash> once (tens of seconds; the hash covers the package's
files and the ROS wheels it is built against, so an edit or a new venv rebuilds) and returns an
environment in which the package imports; for subprocesses only, since the dynamic loader reads
LD_LIBRARY_PATH at process start. A lock makes parallel test processes wait for one build
instead of racing it."""
from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import sysconfig
from importlib import metadata
from pathlib import Path

SOURCES = Path(__file__).resolve().parent / "workspaces"
# workspace name -> its package's folder under SOURCES (the folder's name is the package's name)
PACKAGES = {
    "mgonzs13": "mgonzs13/audio_common_msgs",
    "ros_drivers": "ros_drivers/audio_common_msgs",
    "vision_msgs": "vision_msgs/vision_msgs",
    "bond": "bond/bond",
}
AUDIO_COMMON_FAMILIES = ("mgonzs13", "ros_drivers")
REPO = Path(__file__).resolve().parents[1]
CACHE = Path.home() / ".cache" / "photon"
_DONE = ".photon-complete"
# The wheels' CMake exports name this include dir (scripts/setup.sh links it to the venv's numpy).
_NUMPY_INCLUDE = "/opt/python/cp311-cp311/lib/python3.11/site-packages/numpy/_core/include"


def package_dir(name: str) -> Path:
    """The source folder of workspace `name`'s package."""
    if name not in PACKAGES:
        raise ValueError(f"unknown test workspace {name!r}; known: {', '.join(PACKAGES)}")
    return SOURCES / PACKAGES[name]


def package_name(name: str) -> str:
    return package_dir(name).name


def _fingerprint(name: str) -> str:
    package = package_dir(name)
    digest = hashlib.sha256()
    for path in sorted(p for p in package.rglob("*") if p.is_file()):
        digest.update(str(path.relative_to(package)).encode() + b"\0" + path.read_bytes())
    digest.update(f"{sys.prefix}\0{metadata.version('rclpy')}".encode())
    return digest.hexdigest()[:16]


def install_dir(name: str) -> Path:
    """Where workspace `name`'s package is installed (it may not be built yet)."""
    return CACHE / f"ws-{name}-{_fingerprint(name)}" / "install"


def build_workspace(name: str) -> Path:
    """Workspace `name`'s install dir, built with colcon first when it is not there. Raises
    RuntimeError with the end of colcon's log when the build fails."""
    install = install_dir(name)
    root = install.parent
    if (root / _DONE).exists():
        return install
    root.parent.mkdir(parents=True, exist_ok=True)
    with open(root.with_name(root.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (root / _DONE).exists():   # another process built it while we waited
            return install
        shutil.rmtree(root, ignore_errors=True)   # an interrupted build starts over
        root.mkdir()
        _colcon_build(package_dir(name), root)
        (root / _DONE).write_text(name)
    return install


def _colcon_build(package: Path, root: Path) -> None:
    env = dict(os.environ)
    venv = sys.prefix
    if venv not in env.get("CMAKE_PREFIX_PATH", "").split(os.pathsep):
        raise RuntimeError("the venv is not on CMAKE_PREFIX_PATH: enter the environment with "
                           "`. scripts/dev_env.sh` before running these tests")
    # colcon passes `-l <cores>` to make, which builds one file at a time on a busy machine.
    env["MAKEFLAGS"] = f"-j{os.cpu_count() or 1}"
    # --base-paths is the package folder itself: test/workspaces/COLCON_IGNORE hides it from
    # any crawl of the repository, and colcon only checks for that file in the folders it walks.
    cmd = ["colcon", "--log-base", str(root / "log"), "build",
           "--base-paths", str(package),
           "--build-base", str(root / "build"), "--install-base", str(root / "install"),
           "--merge-install", "--event-handlers", "console_cohesion-", "summary-",
           "--cmake-args", f"-DPython3_EXECUTABLE={sys.executable}",
           f"-DPython3_NumPy_INCLUDE_DIR={_NUMPY_INCLUDE}", "-DBUILD_TESTING=OFF"]
    done = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=900)
    built = (root / "install" / "share" / package.name / "package.xml").exists()
    if done.returncode != 0 or not built:
        raise RuntimeError(f"colcon build of {package} failed (rc {done.returncode}, log in "
                           f"{root / 'log'}):\n{(done.stdout + done.stderr)[-3000:]}")
    shutil.rmtree(root / "build", ignore_errors=True)   # only install/ is used


def workspace_env(name: str, base: dict[str, str] | None = None) -> dict[str, str]:
    """`base` (default: this process's environment) with workspace `name`'s package importable,
    the repository and test/ on PYTHONPATH; for subprocesses only."""
    install = build_workspace(name)
    env = dict(os.environ if base is None else base)
    py_version = sysconfig.get_python_version()
    site = install / "lib" / f"python{py_version}" / "site-packages"

    def prepend(var: str, *paths: Path) -> None:
        env[var] = os.pathsep.join([*map(str, paths), *filter(None, [env.get(var, "")])])

    prepend("AMENT_PREFIX_PATH", install)
    prepend("LD_LIBRARY_PATH", install / "lib")
    prepend("PYTHONPATH", site, REPO, REPO / "test")
    env["ROS_AUTOMATIC_DISCOVERY_RANGE"] = "LOCALHOST"
    return env
