"""The end-to-end benchmark's inputs, made here (nothing read from disk, nothing downloaded): camera
frames as JPEG bytes, as a robot's compressed image topic carries them, and speech-like audio.

Images are smooth gradients with a few flat shapes (a JPEG of noise would cost the decoder far more
than a camera frame does); each request of a concurrency level gets a frame of its own (another seed),
as several cameras would send. Audio: a voiced signal (harmonics of a pitch that drifts between 100 and
200 Hz) in syllable-rate bursts with a little noise, 16 kHz float32; the models run random weights,
so what is said does not matter, only that it looks like speech to a front end and a speech gate.
"""
from __future__ import annotations

import io

import numpy as np

SAMPLE_RATE = 16_000
JPEG_QUALITY = 90


def frame(height: int, width: int, seed: int = 0) -> np.ndarray:
    """[H, W, 3] uint8 RGB: gradients and rectangles placed by `seed`."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    base = np.stack([x / max(width - 1, 1), y / max(height - 1, 1), (x + y) / max(width + height - 2, 1)], -1)
    img = (base * rng.uniform(120, 255, 3) + rng.uniform(0, 60, 3)).clip(0, 255)
    for _ in range(6):
        h, w = rng.integers(height // 10, height // 3), rng.integers(width // 10, width // 3)
        top, left = rng.integers(0, height - h), rng.integers(0, width - w)
        img[top:top + h, left:left + w] = rng.uniform(0, 255, 3)
    return img.astype(np.uint8)


def jpeg(rgb: np.ndarray, quality: int = JPEG_QUALITY) -> bytes:
    """The frame as JPEG bytes (Pillow's encoder, 4:2:0, as most cameras send)."""
    from PIL import Image
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, format="JPEG", quality=quality)
    return buf.getvalue()


def frames(height: int, width: int, n: int) -> list[bytes]:
    """n distinct frames of one size as JPEG bytes."""
    return [jpeg(frame(height, width, seed)) for seed in range(n)]


def decode_jpeg(data: bytes) -> np.ndarray:
    """[H, W, 3] uint8 RGB, decoded as the vision node decodes a CompressedImage
    (photon_ros.image_conversions.encoded_to_rgb: size checked from the header, then OpenCV)."""
    try:
        from photon_ros.image_conversions import encoded_to_rgb
    except ImportError:   # no OpenCV: Pillow, which the reference's users call anyway
        return decode_jpeg_pil(data)
    return encoded_to_rgb(data)


def decode_jpeg_pil(data: bytes):
    """A PIL RGB image, as the public Moondream reference's users open one (Image.open)."""
    from PIL import Image
    with Image.open(io.BytesIO(data)) as im:
        return im.convert("RGB")


def speech_like(seconds: float, seed: int = 0) -> np.ndarray:
    """float32 16 kHz mono in [-1, 1]: voiced bursts of 0.15-0.35 s with short gaps."""
    rng = np.random.default_rng(seed)
    n = int(seconds * SAMPLE_RATE)
    t = np.arange(n) / SAMPLE_RATE
    pitch = 150 + 50 * np.sin(2 * np.pi * 0.3 * t + rng.uniform(0, 6.3))
    phase = 2 * np.pi * np.cumsum(pitch) / SAMPLE_RATE
    voiced = sum(np.sin(k * phase) / k for k in range(1, 12))
    gate = np.zeros(n, np.float32)
    at = 0
    while at < n:
        on = int(rng.uniform(0.15, 0.35) * SAMPLE_RATE)
        gate[at:at + on] = np.hanning(min(on, n - at) + 2)[1:-1]
        at += on + int(rng.uniform(0.03, 0.12) * SAMPLE_RATE)
    pcm = 0.25 * voiced * gate + 0.005 * rng.standard_normal(n)
    return np.clip(pcm, -1, 1).astype(np.float32)


def clips(seconds: float, n: int) -> list[np.ndarray]:
    """n distinct clips of one length (one per microphone)."""
    return [speech_like(seconds, seed) for seed in range(n)]
