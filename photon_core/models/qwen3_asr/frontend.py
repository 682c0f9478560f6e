"""Audio front end: any PCM -> 16 kHz mono float32 -> Qwen3-ASR's 128-bin log-mel.

Qwen3-ASR's feature extractor is Whisper's log-mel (runtime.audio_frontend: n_fft 400, hop 160,
Slaney filterbank, log10 floored at max - 8, (x + 4) / 4) over the clip itself, not a 30 s window: clips shorter
than 0.5 s are zero-padded to 0.5 s first, the last STFT frame is dropped (len // 160 frames),
and the frame axis is right-padded with zeros to whole 100-frame chunks (the encoder's unit).
"""
from __future__ import annotations

import numpy as np
import torch

from photon_core.runtime.audio_frontend import HOP_LENGTH, SAMPLE_RATE, log_mel_spectrogram, prepare_audio

MIN_SAMPLES = 8000   # the original library pads shorter clips to half a second

__all__ = ["SAMPLE_RATE", "prepare_audio", "log_mel", "MIN_SAMPLES"]


def log_mel(pcm: np.ndarray, n_mels: int, chunk_frames: int,
            device: torch.device | None = None) -> tuple[torch.Tensor, int]:
    """([n_mels, frames padded to a multiple of chunk_frames], valid frames) for 16 kHz audio,
    computed on `device` (None: the CPU) and left there."""
    x = torch.as_tensor(pcm, dtype=torch.float32)
    if device is not None:
        x = x.to(device)
    if x.shape[-1] < MIN_SAMPLES:
        x = torch.nn.functional.pad(x, (0, MIN_SAMPLES - x.shape[-1]))
    mel = log_mel_spectrogram(x, n_mels)          # [n_mels, len // 160]
    frames = mel.shape[-1]
    assert frames == x.shape[-1] // HOP_LENGTH
    pad = -frames % chunk_frames
    if pad:
        mel = torch.nn.functional.pad(mel, (0, pad))
    return mel, frames
