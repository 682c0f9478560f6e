"""Image messages <-> RGB arrays: every encoding round-trips or decodes to known pixels, padded
rows and both byte orders work, wide values are scaled (never saturated), compressed frames
decode the same under OpenCV 4.6 (Ubuntu's apt) as under the venv's release, and each malformed
message raises a ValueError that names the problem."""
import io
import re
import struct
import zlib
from pathlib import Path

import cv2
import numpy as np
import pytest
from PIL import Image as PILImage
from sensor_msgs.msg import CompressedImage, Image

import image_frames
import side_opencv
from photon_ros.image_conversions import (SUPPORTED_ENCODINGS, WRITABLE_ENCODINGS, compressed_to_rgb,
                                          image_to_rgb, rgb_to_compressed, rgb_to_image)

# Y, Cb, Cr are whole bytes: rounding each (+-0.5) moves R, G, B by up to 1.164 x 0.5 + 2.018 x 0.5
# = 1.6 levels through BT.601's inverse, and OpenCV's fixed-point arithmetic rounds once more.
YUV_TOLERANCE = 2
PACKED_YUV422 = ("uyvy", "yuv422", "yuyv", "yuv422_yuy2")
SEMI_PLANAR = ("nv12", "nv21", "nv24")
BAYER_PATTERNS = ("rggb", "bggr", "gbrg", "grbg")


@pytest.fixture
def rgb():
    # Fresh random content each run, odd sizes so rows are not aligned.
    rng = np.random.default_rng()
    return rng.integers(0, 256, size=(37, 53, 3), dtype=np.uint8)


def gray_of(rgb):
    luma = cv2.cvtColor(rgb, cv2.COLOR_RGB2GRAY)
    return np.repeat(luma[:, :, None], 3, axis=2)


@pytest.mark.parametrize("encoding", WRITABLE_ENCODINGS)
@pytest.mark.parametrize("padding", [0, 7])
@pytest.mark.parametrize("bigendian", [False, True])
def test_round_trip(rgb, encoding, padding, bigendian):
    msg = rgb_to_image(rgb, encoding, row_padding=padding, is_bigendian=bigendian)
    assert msg.step >= msg.width and len(msg.data) == msg.step * msg.height
    back = image_to_rgb(msg)
    assert back.shape == rgb.shape and back.dtype == np.uint8
    single_channel = encoding.startswith("mono") or encoding.endswith("C1")
    np.testing.assert_array_equal(back, gray_of(rgb) if single_channel else rgb)


def test_every_encoding_of_image_encodings_hpp_that_is_a_picture_is_read():
    # The installed sensor_msgs' own list (Kilted: colour, mono, Bayer, YUV 4:2:2, NV12/21/24 and
    # the OpenCV type names), less the OpenCV types that hold no picture: signed, 2 channels.
    from ament_index_python.packages import get_package_prefix
    header = Path(get_package_prefix("sensor_msgs"), "include", "sensor_msgs", "sensor_msgs",
                  "image_encodings.hpp").read_text()
    defined = set(re.findall(r'const char \w+\[\] = "([^"]+)";', header))
    assert {"rgb8", "bayer_grbg16", "yuv422_yuy2", "nv21", "32FC1"} <= defined
    not_pictures = {name for name in defined if re.fullmatch(r"\d+SC\d|\d+[UF]C2", name)}
    assert defined - not_pictures == set(SUPPORTED_ENCODINGS)


def _message(encoding, values, bigendian=False):
    """One row of values in `encoding`'s dtype and the given byte order."""
    values = np.asarray(values)
    data = values.astype(values.dtype.newbyteorder(">" if bigendian else "<")).tobytes()
    return Image(height=1, width=values.shape[0], encoding=encoding, is_bigendian=bigendian,
                 step=len(data), data=data)


