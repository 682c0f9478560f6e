"""Depth pairing benchmark: how many colour frames get 3D, from their own depth, and what waiting for
it adds, with the camera in another process over DDS.

    python bench/depth_pairing.py [--frames 60] [--rates 15,30] [--lags 0,10,20,30,40] [--write]

A camera process (this file, run with --camera) publishes 640x480 rgb8 frames at each rate and,
`lag` ms after each, its aligned depth (16UC1) and camera_info with the frame's stamp, as
depth-aligning drivers do. The vision node (the small random Moondream checkpoint on the CPU,
detect and point, use_depth, the default depth_tolerance_s 0.05) runs in this process, one node per
row. Per row:

- frames with 3D: of every colour frame that arrived (the node's pairing of each, processed by
  the model or not), how many paired with a depth image, and with their own stamp's; of the frames
  the model processed, how many were published with positions (Objects3D without a depth_note);
- pairing delay: from a frame's arrival to its pairing being decided (its depth arrived, or the
  tolerance ran out): what a frame waits for its depth at most. The node waits while the model
  runs, so this is what a model faster than the lag would add per frame;
- held back: what was added here, per processed frame: how long its results waited for the pairing
  after the model had finished (0 when the model takes longer than the depth's lag);
- own depth there at arrival: frames whose own depth had reached the node before them (what
  pairing with what is there, without waiting, could have found; the node before this pairing
  paired when the model took the frame, with the depth images received by then).
"""
from __future__ import annotations

import argparse
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
from builtin_interfaces.msg import Time  # noqa: E402
from rclpy.parameter import Parameter  # noqa: E402
from rclpy.qos import QoSProfile, ReliabilityPolicy, qos_profile_sensor_data  # noqa: E402
from sensor_msgs.msg import CameraInfo, Image  # noqa: E402
from std_msgs.msg import Header  # noqa: E402

from report import heading, publish  # noqa: E402
from ros_harness import RosGraph, wait_for  # noqa: E402
from test_camera_cross_process import Lines, camera_env  # noqa: E402

WIDTH, HEIGHT, FX = 640, 480, 525.0
T0 = 1_700_000_000


