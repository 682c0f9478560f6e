"""frames.Tf2Lookup over tf2_ros's interface (a test double of tf2_ros: it cannot be installed
here; its exception tree as tf2_py defines it): every tf2 error becomes the LookupError the node
turns into results without 3D, and close() takes the listener's /tf subscriptions away."""
from types import SimpleNamespace

import numpy as np
import pytest

from photon_ros.frames import frame_refusal, tf2_lookup


class TransformException(Exception):
    pass


class LookupException(TransformException):
    pass


class InvalidArgumentException(TransformException):   # tf2: an empty or "/"-prefixed frame id
    pass


def fake_tf2(monkeypatch, fail=None, rotation=(0.0, 0.0, 0.0, 1.0)):
    log = []

    class Buffer:
        def lookup_transform(self, target, source, time, timeout):
            log.append(("lookup", target, source, time.nanoseconds))
            if fail is not None:
                raise fail
            v = SimpleNamespace
            x, y, z, w = rotation
            return v(transform=v(translation=v(x=1.0, y=2.0, z=3.0), rotation=v(x=x, y=y, z=z, w=w)))

    class TransformListener:
        def __init__(self, buffer, node):
            log.append(("listen", node))

        def unregister(self):
            log.append(("unregister",))

    module = SimpleNamespace(Buffer=Buffer, TransformListener=TransformListener, TransformException=TransformException,
                             LookupException=LookupException, InvalidArgumentException=InvalidArgumentException)
    monkeypatch.setitem(__import__("sys").modules, "tf2_ros", module)
    return log


def test_a_transform_comes_back_and_close_unregisters_the_listener(monkeypatch):
    log = fake_tf2(monkeypatch)
    lookup = tf2_lookup("node")
    t = lookup("base_link", "camera_color_optical_frame", 1_700_000_001_123_456_789)
    assert np.array_equal(t.translation, [1.0, 2.0, 3.0]) and np.array_equal(t.rotation, [0, 0, 0, 1])
    assert log[1] == ("lookup", "base_link", "camera_color_optical_frame", 1_700_000_001_123_456_789)   # exact
    lookup.close()
    assert log[-1] == ("unregister",)


def test_a_rotation_tf2_keeps_unnormalised_is_normalised(monkeypatch):
    """tf2 accepts |q|^2 within 0.01 of 1 and returns it as published (a static transform typed as
    0 0 0.71 0.71): rotated by it, a point at (1, 0, 3) m came out at (-0.008, 1.008, 3) and its
    orientation was no unit quaternion. A rotation of no length is no transform."""
    from photon_ros.frames import apply
    fake_tf2(monkeypatch, rotation=(0.0, 0.0, 0.71, 0.71))
    t = tf2_lookup("node")("base_link", "camera_color_optical_frame", 5_000_000_000)
    position, orientation = apply(t, np.array([1.0, 0.0, 3.0]), np.array([0.0, 0.0, 0.0, 1.0]))
    np.testing.assert_allclose(position, [1.0, 3.0, 6.0], atol=1e-9)    # (0, 1, 3) + the translation
    assert abs(np.linalg.norm(orientation) - 1.0) < 1e-12
    fake_tf2(monkeypatch, rotation=(0.0, 0.0, 0.0, 0.0))
    with pytest.raises(LookupError, match="has no rotation"):
        tf2_lookup("node")("base_link", "camera_color_optical_frame", 5_000_000_000)


@pytest.mark.parametrize("error", [LookupException("no base_link"),
                                   InvalidArgumentException("frame_ids cannot be empty")])
def test_every_tf2_error_is_a_lookup_error(monkeypatch, error):
    fake_tf2(monkeypatch, fail=error)
    with pytest.raises(LookupError, match=type(error).__name__):
        tf2_lookup("node")("base_link", "", 5_000_000_000)


def test_a_stamp_before_1970_is_a_lookup_error_not_a_lost_frame(monkeypatch):
    """rclpy's Time refuses negative nanoseconds with a ValueError, which the node does not take
    for a failed lookup: the frame lost its results, not only its 3D."""
    log = fake_tf2(monkeypatch)
    with pytest.raises(LookupError, match="before 1970"):
        tf2_lookup("node")("base_link", "camera", -500_000_000)
    assert [e for e in log if e[0] == "lookup"] == []


def test_frame_ids_tf2_would_refuse():
    assert frame_refusal("base_link") == "" and frame_refusal("") == ""
    assert "must not start with '/'" in frame_refusal("/base_link")
    assert "spaces" in frame_refusal("map ")


@pytest.mark.parametrize("frame, doubted", [("camera_color_optical_frame", False), ("oak_rgb_camera_optical_frame", False),
                                            ("zed_left_camera_frame_optical", False), ("", False),
                                            ("camera_link", True), ("robot/base_link/rgbd_camera", True)])
def test_a_frame_not_named_optical_is_doubted(frame, doubted):
    """Results carry optical axes in the camera's frame: a body frame's name (a simulator's
    camera sensor) is warned of once by the vision node, an optical frame's is not."""
    from photon_ros.frames import optical_frame_doubt
    note = optical_frame_doubt(frame)
    assert bool(note) == doubted
    if doubted:
        assert repr(frame) in note and "x right, y down, z forward" in note
