"""/diagnostics of the vision node across a manager's transitions: frames that failed under one
configuration are not reported after the next (a fixed model or camera may send no frame for a
long while to clear them), while a deactivate and activate, which change nothing, still report
them. One real (unspun) rclpy node whose configure loads a model without weights."""
import time
from types import SimpleNamespace

import pytest
import rclpy
from diagnostic_msgs.msg import DiagnosticStatus
from rclpy.parameter import Parameter

from photon_core.runtime.shared_models import SharedModel
from photon_ros.input_health import FAILING_IN_A_ROW
from photon_ros.managed import SUCCESS
from photon_ros.vision_node import VisionNode


def level(value) -> int:
    """A status level as an int (rosidl gives the byte fields and constants as bytes)."""
    value = value.level if isinstance(value, DiagnosticStatus) else value
    return value[0] if isinstance(value, bytes) else value


ERROR, WARN = level(DiagnosticStatus.ERROR), level(DiagnosticStatus.WARN)


@pytest.fixture
def node(monkeypatch):
    ctx = rclpy.Context()
    rclpy.init(context=ctx)
    node = VisionNode(context=ctx, parameter_overrides=[Parameter("autostart", value=False),
                                                        Parameter("use_depth", value=True)])

    def load() -> SharedModel:
        engine = SharedModel(SimpleNamespace(model_id="fake-vision"))
        engine.holders = 1   # as shared_engine hands it out: cleanup gives the hold back
        return engine

    monkeypatch.setattr(node, "load_engine", load)
    node.sent = []
    node.pub_diagnostics.publish = node.sent.append
    try:
        yield node
    finally:
        node.destroy_node()
        rclpy.shutdown(context=ctx)


def status(node) -> DiagnosticStatus:
    node.publish_diagnostics()
    return node.sent[-1].status[0]


def info(sequence: int) -> dict:
    return {"publication_sequence_number": sequence, "publisher_gid": {"data": bytes(16)}}


def test_failures_of_one_configuration_are_not_reported_after_the_next(node):
    assert node.trigger_configure() == SUCCESS and node.trigger_activate() == SUCCESS
    node.frames.put(object())               # frames came in the first configuration
    node.last_input_at = time.monotonic()
    for _ in range(FAILING_IN_A_ROW):   # as process() says of a frame it cannot convert
        node.health.failed("unknown encoding 'yuv420p'")
    node.without_depth_in_a_row = FAILING_IN_A_ROW
    node.depth_health.arrived(info(5))
    st = status(node)
    assert level(st) == ERROR and "frames all failed" in st.message
    assert node.trigger_deactivate() == SUCCESS and node.trigger_activate() == SUCCESS
    assert level(status(node)) == ERROR      # the same model and subscription: still failing

    assert node.trigger_deactivate() == SUCCESS and node.trigger_cleanup() == SUCCESS
    assert node.trigger_configure() == SUCCESS and node.trigger_activate() == SUCCESS
    st = status(node)
    assert (level(st), st.message) == (WARN, "no images received"), st.message
    assert node.without_depth_in_a_row == 0   # else a configure without depth warned of none forever
    # the depth publisher went on while no subscription existed: not a loss seen by the new one
    assert node.depth_health.arrived(info(40)) == 0


def test_unreadable_frames_say_error_with_no_task_on_every_frame(node, monkeypatch):
    """With no standing task (the shipped config: the loop's find goals only) frames were never
    read: a camera whose every frame is unreadable showed "running" with bad_frames 0 while each
    request failed. One frame a second is read now (every one here)."""
    import numpy as np
    from std_msgs.msg import Header

    import photon_ros.vision_node as vision_node
    from photon_ros.image_conversions import rgb_to_image

    monkeypatch.setattr(vision_node, "IDLE_CHECK_S", 0.0)
    assert node.trigger_configure() == SUCCESS and node.trigger_activate() == SUCCESS
    assert not (node.detect_targets or node.point_targets or node.segment_targets or node.caption_period)
    good = rgb_to_image(np.zeros((8, 8, 3), np.uint8), header=Header(frame_id="camera"))
    bad = rgb_to_image(np.zeros((8, 8, 3), np.uint8), header=Header(frame_id="camera"))
    bad.encoding = "yuv420p"
    for _ in range(FAILING_IN_A_ROW):
        node.process(SimpleNamespace(msg=bad), epoch=1)
    st = status(node)
    assert level(st) == ERROR and "yuv420p" in st.message and node.bad_frames == FAILING_IN_A_ROW, st.message
    node.process(SimpleNamespace(msg=good), epoch=1)
    assert level(status(node)) != ERROR
    monkeypatch.setattr(vision_node, "IDLE_CHECK_S", 3600.0)   # not every frame: at most one an interval
    node.process(SimpleNamespace(msg=bad), epoch=1)
    assert node.bad_frames == FAILING_IN_A_ROW


def test_rates_count_from_the_activation_not_from_the_nodes_start(node):
    """input_rate_hz was frames over the time since the node was built, where frames come only once
    it is active: after a model load of a minute a 10 Hz camera read 1 Hz for 10 s."""
    assert node.trigger_configure() == SUCCESS
    node.stats._started -= 60.0               # built a minute ago: the load took that long
    assert node.trigger_activate() == SUCCESS
    for _ in range(10):                       # the first second's frames
        node.stats.tick("received")
    values = {v.key: v.value for v in status(node).values}
    assert float(values["input_rate_hz"]) >= 9.0, values["input_rate_hz"]
