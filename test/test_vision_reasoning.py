"""Reasoning and spatial references through the vision node over real DDS, with the tests' small
random Moondream checkpoint: what the infer service and the find / ask actions return equals
photon_core's own call with the same options on the same frame (so the options reached the model),
a reference the node cannot take is refused with the reason, and the node keeps serving; a
fine-tuned variant (a random LoRA adapter) is used when a request names it."""
import numpy as np
import pytest
import torch
from action_msgs.msg import GoalStatus
from builtin_interfaces.msg import Time
from diagnostic_msgs.msg import DiagnosticArray
from rclpy.action import ActionClient
from rclpy.node import Node
from rclpy.parameter import Parameter
from rclpy.qos import QoSProfile, ReliabilityPolicy
from sensor_msgs.msg import Image
from std_msgs.msg import Header

from moondream_fixtures import checkpoint, lora_adapter as adapter
from photon_ros.action import Ask, Find
from photon_ros.image_conversions import rgb_to_image
from photon_ros.msg import SpatialRef
from photon_ros.srv import Infer
from photon_ros.vision_node import VisionNode
from ros_harness import RosGraph, wait_for, wait_for_match

RELIABLE = QoSProfile(depth=10, reliability=ReliabilityPolicy.RELIABLE)
# What the node asks when a request leaves the sampling options alone: greedy.
GREEDY = {"temperature": 0.0, "top_p": 1.0, "max_tokens": 6, "max_objects": 3}


@pytest.fixture
def graph():
    g = RosGraph()
    yield g
    g.close()


def call(client, request, timeout=60):
    future = client.call_async(request)
    assert wait_for(future.done, timeout=timeout)
    return future.result()


def goal_outcome(client, goal, timeout=60):
    sent = client.send_goal_async(goal)
    assert wait_for(sent.done, timeout=30) and sent.result().accepted
    result = sent.result().get_result_async()
    assert wait_for(result.done, timeout=timeout)
    return result.result()


def grounding(spans):
    """A VisionText's grounding as query()'s: [(start, end, [(x, y), ...])]."""
    return [(s.start, s.end, [(p.x, p.y) for p in s.points]) for s in spans]


def expected_grounding(reasoning):
    return [(g["start_idx"], g["end_idx"], [pytest.approx(p) for p in g["points"]]) for g in reasoning["grounding"]]