def test_eight_bit_colour_orders_from_bytes_written_by_hand():
    """The round trips build their input through the same table they read it with: a swapped
    entry would pass them. Here each encoding's bytes are laid out by hand (sensor_msgs'
    image_encodings: bgr8 and OpenCV's 8UC3 are blue first, alpha last)."""
    red, green = (200, 10, 30), (5, 220, 40)   # RGB
    for encoding, order in (("rgb8", [0, 1, 2]), ("bgr8", [2, 1, 0]), ("8UC3", [2, 1, 0]),
                            ("rgba8", [0, 1, 2, 3]), ("bgra8", [2, 1, 0, 3]), ("8UC4", [2, 1, 0, 3])):
        row = [[(*pixel, 77)[i] for i in order] for pixel in (red, green)]
        out = image_to_rgb(_message(encoding, np.array(row, np.uint8)))
        np.testing.assert_array_equal(out[0], [red, green], err_msg=encoding)


@pytest.mark.parametrize("bigendian", [False, True])
def test_sixteen_bit_values_span_the_full_range(bigendian):
    # v -> round(v / 257): a 16-bit frame is never saturated to white, a mid grey stays mid grey.
    values = np.array([0, 0x0080, 0x1234, 0x8000, 0xFF00, 0xFFFF], np.uint16)
    grey = image_to_rgb(_message("mono16", values, bigendian))
    np.testing.assert_array_equal(grey[0, :, 0], [0, 0, 18, 128, 254, 255])
    assert (grey == grey[:, :, :1]).all()
    pixels = np.array([[0xFFFF, 0x8000, 0x0000], [0x1234, 0xFF00, 0x0101]], np.uint16)
    for encoding, order in (("rgb16", [0, 1, 2]), ("bgr16", [2, 1, 0]), ("16UC3", [2, 1, 0])):
        out = image_to_rgb(_message(encoding, pixels[:, order], bigendian))
        np.testing.assert_array_equal(out[0], [[255, 128, 0], [18, 254, 1]])
    with_alpha = np.array([[0xFFFF, 0x8000, 0x0000, 0x1111]], np.uint16)
    for encoding, order in (("rgba16", [0, 1, 2, 3]), ("bgra16", [2, 1, 0, 3]), ("16UC4", [2, 1, 0, 3])):
        out = image_to_rgb(_message(encoding, with_alpha[:, order], bigendian))
        np.testing.assert_array_equal(out[0], [[255, 128, 0]])


@pytest.mark.parametrize("encoding, dtype", [("32FC1", np.float32), ("64FC1", np.float64)])
@pytest.mark.parametrize("bigendian", [False, True])
def test_float_values_are_intensities_in_zero_to_one(encoding, dtype, bigendian):
    # OpenCV's convention for float pictures: 1.0 is white; out of range clipped, NaN black.
    values = np.array([0.0, 0.25, 0.5, 1.0, 2.0, -1.0, np.nan, np.inf, -np.inf], dtype)
    out = image_to_rgb(_message(encoding, values, bigendian))
    np.testing.assert_array_equal(out[0, :, 0], [0, 64, 128, 255, 255, 0, 0, 255, 0])
    colour = np.array([[0.0, 0.5, 1.0]], dtype)     # B, G, R in OpenCV's order
    np.testing.assert_array_equal(image_to_rgb(_message(encoding.replace("C1", "C3"), colour, bigendian))[0],
                                  [[255, 128, 0]])


def _frame_rgb():
    # 32 x 48 patches of 8 x 8, a fixed set of colours so that a failure reproduces.
    return image_frames.block_picture(seed=28)


def _max_error(out, rgb, mask=None):
    diff = np.abs(out.astype(int) - rgb.astype(int)).max(axis=2)
    return int(diff[mask].max() if mask is not None else diff.max())


