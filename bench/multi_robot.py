"""Several robots, one engine: N robots served by one process vs one robot, measured in one run.

    python bench/multi_robot.py [--robots 4] [--seconds 30] [--write]

The workstation side is this process: bringup's vision graph once per robot namespace
(`build_graph(..., namespaces=[r1..rN])`, as `python -m photon_ros.bringup --namespaces` builds it),
all on one engine whose batcher gathers the robots' concurrent requests. The robots are another
process: one camera per robot publishing frames of its own at --rate Hz (sensor-data QoS, stamped
with the wall clock) and a listener per robot on its own namespace's detections. Per robot:
latency = Detections received by the robot - its frame's stamp (what the robot waits, including
the frame's wait for the busy engine); throughput = results received for frames sent during the
measured window, all robots together. Configurations alternate 1, N, N, 1 (--rounds times) so a
noisy machine's drift falls on both; each is reported as a ratio to the single robot of the same
run. Model: the tests' small random Moondream checkpoint (test/moondream_fixtures.py), or
--checkpoint. Run it in the development environment (scripts/dev_env.sh).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "test"))
sys.path.insert(0, str(ROOT / "bench"))
os.environ.setdefault("ROS_AUTOMATIC_DISCOVERY_RANGE", "LOCALHOST")

import rclpy  # noqa: E402
from rclpy.executors import SingleThreadedExecutor  # noqa: E402
from rclpy.qos import QoSProfile, ReliabilityPolicy, qos_profile_sensor_data  # noqa: E402
from sensor_msgs.msg import Image  # noqa: E402
from std_msgs.msg import Header  # noqa: E402

from photon_ros.bringup import DEFAULT_CONFIG, build_graph, use_large_data_profile  # noqa: E402
from photon_ros.image_conversions import rgb_to_image  # noqa: E402
from photon_ros.msg import Detections  # noqa: E402
from photon_ros.result_messages import seconds_to_time, time_to_seconds  # noqa: E402
from report import heading  # noqa: E402
from ros_harness import RosGraph, wait_for  # noqa: E402

TOPIC = "camera/image_raw"          # relative: under each robot's namespace
RELIABLE = QoSProfile(depth=50, reliability=ReliabilityPolicy.RELIABLE)
RESULTS = ROOT / "bench" / "RESULTS.md"
ROOFLINE_TITLE = "### Megakernel roofline (prediction, no GPU)"


def robot_names(count: int) -> list[str]:
    return [f"r{i + 1}" for i in range(count)]


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


# --- the robots (another process) ----------------------------------------------------------------

def robots_process(count: int, rate: float, warm_s: float, seconds: float, width: int, height: int) -> int:
    """Cameras and result listeners of `count` robots; prints one JSON line per robot: frames
    sent in the window, latencies of results for frames sent in the window."""
    rclpy.init()
    names = robot_names(count)
    nodes = [rclpy.create_node("robot", namespace=name) for name in names]
    publishers = [node.create_publisher(Image, TOPIC, qos_profile_sensor_data) for node in nodes]
    window: dict[str, tuple[float, float]] = {}
    latencies: dict[str, list[float]] = {name: [] for name in names}

    def on_result(name: str, msg: Detections) -> None:
        stamp = time_to_seconds(msg.header.stamp)
        if msg.header.frame_id != f"{name}_camera":
            print(f"robot {name}: a result of {msg.header.frame_id} on its namespace", file=sys.stderr)
            os._exit(3)   # crossed results make every figure meaningless
        start, end = window.get("measured", (float("inf"), 0.0))
        if start <= stamp < end:
            latencies[name].append(time.time() - stamp)

    subscriptions = [node.create_subscription(Detections, "detections", lambda m, n=name: on_result(n, m), RELIABLE)
                     for node, name in zip(nodes, names)]
    executor = SingleThreadedExecutor()
    for node in nodes:
        executor.add_node(node)
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            executor.spin_once(timeout_sec=0.05)

    spinner = threading.Thread(target=spin, daemon=True)
    spinner.start()
    try:
        matched = wait_for(lambda: all(p.get_subscription_count() >= 1 for p in publishers)
                           and all(s.get_publisher_count() >= 1 for s in subscriptions), timeout=60)
        if not matched:
            print("robots: the vision nodes never matched", file=sys.stderr)
            return 2
        frames = [rgb_to_image(np.random.default_rng(100 + k).integers(0, 256, (height, width, 3), dtype=np.uint8))
                  for k in range(count)]
        sent = {name: 0 for name in names}
        start = time.time()
        window["measured"] = (start + warm_s, start + warm_s + seconds)
        tick = time.monotonic()
        while time.time() < start + warm_s + seconds:
            for name, pub, msg in zip(names, publishers, frames):
                now = time.time()
                msg.header = Header(stamp=seconds_to_time(now), frame_id=f"{name}_camera")
                pub.publish(msg)
                sent[name] += window["measured"][0] <= now < window["measured"][1]
            tick += 1 / rate
            time.sleep(max(0.0, tick - time.monotonic()))
        # Frames of the window still in the engine: their results count, however late.
        time.sleep(min(30.0, max(5.0, 3 * max((max(v) for v in latencies.values() if v), default=5.0))))
        for name in names:
            print(json.dumps({"robot": name, "sent": sent[name], "latencies": latencies[name]}), flush=True)
        return 0
    finally:
        stop.set()
        spinner.join(timeout=5)   # nodes destroyed under a spinning executor abort the process
        executor.shutdown()
        for node in nodes:
            node.destroy_node()
        rclpy.try_shutdown()


# --- the workstation (this process) ---------------------------------------------------------------

class EngineTimer:
    """Wraps a batcher's model call to total the engine's busy time and requests: the engine's
    own cost per frame, apart from what receiving and converting the robots' frames costs."""

    def __init__(self, batcher) -> None:
        self.run_many, self.seconds, self.items = batcher.run_many, 0.0, 0
        batcher.run_many = self

    def __call__(self, items: list) -> list:
        started = time.perf_counter()
        results = self.run_many(items)
        self.seconds += time.perf_counter() - started
        self.items += len(items)
        return results