def test_reasoning_spatial_references_and_variants_over_dds(graph, tmp_path):
    node = graph.add(VisionNode(context=graph.context, parameter_overrides=[
        Parameter("model", value=str(checkpoint())), Parameter("max_objects", value=3),
        Parameter("reliability", value="reliable"), Parameter("max_frame_age_s", value=600.0)]))
    assert wait_for(lambda: node.engine is not None or node.model_error, timeout=120), node.model_error
    diagnostics = []
    graph.node("listen").create_subscription(DiagnosticArray, "/diagnostics", diagnostics.append, RELIABLE)
    # The clients are made before the node joins the spinning executor: an ActionClient made on a
    # node being spun can be waited on before its __init__ has finished (rclpy: no `_lock` yet).
    client_node = Node("client", context=graph.context)
    infer = client_node.create_client(Infer, "infer")
    find, ask = ActionClient(client_node, Find, "find"), ActionClient(client_node, Ask, "ask")
    graph.add(client_node)
    assert infer.wait_for_service(timeout_sec=10)
    assert find.wait_for_server(timeout_sec=30) and ask.wait_for_server(timeout_sec=30)
    camera = graph.node("camera").create_publisher(Image, "image", RELIABLE)
    wait_for_match(camera)
    rgb = np.random.default_rng(3).integers(0, 256, (96, 128, 3), dtype=np.uint8)
    head = Header(stamp=Time(sec=9, nanosec=1), frame_id="camera")
    camera.publish(rgb_to_image(rgb, header=head))
    assert wait_for(lambda: node.frames.latest is not None, timeout=10)
    model = node.engine.model
    here = SpatialRef(kind=SpatialRef.KIND_POINT, x=0.5, y=0.5)
    region = SpatialRef(kind=SpatialRef.KIND_BOX, x=0.1, y=0.2, x_max=0.4, y_max=0.9)

    # Reasoning: the reasoning text and the points it rests on, normalized and in pixels.
    reply = call(infer, Infer.Request(task="query", prompt="what is this?", use_latest_frame=True,
                                      reasoning=True, max_tokens=6))
    assert reply.success, reply.message
    plain = model.query(rgb, "what is this?", reasoning=True, settings=GREEDY)
    text = reply.text
    assert text.header == head and text.text == plain["answer"].strip()
    assert text.reasoning == plain["reasoning"]["text"] and text.grounding
    assert grounding(text.grounding) == expected_grounding(plain["reasoning"])
    first = text.grounding[0]
    assert first.text == text.reasoning[first.start:first.end]
    assert [(p.x_px, p.y_px) for p in first.points] == [pytest.approx((p.x * 128, p.y * 96)) for p in first.points]

    # "What is at this point?" as an action goal: the references reach the model (the grounding is
    # photon_core's with the same references, not the one without them).
    done = goal_outcome(ask, Ask.Goal(task="query", prompt="what is this?", use_latest_frame=True, max_tokens=6,
                                      reasoning=True, spatial_refs=[here, region]))
    assert done.status == GoalStatus.STATUS_SUCCEEDED, done.result.message
    referred = model.query(rgb, "what is this?", reasoning=True, spatial_refs=[(0.5, 0.5), (0.1, 0.2, 0.4, 0.9)],
                           settings=GREEDY)
    assert grounding(done.result.text.grounding) == expected_grounding(referred["reasoning"])
    assert expected_grounding(referred["reasoning"]) != expected_grounding(plain["reasoning"])
    assert done.result.text.text == referred["answer"].strip()

    # Pixels where normalized coordinates belong: refused with the reason, counted on /diagnostics,
    # and the node answers the next request.
    pixels = SpatialRef(kind=SpatialRef.KIND_POINT, x=64.0, y=48.0)
    reply = call(infer, Infer.Request(task="point", prompt="cup", use_latest_frame=True, spatial_refs=[pixels]))
    assert not reply.success and "spatial_refs[0]" in reply.message and "not pixels" in reply.message

    def reported(key):
        values = {v.key: v.value for a in diagnostics[-1:] for v in a.status[0].values}
        return values.get(key, "")
    assert wait_for(lambda: reported("requests_failed") == "1", timeout=5)
    assert "not pixels" in reported("last_request_error")
    done = goal_outcome(ask, Ask.Goal(task="caption", prompt="short", use_latest_frame=True, reasoning=True))
    assert done.status == GoalStatus.STATUS_ABORTED and "reasoning applies to query" in done.result.message

    # Point relative to a place: photon_core's points for the same references.
    done = goal_outcome(find, Find.Goal(task="point", prompt="cup", use_latest_frame=True, spatial_refs=[here]))
    assert done.status == GoalStatus.STATUS_SUCCEEDED, done.result.message
    want = model.point(rgb, "cup", settings=GREEDY, spatial_refs=[(0.5, 0.5)])["points"]
    assert want != model.point(rgb, "cup", settings=GREEDY)["points"]
    assert [(p.x, p.y) for p in done.result.points.points] == [pytest.approx((p["x"], p["y"])) for p in want]

    # A fine-tuned variant (a random LoRA adapter file): photon_core's points with that variant.
    torch.save(adapter(model.config.text, seed=5), tmp_path / "final.pt")
    reply = call(infer, Infer.Request(task="point", prompt="cup", use_latest_frame=True, variant=str(tmp_path)))
    assert reply.success, reply.message
    tuned = model.point(rgb, "cup", settings={**GREEDY, "variant": str(tmp_path)})["points"]
    assert tuned != model.point(rgb, "cup", settings=GREEDY)["points"]
    assert [(p.x, p.y) for p in reply.points.points] == [pytest.approx((p["x"], p["y"])) for p in tuned]
    reply = call(infer, Infer.Request(task="point", prompt="cup", use_latest_frame=True,
                                      variant=str(tmp_path / "missing")))
    assert not reply.success and "not found" in reply.message
    assert node.requests_failed == 3
