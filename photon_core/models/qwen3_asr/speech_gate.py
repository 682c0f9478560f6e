"""Is there speech at all? A gate in front of the model that needs no weights.

Whisper says "no speech" with its own no-speech token probability, which only trained weights
give. Qwen3-ASR has no such token, and a model (trained or not) asked to transcribe silence or
hiss may still write something. So before the encoder runs, this gate looks for what speech has
and silence and noise lack: frames well above the digital-silence floor whose spectrum is far
from flat (voiced speech is harmonic: spectral flatness well under that of noise, which for
white noise is about 0.56), and a level that rises and falls by syllables (stationary noise and
hum keep a steady level). Clips that fail are answered with empty text, without decoding.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

_FRAME, _HOP = 400, 160        # 25 ms frames every 10 ms at 16 kHz
_BAND = (100.0, 4000.0)        # where voiced speech's harmonics carry most energy
_WINDOW = np.hanning(_FRAME).astype(np.float32)
_WINDOW_POWER = float((_WINDOW.astype(np.float64) ** 2).sum())


@dataclass(frozen=True)
class GateOptions:
    min_level_db: float = -55.0      # in-band frame level below this (dBFS) is silence
    max_flatness: float = 0.3        # voiced frames are tonal; white noise's flatness is ~0.56
    min_voiced_s: float = 0.1        # at least this much voiced-looking audio
    min_dynamics_db: float = 10.0    # 95th - 10th percentile of frame level: syllables vs steady noise


@dataclass(frozen=True)
class GateResult:
    speech: bool
    voiced_s: float
    dynamics_db: float
    peak_db: float


def speech_gate(pcm: np.ndarray, sample_rate: int = 16000,
                options: GateOptions = GateOptions()) -> GateResult:
    """Judge 16 kHz float mono audio (already validated) for speech."""
    x = np.asarray(pcm, dtype=np.float32)
    if x.shape[0] < _FRAME:
        x = np.pad(x, (0, _FRAME - x.shape[0]))
    n = 1 + (x.shape[0] - _FRAME) // _HOP
    frames = np.lib.stride_tricks.as_strided(x, (n, _FRAME), (x.strides[0] * _HOP, x.strides[0]))
    spec = np.abs(np.fft.rfft(frames * _WINDOW, axis=1)) ** 2
    freqs = np.fft.rfftfreq(_FRAME, 1.0 / sample_rate)
    band = spec[:, (freqs >= _BAND[0]) & (freqs <= _BAND[1])].astype(np.float64) + 1e-20
    power = band.mean(axis=1)
    # In-band mean square (Parseval, one-sided spectrum) in dBFS: DC drift and rumble do not count.
    level_db = 10.0 * np.log10(2.0 * band.sum(axis=1) / (_FRAME * _WINDOW_POWER) + 1e-20)
    level_db = np.maximum(level_db, -100.0)   # digital silence: a floor, not -200 dB
    flatness = np.exp(np.log(band).mean(axis=1)) / power
    loud = level_db > options.min_level_db
    voiced = loud & (flatness < options.max_flatness)
    voiced_s = float(voiced.sum()) * _HOP / sample_rate
    dynamics = float(np.percentile(level_db, 95) - np.percentile(level_db, 10))
    peak = float(level_db.max())
    speech = (voiced_s >= options.min_voiced_s and dynamics >= options.min_dynamics_db)
    return GateResult(speech, voiced_s, dynamics, peak)
