"""ROS path benchmark: what the graph costs around the model.

    python bench/ros.py [--write]

1. Conversion: sensor_msgs/Image -> RGB array (rgb8 zero-copy view, bgr8 converted) and
   CompressedImage (jpeg) decode, at 640x480 and 1920x1080; p50 / p99.
2. Transport: Image publish -> subscriber callback over DDS on this machine, p50 / p99.
3. End to end with the small random Moondream checkpoint: camera stamp -> Detections received.
4. Throughput with 1, 2, 4 and 8 camera streams into one vision engine (one process), with the
   engine batching concurrent requests (up to 8) and serving them one at a time (max_batch 1).
5. A camera in another process: rgb8 frames at 30 Hz from a publisher process to a subscriber
   process with the vision node's QoS, 640x480 and 1920x1080, best effort (sensor data) and
   reliable, with config/fastdds_large_data.xml and with Fast DDS's defaults; p50 / p99 from the
   camera's stamp to the callback, frames received / sent. `--only cross-process` runs just this.
Run it in the development environment (scripts/dev_env.sh: discovery stays on this machine).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "test"))
sys.path.insert(0, str(ROOT / "bench"))
os.environ.setdefault("ROS_AUTOMATIC_DISCOVERY_RANGE", "LOCALHOST")

import rclpy  # noqa: E402
from rclpy.parameter import Parameter  # noqa: E402
from rclpy.qos import HistoryPolicy, QoSProfile, ReliabilityPolicy, qos_profile_sensor_data  # noqa: E402
from sensor_msgs.msg import Image  # noqa: E402
from std_msgs.msg import Header  # noqa: E402

from photon_ros.image_conversions import compressed_to_rgb, image_to_rgb, rgb_to_compressed, rgb_to_image  # noqa: E402
from photon_ros.msg import Detections  # noqa: E402
from photon_ros.result_messages import time_to_seconds, seconds_to_time  # noqa: E402
from ros_harness import RosGraph, wait_for, wait_for_match  # noqa: E402
from report import heading, publish  # noqa: E402

SIZES = {"640x480": (480, 640), "1920x1080": (1080, 1920)}
RELIABLE = QoSProfile(depth=10, reliability=ReliabilityPolicy.RELIABLE)
PROFILE = ROOT / "config" / "fastdds_large_data.xml"
PROFILE_VARIABLES = ("FASTDDS_DEFAULT_PROFILES_FILE", "FASTRTPS_DEFAULT_PROFILES_FILE")


def pct(values: list[float]) -> tuple[float, float]:
    return float(np.percentile(values, 50)) * 1000, float(np.percentile(values, 99)) * 1000


def bench_conversions(repeats: int) -> list[tuple[str, float, float]]:
    rows = []
    rng = np.random.default_rng(0)
    for name, (h, w) in SIZES.items():
        rgb = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        for label, msg, fn in [("rgb8", rgb_to_image(rgb, "rgb8"), image_to_rgb),
                               ("bgr8", rgb_to_image(rgb, "bgr8"), image_to_rgb),
                               ("jpeg", rgb_to_compressed(rgb, "jpeg"), compressed_to_rgb)]:
            times = []
            for _ in range(repeats):
                t = time.perf_counter()
                fn(msg)
                times.append(time.perf_counter() - t)
            rows.append((f"convert {label} {name}", *pct(times)))
    return rows


def bench_transport(graph: RosGraph, repeats: int) -> list[tuple[str, float, float]]:
    rows = []
    for name, (h, w) in SIZES.items():
        arrivals: dict[int, float] = {}
        node = graph.node(f"transport_{name.replace('x', '_')}")
        topic = f"bench_image_{name.replace('x', '_')}"
        node.create_subscription(Image, topic, lambda m: arrivals.setdefault(m.header.stamp.nanosec, time.perf_counter()), RELIABLE)
        pub = node.create_publisher(Image, topic, RELIABLE)
        wait_for_match(pub)
        msg = rgb_to_image(np.zeros((h, w, 3), np.uint8))
        sent = {}
        for i in range(repeats):
            msg.header.stamp.nanosec = i
            sent[i] = time.perf_counter()
            pub.publish(msg)
            wait_for(lambda: i in arrivals, timeout=5, poll=0.0005)
        rows.append((f"DDS publish -> callback, Image {name}", *pct([arrivals[i] - sent[i] for i in sent if i in arrivals])))
    return rows


def vision_graph(graph: RosGraph, streams: int, checkpoint: str):
    from photon_ros.vision_node import VisionNode

    nodes = []
    for s in range(streams):
        nodes.append(graph.add(VisionNode(context=graph.context, namespace=f"cam{s}", parameter_overrides=[
            Parameter("model", value=checkpoint), Parameter("detect", value=["cup"]),
            Parameter("max_objects", value=1), Parameter("reliability", value="reliable")])))
    assert wait_for(lambda: all(n.engine is not None for n in nodes), timeout=120)
    return nodes


def bench_end_to_end(graph: RosGraph, checkpoint: str, repeats: int) -> list[tuple[str, float, float]]:
    vision_graph(graph, 1, checkpoint)
    got: list[tuple[float, float]] = []
    node = graph.node("e2e")
    node.create_subscription(Detections, "/cam0/detections",
                             lambda m: got.append((time_to_seconds(m.header.stamp), time.time())), RELIABLE)
    pub = node.create_publisher(Image, "/cam0/image", RELIABLE)
    wait_for_match(pub)
    rgb = np.random.default_rng(1).integers(0, 256, (480, 640, 3), dtype=np.uint8)
    for i in range(repeats):
        n = len(got)
        pub.publish(_stamped(rgb))
        wait_for(lambda: len(got) > n, timeout=60, poll=0.001)
    return [("camera stamp -> Detections received (640x480, 1 object)", *pct([r - s for s, r in got]))]


def _stamped(rgb):
    msg = rgb_to_image(rgb)
    msg.header.stamp = seconds_to_time(time.time())
    return msg


def bench_streams(checkpoint: str, seconds: float, counts=(1, 2, 4, 8)) -> list[tuple[int, float, float]]:
    """(streams, frames/s with requests batched, frames/s one request at a time) per stream count."""
    rows = []
    for streams in counts:
        rates = []
        for max_batch in (8, 1):                    # batched, then the engine serving one at a time
            graph = RosGraph()
            try:
                nodes = vision_graph(graph, streams, checkpoint)
                nodes[0].engine.batcher.max_batch = max_batch
                rates.append(_frames_per_second(graph, streams, seconds))
                nodes[0].engine.batcher.max_batch = 8
            finally:
                graph.close()
        rows.append((streams, *rates))
    return rows


def _frames_per_second(graph: RosGraph, streams: int, seconds: float) -> float:
    counts = [0] * streams
    cam = graph.node("cameras")
    for s in range(streams):
        cam.create_subscription(Detections, f"/cam{s}/detections",
                                lambda m, s=s: counts.__setitem__(s, counts[s] + 1), RELIABLE)
    pubs = [cam.create_publisher(Image, f"/cam{s}/image", RELIABLE) for s in range(streams)]
    for p in pubs:
        wait_for_match(p)
    msg = rgb_to_image(np.random.default_rng(2).integers(0, 256, (480, 640, 3), dtype=np.uint8))
    warm = time.monotonic() + 1.0                   # the first frames pay for allocations: not counted
    stop, start = warm + seconds, None
    while time.monotonic() < stop:                  # 30 Hz cameras
        if start is None and time.monotonic() >= warm:
            start = sum(counts)
        for p in pubs:
            p.publish(msg)
        time.sleep(1 / 30)
    return (sum(counts) - start) / seconds


# --- 5. camera in another process ----------------------------------------------------------------

def camera_process(topic: str, width: int, height: int, reliability: str, frames: int) -> int:
    """A camera driver: `frames` rgb8 frames at 30 Hz, stamped with the wall clock at publish."""
    rclpy.init()
    node = rclpy.create_node("bench_camera")
    qos = qos_profile_sensor_data if reliability == "best_effort" else QoSProfile(
        depth=5, reliability=ReliabilityPolicy.RELIABLE)
    pub = node.create_publisher(Image, topic, qos)
    try:
        if not wait_for(lambda: pub.get_subscription_count() >= 1, timeout=30):
            return 2
        msg = rgb_to_image(np.random.default_rng(3).integers(0, 256, (height, width, 3), dtype=np.uint8))
        start = time.monotonic()
        for i in range(frames):
            msg.header = Header(stamp=seconds_to_time(time.time()), frame_id=str(i))
            pub.publish(msg)
            time.sleep(max(0.0, start + (i + 1) / 30 - time.monotonic()))
        # Stay while the listener takes what is in flight (reliable resends need the writer).
        wait_for(lambda: pub.get_subscription_count() == 0, timeout=10)
        return 0
    finally:
        node.destroy_node()
        rclpy.try_shutdown()


def listener_process(topic: str, reliability: str, frames: int) -> int:
    """The vision node's subscription (depth 1); prints {"latencies": [...]} as JSON."""
    rclpy.init()
    node = rclpy.create_node("bench_listener")
    policy = ReliabilityPolicy.RELIABLE if reliability == "reliable" else ReliabilityPolicy.BEST_EFFORT
    latencies: list[float] = []
    last = [-1]

    def on_image(msg: Image) -> None:
        latencies.append(time.time() - time_to_seconds(msg.header.stamp))
        last[0] = int(msg.header.frame_id)

    sub = node.create_subscription(Image, topic, on_image,
                                   QoSProfile(depth=1, history=HistoryPolicy.KEEP_LAST, reliability=policy))
    try:
        matched = time.monotonic() + 30
        while sub.get_publisher_count() < 1 and time.monotonic() < matched:
            rclpy.spin_once(node, timeout_sec=0.05)
        # The camera needs frames / 30 s; frames lost at the end are waited for a few seconds only.
        deadline = time.monotonic() + frames / 30 + 5
        while last[0] < frames - 1 and time.monotonic() < deadline:
            rclpy.spin_once(node, timeout_sec=0.05)
        print(json.dumps({"latencies": latencies}))
        return 0
    finally:
        node.destroy_node()
        rclpy.try_shutdown()


