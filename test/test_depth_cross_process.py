"""3D from a camera in another process, over DDS, as depth-aligning drivers publish it: the colour
image first, its aligned depth (and, per frame, its camera_info) with the same stamp some
milliseconds later. The vision node (the small random checkpoint, detect and point) must place every
frame with the depth image of its own stamp, never a neighbour's, and say why when a frame's depth
never comes.

Every depth image is a flat wall at a distance that names its frame (1.000 m + 37 mm per frame,
modulo 16), and every per-frame camera_info a principal point that names it too (cx 62..66), so
a position tells which depth image and camera_info it was computed from: z is the depth's, x
moves 2 cm a frame with cx. The camera streams until the test has seen enough frames, then
stops; run as a script, this file is the camera."""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import rclpy
from builtin_interfaces.msg import Time
from rclpy.parameter import Parameter
from rclpy.qos import (DurabilityPolicy, HistoryPolicy, QoSProfile, ReliabilityPolicy,
                       qos_profile_sensor_data)
from sensor_msgs.msg import CameraInfo, Image
from std_msgs.msg import Header

from ros_harness import RosGraph, wait_for
from test_camera_cross_process import Lines, camera_env

T0 = 1_700_000_000                  # the first frame's stamp, s
WIDTH, HEIGHT, FX = 128, 96, 100.0
MAX_FRAMES = 600                    # the camera stops by itself after this many
LINE_TIMEOUT_S = 60.0
PRIMING_MM, PRIMING_CX = 500, 70.0  # the early depth and camera_info: no frame's wall or principal point


