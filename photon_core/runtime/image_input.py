"""Images as users pass them -> the one form every vision family reads: [H, W, 3] uint8 RGB.

Accepted, the same way by every family's `encode_image(image, channel_order=...)` and skills:
- a PIL image of any mode: converted as PIL converts to RGB (palette, grey, CMYK, ...), except
  deep single-channel modes, which are scaled to 8 bits (PIL's own conversion clips them, turning
  a 16-bit image white): "I;16*" by 255 / 65535; "I" as 16-bit data too (a 16-bit PGM, a signed
  16-bit TIFF, Image.fromarray of an int32 array), unless its decoder says 32 bits (a 32-bit TIFF,
  FITS or McIdas file) or a value is past 65535 (a copy or crop of one): by 255 / (2**32 - 1);
  values outside the range clipped; 8-bit data in mode I (convert("I") of an L image) cannot be told from dark 16-bit data:
  give it as L (convert("L")) or as a uint8 array; "F" (float TIFF) in [0, 1], overshoot (HDR
  highlights) clipped, or on PIL's 0..255 scale (convert("F")) where over half its pixels exceed
  F_NOMINAL_MAX or all are whole numbers, some above 1; NaN or infinite refused;
- a numpy array [H, W] (grey), [H, W, 1], [H, W, 3] or [H, W, 4] of dtype uint8 (as is), uint16
  (scaled by 255 / 65535) or float16/32/64 holding values in [0, 1] (scaled by 255); scaled
  values are rounded to the nearest integer;
- transparency (RGBA, LA, a palette's transparent colour, a deep image's transparent key as a
  16-bit PNG's, an array's 4th channel): dropped by default (`alpha="drop"`, as the Moondream
  reference's convert("RGB")), or composited onto white (`alpha="white"`, as transformers'
  convert_to_rgb does for Gemma 4 and Qwen 3.5);
- channel_order "rgb" (default) or "bgr" (OpenCV, ROS bgr8/bgra8) for arrays; a PIL image is RGB.

Everything else is refused with a ValueError that says why: not an array or PIL image, another
dtype, another shape, an empty image, NaN or infinite values, float values outside [0, 1] (most
often 0..255 data in a float array), more than MAX_PIXELS pixels, an unknown channel_order, a PIL
image whose lazily read file turns out truncated or corrupt, or was closed before it was read.
"""
from __future__ import annotations

from typing import Union

import numpy as np
from PIL import Image, ImageFile

# PIL's own threshold for a suspected decompression bomb: 89 Mpixel, far above any camera frame
# (the models resize to well under 1 Mpixel anyway).
MAX_PIXELS = 89_478_485
CHANNEL_ORDERS = ("rgb", "bgr")
ALPHAS = ("drop", "white")
F_NOMINAL_MAX = 2.0   # an "F" image mostly above this is on PIL's 0..255 scale, not 0..1 with overshoot

ImageLike = Union[np.ndarray, Image.Image]


def to_rgb(image: ImageLike, channel_order: str = "rgb", alpha: str = "drop") -> np.ndarray:
    """`image` as a C-contiguous [H, W, 3] uint8 RGB array; ValueError for anything else."""
    if channel_order not in CHANNEL_ORDERS:
        raise ValueError(f"channel_order must be 'rgb' or 'bgr', got {channel_order!r}")
    if alpha not in ALPHAS:
        raise ValueError(f"alpha must be 'drop' or 'white', got {alpha!r}")
    if isinstance(image, Image.Image):
        if channel_order != "rgb":
            raise ValueError("channel_order 'bgr' applies to numpy arrays only; PIL images are RGB")
        check_size(image.width, image.height)
        check_open(image)
        try:
            return pil_to_rgb(image, alpha)
        except (OSError, SyntaxError) as err:   # a lazily opened file read only now (PIL's errors)
            raise ValueError(f"the image could not be read: {err}") from None
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
    rgb = image[:, :, 2::-1] if channel_order == "bgr" else image[:, :, :3]
    if alpha == "white" and image.shape[2] == 4:
        a = image[:, :, 3:] / 255.0   # float64 and rounded half to even, as transformers blends
        rgb = np.rint(rgb * a + 255.0 * (1.0 - a)).astype(np.uint8)
    return np.ascontiguousarray(rgb)


def pil_to_rgb(im: Image.Image, alpha: str = "drop") -> np.ndarray:
    """A PIL image (any mode) as [H, W, 3] uint8 RGB, deep single-channel modes scaled to 8 bits,
    transparency dropped or composited onto white (`alpha`)."""
    if is_deep(im.mode):
        grey = _deep_to_uint8(im)
        if alpha == "white":
            grey[key_alpha(im) == 0] = 255   # as to_rgb composites an array's alpha of 0
        return np.repeat(grey[..., None], 3, axis=-1)
    if alpha == "white" and ("A" in im.getbands() or im.info.get("transparency") is not None):
        # as transformers' convert_to_rgb: over a white RGBA background, then RGB
        rgba = im.convert("RGBA")
        return np.asarray(Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255)), rgba).convert("RGB"))
    # Every other mode (palette, grey, grey+alpha, CMYK, YCbCr, 16-bit RGB which PIL already
    # reduces to 8 bits per channel) converts to RGB without loss of scale.
    return np.asarray(im.convert("RGB"))