def child_env(profile: Path | None) -> dict[str, str]:
    """This environment with only `profile` (None: Fast DDS's defaults), discovery on localhost."""
    env = {k: v for k, v in os.environ.items() if k not in PROFILE_VARIABLES}
    env["ROS_AUTOMATIC_DISCOVERY_RANGE"] = "LOCALHOST"
    if profile is not None:
        env["FASTDDS_DEFAULT_PROFILES_FILE"] = str(profile)
    return env


def cross_process_once(size: str, reliability: str, profile: Path | None, frames: int) -> list[float]:
    """Latencies of the frames that reached the listener process from the camera process."""
    (h, w), env = SIZES[size], child_env(profile)
    topic = f"/bench_cross_process/image_{os.getpid()}_{time.monotonic_ns()}"
    me = [sys.executable, str(Path(__file__).resolve())]
    listener = subprocess.Popen(me + ["--listen", topic, reliability, str(frames)], env=env,
                                stdout=subprocess.PIPE, text=True)
    camera = subprocess.Popen(me + ["--camera", topic, str(w), str(h), reliability, str(frames)], env=env)
    try:
        out, _ = listener.communicate(timeout=frames / 30 + 90)
        camera.wait(timeout=30)
        return json.loads(out.strip().splitlines()[-1])["latencies"]
    finally:
        for child in (listener, camera):
            if child.poll() is None:
                child.kill()
            child.wait()


