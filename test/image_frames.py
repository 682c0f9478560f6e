"""Synthetic camera frames with known colours, in the raw encodings cameras send, built from an
RGB picture by the formulas the formats define (never by OpenCV, whose conversions are under
test): BT.601 video-range YUV (V4L2's default for 4:2:2 and 4:2:0 cameras), Bayer mosaics.

Frames are returned as plain dicts of sensor_msgs/Image's fields, so they can be pickled to a
process without ROS; `as_message` makes the real message."""
from __future__ import annotations

import numpy as np

# BT.601, video range: Y in 16..235, Cb / Cr in 16..240 around 128 (R, G, B in 0..1).
_RGB_TO_YCBCR = np.array([
    [65.481, 128.553, 24.966],
    [-37.797, -74.203, 112.0],
    [112.0, -93.786, -18.214],
])
_YCBCR_OFFSET = np.array([16.0, 128.0, 128.0])


def block_picture(seed: int, blocks_high: int = 4, blocks_wide: int = 6, block: int = 8) -> np.ndarray:
    """An RGB uint8 picture of flat square patches, each a random colour: chroma subsampling
    and demosaicing leave the inside of every patch exactly that colour."""
    rng = np.random.default_rng(seed)
    colours = rng.integers(0, 256, size=(blocks_high, blocks_wide, 3), dtype=np.uint8)
    return colours.repeat(block, axis=0).repeat(block, axis=1)


def ycbcr(rgb: np.ndarray) -> np.ndarray:
    """Y, Cb, Cr (float, unrounded) of each pixel, HxWx3."""
    return rgb.astype(np.float64) / 255.0 @ _RGB_TO_YCBCR.T + _YCBCR_OFFSET


def _bytes(values: np.ndarray) -> np.ndarray:
    return np.clip(np.round(values), 0, 255).astype(np.uint8)


def _padded(rows: np.ndarray, padding: int) -> np.ndarray:
    return np.pad(rows, ((0, 0), (0, padding)), constant_values=0xAB) if padding else rows


def _frame(encoding: str, rgb: np.ndarray, rows: np.ndarray, step: int, bigendian: bool = False) -> dict:
    return {"encoding": encoding, "height": rgb.shape[0], "width": rgb.shape[1], "step": step,
            "is_bigendian": bigendian, "data": rows.tobytes()}


def packed_yuv422(rgb: np.ndarray, encoding: str, padding: int = 0) -> dict:
    """uyvy / yuv422 (U Y0 V Y1) or yuyv / yuv422_yuy2 (Y0 U Y1 V): two pixels in four bytes,
    their chroma the mean of the pair's."""
    yuv = ycbcr(rgb)
    height, width = rgb.shape[:2]
    luma = _bytes(yuv[:, :, 0]).reshape(height, width // 2, 2)
    pair = yuv.reshape(height, width // 2, 2, 3).mean(axis=2)
    cb, cr = _bytes(pair[:, :, 1]), _bytes(pair[:, :, 2])
    if encoding in ("uyvy", "yuv422"):
        quads = np.stack([cb, luma[:, :, 0], cr, luma[:, :, 1]], axis=2)
    elif encoding in ("yuyv", "yuv422_yuy2"):
        quads = np.stack([luma[:, :, 0], cb, luma[:, :, 1], cr], axis=2)
    else:
        raise ValueError(f"not a packed 4:2:2 encoding: {encoding}")
    rows = _padded(quads.reshape(height, width * 2), padding)
    return _frame(encoding, rgb, rows, rows.shape[1])


def semi_planar(rgb: np.ndarray, encoding: str, padding: int = 0) -> dict:
    """nv12 / nv21 (chroma of each 2x2 block, Cb Cr or Cr Cb) or nv24 (chroma of each pixel,
    Cb Cr): a Y plane of `step`-byte rows, then the chroma plane (rows of step bytes for 4:2:0,
    2 x step for nv24)."""
    yuv = ycbcr(rgb)
    height, width = rgb.shape[:2]
    step = width + padding
    luma = _padded(_bytes(yuv[:, :, 0]), padding)
    if encoding == "nv24":
        chroma = _padded(_bytes(yuv[:, :, 1:]).reshape(height, width * 2), 2 * padding)
    elif encoding in ("nv12", "nv21"):
        blocks = yuv.reshape(height // 2, 2, width // 2, 2, 3).mean(axis=(1, 3))[:, :, 1:]
        if encoding == "nv21":
            blocks = blocks[:, :, ::-1]
        chroma = _padded(_bytes(blocks).reshape(height // 2, width), padding)
    else:
        raise ValueError(f"not a semi-planar encoding: {encoding}")
    data = np.concatenate([luma.ravel(), chroma.ravel()])
    return _frame(encoding, rgb, data, step)


def bayer(rgb: np.ndarray, pattern: str, bits: int = 8, bigendian: bool = False,
          padding: int = 0) -> dict:
    """bayer_<pattern><bits>: each pixel keeps the one channel that the pattern's letter (its
    top-left 2x2 block read row by row, e.g. "rggb") names at its position."""
    channel = {"r": 0, "g": 1, "b": 2}
    height, width = rgb.shape[:2]
    rows, cols = np.mgrid[0:height, 0:width]
    which = np.array([channel[letter] for letter in pattern])[(rows % 2) * 2 + cols % 2]
    mosaic = np.take_along_axis(rgb, which[:, :, None], axis=2)[:, :, 0]
    if bits == 16:
        mosaic = (mosaic.astype(np.uint16) * 257).astype(">u2" if bigendian else "<u2")
    rows_bytes = _padded(mosaic.view(np.uint8).reshape(height, -1), padding)
    return _frame(f"bayer_{pattern}{bits}", rgb, rows_bytes, rows_bytes.shape[1], bigendian and bits == 16)


def patch_interiors(height: int, width: int, block: int = 8, margin: int = 2) -> np.ndarray:
    """A boolean HxW mask of the pixels at least `margin` from any patch edge."""
    def inside(n: int) -> np.ndarray:
        offset = np.arange(n) % block
        return (offset >= margin) & (offset < block - margin)
    return inside(height)[:, None] & inside(width)[None, :]


def as_message(frame: dict):
    from sensor_msgs.msg import Image
    return Image(**frame)
