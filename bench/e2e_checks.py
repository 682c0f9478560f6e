"""Checks gpu_e2e runs on the device before it times anything: what the timed paths compute there
must be what the CPU tests proved (a wrong byte would not show in a latency).

crops_match_pil: Moondream's crops made on the device (runtime/lanczos.py) against PIL's, at a
camera frame's sizes, on random pixels (PIL's clipping and rounding show on those)."""
from __future__ import annotations

import time
from typing import Any

import numpy as np

FRAMES = ((756, 756), (1080, 1920))
DRY_FRAMES = ((120, 160),)


def crops_match_pil(device: Any, frames: tuple[tuple[int, int], ...] = FRAMES) -> dict[str, Any]:
    """{"ok": every crop equal, "frames": per frame size the order and seconds}."""
    from photon_core.models.moondream import image_crops

    out: dict[str, Any] = {"ok": True, "frames": {}}
    rng = np.random.default_rng(0)
    for h, w in frames:
        image = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        t = time.perf_counter()
        want, tiling = image_crops.make_crops(image)
        pil_s = time.perf_counter() - t
        image_crops.make_crops(image, device=device)           # coefficients and the pass order, once
        t = time.perf_counter()
        got, got_tiling = image_crops.make_crops(image, device=device)
        got_np = got.cpu().numpy()
        dev_s = time.perf_counter() - t
        same = got_tiling == tiling and np.array_equal(got_np, want)
        out["ok"] &= bool(same)
        out["frames"][f"{w}x{h}"] = dict(equal=bool(same), tiling=list(tiling), pil_ms=round(pil_s * 1e3, 2),
                                         device_ms=round(dev_s * 1e3, 2),
                                         levels_off=int(np.abs(got_np.astype(int) - want).max()) if not same else 0)
    return out
