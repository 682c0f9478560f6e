"""photon_ros.depth_projection on a rendered scene: two flat objects (1.2 m and 2.5 m) in front of
a wall (3.5 m), seen by a 640x480 camera with known intrinsics, with and without plumb_bob
distortion. The depth image is rendered by projecting dense samples of each surface with
cv2.projectPoints (far to near, each sample writing its depth into the pixel it lands in), so
the truth does not depend on the code under test's deprojection. Holes (zeros, NaN), out-of-range
spikes and 1% Gaussian noise are added; positions must be within 2% of the truth."""
from __future__ import annotations

import functools
from dataclasses import dataclass
from types import SimpleNamespace

import cv2
import numpy as np
import pytest

from photon_ros.depth_projection import (Box3D, DepthError, DepthImage, DepthPairing,
                                         DepthSettings, DepthView, Intrinsics, NoDepth, Point3D,
                                         depth_image, depth_to_metres, depth_view, frame_depth, intrinsics,
                                         intrinsics_from_camera_info)

WIDTH, HEIGHT = 640, 480
FX = FY = 525.0
CX, CY = 319.5, 239.5
K = np.array([[FX, 0.0, CX], [0.0, FY, CY], [0.0, 0.0, 1.0]])
# A wide-angle webcam's calibration (barrel distortion, small tangential terms).
PLUMB_BOB = (-0.25, 0.08, 0.0006, -0.0004, -0.01)
# OpenCV's rational model, 8 coefficients as depthai (OAK cameras) sends them: k4..k6 divide (dropping
# them misses the near object by more than the 2% the test allows)
RATIONAL = (0.35, -0.2, 0.0006, -0.0004, 0.01, 0.6, -0.25, 0.05)
NOISE = 0.01
SETTINGS = DepthSettings(min_depth_m=0.2, max_depth_m=8.0)


@dataclass(frozen=True)
class Plane:
    """A rectangle facing the camera: centre (x, y, z) in the optical frame, size in metres."""
    x: float
    y: float
    z: float
    size_x: float
    size_y: float

    def samples(self, spacing: float) -> np.ndarray:
        xs = np.arange(-self.size_x / 2, self.size_x / 2 + spacing / 2, spacing) + self.x
        ys = np.arange(-self.size_y / 2, self.size_y / 2 + spacing / 2, spacing) + self.y
        gx, gy = np.meshgrid(xs, ys)
        return np.stack([gx.ravel(), gy.ravel(), np.full(gx.size, self.z)], axis=1)


# Off-centre, where the lens bends rays by ~4%: ignoring the distortion would miss by more than 2%.
NEAR = Plane(-0.55, 0.28, 1.2, 0.26, 0.20)
FAR = Plane(0.9, -0.45, 2.5, 0.50, 0.40)
WALL = Plane(0.0, 0.0, 3.5, 4.6, 2.8)
OBJECTS = (NEAR, FAR)


def project(points: np.ndarray, camera: np.ndarray, dist) -> np.ndarray:
    """OpenCV pixel coordinates (pixel centres at integers) of 3D points."""
    uv, _ = cv2.projectPoints(points, np.zeros(3), np.zeros(3), camera,
                              None if dist is None else np.array(dist))
    return uv.reshape(-1, 2)


@functools.lru_cache(maxsize=None)
def render(dist: tuple | None) -> np.ndarray:
    """True depth (metres, 0 where no surface) of the scene at 640x480."""
    depth = np.zeros((HEIGHT, WIDTH))
    for plane in (WALL, *OBJECTS):    # far to near: nearer surfaces overwrite
        # Samples 0.6 of a pixel apart at the image centre: every pixel the surface covers gets one.
        uv = project(plane.samples(0.6 * plane.z / FX), K, dist)
        col, row = np.rint(uv[:, 0]).astype(int), np.rint(uv[:, 1]).astype(int)
        inside = (col >= 0) & (col < WIDTH) & (row >= 0) & (row < HEIGHT)
        depth[row[inside], col[inside]] = plane.z
    return depth


def detection_box(plane: Plane, dist) -> tuple[float, float, float, float]:
    """The box a detector would draw around `plane`: the extent of its projected outline, in
    continuous image coordinates (pixel edges at integers)."""
    uv = project(plane.samples(0.002), K, dist) + 0.5
    return (*uv.min(axis=0), *uv.max(axis=0))


