"""A camera in another process: rgb8 frames from a separate Python process reach a subscriber with
the vision node's QoS, intact, stamped and in order, at 640x480 and 1920x1080, best effort (the
sensor-data QoS camera drivers use) and reliable. The other tests run every node in one process,
where DDS delivers in-process and never touches the shared-memory transport this needs
(config/fastdds_large_data.xml; both processes get it as scripts/dev_env.sh sets it).

The camera first sends early frames (stamped before any real one, which the test ignores) until
the test has received one, then frames one at a time, each after the previous one arrived, so none
can be lost for lack of time: every one of them must arrive (with Fast DDS's default 512 KiB
segment, best-effort 640x480 frames mostly do not). Then it streams at 30 Hz until the test has
seen enough frames. Run as a script, this file is the camera."""
from __future__ import annotations

import os
import select
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import rclpy
from builtin_interfaces.msg import Time
from rclpy.qos import HistoryPolicy, QoSProfile, ReliabilityPolicy, qos_profile_sensor_data
from sensor_msgs.msg import Image
from std_msgs.msg import Header

from photon_ros.bringup import use_large_data_profile
from photon_ros.image_conversions import image_to_rgb, rgb_to_image
from ros_harness import RosGraph, wait_for

STEPPED = 3            # frames sent one at a time, each after the previous one arrived
STREAM_MIN = 10        # streamed frames the test waits for
STREAM_MAX = 200       # the camera stops by itself after this many (frame indices stay below 256)
LINE_TIMEOUT_S = 30.0  # the camera gives up waiting for a line from the test after this,
ACK_TIMEOUT_S = 15.0   # and counts a stepped frame lost after this (arrival takes milliseconds)
PRIMING_SEC = 500      # the early frames' stamps: seconds before every real frame's (1000 + index)


def frame(index: int, height: int, width: int) -> np.ndarray:
    """Pixels that name their frame: a gradient shifted by 7 x index (distinct below 256)."""
    rows = np.arange(height, dtype=np.uint8)[:, None, None] * np.uint8(3)
    cols = np.arange(width, dtype=np.uint8)[None, :, None]
    channels = np.array([0, 85, 170], np.uint8)
    return rows + cols + channels + np.uint8(index * 7 % 256)


def header(index: int) -> Header:
    return Header(stamp=Time(sec=1000 + index, nanosec=index), frame_id="camera")


def priming_header(count: int) -> Header:
    return Header(stamp=Time(sec=PRIMING_SEC, nanosec=count), frame_id="camera")


# --- the camera process ----------------------------------------------------------------------

def camera_qos(reliability: str) -> QoSProfile:
    """What camera drivers publish with: sensor data (best effort, keep last 5), or reliable."""
    if reliability == "best_effort":
        return qos_profile_sensor_data
    return QoSProfile(depth=5, reliability=ReliabilityPolicy.RELIABLE)


class Lines:
    """What the test says on the camera's stdin: "go", received frame indices, "done" (or EOF)."""

    def __init__(self) -> None:
        self.seen: set[str] = set()
        self.closed = False
        self._partial = ""

    def read(self, timeout: float) -> None:
        # The raw descriptor, not sys.stdin: lines buffered in Python would be invisible to select.
        if self.closed or not select.select([0], [], [], max(timeout, 0))[0]:
            return
        chunk = os.read(0, 65536)
        self.closed = not chunk
        *complete, self._partial = (self._partial + chunk.decode()).split("\n")
        self.seen.update(line.strip() for line in complete)

    def wait(self, word: str, timeout: float = LINE_TIMEOUT_S) -> bool:
        deadline = time.monotonic() + timeout
        while word not in self.seen and "done" not in self.seen and not self.closed \
                and time.monotonic() < deadline:
            self.read(deadline - time.monotonic())
        return word in self.seen

    @property
    def done(self) -> bool:
        return self.closed or "done" in self.seen


def run_camera(topic: str, width: int, height: int, reliability: str) -> int:
    """Publish stepped, then streamed frames on `topic`. Exits by itself whatever the test does."""
    rclpy.init()
    node = rclpy.create_node("cross_process_camera")
    pub = node.create_publisher(Image, topic, camera_qos(reliability))
    lines = Lines()
    try:
        if not wait_for(lambda: pub.get_subscription_count() >= 1, LINE_TIMEOUT_S):
            print("camera: the test's subscriber never matched", file=sys.stderr)
            return 2
        # The graph's counts say both ends are known, not that the reader has matched this writer
        # yet: a frame sent in between is dropped unseen (stepped frame 0 would be counted lost).
        # So early frames (stamped before every real one; the test ignores them) go out until the
        # test has received one and says "go".
        early = rgb_to_image(frame(0, height, width), "rgb8", header=priming_header(0))
        deadline, priming = time.monotonic() + LINE_TIMEOUT_S, 0
        while not lines.wait("go", 0.05) and not lines.done and time.monotonic() < deadline:
            early.header = priming_header(priming)
            pub.publish(early)
            priming += 1
        if "go" not in lines.seen:
            print("camera: the test never said go (no early frame arrived)", file=sys.stderr)
            return 2
        lost = []
        for index in range(STEPPED):
            pub.publish(rgb_to_image(frame(index, height, width), "rgb8", header=header(index)))
            if not lines.wait(str(index), ACK_TIMEOUT_S):
                lost.append(index)
        next_frame = time.monotonic()
        for index in range(STEPPED, STEPPED + STREAM_MAX):
            if lines.done:
                break
            pub.publish(rgb_to_image(frame(index, height, width), "rgb8", header=header(index)))
            next_frame += 1 / 30
            while True:                   # 30 Hz at most, listening for "done" after every frame
                lines.read(next_frame - time.monotonic())
                if lines.done or time.monotonic() >= next_frame:
                    break
        lines.wait("done")                # stays while the test still takes frames (reliable resends)
        if lost:
            print(f"camera: stepped frames {lost} never arrived", file=sys.stderr)
            return 1
        return 0
    finally:
        node.destroy_node()
        rclpy.try_shutdown()


