"""Segmentation over ROS: the result -> message conversion (box normalized and in pixels, no box,
the model's error), and the vision node over real DDS with the tiny random Moondream 3 checkpoint
(its LM head scripted to say a diamond, segment_fixtures) publishing a Segmentation with the frame's
header for a `segment` prompt, the mask drawn on image_annotated inside the box, the prompt
changed at runtime, and the `infer` service's segment task (on the latest frame and on an image sent
with the request); a family without segment refuses it with the reason."""
import numpy as np
import pytest
from builtin_interfaces.msg import Time
from rclpy.parameter import Parameter
from rclpy.qos import QoSProfile, ReliabilityPolicy
from sensor_msgs.msg import Image
from std_msgs.msg import Header

import test_moondream3_checkpoints as ck
from photon_core import svg_path
from photon_ros.image_conversions import image_to_rgb, rgb_to_image
from photon_ros.msg import Segmentation
from photon_ros.srv import Infer
from photon_ros.result_messages import segmentation_message
from photon_ros.vision_node import VisionNode, skills_in_use
from ros_harness import RosGraph, wait_for, wait_for_match
from segment_fixtures import DIAMOND_PATH, script_segment

RELIABLE = QoSProfile(depth=10, reliability=ReliabilityPolicy.RELIABLE)


def head(i=7):
    return Header(stamp=Time(sec=2000 + i, nanosec=i), frame_id="camera")


def test_segmentation_message():
    result = {"path": "M 0 0 L 1 1 Z", "bbox": {"x_min": 0.25, "y_min": 0.5, "x_max": 0.75, "y_max": 1.0}}
    msg = segmentation_message(result, head(), prompt="cup", width=640, height=480, latency=0.25,
                               model_id="moondream3")
    assert msg.header == head() and msg.prompt == "cup" and msg.model_id == "moondream3"
    assert (msg.image_width, msg.image_height) == (640, 480) and msg.path == "M 0 0 L 1 1 Z"
    assert msg.has_bbox and msg.error == ""
    assert (msg.x_min, msg.y_min, msg.x_max, msg.y_max) == (0.25, 0.5, 0.75, 1.0)
    assert (msg.x_min_px, msg.y_min_px, msg.x_max_px, msg.y_max_px) == (160.0, 240.0, 480.0, 480.0)
    assert (msg.latency.sec, msg.latency.nanosec) == (0, 250_000_000)
    # no box, and words that were not a path
    msg = segmentation_message({"path": "", "bbox": None, "error": "unexpected SVG path token 'cup'"}, head(),
                               prompt="cup", width=8, height=4, latency=0.0, model_id="m")
    assert not msg.has_bbox and msg.x_max_px == 0.0 and msg.path == ""
    assert msg.error == "unexpected SVG path token 'cup'"


def test_segment_needs_the_skill():
    assert skills_in_use([], [], False, ["cup"]) == ["segment"]
    assert skills_in_use(["cup"], [], True) == ["detect", "caption"]


@pytest.fixture
def graph():
    g = RosGraph()
    yield g
    g.close()


def gradient(h=200, w=300):
    y, x = np.mgrid[0:h, 0:w]
    return np.stack([x % 256, y % 256, (2 * x + y) % 256], -1).astype(np.uint8)


def test_vision_node_publishes_segmentation(graph, monkeypatch):
    folder = ck.checkpoint("safetensors")[0]
    node = graph.add(VisionNode(context=graph.context, parameter_overrides=[
        Parameter("model", value=str(folder)), Parameter("segment", value=["cup"]),
        Parameter("segment_max_tokens", value=40), Parameter("reliability", value="reliable"),
        Parameter("max_frame_age_s", value=600.0)]))   # its last frame is asked about after inference
    assert wait_for(lambda: node.engine is not None or node.model_error, timeout=120)
    assert node.engine is not None, node.model_error
    assert node.engine.family.name == "moondream3"
    script_segment(monkeypatch, folder)   # after the warm-up (a detect) so the script starts afresh
    got, annotated = [], []
    listen = graph.node("listen")
    listen.create_subscription(Segmentation, "segmentation", got.append, RELIABLE)
    listen.create_subscription(Image, "image_annotated", annotated.append, RELIABLE)
    pub = graph.node("camera").create_publisher(Image, "image", RELIABLE)
    wait_for_match(pub)
    assert wait_for(lambda: node.pub_annotated.get_subscription_count() > 0, timeout=10)
    rgb = gradient()
    pub.publish(rgb_to_image(rgb, "rgb8", header=head(7)))
    assert wait_for(lambda: got and annotated, timeout=60)
    s = got[0]
    assert s.header == head(7) and s.prompt == "cup" and s.model_id == "moondream3"
    assert (s.image_width, s.image_height) == (300, 200)
    assert s.path == DIAMOND_PATH and s.error == "" and s.has_bbox
    assert 0 <= s.x_min < s.x_max <= 1 and 0 <= s.y_min < s.y_max <= 1
    assert s.x_max_px == pytest.approx(s.x_max * 300, rel=1e-5) and s.y_min_px == pytest.approx(s.y_min * 200, rel=1e-5)
    assert s.latency.sec + s.latency.nanosec > 0
    # The annotated frame: the mask's pixels changed, nothing else (so nothing outside the box)
    drawn = annotated[0]
    assert drawn.header == head(7)
    changed = (image_to_rgb(drawn) != rgb).any(-1)
    box = {"x_min": s.x_min, "y_min": s.y_min, "x_max": s.x_max, "y_max": s.y_max}
    mask, _ = svg_path.rasterise(s.path, box, 300, 200)
    assert mask.sum() > 50
    np.testing.assert_array_equal(changed, mask)
    # A new prompt at runtime
    node.set_parameters([Parameter("segment", value=["red dog"])])
    pub.publish(rgb_to_image(rgb, "rgb8", header=head(8)))
    assert wait_for(lambda: any(m.header == head(8) for m in got), timeout=60)
    assert [m.prompt for m in got if m.header == head(8)] == ["red dog"]
    # The infer service: segment on the latest frame, then on an image sent with the request
    node.set_parameters([Parameter("segment", value=[])])   # no frame work beside the calls
    client = graph.node("client").create_client(Infer, "infer")
    assert client.wait_for_service(timeout_sec=10)
    reply = call(client, Infer.Request(task=Infer.Request.TASK_SEGMENT, prompt="mug", use_latest_frame=True))
    assert reply.success, reply.message
    seg = reply.segmentation
    assert seg.header == head(8) and seg.prompt == "mug" and seg.path == DIAMOND_PATH and seg.has_bbox
    assert (seg.image_width, seg.image_height) == (300, 200)
    small = gradient(120, 160)
    reply = call(client, Infer.Request(task="segment", prompt="cup", use_latest_frame=False,
                                       image=rgb_to_image(small, "rgb8", header=head(9))))
    assert reply.success, reply.message
    assert reply.segmentation.header == head(9) and (reply.segmentation.image_width, reply.segmentation.image_height) == (160, 120)
    assert reply.segmentation.path == DIAMOND_PATH
    # A request the service cannot serve is answered, and the node goes on
    reply = call(client, Infer.Request(task="segment", prompt="cup", use_latest_frame=False, image=Image()))
    assert not reply.success and reply.message