@pytest.mark.parametrize("encoding", PACKED_YUV422)
@pytest.mark.parametrize("padding", [0, 6])
def test_packed_yuv422_decodes_to_known_colours(encoding, padding):
    rgb = _frame_rgb()
    msg = image_frames.as_message(image_frames.packed_yuv422(rgb, encoding, padding))
    out = image_to_rgb(msg)
    assert out.shape == rgb.shape and out.dtype == np.uint8
    assert _max_error(out, rgb) <= YUV_TOLERANCE
    # The byte order matters: the other 4:2:2 layout is far off, so the check above has teeth.
    msg.encoding = "yuyv" if encoding in ("uyvy", "yuv422") else "uyvy"
    assert _max_error(image_to_rgb(msg), rgb) > 40


@pytest.mark.parametrize("encoding", SEMI_PLANAR)
@pytest.mark.parametrize("padding", [0, 6])
def test_semi_planar_yuv_decodes_to_known_colours(encoding, padding):
    rgb = _frame_rgb()
    msg = image_frames.as_message(image_frames.semi_planar(rgb, encoding, padding))
    out = image_to_rgb(msg)
    assert out.shape == rgb.shape and out.dtype == np.uint8
    assert _max_error(out, rgb) <= YUV_TOLERANCE
    if encoding != "nv24":
        msg.encoding = "nv21" if encoding == "nv12" else "nv12"   # Cb and Cr swapped
        assert _max_error(image_to_rgb(msg), rgb) > 40


@pytest.mark.parametrize("pattern", BAYER_PATTERNS)
@pytest.mark.parametrize("bits, bigendian", [(8, False), (16, False), (16, True)])
@pytest.mark.parametrize("padding", [0, 5])
def test_bayer_mosaic_of_flat_patches_demosaics_to_their_colours(pattern, bits, bigendian, padding):
    # Bilinear demosaicing reads a pixel's 3x3 neighbourhood: one pixel inside a flat patch it
    # gives that patch's colour exactly. A pattern read as another would not (swapped R and B,
    # or G taken from R / B sites).
    rgb = _frame_rgb()
    frame = image_frames.bayer(rgb, pattern, bits, bigendian, padding)
    out = image_to_rgb(image_frames.as_message(frame))
    assert out.shape == rgb.shape and out.dtype == np.uint8
    inside = image_frames.patch_interiors(*rgb.shape[:2], margin=1)
    assert _max_error(out, rgb, inside) == 0
    for other in BAYER_PATTERNS:
        if other != pattern:
            wrong = image_to_rgb(image_frames.as_message({**frame, "encoding": f"bayer_{other}{bits}"}))
            assert _max_error(wrong, rgb, inside) > 40


@pytest.mark.parametrize("encoding, width, height, message", [
    ("uyvy", 53, 36, "width must be even"),
    ("yuv422_yuy2", 53, 36, "width must be even"),
    ("nv12", 48, 35, "width and height must be even"),
    ("nv21", 47, 36, "width and height must be even"),
])
def test_chroma_shared_by_pixel_pairs_needs_even_sizes(encoding, width, height, message):
    msg = Image(height=height, width=width, encoding=encoding, step=width * 2,
                data=bytes(width * 2 * height * 2))
    with pytest.raises(ValueError, match=message):
        image_to_rgb(msg)


@pytest.mark.parametrize("encoding, message", [
    ("nv12", r"fewer than step x 48 rows \(Y \+ CbCr/2\)"),
    ("nv21", r"fewer than step x 48 rows \(Y \+ CbCr/2\)"),
    ("nv24", r"fewer than step x 96 rows \(Y \+ CbCr x 2\)"),
    ("uyvy", "fewer than step x height"),
])
def test_truncated_yuv_frame_raises(encoding, message):
    rgb = _frame_rgb()
    build = image_frames.packed_yuv422 if encoding == "uyvy" else image_frames.semi_planar
    frame = build(rgb, encoding)
    frame["data"] = frame["data"][:-1]
    with pytest.raises(ValueError, match=message):
        image_to_rgb(image_frames.as_message(frame))


