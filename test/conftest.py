"""Shared test setup.

DDS discovery must stay on this machine (traffic off loopback is forbidden here), and each test
run gets a domain of its own so parallel runs do not hear each other. Both must be set before
rclpy starts, which is why they are set at import time here.
"""
import os
import sys
from pathlib import Path

import pytest

os.environ["ROS_AUTOMATIC_DISCOVERY_RANGE"] = "LOCALHOST"
# Always this run's own: the environment's domain is the user's graph (a robot's, another terminal's).
# Under pytest-xdist (scripts/test.sh) each worker is a process of its own: its number, added to
# the run's (the controller's pid), keeps the workers of one run apart (pids need not be adjacent).
_worker = os.environ.get("PYTEST_XDIST_WORKER", "")
_run = os.getppid() + int(_worker[2:]) if _worker.startswith("gw") else os.getpid()
os.environ["ROS_DOMAIN_ID"] = str(100 + _run % 100)
# No test reads or writes the user's megakernel build cache (megakernel/build_cache.py): a stored
# table would skip the builds tests make on purpose (and their checks). test_megakernel_build_cache
# turns it on in a temporary folder; child processes (nodes under test) inherit this.
os.environ["PHOTON_BUILD_CACHE"] = "0"
# Kernels run on Triton's interpreter here, and Triton reads this when a kernel is defined: a module
# that imported Triton before saying so defined compiled kernels for every module after it (an
# order-dependent error, 2026-12-05). Set once before any test module is imported; the compile-only
# tests compile in subprocesses whose environment drops it (compile_check.compile_env).
os.environ.setdefault("TRITON_INTERPRET", "1")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "test"))


def _patch_triton_language_once_per_launch() -> None:
    """Triton's interpreter (3.6 on) patches triton.language into its Python stand-ins when a launch
    starts and undoes it when the launch ends, but also again on every @triton.jit helper call inside
    the kernel: a scan of the whole language that sets again what the launch has already set (the
    same stand-ins), a fifth of the CPU time of the megakernel tests (test_gemma4_megakernel.py: 92 s
    without this, 72 s with it). Inside a launch whose patches already cover the helper's view of the
    language (triton.language, triton.language.core), the helper's call skips that repeat. The
    kernels run the same interpreted code either way; a Triton without this structure is left alone."""
    import inspect
    import threading

    import triton.language as tl
    from triton.runtime import interpreter

    real = getattr(interpreter, "_patch_lang", None)
    if real is None or getattr(real, "once_per_launch", False) or not hasattr(interpreter, "_LangPatchScope"):
        return
    local = threading.local()   # the language modules the launch running on this thread has patched

    def patch_lang(fn):
        done = getattr(local, "langs", None)
        langs = {id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core)}
        if done and langs and langs <= done:   # a helper called inside the launch
            return interpreter._LangPatchScope()
        scope = real(fn)
        if done:
            done.update(langs)
            return scope
        local.langs = set(langs)                # the launch's own patch: forget it when it is undone
        restore = scope.restore

        def restore_and_forget() -> None:
            local.langs = None
            restore()
        scope.restore = restore_and_forget
        return scope
    patch_lang.once_per_launch = True
    interpreter._patch_lang = patch_lang


def pytest_runtest_setup(item) -> None:
    # After collection: a test module sets TRITON_INTERPRET before it first imports Triton.
    if "triton" in sys.modules:
        _patch_triton_language_once_per_launch()


@pytest.fixture
def context():
    """An rclpy context of the test's own (its nodes share no graph state with other tests')."""
    import rclpy
    ctx = rclpy.Context()
    rclpy.init(context=ctx)
    yield ctx
    rclpy.shutdown(context=ctx)
