"""Real speech with a known text, made by espeak-ng, for speech tests (cached per process)."""
from __future__ import annotations

import functools
import subprocess
import tempfile
from pathlib import Path

import numpy as np

from photon_core.audio_io import read_wav

_DIR = Path(tempfile.mkdtemp(prefix="photon-speech-"))


@functools.lru_cache(maxsize=None)
def espeak_wav(text: str, voice: str | None = "en-us", speed: int = 160) -> Path:
    """A 22050 Hz mono 16-bit WAV of `text` (voice None: espeak-ng's default voice)."""
    path = _DIR / f"{abs(hash((text, voice, speed)))}.wav"
    args = ["espeak-ng"] + (["-v", voice] if voice else []) + ["-s", str(speed), "-w", str(path), text]
    subprocess.run(args, check=True, capture_output=True)
    return path


def espeak_pcm(text: str, **kwargs) -> tuple[np.ndarray, int]:
    """float32 samples in [-1, 1] and their rate."""
    samples, rate = read_wav(espeak_wav(text, **kwargs))
    return samples.astype(np.float32) / 32768.0, rate