@pytest.mark.parametrize("encoding", ["8SC1", "16SC3", "32SC1", "8UC2", "yuv420", "bayer_rggb12", "RGB8", ""])
def test_unknown_encoding_is_a_clear_error(encoding):
    msg = Image(height=2, width=2, encoding=encoding, step=8, data=bytes(16))
    with pytest.raises(ValueError, match=f"unsupported image encoding '{encoding}'; supported: rgb8"):
        image_to_rgb(msg)


@pytest.mark.parametrize("encoding", ["uyvy", "nv12", "bayer_rggb8"])
def test_rgb_to_image_refuses_what_it_cannot_write(rgb, encoding):
    with pytest.raises(ValueError, match=f"cannot write encoding '{encoding}'"):
        rgb_to_image(rgb, encoding)


def test_unpadded_rgb8_is_a_view_of_the_message(rgb):
    msg = rgb_to_image(rgb, "rgb8")
    out = image_to_rgb(msg)
    assert np.shares_memory(out, np.frombuffer(msg.data, dtype=np.uint8))
    padded = image_to_rgb(rgb_to_image(rgb, "rgb8", row_padding=5))
    np.testing.assert_array_equal(padded, rgb)


@pytest.mark.parametrize("fmt", ["jpeg", "png"])
def test_compressed_round_trip(fmt):
    # A smooth picture: JPEG keeps it within a few levels.
    y, x = np.mgrid[0:48, 0:64]
    rgb = np.stack([x * 4, y * 5, (x + y) * 2], axis=2).astype(np.uint8)
    back = compressed_to_rgb(rgb_to_compressed(rgb, fmt))
    assert back.shape == rgb.shape
    tolerance = 0 if fmt == "png" else 12
    assert np.abs(back.astype(int) - rgb.astype(int)).max() <= tolerance


def test_image_transport_format_string_is_accepted(rgb):
    msg = rgb_to_compressed(rgb, "png")
    msg.format = "rgb8; png compressed bgr8"     # what compressed_image_transport writes for rgb8
    np.testing.assert_array_equal(compressed_to_rgb(msg), rgb)


@pytest.mark.parametrize("fmt, fed", [
    ("jpeg", "bgr"), ("png", "bgr"),                                  # this package's, and older publishers'
    ("rgb8; jpeg compressed bgr8", "bgr"), ("bgr8; png compressed bgr8", "bgr"),
    ("rgba8; png compressed bgra8", "bgra"), ("8UC3; png compressed ", "bgr"),  # not a colour encoding
    ("rgb8; png compressed rgb8", "rgb"), ("bgr8; jpeg compressed rgb8", "rgb"),
    ("rgba8; png compressed rgba8", "rgba"), ("rgb16; png compressed rgb16", "rgb16"),
])
def test_compressed_channel_order_is_the_one_the_format_names(fmt, fed):
    """A pure red picture, encoded from the channel order the format names (as
    compressed_image_transport's subscriber reads it): "compressed rgb8" was swapped to blue."""
    red = np.zeros((8, 8, 3), np.uint8)
    red[..., 0] = 255
    opaque = np.full((8, 8, 1), 255, np.uint8)
    pixels = {"bgr": red[..., ::-1], "rgb": red, "bgra": np.dstack([red[..., ::-1], opaque]),
              "rgba": np.dstack([red, opaque]), "rgb16": red.astype(np.uint16) * 257}[fed]
    ok, data = cv2.imencode(".jpg" if "jpeg" in fmt else ".png", np.ascontiguousarray(pixels))
    assert ok
    out = compressed_to_rgb(CompressedImage(format=fmt, data=data.tobytes()))
    assert np.abs(out.astype(int) - red).max() <= (8 if "jpeg" in fmt else 0), (fmt, out[0, 0])


