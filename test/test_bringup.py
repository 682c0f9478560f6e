"""The whole graph from config/photon.yaml without ros2 launch, namespaced and remapped, closing
the loop from speech to a target: spoken WAV -> speech -> loop -> vision (infer) -> ImageTarget.
Also checks that the launch files name only executables we install and configs we ship."""
import ast
import re
import time
from pathlib import Path

import numpy as np
import pytest
from rclpy.qos import QoSProfile, ReliabilityPolicy
from sensor_msgs.msg import Image
from std_msgs.msg import String

from moondream_fixtures import checkpoint
from photon_ros.bringup import DEFAULT_CONFIG, build_graph, flatten
from photon_ros.image_conversions import rgb_to_image
from photon_ros.msg import ImageTarget, Transcript
from ros_harness import RosGraph, wait_for, wait_for_match
from speech_audio import espeak_wav

ROOT = Path(__file__).resolve().parents[1]
RELIABLE = QoSProfile(depth=10, reliability=ReliabilityPolicy.RELIABLE)


def test_flatten_names_nested_parameters_like_ros():
    assert flatten({"model": "m", "vad": {"hangover_s": 0.6, "x": {"y": 1}}}) == {
        "model": "m", "vad.hangover_s": 0.6, "vad.x.y": 1}


def test_launch_files_use_installed_executables_and_shipped_config():
    installed = re.search(r"install\(PROGRAMS ([^\n]+)", (ROOT / "CMakeLists.txt").read_text()).group(1).split()
    for launch in (ROOT / "launch").glob("*.launch.py"):
        tree = ast.parse(launch.read_text())
        for call in (n for n in ast.walk(tree) if isinstance(n, ast.Call)):
            for kw in call.keywords:
                if kw.arg == "executable":
                    assert f"nodes/{kw.value.value}" in installed and (ROOT / "nodes" / kw.value.value).exists()
        for const in (n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)):
            if const.endswith(".yaml"):
                assert (ROOT / "config" / const).exists(), f"{launch.name} names missing config {const}"
            if const.endswith(".launch.py"):
                assert (ROOT / "launch" / const).exists()


@pytest.fixture
def graph():
    g = RosGraph()
    yield g
    g.close()


def test_spoken_command_to_target_through_bringup(graph):
    nodes = build_graph(DEFAULT_CONFIG, "all", namespace="robot1", remaps=["image:=/camera/image_raw"],
                        wav=str(espeak_wav("Find the red ball.")), context=graph.context,
                        overrides={"vision": {"model": str(checkpoint()), "max_objects": 1,
                                              "reliability": "reliable"},
                                   "wav_publisher": {"speed": 2.0}})
    names = sorted(n.get_fully_qualified_name() for n in nodes)
    assert names == ["/robot1/loop", "/robot1/speech", "/robot1/vision", "/robot1/wav_publisher"]
    player = next(n for n in nodes if n.get_name() == "wav_publisher")
    player.timer.cancel()             # start playback once the camera has sent a frame
    for node in nodes:
        graph.add(node)
    targets = []
    transcripts, status = [], []
    listener = graph.node("listener")
    listener.create_subscription(ImageTarget, "/robot1/image_target", targets.append, RELIABLE)
    listener.create_subscription(Transcript, "/robot1/transcript", transcripts.append, RELIABLE)
    listener.create_subscription(String, "/robot1/status", status.append, RELIABLE)
    camera = graph.node("camera").create_publisher(Image, "/camera/image_raw", RELIABLE)
    wait_for_match(camera)
    vision = next(n for n in nodes if n.get_name() == "vision")
    speech = next(n for n in nodes if n.get_name() == "speech")
    assert wait_for(lambda: vision.engine is not None and speech.model is not None, timeout=120), \
        (vision.model_error, speech.model_error)
    frame = np.random.default_rng(0).integers(0, 256, (96, 128, 3), dtype=np.uint8)
    camera.publish(rgb_to_image(frame))
    assert wait_for(lambda: vision.frames.latest is not None, timeout=10)
    player.t0 = time.time()
    player.timer.reset()
    assert wait_for(lambda: targets, timeout=120), ([t.text for t in transcripts], [s.data for s in status])
    finals = [t for t in transcripts if t.is_final]   # partials may come first, while it is spoken
    assert finals[0].text.lower().strip(".") == "find the red ball"
    # status is another topic: it may arrive a moment after the target
    assert wait_for(lambda: any("found red ball" in s.data for s in status), timeout=10), [s.data for s in status]
    t = targets[0]
    assert (t.image_width, t.image_height) == (128, 96)
    assert 0.0 <= t.x <= 1.0 and 0.0 <= t.y <= 1.0 and 0.0 <= t.x_px <= 128 and 0.0 <= t.y_px <= 96
