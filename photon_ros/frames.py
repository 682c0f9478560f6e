"""Moving 3D results from the camera's optical frame into another frame (`target_frame`) with tf2.

tf2_ros comes with ROS from apt (robots); it is not on PyPI. `tf2_lookup` gives a lookup function
over a tf2 buffer fed by the node's /tf subscription, or raises ValueError saying so where tf2_ros
is missing: a node asked for a target_frame it cannot serve refuses to configure rather than
publish in the wrong frame. The math (a rigid transform applied to poses) is plain numpy here.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import numpy as np


class Transform(NamedTuple):
    """Where the source frame is in the target frame: translation (m) and rotation (x, y, z, w)."""
    translation: np.ndarray
    rotation: np.ndarray


# (target frame, source frame, stamp in seconds) -> Transform; LookupError with the reason.
Lookup = Callable[[str, str, float], Transform]


def tf2_lookup(node, timeout_s: float = 0.05) -> "Tf2Lookup":
    """A lookup over tf2 (a buffer and a listener on `node`); close() when done with it."""
    try:
        import tf2_ros
    except ImportError:
        raise ValueError("target_frame needs tf2_ros, which is not installed here (on a robot it comes "
                         "with ROS: apt install ros-$ROS_DISTRO-tf2-ros); leave target_frame empty for "
                         "positions in the camera's optical frame") from None
    return Tf2Lookup(tf2_ros, node, timeout_s)


class Tf2Lookup:
    """(target, source, stamp) -> Transform over a tf2 buffer its listener feeds from /tf."""

    def __init__(self, tf2_ros, node, timeout_s: float) -> None:
        from rclpy.duration import Duration
        from rclpy.time import Time

        self._time, self._timeout = Time, Duration(seconds=timeout_s)
        self._buffer = tf2_ros.Buffer()
        self._listener = tf2_ros.TransformListener(self._buffer, node)
        # Every tf2 error, TransformException's subclasses included: an invalid frame id (empty, or
        # "/base_link" as ROS 1 wrote it) raises InvalidArgumentException, which is none of the
        # three a lookup usually meets, and must cost a frame its 3D, never its results.
        self._failures = tuple(getattr(tf2_ros, name) for name in (
            "TransformException", "LookupException", "ConnectivityException", "ExtrapolationException",
            "InvalidArgumentException", "TimeoutException") if hasattr(tf2_ros, name))

    def __call__(self, target: str, source: str, stamp_ns: int) -> Transform:
        """The transform at the image's stamp, in integer nanoseconds: through float seconds it was
        off by up to ~100 ns at today's epoch, and a driver that stamps its tf with the image's own
        stamp is then asked for a time just past it (an extrapolation error)."""
        at = f"{stamp_ns / 1e9:.3f} s"
        if stamp_ns < 0:   # rclpy's Time refuses it with a ValueError, which would cost the frame its results
            raise LookupError(f"no transform {source or '(no frame)'} -> {target} at {at}: a stamp before 1970")
        try:
            t = self._buffer.lookup_transform(target, source, self._time(nanoseconds=int(stamp_ns)),
                                              self._timeout).transform
        except self._failures as err:
            raise LookupError(f"no transform {source or '(no frame)'} -> {target} at {at}: "
                              f"{type(err).__name__}: {err}") from None
        # tf2 keeps a rotation as it was published, |q|^2 within 0.01 of 1 (a static transform typed
        # as 0 0 0.71 0.71): rotated by it, a point 3 m away moved up to 5 cm, and its orientation
        # was no unit quaternion. tf2's own doTransform divides by |q|^2: normalised here.
        rotation = np.array([t.rotation.x, t.rotation.y, t.rotation.z, t.rotation.w], dtype=float)
        norm = float(np.linalg.norm(rotation))
        if not np.isfinite(norm) or norm < 1e-6:
            raise LookupError(f"the transform {source or '(no frame)'} -> {target} at {at} has no rotation "
                              f"(quaternion {rotation.tolist()})")
        return Transform(np.array([t.translation.x, t.translation.y, t.translation.z]), rotation / norm)

    def close(self) -> None:
        """Take the listener's /tf subscriptions off the node (tf2's listener keeps them until it
        is garbage, which a subscription's callback holding it never lets happen)."""
        unregister = getattr(self._listener, "unregister", None)
        if unregister is not None:
            unregister()


def frame_refusal(frame: str) -> str:
    """Why `frame` cannot name a tf2 frame ("" if it can): tf2 refuses a leading "/"."""
    if frame.startswith("/"):
        return f"must not start with '/' (tf2 frame ids have none: {frame.lstrip('/')!r}), got {frame!r}"
    if frame != frame.strip():
        return f"must not start or end with spaces, got {frame!r}"
    return ""


def optical_frame_doubt(frame: str) -> str:
    """A warning when `frame`, which 3D results are placed in with optical axes (x right, y down,
    z forward), is not named as an optical frame ("" when it is). REP-103 names them *_optical_frame;
    a camera that stamps its body frame (x forward, z up: many simulators' camera sensors) would
    have tf2 turn "2 m ahead" into "2 m up"."""
    if not frame or "optical" in frame:
        return ""
    return (f"3D results are in frame {frame!r} with optical axes (x right, y down, z forward), but its name "
            "does not say optical (REP-103: *_optical_frame); if it is the camera's body frame (x forward, "
            "z up), positions and their transforms are wrong: publish the images in the optical frame")


def quaternion_multiply(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a * b (Hamilton product): rotating by b, then by a; quaternions as (x, y, z, w)."""
    ax, ay, az, aw = a
    bx, by, bz, bw = b
    return np.array([aw * bx + ax * bw + ay * bz - az * by,
                     aw * by - ax * bz + ay * bw + az * bx,
                     aw * bz + ax * by - ay * bx + az * bw,
                     aw * bw - ax * bx - ay * by - az * bz])


def rotate(q: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Vector v rotated by the unit quaternion q = (x, y, z, w)."""
    u, w = np.asarray(q[:3], dtype=float), float(q[3])
    v = np.asarray(v, dtype=float)
    return v + 2.0 * np.cross(u, np.cross(u, v) + w * v)


def apply(transform: Transform, position: np.ndarray, orientation: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A pose (position, orientation x y z w) of the source frame expressed in the target frame."""
    return (rotate(transform.rotation, position) + transform.translation,
            quaternion_multiply(transform.rotation, orientation))
