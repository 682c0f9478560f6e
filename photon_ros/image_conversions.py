"""sensor_msgs/Image and CompressedImage <-> RGB uint8 numpy arrays, no node needed.

The engine wants HxWx3 RGB uint8. An `rgb8` message without row padding becomes a view of the
message's buffer (no copy); other layouts are copied once, by the one numpy or OpenCV call that
converts them. cv_bridge's `CvBridge` is the ecosystem's tool for this, but it cannot do it
without a copy, ignores row padding (`step`), and the PyPI port used off-robot fails on numpy 2
(`ndarray.tostring`), so raw images take our own path; it decodes compressed images the same way
OpenCV does, which is what we call.

Every malformed message raises ValueError naming the problem, so a node can log it and go on.
"""
from __future__ import annotations

import io
import struct
from typing import NamedTuple

import cv2
import numpy as np
from sensor_msgs.msg import CompressedImage, Image

# A 12-megapixel camera frame must pass; a corrupt header claiming gigapixels must not.
DEFAULT_MAX_PIXELS = 64_000_000


class _Layout(NamedTuple):
    channels: int
    itemsize: int            # bytes per channel value
    to_rgb: int | None       # cv2 colour conversion code; None when already RGB order


_LAYOUTS: dict[str, _Layout] = {
    "rgb8": _Layout(3, 1, None),
    "bgr8": _Layout(3, 1, cv2.COLOR_BGR2RGB),
    "rgba8": _Layout(4, 1, cv2.COLOR_RGBA2RGB),
    "bgra8": _Layout(4, 1, cv2.COLOR_BGRA2RGB),
    "mono8": _Layout(1, 1, cv2.COLOR_GRAY2RGB),
    "mono16": _Layout(1, 2, cv2.COLOR_GRAY2RGB),
    # OpenCV type names that drivers publish; 3-channel OpenCV images are BGR by convention.
    "8UC1": _Layout(1, 1, cv2.COLOR_GRAY2RGB),
    "8UC3": _Layout(3, 1, cv2.COLOR_BGR2RGB),
    "16UC1": _Layout(1, 2, cv2.COLOR_GRAY2RGB),
}

SUPPORTED_ENCODINGS = tuple(_LAYOUTS)
COMPRESSED_FORMATS = ("jpeg", "png")


def _check_size(width: int, height: int, max_pixels: int) -> None:
    if width <= 0 or height <= 0:
        raise ValueError(f"image has zero size ({width}x{height})")
    if width * height > max_pixels:
        raise ValueError(f"image is too large ({width}x{height} = {width * height} pixels; "
                         f"the limit is {max_pixels})")


def image_to_rgb(msg: Image, max_pixels: int = DEFAULT_MAX_PIXELS) -> np.ndarray:
    """A sensor_msgs/Image as an HxWx3 uint8 RGB array (a view of the message for unpadded rgb8).

    mono16 keeps its 8 most significant bits; `is_bigendian` is honoured for 16-bit data."""
    layout = _LAYOUTS.get(msg.encoding)
    if layout is None:
        raise ValueError(f"unsupported image encoding {msg.encoding!r}; "
                         f"supported: {', '.join(SUPPORTED_ENCODINGS)}")
    width, height, step = int(msg.width), int(msg.height), int(msg.step)
    _check_size(width, height, max_pixels)
    row_bytes = width * layout.channels * layout.itemsize
    if step < row_bytes:
        raise ValueError(f"image step {step} is shorter than a row of {width} {msg.encoding} "
                         f"pixels ({row_bytes} bytes)")
    buf = np.frombuffer(msg.data, dtype=np.uint8)
    if buf.size < step * height:
        raise ValueError(f"image data has {buf.size} bytes, fewer than step x height = "
                         f"{step} x {height} = {step * height}")
    rows = buf[: step * height].reshape(height, step)[:, :row_bytes]
    if layout.itemsize == 2:
        rows = rows.view(">u2" if msg.is_bigendian else "<u2")
        # Keep the top byte: the model sees 8-bit intensities.
        rows = (rows >> 8).astype(np.uint8)
    pixels = rows.reshape(height, width, layout.channels)
    if layout.to_rgb is None:
        return pixels
    return cv2.cvtColor(pixels, layout.to_rgb)