def run_configuration(count: int, args, checkpoint: str) -> dict:
    """Serve `count` robots for one measured window; their latencies, throughput, batch sizes."""
    names = robot_names(count)
    graph = RosGraph()
    try:
        nodes = build_graph(DEFAULT_CONFIG, "vision", namespaces=names, remaps=[f"image:={TOPIC}"],
                            context=graph.context,
                            overrides={"vision": {"model": checkpoint, "detect": ["cup"],
                                                  "max_objects": args.max_objects, "publish_annotated": False}})
        for node in nodes:
            graph.add(node)
        if not wait_for(lambda: all(n.engine is not None or n.model_error for n in nodes), timeout=600):
            raise RuntimeError("the model did not load within 10 minutes")
        errors = [n.model_error for n in nodes if n.engine is None]
        if errors:
            raise RuntimeError(f"the model did not load: {errors[0]}")
        engine = nodes[0].engine
        if any(n.engine is not engine for n in nodes):
            raise RuntimeError("the robots' vision nodes do not share one engine")
        before = len(engine.batcher.sizes)
        busy = EngineTimer(engine.batcher)
        child = subprocess.run(
            [sys.executable, str(Path(__file__).resolve()), "--robots-process", str(count), str(args.rate),
             str(args.warm), str(args.seconds), str(args.width), str(args.height)],
            capture_output=True, text=True, env=dict(os.environ), timeout=args.warm + args.seconds + 300)
        if child.returncode != 0:
            raise RuntimeError(f"the robots' process failed ({child.returncode}): {child.stderr[-2000:]}")
        per_robot = [json.loads(line) for line in child.stdout.splitlines() if line.startswith("{")]
        sizes = engine.batcher.sizes[before:]
        engine.batcher.run_many = busy.run_many
    finally:
        graph.close()
    latencies = [x for robot in per_robot for x in robot["latencies"]]
    return {"robots": count, "sent": sum(r["sent"] for r in per_robot), "results": len(latencies),
            "fps": len(latencies) / args.seconds, "latencies": latencies, "sizes": sizes,
            "per_robot_p50": {r["robot"]: pct(r["latencies"], 50) for r in per_robot},
            "engine_s": busy.seconds, "engine_items": busy.items}


