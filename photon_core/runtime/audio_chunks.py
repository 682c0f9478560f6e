"""Long audio cut into chunks at quiet points, for models that take a bounded length at once.

A speech model that transcribes a clip in one pass (Parakeet's encoder, Qwen3-ASR's prompt and
its decoding context) is given long audio chunk by chunk. Each cut falls at the quietest 10 ms
of the last quarter of its window, so a cut rarely splits a word; the chunks are contiguous and
cover the whole clip. Both speech families use this one mechanism.
"""
from __future__ import annotations

import numpy as np

FRAME_S = 0.025   # RMS frames of 25 ms ...
HOP_S = 0.010     # ... every 10 ms


def frames(pcm: np.ndarray, sample_rate: int) -> np.ndarray:
    """[count, samples] float64: the 25 ms frames every 10 ms (a clip shorter than a frame is
    zero-padded to one)."""
    size, hop = int(FRAME_S * sample_rate), int(HOP_S * sample_rate)
    if len(pcm) < size:
        pcm = np.pad(pcm, (0, size - len(pcm)))
    pcm = np.ascontiguousarray(pcm, dtype=np.float32)
    count = 1 + (len(pcm) - size) // hop
    return np.lib.stride_tricks.as_strided(pcm, (count, size), (pcm.strides[0] * hop, pcm.strides[0])).astype(np.float64)


def frame_rms(pcm: np.ndarray, sample_rate: int) -> np.ndarray:
    """RMS of each 25 ms frame, hop 10 ms."""
    return np.sqrt((frames(pcm, sample_rate) ** 2).mean(axis=1))


def chunk_bounds(pcm: np.ndarray, sample_rate: int, max_seconds: float) -> list[tuple[int, int]]:
    """[start, end) sample ranges of at most max_seconds (contiguous, covering the clip), each cut
    at the quietest 10 ms frame of the last quarter of its window; one range when the clip fits."""
    limit = int(max_seconds * sample_rate)
    if limit < 1:
        raise ValueError(f"a chunk of {max_seconds} s holds no sample at {sample_rate} Hz")
    if len(pcm) <= limit:
        return [(0, len(pcm))]
    rms = frame_rms(pcm, sample_rate)
    hop = int(HOP_S * sample_rate)
    bounds, start = [], 0
    while len(pcm) - start > limit:
        lo = (start + (3 * limit) // 4) // hop
        window = rms[lo:(start + limit) // hop]
        cut = (lo + int(np.argmin(window))) * hop if len(window) else start + limit
        cut = min(max(cut, start + hop), start + limit)
        bounds.append((start, cut))
        start = cut
    bounds.append((start, len(pcm)))
    return bounds


__all__ = ["chunk_bounds", "frame_rms", "frames", "FRAME_S", "HOP_S"]