# --- the test --------------------------------------------------------------------------------

def vision_qos(reliability: str) -> QoSProfile:
    """The vision node's image subscription (photon_ros/vision_node.py), default depth 1."""
    policy = ReliabilityPolicy.RELIABLE if reliability == "reliable" else ReliabilityPolicy.BEST_EFFORT
    return QoSProfile(depth=1, history=HistoryPolicy.KEEP_LAST, reliability=policy)


class Received:
    """Checks each frame on arrival (keeping 1080p frames would cost memory) and tells the camera."""

    def __init__(self, height: int, width: int) -> None:
        self.height, self.width = height, width
        self.indices: list[int] = []
        self.bad: list[str] = []
        self.primed = 0                    # the camera's early frames received (not checked, not counted)
        self.camera: subprocess.Popen | None = None
        self._telling = threading.Lock()   # the executor's threads and the test's all write lines

    def __call__(self, msg: Image) -> None:
        if msg.header.stamp.sec == PRIMING_SEC:
            self.primed += 1
            return
        index = msg.header.stamp.sec - 1000
        if msg.header != header(index):
            self.bad.append(f"frame {index}: header {msg.header}")
        elif (msg.height, msg.width, msg.encoding) != (self.height, self.width, "rgb8"):
            self.bad.append(f"frame {index}: {msg.width}x{msg.height} {msg.encoding}")
        elif not np.array_equal(image_to_rgb(msg), frame(index, self.height, self.width)):
            self.bad.append(f"frame {index}: pixels differ from those sent")
        self.indices.append(index)
        self.tell(str(index))

    def streamed(self) -> int:
        return sum(index >= STEPPED for index in self.indices)

    def tell(self, line: str) -> None:
        with self._telling:
            try:
                self.camera.stdin.write(line + "\n")
                self.camera.stdin.flush()
            except (OSError, ValueError):   # the camera has exited; its exit code says why
                pass


def camera_env() -> dict[str, str]:
    """This process's environment, with the DDS profile as scripts/dev_env.sh sets it."""
    env = dict(os.environ, ROS_AUTOMATIC_DISCOVERY_RANGE="LOCALHOST")   # never off this machine
    use_large_data_profile(env)
    return env


@pytest.fixture
def graph():
    g = RosGraph()
    yield g
    g.close()


@pytest.mark.parametrize("reliability", ["best_effort", "reliable"])
@pytest.mark.parametrize("width,height", [(640, 480), (1920, 1080)])
def test_frames_from_a_camera_process_arrive_intact(graph, tmp_path, width, height, reliability):
    topic = f"/cross_process/image_{width}x{height}_{reliability}_{os.getpid()}"
    received = Received(height, width)
    sub = graph.node("vision_side").create_subscription(Image, topic, received, vision_qos(reliability))
    log = tmp_path / "camera.log"
    with open(log, "w") as out:
        received.camera = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), topic, str(width), str(height), reliability],
            stdin=subprocess.PIPE, stdout=out, stderr=subprocess.STDOUT, text=True, env=camera_env())
    camera = received.camera
    try:
        # the camera's early frames reach us: its writer and our reader have matched each other
        assert wait_for(lambda: received.primed >= 1 or camera.poll() is not None, timeout=60), \
            "no early frame arrived"
        received.tell("go")
        wait_for(lambda: received.streamed() >= STREAM_MIN or camera.poll() is not None, timeout=120)
        received.tell("done")
        code = camera.wait(timeout=60)
    finally:
        if camera.poll() is None:
            camera.kill()
        camera.wait(timeout=10)
    why = log.read_text()[-2000:]
    assert code == 0, why
    assert received.bad == [], received.bad[:5]
    assert received.indices[:STEPPED] == list(range(STEPPED))
    assert received.streamed() >= STREAM_MIN, (received.indices, why)
    assert received.indices == sorted(set(received.indices)), "frames out of order or repeated"


if __name__ == "__main__":
    sys.exit(run_camera(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]))
