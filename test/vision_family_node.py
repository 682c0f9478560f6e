"""One round trip of the vision node with a caption/query family (Gemma 4, Qwen 3.5, ...) over real
DDS: a periodic caption stamped with the frame's header, the infer service's query on the latest
frame, and detect and Moondream's query options refused with the family's reason."""
from __future__ import annotations

from pathlib import Path

import numpy as np
from builtin_interfaces.msg import Time
from rclpy.parameter import Parameter
from rclpy.qos import QoSProfile, ReliabilityPolicy
from sensor_msgs.msg import Image
from std_msgs.msg import Header

from photon_ros.image_conversions import rgb_to_image
from photon_ros.msg import SpatialRef, VisionText
from photon_ros.srv import Infer
from photon_ros.vision_node import VisionNode
from ros_harness import RosGraph, wait_for, wait_for_match

RELIABLE = QoSProfile(depth=10, reliability=ReliabilityPolicy.RELIABLE)


def caption_query_round_trip(graph: RosGraph, folder: Path, family: str) -> None:
    node = graph.add(VisionNode(context=graph.context, parameter_overrides=[
        Parameter("model", value=str(folder)), Parameter("caption_period_s", value=0.01),
        Parameter("caption_length", value="short"), Parameter("reliability", value="reliable"),
        Parameter("max_frame_age_s", value=600.0)]))   # one frame, queried after slow captions
    assert wait_for(lambda: node.engine is not None or node.model_error, timeout=120)
    assert node.engine is not None, node.model_error
    assert node.engine.family.name == family
    captions = []
    graph.node("listen").create_subscription(VisionText, "caption", captions.append, RELIABLE)
    pub = graph.node("camera").create_publisher(Image, "image", RELIABLE)
    wait_for_match(pub)
    rgb = np.random.default_rng(0).integers(0, 256, (48, 64, 3), dtype=np.uint8)
    head = Header(stamp=Time(sec=5, nanosec=6), frame_id="camera")
    pub.publish(rgb_to_image(rgb, "rgb8", header=head))
    assert wait_for(lambda: captions, timeout=120)
    c = captions[0]
    assert c.header == head and c.task == VisionText.TASK_CAPTION and c.model_id == folder.name

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
    # What only Moondream has (grounded reasoning, spatial references, variants): refused with the
    # reason, never answered as if the option had been used.
    here = SpatialRef(kind=SpatialRef.KIND_POINT, x=0.5, y=0.5)
    for option, value in (("reasoning", True), ("spatial_refs", [here]), ("variant", "adapter")):
        future = client.call_async(Infer.Request(task="query", prompt="what is this?", use_latest_frame=True,
                                                 max_tokens=4, **{option: value}))
        assert wait_for(future.done, timeout=60)
        assert not future.result().success and option in future.result().message
    assert node.requests_failed == 4 and "variant" in node.last_request_error
