"""One workstation serving four robots: bringup's graph once per namespace (r1..r4) in this
process, on one engine, with the robots' cameras in another process (over DDS, as a robot's camera
would be). Each camera sends frames of its own (pixels, stamps and frame_id that name the robot);
every result must come back on that robot's namespace only, with a header its camera sent and the
boxes the model gives for its image, and the engine must have decoded several robots' requests in
one batch. Run as a script, this file is the robots' cameras."""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import rclpy
from builtin_interfaces.msg import Time
from rclpy.qos import QoSProfile, ReliabilityPolicy, qos_profile_sensor_data
from sensor_msgs.msg import Image
from std_msgs.msg import Header

from moondream_fixtures import checkpoint
from photon_ros.bringup import DEFAULT_CONFIG, build_graph
from photon_ros.image_conversions import rgb_to_image
from photon_ros.msg import Detections
from photon_ros.vision_node import frame_requests
from ros_harness import ExecutorThread, RosGraph, wait_for
from test_camera_cross_process import Lines, camera_env

ROBOTS = ["r1", "r2", "r3", "r4"]
TOPIC = "camera/image_raw"   # relative: each robot's camera is under its namespace
RATE_HZ = 10.0               # per camera: together more than the engine serves one at a time here
MAX_FRAMES = 400             # a camera stops by itself after this many (40 s)
RESULTS_EACH = 3             # results the test waits for from every robot
RELIABLE = QoSProfile(depth=50, reliability=ReliabilityPolicy.RELIABLE)


def robot_image(robot: int) -> np.ndarray:
    """The frames of robot `robot` (0-based): noise of its own, 96x128 to stay cheap."""
    return np.random.default_rng(100 + robot).integers(0, 256, (96, 128, 3), dtype=np.uint8)


def robot_header(robot: int, index: int) -> Header:
    """A stamp and frame_id that name the robot and the frame: seconds 1000 x (robot + 1) + index."""
    return Header(stamp=Time(sec=1000 * (robot + 1) + index, nanosec=index),
                  frame_id=f"{ROBOTS[robot]}_camera")


# --- the robots' cameras (another process) ---------------------------------------------------

def run_cameras() -> int:
    """One camera node per robot, each publishing its own frames on <robot>/camera/image_raw with
    the sensor-data QoS of camera drivers, from "go" on the test's stdin until "done" or EOF."""
    rclpy.init()
    nodes = [rclpy.create_node("camera", namespace=name) for name in ROBOTS]
    publishers = [node.create_publisher(Image, TOPIC, qos_profile_sensor_data) for node in nodes]
    lines = Lines()
    try:
        if not (wait_for(lambda: all(p.get_subscription_count() >= 1 for p in publishers), 30.0)
                and lines.wait("go")):
            print("cameras: the vision nodes never matched, or the test never said go", file=sys.stderr)
            return 2
        frames = [rgb_to_image(robot_image(k), "rgb8") for k in range(len(ROBOTS))]
        next_frame = time.monotonic()
        for index in range(MAX_FRAMES):
            for k, (pub, msg) in enumerate(zip(publishers, frames)):
                msg.header = robot_header(k, index)
                pub.publish(msg)
            next_frame += 1 / RATE_HZ
            while not lines.done and time.monotonic() < next_frame:
                lines.read(next_frame - time.monotonic())
            if lines.done:
                return 0
        return 0
    finally:
        for node in nodes:
            node.destroy_node()
        rclpy.try_shutdown()


# --- the test ----------------------------------------------------------------------------------

@pytest.fixture
def graph():
    g = RosGraph()
    yield g
    g.close()