def is_deep(mode: str) -> bool:
    """Whether a PIL mode is one of the deep single-channel ones pil_to_rgb scales itself."""
    return mode in ("I", "F") or mode.startswith("I;16")


def key_alpha(im: Image.Image) -> np.ndarray:
    """[H, W] uint8 alpha of a deep single-channel image: 0 where a pixel holds its transparency
    key (a 16-bit PNG's tRNS), 255 elsewhere. PIL's convert("RGBA") would keep every pixel opaque."""
    alpha = np.full((im.height, im.width), 255, np.uint8)
    key = im.info.get("transparency")
    if isinstance(key, (int, float)):
        alpha[np.asarray(im) == key] = 0
    return alpha


def _deep_to_uint8(im: Image.Image) -> np.ndarray:
    x = np.asarray(im).astype(np.float64)
    if im.mode == "F":
        if not np.isfinite(x).all():
            raise ValueError("image has NaN or infinite values")
        # Float TIFFs hold 0..1 nominally, HDR highlights above; PIL's own float images
        # (convert("F") of an 8-bit one) hold 0..255. The max told them apart: one highlight past
        # F_NOMINAL_MAX blacked out a whole HDR image. The median does not move with a few
        # pixels: half an HDR image is over twice its white only when it is mostly blown out,
        # half a 0..255 image under 2/255 only in a near-black frame, which convert("F") still
        # gives as whole numbers (a real float image past 1 practically never is).
        on_255 = x.size > 0 and (float(np.median(x)) > F_NOMINAL_MAX
                                 or (float(x.max()) > 1.0 and bool((x == np.rint(x)).all())))
        return np.clip(np.rint(x if on_255 else x * 255.0), 0, 255).astype(np.uint8)
    # Mode I carries no bit depth in memory, and reading it from the values (up to 255 as 8-bit)
    # made one pixel switch a dark 16-bit frame's scale by 257x. Decoders give I for 16-bit data
    # (PGM, signed 16-bit TIFF) or 32-bit (TIFF says so; FITS and McIdas are always 32); 8-bit
    # files open as L, so 8-bit data in I was put there by hand and can be given as L instead.
    bits = 16
    if im.mode == "I" and im.format == "TIFF":
        bits = int(getattr(im, "tag_v2", {}).get(258, (16,))[0])   # BitsPerSample (TiffImageFile's)
    elif im.mode == "I" and im.format in ("FITS", "MCIDAS"):
        bits = 32
    if x.size and float(x.max()) > 65535:
        bits = 32   # no 16-bit value is: a 32-bit image whose file is gone (.copy(), .crop())
    return np.clip(np.rint(x * (255.0 / (2.0 ** bits - 1))), 0, 255).astype(np.uint8)


def check_size(width: int, height: int) -> None:
    """ValueError for an image of no pixels or over MAX_PIXELS (before its pixels are decoded)."""
    if width == 0 or height == 0:
        raise ValueError(f"image has zero size ({width}x{height})")
    if width * height > MAX_PIXELS:
        raise ValueError(f"image of {width}x{height} ({width * height / 1e6:.0f} Mpixel) is over the limit "
                         f"of {MAX_PIXELS / 1e6:.0f} Mpixel; scale it down")


def check_open(image: Image.Image) -> None:
    """ValueError for a lazily opened PIL image whose file was closed before its pixels were read
    (`with Image.open(path) as im:`, `im` used after the block): PIL fails there with a bare
    AssertionError, no message at all."""
    if isinstance(image, ImageFile.ImageFile) and image.tile and image.fp is None:
        raise ValueError("the PIL image's file was closed before its pixels were read (Image.open reads "
                         "them lazily): call image.load() or image.copy() while the file is open")


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
    # NaN and infinity looked for in the image's own dtype: a finite float64 beyond float32's range
    # becomes inf in the cast, and was refused as "NaN or infinite" rather than as out of range
    if not np.isfinite(image).all():
        raise ValueError("image has NaN or infinite values")
    with np.errstate(over="ignore"):
        x = image.astype(np.float32)
    if float(x.min()) < 0.0 or float(x.max()) > 1.0:
        low, high = float(image.min()), float(image.max())   # as given, not as cast
        raise ValueError(f"a float image must hold values in [0, 1], got {low:g}..{high:g}; give 0..255 data "
                         f"as uint8 (or divide it by 255)")
    return np.rint(x * 255.0).astype(np.uint8)