def stamp(index: int, rate_hz: float) -> Time:
    ns = round(index * 1e9 / rate_hz)
    return Time(sec=T0 + ns // 1_000_000_000, nanosec=ns % 1_000_000_000)


def index_of(t: Time, rate_hz: float) -> int:
    return round(((t.sec - T0) * 1e9 + t.nanosec) * rate_hz / 1e9)


def wall_mm(index: int) -> int:
    return 1000 + 37 * (index % 16)


def cx_of(index: int | None) -> float:
    """Per-frame camera_info's principal point (None: the latched one's)."""
    return 64.0 if index is None else 62.0 + index % 5


def colour(index: int, stamp_: Time) -> Image:
    rgb = np.random.default_rng(5).integers(0, 256, (HEIGHT, WIDTH, 3), dtype=np.uint8)
    return Image(header=Header(stamp=stamp_, frame_id="camera_color_optical_frame"), height=HEIGHT, width=WIDTH,
                 encoding="rgb8", step=WIDTH * 3, data=rgb.tobytes())


def depth(index: int | None, stamp_: Time) -> Image:
    """index None: the early depth image, a wall no frame has (PRIMING_MM)."""
    mm = np.full((HEIGHT, WIDTH), PRIMING_MM if index is None else wall_mm(index), "<u2")
    return Image(header=Header(stamp=stamp_, frame_id="camera_color_optical_frame"), height=HEIGHT, width=WIDTH,
                 encoding="16UC1", step=WIDTH * 2, data=mm.tobytes())


def camera_info(index: int | None, stamp_: Time, cx: float | None = None) -> CameraInfo:
    cx, cy = cx_of(index) if cx is None else cx, 48.0
    return CameraInfo(header=Header(stamp=stamp_, frame_id="camera_color_optical_frame"), width=WIDTH,
                      height=HEIGHT, distortion_model="plumb_bob", d=[0.0] * 5,
                      k=[FX, 0.0, cx, 0.0, FX, cy, 0.0, 0.0, 1.0], r=[1.0, 0, 0, 0, 1.0, 0, 0, 0, 1.0],
                      p=[FX, 0.0, cx, 0.0, 0.0, FX, cy, 0.0, 0.0, 0.0, 1.0, 0.0])


LATCHED = QoSProfile(depth=1, history=HistoryPolicy.KEEP_LAST, reliability=ReliabilityPolicy.RELIABLE,
                     durability=DurabilityPolicy.TRANSIENT_LOCAL)


# --- the camera process ----------------------------------------------------------------------

def run_camera(prefix: str, rate_hz: float, lag_ms: float, info_mode: str, skip_every: int) -> int:
    """Colour at rate_hz; `lag_ms` later its depth (none for every skip_every-th frame) and, with
    info_mode per_frame, its camera_info. latched: one camera_info, published at once (before
    any subscriber can have matched) with a latched QoS, stamped 0."""
    rclpy.init()
    node = rclpy.create_node("depth_camera")
    images = node.create_publisher(Image, f"{prefix}/color/image_raw", qos_profile_sensor_data)
    depths = node.create_publisher(Image, f"{prefix}/aligned_depth_to_color/image_raw", qos_profile_sensor_data)
    infos = node.create_publisher(CameraInfo, f"{prefix}/color/camera_info",
                                  LATCHED if info_mode == "latched" else qos_profile_sensor_data)
    if info_mode == "latched":
        infos.publish(camera_info(None, Time()))
    lines = Lines()
    try:
        # camera_info per frame too: a first frame sent before its subscription matched would pair
        # with no camera_info of its own (a latched one is delivered on matching, whenever that is)
        if not wait_for(lambda: images.get_subscription_count() >= 1 and depths.get_subscription_count() >= 1
                        and (info_mode == "latched" or infos.get_subscription_count() >= 1), LINE_TIMEOUT_S):
            print("camera: the vision node never matched", file=sys.stderr)
            return 2
        # The graph's counts say both ends are known, not that the reader has matched this writer
        # yet: a message sent in between is dropped before the node can number it (its first
        # frame's depth and camera_info paired with frame 1's, 1 CI run in ~10). So depth and
        # camera_info stamped long before the first frame (outside any tolerance: depth never
        # pairs with them; camera_info only by its newest fallback, when the frame's own is lost
        # or late, which the node counts) go out until the test has seen the node receive both
        # and says "go".
        deadline, priming = time.monotonic() + LINE_TIMEOUT_S, 0
        while not lines.wait("go", 0.05) and not lines.done and time.monotonic() < deadline:
            early = Time(sec=T0 - 200 + priming // 20, nanosec=priming % 20 * 50_000_000)
            depths.publish(depth(None, early))
            if info_mode == "per_frame":
                infos.publish(camera_info(None, early, PRIMING_CX))
            priming += 1
        if "go" not in lines.seen:
            print("camera: the test never said go", file=sys.stderr)
            return 2
        start = time.monotonic() + 0.05
        for index in range(MAX_FRAMES):
            lines.read(0)
            if lines.done:
                break
            at, t = start + index / rate_hz, stamp(index, rate_hz)
            time.sleep(max(at - time.monotonic(), 0))
            images.publish(colour(index, t))
            time.sleep(max(at + lag_ms / 1000 - time.monotonic(), 0))
            if not (skip_every and index % skip_every == skip_every - 1):
                depths.publish(depth(index, t))
            if info_mode == "per_frame":
                infos.publish(camera_info(index, t))
        lines.wait("done")
        # The last frame's best-effort messages may still be on their way: a writer destroyed at
        # once can drop them, and that frame would read as paired with a neighbour's.
        time.sleep(0.5)
        return 0
    finally:
        node.destroy_node()
        rclpy.try_shutdown()


# --- the test --------------------------------------------------------------------------------

@pytest.fixture
def graph():
    g = RosGraph()
    yield g
    g.close()


def start_vision(graph, prefix: str, tolerance: float):
    from moondream_fixtures import checkpoint
    from photon_ros.vision_node import VisionNode

    remaps = {"image": f"{prefix}/color/image_raw", "depth": f"{prefix}/aligned_depth_to_color/image_raw",
              "camera_info": f"{prefix}/color/camera_info"}
    params = {"model": str(checkpoint()), "max_objects": 2, "detect": ["cup"], "point": ["dog"], "use_depth": True,
              "depth_tolerance_s": tolerance, "tracking": False, "publish_annotated": False}
    node = graph.add(VisionNode(context=graph.context,
                                cli_args=["--ros-args", *[a for k, v in remaps.items() for a in ("-r", f"{k}:={v}")]],
                                parameter_overrides=[Parameter(k, value=v) for k, v in params.items()]))
    assert wait_for(lambda: node.engine is not None or node.model_error, timeout=120)
    assert node.engine is not None, node.model_error
    return node


def check(msg, rate_hz: float, info_mode: str, skip_every: int, tolerance: float) -> tuple[str, str]:
    """(kind, problem): kind "placed" or "no depth", problem "" when the message is right."""
    index = index_of(msg.header.stamp, rate_hz)
    if msg.header.stamp != stamp(index, rate_hz):
        return "?", f"stamp {msg.header.stamp} is no frame's"
    if skip_every and index % skip_every == skip_every - 1:
        expected = f"no depth image stamped within {tolerance:g} s of this frame arrived within"
        if expected not in msg.depth_note or any(o.has_position for o in msg.objects):
            return "no depth", f"frame {index} (no depth sent): note {msg.depth_note!r}"
        return "no depth", ""
    if msg.depth_note or not msg.objects:
        return "placed", f"frame {index}: note {msg.depth_note!r}, {len(msg.objects)} objects"
    z, cx = wall_mm(index) / 1000, cx_of(index if info_mode == "per_frame" else None)
    for o in msg.objects:
        if not o.has_position:
            return "placed", f"frame {index}: {o.label} not placed ({o.reason})"
        u = (max(o.x_min_px, 0.0) + min(o.x_max_px, WIDTH)) / 2 - 0.5
        if abs(o.pose.position.z - z) > 1e-4:
            paired = [i for i in range(index - 8, index + 8) if abs(wall_mm(i) / 1000 - o.pose.position.z) < 1e-4]
            return "placed", f"frame {index}: z {o.pose.position.z:.4f} m is frame(s) {paired}'s depth, not its own"
        if abs(o.pose.position.x - (u - cx) / FX * z) > 1e-4:
            return "placed", f"frame {index}: x {o.pose.position.x:.4f} m is not from its own camera_info (cx {cx})"
    return "placed", ""


def run(graph, tmp_path, rate_hz: float, lag_ms: float, info_mode: str, skip_every: int, tolerance: float,
        enough: int) -> tuple[dict, list[str], object, tuple[int, int]]:
    from photon_ros.msg import Objects3D

    prefix = f"/depthx_{rate_hz:g}_{info_mode}_{time.monotonic_ns()}".replace(".", "_")
    node = start_vision(graph, prefix, tolerance)
    seen, problems = {"placed": 0, "no depth": 0}, []

    def on_objects(msg) -> None:
        kind, problem = check(msg, rate_hz, info_mode, skip_every, tolerance)
        seen[kind] = seen.get(kind, 0) + 1
        if problem:
            problems.append(problem)
    listener = graph.node("objects_listener").create_subscription(
        Objects3D, "objects_3d", on_objects, QoSProfile(depth=50, reliability=ReliabilityPolicy.RELIABLE))
    log = tmp_path / "camera.log"
    with open(log, "w") as out:
        camera = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), prefix, str(rate_hz), str(lag_ms),
                                   info_mode, str(skip_every)],
                                  stdin=subprocess.PIPE, stdout=out, stderr=subprocess.STDOUT, text=True,
                                  env=camera_env())

    def tell(line: str) -> None:
        try:
            camera.stdin.write(line + "\n")
            camera.stdin.flush()
        except (OSError, ValueError):
            pass
    try:
        subs = node.depth_subscriptions[:2] + [node.subscription]
        assert wait_for(lambda: all(s.get_publisher_count() >= 1 for s in subs) or camera.poll() is not None, 60)
        assert wait_for(lambda: node.pub_objects_3d.get_subscription_count() >= 1 and listener.get_publisher_count()
                        >= 1, 10)
        # the camera's early depth and camera_info (a latched one: sent before anything matched, it
        # comes through the latched subscription) have reached the node: every later loss is numbered
        assert wait_for(lambda: node.depth_stream.received >= 1 and node.info_stream.received >= 1
                        or camera.poll() is not None, 30)
        # early messages lost so far (a busy node's shallow queue overwrote them): no frame's
        primed_lost = (node.depth_health.lost_in_transport, node.info_health.lost_in_transport)
        tell("go")
        wants = {"placed": enough, "no depth": enough if skip_every else 0}
        wait_for(lambda: all(seen[k] >= n for k, n in wants.items()) or problems or camera.poll() is not None,
                 timeout=120)
        tell("done")
        code = camera.wait(timeout=60)
    finally:
        if camera.poll() is None:
            camera.kill()
        camera.wait(timeout=10)
    assert code == 0, log.read_text()[-2000:]
    return seen, problems, node, primed_lost