def stamp(index: int, rate_hz: float) -> Time:
    ns = round(index * 1e9 / rate_hz)
    return Time(sec=T0 + ns // 1_000_000_000, nanosec=ns % 1_000_000_000)


# --- the camera process ----------------------------------------------------------------------

def camera(prefix: str, rate_hz: float, lag_ms: float, frames: int) -> int:
    rclpy.init()
    node = rclpy.create_node("bench_depth_camera")
    images = node.create_publisher(Image, f"{prefix}/color/image_raw", qos_profile_sensor_data)
    depths = node.create_publisher(Image, f"{prefix}/aligned_depth_to_color/image_raw", qos_profile_sensor_data)
    infos = node.create_publisher(CameraInfo, f"{prefix}/color/camera_info", qos_profile_sensor_data)
    rgb = np.random.default_rng(5).integers(0, 256, (HEIGHT, WIDTH, 3), dtype=np.uint8).tobytes()
    mm = np.full((HEIGHT, WIDTH), 1500, "<u2").tobytes()
    lines = Lines()
    try:
        if not (wait_for(lambda: min(p.get_subscription_count() for p in (images, depths, infos)) >= 1, 60)
                and lines.wait("go")):
            return 2
        start = time.monotonic() + 0.05
        # Colour i at start + i / rate, its depth and camera_info lag later (after the next colour
        # frame when the lag is longer than a frame's spacing), in time order.
        events = sorted([(start + i / rate_hz, 0, i) for i in range(frames)]
                        + [(start + i / rate_hz + lag_ms / 1000, 1, i) for i in range(frames)])
        sent_at: dict[int, float] = {}
        lags: list[float] = []          # depth published after its colour frame, as it happened
        for at, kind, index in events:
            header = Header(stamp=stamp(index, rate_hz), frame_id="camera_color_optical_frame")
            time.sleep(max(at - time.monotonic(), 0))
            if kind == 0:
                images.publish(Image(header=header, height=HEIGHT, width=WIDTH, encoding="rgb8", step=WIDTH * 3,
                                     data=rgb))
                sent_at[index] = time.monotonic()
                continue
            depths.publish(Image(header=header, height=HEIGHT, width=WIDTH, encoding="16UC1", step=WIDTH * 2, data=mm))
            lags.append(time.monotonic() - sent_at[index])
            infos.publish(CameraInfo(header=header, width=WIDTH, height=HEIGHT, distortion_model="plumb_bob",
                                     d=[0.0] * 5, k=[FX, 0.0, 319.5, 0.0, FX, 239.5, 0.0, 0.0, 1.0]))
        print(f"sent {sum(lag > 0.05 for lag in lags)} {max(lags) * 1000:.1f}", flush=True)
        lines.wait("done")
        return 0
    finally:
        node.destroy_node()
        rclpy.try_shutdown()


# --- the node side ---------------------------------------------------------------------------

def one_row(rate_hz: float, lag_ms: float, frames: int, checkpoint: str) -> dict:
    from photon_ros.msg import Objects3D
    from photon_ros.vision_node import VisionNode

    prefix = f"/bench_depth_{os.getpid()}_{time.monotonic_ns()}"
    remaps = {"image": f"{prefix}/color/image_raw", "depth": f"{prefix}/aligned_depth_to_color/image_raw",
              "camera_info": f"{prefix}/color/camera_info"}
    params = {"model": checkpoint, "max_objects": 2, "detect": ["cup"], "point": ["dog"], "use_depth": True,
              "tracking": False, "publish_annotated": False}
    cli = ["--ros-args"] + [a for k, v in remaps.items() for a in ("-r", f"{k}:={v}")]
    graph = RosGraph()
    try:
        node = graph.add(VisionNode(context=graph.context, cli_args=cli,
                                    parameter_overrides=[Parameter(k, value=v) for k, v in params.items()]))
        assert wait_for(lambda: node.engine is not None or node.model_error, timeout=120), "model not loaded"
        assert node.engine is not None, node.model_error
        placed: list = []
        listener = graph.node("bench_listener").create_subscription(
            Objects3D, "objects_3d", placed.append, QoSProfile(depth=100, reliability=ReliabilityPolicy.RELIABLE))
        proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--camera", prefix, str(rate_hz),
                                 str(lag_ms), str(frames)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                text=True, env=camera_env())
        try:
            subs = node.depth_subscriptions[:2] + [node.subscription]
            assert wait_for(lambda: all(s.get_publisher_count() >= 1 for s in subs), 60), "camera not matched"
            assert wait_for(lambda: node.pub_objects_3d.get_subscription_count() >= 1
                            and listener.get_publisher_count() >= 1, 10)
            proc.stdin.write("go\n")
            proc.stdin.flush()
            sent = proc.stdout.readline().split()
            assert sent[:1] == ["sent"], sent
            camera_late, camera_lag_max = int(sent[1]), float(sent[2])
            depth = node.depth_stream
            # Every frame's pairing decided (the last one's tolerance run out at most), the model idle.
            wait_for(lambda: depth.waiting() == 0 and sum(depth.outcomes.values()) >= node.frames.received
                     and node.frames.taken + node.frames.dropped >= node.frames.received, timeout=30)
            time.sleep(0.5)          # the last results on their way to the listener
            proc.stdin.write("done\n")
            proc.stdin.flush()
            proc.wait(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
        outcomes, waited = dict(depth.outcomes), list(depth.waited_s)
        detect = [m for m in placed if m.task == "detect"]
        held = list(node.depth_waits_s)
        return {"rate": rate_hz, "lag": lag_ms, "sent": frames, "arrived": node.frames.received,
                "paired": outcomes["exact"] + outcomes["nearest"], "own": outcomes["exact"],
                "decided": sum(outcomes.values()), "processed": len(detect),
                "processed_3d": sum(1 for m in detect if not m.depth_note),
                "there_at_arrival": sum(1 for w in waited if w == 0),
                "delay_p50": float(np.percentile(waited, 50)) * 1000, "delay_max": max(waited) * 1000,
                "held_p50": float(np.percentile(held, 50)) * 1000, "held_max": max(held) * 1000,
                "camera_late": camera_late, "camera_lag_max": camera_lag_max,
                "model_ms": float(np.median([m.latency.sec + m.latency.nanosec * 1e-9 for m in detect])) * 1000}
    finally:
        graph.close()


def lines_of(rows: list[dict], frames: int) -> list[str]:
    load = os.getloadavg()[0]
    out = heading("Depth pairing over DDS, camera in another process (640x480, CPU)") + [
        f"Per row: {frames} colour frames sent at the rate, each one's aligned depth (16UC1) and camera_info "
        "`lag` ms after it with its stamp; the vision node (small random checkpoint, CPU, detect + point, "
        "use_depth, depth_tolerance_s 0.05) in the benchmark's process. Frames with 3D: of the frames that "
        "arrived, paired with a depth image (own stamp); of the frames the model processed, published with "
        "positions. Pairing delay: the frame's reception to its pairing decided (its depth's reception, or the "
        "tolerance run out): what a model faster than the lag adds per frame. Held back: what was added here, "
        "per processed frame, after the model finished. Own depth there at arrival: what pairing without "
        f"waiting could have found. Load average at the end: {load:.1f} on "
        f"{os.cpu_count()} cores.", "",
        "| rate | depth lag | frames arrived / sent | with 3D (own stamp) | processed with 3D | own depth there "
        "at arrival | pairing delay p50 / max ms | held back p50 / max ms | result latency p50 ms | camera: depth "
        "sent > 50 ms late (max ms) |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        out.append(f"| {r['rate']:g} Hz | {r['lag']:g} ms | {r['arrived']} / {r['sent']} | "
                   f"{r['paired']} / {r['decided']} ({r['own']}) | {r['processed_3d']} / {r['processed']} | "
                   f"{r['there_at_arrival']} / {r['decided']} | {r['delay_p50']:.1f} / {r['delay_max']:.1f} | "
                   f"{r['held_p50']:.1f} / {r['held_max']:.1f} | {r['model_ms']:.0f} | "
                   f"{r['camera_late']} ({r['camera_lag_max']:.0f}) |")
    paired, decided = sum(r["paired"] for r in rows), sum(r["decided"] for r in rows)
    own, there = sum(r["own"] for r in rows), sum(r["there_at_arrival"] for r in rows)
    late = sum(r["camera_late"] for r in rows)
    out += ["", f"Reading: {paired} of {decided} frames that arrived paired with a depth image, {own} of them with "
            f"their own stamp's, {paired - own} with a neighbour's inside the tolerance (their own came later than "
            f"50 ms). {decided - paired} had no depth image within the tolerance reach the node within 50 ms of them "
            "(pairing delay max 50.0: the tolerance ran out): published without positions, with the reason. The "
            f"camera process itself, on this loaded machine, sent {late} depth images more than 50 ms after their "
            "colour frame (last column); the others reached the node's process late (its DDS threads share the 2 "
            "cores with the model and the camera). A frame's own depth had reached the node "
            f"before the frame for {there} of the {decided}: pairing with what is there, without waiting, would "
            "have given the others no depth or a neighbour's. Results were held back "
            f"{max(r['held_max'] for r in rows):.1f} ms at most: this CPU model (result latency p50 "
            f"{min(r['model_ms'] for r in rows):.0f}-{max(r['model_ms'] for r in rows):.0f} ms) outlasts the "
            "depth's lag, so waiting costs nothing here; a model faster than the lag (a GPU) waits the pairing "
            "delay, about the lag, at most the tolerance."]
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--frames", type=int, default=60)
    parser.add_argument("--rates", default="15,30")
    parser.add_argument("--lags", default="0,10,20,30,40")
    parser.add_argument("--write", action="store_true", help="put the section in bench/RESULTS.md")
    parser.add_argument("--camera", nargs=4, metavar=("PREFIX", "RATE", "LAG_MS", "FRAMES"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.camera:
        prefix, rate, lag, frames = args.camera
        return camera(prefix, float(rate), float(lag), int(frames))
    from moondream_fixtures import checkpoint

    rows = []
    for rate in (float(r) for r in args.rates.split(",")):
        for lag in (float(x) for x in args.lags.split(",")):
            rows.append(one_row(rate, lag, args.frames, str(checkpoint())))
            print(rows[-1], flush=True)
    publish(lines_of(rows, args.frames), args.write)
    return 0


if __name__ == "__main__":
    sys.exit(main())