def call(client, request, timeout=60):
    future = client.call_async(request)
    assert wait_for(future.done, timeout=timeout)
    return future.result()


def test_a_family_without_segment_is_refused_with_the_reason(graph):
    from moondream_fixtures import checkpoint as md2_checkpoint
    node = graph.add(VisionNode(context=graph.context, parameter_overrides=[
        Parameter("model", value=str(md2_checkpoint())), Parameter("segment", value=["cup"])]))
    assert wait_for(lambda: node.engine is not None or node.model_error, timeout=120)
    assert node.engine is None and "moondream model cannot segment" in node.model_error


def test_segment_targets_wait_for_the_model_that_can_segment(graph):
    """On a Moondream 2 node segment targets are refused (every frame would fail with them, its
    detections too), also beside a change of model to Moondream 3: that model is loaded only at
    the next configure, and the refusal says so."""
    from moondream_fixtures import checkpoint as md2_checkpoint
    node = graph.add(VisionNode(context=graph.context, parameter_overrides=[
        Parameter("model", value=str(md2_checkpoint()))]))
    assert wait_for(lambda: node.engine is not None or node.model_error, timeout=120)
    assert node.engine is not None, node.model_error
    refused = node.set_parameters([Parameter("segment", value=["cup"])])[0]
    assert not refused.successful and "cannot segment" in refused.reason and "next configure" not in refused.reason
    md3 = str(ck.checkpoint("safetensors")[0])
    refused = node.set_parameters_atomically([Parameter("model", value=md3), Parameter("segment", value=["cup"])])
    assert not refused.successful and "is loaded at the next configure: set segment after it" in refused.reason
    assert node.params["model"] == str(md2_checkpoint()) and node.segment_targets == []


def test_infer_segment_on_a_family_without_it_is_refused(graph):
    from moondream_fixtures import checkpoint as md2_checkpoint
    node = graph.add(VisionNode(context=graph.context, parameter_overrides=[
        Parameter("model", value=str(md2_checkpoint()))]))
    assert wait_for(lambda: node.engine is not None or node.model_error, timeout=120)
    assert node.engine is not None, node.model_error
    client = graph.node("client").create_client(Infer, "infer")
    assert client.wait_for_service(timeout_sec=10)
    reply = call(client, Infer.Request(task="segment", prompt="cup", use_latest_frame=False,
                                       image=rgb_to_image(gradient(64, 64), "rgb8", header=head(1))))
    assert not reply.success and "moondream model cannot segment" in reply.message


def test_a_canceled_segment_stops_its_decode(monkeypatch):
    """A find goal's cancel took effect only when its segment decode ended (or after another
    caller's work released the engine): it now ends the decode between two path commands, and
    the wait for the engine too; what was found is kept, marked canceled."""
    import threading

    from photon_core.runtime.shared_models import release, shared_engine
    from photon_ros.vision_node import segment_frame

    folder = ck.checkpoint("safetensors")[0]
    engine = shared_engine(str(folder), skills=["segment"])
    try:
        script_segment(monkeypatch, folder)
        rgb = gradient()
        whole = segment_frame(engine, rgb, ["cup"], 40, threading.Event())[0]
        assert whole["path"] == DIAMOND_PATH and whole["bbox"] is not None   # as without a cancel
        script_segment(monkeypatch, folder)
        canceled = threading.Event()
        canceled.set()
        stopped = segment_frame(engine, rgb, ["cup", "mug"], 40, canceled)
        assert [s["error"] for s in stopped] == ["canceled", "canceled"] and stopped[0]["path"] == ""
        assert stopped[0]["bbox"] == whole["bbox"]   # found before the first path command ended
        with engine.lock:   # another caller's work holds the engine: the wait ends too
            assert segment_frame(engine, rgb, ["cup"], 40, canceled) == [{"path": "", "bbox": None, "error": "canceled"}]
    finally:
        release(engine)
