"""3D positions in metres from an aligned depth image and camera_info, without ROS.

A detection's box or a point, in colour-image pixels, becomes a position (and a box's extent) in
the colour camera's optical frame (REP 103: x right, y down, z forward), in metres. Nothing here
imports ROS: functions take the message's fields, or any object that has them, and return plain
dataclasses, so the node stays thin and everything is tested without a graph.

Pieces, in the order a frame goes through them:

- `intrinsics_from_camera_info(msg)` (or `intrinsics(...)` from the fields): the camera model.
  For the raw colour image (`image_raw`), K and D: a pixel is undistorted with OpenCV
  (`undistortPoints`, iterated to convergence) before it is deprojected. Distortion models:
  `plumb_bob` (k1 k2 t1 t2 [k3]), `rational_polynomial` (8, 12 or 14 of OpenCV's coefficients:
  depthai's OAK cameras send 8) and none (empty model or `none`, coefficients empty or zero); a
  model whose coefficients are all zero is no distortion whatever its name; any other model with
  non-zero coefficients is refused. `rectified=True` is for a rectified colour image
  (`image_rect_color`): P's intrinsics, no distortion (P's translation column is ignored: points
  stay in this camera's own frame, as depth_image_proc does). R is not used: it rotates into a
  stereo pair's rectified frame, and results are in the frame the colour image names. Binning and
  ROI other than the full image are refused rather than half-applied. A pixel without a ray
  through the lens has none: its undistorted ray does not project back onto it (a calibration
  whose polynomial turns over before the image's edge, where OpenCV's iteration diverges or
  returns the distorted coordinates), or does, but from past the fold or a rational model's pole
  (another ray nearer the centre lands there first). A result that needs it has no position, with
  the reason, rather than a wrong one.
- `depth_image(...)` / `depth_image_from_msg(msg)`: a view of the depth message's values (16UC1
  millimetres or 32FC1 metres, with `step` and `is_bigendian` honoured; no copy when rows are
  unpadded). Only the pixels a result reads are touched (validity is tested in the stored unit),
  so a frame costs what its boxes cover, not the whole image; `depth_to_metres(...)` converts a
  whole image to metres when that is what is wanted. Zero, negative, NaN, inf and values outside [min_depth_m, max_depth_m] are
  invalid (NaN in `depth_to_metres`'s output).
- `DepthPairing`: the last few depth frames by stamp; the one nearest a colour frame's stamp
  within a tolerance, or the reason there is none, with what is there now. The vision node pairs
  with `photon_ros.stamp_pairing` instead: a colour frame waits there for a depth image that
  comes after it (depth-aligning drivers publish the aligned depth after the colour image), and
  the paired depth travels with the frame however long the model takes.
- `DepthView`: one colour frame's depth, camera model and image size, checked against each other;
  `boxes_3d` / `points_3d` give a `Box3D` / `Point3D` per input or a `NoDepth` with the reason.
  `frame_depth(...)` does pairing, decoding and checks in one call and never raises: it returns a
  `DepthView` or a `NoDepth` for the whole frame; `depth_view(...)` does the same for a frame
  already paired.

In a node (photon_ros/vision_node.py; stamp_pairing's module doc gives the pairing's rules):

    depth, info = StampPairing("depth image", tol), StampPairing("camera_info", tol, fallback_newest=True)
    on depth / camera_info:  depth.add(stamp_ns(msg.header.stamp), msg)   # info.add(...) alike
    on a colour frame:       waits = depth.wait_for(stamp, now), info.wait_for(stamp, now)
    after its inference:     d, c = waits[0].result(), waits[1].result()   # waits until decided
                             view = depth_view(d.msg or NoDepth(d.reason), c.msg or NoDepth(c.reason), ...)
    results:         view.boxes_3d([(x_min_px, y_min_px, x_max_px, y_max_px), ...]),
                     view.points_3d([(x_px, y_px), ...]); or view.reason for the whole frame

Conventions (decided here, documented for the node's users):

- Box and point coordinates are continuous pixel coordinates of the colour image: (0, 0) is the
  top-left corner of the top-left pixel, (width, height) the bottom-right corner of the last,
  which is what `x * width` gives for the model's normalized results. OpenCV and camera_info put
  pixel centres at integers, so 0.5 is subtracted before the camera model is applied.
- Three pixel grids may differ in size: the colour image the boxes refer to, camera_info's
  width x height (what K describes) and the depth image. Aligned depth is registered to the colour
  camera, so it normally has the colour image's size; a grid of another size with the same aspect
  ratio (a resized stream, e.g. 640x360 depth for 1280x720 colour) is used by scaling
  coordinates, as resizing scales them. A grid whose aspect ratio differs by more than a pixel
  (640x480 depth for 1280x720 colour) is not the same view of the scene and is refused.
- A box's depth is the median of the valid depths in its inner part: the central
  `inner_fraction` (default 50%) of its width and of its height, a quarter of its area. A box
  drawn around an object has background in its margins and corners; its middle is the object for
  convex, roughly centred objects (a ring or a chair seen through may still be missed: the median
  then is the background's). At least `min_valid_fraction` (20%) of the sampled pixels, and
  `min_valid_pixels` (5) or all of them where fewer, must be valid, else there is no depth: never 0 m.
  Large boxes are sampled on a regular grid of at most `max_samples` (1024) pixels, which keeps the
  cost per box bounded; the median of 1024 samples is well inside the sensor's noise. Medians and
  quartiles are nearest-rank (a value that was measured, never an average of two).
- A box's position and its size_x and size_y are the centre and size of the rectangle inside its
  undistorted outline, at that depth (without distortion: the centre pixel deprojected, and the
  box's size): each side is placed at the innermost of its two corners and its midpoint,
  undistorted. A box drawn in a distorted image hugs the object's bowed outline, touching it at a
  corner or a midpoint of each side; the inscribed rectangle is the object's extent. Its
  size_z is the interquartile range of the valid depths in its inner part: the relief of the
  surface the camera sees (a flat face gives about the sensor's noise). One view cannot see how
  deep an object is behind its front; the box centred at the median spans the middle half of the
  visible depths. Boxes are clipped to the image first: the position is that of the visible part.
- A point's depth is the median of the valid depths in a `point_window` x `point_window` (5 x 5)
  window of depth pixels around it (moved inside the image at its borders), with the same
  validity rule.
- Depth images hold z (distance along the optical axis), not range along the ray: a pixel's
  normalized ray (x', y', 1) times the depth z is the point.
"""
from __future__ import annotations