def engine_alone(checkpoint: str, args) -> tuple[float, float, bool]:
    """ms per request of the engine by itself, no ROS graph running: N robots' frames
    one request at a time, then as one batch (repeats interleaved); and whether the batch's results
    equal the requests' own."""
    from photon_core.runtime.shared_models import release
    from photon_ros.vision_node import frame_requests, load_vision_model

    engine = load_vision_model(checkpoint, "cpu", None, "auto")
    try:
        frames = [np.random.default_rng(100 + k).integers(0, 256, (args.height, args.width, 3), dtype=np.uint8)
                  for k in range(args.robots)]
        requests = [r for rgb in frames for r in frame_requests(rgb, ["cup"], [], None, args.max_objects)]
        alone, together = [], []
        # Through the batcher, the path the nodes take (one group: one batch).
        run = engine.batcher.submit
        one_by_one = [run([r])[0] for r in requests]   # warm-up, and the reference
        equal = run(requests) == one_by_one
        for _ in range(args.engine_repeats):
            started = time.perf_counter()
            for r in requests:
                run([r])
            alone.append((time.perf_counter() - started) / len(requests))
            started = time.perf_counter()
            run(requests)
            together.append((time.perf_counter() - started) / len(requests))
        return 1000 * float(np.median(alone)), 1000 * float(np.median(together)), equal
    finally:
        release(engine)


def roofline_ratio() -> tuple[float, float, float] | None:
    """Moondream 2's predicted H200 decode step at batch 1 and 8 from the roofline section of
    RESULTS.md (bench/roofline.py), and their ratio; None without that section."""
    text = RESULTS.read_text() if RESULTS.exists() else ""
    if ROOFLINE_TITLE not in text:
        return None
    section = text.split(ROOFLINE_TITLE, 1)[1].split("\n### ", 1)[0]
    steps = {}
    for batch in (1, 8):
        found = re.search(rf"^\| Moondream 2 \| {batch} \|(?:[^|]*\|){{6}}\s*([\d.]+)\s*\|", section, re.M)
        if found is None:
            return None
        steps[batch] = float(found.group(1))
    return steps[1], steps[8], steps[8] / steps[1]


def load_average() -> str:
    return Path("/proc/loadavg").read_text().split()[0]


def effect(ratio: float) -> str:
    """A per-request cost ratio (batched / alone) in words."""
    if ratio < 0.9:
        return f"saved {1 - ratio:.0%}"
    if ratio <= 1.1:
        return f"saved about nothing ({ratio:.2f}x)"
    return f"cost {ratio - 1:.0%} more"