@pytest.mark.parametrize("rate_hz", [15, 30])
def test_every_frame_is_placed_with_its_own_depth_and_camera_info(graph, tmp_path, rate_hz):
    """Depth and camera_info 30 ms after their colour frame. The tolerance, 0.25 s, holds several
    neighbours of each frame (3 each side at 15 Hz, 7 at 30 Hz), and the previous depth image is
    there when the frame arrives; still each frame pairs with its own. (It also leaves room for a
    loaded test machine holding a message back by 100 ms or more.) Checked on every processed
    frame's positions, and on every frame that arrived by the node's pairing counts (exact but the excused)."""
    seen, problems, node, primed_lost = run(graph, tmp_path, rate_hz, 30, "per_frame", 0, tolerance=0.25, enough=6)
    # A frame whose own depth image never came in time (lost in transport: best-effort QoS, a
    # loaded machine; or late: it reached the node after the frame's deadline, or its callback
    # ran after the decision) takes the nearest within the tolerance, as ApproximateTime would, or
    # none: allowed only for as many frames as the node counted such depth images, never otherwise.
    # The same for camera_info. (Losses counted before "go" were the camera's early messages, no frame's.
    # One lost after it is counted as a frame's: a slightly larger excuse, never a smaller one.)
    depth, info = node.depth_stream, node.info_stream
    depth_excused = node.depth_health.lost_in_transport - primed_lost[0] + depth.late + depth.seen_late
    info_excused = node.info_health.lost_in_transport - primed_lost[1] + info.late + info.seen_late
    counts = {"primed_lost": primed_lost,
              "depth": (node.depth_health.lost_in_transport, depth.late, depth.seen_late, depth.outcomes),
              "camera_info": (node.info_health.lost_in_transport, info.late, info.seen_late, info.outcomes)}
    neighbour = [p for p in problems if "depth, not its own" in p or "no depth image" in p]
    other_info = [p for p in problems if "not from its own camera_info" in p or "camera_info" in p.partition(":")[2]]
    assert len({p.split(":")[0] for p in neighbour}) <= depth_excused, (problems[:5], counts)
    assert len({p.split(":")[0] for p in other_info}) <= info_excused, (problems[:5], counts)
    assert [p for p in problems if p not in neighbour + other_info] == [], problems[:5]
    assert seen["placed"] >= 6, seen
    frames = seen["placed"] // 2     # each frame's detect and point results
    assert depth.outcomes["exact"] >= frames - depth_excused, counts
    assert depth.outcomes["nearest"] + depth.outcomes["none"] <= depth_excused, counts
    assert info.outcomes["exact"] >= frames - info_excused, counts
    assert info.outcomes["nearest"] + info.outcomes["none"] + info.outcomes["newest"] <= info_excused, counts


def test_latched_camera_info_and_depth_that_never_comes(graph, tmp_path):
    """2.5 Hz, depth 10 ms after colour but never for every third frame, a tolerance of 0.3 s (the
    neighbours, 400 ms away, are outside it; a camera process a loaded machine holds up between a
    frame and its depth still has 290 ms), and one camera_info published once with a latched QoS
    before the node matched. Frames with depth are placed with their own; the others have no
    position and say why, never a neighbour's depth."""
    seen, problems, node, _ = run(graph, tmp_path, 2.5, 10, "latched", 3, tolerance=0.3, enough=3)
    assert problems == [], problems[:5]
    assert seen["placed"] >= 3 and seen["no depth"] >= 3, seen
    assert node.latched_info.subscription is not None and node.info_stream.outcomes["none"] == 0
    assert node.depth_stream.outcomes["nearest"] == 0, node.depth_stream.outcomes


if __name__ == "__main__":
    sys.exit(run_camera(sys.argv[1], float(sys.argv[2]), float(sys.argv[3]), sys.argv[4], int(sys.argv[5])))
