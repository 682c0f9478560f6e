"""A loop node stopped mid-turn (Ctrl-C from ros2 launch: SIGINT; its escalation: SIGTERM) ends the
turn with a zero Twist, as the README promises: rclpy's own signal handler shut the context down
first, the stop could not be published, and a base without a cmd_vel timeout kept turning. The
node runs in a process of its own through run_node, as `ros2 run` starts it; run as a script, this
file is that process (a turn started 1 s in, as a find result would start one)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def child() -> None:
    import threading

    from photon_ros.loop_node import LoopNode
    from photon_ros.run_node import run_node
    from photon_ros.steering import Turn

    def make():
        node = LoopNode()

        def later():
            time.sleep(1.0)
            node.turns.start(Turn(rate=0.5, duration=30.0), time.monotonic())
        threading.Thread(target=later, daemon=True).start()
        return node
    run_node(make, sys.argv[2:])


# The long callback of busy_child() runs until the test lets it end, at most this long: longer
# than the test waits for the zero Twist, so that one held up by the callback is never mistaken for
# one sent before it.
LONG_CALLBACK_S = 120.0


class Base:
    """The test's side: the node process (this file run in `mode`, in namespace `ns`) and a node of
    our own listening to it, spun here."""

    def __init__(self, mode: str, ns: str, **env_vars: str) -> None:
        import rclpy
        env = {**os.environ, "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}", **env_vars}
        self.proc = subprocess.Popen([sys.executable, __file__, mode, "--ros-args", "-r", f"__ns:={ns}"],
                                     env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.ctx = rclpy.Context()
        rclpy.init(context=self.ctx)
        self.node = rclpy.create_node("base", context=self.ctx)
        self.executor = rclpy.executors.SingleThreadedExecutor(context=self.ctx)
        self.executor.add_node(self.node)

    def spin_for(self, seconds: float, until=lambda: False) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end and not until():
            self.executor.spin_once(timeout_sec=0.05)

    def close(self) -> None:
        import rclpy
        if self.proc.poll() is None:
            self.proc.kill()
        self.node.destroy_node()
        rclpy.shutdown(context=self.ctx)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_turn_stopped_by_a_signal_ends_with_a_zero_twist(sig):
    from geometry_msgs.msg import Twist
    from rclpy.qos import QoSProfile, ReliabilityPolicy

    base = Base("child", "/shutdown_test")
    got: list[float] = []
    base.node.create_subscription(Twist, "/shutdown_test/cmd_vel", lambda m: got.append(m.angular.z),
                                  QoSProfile(depth=100, reliability=ReliabilityPolicy.RELIABLE))
    try:
        base.spin_for(60, lambda: len(got) >= 3)
        assert got and got[-1] == 0.5, (got, base.proc.poll())
        base.proc.send_signal(sig)
        base.spin_for(60, lambda: base.proc.poll() is not None and got[-1] == 0.0)
        assert base.proc.wait(timeout=60) == 0
        base.spin_for(0.5)
        assert got[-1] == 0.0, got[-5:]
    finally:
        base.close()


def busy_child() -> None:
    """The loop node beside a node whose callback runs for seconds (an inference, a goal waiting
    for a frame), in one process as bringup spins them; the turn starts 1 s in, the long callback
    1.5 s in: it creates the file BUSY_DIR/began, runs until the test creates BUSY_DIR/go (or
    LONG_CALLBACK_S at most), and says 'done' on /shutdown_busy/done as it ends."""
    import threading

    import rclpy
    from rclpy.node import Node
    from std_msgs.msg import String

    from photon_ros.loop_node import LoopNode
    from photon_ros.run_node import init_rclpy, spin_nodes
    from photon_ros.steering import Turn

    init_rclpy(sys.argv[2:])
    loop, busy = LoopNode(), Node("busy")
    done = busy.create_publisher(String, "done", 10)
    here = Path(os.environ["BUSY_DIR"])

    def long_callback():
        timer.cancel()
        (here / "began").touch()
        end = time.monotonic() + LONG_CALLBACK_S
        while not (here / "go").exists() and time.monotonic() < end:
            time.sleep(0.05)
        done.publish(String(data="done"))
    timer = busy.create_timer(1.5, long_callback)

    def later():
        time.sleep(1.0)
        loop.turns.start(Turn(rate=0.5, duration=30.0), time.monotonic())
    threading.Thread(target=later, daemon=True).start()
    spin_nodes([loop, busy])
    assert not rclpy.ok()


if __name__ == "__main__" and sys.argv[1:2] == ["child"]:
    child()
if __name__ == "__main__" and sys.argv[1:2] == ["busy"]:
    busy_child()


def test_the_zero_twist_goes_out_before_waiting_for_a_long_callback(tmp_path):
    """At Ctrl-C the executor waits for the callbacks still running (an inference may take seconds;
    a goal waiting for a frame ends only when its node is told to stop): the loop's zero Twist must
    not wait for them. It arrives while the long callback still runs (it ends only when the test
    lets it, once the Twist is in), before its 'done'."""
    from geometry_msgs.msg import Twist
    from rclpy.qos import QoSProfile, ReliabilityPolicy
    from std_msgs.msg import String

    base = Base("busy", "/shutdown_busy", BUSY_DIR=str(tmp_path))
    events: list[tuple[str, float]] = []
    reliable = QoSProfile(depth=100, reliability=ReliabilityPolicy.RELIABLE)
    base.node.create_subscription(Twist, "/shutdown_busy/cmd_vel", lambda m: events.append(("twist", m.angular.z)),
                                  reliable)
    base.node.create_subscription(String, "/shutdown_busy/done", lambda m: events.append(("done", 0.0)), 10)
    try:
        base.spin_for(60, lambda: sum(e == ("twist", 0.5) for e in events) >= 3 and (tmp_path / "began").exists())
        assert (tmp_path / "began").exists(), (events[-5:], base.proc.poll())   # the long callback runs
        assert events and events[-1] == ("twist", 0.5), (events[-5:], base.proc.poll())
        base.proc.send_signal(signal.SIGINT)
        base.spin_for(60, lambda: ("twist", 0.0) in events)
        assert ("twist", 0.0) in events and ("done", 0.0) not in events, events[-6:]
        (tmp_path / "go").touch()                                # now the long callback may end
        base.spin_for(60, lambda: base.proc.poll() is not None and ("done", 0.0) in events)
        assert base.proc.wait(timeout=60) == 0, base.proc.stdout.read()[-2000:]
        base.spin_for(0.5)
        after = [e for e in events if e != ("twist", 0.5)]
        assert after[:2] == [("twist", 0.0), ("done", 0.0)], events[-6:]
    finally:
        base.close()


def test_bringup_stops_at_ctrl_c():
    """Several nodes in one process (bringup) stop on SIGINT and exit 0, their destroy_node run
    (with rclpy's signal handler off, nothing else wakes the executor's wait)."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.Popen([sys.executable, "-m", "photon_ros.bringup", "--graph", "loop", "--namespace", "stop_test"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    import rclpy
    ctx = rclpy.Context()
    rclpy.init(context=ctx)
    watcher = rclpy.create_node("watcher", context=ctx)
    try:
        deadline = time.monotonic() + 60   # up once its nodes are on the graph (imports take seconds on a busy CPU)
        while ("loop", "/stop_test") not in watcher.get_node_names_and_namespaces():
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()
            time.sleep(0.2)
        time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
        # Without a wake-up the executor's wait never returns: a hang, told apart by this generous
        # wait (not by timing the exit, which takes seconds on a busy machine).
        try:
            code = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pytest.fail("bringup still running 60 s after SIGINT")
        assert code == 0, proc.stdout.read()[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
        watcher.destroy_node()
        rclpy.shutdown(context=ctx)
