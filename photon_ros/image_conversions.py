"""sensor_msgs/Image and CompressedImage <-> RGB uint8 numpy arrays, no node needed.

The engine wants HxWx3 RGB uint8. An `rgb8` message without row padding becomes a view of the
message's buffer (no copy); other layouts are converted by numpy / OpenCV calls. cv_bridge's
`CvBridge` is the ecosystem's tool for this, but it cannot do it without a copy, and the PyPI
port used off-robot fails on numpy 2 (`ndarray.tostring`), so raw images take our own path. It
reads every encoding of sensor_msgs/image_encodings.hpp that is a picture, with the same OpenCV
conversions cv_bridge uses where cv_bridge has one:

- rgb/bgr/rgba/bgra/mono, 8 and 16 bit; OpenCV type names (8UC1/3/4, 16UC1/3/4, 32FC1/3/4,
  64FC1/3/4; 3 and 4 channels are BGR / BGRA, OpenCV's order);
- bayer_rggb/bggr/gbrg/grbg, 8 and 16 bit (bilinear demosaicing);
- packed YUV 4:2:2: uyvy (alias yuv422) and yuyv (alias yuv422_yuy2);
- semi-planar YUV: nv12, nv21 (4:2:0) and nv24 (4:4:4).

Scaling to 8 bits: 16-bit values span the full 0..65535 (as the encodings declare; cv_bridge
scales by 255/65535 too), so v -> round(v / 257). Float values are intensities in 0..1, OpenCV's
convention for float images (what cv2.imshow and image_view display), so v -> round(255 v),
clipped, NaN -> 0. A depth map (16UC1 millimetres, 32FC1 metres) is not a picture: it converts,
but only as that intensity reading. YUV is BT.601 with video range (Y 16..235), as in OpenCV's
and cv_bridge's conversions and as V4L2 cameras send it.

Nothing here imports ROS when the module loads: the conversions take any object with the
message's fields, so the same code runs (and is tested) under another OpenCV without rclpy.

Every malformed message raises ValueError naming the problem, so a node can log it and go on.
"""
from __future__ import annotations

import io
import struct
from typing import TYPE_CHECKING, NamedTuple

import cv2
import numpy as np

if TYPE_CHECKING:
    from sensor_msgs.msg import CompressedImage, Image

# A 12-megapixel camera frame must pass; a corrupt header claiming gigapixels must not.
DEFAULT_MAX_PIXELS = 64_000_000


class _Layout(NamedTuple):
    channels: int            # values per pixel in the message
    dtype: str               # one value, little-endian numpy type ("<u2"); byte order per message
    to_rgb: int | None       # cv2 colour conversion after scaling to 8 bits; None: already RGB


_LAYOUTS: dict[str, _Layout] = {}
for _bits, _dtype in (("8", "u1"), ("16", "<u2")):
    _LAYOUTS.update({
        f"rgb{_bits}": _Layout(3, _dtype, None),
        f"bgr{_bits}": _Layout(3, _dtype, cv2.COLOR_BGR2RGB),
        f"rgba{_bits}": _Layout(4, _dtype, cv2.COLOR_RGBA2RGB),
        f"bgra{_bits}": _Layout(4, _dtype, cv2.COLOR_BGRA2RGB),
        f"mono{_bits}": _Layout(1, _dtype, cv2.COLOR_GRAY2RGB),
        # OpenCV's BayerXY names go by the second row's pattern; these aliases (OpenCV 4.6
        # has them) go by the top-left 2x2 block, as ROS does.
        f"bayer_rggb{_bits}": _Layout(1, _dtype, cv2.COLOR_BayerRGGB2RGB),
        f"bayer_bggr{_bits}": _Layout(1, _dtype, cv2.COLOR_BayerBGGR2RGB),
        f"bayer_gbrg{_bits}": _Layout(1, _dtype, cv2.COLOR_BayerGBRG2RGB),
        f"bayer_grbg{_bits}": _Layout(1, _dtype, cv2.COLOR_BayerGRBG2RGB),
    })
for _name, _dtype in (("8U", "u1"), ("16U", "<u2"), ("32F", "<f4"), ("64F", "<f8")):
    _LAYOUTS.update({
        f"{_name}C1": _Layout(1, _dtype, cv2.COLOR_GRAY2RGB),
        f"{_name}C3": _Layout(3, _dtype, cv2.COLOR_BGR2RGB),
        f"{_name}C4": _Layout(4, _dtype, cv2.COLOR_BGRA2RGB),
    })