@pytest.mark.parametrize("mutate, message", [
    (lambda m: setattr(m, "data", bytes(m.data)[: m.step * m.height - 1]), "fewer than step x height"),
    (lambda m: setattr(m, "encoding", "8SC3"), "unsupported image encoding '8SC3'"),
    (lambda m: setattr(m, "width", 0), "zero size"),
    (lambda m: setattr(m, "height", 0), "zero size"),
    (lambda m: setattr(m, "step", m.width * 3 - 1), "shorter than a row"),
    (lambda m: (setattr(m, "width", 100_000), setattr(m, "height", 100_000)), "too large"),
])
def test_malformed_image_raises(rgb, mutate, message):
    msg = rgb_to_image(rgb, "rgb8")
    mutate(msg)
    with pytest.raises(ValueError, match=message):
        image_to_rgb(msg)


@pytest.mark.parametrize("data, fmt, message", [
    (b"\xff\xd8\xff\xe0 this is not a jpeg at all", "jpeg", "corrupt compressed image"),
    (b"", "jpeg", "no data"),
    (b"GIF89a", "gif", "unsupported compressed image format"),
])
def test_malformed_compressed_raises(data, fmt, message):
    with pytest.raises(ValueError, match=message):
        compressed_to_rgb(CompressedImage(format=fmt, data=data))


def test_truncated_jpeg_raises_or_decodes_partially(rgb):
    # Truncation that destroys the header must be reported, never crash the caller.
    good = bytes(rgb_to_compressed(rgb, "jpeg").data)
    with pytest.raises(ValueError, match="corrupt compressed image"):
        compressed_to_rgb(CompressedImage(format="jpeg", data=good[:20]))


def test_huge_compressed_header_is_rejected_before_decoding():
    big = np.zeros((3000, 4000, 3), dtype=np.uint8)
    msg = rgb_to_compressed(big, "png")
    assert compressed_to_rgb(msg).shape == (3000, 4000, 3)   # 12 MP is fine
    with pytest.raises(ValueError, match="too large"):
        compressed_to_rgb(msg, max_pixels=1_000_000)


