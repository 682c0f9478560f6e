"""Image -> one global crop + overlapping local crops (uint8, RGB), the way Moondream was trained.

The local crops tile a resized copy of the image; neighbouring crops overlap by `overlap_margin`
patches on each side so that every kept patch had context (the margins are dropped again when the
features are stitched, see vision.py). Big frames are shrunk with one cv2.resize (INTER_AREA) to the
tiling's target size first, so a 12-megapixel frame costs a few milliseconds, not a slow path.
"""
from __future__ import annotations

import math

import cv2
import numpy as np

# Image input (any array / PIL image -> [H, W, 3] uint8 RGB) is runtime.image_input's; the name
# stays importable here for the tests written against it.
from photon_core.runtime.image_input import to_rgb as to_rgb_array  # noqa: F401


def select_tiling(height: int, width: int, crop_size: int, max_crops: int) -> tuple[int, int]:
    """(rows, cols) of local crops for an image of this size; the public reference's rule."""
    if height <= crop_size or width <= crop_size:
        return (1, 1)
    min_h, min_w = math.ceil(height / crop_size), math.ceil(width / crop_size)
    if min_h * min_w > max_crops:
        ratio = math.sqrt(max_crops / (min_h * min_w))
        return (max(1, math.floor(min_h * ratio)), max(1, math.floor(min_w * ratio)))
    # Tiles in proportion to the aspect ratio, at least the minimum, at most max_crops.
    h_tiles = max(math.floor(math.sqrt(max_crops * height / width)), min_h)
    w_tiles = max(math.floor(math.sqrt(max_crops * width / height)), min_w)
    if h_tiles * w_tiles > max_crops:
        if w_tiles > h_tiles:
            w_tiles = math.floor(max_crops / h_tiles)
        else:
            h_tiles = math.floor(max_crops / w_tiles)
    return (max(1, h_tiles), max(1, w_tiles))


def _resize(image: np.ndarray, height: int, width: int) -> np.ndarray:
    if image.shape[0] == height and image.shape[1] == width:
        return image
    # Shrinking: INTER_AREA averages the source pixels (no aliasing). Its exact-2x case is several
    # times faster than a general ratio, so big frames are first halved (dropping at most one odd
    # row/column) while both sides stay >= 2x the target, then resized once.
    while image.shape[0] >= 2 * height and image.shape[1] >= 2 * width:
        h, w = image.shape[0] // 2, image.shape[1] // 2
        image = cv2.resize(image[:2 * h, :2 * w], (w, h), interpolation=cv2.INTER_AREA)
    shrink = height <= image.shape[0] and width <= image.shape[1]
    return cv2.resize(image, (width, height), interpolation=cv2.INTER_AREA if shrink else cv2.INTER_CUBIC)


def make_crops(image: np.ndarray, crop_size: int = 378, patch_size: int = 14, overlap_margin: int = 4,
               max_crops: int = 12) -> tuple[np.ndarray, tuple[int, int]]:
    """HxWx3 uint8 RGB -> (crops [1 + rows*cols, crop, crop, 3] uint8, (rows, cols)).

    crops[0] is the whole image squashed to crop x crop; crops[1:] are the local crops in row-major order.
    """
    h, w = image.shape[:2]
    margin = patch_size * overlap_margin
    window = crop_size - 2 * margin  # the part of each local crop that is kept after stitching
    rows, cols = select_tiling(h - 2 * margin, w - 2 * margin, window, max_crops)
    target_h, target_w = rows * window + 2 * margin, cols * window + 2 * margin

    crops = np.empty((1 + rows * cols, crop_size, crop_size, 3), dtype=np.uint8)
    resized = _resize(image, target_h, target_w)
    # The global view comes from the already-reduced copy: same picture, a fraction of the pixels.
    crops[0] = _resize(resized, crop_size, crop_size)
    for i in range(rows):
        for j in range(cols):
            y0, x0 = i * window, j * window
            crops[1 + i * cols + j] = resized[y0:y0 + crop_size, x0:x0 + crop_size]
    return crops, (rows, cols)
