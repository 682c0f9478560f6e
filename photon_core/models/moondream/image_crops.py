"""Image -> one global crop + overlapping local crops (uint8, RGB), as Moondream's makers make them.

The local crops tile a resized copy of the image; neighbouring crops overlap by `overlap_margin`
patches on each side so that every kept patch had context (the margins are dropped again when the
features are stitched, see vision.py).

Why the pipeline is what it is. The encoder was trained on crops made one way, and the decoder
amplifies small input differences: with crops from another resampler (cv2 INTER_AREA/INTER_CUBIC,
the global crop taken from the resized copy) a Moondream 2 checkpoint's logits were ~4e-3 off the
public reference's and a greedy caption took another word after a dozen tokens (issue 41). So:

- Both resizes start from the ORIGINAL image, each with Lanczos-3: the canvas the local crops tile
  (`target_size`) and the global crop (crop_size x crop_size). The public reference (vikhyat/moondream
  moondream/torch/image_crops.py) does this with PIL `Image.resize(..., LANCZOS)` when pyvips is not
  installed; `resampler="pil"` gives PIL's output byte for byte (Moondream 2). pyvips is not used
  even where installed: its resize does not give PIL's bytes (libvips 8.18, measured: up to 5-25
  levels apart shrinking, and nearly every pixel, up to ~200 levels, enlarging), and crops should not
  depend on what else happens to be installed.
- Moondream 3 follows the makers' engine (m87-labs/kestrel, kestrel/models/moondream/image_crops.py):
  the same two resizes from the original, Lanczos-3. kestrel runs them with its own native resize
  (PyPI kestrel-native), which is not used here: its wheel names no licence. So Moondream 3's crops
  are PIL's Lanczos-3 too: kestrel's filter on the same image, not its exact bytes (kestrel-native
  0.1.9, measured on pictures: a mean 0.1-0.3 levels apart, at most 2-16; 1-3 levels on average for
  a 5x shrink, a 1920x1080 frame's global crop; up to ~46 on pure noise).
- Lanczos-3 costs more than the cv2 path did (bench/RESULTS.md, "Moondream crops": on 2 EPYC cores
  640x480 14 ms instead of 2, 1920x1080 25 ms instead of 5). So the two resizes of a frame run on two
  threads (PIL lets go of the GIL while it resizes), and the model lets a caller make the crops
  ahead, off the batch's critical path: MoondreamModel.prepare in a camera's own thread, the Crops
  then given to any skill as its image.
- On a GPU the two resizes run there (runtime/lanczos.py: PIL's arithmetic as torch ops, the same
  bytes, in well under a millisecond), so a frame's crops cost the host nothing but the upload.
- Normalisation to [-1, 1] is vision.normalize's: through bfloat16 for Moondream 2, as the reference's
  prepare_crops; in the model's dtype for Moondream 3, as kestrel's.
"""
from __future__ import annotations

import math
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from PIL import Image

# Image input (any array / PIL image -> [H, W, 3] uint8 RGB) is runtime.image_input's; the name
# stays importable here for the tests written against it.
from photon_core.runtime.image_input import to_rgb as to_rgb_array  # noqa: F401

RESAMPLERS = ("pil",)
# Below this many source pixels the second thread costs about what it saves.
_PARALLEL_MIN_PIXELS = 200_000
_pool: ThreadPoolExecutor | None = None


@dataclass(frozen=True)
class Crops:
    """An image made into the encoder's crops ahead of a request (MoondreamModel.prepare): any
    skill takes it as its image and skips the resizing. `resampler`, `crop_size`, `patch_size`,
    `overlap_margin` and `max_crops`: how it was made, checked against the model that reads it."""
    crops: np.ndarray | torch.Tensor   # [1 + rows*cols, crop, crop, 3] uint8, crops[0] the global one
    tiling: tuple[int, int]        # (rows, cols)
    resampler: str
    crop_size: int
    patch_size: int
    overlap_margin: int
    max_crops: int


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


def target_size(height: int, width: int, crop_size: int = 378, patch_size: int = 14, overlap_margin: int = 4,
                max_crops: int = 12) -> tuple[tuple[int, int], tuple[int, int]]:
    """((rows, cols), (canvas height, canvas width)): the tiling of an image of this size and the size
    the image is resized to for its local crops (rows x cols kept windows plus one margin each side)."""
    margin = patch_size * overlap_margin
    window = crop_size - 2 * margin  # the part of each local crop that is kept after stitching
    rows, cols = select_tiling(height - 2 * margin, width - 2 * margin, window, max_crops)
    return (rows, cols), (rows * window + 2 * margin, cols * window + 2 * margin)