def _png(width: int, height: int) -> bytes:
    """A PNG whose header claims width x height (its data is a few bytes)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"\0" * 16)) + chunk(b"IEND", b""))


@pytest.mark.parametrize("side", [10_000, 20_000])
def test_decompression_bomb_header_is_a_clear_error(side):
    # 100 MP: past our limit; 400 MP: past Pillow's own, which raises its own error (not an
    # OSError) before the size is known. Both must be the ValueError the nodes log and survive.
    with pytest.raises(ValueError, match="too large"):
        compressed_to_rgb(CompressedImage(format="png", data=_png(side, side)))


def test_exif_orientation_is_not_applied():
    # The pixels as stored, as the camera frame and the size check see them (100 wide, 40 high).
    exif = PILImage.Exif()
    exif[0x0112] = 6    # "rotate 90 degrees to display"
    buf = io.BytesIO()
    PILImage.fromarray(np.zeros((40, 100, 3), np.uint8)).save(buf, "JPEG", exif=exif.tobytes())
    assert compressed_to_rgb(CompressedImage(format="jpeg", data=buf.getvalue())).shape == (40, 100, 3)


def test_bad_arrays_raise():
    with pytest.raises(ValueError, match="HxWx3 uint8"):
        rgb_to_image(np.zeros((4, 4), np.uint8))
    with pytest.raises(ValueError, match="HxWx3 uint8"):
        rgb_to_compressed(np.zeros((4, 4, 3), np.float32))


def _png16(channels):
    """A 16-bit PNG of a gradient over the whole 0..65535 range, and its values (RGB order)."""
    ramp = np.linspace(0, 65535, 24 * 40).round().astype(np.uint16).reshape(24, 40)
    values = np.dstack([ramp, ramp[::-1], ramp[:, ::-1]])[:, :, :channels]
    ok, png = cv2.imencode(".png", values[:, :, ::-1] if channels == 3 else values)
    assert ok
    return png.tobytes(), values


@pytest.mark.parametrize("channels", [1, 3])
def test_sixteen_bit_png_is_scaled_not_saturated(channels):
    data, values = _png16(channels)
    out = compressed_to_rgb(CompressedImage(format="png", data=data))
    expected = np.broadcast_to(values if channels == 3 else values[:, :, :1], out.shape)
    # OpenCV keeps each sample's top byte (v >> 8): within one level of round(v / 257).
    assert np.abs(out.astype(int) - np.round(expected / 257)).max() <= 1
    assert 100 < out.mean() < 155


def test_compressed_depth_is_refused_by_name():
    with pytest.raises(ValueError, match="is a depth map"):
        compressed_to_rgb(CompressedImage(format="16UC1; compressedDepth png", data=_png(4, 4)))


def test_decompression_bomb_error_names_the_limit():
    with pytest.raises(ValueError, match="the limit is 64000000 pixels"):
        compressed_to_rgb(CompressedImage(format="png", data=_png(20_000, 20_000)))
    with pytest.raises(ValueError, match="the limit is 1000 pixels"):
        compressed_to_rgb(CompressedImage(format="png", data=_png(100, 100)), max_pixels=1000)


def _exif_rotated_jpeg():
    exif = PILImage.Exif()
    exif[0x0112] = 6    # "rotate 90 degrees to display"
    buf = io.BytesIO()
    y, x = np.mgrid[0:40, 0:100]
    picture = np.stack([x * 2, y * 6, 255 - x * 2], axis=2).astype(np.uint8)
    PILImage.fromarray(picture).save(buf, "JPEG", exif=exif.tobytes(), quality=95)
    return buf.getvalue(), picture


def _old_opencv_cases():
    """(case, expected RGB or None for a clear error, tolerance against it, the pixels compared
    with it or None for all)."""
    rgb = _frame_rgb()
    y, x = np.mgrid[0:48, 0:64]
    smooth = np.stack([x * 4, y * 5, (x + y) * 2], axis=2).astype(np.uint8)
    cases = []

    def compressed(fmt, data, expected, tolerance):
        cases.append(({"kind": "compressed", "format": fmt, "data": data}, expected, tolerance, None))

    compressed("jpeg", bytes(rgb_to_compressed(smooth, "jpeg").data), smooth, 12)
    compressed("png", bytes(rgb_to_compressed(rgb, "png").data), rgb, 0)
    rgba = np.dstack([rgb, np.full(rgb.shape[:2], 77, np.uint8)])
    compressed("png", cv2.imencode(".png", cv2.cvtColor(rgba, cv2.COLOR_RGBA2BGRA))[1].tobytes(), rgb, 0)
    compressed("png", cv2.imencode(".png", gray_of(rgb)[:, :, 0])[1].tobytes(), gray_of(rgb), 0)
    for channels in (1, 3):
        data, values = _png16(channels)
        full = np.broadcast_to(values if channels == 3 else values[:, :, :1], values.shape[:2] + (3,))
        compressed("png", data, np.round(full / 257).astype(np.uint8), 1)
    jpeg, picture = _exif_rotated_jpeg()
    compressed("jpeg", jpeg, picture, 12)                       # stored orientation: 40 x 100
    compressed("jpeg", b"\xff\xd8\xff\xe0 not a jpeg", None, 0)  # the same clear error

    def raw(frame, expected, tolerance, inside=None):
        cases.append(({"kind": "raw", **frame}, expected, tolerance, inside))

    for encoding in WRITABLE_ENCODINGS:
        msg = rgb_to_image(rgb, encoding, row_padding=3, is_bigendian=encoding.endswith("16"))
        fields = {k: getattr(msg, k) for k in ("encoding", "height", "width", "step", "is_bigendian")}
        single = encoding.startswith("mono") or encoding.endswith("C1")
        raw({**fields, "data": bytes(msg.data)}, gray_of(rgb) if single else rgb, 0)
    for encoding in PACKED_YUV422:
        raw(image_frames.packed_yuv422(rgb, encoding, 4), rgb, YUV_TOLERANCE)
    for encoding in SEMI_PLANAR:
        raw(image_frames.semi_planar(rgb, encoding, 4), rgb, YUV_TOLERANCE)
    for pattern in BAYER_PATTERNS:
        for bits in (8, 16):
            raw(image_frames.bayer(rgb, pattern, bits, bits == 16, 3), rgb, 0,
                inside=image_frames.patch_interiors(*rgb.shape[:2], margin=1))
    return cases


def test_the_same_conversions_under_opencv_4_6():
    # Ubuntu's apt OpenCV (4.6, what ROS robots have) lacks IMREAD_COLOR_RGB and more: every
    # compressed and raw path runs there in a side install and must give the known pixels, and
    # exactly what it gives here (both bundle the same decoders' arithmetic; measured equal).
    try:
        side_opencv.side_install()
    except RuntimeError as err:
        pytest.skip(f"no OpenCV 4.6 side install (needs PyPI once): {err}")
    cases = _old_opencv_cases()
    run = side_opencv.decode_in_side_opencv([case for case, *_ in cases])
    assert run["cv2"].startswith("4.6."), run
    assert run["cv2_file"].startswith(str(side_opencv.SIDE_DIR)) and run["numpy"].startswith("1.")
    assert run["ros_imported"] == []
    assert cv2.__version__ != run["cv2"]
    for (case, expected, tolerance, inside), old in zip(cases, run["results"], strict=True):
        convert = compressed_to_rgb if case["kind"] == "compressed" else image_to_rgb
        fields = {k: v for k, v in case.items() if k != "kind"}
        msg = CompressedImage(**fields) if case["kind"] == "compressed" else Image(**fields)
        label = f"{case['kind']} {case.get('encoding', case.get('format'))}"
        if expected is None:
            with pytest.raises(ValueError) as err:
                convert(msg)
            assert old == ("error", str(err.value)), label
            continue
        here = convert(msg)
        assert old[0] == here.shape, label
        there = np.frombuffer(old[1], np.uint8).reshape(old[0])
        np.testing.assert_array_equal(there, here, err_msg=label)
        assert _max_error(here, expected, inside) <= tolerance, label


def test_data_longer_than_the_image_by_a_row_or_more_is_refused():
    """An rgba8 frame sent as rgb8 (step 3 x width): the extra bytes were cut off silently and the
    model answered on a garbled image. Trailing bytes short of a row (an allocator's) still pass."""
    rgba = np.full((4, 6, 4), 200, np.uint8)
    wrong = Image(height=4, width=6, encoding="rgb8", step=18, data=rgba.tobytes())
    with pytest.raises(ValueError, match="more than step x height"):
        image_to_rgb(wrong)
    padded = Image(height=4, width=6, encoding="rgb8", step=18, data=bytes(4 * 18 + 7))
    assert image_to_rgb(padded).shape == (4, 6, 3)


def test_boxes_and_points_are_drawn_on_the_pixels_they_cover():
    """A box to x_max 1.0 was drawn at column w, outside the image: its right and bottom sides
    were missing."""
    from photon_core.draw import draw_results
    rgb = np.zeros((100, 200, 3), np.uint8)
    out = draw_results(rgb, {"box": [{"x_min": 0.5, "y_min": 0.5, "x_max": 1.0, "y_max": 1.0}]},
                       {"pt": [{"x": 0.9999, "y": 0.0}]})
    painted = out.any(axis=2)
    assert painted[50:100, 199].sum() > 40 and painted[99, 100:200].sum() > 90   # right and bottom sides
    assert painted[:5, 195:200].any()                                            # the point, inside
