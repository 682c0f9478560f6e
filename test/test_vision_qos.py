"""The vision node's image input over real DDS, as camera drivers and the ways of starting it give
it: a best-effort driver (sensor-data QoS, or a bag of one) that a node set to `reliability:
reliable` cannot match is said on /diagnostics, not only in rclpy's one log line; and with `input:
compressed` the subscription is image_transport's `<image>/compressed` of the image topic as
remapped and namespaced, so `-r image:=...` (ros2 run, bringup) moves it as vision.launch.py's
rules do."""

import time

import numpy as np
import pytest
from builtin_interfaces.msg import Time
from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus
from rclpy.parameter import Parameter
from rclpy.qos import QoSProfile, ReliabilityPolicy, qos_profile_sensor_data
from sensor_msgs.msg import CompressedImage, Image
from std_msgs.msg import Header

from moondream_fixtures import checkpoint
from photon_ros.image_conversions import rgb_to_compressed, rgb_to_image
from photon_ros.vision_node import VisionNode
from ros_harness import RosGraph, wait_for, wait_for_match
from test_launch_arguments import defaults, plain_part

RELIABLE = QoSProfile(depth=10, reliability=ReliabilityPolicy.RELIABLE)


@pytest.fixture
def graph():
    g = RosGraph()
    yield g
    g.close()


def frame(input_kind: str, i: int = 1):
    rgb = np.random.default_rng(i).integers(0, 256, (48, 64, 3), dtype=np.uint8)
    header = Header(stamp=Time(sec=1000 + i), frame_id="camera")
    return rgb_to_image(rgb, "rgb8", header=header) if input_kind == "raw" else rgb_to_compressed(rgb, "jpeg", header=header)


def vision_node(graph, namespace: str = "", remaps: list[str] = (), **params):
    params.setdefault("model", str(checkpoint()))
    cli_args = ["--ros-args"] + [arg for rule in remaps for arg in ("-r", rule)] if remaps else None
    node = graph.add(VisionNode(context=graph.context, namespace=namespace, cli_args=cli_args,
                                parameter_overrides=[Parameter(k, value=v) for k, v in params.items()]))
    assert wait_for(lambda: node.lifecycle_state() == "active" or node.model_error, timeout=120)
    assert node.lifecycle_state() == "active", node.model_error
    return node


@pytest.mark.parametrize("input_kind", ["raw", "compressed"])
def test_a_camera_whose_qos_the_node_cannot_match_is_said_on_diagnostics(graph, input_kind):
    node = vision_node(graph, input=input_kind, reliability="reliable")
    arrays = []
    graph.node("listener").create_subscription(DiagnosticArray, "/diagnostics", arrays.append, RELIABLE)

    def status(after: float = 0.0):
        mine = [s for a in arrays if a.header.stamp.sec + a.header.stamp.nanosec / 1e9 >= after
                for s in a.status if s.name.endswith(node.get_fully_qualified_name())]
        return mine[-1] if mine else None

    msg_type, topic = (Image, "image") if input_kind == "raw" else (CompressedImage, "image/compressed")
    # realsense2_camera, or a bag of its topics: sensor-data QoS, best effort
    driver = graph.node("driver").create_publisher(msg_type, topic, qos_profile_sensor_data)
    assert wait_for(lambda: status() is not None and "cannot match" in status().message, timeout=20)
    said = status()
    assert said.level == DiagnosticStatus.WARN
    assert f"a publisher on /{topic} offers QoS this node cannot match (RELIABILITY)" in said.message
    assert "images never arrive" in said.message
    assert {v.key: v.value for v in said.values}["image_qos"] == "reliable"
    driver.publish(frame(input_kind))
    time.sleep(0.5)
    assert node.frames.received == 0 and driver.get_subscription_count() == 0

    # A publisher it does match on the same topic: its images arrive, and the warning has done its work.
    reliable = graph.node("camera").create_publisher(msg_type, topic, RELIABLE)
    wait_for_match(reliable)
    reliable.publish(frame(input_kind))
    assert wait_for(lambda: node.frames.received == 1, timeout=10)
    since = time.time()
    assert wait_for(lambda: status(since) is not None, timeout=5)
    assert "cannot match" not in status(since).message


def launch_rules(namespace_image: str) -> list[str]:
    """vision.launch.py's remaps for image:=`namespace_image`, as its vision_settings makes them."""
    settings = plain_part("vision.launch.py")["vision_settings"]({**defaults("vision.launch.py"),
                                                                   "image": namespace_image})
    return [f"{source}:={target}" for source, target in settings["remappings"]]


@pytest.mark.parametrize("namespace, remaps, topic", [
    ("", ["image:=/camera/image_raw"], "/camera/image_raw/compressed"),                 # ros2 run -r
    ("r1", ["image:=camera/image_raw"], "/r1/camera/image_raw/compressed"),             # bringup --namespace
    ("r1", launch_rules("camera/image_raw"), "/r1/camera/image_raw/compressed"),        # vision.launch.py
    ("r1", launch_rules("image"), "/r1/image/compressed"),                              # its defaults
    ("r1", ["image/compressed:=/cam/jpeg"], "/cam/jpeg"),           # the compressed topic remapped itself
], ids=["ros2-run", "bringup-namespace", "vision-launch", "vision-launch-defaults", "compressed-remapped"])
def test_compressed_input_follows_a_remap_of_image(graph, namespace, remaps, topic):
    node = vision_node(graph, namespace=namespace, remaps=remaps, input="compressed")
    assert node.subscription.topic_name == topic
    camera = graph.node("camera").create_publisher(CompressedImage, topic, RELIABLE)
    wait_for_match(camera)
    camera.publish(frame("compressed"))
    assert wait_for(lambda: node.frames.received == 1, timeout=10)
