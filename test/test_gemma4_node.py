"""The vision node over real DDS with the tiny random Gemma 4 checkpoint (test_gemma4_fixtures):
periodic captions published with the frame's header, and the on-demand service answering a query
and refusing a task the family does not have."""
import json
import shutil

import pytest
from builtin_interfaces.msg import Time
from rclpy.parameter import Parameter
from rclpy.qos import QoSProfile, ReliabilityPolicy
from sensor_msgs.msg import Image
from std_msgs.msg import Header

from test_gemma4_fixtures import EOS, EOT, SPECIALS, VOCAB, gemma4_dir, gemma4_hf  # noqa: F401
from photon_ros.image_conversions import rgb_to_image
from photon_ros.msg import VisionText
from photon_ros.srv import Infer
from photon_ros.vision_node import VisionNode
from ros_harness import RosGraph, wait_for, wait_for_match

import numpy as np

RELIABLE = QoSProfile(depth=10, reliability=ReliabilityPolicy.RELIABLE)


@pytest.fixture
def graph():
    g = RosGraph()
    yield g
    g.close()


@pytest.fixture(scope="module")
def quick_dir(gemma4_dir, tmp_path_factory):
    """The same checkpoint with every other token an end token, so the node's full-length
    requests (768 tokens allowed) end after a few tokens on these random weights."""
    folder = tmp_path_factory.mktemp("gemma4_quick") / "gemma4-quick"
    shutil.copytree(gemma4_dir, folder)
    eos = [EOS, EOT] + list(range(len(SPECIALS), VOCAB, 2))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    return folder


def test_vision_node_captions_and_answers_with_gemma4(graph, quick_dir):
    node = graph.add(VisionNode(context=graph.context, parameter_overrides=[
        Parameter("model", value=str(quick_dir)), Parameter("caption_period_s", value=0.01),
        Parameter("caption_length", value="short"), Parameter("reliability", value="reliable")]))
    assert wait_for(lambda: node.engine is not None or node.model_error, timeout=120)
    assert node.engine is not None, node.model_error
    assert node.engine.family.name == "gemma4"
    captions = []
    graph.node("listen").create_subscription(VisionText, "caption", captions.append, RELIABLE)
    pub = graph.node("camera").create_publisher(Image, "image", RELIABLE)
    wait_for_match(pub)
    rgb = np.random.default_rng(0).integers(0, 256, (48, 64, 3), dtype=np.uint8)
    head = Header(stamp=Time(sec=5, nanosec=6), frame_id="camera")
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