def bench_cross_process(frames: int) -> list[tuple[str, str, str, list[float]]]:
    rows = []
    for label, profile in (("fastdds_large_data.xml", PROFILE), ("Fast DDS defaults", None)):
        for size in SIZES:
            for reliability in ("best_effort", "reliable"):
                rows.append((label, size, reliability, cross_process_once(size, reliability, profile, frames)))
    return rows


def cross_process_lines(rows, frames: int) -> list[str]:
    lines = [f"Camera in another process: {frames} rgb8 frames at 30 Hz from a publisher process to a "
             "subscriber process with the vision node's QoS (depth 1); camera stamp -> callback:", "",
             "| DDS profile | image | QoS | p50 ms | p99 ms | frames received / sent |",
             "|---|---|---|---:|---:|---:|"]
    for label, size, reliability, latencies in rows:
        cells = "{:.2f} | {:.2f}".format(*pct(latencies)) if latencies else "- | -"
        lines.append(f"| {label} | {size} | {reliability} | {cells} | {len(latencies)} / {frames} |")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--seconds", type=float, default=10.0, help="per stream-count throughput run")
    parser.add_argument("--write", action="store_true")
    parser.add_argument("--only", choices=["all", "cross-process"], default="all")
    parser.add_argument("--frames", type=int, default=90, help="per camera-in-another-process run")
    parser.add_argument("--camera", nargs=5, help=argparse.SUPPRESS)   # the child processes of part 5
    parser.add_argument("--listen", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.camera:
        topic, w, h, reliability, frames = args.camera
        return camera_process(topic, int(w), int(h), reliability, int(frames))
    if args.listen:
        topic, reliability, frames = args.listen
        return listener_process(topic, reliability, int(frames))
    if args.only == "cross-process":
        lines = heading("ROS path: camera in another process")
        publish(lines + cross_process_lines(bench_cross_process(args.frames), args.frames), args.write)
        return 0
    import moondream_fixtures

    checkpoint = str(moondream_fixtures.checkpoint())
    rows = bench_conversions(args.repeats)
    graph = RosGraph()
    try:
        rows += bench_transport(graph, args.repeats)
        rows += bench_end_to_end(graph, checkpoint, min(args.repeats, 10))
    finally:
        graph.close()
    stream_rows = bench_streams(checkpoint, args.seconds)
    lines = heading("ROS path") + ["| what | p50 ms | p99 ms |", "|---|---:|---:|"]
    lines += [f"| {n} | {a:.2f} | {b:.2f} |" for n, a, b in rows]
    lines += ["", "Camera streams x 30 Hz into one engine (detect 1 object per frame), frames/s processed:", "",
              "| streams | batched | one request at a time | batched / one at a time |", "|---:|---:|---:|---:|"]
    lines += [f"| {n} | {b:.2f} | {one:.2f} | {b / one:.2f}x |" for n, b, one in stream_rows]
    lines += [""] + cross_process_lines(bench_cross_process(args.frames), args.frames)
    publish(lines, args.write)
    return 0


if __name__ == "__main__":
    sys.exit(main())