def centre_pixel(plane: Plane, dist) -> tuple[float, float]:
    u, v = project(np.array([[plane.x, plane.y, plane.z]]), K, dist)[0] + 0.5
    return float(u), float(v)


def measured(depth: np.ndarray, encoding: str, seed: int = 0) -> np.ndarray:
    """The rendered depth as a sensor gives it: 1% noise, 15% scattered holes, a hole block on
    each object, out-of-range spikes; in the encoding's unit and markers."""
    rng = np.random.default_rng(seed)
    metres = depth * (1 + NOISE * rng.standard_normal(depth.shape))
    holes = (depth == 0) | (rng.random(depth.shape) < 0.15)
    for plane in OBJECTS:
        u, v = np.rint(project(np.array([[plane.x, plane.y, plane.z]]), K, None)[0]).astype(int)
        holes[v - 4:v + 4, u - 16:u - 3] = True     # beside the centre, inside the inner part
    spikes = rng.random(depth.shape) < 0.02
    if encoding == "16UC1":
        out = np.rint(metres * 1000).astype(np.uint16)
        out[holes] = 0
        out[spikes] = 60000          # 60 m: beyond max_depth_m
        return out
    out = metres.astype(np.float32)
    out[holes] = np.nan
    out[holes & (rng.random(depth.shape) < 0.3)] = 0.0      # some drivers write 0 in 32FC1
    out[spikes] = np.inf
    return out


def depth_msg(values: np.ndarray, encoding: str, bigendian: bool = False, padding: int = 0):
    """A sensor_msgs/Image's fields holding `values` (rows padded by `padding` bytes)."""
    dtype = values.dtype.newbyteorder(">" if bigendian else "<")
    rows = np.ascontiguousarray(values.astype(dtype)).view(np.uint8).reshape(values.shape[0], -1)
    rows = np.pad(rows, ((0, 0), (0, padding)), constant_values=0xEE)
    return SimpleNamespace(encoding=encoding, width=values.shape[1], height=values.shape[0],
                           step=rows.shape[1], is_bigendian=int(bigendian), data=rows.tobytes())


def camera_info(width=WIDTH, height=HEIGHT, k=K, d=PLUMB_BOB, model="plumb_bob", p=None):
    k = np.asarray(k, dtype=float)
    if p is None:
        p = np.hstack([k, np.zeros((3, 1))])
    return SimpleNamespace(width=width, height=height, distortion_model=model, d=list(d),
                           k=k.ravel(), r=np.eye(3).ravel(), p=np.asarray(p, float).ravel(),
                           binning_x=0, binning_y=0,
                           roi=SimpleNamespace(x_offset=0, y_offset=0, width=0, height=0,
                                               do_rectify=False))


def paired(msg, stamp: float = 100.0, tolerance: float = 0.05) -> DepthPairing:
    pairing = DepthPairing(tolerance)
    pairing.add(stamp, msg)
    return pairing


def assert_close(result, truth: tuple[float, float, float], rel: float = 0.02) -> None:
    assert result.ok, result
    error = np.linalg.norm(np.array([result.x, result.y, result.z]) - truth)
    assert error <= rel * np.linalg.norm(truth), (result, truth, error)
    assert abs(result.z - truth[2]) <= rel * truth[2]


CASES = {
    # name: (encoding, distortion model and d, big-endian, row padding bytes, rectified)
    "16UC1-pinhole": ("16UC1", ("", ()), False, 0, False),
    "32FC1-pinhole-bigendian": ("32FC1", ("none", ()), True, 0, False),
    "16UC1-plumb_bob-bigendian-padded": ("16UC1", ("plumb_bob", PLUMB_BOB), True, 6, False),
    "32FC1-plumb_bob-padded": ("32FC1", ("plumb_bob", PLUMB_BOB), False, 12, False),
    "16UC1-plumb_bob-4": ("16UC1", ("plumb_bob", PLUMB_BOB[:4]), False, 0, False),
    "16UC1-rational_polynomial": ("16UC1", ("rational_polynomial", RATIONAL), False, 0, False),
    # A rectified image with the raw camera's K and D in camera_info: P is what applies.
    "16UC1-rectified": ("16UC1", ("plumb_bob", PLUMB_BOB), False, 0, True),
}


