"""Whisper's audio front end: 16 kHz mono float32 (runtime.audio_frontend) -> log-mel over the
30 s windows the encoder reads.

The log-mel is openai-whisper's (runtime.audio_frontend.log_mel_spectrogram), so the model sees
the features it was trained on; here are Whisper's own pieces: the 30 s window and the frames
openai-whisper's transcribe reads of a longer clip.
"""
from __future__ import annotations

import numpy as np
import torch

from photon_core.runtime.audio_frontend import (HOP_LENGTH, N_FFT, SAMPLE_RATE, log_mel_spectrogram,
                                                mel_filterbank, prepare_audio, resample, to_float_mono)

# The shared front end's names are Whisper's front end too (its users and tests read them here).
__all__ = ["SAMPLE_RATE", "N_FFT", "HOP_LENGTH", "CHUNK_SECONDS", "N_SAMPLES", "N_FRAMES", "mel_filterbank",
           "to_float_mono", "resample", "prepare_audio", "log_mel_spectrogram", "log_mel_content", "pad_or_trim"]

CHUNK_SECONDS = 30
N_SAMPLES = CHUNK_SECONDS * SAMPLE_RATE    # 480000 samples in a 30 s window
N_FRAMES = N_SAMPLES // HOP_LENGTH         # 3000 mel frames in a 30 s window


def log_mel_content(audio: np.ndarray | torch.Tensor, n_mels: int = 80,
                    device: torch.device | None = None) -> torch.Tensor:
    """The first len(audio) // 160 frames of `log_mel_spectrogram(audio, padding=N_SAMPLES)`
    (the frames openai-whisper's transcribe reads), without transforming 30 s of zeros.

    Exact because every frame whose 400-sample window touches audio is computed here on the same
    samples (enough zero padding for the window and for the end's reflect padding), and all other
    frames of the 30 s-padded version are windows of zeros, at the clamp value -10, which can only
    tie the global max used by the floor. Computed on `device` (None: where the audio is).
    """
    x = torch.as_tensor(audio, dtype=torch.float32)
    n_frames = x.shape[-1] // HOP_LENGTH
    return log_mel_spectrogram(x, n_mels, padding=N_FFT + HOP_LENGTH, device=device)[:, :n_frames]


def pad_or_trim(x: torch.Tensor, length: int, dim: int = -1) -> torch.Tensor:
    """Zero-pad or cut `x` along `dim` to `length` (samples or mel frames)."""
    n = x.shape[dim]
    if n > length:
        return x.narrow(dim, 0, length)
    if n < length:
        pad = [0, 0] * (x.ndim - (dim % x.ndim) - 1) + [0, length - n]
        return torch.nn.functional.pad(x, pad)
    return x