def compressed_to_rgb(msg: CompressedImage, max_pixels: int = DEFAULT_MAX_PIXELS) -> np.ndarray:
    """A sensor_msgs/CompressedImage (jpeg or png, as image_transport names them) as HxWx3 RGB."""
    fmt = msg.format.lower()
    if not any(name in fmt for name in ("jpeg", "jpg", "png")):
        raise ValueError(f"unsupported compressed image format {msg.format!r}; "
                         f"supported: {', '.join(COMPRESSED_FORMATS)}")
    data = np.frombuffer(msg.data, dtype=np.uint8)
    if data.size == 0:
        raise ValueError("compressed image has no data")
    width, height = _peek_size(data)
    _check_size(width, height, max_pixels)
    # The stored orientation: the camera frame (and its camera_info) is that one, and the size
    # checked above is too; OpenCV would otherwise apply an EXIF rotation.
    image = cv2.imdecode(data, cv2.IMREAD_COLOR_RGB | cv2.IMREAD_IGNORE_ORIENTATION)
    if image is None:
        raise ValueError(f"corrupt compressed image ({msg.format!r}, {data.size} bytes): "
                         "OpenCV could not decode it")
    return image


def _peek_size(data: np.ndarray) -> tuple[int, int]:
    """Width and height from the file header, before decoding allocates anything."""
    from PIL import Image as PILImage, UnidentifiedImageError

    try:
        with PILImage.open(io.BytesIO(data.tobytes())) as im:
            return im.size
    except PILImage.DecompressionBombError as err:
        # Past ~179 MP Pillow refuses before we see the size (not an OSError).
        raise ValueError(f"compressed image too large ({data.size} bytes): {err}") from None
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError, struct.error) as err:
        raise ValueError(f"corrupt compressed image ({data.size} bytes): {err}") from None


def rgb_to_image(rgb: np.ndarray, encoding: str = "rgb8", header=None, row_padding: int = 0,
                 is_bigendian: bool = False) -> Image:
    """An HxWx3 uint8 RGB array as a sensor_msgs/Image in `encoding` (mono encodings get the
    luma; mono16 scales it by 257 so the top byte is the 8-bit luma). `row_padding` bytes are
    added after each row, as some drivers do."""
    layout = _LAYOUTS.get(encoding)
    if layout is None:
        raise ValueError(f"unsupported image encoding {encoding!r}")
    rgb = _check_rgb(rgb)
    if encoding in ("rgb8",):
        pixels = rgb
    elif layout.channels == 1:
        pixels = cv2.cvtColor(rgb, cv2.COLOR_RGB2GRAY)
        if layout.itemsize == 2:
            pixels = (pixels.astype(np.uint16) * 257).astype(">u2" if is_bigendian else "<u2")
    else:
        back = {"bgr8": cv2.COLOR_RGB2BGR, "8UC3": cv2.COLOR_RGB2BGR,
                "rgba8": cv2.COLOR_RGB2RGBA, "bgra8": cv2.COLOR_RGB2BGRA}[encoding]
        pixels = cv2.cvtColor(rgb, back)
    height, width = rgb.shape[:2]
    rows = np.ascontiguousarray(pixels).view(np.uint8).reshape(height, -1)
    if row_padding:
        rows = np.pad(rows, ((0, 0), (0, row_padding)), constant_values=0xAB)
    msg = Image()
    if header is not None:
        msg.header = header
    msg.height, msg.width = height, width
    msg.encoding = encoding
    msg.is_bigendian = bool(is_bigendian and layout.itemsize > 1)
    msg.step = rows.shape[1]
    msg.data = rows.tobytes()
    return msg


def rgb_to_compressed(rgb: np.ndarray, fmt: str = "jpeg", quality: int = 90,
                      header=None) -> CompressedImage:
    """An HxWx3 uint8 RGB array as a sensor_msgs/CompressedImage (jpeg or png)."""
    if fmt not in COMPRESSED_FORMATS:
        raise ValueError(f"unsupported compressed format {fmt!r}; supported: {COMPRESSED_FORMATS}")
    bgr = cv2.cvtColor(_check_rgb(rgb), cv2.COLOR_RGB2BGR)
    params = [cv2.IMWRITE_JPEG_QUALITY, quality] if fmt == "jpeg" else []
    ok, encoded = cv2.imencode("." + ("jpg" if fmt == "jpeg" else "png"), bgr, params)
    if not ok:
        raise ValueError(f"OpenCV could not encode a {rgb.shape} image as {fmt}")
    msg = CompressedImage()
    if header is not None:
        msg.header = header
    msg.format = fmt
    msg.data = encoded.tobytes()
    return msg


def _check_rgb(rgb: np.ndarray) -> np.ndarray:
    if not isinstance(rgb, np.ndarray) or rgb.dtype != np.uint8 or rgb.ndim != 3 or rgb.shape[2] != 3:
        raise ValueError(f"expected an HxWx3 uint8 RGB array, got "
                         f"{getattr(rgb, 'shape', None)} {getattr(rgb, 'dtype', type(rgb).__name__)}")
    _check_size(rgb.shape[1], rgb.shape[0], DEFAULT_MAX_PIXELS)
    return rgb