@pytest.mark.parametrize("case", CASES)
def test_objects_at_known_depths(case: str) -> None:
    encoding, (model, d), bigendian, padding, rectified = CASES[case]
    distorted = bool(d) and not rectified
    lens = tuple(d) if distorted else None
    if rectified:
        info = camera_info(k=[[540.0, 0, 322.0], [0, 538.0, 236.0], [0, 0, 1]], d=d, model=model,
                           p=np.hstack([K, np.zeros((3, 1))]))
    else:
        info = camera_info(d=d, model=model)
    msg = depth_msg(measured(render(lens), encoding), encoding, bigendian, padding)
    view = frame_depth(paired(msg), 100.01, info, WIDTH, HEIGHT, SETTINGS, rectified=rectified)
    assert isinstance(view, DepthView), view

    boxes = view.boxes_3d([detection_box(plane, lens) for plane in OBJECTS])
    points = view.points_3d([centre_pixel(plane, lens) for plane in OBJECTS])
    for plane, box, point in zip(OBJECTS, boxes, points):
        truth = (plane.x, plane.y, plane.z)
        assert isinstance(box, Box3D) and isinstance(point, Point3D)
        assert_close(box, truth)
        assert_close(point, truth)
        assert box.size_x == pytest.approx(plane.size_x, rel=0.05)
        assert box.size_y == pytest.approx(plane.size_y, rel=0.05)
        # A flat face: the interquartile range is the noise's, 1.35 sigma.
        assert 0.5 * 1.35 * NOISE * plane.z < box.size_z < 2 * 1.35 * NOISE * plane.z
        assert 0.5 < box.valid_fraction < 0.95    # holes and spikes were skipped, not used

    if distorted:
        # The same pixels read as if the lens were ideal miss by more than 2%: the test above
        # depends on the undistortion.
        ideal = DepthView(view.depth, Intrinsics(WIDTH, HEIGHT, FX, FY, CX, CY), WIDTH, HEIGHT,
                          SETTINGS).boxes_3d([detection_box(NEAR, lens)])[0]
        error = np.linalg.norm(np.array([ideal.x, ideal.y, ideal.z]) - (NEAR.x, NEAR.y, NEAR.z))
        assert error > 0.02 * np.linalg.norm((NEAR.x, NEAR.y, NEAR.z))


def test_inner_part_ignores_the_background() -> None:
    """A loose box, 1.8x the object's size: two thirds of its pixels are the wall at 3.5 m (the
    median over the whole box would be the wall's), but its inner part is the object."""
    view = DepthView(depth_image(**vars(depth_msg(measured(render(None), "16UC1"), "16UC1"))),
                     intrinsics_from_camera_info(camera_info(d=())), WIDTH, HEIGHT, SETTINGS)
    x0, y0, x1, y1 = detection_box(FAR, None)
    grow_x, grow_y = 0.4 * (x1 - x0), 0.4 * (y1 - y0)
    box = view.box_3d((x0 - grow_x, y0 - grow_y, x1 + grow_x, y1 + grow_y))
    assert_close(box, (FAR.x, FAR.y, FAR.z))
    assert box.size_x == pytest.approx(1.8 * FAR.size_x, rel=0.05)


@pytest.mark.parametrize("colour, info_size", [((1280, 960), (1280, 960)), ((1280, 960), (640, 480)),
                                                ((320, 240), (640, 480))])
def test_depth_of_another_size_with_the_same_aspect(colour, info_size) -> None:
    """640x480 depth read for a colour image of another size, camera_info for either grid."""
    scale_info = info_size[0] / WIDTH
    k = [[FX * scale_info, 0, (CX + 0.5) * scale_info - 0.5],
         [0, FY * scale_info, (CY + 0.5) * scale_info - 0.5], [0, 0, 1]]
    msg = depth_msg(measured(render(None), "32FC1"), "32FC1")
    view = frame_depth(paired(msg), 100.0, camera_info(*info_size, k=k, d=()), *colour, SETTINGS)
    assert isinstance(view, DepthView), view
    s = colour[0] / WIDTH
    for plane in OBJECTS:
        box = [c * s for c in detection_box(plane, None)]
        assert_close(view.box_3d(box), (plane.x, plane.y, plane.z))
        u, v = centre_pixel(plane, None)
        assert_close(view.point_3d(u * s, v * s), (plane.x, plane.y, plane.z))


