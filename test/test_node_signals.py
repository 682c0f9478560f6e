"""Ctrl-C (SIGINT) at any moment of a node's life ends it promptly with status 0, without a
traceback or an abort: during its imports (torch takes seconds; a Ctrl-C then printed a
KeyboardInterrupt traceback, and one inherited as ignored, as a shell script's background job has
it, was ignored until rclpy.init, so the node loaded its model and ran on), during the model load
(the loading thread given up: the interpreter's finalization stopped it inside C++ code,
"terminate called without an active exception", status 134) and while it runs. The speech node
(Whisper tiny.en from the venv) runs in a process of its own, as `python -m` starts it."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# SIGINT ends the node promptly; a node that ignored it runs on. The test tells the two apart by
# this wait, not by timing the exit: a busy CI machine makes a prompt exit take seconds.
EXIT_WAIT_S = 60.0


def start(ns: str, *ros_args: str, ignore_sigint: bool = False) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}"}
    return subprocess.Popen(
        [sys.executable, "-m", "photon_ros.speech_node", "--ros-args", "-r", f"__ns:={ns}", *ros_args],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=(lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if ignore_sigint else None)


def interrupt(proc: subprocess.Popen) -> tuple[int, str]:
    """SIGINT to `proc`; its exit status and stderr."""
    proc.send_signal(signal.SIGINT)
    try:
        _, err = proc.communicate(timeout=EXIT_WAIT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
        pytest.fail(f"still running {EXIT_WAIT_S:g} s after SIGINT; stderr: {err[-2000:]}")
    return proc.returncode, err


def assert_clean(code: int, err: str) -> None:
    assert "Traceback" not in err and "terminate called" not in err, err[-2000:]
    assert code == 0, (code, err[-2000:])


def importing(proc: subprocess.Popen, timeout: float = 60.0) -> bool:
    """Wait until the node's module runs its imports: past `exit_on_ctrl_c()` (the first thing the
    module does under `python -m`) it imports numpy, whose extension then shows in the process's
    memory map. A fixed sleep before the SIGINT was no such thing: on a loaded machine the
    interpreter had not reached the module yet (Python's own KeyboardInterrupt traceback; an
    inherited SIG_IGN still in force, so the node ran on)."""
    deadline = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            with open(f"/proc/{proc.pid}/maps") as maps:
                if "_multiarray_umath" in maps.read():
                    return True
        except OSError:
            return False
        time.sleep(0.005)
    return False


@pytest.mark.parametrize("ignored", [False, True], ids=["default", "inherited_ignored"])
def test_ctrl_c_during_the_imports(ignored):
    proc = start(f"/signals_import_{os.getpid()}", ignore_sigint=ignored)
    try:
        assert importing(proc), proc.poll()     # then torch, rclpy, ... (seconds)
        assert proc.poll() is None
        assert_clean(*interrupt(proc))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


class Graph:
    """A node of the test's own (own context), to see the speech node come up."""

    def __init__(self) -> None:
        import rclpy
        self.ctx = rclpy.Context()
        rclpy.init(context=self.ctx)
        self.node = rclpy.create_node("signals_watcher", context=self.ctx)

    def wait_for(self, proc: subprocess.Popen, ns: str, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while ("speech", ns) not in self.node.get_node_names_and_namespaces():
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                pytest.fail(f"the speech node did not come up: {proc.communicate()[1][-2000:]}")
            time.sleep(0.05)

    def close(self) -> None:
        import rclpy
        self.node.destroy_node()
        rclpy.shutdown(context=self.ctx)


@pytest.mark.parametrize("autostart", [True, False], ids=["loading_model", "running_unconfigured"])
def test_ctrl_c_once_the_node_is_up(autostart):
    """autostart: the node is on the graph at once and loads the model meanwhile (seconds), so the
    Ctrl-C comes during the load. Without: the node spins, waiting for a lifecycle manager."""
    ns = f"/signals_{'load' if autostart else 'run'}_{os.getpid()}"
    graph = Graph()
    proc = start(ns, "-p", f"autostart:={str(autostart).lower()}")
    try:
        graph.wait_for(proc, ns)
        if not autostart:
            time.sleep(0.5)
        assert_clean(*interrupt(proc))
    finally:
        if proc.poll() is None:
            proc.kill()
        graph.close()