def resize_lanczos3(image: np.ndarray, height: int, width: int, resampler: str = "pil") -> np.ndarray:
    """[H, W, 3] uint8 RGB -> [height, width, 3] uint8 with Lanczos-3: PIL's `Image.resize(..., LANCZOS)`
    ("pil", the one resampler: the module docstring says why)."""
    if resampler not in RESAMPLERS:
        raise ValueError(f"resampler must be one of {RESAMPLERS}, not {resampler!r}")
    image = np.ascontiguousarray(image)
    if image.shape[:2] == (height, width):
        return image   # PIL returns such an image unchanged
    return np.asarray(Image.fromarray(image).resize((width, height), Image.Resampling.LANCZOS))


def _in_background(fn: Any, *args: Any) -> Future:
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="moondream-crops")
    return _pool.submit(fn, *args)


def make_crops(image: np.ndarray, crop_size: int = 378, patch_size: int = 14, overlap_margin: int = 4,
               max_crops: int = 12, resampler: str = "pil", device: torch.device | str | None = None
               ) -> tuple[np.ndarray | torch.Tensor, tuple[int, int]]:
    """HxWx3 uint8 RGB -> (crops [1 + rows*cols, crop, crop, 3] uint8, (rows, cols)).

    crops[0] is the whole image resized to crop x crop; crops[1:] are the local crops in row-major
    order, cut from the image resized to target_size. Both resizes start from `image` (see the
    module docstring for why, and for `resampler`). `device`: resize there with PIL's arithmetic
    (runtime/lanczos.py; the crops a tensor on it), None: with PIL on this CPU."""
    h, w = image.shape[:2]
    (rows, cols), (target_h, target_w) = target_size(h, w, crop_size, patch_size, overlap_margin, max_crops)
    window = crop_size - 2 * patch_size * overlap_margin
    resize = _pil_resizes if device is None else _device_resizes(torch.device(device))
    canvas, whole = resize(image, (target_h, target_w), (crop_size, crop_size), resampler)
    tiles = [canvas[i * window:i * window + crop_size, j * window:j * window + crop_size]
             for i in range(rows) for j in range(cols)]
    stack: Any = np.stack if device is None else torch.stack
    return stack([whole, *tiles]), (rows, cols)


def _pil_resizes(image: np.ndarray, canvas: tuple[int, int], whole: tuple[int, int], resampler: str
                 ) -> tuple[np.ndarray, np.ndarray]:
    """The canvas and the global crop by PIL, on two threads for a large image."""
    if image.shape[0] * image.shape[1] >= _PARALLEL_MIN_PIXELS:
        pending = _in_background(resize_lanczos3, image, *whole, resampler)
        return resize_lanczos3(image, *canvas, resampler), pending.result()
    return resize_lanczos3(image, *canvas, resampler), resize_lanczos3(image, *whole, resampler)


def _device_resizes(device: torch.device) -> Any:
    """_pil_resizes' bytes on `device` (runtime/lanczos.py); a size pair whose pass order the
    installed Pillow does not show (lanczos.pil_order None) is resized by PIL and uploaded."""
    from photon_core.runtime import lanczos

    def resizes(image: np.ndarray, canvas: tuple[int, int], whole: tuple[int, int], resampler: str
                ) -> tuple[torch.Tensor, torch.Tensor]:
        if resampler not in RESAMPLERS:
            raise ValueError(f"resampler must be one of {RESAMPLERS}, not {resampler!r}")
        source = torch.from_numpy(np.ascontiguousarray(image)).to(device)

        def resized(height: int, width: int) -> torch.Tensor:
            order = lanczos.pil_order(*image.shape[:2], height, width, str(device))
            if order is None:
                return torch.from_numpy(resize_lanczos3(image, height, width, resampler)).to(device)
            return lanczos.resize_lanczos3(source, height, width, order)
        return resized(*canvas), resized(*whole)
    return resizes


def stacked(crops: list[np.ndarray | torch.Tensor], device: torch.device) -> np.ndarray | torch.Tensor:
    """Several images' crops as one array: numpy where all are (made by PIL), else a tensor on
    `device`."""
    if all(isinstance(c, np.ndarray) for c in crops):
        return np.concatenate(crops)
    return torch.cat([torch.as_tensor(c).to(device) for c in crops])