# Two pixels in four bytes, sharing their chroma.
_PACKED_YUV422 = {
    "uyvy": cv2.COLOR_YUV2RGB_UYVY, "yuv422": cv2.COLOR_YUV2RGB_UYVY,
    "yuyv": cv2.COLOR_YUV2RGB_YUY2, "yuv422_yuy2": cv2.COLOR_YUV2RGB_YUY2,
}
# A Y plane of `height` rows of `step` bytes, then an interleaved chroma plane (V4L2 layouts;
# `step` is the Y plane's, as camera_ros and depthai publish them).
_NV420 = {"nv12": cv2.COLOR_YUV2RGB_NV12, "nv21": cv2.COLOR_YUV2RGB_NV21}
_NV444 = ("nv24",)

# OpenCV has no NV24 conversion (4.6 nor 5.0): the BT.601 video-range matrix of its other YUV
# conversions, applied by cv2.transform (rounds and saturates to uint8). Columns: Y, U, V, 1.
_BT601_YUV_TO_RGB = np.array([
    [1.164, 0.000, 1.596, -1.164 * 16 - 1.596 * 128],
    [1.164, -0.391, -0.813, -1.164 * 16 + (0.391 + 0.813) * 128],
    [1.164, 2.018, 0.000, -1.164 * 16 - 2.018 * 128],
])

SUPPORTED_ENCODINGS = tuple(_LAYOUTS) + tuple(_PACKED_YUV422) + tuple(_NV420) + _NV444
# What rgb_to_image writes: the layouts that hold an RGB picture without loss (mono: its luma).
WRITABLE_ENCODINGS = tuple(name for name in _LAYOUTS if not name.startswith("bayer_"))
COMPRESSED_FORMATS = ("jpeg", "png")
# sensor_msgs' colour encodings (image_encodings' isColor): those whose compressed channel order
# compressed_image_transport names
_COLOUR_ENCODINGS = frozenset(f"{order}{bits}" for order in ("rgb", "bgr", "rgba", "bgra") for bits in (8, 16))


def _check_size(width: int, height: int, max_pixels: int) -> None:
    if width <= 0 or height <= 0:
        raise ValueError(f"image has zero size ({width}x{height})")
    if width * height > max_pixels:
        raise ValueError(f"image is too large ({width}x{height} = {width * height} pixels; "
                         f"the limit is {max_pixels} pixels)")