import functools
import math
import threading
from collections import deque
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, Sequence, TypeVar

import cv2
import numpy as np

# Per encoding: the numpy type of one value (little-endian; byte order per message), and metres
# per unit. 0 means "no reading" in 16UC1, and so does its largest value (65.535 m, beyond any
# depth camera's range: drivers that mark saturated or out-of-range pixels write it); NaN / inf
# mean it in 32FC1.
DEPTH_ENCODINGS: dict[str, tuple[str, float]] = {"16UC1": ("<u2", 0.001), "32FC1": ("<f4", 1.0)}
DEFAULT_MAX_PIXELS = 64_000_000
# Coefficient counts OpenCV's model takes for each CameraInfo model (a plumb_bob with 4 omits k3;
# depthai's rational_polynomial sends the first 8 of OpenCV's 14): undistortPoints reads them all.
DISTORTION_COEFFICIENTS = {"plumb_bob": (4, 5), "rational_polynomial": (8, 12, 14)}
DISTORTION_MODELS = (*DISTORTION_COEFFICIENTS, "none")
# undistortPoints' default (5 iterations) leaves tenths of a pixel near the corners of a
# wide-angle lens; this converges to far below that.
_UNDISTORT_CRITERIA = (cv2.TERM_CRITERIA_COUNT | cv2.TERM_CRITERIA_EPS, 40, 1e-10)
# An undistorted ray must project back onto its pixel within this (pixels of camera_info's grid).
# Where the calibration's polynomial turns over before the image's edge (a wide-angle lens fitted
# without samples in its corners) no ray distorts onto the pixel: OpenCV's iteration then diverges
# or gives up, returning the distorted coordinates, and either is a wrong ray, silently.
_REPROJECTION_TOLERANCE_PX = 0.1
# Points from the centre to a ray whose images must move outward (_inverts).
_ALONG_RAY = 16

T = TypeVar("T")


class DepthError(ValueError):
    """Input that gives no depth (malformed depth image, invalid camera_info, mismatched sizes);
    the message says why."""


@dataclass(frozen=True)
class NoDepth:
    """No 3D result, and why."""
    reason: str
    ok: ClassVar[bool] = False


@dataclass(frozen=True)
class Box3D:
    """A box's centre and extent in the camera's optical frame, metres (rules in the module doc)."""
    x: float
    y: float
    z: float
    size_x: float
    size_y: float
    size_z: float
    valid_pixels: int        # valid depths the median was taken over
    valid_fraction: float    # of the sampled pixels in the box's inner part
    ok: ClassVar[bool] = True


@dataclass(frozen=True)
class Point3D:
    """A point in the camera's optical frame, metres."""
    x: float
    y: float
    z: float
    valid_pixels: int
    valid_fraction: float
    ok: ClassVar[bool] = True


# --- camera model ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Intrinsics:
    """A pinhole camera with optional distortion (plumb_bob, rational_polynomial), for a width x
    height pixel grid."""
    width: int
    height: int
    fx: float
    fy: float
    cx: float
    cy: float
    distortion: tuple[float, ...] = ()     # OpenCV's coefficients (k1, k2, p1, p2[, k3...]); () for none

    def normalized(self, uv: np.ndarray) -> np.ndarray:
        """(N, 2) pixel coordinates of this grid (pixel centres at integers) -> (N, 2) normalized
        image coordinates (x', y'): the ray through the pixel is (x', y', 1). NaN for a pixel the
        distortion model cannot be inverted at (its ray does not project back onto it)."""
        uv = np.asarray(uv, dtype=np.float64).reshape(-1, 2)
        if not self.distortion:
            return (uv - (self.cx, self.cy)) / (self.fx, self.fy)
        camera = np.array([[self.fx, 0.0, self.cx], [0.0, self.fy, self.cy], [0.0, 0.0, 1.0]])
        dist = np.array(self.distortion, dtype=np.float64)
        src = uv.reshape(-1, 1, 2)
        # OpenCV 4.6 (Ubuntu's apt) names the iterated form undistortPointsIter; 5.x folds it
        # into undistortPoints' criteria argument.
        if hasattr(cv2, "undistortPointsIter"):
            out = cv2.undistortPointsIter(src, camera, dist, None, None, _UNDISTORT_CRITERIA)
        else:
            out = cv2.undistortPoints(src, camera, dist, criteria=_UNDISTORT_CRITERIA)
        rays = out.reshape(-1, 2).astype(np.float64)
        # NaN in, a miss, or another branch's: no ray
        rays[~_inverts(rays, uv, camera, dist, _pole_radius(self.distortion))] = np.nan
        return rays


