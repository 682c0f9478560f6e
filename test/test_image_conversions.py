"""Image messages <-> RGB arrays: every encoding round-trips, padded rows and both byte orders
work, and each malformed message raises a ValueError that names the problem."""
import io
import struct
import zlib

import cv2
import numpy as np
import pytest
from PIL import Image as PILImage
from sensor_msgs.msg import CompressedImage, Image

from photon_ros.image_conversions import (SUPPORTED_ENCODINGS, compressed_to_rgb, image_to_rgb,
                                          rgb_to_compressed, rgb_to_image)


@pytest.fixture
def rgb():
    # Fresh random content each run, odd sizes so rows are not aligned.
    rng = np.random.default_rng()
    return rng.integers(0, 256, size=(37, 53, 3), dtype=np.uint8)


def gray_of(rgb):
    luma = cv2.cvtColor(rgb, cv2.COLOR_RGB2GRAY)
    return np.repeat(luma[:, :, None], 3, axis=2)


@pytest.mark.parametrize("encoding", SUPPORTED_ENCODINGS)
@pytest.mark.parametrize("padding", [0, 7])
@pytest.mark.parametrize("bigendian", [False, True])
def test_round_trip(rgb, encoding, padding, bigendian):
    msg = rgb_to_image(rgb, encoding, row_padding=padding, is_bigendian=bigendian)
    assert msg.step >= msg.width and len(msg.data) == msg.step * msg.height
    back = image_to_rgb(msg)
    assert back.shape == rgb.shape and back.dtype == np.uint8
    expected = gray_of(rgb) if encoding in ("mono8", "mono16", "8UC1", "16UC1") else rgb
    np.testing.assert_array_equal(back, expected)


def test_mono16_byte_order_is_honoured():
    values = np.array([[0x1234, 0xFF00]], dtype=np.uint16)
    for order, big in (("<u2", False), (">u2", True)):
        msg = Image(height=1, width=2, encoding="mono16", is_bigendian=big, step=4,
                    data=values.astype(order).tobytes())
        np.testing.assert_array_equal(image_to_rgb(msg)[0, :, 0], [0x12, 0xFF])


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
    msg.format = "rgb8; png compressed rgb8"
    np.testing.assert_array_equal(compressed_to_rgb(msg), rgb)


@pytest.mark.parametrize("mutate, message", [
    (lambda m: setattr(m, "data", bytes(m.data)[: m.step * m.height - 1]), "fewer than step x height"),
    (lambda m: setattr(m, "encoding", "yuv422"), "unsupported image encoding 'yuv422'"),
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