def image_to_rgb(msg: Image, max_pixels: int = DEFAULT_MAX_PIXELS) -> np.ndarray:
    """A sensor_msgs/Image as an HxWx3 uint8 RGB array (a view of the message for unpadded rgb8).

    Honours `step` (row padding) and, for 16-bit and float data, `is_bigendian`; the module's
    docstring says how each encoding is scaled to 8 bits."""
    encoding = msg.encoding
    width, height, step = int(msg.width), int(msg.height), int(msg.step)
    if encoding not in SUPPORTED_ENCODINGS:
        raise ValueError(f"unsupported image encoding {encoding!r}; "
                         f"supported: {', '.join(SUPPORTED_ENCODINGS)}")
    _check_size(width, height, max_pixels)
    buf = np.frombuffer(msg.data, dtype=np.uint8)
    if encoding in _PACKED_YUV422:
        _need_even(encoding, width=width)
        packed = _rows(buf, encoding, step, height, width * 2).reshape(height, width, 2)
        return cv2.cvtColor(packed, _PACKED_YUV422[encoding])
    if encoding in _NV420:
        _need_even(encoding, width=width, height=height)
        # OpenCV takes the two planes as one single-channel image of 3/2 the height.
        planes = _rows(buf, encoding, step, height * 3 // 2, width, planes="Y + CbCr/2")
        return cv2.cvtColor(planes, _NV420[encoding])
    if encoding in _NV444:
        return _nv24_to_rgb(buf, step, height, width)
    layout = _LAYOUTS[encoding]
    itemsize = np.dtype(layout.dtype).itemsize
    rows = _rows(buf, encoding, step, height, width * layout.channels * itemsize)
    if itemsize > 1:
        values = rows.view(layout.dtype.replace("<", ">") if msg.is_bigendian else layout.dtype)
        rows = _to_uint8(values)
    pixels = rows.reshape(height, width, layout.channels)
    if layout.to_rgb is None:
        return pixels
    if layout.channels == 1:
        pixels = pixels[:, :, 0]   # Bayer demosaicing wants a 2-D array
    return cv2.cvtColor(pixels, layout.to_rgb)


def _rows(buf: np.ndarray, encoding: str, step: int, rows: int, row_bytes: int,
          planes: str = "") -> np.ndarray:
    """The (rows, row_bytes) bytes of an image whose rows start `step` bytes apart."""
    if step < row_bytes:
        raise ValueError(f"image step {step} is shorter than a row of {encoding} "
                         f"pixels ({row_bytes} bytes)")
    what = f"step x {rows} rows ({planes})" if planes else "step x height"
    if buf.size < step * rows:
        raise ValueError(f"image data has {buf.size} bytes, fewer than {what} = "
                         f"{step} x {rows} = {step * rows}")
    if buf.size >= step * (rows + 1):
        # a row or more left over: another encoding or size than the message says (rgba8 sent
        # as rgb8), which read as declared is a garbled image the model would answer on
        raise ValueError(f"image data has {buf.size} bytes, more than {what} = {step} x {rows} = "
                         f"{step * rows} by a row or more: is the encoding ({encoding}) or the size right?")
    return buf[: step * rows].reshape(rows, step)[:, :row_bytes]


def _need_even(encoding: str, **sizes: int) -> None:
    odd = [f"{name} {value}" for name, value in sizes.items() if value % 2]
    if odd:
        raise ValueError(f"{encoding} shares chroma between neighbouring pixels: "
                         f"its {' and '.join(sizes)} must be even (got {', '.join(odd)})")


def _nv24_to_rgb(buf: np.ndarray, step: int, height: int, width: int) -> np.ndarray:
    # The chroma plane has two bytes (Cb, Cr) per pixel, so its rows are 2 x step apart.
    planes = _rows(buf, "nv24", step, height * 3, width, planes="Y + CbCr x 2")
    luma = planes[:height]
    chroma = buf[step * height: step * height * 3].reshape(height, 2 * step)[:, : 2 * width]
    yuv = np.dstack((luma, chroma.reshape(height, width, 2)))
    return cv2.transform(yuv, _BT601_YUV_TO_RGB)


def _to_uint8(values: np.ndarray) -> np.ndarray:
    """16-bit or float values as uint8, scaled as the module's docstring says."""
    if values.dtype.kind == "u":
        # convertScaleAbs rounds and saturates; v / 257 is never halfway between integers.
        # Rows an odd number of bytes apart (padding) are copied together first: OpenCV 5
        # misreads such an array and 4.6 refuses it.
        native = np.ascontiguousarray(values, dtype=np.uint16)
        return cv2.convertScaleAbs(native, alpha=255.0 / 65535.0).reshape(values.shape)
    finite = np.nan_to_num(values.astype(np.float32), nan=0.0, posinf=1.0, neginf=0.0)
    return (np.clip(finite, 0.0, 1.0) * 255.0 + 0.5).astype(np.uint8)


def compressed_to_rgb(msg: CompressedImage, max_pixels: int = DEFAULT_MAX_PIXELS) -> np.ndarray:
    """A sensor_msgs/CompressedImage (jpeg or png, as image_transport names them) as HxWx3 RGB.
    The channels are in the order the format says they were encoded in, as compressed_image_transport's
    subscriber reads it ("<encoding>; png compressed <order>"): with a colour encoding and no
    "compressed bgr..." they were RGB; otherwise (plain "jpeg"/"png" too) BGR, OpenCV's order."""
    fmt = msg.format.lower()
    if "compresseddepth" in fmt:
        raise ValueError(f"compressed image format {msg.format!r} is a depth map "
                         "(compressed_depth_image_transport), not a picture")
    if not any(name in fmt for name in ("jpeg", "jpg", "png")):
        raise ValueError(f"unsupported compressed image format {msg.format!r}; "
                         f"supported: {', '.join(COMPRESSED_FORMATS)}")
    decoded = _decode(msg.data, max_pixels, what=f"compressed image ({msg.format!r})")
    encoding, split, compressed = fmt.partition(";")
    if split and encoding.strip() in _COLOUR_ENCODINGS and "compressed bgr" not in compressed:
        return decoded    # fed to the encoder in RGB order: OpenCV hands that order back
    return cv2.cvtColor(decoded, cv2.COLOR_BGR2RGB)


def encoded_to_rgb(data: bytes | bytearray | np.ndarray, max_pixels: int = DEFAULT_MAX_PIXELS,
                   what: str = "compressed image") -> np.ndarray:
    """An encoded picture (a file's bytes: JPEG, PNG, or another format that both Pillow and
    OpenCV read) as HxWx3 RGB uint8: its size is read from the header by Pillow and checked
    before OpenCV decodes anything; 16-bit samples keep their 8 most significant bits (within
    one level of the raw path's v / 257); EXIF orientation is not applied."""
    return cv2.cvtColor(_decode(data, max_pixels, what), cv2.COLOR_BGR2RGB)


def _decode(data: bytes | bytearray | np.ndarray, max_pixels: int, what: str) -> np.ndarray:
    """encoded_to_rgb's picture in OpenCV's channel order (BGR for a picture encoded from BGR)."""
    array = np.frombuffer(data, dtype=np.uint8)
    if array.size == 0:
        raise ValueError(f"{what} has no data")
    width, height = _peek_size(array, max_pixels, what)
    _check_size(width, height, max_pixels)
    # IMREAD_COLOR (BGR, 8 bits) and IMREAD_IGNORE_ORIENTATION exist in OpenCV 4.6 (Ubuntu's
    # apt) as in 5.x; IMREAD_COLOR_RGB does not. Orientation stays as stored: the camera frame
    # (and its camera_info) is that one, and so is the size checked above.
    decoded = cv2.imdecode(array, cv2.IMREAD_COLOR | cv2.IMREAD_IGNORE_ORIENTATION)
    if decoded is None:
        raise ValueError(f"corrupt {what}, {array.size} bytes: OpenCV could not decode it")
    return decoded


def _peek_size(data: np.ndarray, max_pixels: int, what: str) -> tuple[int, int]:
    """Width and height from the file header, before decoding allocates anything."""
    from PIL import Image as PILImage, UnidentifiedImageError

    try:
        with PILImage.open(io.BytesIO(data.tobytes())) as im:
            return im.size
    except PILImage.DecompressionBombError as err:
        # Past ~179 MP Pillow refuses before we see the size (not an OSError).
        raise ValueError(f"{what} is too large ({err}); the limit is {max_pixels} pixels") from None
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError, struct.error) as err:
        raise ValueError(f"corrupt {what}, {data.size} bytes: {err}") from None


