"""Moondream's crops: Lanczos-3 of the original image (issue 41) against the cv2 path it replaced.

    python bench/moondream_crops.py              # print the table
    python bench/moondream_crops.py --write      # also put it in bench/RESULTS.md

Per camera frame size: the cv2 path as it was (INTER_AREA halvings then INTER_AREA / INTER_CUBIC to
the tiles' canvas, the global crop from that canvas), the two Lanczos-3 resizes of today's
make_crops on one thread and on two (its default for frames of 200k pixels and more), the
normalisation of the frame's crops (bfloat16
round trip vs the model's dtype), and what a request's batch spends encoding one frame (small random
checkpoint, CPU) when it resizes itself vs when the crops were made ahead (MoondreamModel.prepare,
in the camera's own thread).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import cv2
import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "test"))
sys.path.insert(0, str(ROOT / "bench"))
from report import heading, publish  # noqa: E402

from photon_core.models.moondream import image_crops, vision  # noqa: E402

SIZES = {"640x480": (480, 640), "1920x1080": (1080, 1920), "4000x3000": (3000, 4000)}


def timed(fn, repeats: int) -> tuple[float, float]:
    """Median and best wall time of fn() over `repeats` runs, after one warm-up."""
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times), min(times)


def cv2_resize(image: np.ndarray, height: int, width: int) -> np.ndarray:
    """The resize make_crops used before issue 41 (for comparison only)."""
    if image.shape[:2] == (height, width):
        return image
    while image.shape[0] >= 2 * height and image.shape[1] >= 2 * width:
        h, w = image.shape[0] // 2, image.shape[1] // 2
        image = cv2.resize(image[:2 * h, :2 * w], (w, h), interpolation=cv2.INTER_AREA)
    shrink = height <= image.shape[0] and width <= image.shape[1]
    return cv2.resize(image, (width, height), interpolation=cv2.INTER_AREA if shrink else cv2.INTER_CUBIC)


def cv2_crops(image: np.ndarray) -> np.ndarray:
    (rows, cols), (th, tw) = image_crops.target_size(*image.shape[:2])
    canvas = cv2_resize(image, th, tw)
    crops = np.empty((1 + rows * cols, 378, 378, 3), np.uint8)
    crops[0] = cv2_resize(canvas, 378, 378)
    for i in range(rows):
        for j in range(cols):
            crops[1 + i * cols + j] = canvas[i * 266:i * 266 + 378, j * 266:j * 266 + 378]
    return crops


def lanczos_one_thread(image: np.ndarray, resampler: str = "pil") -> None:
    (rows, cols), (th, tw) = image_crops.target_size(*image.shape[:2])
    image_crops.resize_lanczos3(image, th, tw, resampler)
    image_crops.resize_lanczos3(image, 378, 378, resampler)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    frames = {name: rng.integers(0, 256, (*hw, 3), dtype=np.uint8) for name, hw in SIZES.items()}
    rows = []
    for name, frame in frames.items():
        tiling, canvas = image_crops.target_size(*frame.shape[:2])
        cases = [("cv2 path (before)", lambda: cv2_crops(frame)),
                 ("Lanczos-3 (PIL), one thread", lambda: lanczos_one_thread(frame)),
                 ("Lanczos-3 (PIL), make_crops", lambda: image_crops.make_crops(frame))]
        crops = image_crops.make_crops(frame)[0]
        cases += [("normalise, via bfloat16 (Moondream 2)", lambda: vision.normalize(crops, torch.float32, "cpu")),
                  ("normalise, in float32 (Moondream 3)",
                   lambda: vision.normalize(crops, torch.float32, "cpu", via=None))]
        for label, fn in cases:
            med, best = timed(fn, args.repeats)
            rows.append((f"{name} -> {tiling[0]}x{tiling[1]} tiles ({canvas[1]}x{canvas[0]})", label, med, best))

    import moondream_fixtures
    from photon_core.models.moondream import load_moondream
    model = load_moondream(moondream_fixtures.checkpoint(), device="cpu", dtype="float32")
    encode_rows = []
    for name in ("640x480", "1920x1080"):
        frame = frames[name]
        made = model.prepare(frame)
        encode_rows.append((name, timed(lambda: model.encode_images([frame]), args.repeats)[0],
                            timed(lambda: model.encode_images([made]), args.repeats)[0],
                            timed(lambda: model.prepare(frame), args.repeats)[0]))

    lines = heading("Moondream crops: Lanczos-3 of the original vs the cv2 path (CPU)")
    lines += [f"torch threads {torch.get_num_threads()}; random uint8 frames (the resize's "
              "cost does not depend on the content); ms.", "",
              "| frame | step | median ms | best ms |", "|---|---|---:|---:|"]
    lines += [f"| {frame} | {label} | {med * 1e3:.1f} | {best * 1e3:.1f} |" for frame, label, med, best in rows]
    lines += ["", "One frame's encode inside a request's batch (small random checkpoint: 2 vision layers, so the "
              "resize is most of it), median ms:", "",
              "| frame | batch resizes itself | crops made ahead (prepare) | prepare, in the camera's thread |",
              "|---|---:|---:|---:|"]
    lines += [f"| {name} | {own * 1e3:.1f} | {ahead * 1e3:.1f} | {prep * 1e3:.1f} |"
              for name, own, ahead, prep in encode_rows]
    publish(lines, args.write)
    return 0


if __name__ == "__main__":
    sys.exit(main())
