"""The vision node over real DDS with a tiny random Qwen 3.5 checkpoint (test_qwen3_5_fixtures):
periodic captions stamped with the frame's header, the on-demand service answering a query, and a
skill the family lacks refused with the reason."""
import json

import numpy as np
import pytest
from builtin_interfaces.msg import Time
from rclpy.parameter import Parameter
from rclpy.qos import QoSProfile, ReliabilityPolicy
from sensor_msgs.msg import Image
from std_msgs.msg import Header

from test_qwen3_5_fixtures import SPECIALS, VOCAB, build
from photon_ros.image_conversions import rgb_to_image
from photon_ros.msg import VisionText
from photon_ros.srv import Infer
from photon_ros.vision_node import VisionNode
from ros_harness import RosGraph, wait_for, wait_for_match

RELIABLE = QoSProfile(depth=10, reliability=ReliabilityPolicy.RELIABLE)


@pytest.fixture
def graph():
    g = RosGraph()
    yield g
    g.close()


@pytest.fixture(scope="module")
def quick_dir(tmp_path_factory):
    """The tiny checkpoint with every other ordinary token an end token, so the node's full-length
    requests (768 tokens allowed) end after a few tokens on random weights."""
    folder = tmp_path_factory.mktemp("qwen3_5_node") / "qwen3_5-quick"
    build(folder)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": list(range(1, VOCAB - len(SPECIALS), 2))}))
    return folder


def test_vision_node_captions_and_answers_with_qwen3_5(graph, quick_dir):
    node = graph.add(VisionNode(context=graph.context, parameter_overrides=[
        Parameter("model", value=str(quick_dir)), Parameter("caption_period_s", value=0.01),
        Parameter("caption_length", value="short"), Parameter("reliability", value="reliable")]))
    assert wait_for(lambda: node.engine is not None or node.model_error, timeout=120)
    assert node.engine is not None, node.model_error
    assert node.engine.family.name == "qwen3_5"
    captions = []
    graph.node("listen").create_subscription(VisionText, "caption", captions.append, RELIABLE)
    pub = graph.node("camera").create_publisher(Image, "image", RELIABLE)
    wait_for_match(pub)
    rgb = np.random.default_rng(0).integers(0, 256, (48, 64, 3), dtype=np.uint8)
    head = Header(stamp=Time(sec=7, nanosec=8), frame_id="camera")
    pub.publish(rgb_to_image(rgb, "rgb8", header=head))
    assert wait_for(lambda: captions, timeout=120)
    c = captions[0]
    assert c.header == head and c.task == VisionText.TASK_CAPTION and c.model_id == quick_dir.name

    client = graph.node("client").create_client(Infer, "infer")
    assert client.wait_for_service(timeout_sec=10)
    future = client.call_async(Infer.Request(task="query", prompt="what is in this image?", use_latest_frame=True))
    assert wait_for(future.done, timeout=120)
    result = future.result()
    assert result.success, result.message
    assert result.text.task == "query" and result.text.prompt == "what is in this image?"
    future = client.call_async(Infer.Request(task="detect", prompt="cup", use_latest_frame=True))
    assert wait_for(future.done, timeout=30)
    assert not future.result().success and "cannot detect" in future.result().message
