"""The options of on-demand vision requests (infer, find, ask) as the engine takes them, and
reasoning results as messages: spatial references checked and converted, each option refused with
the reason where its task does not take it, grounding placed in pixels."""
import math

import pytest
from std_msgs.msg import Header

from photon_ros.action import Ask, Find
from photon_ros.msg import SpatialRef
from photon_ros.result_messages import vision_text_message
from photon_ros.srv import Infer
from photon_ros.vision_requests import engine_request, missing_reasoning, request_options, spatial_refs


def point(x, y, **extra):
    return SpatialRef(kind=SpatialRef.KIND_POINT, x=x, y=y, **extra)


def box(x, y, x_max, y_max):
    return SpatialRef(kind=SpatialRef.KIND_BOX, x=x, y=y, x_max=x_max, y_max=y_max)


def test_spatial_refs_become_the_engines_points_and_boxes():
    got = spatial_refs([point(0.25, 0.5), box(0.0, 0.125, 1.0, 0.75)])
    assert got == [(0.25, 0.5), (0.0, 0.125, 1.0, 0.75)]
    for bad, why in [(SpatialRef(x=0.5, y=0.5), "kind must be 'point' or 'box'"),
                     (point(320.0, 240.0), "normalized to [0, 1] of the image (not pixels)"),
                     (point(math.nan, 0.5), "normalized"),
                     (point(0.5, 0.5, x_max=0.7), "a point has only x and y"),
                     (box(0.6, 0.1, 0.4, 0.9), "x <= x_max and y <= y_max")]:
        with pytest.raises(ValueError, match=r"spatial_refs\[1\]") as err:
            spatial_refs([point(0.1, 0.1), bad])
        assert why in str(err.value)


def test_defaults_ask_what_the_node_always_asked_greedy():
    request = engine_request("query", None, "what is this?", Infer.Request(task="query"), 7)
    assert (request.temperature, request.top_p, request.settings, request.reasoning, request.spatial_refs) == \
        (0.0, 1.0, None, False, None)
    assert request.options().temperature == 0.0
    assert engine_request("point", None, "cup", Find.Goal(task="point"), 7).max_objects == 7
    assert engine_request("point", None, "cup", Find.Goal(task="point", max_objects=2), 7).max_objects == 2


def test_options_reach_the_request_and_misplaced_ones_are_refused():
    ask = Ask.Goal(task="query", reasoning=True, spatial_refs=[point(0.5, 0.5)], temperature=0.7, top_p=0.9,
                   max_tokens=20, variant=" my-adapter ")
    request = engine_request("query", None, "what is here?", ask, 7)
    assert request.reasoning and request.spatial_refs == [(0.5, 0.5)]
    assert request.settings == {"temperature": pytest.approx(0.7), "top_p": pytest.approx(0.9), "max_tokens": 20,
                                "max_objects": 7, "variant": "my-adapter"}
    assert request.options().variant == "my-adapter"
    for task, msg, why in [
            ("detect", Infer.Request(reasoning=True), "reasoning applies to query, not to detect"),
            ("caption", Ask.Goal(reasoning=True), "reasoning applies to query"),
            ("detect", Infer.Request(spatial_refs=[point(0.5, 0.5)]), "spatial_refs applies to query, point"),
            ("detect", Find.Goal(spatial_refs=[point(0.5, 0.5)]), "spatial_refs applies"),
            ("point", Infer.Request(temperature=0.5), "temperature and top_p applies to caption, query"),
            ("query", Infer.Request(temperature=-1.0), "temperature must be >= 0"),
            ("query", Ask.Goal(top_p=1.5), "top_p must be in (0, 1]"),
            ("detect", Infer.Request(max_tokens=5), "max_tokens applies"),
            ("query", Infer.Request(max_objects=5), "max_objects applies"),
            ("segment", Find.Goal(variant="a"), "variant applies"),
            ("point", Find.Goal(spatial_refs=[point(2.0, 0.5)]), "not pixels")]:
        with pytest.raises(ValueError) as err:
            request_options(task, msg, 7)
        assert why in str(err.value), (task, str(err.value))


def test_reasoning_result_as_a_message_with_its_grounding_in_pixels():
    reasoning = {"text": "The cup is left of the dog.",
                 "grounding": [{"start_idx": 4, "end_idx": 7, "points": [(0.25, 0.5)]},
                               {"start_idx": 23, "end_idx": 26, "points": [(0.75, 0.5), (0.5, 1.0)]}]}
    msg = vision_text_message(" A cup. ", Header(frame_id="camera"), task="query", prompt="what?", latency=0.1,
                              model_id="m", reasoning=reasoning, width=200, height=100)
    assert msg.text == "A cup." and msg.reasoning == reasoning["text"]
    assert [(s.start, s.end, s.text) for s in msg.grounding] == [(4, 7, "cup"), (23, 26, "dog")]
    assert [(p.x, p.y, p.x_px, p.y_px, p.label) for p in msg.grounding[1].points] == \
        [(0.75, 0.5, 150.0, 50.0, "dog"), (0.5, 1.0, 100.0, 100.0, "dog")]
    assert math.isnan(msg.grounding[0].points[0].score)
    plain = vision_text_message("A cup.", Header(), task="query", prompt="what?", latency=0.1, model_id="m")
    assert plain.reasoning == "" and not plain.grounding
    missing_reasoning(False, {"answer": "x"})
    with pytest.raises(ValueError, match="without reasoning"):
        missing_reasoning(True, {"answer": "x"})


def test_seconds_become_a_ros_time_exactly_or_are_refused():
    """Rounded to the nanosecond and carried into the seconds (1.9999999996 s was (1, 999999999));
    a value with no time (NaN, infinite) or past int32 seconds (sent wrapped to 1901) refused."""
    from photon_ros.result_messages import seconds_to_duration, seconds_to_time
    t = seconds_to_time(1.9999999996)
    assert (t.sec, t.nanosec) == (2, 0)
    t = seconds_to_time(-0.25)
    assert (t.sec, t.nanosec) == (-1, 750_000_000)
    d = seconds_to_duration(0.0300000004)
    assert (d.sec, d.nanosec) == (0, 30_000_000)
    for bad in (float("nan"), float("inf"), 2.0**31 + 0.5, -(2.0**31) - 1):
        with pytest.raises(ValueError, match="ROS time"):
            seconds_to_time(bad)


def test_infer_refuses_a_task_that_is_none_of_its_own():
    """An unknown task (a typo, an empty field) is refused as such, not as one the loaded model lacks
    ("a moondream model cannot  (it offers ...)"), and counted."""
    import time
    from types import SimpleNamespace

    from photon_ros.vision_node import VisionNode

    refused = []
    node = SimpleNamespace(refused=lambda what, why: refused.append((what, why)) or why,
                           lacks=lambda task: f"a moondream model cannot {task}")
    for task in ("", "Detect", "transcribe"):
        response = VisionNode.infer(node, Infer.Request(task=task, prompt="cup"), Infer.Response(), time.monotonic())
        assert not response.success
        assert response.message == f"task must be one of detect, point, caption, query, segment, got {task!r}"
    assert len(refused) == 3
