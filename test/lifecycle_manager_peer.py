"""nav2_lifecycle_manager's side of test_bond.py, run in a subprocess whose environment
(interface_workspaces.workspace_env("bond")) makes `bond` importable (nav2 cannot be installed
here). For the managed node NAMESPACE/NAME it does what nav2's manager does with a node in its
`node_names`, bond_timeout 4 s:

  configure; then twice: activate, hold a bond (heartbeats on NAMESPACE/bond, id NAME, every
  0.1 s, as bondcpp sends them) that must form (a status of the node's with active true; nav2
  waits bond_timeout / 2, this peer up to 30 s and reports how long it took), watch the node's heartbeats for WATCH_S, deactivate and watch for the node's
  "not active"; then cleanup.

  python lifecycle_manager_peer.py NAMESPACE NAME WATCH_S

It writes JSON on stdout: per activation, the seconds until the bond formed (null: it did not),
the node's statuses seen (time, its send stamp, instance_id, active, heartbeat_period, heartbeat_timeout, id),
and when deactivate's service call returned; exit 1 when a lifecycle call fails."""
from __future__ import annotations

import json
import sys
import threading
import time
import uuid

import rclpy
from lifecycle_msgs.msg import State, Transition
from lifecycle_msgs.srv import ChangeState, GetState
from rclpy.executors import MultiThreadedExecutor
from rclpy.qos import QoSProfile, ReliabilityPolicy

BOND_TIMEOUT_S = 4.0


def main(namespace: str, name: str, watch_s: float) -> int:
    from bond.msg import Status

    rclpy.init()
    node = rclpy.create_node("lifecycle_manager_test", namespace=namespace)
    executor = MultiThreadedExecutor(num_threads=2)
    executor.add_node(node)
    spinner = threading.Thread(target=executor.spin, daemon=True)
    spinner.start()
    change = node.create_client(ChangeState, f"{name}/change_state")
    get = node.create_client(GetState, f"{name}/get_state")
    if not (change.wait_for_service(timeout_sec=60) and get.wait_for_service(timeout_sec=10)):
        print("no lifecycle services", file=sys.stderr)
        return 1

    def transition(tid: int, want: int) -> bool:
        done = change.call(ChangeState.Request(transition=Transition(id=tid)), timeout_sec=120)
        state = get.call(GetState.Request(), timeout_sec=10)
        return bool(done and done.success and state and state.current_state.id == want)

    seen: list[dict] = []
    lock = threading.Lock()
    start = time.monotonic()

    mine: set[str] = set()   # the manager's own instances: it hears itself on the topic

    def heard(msg) -> None:
        if msg.id == name and msg.instance_id not in mine:   # id: the node's name, as the manager lists it
            with lock:
                sent = msg.header.stamp.sec + msg.header.stamp.nanosec * 1e-9   # the node's steady clock
                seen.append({"t": time.monotonic() - start, "sent": sent, "instance_id": msg.instance_id,
                             "active": msg.active, "period": msg.heartbeat_period,
                             "timeout": msg.heartbeat_timeout, "id": msg.id})

    # bondcpp's QoS: its subscription keeps 100, its publisher 5, both reliable
    node.create_subscription(Status, "bond", heard, QoSProfile(depth=100, reliability=ReliabilityPolicy.RELIABLE))
    pub = node.create_publisher(Status, "bond", QoSProfile(depth=5, reliability=ReliabilityPolicy.RELIABLE))
    if not transition(Transition.TRANSITION_CONFIGURE, State.PRIMARY_STATE_INACTIVE):
        print("configure failed", file=sys.stderr)
        return 1
    report = []
    for _ in range(2):
        if not transition(Transition.TRANSITION_ACTIVATE, State.PRIMARY_STATE_ACTIVE):
            print("activate failed", file=sys.stderr)
            return 1
        # the manager's bond starts once activate has returned, and waits bond_timeout / 2
        ours, bond_start = str(uuid.uuid4()), time.monotonic()
        mine.add(ours)
        formed = None
        ending = threading.Event()

        def beat() -> None:
            while not ending.is_set():
                msg = Status(id=name, instance_id=ours, active=True, heartbeat_timeout=BOND_TIMEOUT_S,
                             heartbeat_period=0.1)
                pub.publish(msg)
                ending.wait(0.1)
        beater = threading.Thread(target=beat, daemon=True)
        beater.start()
        # nav2 gives up after bond_timeout / 2; here the time it took is reported (on a loaded
        # machine delivery alone can take that long), and the test reads the node's own stamps
        while time.monotonic() - bond_start < 30.0:
            with lock:
                if any(s["active"] and s["t"] >= bond_start - start for s in seen):
                    formed = time.monotonic() - bond_start
                    break
            time.sleep(0.01)
        time.sleep(watch_s)
        deactivated_ok = transition(Transition.TRANSITION_DEACTIVATE, State.PRIMARY_STATE_INACTIVE)
        deactivated_at = time.monotonic() - start
        time.sleep(1.0)   # the node's "not active" follows its deactivate
        ending.set()      # then the manager drops its bond
        beater.join()
        with lock:
            statuses = [s for s in seen if s["t"] >= bond_start - start]
            seen.clear()
        report.append({"formed_s": formed, "bond_start": bond_start - start, "statuses": statuses,
                       "deactivated_ok": deactivated_ok, "deactivated_at": deactivated_at})
    cleaned = transition(Transition.TRANSITION_CLEANUP, State.PRIMARY_STATE_UNCONFIGURED)
    print(json.dumps({"activations": report, "cleaned": cleaned}), flush=True)
    executor.shutdown()
    spinner.join(timeout=10)
    node.destroy_node()
    rclpy.try_shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2], float(sys.argv[3])))