def test_mis_sized_depth_is_refused() -> None:
    msg = depth_msg(measured(render(None), "16UC1"), "16UC1")     # 640x480
    result = frame_depth(paired(msg), 100.0, camera_info(1280, 720, k=[[900, 0, 640], [0, 900, 360],
                                                                       [0, 0, 1]]), 1280, 720)
    assert isinstance(result, NoDepth)
    assert "640x480" in result.reason and "1280x720" in result.reason
    assert "aspect ratio" in result.reason and "depth" in result.reason


def test_missing_and_stale_depth() -> None:
    info = camera_info(d=())
    assert frame_depth(DepthPairing(0.05), 100.0, info, WIDTH, HEIGHT).reason == \
        "no depth image received yet"
    msg = depth_msg(measured(render(None), "16UC1"), "16UC1")
    assert frame_depth(paired(msg), 100.0, None, WIDTH, HEIGHT).reason == \
        "no camera_info received yet"
    kept = NoDepth("invalid camera_info: K is all zeros (the camera is not calibrated)")
    assert frame_depth(paired(msg), 100.0, kept, WIDTH, HEIGHT) == kept

    pairing = DepthPairing(0.05, keep=3)
    for stamp in (99.0, 99.5, 100.3):
        pairing.add(stamp, msg)
    stale = frame_depth(pairing, 99.8, info, WIDTH, HEIGHT)
    assert isinstance(stale, NoDepth)
    assert "stale depth" in stale.reason and "0.300 s before" in stale.reason
    assert "tolerance 0.05 s" in stale.reason

    # The nearest of the kept frames, newer or older; the oldest drops out past `keep`.
    pairing.add(100.02, "newest")
    assert len(pairing) == 3
    assert pairing.nearest(100.0).frame == "newest"
    assert pairing.nearest(100.0).offset_s == pytest.approx(0.02)
    assert pairing.nearest(100.29).stamp == 100.3
    assert isinstance(pairing.nearest(99.0), NoDepth)      # 99.0 was dropped


def _malformed(field: str, value) -> SimpleNamespace:
    msg = depth_msg(np.full((HEIGHT, WIDTH), 1200, np.uint16), "16UC1")
    setattr(msg, field, value)
    return msg


@pytest.mark.parametrize("msg, reason", [
    (_malformed("step", WIDTH * 2 - 2), "step 1278 is shorter than a row"),
    (_malformed("step", WIDTH * 2 + 4), "not step x height = 1284 x 480"),
    (_malformed("data", bytes(WIDTH * HEIGHT * 2 - 1)), "data has 614399 bytes"),
    (_malformed("encoding", "rgb8"), "'rgb8' is not a depth encoding"),
    (_malformed("height", 0), "size 640x0"),
], ids=["short-step", "long-step", "short-data", "encoding", "zero-size"])
def test_malformed_depth_gives_a_reason(msg, reason: str) -> None:
    result = frame_depth(paired(msg), 100.0, camera_info(d=()), WIDTH, HEIGHT)
    assert isinstance(result, NoDepth) and reason in result.reason, result


@pytest.mark.parametrize("info, reason", [
    (camera_info(k=[[0, 0, CX], [0, FY, CY], [0, 0, 1]]), "focal lengths fx = 0"),
    (camera_info(k=np.zeros((3, 3))), "K is all zeros"),
    (camera_info(k=[[FX, 0, np.nan], [0, FY, CY], [0, 0, 1]]), "K has non-finite values"),
    (camera_info(d=(0.1, 0.02, 0.0, 0.0), model="equidistant"), "unsupported distortion model 'equidistant'"),
    (camera_info(d=(0.1, 0.02, 0.0, 0.0, 0.0), model="rational_polynomial"),
     "rational_polynomial takes 8 or 12 or 14 coefficients"),
    (camera_info(d=(-0.2, 0.05, 0.0)), "plumb_bob takes 4 or 5 coefficients"),
    (camera_info(d=(-0.2, 0.05, 0.0, 0.0, 0.0), model=""), "is not zero"),
    (camera_info(k=[[FX, 0, 960], [0, FY, 540], [0, 0, 1]]), "principal point (960, 540) lies outside"),
    (camera_info(width=0, height=0), "image size 0x0"),
    (camera_info(width=800, height=480, k=[[FX, 0, 400], [0, FY, CY], [0, 0, 1]]),
     "camera_info: it is for a 800x480 image, but the colour image is 640x480"),
], ids=["zero-fx", "zero-K", "nan", "equidistant", "rational", "plumb_bob-3", "coefficients-without-model",
        "principal-point", "zero-size", "aspect"])
