"""Draw detections and points on a copy of an RGB image (the CLI's --draw, the node's image_annotated)."""
from __future__ import annotations

import cv2
import numpy as np

_COLORS = [(255, 64, 64), (64, 200, 64), (64, 128, 255), (255, 200, 0), (200, 64, 255), (0, 220, 220)]


def draw_results(rgb: np.ndarray, detections: dict[str, list[dict]], points: dict[str, list[dict]]) -> np.ndarray:
    """`detections` / `points`: label -> normalized boxes / points, as the engine returns them."""
    out = np.ascontiguousarray(rgb).copy()
    h, w = out.shape[:2]
    thickness = max(1, round(min(h, w) / 300))
    for i, (label, boxes) in enumerate(detections.items()):
        color = _COLORS[i % len(_COLORS)]
        for b in boxes:
            p0 = (round(b["x_min"] * w), round(b["y_min"] * h))
            p1 = (round(b["x_max"] * w), round(b["y_max"] * h))
            cv2.rectangle(out, p0, p1, color, thickness)
            cv2.putText(out, label, (p0[0], max(12, p0[1] - 4)), cv2.FONT_HERSHEY_SIMPLEX,
                        0.4 * thickness, color, thickness)
    for i, (label, pts) in enumerate(points.items()):
        color = _COLORS[(i + len(detections)) % len(_COLORS)]
        for p in pts:
            centre = (round(p["x"] * w), round(p["y"] * h))
            cv2.circle(out, centre, 4 * thickness, color, -1)
            cv2.putText(out, label, (centre[0] + 6, centre[1]), cv2.FONT_HERSHEY_SIMPLEX,
                        0.4 * thickness, color, thickness)
    return out
