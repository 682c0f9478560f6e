"""Draw detections, points and segmentation masks on a copy of an RGB image (the CLI's --draw, the
node's image_annotated)."""
from __future__ import annotations

import math

import cv2
import numpy as np

_COLORS = [(255, 64, 64), (64, 200, 64), (64, 128, 255), (255, 200, 0), (200, 64, 255), (0, 220, 220)]


MASK_ALPHA = 0.4   # how much of a mask's colour covers the image under it


def _first_pixel(v: float, size: int) -> int:
    """The pixel holding normalized coordinate v."""
    return min(max(math.floor(v * size), 0), size - 1)


def _last_pixel(v: float, size: int) -> int:
    """The last pixel a span ending at normalized v covers."""
    return min(max(math.ceil(v * size) - 1, 0), size - 1)


def draw_results(rgb: np.ndarray, detections: dict[str, list[dict]], points: dict[str, list[dict]],
                 segments: dict[str, dict] | None = None) -> np.ndarray:
    """`detections` / `points`: label -> normalized boxes / points, as the engine returns them;
    `segments`: label -> a segment result ({"path", "bbox"}), drawn as a filled mask with its border."""
    out = np.ascontiguousarray(rgb).copy()
    h, w = out.shape[:2]
    thickness = max(1, round(min(h, w) / 300))
    for i, (label, boxes) in enumerate(detections.items()):
        color = _COLORS[i % len(_COLORS)]
        for b in boxes:
            # the pixels the box covers (pixel k spans [k, k + 1)): x_max 1.0 is the last column
            p0 = (_first_pixel(b["x_min"], w), _first_pixel(b["y_min"], h))
            p1 = (_last_pixel(b["x_max"], w), _last_pixel(b["y_max"], h))
            cv2.rectangle(out, p0, p1, color, thickness)
            cv2.putText(out, label, (p0[0], max(12, p0[1] - 4)), cv2.FONT_HERSHEY_SIMPLEX,
                        0.4 * thickness, color, thickness)
    for i, (label, pts) in enumerate(points.items()):
        color = _COLORS[(i + len(detections)) % len(_COLORS)]
        for p in pts:
            centre = (_first_pixel(p["x"], w), _first_pixel(p["y"], h))
            cv2.circle(out, centre, 4 * thickness, color, -1)
            cv2.putText(out, label, (centre[0] + 6, centre[1]), cv2.FONT_HERSHEY_SIMPLEX,
                        0.4 * thickness, color, thickness)
    for i, (label, result) in enumerate((segments or {}).items()):
        draw_segment(out, result, _COLORS[(i + len(detections) + len(points)) % len(_COLORS)], thickness)
    return out


def draw_segment(out: np.ndarray, result: dict, color: tuple[int, int, int], thickness: int = 1,
                 alpha: float = MASK_ALPHA) -> np.ndarray:
    """A segment result drawn in place on `out` (RGB): the mask (pixels whose centres the path
    encloses) blended in with `alpha`, its border in full colour. The path lives in its bbox's unit
    square, so without a bbox (or a path) nothing is drawn; a path the model ended mid-command is
    drawn up to its last whole command."""
    from photon_core import svg_path

    bbox, path = result.get("bbox"), result.get("path") or ""
    if not bbox or not path.strip():
        return out
    h, w = out.shape[:2]
    mask, _ = svg_path.rasterise(path, bbox, w, h)
    if not mask.any():
        return out
    blended = out[mask].astype(np.float32) * (1 - alpha) + np.asarray(color, np.float32) * alpha
    out[mask] = np.clip(np.rint(blended), 0, 255).astype(out.dtype)
    # The outline: the mask's own border pixels (`thickness` deep), so it never leaves the mask,
    # hence the box, and it follows holes too.
    m = mask.astype(np.uint8)
    inner = cv2.erode(m, cv2.getStructuringElement(cv2.MORPH_CROSS, (3, 3)), iterations=thickness,
                      borderType=cv2.BORDER_CONSTANT, borderValue=0)
    out[m > inner] = color
    return out