def test_invalid_camera_info_gives_a_reason(info, reason: str) -> None:
    msg = depth_msg(measured(render(None), "16UC1"), "16UC1")
    result = frame_depth(paired(msg), 100.0, info, WIDTH, HEIGHT)
    assert isinstance(result, NoDepth) and reason in result.reason, result
    with pytest.raises(DepthError):
        DepthView(depth_image(**vars(msg)), intrinsics_from_camera_info(info), WIDTH, HEIGHT)


def test_rectified_needs_p() -> None:
    info = camera_info(p=np.zeros((3, 4)))
    assert intrinsics_from_camera_info(info).fx == FX          # the raw image uses K
    with pytest.raises(DepthError, match="P is all zeros"):
        intrinsics_from_camera_info(info, rectified=True)


def test_all_zero_coefficients_are_no_distortion() -> None:
    for model in ("equidistant", "plumb_bob", "rational_polynomial", ""):
        assert intrinsics(WIDTH, HEIGHT, model, [0.0] * 5, K.ravel()).distortion == ()
    assert intrinsics(WIDTH, HEIGHT, "plumb_bob", [], K.ravel()).distortion == ()


def test_no_valid_depth_is_never_zero_metres() -> None:
    values = np.full((HEIGHT, WIDTH), 1500, np.uint16)
    values[100:200, 100:300] = 0                        # no reading
    values[300:400, 100:300] = 200                      # 0.2 m: below min_depth_m
    values[300:400, 400:500] = np.where(np.random.default_rng(1).random((100, 100)) < 0.25,
                                        1500, 0)        # a quarter valid: above the 20% needed
    view = DepthView(DepthImage(values, 0.001), Intrinsics(WIDTH, HEIGHT, FX, FY, CX, CY),
                     WIDTH, HEIGHT, DepthSettings(min_depth_m=0.3, max_depth_m=5.0))
    hole, near, sparse, outside, empty = view.boxes_3d([
        (120, 110, 280, 190), (100, 300, 300, 400), (400, 300, 500, 400), (700, 10, 800, 50),
        (50, 50, 50, 80)])
    assert isinstance(hole, NoDepth) and "no valid depth in the box's inner part: 0 of" in hole.reason
    assert isinstance(near, NoDepth) and "0.3-5 m" in near.reason
    assert isinstance(sparse, Box3D) and sparse.z == pytest.approx(1.5)
    assert sparse.valid_fraction == pytest.approx(0.25, abs=0.05)
    assert isinstance(outside, NoDepth) and "outside the 640x480 image" in outside.reason
    assert isinstance(empty, NoDepth) and "empty" in empty.reason
    in_hole, too_near, edge, off = view.points_3d([(150.5, 150.5), (200.5, 350.5), (0.0, 0.0),
                                                   (-1.0, 10.0)])
    assert isinstance(in_hole, NoDepth) and "around the point" in in_hole.reason
    # 16UC1's largest value is "no reading" even where the range reaches past it
    saturated = np.full((HEIGHT, WIDTH), 65535, np.uint16)
    saturated[:, WIDTH // 2:] = 65534
    far = DepthView(DepthImage(saturated, 0.001), Intrinsics(WIDTH, HEIGHT, FX, FY, CX, CY),
                    WIDTH, HEIGHT, DepthSettings(min_depth_m=0.3, max_depth_m=100.0))
    marked, deep = far.points_3d([(100.5, 100.5), (500.5, 100.5)])
    assert isinstance(marked, NoDepth) and isinstance(deep, Point3D) and deep.z == pytest.approx(65.534)
    assert isinstance(too_near, NoDepth) and "0 of 25 pixels valid" in too_near.reason
    # A corner's window is moved inside the image; its ray is the corner's.
    assert isinstance(edge, Point3D) and edge.valid_pixels == 25
    assert edge.x == pytest.approx(-(CX + 0.5) / FX * 1.5) and edge.z == pytest.approx(1.5)
    assert isinstance(off, NoDepth) and "outside" in off.reason
    assert view.boxes_3d([]) == [] and view.points_3d([]) == []
    with pytest.raises(DepthError, match="a box must be 4 numbers, got 3"):
        view.boxes_3d([(1, 2, 3)])


def test_depth_to_metres_marks_invalid_values() -> None:
    mm = np.array([[0, 100, 1200, 65535], [999, 2500, 1, 5000]], np.uint16)
    expected = np.array([[np.nan, np.nan, 1.2, np.nan], [0.999, 2.5, np.nan, 5.0]], np.float32)
    for bigendian, padding in ((False, 0), (True, 2), (False, 3)):
        msg = depth_msg(mm, "16UC1", bigendian, padding)
        got = depth_to_metres(msg.data, "16UC1", 4, 2, msg.step, bigendian, 0.5, 6.0)
        np.testing.assert_array_equal(np.isnan(got), np.isnan(expected))
        np.testing.assert_allclose(got[~np.isnan(got)], expected[~np.isnan(expected)], rtol=1e-6)
    metres = np.array([[np.nan, np.inf, -np.inf, 0.0, -1.2, 1.25, 6.5, 0.5]], np.float32)
    for bigendian in (False, True):
        msg = depth_msg(metres, "32FC1", bigendian)
        got = depth_to_metres(msg.data, "32FC1", 8, 1, msg.step, bigendian, 0.5, 6.0)
        assert np.isnan(got[0, :5]).all() and np.isnan(got[0, 6])
        assert got[0, 5] == np.float32(1.25) and got[0, 7] == np.float32(0.5)
    with pytest.raises(DepthError, match="0 < min_depth_m < max_depth_m"):
        depth_to_metres(msg.data, "32FC1", 8, 1, msg.step, False, 0.0, 6.0)
    # 16UC1's largest value is "no reading" (a driver's saturated pixel) even where the range
    # would take 65.535 m; the value below it is a depth
    msg = depth_msg(np.array([[65535, 65534]], np.uint16), "16UC1")
    got = depth_to_metres(msg.data, "16UC1", 2, 1, msg.step, False, 0.5, 100.0)
    assert np.isnan(got[0, 0]) and got[0, 1] == pytest.approx(65.534)


def test_real_ros_messages() -> None:
    """The same scene through sensor_msgs/Image and CameraInfo (array.array and numpy fields)."""
    msgs = pytest.importorskip("sensor_msgs.msg")
    values = measured(render(PLUMB_BOB), "16UC1")
    image = msgs.Image(encoding="16UC1", width=WIDTH, height=HEIGHT, step=WIDTH * 2,
                       is_bigendian=0, data=values.astype("<u2").tobytes())
    info = msgs.CameraInfo(width=WIDTH, height=HEIGHT, distortion_model="plumb_bob",
                           d=list(PLUMB_BOB), k=K.ravel().tolist(), r=np.eye(3).ravel().tolist(),
                           p=np.hstack([K, np.zeros((3, 1))]).ravel().tolist())
    view = frame_depth(paired(image), 100.0, info, WIDTH, HEIGHT, SETTINGS)
    assert isinstance(view, DepthView), view
    # A view of the message's buffer, not a copy.
    assert np.shares_memory(view.depth.values, np.frombuffer(image.data, np.uint8))
    for plane in OBJECTS:
        assert_close(view.box_3d(detection_box(plane, PLUMB_BOB)), (plane.x, plane.y, plane.z))


@pytest.mark.parametrize("box", [(100, 700, 2400, 701), (1200, 40, 1201, 1400)], ids=["one-row", "one-column"])
def test_a_long_thin_box_gets_its_depth(box) -> None:
    # A shelf edge or a cable: an inner region one depth pixel across and thousands long, sampled
    # on a grid, kept its one row (it used to sample none and raise IndexError).
    w, h = 2560, 1440
    info = camera_info(width=w, height=h, k=[[1000.0, 0, w / 2], [0, 1000.0, h / 2], [0, 0, 1]], d=())
    view = frame_depth(paired(depth_msg(np.full((h, w), 2000, np.uint16), "16UC1")), 100.0, info, w, h)
    got = view.boxes_3d([box])[0]
    assert isinstance(got, Box3D) and got.z == pytest.approx(2.0, abs=1e-6), got


@pytest.mark.parametrize("depth_frame, info_frame, said", [
    ("camera_depth_optical_frame", "camera_color_optical_frame", "the depth image is in frame 'camera_depth_optical_frame'"),
    ("camera_color_optical_frame", "camera_depth_optical_frame", "the camera_info is in frame 'camera_depth_optical_frame'"),
    ("camera_color_optical_frame", "camera_color_optical_frame", None),
    ("", "", None)])       # frames not named: nothing says they differ
def test_depth_or_camera_info_of_another_camera_gives_no_depth(depth_frame, info_frame, said) -> None:
    # A RealSense's unaligned depth (image_rect_raw) at the colour image's size passes every size
    # check: only its frame id tells it is another camera's.
    msg = depth_msg(measured(render(None), "16UC1"), "16UC1")
    msg.header = SimpleNamespace(frame_id=depth_frame)
    info = camera_info(d=())
    info.header = SimpleNamespace(frame_id=info_frame)
    view = depth_view(msg, info, WIDTH, HEIGHT, image_frame="camera_color_optical_frame")
    if said is None:
        assert isinstance(view, DepthView)
    else:
        assert isinstance(view, NoDepth) and said in view.reason and "registered" in view.reason


@pytest.mark.parametrize("depth_frame, info_frame, refused", [
    ("camera_depth_optical_frame", "camera_color_optical_frame", True),
    ("camera_color_optical_frame", "camera_color_optical_frame", False),
    ("camera_depth_optical_frame", "", False)])   # one unnamed: nothing says they differ
def test_a_colour_image_naming_no_frame_does_not_hide_depth_of_another_camera(depth_frame, info_frame,
                                                                                refused) -> None:
    # With no frame id on the colour image there is nothing to compare each against, but depth and
    # camera_info naming two frames are two cameras: positions would be off by the stereo baseline.
    msg = depth_msg(measured(render(None), "16UC1"), "16UC1")
    msg.header = SimpleNamespace(frame_id=depth_frame)
    info = camera_info(d=())
    info.header = SimpleNamespace(frame_id=info_frame)
    view = depth_view(msg, info, WIDTH, HEIGHT, image_frame="")
    if refused:
        assert isinstance(view, NoDepth) and "registered" in view.reason
        assert repr(depth_frame) in view.reason and repr(info_frame) in view.reason
    else:
        assert isinstance(view, DepthView)


@pytest.mark.parametrize("size, fx, d", [
    ((640, 480), 350.0, (-0.35, 0.12, 0.0, 0.0, -0.02)),
    # a rational model whose numerator and denominator nearly cancel, as OAK calibrations' do
    ((1280, 800), 600.0, (-4.27, 15.6, 0.0, 0.0, -16.6, -4.18, 15.3, -16.3)),
], ids=["plumb_bob", "rational"])
def test_every_pixel_the_model_can_invert_gets_its_own_ray(size, fx, d):
    """A radial model that turns over: r_d(r) rises to a maximum and falls (then may go negative,
    or rise again). A pixel inside the maximum has one ray through the lens, on the first rising
    branch; rays past the fold project onto pixels too, OpenCV's iteration lands on them, and a
    check of the reprojection alone took them (2390 of this rational model's grid, placed up to
    1.8x too far out). Pixels past the maximum have no ray."""
    width, height = size
    cx, cy = width / 2 - 0.5, height / 2 - 0.5
    camera = Intrinsics(width, height, fx, fx, cx, cy, d)
    k = list(d) + [0.0] * (8 - len(d))
    r = np.linspace(0.0, 4.0, 400001)
    r_d = r * (1 + k[0] * r**2 + k[1] * r**4 + k[4] * r**6) / (1 + k[5] * r**2 + k[6] * r**4 + k[7] * r**6)
    fold = int(np.argmax(np.diff(r_d) <= 0))
    uv = np.array([(x, y) for x in np.linspace(0, width - 1, 65) for y in np.linspace(0, height - 1, 41)])
    rho = np.hypot(*((uv - (cx, cy)) / fx).T)
    rays = camera.normalized(uv)
    placed = np.isfinite(rays).all(axis=1)
    assert placed[rho < r_d[fold] - 1e-3].all(), uv[(rho < r_d[fold] - 1e-3) & ~placed]
    assert not placed[rho > r_d[fold] + 1e-3].any()
    assert (np.hypot(*rays[placed].T) <= r[fold] + 1e-3).all()


def test_a_pixel_the_distortion_model_cannot_invert_has_no_position() -> None:
    """A wide-angle plumb_bob calibration whose polynomial turns over before the image's corners
    (fitted without samples there): no ray distorts onto a corner pixel, and OpenCV's iteration
    there diverges or returns the distorted coordinates (positions metres to kilometres off, with
    no sign of it). Such a pixel gets no position, with the reason; every position given is on a
    ray that projects back onto its own pixel, and the rest of the image is placed as before."""
    fx, d = 350.0, (-0.35, 0.12, 0.0, 0.0, -0.02)
    camera = Intrinsics(WIDTH, HEIGHT, fx, fx, CX, CY, d)
    view = DepthView(DepthImage(np.full((HEIGHT, WIDTH), 1500, np.uint16), 0.001), camera, WIDTH, HEIGHT)
    k = np.array([[fx, 0, CX], [0, fx, CY], [0, 0, 1]])
    grid = [(x, y) for x in np.linspace(0.5, WIDTH - 0.5, 33) for y in np.linspace(0.5, HEIGHT - 0.5, 25)]
    placed = 0
    for (x, y), got in zip(grid, view.points_3d(grid)):
        if isinstance(got, NoDepth):
            assert "cannot be inverted at the point" in got.reason, got
            continue
        placed += 1
        assert np.isfinite([got.x, got.y, got.z]).all() and got.z == pytest.approx(1.5)
        back = project(np.array([[got.x, got.y, got.z]]), k, d)[0] + 0.5
        assert np.hypot(*(back - (x, y))) < 0.5, ((x, y), back, got)
    assert 0.5 * len(grid) < placed < len(grid)      # the corners have none, the middle has
    corner, middle = view.boxes_3d([(0, 0, 40, 30), (300, 220, 340, 260)])
    assert isinstance(corner, NoDepth) and "cannot be inverted at the box" in corner.reason, corner
    assert isinstance(middle, Box3D) and np.isfinite([middle.x, middle.y, middle.size_x, middle.size_y]).all()
    # A box whose corners lie where the model does not invert, the middles of its sides where it
    # does, keeps its position and takes its size from those (under barrel distortion a side's
    # middle is its innermost point anyway); one whose side has no point that inverts has none.
    large, whole = view.boxes_3d([(40, 30, 600, 450), (0, 0, WIDTH, HEIGHT)])
    assert isinstance(large, Box3D) and abs(large.x) < 0.01, large
    left_middle = camera.normalized([(40 - 0.5, CY)])[0, 0]      # the right side's mirrors it
    assert np.isfinite(left_middle) and large.size_x == pytest.approx(-2 * left_middle * 1.5, rel=1e-6)
    assert isinstance(whole, NoDepth) and "cannot be inverted at the box" in whole.reason


@pytest.mark.parametrize("near_x", [1.0, -2.0])
def test_a_distorted_boxs_centre_and_size_describe_one_rectangle(near_x) -> None:
    """A 1 m square at 2 m, off-axis, seen through a strong wide-angle lens: the published box,
    centre +- size / 2, is the square (the distorted box's centre pixel lies nearer the image
    centre than the square's centre: a centre from it shifted the box ~6 cm inward)."""
    k = np.array([[300.0, 0, 320], [0, 300, 240], [0, 0, 1]])
    d = [-0.3, 0.09, 0.0, 0.0, 0.0]
    view = DepthView(DepthImage(np.full((HEIGHT, WIDTH), 2000, np.uint16), 0.001),
                     intrinsics(WIDTH, HEIGHT, "plumb_bob", d, k.ravel()), WIDTH, HEIGHT, SETTINGS)
    edge = np.linspace(0.0, 1.0, 201)
    outline = np.concatenate([np.c_[near_x + edge, np.full_like(edge, y)] for y in (-0.5, 0.5)]
                             + [np.c_[np.full_like(edge, x), edge - 0.5] for x in (near_x, near_x + 1.0)])
    pixels, _ = cv2.projectPoints(np.c_[outline, np.full(len(outline), 2.0)], np.zeros(3), np.zeros(3), k, np.array(d))
    pixels = pixels.reshape(-1, 2) + 0.5          # OpenCV's pixel centres are at integers, ours at +0.5
    box = view.box_3d((*pixels.min(axis=0), *pixels.max(axis=0)))
    assert isinstance(box, Box3D), box
    assert box.z == pytest.approx(2.0)
    for centre, size, low in ((box.x, box.size_x, near_x), (box.y, box.size_y, -0.5)):
        assert centre - size / 2 == pytest.approx(low, abs=0.01)
        assert centre + size / 2 == pytest.approx(low + 1.0, abs=0.01)
