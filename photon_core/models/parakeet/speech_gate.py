"""Is there speech in this audio at all? A gate before the model that does not depend on its weights.

A transducer has no "no speech" output: given silence or noise, a model (and certainly a random
one) may still emit tokens. Whisper answers with its no-speech probability; Parakeet has none, so
the audio is judged first by three signal facts, per 25 ms frame. A speech frame is loud enough
(RMS above an absolute floor), spectrally shaped (flatness over 300-4000 Hz well below white
noise's ~0.56) and stands out from the clip's own background (its 300-4000 Hz energy at least
10 dB over the clip's 10th percentile: stationary noise of any colour, hum and hiss never do,
while syllables do over pauses and consonants). Audio with too few such frames is not
transcribed. The same frame energies give the quiet points where long audio is cut into chunks.
"""
from __future__ import annotations

import numpy as np

FRAME_S = 0.025
HOP_S = 0.010
RMS_FLOOR = 10 ** (-50 / 20)      # -50 dBFS
MAX_FLATNESS = 0.3
MIN_SPEECH_S = 0.1
BACKGROUND_QUANTILE = 0.1
ABOVE_BACKGROUND_DB = 10.0


def frame_stats(pcm: np.ndarray, sample_rate: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(rms, 300-4000 Hz energy in dB, spectral flatness over 300-4000 Hz) per 25 ms frame, hop 10 ms."""
    size, hop = int(FRAME_S * sample_rate), int(HOP_S * sample_rate)
    if len(pcm) < size:
        pcm = np.pad(pcm, (0, size - len(pcm)))
    pcm = np.ascontiguousarray(pcm, dtype=np.float32)
    count = 1 + (len(pcm) - size) // hop
    frames = np.lib.stride_tricks.as_strided(pcm, (count, size), (pcm.strides[0] * hop, pcm.strides[0]))
    frames = frames.astype(np.float64)
    rms = np.sqrt((frames ** 2).mean(axis=1))
    n_fft = 1 << (size - 1).bit_length()
    power = np.abs(np.fft.rfft(frames * np.hanning(size), n_fft, axis=1)) ** 2
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


def chunk_bounds(pcm: np.ndarray, sample_rate: int, max_seconds: float) -> list[tuple[int, int]]:
    """[start, end) sample ranges of at most max_seconds, each cut at the quietest 10 ms frame of
    the last quarter of its window, so a cut rarely splits a word."""
    limit = int(max_seconds * sample_rate)
    if len(pcm) <= limit:
        return [(0, len(pcm))]
    rms = frame_stats(pcm, sample_rate)[0]
    hop = int(HOP_S * sample_rate)
    bounds, start = [], 0
    while len(pcm) - start > limit:
        lo, hi = (start + (3 * limit) // 4) // hop, (start + limit) // hop
        cut = (lo + int(np.argmin(rms[lo:hi]))) * hop if hi > lo else start + limit
        cut = min(max(cut, start + hop), start + limit)
        bounds.append((start, cut))
        start = cut
    bounds.append((start, len(pcm)))
    return bounds
