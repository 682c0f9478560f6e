"""Parakeet's audio front end: user PCM -> model-rate mono float32 (runtime.audio_frontend) ->
normalised log-mel frames.

The log-mel is NeMo's AudioToMelSpectrogramPreprocessor at inference (transformers'
ParakeetFeatureExtractor computes the same): pre-emphasis, centred STFT with zero padding and a
symmetric Hann window of win_length inside n_fft, power spectrum, Slaney mel filterbank (the
checkpoint's own when a .nemo ships it), log(mel + 2^-24), and per-feature mean / unbiased std
normalisation over the utterance's len // hop frames (the STFT's extra last frame is not part of
the utterance). No dither: NeMo adds it only in training.
"""
from __future__ import annotations

import numpy as np
import torch

from photon_core.runtime.audio_frontend import mel_filterbank, prepare_audio

from .config import FrontendConfig

__all__ = ["LogMel", "prepare_audio"]   # prepare_audio(samples, rate, target): the shared one


class LogMel:
    def __init__(self, fc: FrontendConfig, filters: torch.Tensor | None = None,
                 window: torch.Tensor | None = None) -> None:
        self.fc = fc
        n_freq = fc.n_fft // 2 + 1
        if filters is None:
            filters = torch.from_numpy(mel_filterbank(fc.n_mels, fc.sample_rate, fc.n_fft))
        if tuple(filters.shape) != (fc.n_mels, n_freq):
            raise ValueError(f"mel filterbank of shape {tuple(filters.shape)}, expected {(fc.n_mels, n_freq)}")
        self.filters = filters.float()
        self.window = (window.float() if window is not None
                       else torch.hann_window(fc.win_length, periodic=False))

    def frames(self, n_samples: int) -> int:
        return n_samples // self.fc.hop_length

    def __call__(self, pcm: np.ndarray | torch.Tensor) -> torch.Tensor:
        """[frames, n_mels] float32 for 1-D float audio at the model's rate (>= 2 frames long)."""
        fc = self.fc
        x = torch.as_tensor(pcm, dtype=torch.float32)
        n = self.frames(x.shape[-1])
        if n < 2:
            raise ValueError(f"audio of {x.shape[-1]} samples is too short: at least "
                             f"{2 * fc.hop_length} samples ({2 * fc.hop_length / fc.sample_rate:.3f} s) needed")
        if fc.preemphasis:
            x = torch.cat([x[:1], x[1:] - fc.preemphasis * x[:-1]])
        spec = torch.stft(x, fc.n_fft, hop_length=fc.hop_length, win_length=fc.win_length,
                          window=self.window, center=True, pad_mode="constant", return_complex=True)
        power = torch.view_as_real(spec).pow(2).sum(-1)
        mel = torch.log(self.filters @ power + fc.log_guard)[:, :n]
        if fc.normalize == "per_feature":
            mean = mel.mean(dim=1, keepdim=True)
            std = ((mel - mean) ** 2).sum(dim=1, keepdim=True).div(n - 1).sqrt()
            mel = (mel - mean) / (std + fc.std_eps)
        return mel.T.contiguous()
