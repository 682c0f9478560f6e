"""The managed nodes' bond with a lifecycle manager over DDS (photon_ros.lifecycle_bond), as
nav2_lifecycle_manager holds one with every node it activates: with bond_timeout > 0 (its default,
4 s) a node without heartbeats fails the robot's bringup, and a node whose heartbeats stop takes
every managed node down.

The bond messages are not on PyPI: the test-only stand-in (test/workspaces/bond, the upstream
type hashes) carries their definitions. The vision node runs as its own process (autostart false,
the tests' small random Moondream) and so does the manager's side (lifecycle_manager_peer.py):
it configures the node, activates it twice, each time holding a bond as nav2's manager does, and
deactivates it."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from interface_workspaces import install_dir, package_dir, workspace_env
from moondream_fixtures import checkpoint
from ros_harness import interrupt

PEER = Path(__file__).with_name("lifecycle_manager_peer.py")
# RIHS01 type hashes of ros/bond_core's bond messages (branch ros2 at e6d0fc2c), computed with
# `rosidl hash` from its .msg files: equal hashes mean the same type on the wire.
UPSTREAM_HASHES = {
    "Constants": "RIHS01_347874ac7a49af69eb313fc911d72cd59152a5a157b6577cafad31ad43a8d63e",
    "Status": "RIHS01_87eaccffa254ffffadc0b61600452e8251740f06c25659a2dbda4927fdb1f70a",
}
BOND_TIMEOUT_S = 4.0   # nav2's default bond_timeout


def test_stand_in_has_the_upstream_type_hashes():
    workspace_env("bond")   # builds it when missing
    share = install_dir("bond") / "share" / "bond" / "msg"
    assert sorted(p.stem for p in (package_dir("bond") / "msg").glob("*.msg")) == sorted(UPSTREAM_HASHES)
    for name, want in UPSTREAM_HASHES.items():
        hashes = json.loads((share / f"{name}.json").read_text())["type_hashes"]
        assert hashes[0]["type_name"] == f"bond/msg/{name}"
        assert hashes[0]["hash_string"] == want, name


def test_a_managed_node_holds_a_bond_while_active(tmp_path):
    ns = f"/bond_test_{os.getpid()}"
    env = workspace_env("bond")
    cmd = [sys.executable, "-m", "photon_ros.vision_node", "--ros-args", "-r", f"__ns:={ns}",
           "-p", f"model:={checkpoint()}", "-p", "detect:=[cup]", "-p", "autostart:=false"]
    log = tmp_path / "vision_node.log"
    with open(log, "w") as out:
        node = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        manager = subprocess.run([sys.executable, str(PEER), ns, "vision", "1.5"], env=env,
                                 capture_output=True, text=True, timeout=240)
    finally:
        interrupt(node)
    assert manager.returncode == 0, manager.stderr[-3000:] + log.read_text()[-3000:]
    got = json.loads(manager.stdout)
    assert got["cleaned"]
    instances = []
    for activation in got["activations"]:
        assert activation["deactivated_ok"]
        # it forms (nav2's manager waits bond_timeout / 2 for that: the node beats from activate on,
        # so only the machine's delivery sets how long it takes)
        assert activation["formed_s"] is not None
        statuses = activation["statuses"]
        assert {s["id"] for s in statuses} == {"vision"}
        assert len({s["instance_id"] for s in statuses}) == 1   # one bond an activation
        instances.append(statuses[0]["instance_id"])
        assert all(s["period"] == pytest.approx(0.1) and s["timeout"] == pytest.approx(BOND_TIMEOUT_S)
                   for s in statuses)
        # heartbeats while active, then "not active" at deactivate and nothing active after it
        flags = [s["active"] for s in statuses]
        assert False in flags, "no 'not active' status after deactivate"
        first_off = flags.index(False)
        assert all(flags[:first_off]) and not any(flags[first_off:])
        assert statuses[first_off]["t"] > activation["bond_start"]
        # the manager's heartbeat check must never fire: sent (the node's own stamps, not when this
        # machine delivered them) at gaps far below its timeout
        beats = [s["sent"] for s in statuses[:first_off]]
        assert len(beats) >= 5 and max(b - a for a, b in zip(beats, beats[1:])) < BOND_TIMEOUT_S / 2
    assert instances[0] != instances[1]   # a new bond at the second activation
    assert node.returncode == 0, log.read_text()[-3000:]