def test_four_robots_on_one_engine_get_only_their_own_results(graph, tmp_path):
    # The robots' cameras start first: their process's start-up overlaps the model's loading.
    log = tmp_path / "cameras.log"
    with open(log, "w") as out:
        cameras = subprocess.Popen([sys.executable, str(Path(__file__).resolve())], stdin=subprocess.PIPE,
                                   stdout=out, stderr=subprocess.STDOUT, text=True, env=camera_env())
    try:
        nodes = build_graph(DEFAULT_CONFIG, "vision", namespaces=ROBOTS, remaps=[f"image:={TOPIC}"],
                            context=graph.context,
                            overrides={"vision": {"model": str(checkpoint()), "detect": ["cup"], "max_objects": 1,
                                                  "publish_annotated": False, "max_frame_age_s": 600.0}})
        assert sorted(n.get_fully_qualified_name() for n in nodes) == [f"/{r}/vision" for r in ROBOTS]
        for node in nodes:
            graph.add(node)
        assert wait_for(lambda: all(n.engine is not None or n.model_error for n in nodes), timeout=60)
        assert all(n.engine is not None for n in nodes), [n.model_error for n in nodes]
        engine = nodes[0].engine
        assert all(n.engine is engine for n in nodes)          # one model, one batcher for all robots
        # The vision nodes resolve the relative remap inside their own namespaces.
        assert [n.subscription.topic_name for n in nodes] == [f"/{r}/{TOPIC}" for r in ROBOTS]

        got = {r: [] for r in ROBOTS}
        listener = graph.node("fleet_listener")
        for r in ROBOTS:
            listener.create_subscription(Detections, f"/{r}/detections", got[r].append, RELIABLE)
        unnamespaced = []
        listener.create_subscription(Detections, "/detections", unnamespaced.append, RELIABLE)
        assert wait_for(lambda: all(listener.count_publishers(f"/{r}/detections") == 1 for r in ROBOTS), 10)
        warmed = len(engine.batcher.sizes)   # the nodes' warm-up batches are not the robots' frames
        cameras.stdin.write("go\n")
        cameras.stdin.flush()
        served = lambda: engine.batcher.sizes[warmed:]  # noqa: E731
        assert wait_for(lambda: all(len(got[r]) >= RESULTS_EACH for r in ROBOTS) and max(served(), default=0) > 1
                        or cameras.poll() is not None, timeout=30), \
            ({r: len(got[r]) for r in ROBOTS}, served(), log.read_text()[-2000:])
        assert cameras.poll() is None, log.read_text()[-2000:]
        cameras.stdin.write("done\n")
        cameras.stdin.flush()
        assert cameras.wait(timeout=30) == 0, log.read_text()[-2000:]
    finally:
        if cameras.poll() is None:
            cameras.kill()
        cameras.wait(timeout=10)

    # Several robots' frames went through the model in one batch (one request per frame here).
    assert max(served()) > 1, served()
    # What the model gives for each robot's image alone: a result from another robot's frame shows.
    want = {}
    for k, r in enumerate(ROBOTS):
        (result,) = engine.batcher.submit(frame_requests(robot_image(k), ["cup"], [], None, 1))
        want[r] = [box[c] for box in result["objects"] for c in ("x_min", "y_min", "x_max", "y_max")]
    assert len({tuple(w) for w in want.values()}) == len(ROBOTS), want   # the robots' answers differ
    for k, r in enumerate(ROBOTS):
        for msg in got[r]:
            index = msg.header.stamp.sec - 1000 * (k + 1)
            assert 0 <= index < MAX_FRAMES and msg.header == robot_header(k, index), (r, msg.header)
            boxes = [v for d in msg.detections for v in (d.x_min, d.y_min, d.x_max, d.y_max)]
            assert boxes == pytest.approx(want[r], abs=1e-6), (r, boxes, want)
    assert unnamespaced == []


def test_robots_waiting_on_the_engine_leave_the_process_serving(graph, monkeypatch):
    """The executor run_node and spin_nodes spin (bringup --namespaces) on a 2-core computer: while
    an infer request of each robot waits on the engine (a long decode; here its lock is held), the
    process still serves a lifecycle manager and publishes /diagnostics. With a thread per core,
    the two requests held both threads until the decode ended."""
    import os
    import threading

    from diagnostic_msgs.msg import DiagnosticArray
    from lifecycle_msgs.srv import GetState

    from photon_ros.run_node import make_executor
    from photon_ros.srv import Infer

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)   # as on a 2-core robot
    robots = ROBOTS[:2]
    nodes = build_graph(DEFAULT_CONFIG, "vision", namespaces=robots, context=graph.context,
                        overrides={"vision": {"model": str(checkpoint()), "detect": ["cup"], "max_objects": 1,
                                              "publish_annotated": False, "max_frame_age_s": 600.0,
                                              "reliability": "reliable"}})
    executor = make_executor(nodes, context=graph.context)
    spinner = ExecutorThread(executor, graph.context)
    try:
        assert wait_for(lambda: all(n.engine is not None or n.model_error for n in nodes), timeout=120)
        assert all(n.engine is not None for n in nodes), [n.model_error for n in nodes]
        client = graph.node("fleet_client")
        diagnostics = []
        client.create_subscription(DiagnosticArray, "/diagnostics",
                                   lambda m: diagnostics.append((time.monotonic(), m.status[0].name)), RELIABLE)
        cameras = [client.create_publisher(Image, f"/{r}/image", RELIABLE) for r in robots]
        infer = [client.create_client(Infer, f"/{r}/infer") for r in robots]
        get_state = client.create_client(GetState, f"/{robots[0]}/vision/get_state")
        assert all(c.wait_for_service(timeout_sec=30) for c in infer + [get_state])
        assert wait_for(lambda: all(p.get_subscription_count() >= 1 for p in cameras), 10)
        assert wait_for(lambda: [p.publish(rgb_to_image(robot_image(k))) for k, p in enumerate(cameras)]
                        and all(n.frames.latest is not None for n in nodes), timeout=30, poll=0.2)

        with nodes[0].engine.lock:   # every robot's decode waits for it
            asked = [c.call_async(Infer.Request(task="detect", prompt="cup", use_latest_frame=True)) for c in infer]
            assert wait_for(lambda: all(n.activity._busy for n in nodes), timeout=30)   # both requests wait
            held = time.monotonic()
            state = get_state.call_async(GetState.Request())
            # (the requests wait for as long as the test holds the lock: a generous wait tells "not
            # at all" from "late on a busy machine")
            assert wait_for(state.done, timeout=60), "no lifecycle service while the robots' requests waited"
            assert state.result().current_state.label == "active"
            assert wait_for(lambda: any(at > held for at, name in diagnostics if robots[1] in name), timeout=60), \
                "no /diagnostics while the robots' requests waited"
        assert wait_for(lambda: all(f.done() for f in asked), timeout=60)
        assert all(f.result().success for f in asked), [f.result().message for f in asked]
    finally:
        spinner.stop()
        for node in nodes:
            executor.remove_node(node)
            node.destroy_node()
        executor.shutdown()


if __name__ == "__main__":
    sys.exit(run_cameras())
