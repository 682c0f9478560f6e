"""PIL's Lanczos-3 resize of uint8 RGB images, byte for byte, as torch ops on any device.

Moondream's crops must be PIL's bytes (models/moondream/image_crops.py says why), and PIL resizes
on the CPU: 14-67 ms for a camera frame's two resizes on two cores, more on a Jetson's ARM cores,
half of a 25 ms detect. The same arithmetic on the GPU takes well under a millisecond.

What PIL computes (Pillow's libImaging/Resample.c, 8 bits a channel), reproduced exactly:
- per axis, per output index i: the centre c = (i + 0.5) * scale (scale = in / out), support
  3 * max(scale, 1), source indices [xmin, xmin + n) with xmin = int(c - support + 0.5) (C's
  truncation) clamped to 0 and the end likewise clamped to the input; weights
  lanczos((j - c + 0.5) / max(scale, 1)) normalised to sum 1, then fixed point: int(w * 2^22 +- 0.5).
  These are computed here on the host with Python's floats and math.sin, which are the C doubles
  and libm's sin PIL uses, so the integers are PIL's (cached per (in, out) size: a camera's frames
  share theirs);
- two passes, each output value clip(2^21 + sum(pixel * weight) >> 22, 0, 255) in integers, the
  intermediate image stored as uint8 as PIL stores it. Pillow up to 12.3 runs the horizontal pass
  first (over only the rows the vertical pass reads); Pillow 13 runs the vertical one first for
  some sizes, by a rule its source states and this module does not guess: `pil_order` finds which
  order the installed Pillow takes for a pair of sizes by resizing random probes of those sizes
  with PIL and both ways here (once per pair of sizes, cached), and says None where neither gives
  PIL's bytes (the caller then resizes with PIL).
Each pass gathers every output's taps ([rows, out, taps, 3] int32; chunked to bound memory) and sums
them: integer sums, so the result does not depend on the order of the additions or the device.
"""
from __future__ import annotations

import functools
import math

import numpy as np
import torch

PRECISION_BITS = 22
ORDERS = ("hv", "vh")
SUPPORT = 3.0
# one pass's gathered taps at most (int32 elements: 64 MB), chunked over rows beyond it
CHUNK_ELEMENTS = 16 << 20


def _lanczos(x: float) -> float:
    if not -SUPPORT <= x < SUPPORT:
        return 0.0
    return _sinc(x) * _sinc(x / 3)


def _sinc(x: float) -> float:
    if x == 0.0:
        return 1.0
    x = x * math.pi
    return math.sin(x) / x