def rgb_to_image(rgb: np.ndarray, encoding: str = "rgb8", header=None, row_padding: int = 0,
                 is_bigendian: bool = False, max_pixels: int = DEFAULT_MAX_PIXELS) -> Image:
    """An HxWx3 uint8 RGB array as a sensor_msgs/Image in one of WRITABLE_ENCODINGS (mono and
    single-channel encodings get the luma). Wider values are v x 257 (16 bit) or v / 255
    (float), so image_to_rgb gives the array back. `row_padding` bytes are added after each
    row, as some drivers do."""
    from sensor_msgs.msg import Image

    layout = _LAYOUTS.get(encoding)
    if layout is None or encoding not in WRITABLE_ENCODINGS:
        raise ValueError(f"rgb_to_image cannot write encoding {encoding!r}; "
                         f"it writes: {', '.join(WRITABLE_ENCODINGS)}")
    rgb = _check_rgb(rgb, max_pixels)
    pixels = rgb
    if layout.channels == 1:
        pixels = cv2.cvtColor(rgb, cv2.COLOR_RGB2GRAY)
    elif layout.to_rgb is not None:
        back = {cv2.COLOR_BGR2RGB: cv2.COLOR_RGB2BGR, cv2.COLOR_RGBA2RGB: cv2.COLOR_RGB2RGBA,
                cv2.COLOR_BGRA2RGB: cv2.COLOR_RGB2BGRA}[layout.to_rgb]
        pixels = cv2.cvtColor(rgb, back)
    dtype = np.dtype(layout.dtype)
    if dtype.kind == "u" and dtype.itemsize == 2:
        pixels = pixels.astype(np.uint16) * 257
    elif dtype.kind == "f":
        pixels = pixels.astype(dtype) / 255.0
    if dtype.itemsize > 1:
        pixels = pixels.astype(dtype.newbyteorder(">" if is_bigendian else "<"))
    height, width = rgb.shape[:2]
    rows = np.ascontiguousarray(pixels).view(np.uint8).reshape(height, -1)
    if row_padding:
        rows = np.pad(rows, ((0, 0), (0, row_padding)), constant_values=0xAB)
    msg = Image()
    if header is not None:
        msg.header = header
    msg.height, msg.width = height, width
    msg.encoding = encoding
    msg.is_bigendian = bool(is_bigendian and dtype.itemsize > 1)
    msg.step = rows.shape[1]
    msg.data = rows.tobytes()
    return msg


def rgb_to_compressed(rgb: np.ndarray, fmt: str = "jpeg", quality: int = 90,
                      header=None) -> CompressedImage:
    """An HxWx3 uint8 RGB array as a sensor_msgs/CompressedImage (jpeg or png)."""
    from sensor_msgs.msg import CompressedImage

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


def _check_rgb(rgb: np.ndarray, max_pixels: int = DEFAULT_MAX_PIXELS) -> np.ndarray:
    if not isinstance(rgb, np.ndarray) or rgb.dtype != np.uint8 or rgb.ndim != 3 or rgb.shape[2] != 3:
        raise ValueError(f"expected an HxWx3 uint8 RGB array, got "
                         f"{getattr(rgb, 'shape', None)} {getattr(rgb, 'dtype', type(rgb).__name__)}")
    _check_size(rgb.shape[1], rgb.shape[0], max_pixels)
    return rgb