def report(runs: list[dict], alone: tuple[float, float, bool], args, checkpoint_label: str, load_start: str,
           wall_s: float) -> list[str]:
    robots = args.robots
    single = [r for r in runs if r["robots"] == 1]
    multi = [r for r in runs if r["robots"] == robots]

    def pooled(group: list[dict]) -> dict:
        lat = [x for r in group for x in r["latencies"]]
        sizes = [s for r in group for s in r["sizes"]]
        return {"fps": sum(r["results"] for r in group) / (args.seconds * len(group)),
                "p50": pct(lat, 50), "p95": pct(lat, 95), "results": len(lat),
                "sent": sum(r["sent"] for r in group), "batch": float(np.mean(sizes)) if sizes else float("nan"),
                "largest": max(sizes, default=0),
                "engine_ms": 1000 * sum(r["engine_s"] for r in group) / max(1, sum(r["engine_items"] for r in group))}

    one, many = pooled(single), pooled(multi)
    lines = heading(f"Several robots, one engine ({robots} vs 1, CPU)")
    lines += [f"Model: {checkpoint_label}; detect 1 prompt per frame (max_objects {args.max_objects}), "
              f"{args.width}x{args.height} rgb8 frames at {args.rate:g} Hz per robot. Workstation: this process, "
              f"bringup's vision graph once per namespace (r1..r{robots}) on one engine. Robots: another process "
              f"(a camera and a result listener per namespace). Order {' '.join(str(r['robots']) for r in runs)}, "
              f"{args.seconds:g} s measured per run after {args.warm:g} s of warm-up. Latency: a robot's frame "
              "stamp to its Detections received back (the wait for the busy engine included); throughput: "
              "results for frames sent in the window, all robots together. Load average (1 min) "
              f"{load_start} at the start, {load_average()} at the end; {wall_s:.0f} s in all.", "",
              "| robots | frames/s (all robots) | per-robot latency p50 s | p95 s | mean batch | largest batch "
              "| engine ms per request | results / frames sent |", "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for count, p in ((1, one), (robots, many)):
        lines.append(f"| {count} | {p['fps']:.2f} | {p['p50']:.2f} | {p['p95']:.2f} | {p['batch']:.2f} | "
                     f"{p['largest']} | {p['engine_ms']:.0f} | {p['results']} / {p['sent']} |")
    lines.append(f"| **{robots} / 1** | **{many['fps'] / one['fps']:.2f}x** | **{many['p50'] / one['p50']:.2f}x** | "
                 f"**{many['p95'] / one['p95']:.2f}x** | | | **{many['engine_ms'] / one['engine_ms']:.2f}x** | |")
    per_robot = "; ".join(f"run {i + 1}: " + ", ".join(f"{k} {v:.2f}" for k, v in r["per_robot_p50"].items())
                          for i, r in enumerate(multi))
    lines += ["", f"Per-robot p50 latency (s) in the {robots}-robot runs: {per_robot}. Every result came back on "
              "its own robot's namespace with its own camera's frame_id (the robots' process exits on any other).", ""]
    single_ms, batch_ms, equal = alone
    lines += [f"Engine alone (this process, before the graph runs, through the batcher; the same {robots} frames, median of "
              f"{args.engine_repeats}): {single_ms:.0f} ms per request one at a time, {batch_ms:.0f} ms per request "
              f"as one batch of {robots} ({batch_ms / single_ms:.2f}x; the batch's results "
              f"{'equal' if equal else 'DIFFER FROM'} the requests' own).", "",
              f"Reading: on this CPU a batch of {robots} {effect(batch_ms / single_ms)} of the engine's time per "
              f"request alone, and {effect(many['engine_ms'] / one['engine_ms'])} in the graph runs (the column "
              f"\"engine ms per request\"); {robots} robots got {many['fps'] / one['fps']:.2f}x one robot's frames/s in "
              f"total, and each robot waits for its whole batch ({many['p50'] / one['p50']:.1f}x the p50 latency). "
              f"In the graph runs the workstation also receives and converts {robots}x the frames, and the robots' "
              "cameras (another process) publish on the same cores, which on real robots they would not: the "
              "engine's time there includes that contention, and other jobs on this shared machine (the load "
              "average) add noise of their own; the 1, N, N, 1 order puts any drift on both sides.", ""]
    roof = roofline_ratio()
    if roof is None:
        lines.append("GPU view: no roofline section in RESULTS.md to cite (run `python bench/roofline.py --write`).")
    else:
        b1, b8, ratio = roof
        lines.append(
            f"GPU view (a **prediction**, no GPU measured here): a decode step on a GPU is memory-bound, the "
            f"weights read once per step whatever the batch. The megakernel roofline (section \"Megakernel "
            f"roofline\" above, bench/roofline.py; Moondream 2 on an H200) predicts a decode step of {b1:.3f} ms "
            f"at batch 1 and {b8:.3f} ms at batch 8: batch 8 / batch 1 = {ratio:.2f}, i.e. eight robots' requests "
            f"decoded for {ratio:.2f}x the time of one ({8 / ratio:.1f}x the decode throughput, each robot's "
            f"tokens {ratio:.2f}x slower). {robots} robots with one request per frame sit at batch {robots}"
            + (f", between the two: at least {robots / ratio:.1f}x one robot's decode throughput at no more than "
               f"{ratio:.2f}x its step time" if robots < 8 else "")
            + ". The roofline covers decode steps only; image encoding and prefill are compute-bound and grow "
            "with the batch, so whole-frame gains are smaller where they dominate (short answers, large images).")
    return lines


def append_section(lines: list[str]) -> None:
    """Append to RESULTS.md. Others write to it too: its end is read just before, nothing else of
    it is touched (no rewrite)."""
    end = RESULTS.read_text()[-2:] if RESULTS.exists() else "\n\n"
    gap = "" if end == "\n\n" else "\n" if end.endswith("\n") else "\n\n"
    with open(RESULTS, "a") as out:
        out.write(gap + "\n".join(lines).rstrip("\n") + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--robots", type=int, default=4, help="robots served together (compared with 1)")
    parser.add_argument("--seconds", type=float, default=30.0, help="measured window per run")
    parser.add_argument("--warm", type=float, default=3.0, help="seconds of frames before the window")
    parser.add_argument("--rate", type=float, default=5.0,
                        help="frames per second per robot camera (above what one robot is served at)")
    parser.add_argument("--width", type=int, default=640)
    parser.add_argument("--height", type=int, default=480)
    parser.add_argument("--max-objects", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=1, help="each round runs 1, N, N, 1 robots")
    parser.add_argument("--engine-repeats", type=int, default=3, help="engine-alone repeats (batch N vs 1)")
    parser.add_argument("--checkpoint", help="a Moondream checkpoint (default: the tests' small random one)")
    parser.add_argument("--write", action="store_true", help="append the section to bench/RESULTS.md")
    parser.add_argument("--robots-process", nargs=6, help=argparse.SUPPRESS)
    args = parser.parse_args()
    use_large_data_profile()   # 640x480 frames between processes need the shared-memory segment
    if args.robots_process:
        count, rate, warm, seconds, width, height = args.robots_process
        return robots_process(int(count), float(rate), float(warm), float(seconds), int(width), int(height))
    if args.robots < 2:
        parser.error("--robots must be at least 2 (it is compared with one robot)")
    if args.checkpoint:
        checkpoint, label = args.checkpoint, args.checkpoint
    else:
        import moondream_fixtures
        checkpoint, label = str(moondream_fixtures.checkpoint()), "the tests' small random Moondream 2 checkpoint"
    load_start, started = load_average(), time.monotonic()
    alone = engine_alone(checkpoint, args)   # first: nothing else runs yet
    runs = []
    for _ in range(args.rounds):
        for count in (1, args.robots, args.robots, 1):
            runs.append(run_configuration(count, args, checkpoint))
            r = runs[-1]
            print(f"{count} robot(s): {r['fps']:.2f} frames/s, p50 {pct(r['latencies'], 50):.2f} s, "
                  f"p95 {pct(r['latencies'], 95):.2f} s, batches {r['sizes'][:12]}", file=sys.stderr, flush=True)
    lines = report(runs, alone, args, label, load_start, time.monotonic() - started)
    print("\n".join(lines))
    if args.write:
        append_section(lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
