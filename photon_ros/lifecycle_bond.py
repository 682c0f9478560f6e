"""A managed node's side of the bond a lifecycle manager holds with it (ros/bond_core's protocol).

nav2_lifecycle_manager, after activating each node it manages, waits bond_timeout / 2 (default
2 s) for the node's heartbeat on `bond` (a bond/Status whose id is the node's name) and gives up
the whole bringup without it; once everything is up it resets every node it manages when one
node's heartbeats stop for bond_timeout (a crashed server). nav2's own servers send heartbeats
from activate to deactivate; ours do the same when a manager drives them (autostart false).

The heartbeats come from a thread of their own, not from an executor timer: a node whose executor
threads are all busy (several action goals decoding at once on a two-core robot) would otherwise
fall silent and take the robot's whole stack down with it. Only the manager reads the bond's
state, so our side does not track the manager's heartbeats (bondcpp's side would only stop
sending after 10 s without them).
"""
from __future__ import annotations

import threading
import time
import uuid
from typing import Any

from rclpy.qos import QoSProfile, ReliabilityPolicy

TOPIC = "bond"
PERIOD_S = 0.1       # nav2's servers' heartbeat period
TIMEOUT_S = 4.0      # and the heartbeat timeout they announce
BROKEN_REPEATS = 2   # "not active" is sent this many times, DEAD_PUBLISH_PERIOD (0.05 s) apart


def status_type() -> type | None:
    """bond/msg/Status where the bond messages are installed (nav2 installs them), else None."""
    try:
        from bond.msg import Status
    except ImportError:
        return None
    return Status


class Heartbeat:
    """Heartbeats of bond `bond_id` (the node's name, as the manager names it) on the node's
    `bond` topic, from construction until `end()`, which sends "not active" so that a manager
    watching the bond sees it broken at once rather than after its timeout."""

    def __init__(self, node: Any, status: type, bond_id: str) -> None:
        self._status, self.bond_id = status, bond_id
        self.instance_id = str(uuid.uuid4())   # this bond's, new at each activation
        # bondcpp's QoS: keep last 5, reliable, volatile
        self._pub = node.create_publisher(status, TOPIC, QoSProfile(
            depth=5, reliability=ReliabilityPolicy.RELIABLE))
        self._node = node
        self._ended = threading.Event()
        self._end_lock = threading.Lock()   # a deactivate and a shutdown may end it at once
        self._thread = threading.Thread(target=self._beat, daemon=True, name=f"bond {bond_id}")
        self._thread.start()

    def _send(self, active: bool) -> None:
        msg = self._status()
        now = time.monotonic_ns()   # bondcpp stamps its status on the steady clock
        msg.header.stamp.sec, msg.header.stamp.nanosec = divmod(now, 1_000_000_000)
        msg.id, msg.instance_id, msg.active = self.bond_id, self.instance_id, active
        msg.heartbeat_timeout, msg.heartbeat_period = TIMEOUT_S, PERIOD_S
        self._pub.publish(msg)

    def _beat(self) -> None:
        try:
            while True:
                self._send(True)
                if self._ended.wait(PERIOD_S):
                    return
        except Exception:  # noqa: BLE001 - the context is shutting down: nothing to beat for
            return

    def end(self) -> None:
        """Stop the heartbeats, send "not active", remove the publisher. Idempotent."""
        with self._end_lock:
            if self._ended.is_set():
                return
            self._ended.set()
            self._thread.join()
            try:
                for i in range(BROKEN_REPEATS):
                    if i:
                        time.sleep(0.05)   # a second copy, should the first be lost
                    self._send(False)
                self._node.destroy_publisher(self._pub)
            except Exception:  # noqa: BLE001 - the context is shutting down: nobody to tell
                pass
