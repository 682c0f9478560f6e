"""Depth benchmark: what 3D from an aligned depth image costs per colour frame at 640x480 on the CPU.

    python bench/depth_3d.py [--frames 400] [--detections 10] [--points 10] [--write]

Per colour frame, as the vision node will run it (photon_ros.depth_projection): a depth frame is
added to the pairing (camera rate; depth arrives as often as colour), the colour frame is paired
with the nearest of the last 10 depth frames, the paired sensor_msgs/Image is decoded (a view of
its buffer), the CameraInfo message is converted and checked (every frame: the worst case, the
node may cache it), and `--detections` boxes and `--points` points get their 3D. Boxes are
40-200 px (typical detections) or 320x240 each (half the image: the sampling cap at work);
16UC1 and 32FC1, without distortion and with plumb_bob. For reference, the cost of converting a
whole image to metres (`depth_to_metres`), which this path avoids.
The issue's target is depth pairing, 3D and tracking together under 2 ms per frame; this measures
the depth part (bench/tracking.py measures tracking). Messages are real sensor_msgs where they
import, plain objects with the same fields otherwise.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import cv2
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from photon_ros.depth_projection import (DepthPairing, DepthSettings, DepthView,  # noqa: E402
                                         depth_to_metres, frame_depth)
from report import heading, publish  # noqa: E402

WIDTH, HEIGHT = 640, 480
K = [525.0, 0.0, 319.5, 0.0, 525.0, 239.5, 0.0, 0.0, 1.0]
PLUMB_BOB = [-0.25, 0.08, 0.0006, -0.0004, -0.01]
CAMERA_RATE = 30.0

try:
    from sensor_msgs.msg import CameraInfo, Image
except ImportError:       # no ROS: the module reads fields only
    CameraInfo = Image = None


def scene(rng: np.random.Generator) -> np.ndarray:
    """Metres: a wall at 3.5 m, 15 rectangles at 0.6-3 m, 1% noise, 10% holes (0)."""
    depth = np.full((HEIGHT, WIDTH), 3.5)
    for _ in range(15):
        x, y = rng.integers(0, WIDTH - 40), rng.integers(0, HEIGHT - 40)
        w, h = rng.integers(40, 220), rng.integers(40, 180)
        depth[y:y + h, x:x + w] = rng.uniform(0.6, 3.0)
    depth *= 1 + 0.01 * rng.standard_normal(depth.shape)
    depth[rng.random(depth.shape) < 0.1] = 0
    return depth


def image_msg(metres: np.ndarray, encoding: str):
    values = (np.rint(metres * 1000).astype("<u2") if encoding == "16UC1"
              else np.where(metres > 0, metres, np.nan).astype("<f4"))
    fields = dict(encoding=encoding, width=WIDTH, height=HEIGHT, step=WIDTH * values.itemsize,
                  is_bigendian=0, data=values.tobytes())
    if Image is None:
        return SimpleNamespace(**fields)
    return Image(**fields)


def info_msg(distortion: list[float]):
    fields = dict(width=WIDTH, height=HEIGHT, distortion_model="plumb_bob", d=distortion, k=K,
                  r=[1.0, 0, 0, 0, 1.0, 0, 0, 0, 1.0], p=K[:3] + [0.0] + K[3:6] + [0.0] + K[6:] + [0.0])
    if CameraInfo is None:
        return SimpleNamespace(**fields, binning_x=0, binning_y=0, roi=None)
    return CameraInfo(**fields)


def boxes(rng: np.random.Generator, count: int, large: bool) -> list[tuple[float, ...]]:
    if large:
        corner = rng.uniform([0, 0], [WIDTH - 320, HEIGHT - 240], size=(count, 2))
        size = np.tile([320.0, 240.0], (count, 1))
    else:
        size = rng.uniform(40, 200, size=(count, 2))
        corner = rng.uniform(0, 1, size=(count, 2)) * ([WIDTH, HEIGHT] - size)
    return [tuple(b) for b in np.concatenate([corner, corner + size], axis=1)]


def run(rng: np.random.Generator, encoding: str, distortion: list[float], large: bool,
        frames: int, detections: int, points: int) -> tuple[list[float], list[float], int]:
    """Wall and CPU seconds per colour frame, and how many 3D results the last frame gave."""
    settings = DepthSettings(min_depth_m=0.2, max_depth_m=8.0)
    depth_frames = [image_msg(scene(rng), encoding) for _ in range(4)]
    info = info_msg(distortion)
    pairing: DepthPairing = DepthPairing(tolerance_s=0.02)
    box_list = boxes(rng, detections, large)
    point_list = [tuple(p) for p in rng.uniform([0, 0], [WIDTH, HEIGHT], size=(points, 2))]
    times, cpu_times, found = [], [], 0
    for k in range(frames + 10):
        stamp = k / CAMERA_RATE
        start, cpu_start = time.perf_counter(), time.process_time()
        pairing.add(stamp + 0.004, depth_frames[k % len(depth_frames)])
        view = frame_depth(pairing, stamp, info, WIDTH, HEIGHT, settings)
        if not isinstance(view, DepthView):
            raise RuntimeError(f"no depth in the benchmark's own scene: {view.reason}")
        results = view.boxes_3d(box_list) + view.points_3d(point_list)
        times.append(time.perf_counter() - start)
        cpu_times.append(time.process_time() - cpu_start)
        found = sum(r.ok for r in results)
    return times[10:], cpu_times[10:], found


def percentiles(values: list[float]) -> tuple[float, float, float]:
    """Best, p50 and p99 in milliseconds (the best is the cost without contention from other
    processes, which a shared machine adds to the others)."""
    return (min(values) * 1000, float(np.percentile(values, 50)) * 1000,
            float(np.percentile(values, 99)) * 1000)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frames", type=int, default=400)
    parser.add_argument("--detections", type=int, default=10)
    parser.add_argument("--points", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--write", action="store_true", help="put the section in bench/RESULTS.md")
    args = parser.parse_args()
    if args.frames < 20 or args.detections < 0 or args.points < 0:
        parser.error("--frames >= 20, --detections and --points >= 0")
    rng = np.random.default_rng(args.seed)
    load = os.getloadavg()[0]
    started = time.perf_counter()
    rows = []
    for encoding in ("16UC1", "32FC1"):
        for lens, distortion in (("none", [0.0] * 5), ("plumb_bob", PLUMB_BOB)):
            for large in (False, True):
                times, cpu_times, found = run(rng, encoding, distortion, large, args.frames,
                                              args.detections, args.points)
                size = "320x240" if large else "40-200 px"
                rows.append((f"{encoding}, {lens}, boxes {size}", *percentiles(times),
                             float(np.percentile(cpu_times, 50)) * 1000,
                             f"{found} / {args.detections + args.points}"))
    whole, whole_cpu = [], []
    msg = image_msg(scene(rng), "16UC1")
    for _ in range(args.frames // 4):
        start, cpu_start = time.perf_counter(), time.process_time()
        depth_to_metres(msg.data, "16UC1", WIDTH, HEIGHT, msg.step, False, 0.2, 8.0)
        whole.append(time.perf_counter() - start)
        whole_cpu.append(time.process_time() - cpu_start)
    typical_best, typical, _, typical_cpu = rows[0][1:5]
    worst = max(rows, key=lambda row: row[2])
    lines = heading("Depth to 3D, CPU (pairing, decoding, boxes and points, 640x480)")
    lines += [f"numpy {np.__version__}, OpenCV {cv2.__version__}, messages: "
              f"{'sensor_msgs' if Image is not None else 'plain objects'}; {args.frames} colour frames "
              f"per row, each: add a depth frame, pair (tolerance 20 ms, 10 kept), decode, convert "
              f"CameraInfo, then {args.detections} boxes and {args.points} points to 3D (plumb_bob "
              f"rows undistort every box's centre and outline). Load average when it started: "
              f"{load:.1f}, at its end {os.getloadavg()[0]:.1f}, on {os.cpu_count()} cores; other work "
              f"on the machine inflates p50 and p99 (p99 most), best approaches the uncontended cost, "
              f"CPU is the process's CPU time (time spent waiting for a core is not in it); "
              f"{time.perf_counter() - started:.0f} s in all.", "",
              "| per colour frame | best ms | p50 ms | p99 ms | CPU p50 ms | 3D results (last frame) |",
              "|---|---:|---:|---:|---:|---:|"]
    lines += [f"| {name} | {best:.3f} | {p50:.3f} | {p99:.3f} | {cpu:.3f} | {found} |"
              for name, best, p50, p99, cpu, found in rows]
    lines += ["| for reference: whole 16UC1 image to metres (`depth_to_metres`, not on this path) | "
              + " | ".join(f"{v:.3f}" for v in percentiles(whole))
              + f" | {float(np.percentile(whole_cpu, 50)) * 1000:.3f} | |",
              "",
              f"Against the 2 ms target (depth pairing, 3D and tracking together): the depth part takes "
              f"{typical:.3f} ms at p50 ({typical_best:.3f} ms best, {typical_cpu:.3f} ms CPU) with "
              f"typical boxes (16UC1, no distortion), {worst[2]:.3f} ms at p50 in the slowest row "
              f"({worst[0]}); tracking's share is in its own section. Results missing from the last "
              f"frame would be boxes or points over holes and out-of-range readings of the random "
              f"scene, reported as such.", ""]
    publish(lines, args.write)
    return 0


if __name__ == "__main__":
    sys.exit(main())