@functools.lru_cache(maxsize=32)
def coefficients(in_size: int, out_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(first source index [out], taps used [out], fixed-point weights [out, ksize] int32) of one
    axis resized from in_size to out_size, as PIL's precompute_coeffs and normalize_coeffs_8bpc."""
    scale = in_size / out_size
    filterscale = max(scale, 1.0)
    support = SUPPORT * filterscale
    ksize = int(math.ceil(support)) * 2 + 1
    first = np.zeros(out_size, np.int64)
    count = np.zeros(out_size, np.int64)
    weights = np.zeros((out_size, ksize), np.int32)
    ss = 1.0 / filterscale
    for i in range(out_size):
        center = (i + 0.5) * scale
        lo = max(int(center - support + 0.5), 0)
        n = min(int(center + support + 0.5), in_size) - lo
        w = [_lanczos((x + lo - center + 0.5) * ss) for x in range(n)]
        total = 0.0
        for v in w:
            total += v            # in PIL's order: the sum's rounding is part of the weights
        if total != 0.0:
            w = [v / total for v in w]
        weights[i, :n] = [int(-0.5 + v * (1 << PRECISION_BITS)) if v < 0 else int(0.5 + v * (1 << PRECISION_BITS))
                          for v in w]
        first[i], count[i] = lo, n
    return first, count, weights


@functools.lru_cache(maxsize=64)
def _taps(in_size: int, out_size: int, shift: int, n: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """One axis's source index per output and tap ([out, ksize], the first index less `shift`,
    clamped to the n rows or columns at hand: a clamped tap's weight is 0) and its weights, on
    `device`: uploaded once per pair of sizes, not per frame."""
    first, _, weights = coefficients(in_size, out_size)
    taps = np.minimum(first[:, None] - shift + np.arange(weights.shape[1]), n - 1)
    return torch.from_numpy(taps).to(device), torch.from_numpy(weights).to(device)


def _pass(image: torch.Tensor, in_size: int, out_size: int, axis: int, shift: int = 0) -> torch.Tensor:
    """One axis's resample (in_size -> out_size) of uint8 image [H, W, 3] along `axis` (0: rows,
    1: columns); `shift`: the image starts that many rows into the axis's input."""
    taps, w = _taps(in_size, out_size, shift, image.shape[axis], str(image.device))
    out, ksize = w.shape
    other = image.shape[1 - axis]
    step = max(1, CHUNK_ELEMENTS // (out * ksize * 3))
    parts = []
    for s in range(0, other, step):
        if axis == 1:
            block = image[s:s + step].to(torch.int32)                 # [rows, W, 3]
            gathered = block[:, taps]                                 # [rows, out, ksize, 3]
            acc = (gathered * w[None, :, :, None]).sum(2)
        else:
            block = image[:, s:s + step].to(torch.int32)              # [H, cols, 3]
            gathered = block[taps]                                    # [out, ksize, cols, 3]
            acc = (gathered * w[:, :, None, None]).sum(1)
        parts.append(((acc + (1 << (PRECISION_BITS - 1))) >> PRECISION_BITS).clamp_(0, 255).to(torch.uint8))
    return torch.cat(parts, dim=1 - axis)


def resize_lanczos3(image: torch.Tensor, height: int, width: int, order: str = "hv") -> torch.Tensor:
    """[H, W, 3] uint8 -> [height, width, 3] uint8 on image's device: `Image.resize((width, height),
    LANCZOS)`'s bytes where `order` is the installed Pillow's for these sizes (pil_order): "hv"
    horizontal pass first, "vh" vertical first."""
    if image.dtype != torch.uint8 or image.dim() != 3 or image.shape[2] != 3:
        raise ValueError(f"expected an [H, W, 3] uint8 image, got {image.dtype} {tuple(image.shape)}")
    if order not in ORDERS:
        raise ValueError(f"order must be one of {ORDERS}, not {order!r}")
    h, w = image.shape[:2]
    if (h, w) == (height, width):
        return image
    if order == "vh":
        if height != h:
            image = _pass(image, h, height, axis=0)
        return _pass(image, w, width, axis=1) if width != w else image
    top = 0
    if width != w:
        # only the rows the vertical pass reads, as PIL's horizontal pass
        v_first, v_count, _ = coefficients(h, height)
        top, bottom = int(v_first[0]), int(v_first[-1] + v_count[-1])
        image = _pass(image[top:bottom], w, width, axis=1)
    if height != h:
        image = _pass(image, h, height, axis=0, shift=top)
    return image


@functools.lru_cache(maxsize=32)
def pil_order(height: int, width: int, out_height: int, out_width: int, device: str = "cpu",
              probes: int = 2) -> str | None:
    """The pass order ("hv" or "vh") in which the installed Pillow resizes [height, width] images to
    [out_height, out_width], or None where neither order gives its bytes on every probe (random
    images of that size, which tell the orders apart: their values are clipped and rounded
    differently). Costs one PIL resize of the size and two here per probe, once per pair of sizes."""
    from PIL import Image

    rng = np.random.default_rng(height * 7919 + width)
    left = list(ORDERS)
    for _ in range(probes):
        probe = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
        want = np.asarray(Image.fromarray(probe).resize((out_width, out_height), Image.Resampling.LANCZOS))
        t = torch.from_numpy(probe).to(device)
        left = [o for o in left if np.array_equal(resize_lanczos3(t, out_height, out_width, o).cpu().numpy(), want)]
    one_pass = height == out_height or width == out_width      # either order is the same pass
    return left[0] if len(left) == 1 or (left and one_pass) else None


__all__ = ["resize_lanczos3", "pil_order", "coefficients", "ORDERS", "PRECISION_BITS"]