def _projected(rays: np.ndarray, camera: np.ndarray, dist: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Pixels of the rays (x', y', 1) and the 2x2 Jacobians d(pixel) / d(x', y')."""
    points = np.column_stack([rays, np.ones(len(rays))])
    pixels, jacobian = cv2.projectPoints(points, np.zeros(3), np.zeros(3), camera, dist)
    # with no rotation, a ray's derivative is the translation's: columns 3-4 (tx, ty)
    return pixels.reshape(-1, 2), jacobian[:, 3:5].reshape(-1, 2, 2)


def _inverts(rays: np.ndarray, uv: np.ndarray, camera: np.ndarray, dist: np.ndarray, pole: float) -> np.ndarray:
    """Which rays are their pixels': projected back within the tolerance, inside the rational
    model's pole (where its denominator, 1 + k4 r^2 + k5 r^4 + k6 r^6, first reaches 0), and with
    an image that moves outward all the way from the centre to the ray (_ALONG_RAY points on it,
    measured along the ray's direction, may fall back by no more than the tolerance). Past the fold
    of a polynomial that turns over, or past a pole, other rays project onto the pixels that rays
    nearer the centre reach (or, where the model changes sign, onto the opposite side): none of
    them came through the lens to the pixel."""
    with np.errstate(invalid="ignore", over="ignore"):
        pixels, _ = _projected(rays, camera, dist)
        miss = np.hypot(*(pixels - uv).T)
        steps = np.linspace(1.0 / _ALONG_RAY, 1.0, _ALONG_RAY)
        along, _ = _projected((rays[:, None, :] * steps[None, :, None]).reshape(-1, 2), camera, dist)
        offsets = along.reshape(len(rays), _ALONG_RAY, 2) - camera[:2, 2]
        direction = rays / np.maximum(np.hypot(*rays.T), 1e-12)[:, None]
        reach = np.einsum("nsk,nk->ns", offsets, direction)   # signed: the opposite side is negative
        outward = (np.diff(reach, axis=1) >= -_REPROJECTION_TOLERANCE_PX).all(axis=1) & (reach[:, 0] >= 0)
        inside = np.hypot(*rays.T) < pole
        return (miss <= _REPROJECTION_TOLERANCE_PX) & outward & inside


@functools.lru_cache(maxsize=16)   # once per calibration, not per frame
def _pole_radius(distortion: tuple[float, ...]) -> float:
    """The smallest ray radius where the rational model's denominator 1 + k4 r^2 + k5 r^4 + k6 r^6
    is 0 (inf for the other models, and where it never is)."""
    k = distortion
    if len(k) < 8 or not any(k[5:8]):
        return math.inf
    roots = np.roots([k[7], k[6], k[5], 1.0])   # in r^2
    real = roots[(np.abs(roots.imag) < 1e-12) & (roots.real > 0)].real
    return float(np.sqrt(real.min())) if real.size else math.inf


def _floats(values: Any, what: str, count: int | None = None) -> np.ndarray:
    try:
        array = np.asarray(values if values is not None else (), dtype=np.float64).ravel()
    except (TypeError, ValueError):
        raise DepthError(f"invalid camera_info: {what} is not a list of numbers") from None
    if count is not None and array.size != count:
        raise DepthError(f"invalid camera_info: {what} has {array.size} values, not {count}")
    if not np.isfinite(array).all():
        raise DepthError(f"invalid camera_info: {what} has non-finite values ({_show(array)})")
    return array


def _show(values: np.ndarray) -> str:
    return " ".join(f"{v:g}" for v in values)


def _pinhole(m: np.ndarray, what: str, width: int, height: int) -> tuple[float, float, float, float]:
    """fx, fy, cx, cy of a 3x3 camera matrix (K, or P's left 3x3), checked."""
    if not np.any(m):
        raise DepthError(f"invalid camera_info: {what} is all zeros (the camera is not calibrated)")
    fx, skew, cx, _, fy, cy = m[:6]
    if fx <= 0 or fy <= 0:
        raise DepthError(f"invalid camera_info: focal lengths fx = {fx:g}, fy = {fy:g} in {what} "
                         "must be positive")
    if m[3] != 0 or abs(skew) > 1e-9 * fx or m[6] != 0 or m[7] != 0 or abs(m[8] - 1) > 1e-9:
        raise DepthError(f"invalid camera_info: {what} = [{_show(m)}] is not [fx 0 cx; 0 fy cy; "
                         "0 0 1] (skew or a scaled last row is not supported)")
    if not (0 <= cx <= width and 0 <= cy <= height):
        raise DepthError(f"invalid camera_info: principal point ({cx:g}, {cy:g}) lies outside the "
                         f"{width}x{height} image (camera_info of another resolution?)")
    return float(fx), float(fy), float(cx), float(cy)


def _distortion(model: str, d: np.ndarray) -> tuple[float, ...]:
    if not np.any(d):
        return ()     # all zero (or none given): no distortion, whatever the model's name
    if model in DISTORTION_COEFFICIENTS:
        counts = DISTORTION_COEFFICIENTS[model]
        if d.size not in counts:
            raise DepthError(f"invalid camera_info: {model} takes {' or '.join(map(str, counts))} coefficients "
                             f"(OpenCV's k1 k2 p1 p2 [k3 [k4 k5 k6 [s1 s2 s3 s4 [tx ty]]]]), d has {d.size}")
        return tuple(float(v) for v in d)
    if model in ("", "none"):
        raise DepthError(f"invalid camera_info: distortion_model is {model!r} but d = [{_show(d)}] "
                         "is not zero")
    raise DepthError(f"unsupported distortion model {model!r} (d = [{_show(d)}]); supported: "
                     f"{', '.join(DISTORTION_MODELS)} (or a rectified image with rectified=True)")


def intrinsics(width: int, height: int, distortion_model: str, d: Sequence[float],
               k: Sequence[float], p: Sequence[float] | None = None, *, rectified: bool = False,
               binning_x: int = 0, binning_y: int = 0, roi: Any = None) -> Intrinsics:
    """The camera model from sensor_msgs/CameraInfo's fields (the module doc says which are used).
    Raises DepthError with the reason for anything it cannot use."""
    width, height = int(width), int(height)
    if width <= 0 or height <= 0:
        raise DepthError(f"invalid camera_info: image size {width}x{height}")
    if max(int(binning_x), 1) != 1 or max(int(binning_y), 1) != 1:
        raise DepthError(f"camera_info binning {binning_x}x{binning_y} is not supported")
    if roi is not None and int(roi.width) and (
            (int(roi.x_offset), int(roi.y_offset), int(roi.width), int(roi.height))
            != (0, 0, width, height)):
        raise DepthError(f"camera_info ROI {roi.width}x{roi.height} at ({roi.x_offset}, "
                         f"{roi.y_offset}) is not the full {width}x{height} image: not supported")
    if rectified:
        proj = _floats(p, "P", 12)
        fx, fy, cx, cy = _pinhole(proj[[0, 1, 2, 4, 5, 6, 8, 9, 10]], "P", width, height)
        return Intrinsics(width, height, fx, fy, cx, cy)
    fx, fy, cx, cy = _pinhole(_floats(k, "K", 9), "K", width, height)
    return Intrinsics(width, height, fx, fy, cx, cy,
                      _distortion(str(distortion_model).strip().lower(), _floats(d, "d")))


def intrinsics_from_camera_info(msg: Any, *, rectified: bool = False) -> Intrinsics:
    """`intrinsics(...)` from a sensor_msgs/CameraInfo (any object with its fields)."""
    return intrinsics(msg.width, msg.height, msg.distortion_model, msg.d, msg.k, msg.p,
                      rectified=rectified, binning_x=getattr(msg, "binning_x", 0),
                      binning_y=getattr(msg, "binning_y", 0), roi=getattr(msg, "roi", None))


# --- depth images ---------------------------------------------------------------------------

@dataclass(frozen=True, eq=False)
class DepthImage:
    """A depth image's values as the message holds them (uint16 millimetres or float32 metres,
    in the message's byte order), height x width."""
    values: np.ndarray
    metres_per_unit: float

    @property
    def width(self) -> int:
        return self.values.shape[1]

    @property
    def height(self) -> int:
        return self.values.shape[0]

    def to_metres(self, min_depth_m: float, max_depth_m: float) -> np.ndarray:
        """The whole image as float32 metres, NaN where invalid."""
        return _metres(self.values, self.metres_per_unit, min_depth_m, max_depth_m)


def _metres(values: np.ndarray, scale: float, lo: float, hi: float) -> np.ndarray:
    metres = values.astype(np.float32)   # native byte order, a new array
    if scale != 1.0:
        metres *= np.float32(scale)
    # NaN fails both comparisons; inf and -inf and zero fail one (lo > 0).
    metres[~((metres >= lo) & (metres <= hi))] = np.nan
    if values.dtype.kind == "u":
        metres[values == np.iinfo(values.dtype).max] = np.nan   # "no reading", as 0
    return metres


def depth_image(data: Any, encoding: str, width: int, height: int, step: int,
                is_bigendian: bool | int, max_pixels: int = DEFAULT_MAX_PIXELS) -> DepthImage:
    """A DepthImage from sensor_msgs/Image's fields; DepthError when they do not describe one."""
    if encoding not in DEPTH_ENCODINGS:
        raise DepthError(f"depth image encoding {encoding!r} is not a depth encoding; supported: "
                         f"{', '.join(DEPTH_ENCODINGS)}")
    width, height, step = int(width), int(height), int(step)
    if width <= 0 or height <= 0 or width * height > max_pixels:
        raise DepthError(f"malformed depth image: size {width}x{height} (limit {max_pixels} pixels)")
    type_name, scale = DEPTH_ENCODINGS[encoding]
    dtype = np.dtype(type_name.replace("<", ">") if is_bigendian else type_name)
    row_bytes = width * dtype.itemsize
    if step < row_bytes:
        raise DepthError(f"malformed depth image: step {step} is shorter than a row of {width} "
                         f"{encoding} values ({row_bytes} bytes)")
    try:
        buf = np.frombuffer(data, dtype=np.uint8)
    except TypeError:      # a plain list of ints (hand-built messages)
        buf = np.asarray(data, dtype=np.uint8).ravel()
    if buf.size != step * height:
        raise DepthError(f"malformed depth image: data has {buf.size} bytes, not step x height = "
                         f"{step} x {height} = {step * height}")
    if step == row_bytes:
        values = buf.view(dtype).reshape(height, width)
    else:
        # Padded rows (rare for depth) are copied together rather than read through strides.
        values = np.ascontiguousarray(buf.reshape(height, step)[:, :row_bytes]).view(dtype)
    return DepthImage(values.reshape(height, width), scale)


def depth_image_from_msg(msg: Any, max_pixels: int = DEFAULT_MAX_PIXELS) -> DepthImage:
    """`depth_image(...)` from a sensor_msgs/Image (any object with its fields)."""
    return depth_image(msg.data, msg.encoding, msg.width, msg.height, msg.step, msg.is_bigendian,
                       max_pixels)


def depth_to_metres(data: Any, encoding: str, width: int, height: int, step: int,
                    is_bigendian: bool | int, min_depth_m: float, max_depth_m: float) -> np.ndarray:
    """A whole depth image as height x width float32 metres, NaN where there is no valid depth."""
    _check_range(min_depth_m, max_depth_m)
    return depth_image(data, encoding, width, height, step, is_bigendian).to_metres(
        min_depth_m, max_depth_m)


def _check_range(lo: float, hi: float) -> None:
    if not (math.isfinite(lo) and math.isfinite(hi) and 0 < lo < hi):
        raise DepthError(f"depth range [{lo}, {hi}] m must satisfy 0 < min_depth_m < max_depth_m")


# --- pairing by stamp -----------------------------------------------------------------------

@dataclass(frozen=True)
class Paired(Generic[T]):
    frame: T
    stamp: float
    offset_s: float      # depth stamp - colour stamp


class DepthPairing(Generic[T]):
    """The last `keep` depth frames (anything: messages or DepthImages) by stamp, in seconds.
    Thread-safe: a subscription adds while the inference worker pairs."""

    def __init__(self, tolerance_s: float, keep: int = 10) -> None:
        if not (math.isfinite(tolerance_s) and tolerance_s >= 0):
            raise ValueError(f"pairing tolerance {tolerance_s} s must be finite and >= 0")
        if keep < 1:
            raise ValueError(f"keep {keep} must be at least 1")
        self.tolerance_s = float(tolerance_s)
        self._frames: deque[tuple[float, T]] = deque(maxlen=keep)
        self._lock = threading.Lock()

    def add(self, stamp: float, frame: T) -> None:
        with self._lock:
            self._frames.append((float(stamp), frame))

    def __len__(self) -> int:
        with self._lock:
            return len(self._frames)

    def nearest(self, stamp: float) -> Paired[T] | NoDepth:
        """The kept frame nearest `stamp` within the tolerance, or why there is none."""
        with self._lock:
            frames = list(self._frames)
        if not frames:
            return NoDepth("no depth image received yet")
        depth_stamp, frame = min(frames, key=lambda item: abs(item[0] - stamp))
        offset = depth_stamp - stamp
        if not abs(offset) <= self.tolerance_s:
            side = "after" if offset > 0 else "before"
            return NoDepth(f"stale depth: the nearest depth image is {abs(offset):.3f} s {side} the "
                           f"colour image (tolerance {self.tolerance_s:g} s)")
        return Paired(frame, depth_stamp, offset)


# --- 3D from a frame's depth ----------------------------------------------------------------

@dataclass(frozen=True)
class DepthSettings:
    """How depth is read (the module doc gives the reasons for the defaults)."""
    min_depth_m: float = 0.1
    max_depth_m: float = 10.0
    inner_fraction: float = 0.5
    point_window: int = 5
    min_valid_fraction: float = 0.2
    min_valid_pixels: int = 5
    max_samples: int = 1024

    def __post_init__(self) -> None:
        _check_range(self.min_depth_m, self.max_depth_m)
        if not 0 < self.inner_fraction <= 1:
            raise DepthError(f"inner_fraction {self.inner_fraction} must be in (0, 1]")
        if self.point_window < 1 or self.point_window % 2 == 0:
            raise DepthError(f"point_window {self.point_window} must be a positive odd number")
        if not 0 <= self.min_valid_fraction <= 1 or self.min_valid_pixels < 1:
            raise DepthError("min_valid_fraction must be in [0, 1] and min_valid_pixels >= 1")
        if self.max_samples < 16:
            raise DepthError(f"max_samples {self.max_samples} must be at least 16")


def _grid_scale(src_w: int, src_h: int, dst_w: int, dst_h: int) -> tuple[float, float] | None:
    """Factors taking continuous coordinates of a src_w x src_h grid to a dst_w x dst_h one, or
    None when their aspect ratios differ by more than a pixel."""
    sx, sy = dst_w / src_w, dst_h / src_h
    if abs(src_w * sy - dst_w) > 1 or abs(src_h * sx - dst_h) > 1:
        return None
    return sx, sy


def _numbers(item: Sequence[float], count: int, what: str) -> tuple[float, ...]:
    """`count` floats from a box or point; DepthError when it is something else."""
    try:
        values = tuple(float(v) for v in item)
    except (TypeError, ValueError):
        raise DepthError(f"a {what} must be {count} numbers, got {item!r}") from None
    if len(values) != count:
        raise DepthError(f"a {what} must be {count} numbers, got {len(values)}")
    return values


# A box's centre and outline, clockwise from the top-left corner, as indices into
# (x0, y0, x1, y1, xc, yc); then, for the rectangle inside the undistorted outline, which outline
# points and axis bound each side (left, right, top, bottom), signed so that one max() finds the
# innermost point of each (right and bottom come out negated).
_OUTLINE = np.array([[4, 5], [0, 1], [4, 1], [2, 1], [2, 5], [2, 3], [4, 3], [0, 3], [0, 5]])
_SIDE_POINTS = np.array([[1, 7, 8], [3, 4, 5], [1, 2, 3], [5, 6, 7]])
_SIDE_AXES = np.array([[0, 0, 0], [0, 0, 0], [1, 1, 1], [1, 1, 1]])
_SIDE_SIGNS = np.array([[1.0] * 3, [-1.0] * 3, [1.0] * 3, [-1.0] * 3])


_UNDISTORTABLE = ("camera_info's distortion model cannot be inverted at the {}: no ray projects back onto "
                  "it (the calibration does not reach this part of the image)")


def _quantiles(values: np.ndarray, qs: Sequence[float]) -> list[float]:
    """Nearest-rank quantiles by one partial sort (np.percentile costs several times more)."""
    ranks = [math.floor((values.size - 1) * q + 0.5) for q in qs]
    part = np.partition(values, sorted(set(ranks)))
    return [float(part[r]) for r in ranks]


class DepthView:
    """One colour frame's depth: the paired depth image, the camera model and the colour image's
    size, checked against each other at construction (DepthError with the reason)."""

    def __init__(self, depth: DepthImage, camera: Intrinsics, image_width: int, image_height: int,
                 settings: DepthSettings = DepthSettings()) -> None:
        image_width, image_height = int(image_width), int(image_height)
        if image_width <= 0 or image_height <= 0:
            raise DepthError(f"colour image size {image_width}x{image_height}")
        to_camera = _grid_scale(image_width, image_height, camera.width, camera.height)
        if to_camera is None:
            raise DepthError(f"invalid camera_info: it is for a {camera.width}x{camera.height} "
                             f"image, but the colour image is {image_width}x{image_height}, another "
                             "aspect ratio: this camera_info does not describe this image")
        to_depth = _grid_scale(image_width, image_height, depth.width, depth.height)
        if to_depth is None:
            raise DepthError(f"mis-sized depth: the depth image is {depth.width}x{depth.height} but "
                             f"the colour image is {image_width}x{image_height}, another aspect ratio: "
                             "the depth is not aligned to this image (it must be registered to the "
                             "colour camera, e.g. aligned_depth_to_color)")
        self.depth, self.camera, self.settings = depth, camera, settings
        self.image_width, self.image_height = image_width, image_height
        self._to_camera = np.array(to_camera)
        self._to_depth = to_depth
        # Validity is tested on the values as stored (no conversion of what is then dropped):
        # millimetre bounds for 16UC1, metres for 32FC1, as scalars of the values' own type
        # (numpy compares with those faster than with Python numbers).
        self._scale = depth.metres_per_unit
        native = depth.values.dtype.newbyteorder("=")
        if native.kind == "u":
            top = np.iinfo(native).max - 1   # the largest value is "no reading" (DEPTH_ENCODINGS)
            self._lo = native.type(min(math.ceil(settings.min_depth_m / self._scale - 1e-6), top))
            self._hi = native.type(min(math.floor(settings.max_depth_m / self._scale + 1e-6), top))
        else:
            self._lo = native.type(settings.min_depth_m / self._scale)
            self._hi = native.type(settings.max_depth_m / self._scale)

    def _rays(self, uv: np.ndarray) -> np.ndarray:
        """Normalized rays through (N, 2) colour-image continuous coordinates."""
        if not uv.size:
            return np.zeros((0, 2))
        return self.camera.normalized(uv * self._to_camera - 0.5)

    def _native(self, values: np.ndarray) -> np.ndarray:
        return values if values.dtype.isnative else values.astype(values.dtype.newbyteorder("="))

    def _valid_depths(self, r0: int, r1: int, c0: int, c1: int) -> tuple[np.ndarray, int]:
        """Valid values (in the image's unit) in depth rows r0:r1, columns c0:c1 (sampled on a
        grid when large), and how many pixels were sampled."""
        region = self.depth.values[r0:r1, c0:c1]
        if region.size > self.settings.max_samples:
            stride = math.ceil(math.sqrt(region.size / self.settings.max_samples))
            rows, cols = region.shape
            # a long thin region (one row of thousands of pixels) keeps its one row
            region = region[min(stride // 2, rows - 1)::stride, min(stride // 2, cols - 1)::stride]
        region = self._native(region)
        return region[(region >= self._lo) & (region <= self._hi)], region.size

    def _enough(self, valid: int, sampled: int, where: str) -> NoDepth | None:
        s = self.settings
        if sampled == 0:
            return NoDepth(f"no depth pixels {where}")
        need = max(math.ceil(s.min_valid_fraction * sampled), min(s.min_valid_pixels, sampled))
        if valid >= need:
            return None
        return NoDepth(f"no valid depth {where}: {valid} of {sampled} pixels valid (need "
                       f"{need}; valid means {s.min_depth_m:g}-{s.max_depth_m:g} m)")

    def _span(self, lo: float, hi: float, size: int) -> tuple[int, int]:
        """Depth pixels whose centres lie in [lo, hi] (depth-grid coordinates); at least the pixel
        under their middle."""
        first, last = math.ceil(lo - 0.5), math.floor(hi - 0.5)
        if last < first:
            first = last = min(max(math.floor((lo + hi) / 2), 0), size - 1)
        return max(first, 0), min(last + 1, size)

    def boxes_3d(self, boxes: Sequence[Sequence[float]]) -> list[Box3D | NoDepth]:
        """Each (x_min, y_min, x_max, y_max) box in colour-image pixels -> Box3D or NoDepth
        (DepthError for an item that is not 4 numbers: a caller's bug, not bad input)."""
        # Per-box arithmetic is plain Python and the undistortion one batched call: at ten boxes
        # a frame each numpy call costs more than the arithmetic it would vectorize.
        s, sx, sy = self.settings, *self._to_depth
        width, height = float(self.image_width), float(self.image_height)
        results: list[Box3D | NoDepth | None] = []
        pending: list[int] = []
        geometry: list[tuple[float, ...]] = []
        stats: list[tuple[float, float, float, int, int]] = []
        for box in boxes:
            ox0, oy0, ox1, oy1 = _numbers(box, 4, "box")
            if not all(map(math.isfinite, (ox0, oy0, ox1, oy1))) or ox1 <= ox0 or oy1 <= oy0:
                results.append(NoDepth(f"box ({ox0:g}, {oy0:g}, {ox1:g}, {oy1:g}) is empty or "
                                       "not finite"))
                continue
            x0, y0, x1, y1 = max(ox0, 0.0), max(oy0, 0.0), min(ox1, width), min(oy1, height)
            if x1 <= x0 or y1 <= y0:
                results.append(NoDepth(f"box ({ox0:g}, {oy0:g}, {ox1:g}, {oy1:g}) lies outside "
                                       f"the {self.image_width}x{self.image_height} image"))
                continue
            xc, yc = (x0 + x1) / 2, (y0 + y1) / 2
            half_w, half_h = (x1 - x0) * s.inner_fraction / 2, (y1 - y0) * s.inner_fraction / 2
            c0, c1 = self._span((xc - half_w) * sx, (xc + half_w) * sx, self.depth.width)
            r0, r1 = self._span((yc - half_h) * sy, (yc + half_h) * sy, self.depth.height)
            valid, sampled = self._valid_depths(r0, r1, c0, c1)
            missing = self._enough(valid.size, sampled, "in the box's inner part")
            results.append(missing)
            if missing is None:
                pending.append(len(results) - 1)
                geometry.append((x0, y0, x1, y1, xc, yc))
                stats.append((*_quantiles(valid, (0.25, 0.5, 0.75)), valid.size, sampled))
        if not pending:
            return results
        rays = self._rays(np.array(geometry)[:, _OUTLINE].reshape(-1, 2)).reshape(-1, 9, 2)
        # The rectangle inside the undistorted outline: each side at its innermost point (of those
        # the camera model can undistort: -inf where none of a side's can).
        signed = rays[:, _SIDE_POINTS, _SIDE_AXES] * _SIDE_SIGNS
        sides = np.where(np.isnan(signed), -np.inf, signed).max(axis=2).tolist()
        for index, (cx, cy), (left, neg_right, top, neg_bottom), (q1, z, q3, count, sampled), box in zip(
                pending, rays[:, 0].tolist(), sides, stats, geometry):
            if not all(map(math.isfinite, (cx, cy, left, neg_right, top, neg_bottom))):
                results[index] = NoDepth(_UNDISTORTABLE.format("box ({:g}, {:g}, {:g}, {:g})".format(*box[:4])))
                continue
            z, spread = z * self._scale, (q3 - q1) * self._scale
            # centre and size of one rectangle: the distorted box's centre pixel lies off the
            # inscribed rectangle's centre (toward the image centre under barrel distortion)
            results[index] = Box3D(
                x=(left - neg_right) / 2 * z, y=(top - neg_bottom) / 2 * z, z=z, size_x=max(-neg_right - left, 0.0) * z,
                size_y=max(-neg_bottom - top, 0.0) * z, size_z=spread, valid_pixels=count,
                valid_fraction=count / sampled)
        return results

    def points_3d(self, points: Sequence[Sequence[float]]) -> list[Point3D | NoDepth]:
        """Each (x, y) point in colour-image pixels -> Point3D or NoDepth."""
        results: list[Point3D | NoDepth | None] = []
        at: list[int] = []
        inside: list[tuple[float, float]] = []
        for point in points:
            x, y = _numbers(point, 2, "point")
            if 0 <= x <= self.image_width and 0 <= y <= self.image_height:
                at.append(len(results))
                inside.append((x, y))
                results.append(None)
            else:
                results.append(NoDepth(f"point ({x:g}, {y:g}) lies outside the "
                                       f"{self.image_width}x{self.image_height} image"))
        if not at:
            return results
        # All windows at once, as flat indices: one gather, invalid values sorted last, each
        # window's median read at its own rank.
        xy = np.array(inside)
        sx, sy = self._to_depth
        height, width = self.depth.values.shape
        half = min(self.settings.point_window // 2, (width - 1) // 2, (height - 1) // 2)
        cols = np.clip((xy[:, 0] * sx).astype(np.intp), half, width - 1 - half)
        rows = np.clip((xy[:, 1] * sy).astype(np.intp), half, height - 1 - half)
        offsets = np.arange(-half, half + 1)
        window = (offsets[:, None] * width + offsets[None, :]).ravel()
        values = self._native(self.depth.values.reshape(-1)[(rows * width + cols)[:, None] + window])
        valid = (values >= self._lo) & (values <= self._hi)
        counts = valid.sum(axis=1)
        ordered = np.sort(np.where(valid, values, np.inf), axis=1)
        rank = np.floor((np.maximum(counts, 1) - 1) * 0.5 + 0.5).astype(np.intp)    # as _quantiles
        medians = ordered[np.arange(len(at)), rank].tolist()
        for index, count, depth, (rx, ry), (x, y) in zip(at, counts.tolist(), medians,
                                                         self._rays(xy).tolist(), inside):
            z = depth * self._scale
            if not (math.isfinite(rx) and math.isfinite(ry)):
                results[index] = NoDepth(_UNDISTORTABLE.format(f"point ({x:g}, {y:g})"))
                continue
            results[index] = self._enough(count, window.size, "around the point") or Point3D(
                x=rx * z, y=ry * z, z=z, valid_pixels=count, valid_fraction=count / window.size)
        return results

    def box_3d(self, box: Sequence[float]) -> Box3D | NoDepth:
        return self.boxes_3d([box])[0]

    def point_3d(self, x: float, y: float) -> Point3D | NoDepth:
        return self.points_3d([(x, y)])[0]


def frame_depth(pairing: DepthPairing, stamp: float, camera: Any, image_width: int,
                image_height: int, settings: DepthSettings = DepthSettings(), *,
                rectified: bool = False) -> DepthView | NoDepth:
    """A colour frame's DepthView, or why it has none; never raises for bad input.

    `camera`: an Intrinsics, a sensor_msgs/CameraInfo (converted here; `rectified` as in
    `intrinsics`), a NoDepth (a node that converts each camera_info on arrival keeps the reason
    it could not), or None when none has arrived. The pairing's frames may be DepthImages or
    sensor_msgs/Image messages (decoded here: a view, no copy of unpadded data)."""
    if camera is None:
        return NoDepth("no camera_info received yet")
    if isinstance(camera, NoDepth):
        return camera
    paired = pairing.nearest(stamp)
    return depth_view(paired if isinstance(paired, NoDepth) else paired.frame, camera, image_width,
                      image_height, settings, rectified=rectified)


def misaligned(image_frame: str, depth: Any, camera: Any) -> str:
    """Why the depth image or camera_info does not describe the colour image ("" if nothing says
    so): a frame id of its own, non-empty and not the colour image's, or (the colour image naming
    none) depth and camera_info naming different frames. Unregistered depth (the
    depth camera's image_rect_raw) or the depth camera's camera_info of the same aspect ratio
    would pass every size check and give positions off by the stereo baseline, or through the
    wrong intrinsics, labelled with the wrong frame."""
    frames = {}
    for what, msg in (("depth image", depth), ("camera_info", camera)):
        frame = frames[what] = getattr(getattr(msg, "header", None), "frame_id", "")
        if image_frame and frame and frame != image_frame:
            return (f"the {what} is in frame {frame!r} but the colour image in {image_frame!r}: depth must be "
                    "registered to the colour camera (e.g. aligned_depth_to_color) and camera_info be the colour "
                    "camera's")
    # A colour image that names no frame cannot vouch for either, but two that name different
    # frames are still two cameras: one of them is not the colour camera's.
    depth_frame, info_frame = frames["depth image"], frames["camera_info"]
    if depth_frame and info_frame and depth_frame != info_frame:
        return (f"the depth image is in frame {depth_frame!r} but the camera_info in {info_frame!r}: depth must be "
                "registered to the colour camera (e.g. aligned_depth_to_color) and camera_info be the colour "
                "camera's")
    return ""


def depth_view(depth: Any, camera: Any, image_width: int, image_height: int,
               settings: DepthSettings = DepthSettings(), *, rectified: bool = False,
               image_frame: str = "") -> DepthView | NoDepth:
    """`frame_depth` for a frame already paired (photon_ros.stamp_pairing): `depth` is its depth
    image (a DepthImage or a sensor_msgs/Image) or a NoDepth, `camera` as in frame_depth. Never
    raises for bad input. A missing camera_info is the reason given first. `image_frame`: the
    colour image's frame id, which the depth image's and camera_info's must match (misaligned)."""
    if camera is None:
        return NoDepth("no camera_info received yet")
    if isinstance(camera, NoDepth):
        return camera
    if isinstance(depth, NoDepth):
        return depth
    if reason := misaligned(image_frame, depth, camera):
        return NoDepth(reason)
    try:
        model = camera if isinstance(camera, Intrinsics) else intrinsics_from_camera_info(
            camera, rectified=rectified)
        image = depth if isinstance(depth, DepthImage) else depth_image_from_msg(depth)
        return DepthView(image, model, image_width, image_height, settings)
    except DepthError as err:
        return NoDepth(str(err))
