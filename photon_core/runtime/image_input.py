"""Images as users pass them -> the one form every vision family reads: [H, W, 3] uint8 RGB.

Accepted, the same way by every family's `encode_image(image, channel_order=...)` and skills:
- a PIL image of any mode: converted as PIL converts to RGB (palette, grey, CMYK, ...; alpha is
  dropped, not composited), except deep single-channel modes (16-bit, 32-bit integer, float),
  which are scaled to 8 bits: PIL's own conversion clips them, turning a 16-bit image white;
- a numpy array [H, W] (grey), [H, W, 1], [H, W, 3] or [H, W, 4] (alpha dropped) of dtype
  uint8 (as is), uint16 (scaled by 255 / 65535) or float16/32/64 holding values in [0, 1]
  (scaled by 255); scaled values are rounded to the nearest integer;
- channel_order "rgb" (default) or "bgr" (OpenCV, ROS bgr8/bgra8) for arrays; a PIL image is RGB.

Everything else is refused with a ValueError that says why: not an array or PIL image, another
dtype, another shape, an empty image, NaN or infinite values, float values outside [0, 1] (most
often 0..255 data in a float array), more than MAX_PIXELS pixels, an unknown channel_order.
"""
from __future__ import annotations

from typing import Union

import numpy as np
from PIL import Image

# PIL's own threshold for a suspected decompression bomb: 89 Mpixel, far above any camera frame
# (the models resize to well under 1 Mpixel anyway).
MAX_PIXELS = 89_478_485
CHANNEL_ORDERS = ("rgb", "bgr")

ImageLike = Union[np.ndarray, Image.Image]


def to_rgb(image: ImageLike, channel_order: str = "rgb") -> np.ndarray:
    """`image` as a C-contiguous [H, W, 3] uint8 RGB array; ValueError for anything else."""
    if channel_order not in CHANNEL_ORDERS:
        raise ValueError(f"channel_order must be 'rgb' or 'bgr', got {channel_order!r}")
    if isinstance(image, Image.Image):
        if channel_order != "rgb":
            raise ValueError("channel_order 'bgr' applies to numpy arrays only; PIL images are RGB")
        check_size(image.width, image.height)
        return pil_to_rgb(image)
    if not isinstance(image, np.ndarray):
        raise ValueError(f"image must be a numpy array ([H, W, 3] uint8 RGB) or a PIL image, "
                         f"got {type(image).__name__}")
    if image.ndim == 3 and image.shape[2] == 1:
        image = image[:, :, 0]
    if image.ndim not in (2, 3) or (image.ndim == 3 and image.shape[2] not in (3, 4)):
        raise ValueError(f"image must be [H, W] (grey), [H, W, 3] (RGB) or [H, W, 4] (RGBA), "
                         f"got shape {image.shape}")
    check_size(image.shape[1], image.shape[0])
    image = _to_uint8(image)
    if image.ndim == 2:
        return np.repeat(image[:, :, None], 3, axis=2)
    image = image[:, :, 2::-1] if channel_order == "bgr" else image[:, :, :3]
    return np.ascontiguousarray(image)


def pil_to_rgb(im: Image.Image) -> np.ndarray:
    """A PIL image (any mode) as [H, W, 3] uint8 RGB, deep single-channel modes scaled to 8 bits."""
    mode = im.mode
    if mode.startswith("I;16") or mode in ("I", "F"):
        # 16-bit PNG / TIFF ("I;16*"; older PIL and some TIFFs give "I" holding 16-bit values)
        # and float TIFF ("F", nominally 0..1).
        x = np.asarray(im).astype(np.float32)
        if mode == "F":
            x = np.nan_to_num(x, nan=0.0) * 255.0
        elif mode == "I" and x.size and x.max() > 65535:
            x = x / 16843009.0   # a genuine 32-bit integer image: (2**32 - 1) / 255
        else:
            x = x / 257.0        # 65535 / 255
        grey = np.clip(np.rint(x), 0, 255).astype(np.uint8)
        return np.repeat(grey[..., None], 3, axis=-1)
    # Every other mode (palette, grey, grey+alpha, CMYK, YCbCr, 16-bit RGB which PIL already
    # reduces to 8 bits per channel) converts to RGB without loss of scale.
    return np.asarray(im.convert("RGB"))


def check_size(width: int, height: int) -> None:
    """ValueError for an image of no pixels or over MAX_PIXELS (before its pixels are decoded)."""
    if width == 0 or height == 0:
        raise ValueError(f"image has zero size ({width}x{height})")
    if width * height > MAX_PIXELS:
        raise ValueError(f"image of {width}x{height} ({width * height / 1e6:.0f} Mpixel) is over the limit "
                         f"of {MAX_PIXELS / 1e6:.0f} Mpixel; scale it down")


def _to_uint8(image: np.ndarray) -> np.ndarray:
    if image.dtype == np.uint8:
        return image
    if image.dtype.kind == "u" and image.dtype.itemsize == 2:   # either byte order (ROS is_bigendian)
        image = image.astype(np.uint16)
    if image.dtype == np.uint16:
        return np.rint(image.astype(np.float32) / 257.0).astype(np.uint8)
    if not np.issubdtype(image.dtype, np.floating):
        raise ValueError(f"image dtype {image.dtype} is not accepted: give uint8 (0..255), uint16 (0..65535) "
                         f"or float (0..1)")
    x = image.astype(np.float32)
    if not np.isfinite(x).all():
        raise ValueError("image has NaN or infinite values")
    low, high = float(x.min()), float(x.max())
    if low < 0.0 or high > 1.0:
        raise ValueError(f"a float image must hold values in [0, 1], got {low:g}..{high:g}; give 0..255 data "
                         f"as uint8 (or divide it by 255)")
    return np.rint(x * 255.0).astype(np.uint8)
