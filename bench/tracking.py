"""Tracking benchmark: what ids and optical flow cost per frame at 640x480 on the CPU.

    python bench/tracking.py [--frames 600] [--objects 10] [--write]

1. Association (photon_ros.tracking.BoxTracker / PointTracker `update`): one model result of
   `--objects` moving, jittered boxes (or points) per frame, matched to as many live tracks;
   milliseconds per result.
2. Optical flow (`SparseFlow.move` through `StreamTrackers.follow`, all boxes in one call):
   `--objects` boxes of 50-110 px on a textured 640x480 scene that pans a few pixels per frame
   (the camera turning), from an RGB frame (the gray conversion included); milliseconds per
   camera frame (also with a single box: the fixed part, the image pyramids), the frames per
   second that sustains (1 / median time of gray conversion + flow, with OpenCV's threads), and
   the error of the boxes' motion against the scene's known shift.
The issue's target is depth pairing, 3D and tracking together under 2 ms per frame; this measures
the tracking part only. No ROS is needed (the module has none).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import cv2
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from photon_ros.tracking import BoxTracker, PointTracker, StreamTrackers, PREDICTED  # noqa: E402
from report import heading, publish  # noqa: E402

WIDTH, HEIGHT = 640, 480


class Timer:
    """Wall and CPU time (this process, all its threads) of each timed call. On a shared machine
    the wall time includes waiting for a core; the CPU time is the work itself."""

    def __init__(self) -> None:
        self.wall: list[float] = []
        self.cpu: list[float] = []

    def __call__(self, fn, *args):
        wall, cpu = time.perf_counter(), time.process_time()
        result = fn(*args)
        self.wall.append(time.perf_counter() - wall)
        self.cpu.append(time.process_time() - cpu)
        return result

    def row(self, name: str, skip: int) -> tuple[str, float, float, float]:
        """name, wall p50, wall p99, CPU p50, in milliseconds, after the first `skip` calls."""
        wall, cpu = np.array(self.wall[skip:]) * 1000, np.array(self.cpu[skip:]) * 1000
        return name, float(np.percentile(wall, 50)), float(np.percentile(wall, 99)), float(np.median(cpu))


def moving_objects(rng: np.random.Generator, count: int, frames: int) -> np.ndarray:
    """(frames, count, 4) boxes that drift a few pixels per frame with 1 px of jitter."""
    centre = rng.uniform([80, 80], [WIDTH - 80, HEIGHT - 80], size=(count, 2))
    velocity = rng.uniform(-4, 4, size=(count, 2))
    size = rng.uniform(40, 100, size=(count, 2))
    steps = np.arange(frames)[:, None, None]
    centres = centre + velocity * steps + rng.normal(0, 1, size=(frames, count, 2))
    return np.concatenate([centres - size / 2, centres + size / 2], axis=-1)


def bench_association(rng: np.random.Generator, count: int, frames: int) -> list[tuple[str, float, float]]:
    boxes = moving_objects(rng, count, frames)
    rows = []
    points = (boxes[..., :2] + boxes[..., 2:]) / 2
    for name, tracker, data in (("boxes (IoU)", BoxTracker(), boxes),
                                ("points (normalized distance)", PointTracker(), points)):
        timer = Timer()
        for k in range(frames):
            order = rng.permutation(count)
            timer(tracker.update, data[k][order], k / 30, (WIDTH, HEIGHT))
        ids = {t.track_id for t in tracker.tracks()}
        rows.append(timer.row(f"associate {count} {name}, {len(ids)} tracks at the end", 10))
    return rows


def scene(rng: np.random.Generator) -> np.ndarray:
    """A large RGB texture: smooth background plus sharper-edged blobs, panned across below."""
    base = cv2.GaussianBlur(rng.integers(0, 256, size=(HEIGHT + 400, WIDTH + 400), dtype=np.uint8), (0, 0), 3.0)
    for _ in range(300):
        x, y = rng.integers(0, base.shape[1]), rng.integers(0, base.shape[0])
        cv2.circle(base, (int(x), int(y)), int(rng.integers(3, 15)), int(rng.integers(0, 256)), -1)
    return cv2.cvtColor(base, cv2.COLOR_GRAY2RGB)


def bench_flow(rng: np.random.Generator, count: int, frames: int) -> tuple[list[tuple], dict]:
    texture = scene(rng)
    pan = np.clip(np.cumsum(rng.uniform(-4, 4, size=(frames + 1, 2)), axis=0), -190, 190)

    def frame(k: int) -> np.ndarray:
        dx, dy = pan[k]
        moved = cv2.warpAffine(texture, np.array([[1, 0, dx], [0, 1, dy]]), (texture.shape[1], texture.shape[0]))
        return np.ascontiguousarray(moved[200:200 + HEIGHT, 200:200 + WIDTH])

    images = [frame(k) for k in range(frames + 1)]
    centres = rng.uniform([70, 70], [WIDTH - 70, HEIGHT - 70], size=(count, 2))
    sizes = rng.uniform(50, 110, size=(count, 2))
    start_boxes = np.concatenate([centres - sizes / 2, centres + sizes / 2], axis=1)

    streams = StreamTrackers()
    tracker = streams.get("detect", "thing")
    gray_timer, flow_timer, errors, held = Timer(), Timer(), [], 0
    prev = cv2.cvtColor(images[0], cv2.COLOR_RGB2GRAY)
    for k in range(frames):
        if k % 30 == 0:   # a model result once a second re-seeds the boxes where the scene put them
            tracker.update(start_boxes + np.tile(pan[k] - pan[0], 2), k / 30, (WIDTH, HEIGHT))
        before = np.array([t.coords for t in tracker.tracks()])
        gray = gray_timer(cv2.cvtColor, images[k + 1], cv2.COLOR_RGB2GRAY)
        out = flow_timer(streams.follow, prev, gray, (k + 1) / 30)[("detect", "thing")]
        prev = gray   # the node keeps the previous camera frame's gray
        truth = pan[k + 1] - pan[k]
        for t, b in zip(out, before):
            if t.status == PREDICTED:
                errors.append(float(np.abs(np.subtract(t.coords[:2], b[:2]) - truth).max()))
            else:
                held += 1
    plural = "es" if count > 1 else ""
    rows = [gray_timer.row("RGB -> gray, 640x480", 5),
            flow_timer.row(f"flow, {count} box{plural} (features, LK forward + back, median)", 5)]
    wall = float(np.median(np.add(gray_timer.wall, flow_timer.wall)[5:]))
    cpu = float(np.median(np.add(gray_timer.cpu, flow_timer.cpu)[5:]))
    summary = {"wall_ms": wall * 1000, "cpu_ms": cpu * 1000, "wall_fps": 1 / wall, "cpu_fps": 1 / cpu,
               "error_px": float(np.median(errors)) if errors else float("nan"),
               "error_p99_px": float(np.percentile(errors, 99)) if errors else float("nan"),
               "held": held, "moves": frames * count}
    return rows, summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frames", type=int, default=600)
    parser.add_argument("--objects", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--write", action="store_true", help="put the section in bench/RESULTS.md")
    args = parser.parse_args()
    if args.frames < 20 or args.objects < 1:
        parser.error("--frames >= 20 and --objects >= 1")
    rng = np.random.default_rng(args.seed)
    load = os.getloadavg()[0]
    rows = bench_association(rng, args.objects, args.frames)
    one_box_rows, _ = bench_flow(rng, 1, args.frames // 2)
    flow_rows, flow = bench_flow(rng, args.objects, args.frames)
    rows += one_box_rows[1:] + flow_rows
    lines = heading("Tracking, CPU (association and optical flow, 640x480)")
    lines += [f"OpenCV {cv2.__version__} ({cv2.getNumThreads()} threads), {args.frames} frames, "
              f"{args.objects} objects. Load average when it started: {load:.1f} on {os.cpu_count()} cores; "
              f"wall time includes waiting for a core on a busy machine, CPU time (this process, all "
              f"threads) is the work.", "",
              "| step, per frame | wall p50 ms | wall p99 ms | CPU p50 ms |", "|---|---:|---:|---:|"]
    lines += [f"| {name} | {p50:.3f} | {p99:.3f} | {cpu:.3f} |" for name, p50, p99, cpu in rows]
    association = rows[0]
    lines += ["",
              f"Rate at which boxes follow the camera (gray conversion and flow of {args.objects} boxes per "
              f"frame): {flow['cpu_fps']:.0f} frames/s by CPU time ({flow['cpu_ms']:.2f} ms a frame), "
              f"{flow['wall_fps']:.0f} frames/s by wall time on this machine as loaded "
              f"({flow['wall_ms']:.2f} ms). Motion error against the scene's known shift: median "
              f"{flow['error_px']:.3f} px, p99 {flow['error_p99_px']:.3f} px; {flow['held']} of "
              f"{flow['moves']} box moves held.", "",
              f"Against the 2 ms target (depth pairing, 3D and tracking together): association of "
              f"{args.objects} boxes takes {association[1]:.3f} ms wall, {association[3]:.3f} ms CPU of it. "
              f"Optical flow is extra work on camera frames the model does not process: "
              f"{flow['cpu_ms']:.2f} ms CPU a frame, {'inside' if flow['cpu_ms'] < 2 else 'over'} "
              f"2 ms on its own.", ""]
    publish(lines, args.write)
    return 0


if __name__ == "__main__":
    sys.exit(main())
