"""Image files in and out for the command line: any format PIL reads, as 8-bit RGB.

Sizes are checked from the header, before a pixel is decoded (a small file can declare a huge
image); the pixels then become RGB as runtime.image_input converts any PIL image (deep images
scaled to 8 bits rather than clipped).
"""
from __future__ import annotations

import re
import warnings
from pathlib import Path

import numpy as np

# The limit on pixels an image may have (PIL's decompression-bomb threshold; it errors at twice this).
from photon_core.runtime.image_input import MAX_PIXELS, is_deep, key_alpha, pil_to_rgb


class ImageFileError(ValueError):
    """An image file that cannot be read or written as asked; the message names the file."""


def read_image(path: str | Path, max_pixels: int = MAX_PIXELS, keep_alpha: bool = False) -> np.ndarray:
    """The image at `path` as an [H, W, 3] uint8 RGB array. 16-bit images are scaled by
    255/65535, float images from [0, 1] (clipped there), alpha is dropped; with `keep_alpha` an
    image with transparency comes as [H, W, 4] RGBA, for the model to drop or composite as its
    family does (runtime.image_input.to_rgb's alpha). ImageFileError for a
    missing, unreadable or larger-than-`max_pixels` file, before the pixels are decoded. The stored
    pixel grid, EXIF orientation not applied (as PIL opens it, and as the moondream client passes
    a PIL image): coordinates are of the grid, as a camera's are."""
    from PIL import Image

    path = Path(path)
    if path.is_dir():
        raise ImageFileError(f"{path}: is a directory, not an image file")
    if not path.exists():
        raise ImageFileError(f"{path}: no such file")
    try:
        with warnings.catch_warnings():
            # Sizes are refused below, with the limit; PIL's warning for them would only repeat it.
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(path) as im:
                _check_size(path, im.size, max_pixels)
                if keep_alpha and ("A" in im.getbands() or im.info.get("transparency") is not None):
                    return _rgba(im)
                return pil_to_rgb(im)
    except Image.DecompressionBombError as err:
        # PIL refuses on its own at twice its threshold, in open(), before we see the size.
        found = re.search(r"\((\d+) pixels\)", str(err))
        raise _too_large(path, f"{int(found.group(1)) / 1e6:.0f} Mpixel" if found else "too large",
                         max_pixels) from None
    except (OSError, ValueError, SyntaxError) as err:
        if isinstance(err, ImageFileError):
            raise
        raise ImageFileError(f"{path}: cannot read it as an image ({err})") from None


def _rgba(im) -> np.ndarray:
    """[H, W, 4] uint8 of an image with transparency. Deep single-channel images (16-bit, 32-bit,
    float: their transparency is a key value, as a 16-bit PNG's tRNS) are scaled as pil_to_rgb
    scales them, the key's pixels transparent: PIL's own convert("RGBA") clips them to 8 bits (a
    16-bit depth or IR frame came out all white) and keeps every pixel opaque."""
    if is_deep(im.mode):
        return np.dstack([pil_to_rgb(im), key_alpha(im)])
    return np.asarray(im.convert("RGBA"))


def _check_size(path: Path, size: tuple[int, int], max_pixels: int) -> None:
    width, height = size
    if width * height > max_pixels:
        raise _too_large(path, f"{width}x{height}, {width * height / 1e6:.0f} Mpixel", max_pixels)
    if width == 0 or height == 0:
        raise ImageFileError(f"{path}: an empty image ({width}x{height})")


def _too_large(path: Path, size: str, max_pixels: int) -> ImageFileError:
    return ImageFileError(f"{path}: {size}, over the limit of {max_pixels / 1e6:.0f} Mpixel: "
                          f"refused before decoding (scale it down)")


def check_writable_image(path: str | Path) -> Path:
    """`path` if an image can be written there (a format OpenCV writes, by its extension, in a
    folder that exists); ImageFileError saying what is wrong, so it is refused before any work."""
    import cv2

    path = Path(path)
    if path.is_dir():
        raise ImageFileError(f"{path}: is a directory; give a file name such as out.png")
    if not path.suffix or not cv2.haveImageWriter(str(path)):
        raise ImageFileError(f"{path}: cannot write an image with extension {path.suffix or '(none)'!r}; "
                             f"use .png or .jpg")
    if not path.parent.is_dir():
        raise ImageFileError(f"{path}: the folder {path.parent} does not exist")
    return path
