"""Is there speech in this audio at all? A gate before the model that does not depend on its weights.

A transducer has no "no speech" output: given silence or noise, a model (and certainly a random
one) may still emit tokens. Whisper answers with its no-speech probability; Parakeet has none, so
the audio is judged first by three signal facts, per 25 ms frame. A speech frame is loud enough
(RMS above an absolute floor), spectrally shaped (flatness over 300-4000 Hz well below white
noise's ~0.56) and stands out from the clip's own background (its 300-4000 Hz energy at least
10 dB over the clip's 10th percentile: stationary noise of any colour, hum and hiss never do,
while syllables do over pauses and consonants). Audio with too few such frames is not
transcribed (runtime/audio_chunks cuts long audio at quiet points of the same frames).
"""
from __future__ import annotations

import numpy as np

from photon_core.runtime.audio_chunks import HOP_S, frames

RMS_FLOOR = 10 ** (-50 / 20)      # -50 dBFS
MAX_FLATNESS = 0.3
MIN_SPEECH_S = 0.1
BACKGROUND_QUANTILE = 0.1
ABOVE_BACKGROUND_DB = 10.0


def frame_stats(pcm: np.ndarray, sample_rate: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(rms, 300-4000 Hz energy in dB, spectral flatness over 300-4000 Hz) per 25 ms frame, hop 10 ms."""
    framed = frames(pcm, sample_rate)
    size = framed.shape[1]
    rms = np.sqrt((framed ** 2).mean(axis=1))
    n_fft = 1 << (size - 1).bit_length()
    power = np.abs(np.fft.rfft(framed * np.hanning(size), n_fft, axis=1)) ** 2
    freqs = np.fft.rfftfreq(n_fft, 1.0 / sample_rate)
    band = power[:, (freqs >= 300) & (freqs <= 4000)] + 1e-20
    flatness = np.exp(np.log(band).mean(axis=1)) / band.mean(axis=1)
    return rms, 10 * np.log10(band.sum(axis=1)), flatness


def speech_frames(pcm: np.ndarray, sample_rate: int) -> np.ndarray:
    rms, band_db, flatness = frame_stats(pcm, sample_rate)
    background = np.quantile(band_db, BACKGROUND_QUANTILE)
    return (rms > RMS_FLOOR) & (flatness < MAX_FLATNESS) & (band_db > background + ABOVE_BACKGROUND_DB)


def has_speech(pcm: np.ndarray, sample_rate: int) -> bool:
    return float(speech_frames(pcm, sample_rate).sum()) * HOP_S >= MIN_SPEECH_S
