"""The speech families' shared audio front end: any PCM array -> mono float32 at the model's
rate -> log-mel features.

- to_float_mono / resample / prepare_audio: integer PCM scaled to [-1, 1], channels averaged
  ([samples, channels] only: channel-first arrays are refused, not misread), polyphase
  (anti-aliased) resampling to the model's rate (16 kHz unless it says otherwise);
- mel_filterbank: the Slaney-normalised triangular bank librosa.filters.mel gives (Whisper and
  Qwen3-ASR are trained on it; Parakeet uses it when its checkpoint ships none);
- log_mel_spectrogram: openai-whisper's log-mel (STFT n_fft 400, hop 160, periodic Hann window,
  centred with reflect padding, last frame dropped, power spectrum, log10 clamped at 1e-10,
  floored at max - 8, then (x + 4) / 4), which Whisper and Qwen3-ASR read.
The filterbank is computed here rather than loaded from a file.
"""
from __future__ import annotations

from functools import lru_cache
from math import gcd

import numpy as np
import torch

from photon_core.audio_io import MAX_FLOAT_PEAK, MAX_FLOAT_SAMPLE, pcm_to_float

SAMPLE_RATE = 16000
N_FFT = 400
HOP_LENGTH = 160


def _hz_to_mel(f: np.ndarray | float) -> np.ndarray:
    """Slaney mel scale: linear below 1 kHz, logarithmic above (librosa's default, htk=False)."""
    f = np.asarray(f, dtype=np.float64)
    f_sp = 200.0 / 3
    mels = f / f_sp
    min_log_hz, min_log_mel, logstep = 1000.0, 1000.0 / f_sp, np.log(6.4) / 27.0
    log_part = min_log_mel + np.log(np.maximum(f, 1e-10) / min_log_hz) / logstep
    return np.where(f >= min_log_hz, log_part, mels)


def _mel_to_hz(m: np.ndarray) -> np.ndarray:
    m = np.asarray(m, dtype=np.float64)
    f_sp = 200.0 / 3
    min_log_hz, min_log_mel, logstep = 1000.0, 1000.0 / f_sp, np.log(6.4) / 27.0
    return np.where(m >= min_log_mel, min_log_hz * np.exp(logstep * (m - min_log_mel)), f_sp * m)


# Bounds on the filterbank's arguments (a [n_mels + 2, n_fft / 2 + 1] float64 array is built):
# at these its temporaries are a few hundred MB at most; a crafted config's 3e6 mels or 1e9-point FFT
# asked for GBs.
MAX_MELS = 1024
MAX_N_FFT = 1 << 15
MAX_SAMPLE_RATE = 384_000


@lru_cache(maxsize=4)
def mel_filterbank(n_mels: int, sample_rate: int = SAMPLE_RATE, n_fft: int = N_FFT) -> np.ndarray:
    """Slaney-normalized triangular mel filters [n_mels, 1 + n_fft // 2], float32, from 0 to
    Nyquist; the bank librosa.filters.mel(sr, n_fft, n_mels) gives, which Whisper was trained on.
    Its size comes from checkpoint configs, so it is bounded (real models: 80-128 mels, n_fft
    400-512, 16 kHz): ValueError past MAX_MELS, MAX_N_FFT, MAX_SAMPLE_RATE."""
    for name, value, high in (("n_mels", n_mels, MAX_MELS), ("n_fft", n_fft, MAX_N_FFT),
                              ("sample_rate", sample_rate, MAX_SAMPLE_RATE)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not 1 <= value <= high:
            raise ValueError(f"mel filterbank: {name} must be an integer from 1 to {high}, got {value!r}")
    fft_freqs = np.linspace(0, sample_rate / 2, 1 + n_fft // 2)
    mel_pts = _mel_to_hz(np.linspace(_hz_to_mel(0.0), _hz_to_mel(sample_rate / 2), n_mels + 2))
    fdiff = np.diff(mel_pts)
    ramps = mel_pts[:, None] - fft_freqs[None, :]
    lower = -ramps[:-2] / fdiff[:-1, None]
    upper = ramps[2:] / fdiff[1:, None]
    weights = np.maximum(0.0, np.minimum(lower, upper))
    weights *= (2.0 / (mel_pts[2:] - mel_pts[:-2]))[:, None]   # equal area per filter (Slaney)
    return weights.astype(np.float32)


@lru_cache(maxsize=8)
def mel_filters_tensor(n_mels: int, device: torch.device | str = "cpu") -> torch.Tensor:
    return torch.from_numpy(mel_filterbank(n_mels)).to(device)


@lru_cache(maxsize=4)
def _hann_window(device: torch.device | str) -> torch.Tensor:
    return torch.hann_window(N_FFT, device=device)


def feature_device(device: torch.device) -> torch.device | None:
    """Where a model on `device` computes its log-mel: on its GPU (as openai-whisper does for a
    model there: 30 s cost ~10 ms of a Xeon's CPU), on the CPU otherwise (None)."""
    return device if device.type == "cuda" else None


# More channels than any microphone array or ambisonic order this serves: a 2-D array with more
# is channel-first ([channels, samples], as torchaudio and librosa give), whose mixdown over the
# last axis would silently turn the whole clip into a few samples.
MAX_CHANNELS = 64


def _channel_first_error(shape: tuple[int, ...]) -> ValueError:
    return ValueError(f"audio of shape {shape} looks channel-first ([channels, samples], as torchaudio "
                      f"and librosa give); 2-D audio must be [samples, channels]: pass audio.T")


def to_float_mono(audio: np.ndarray) -> np.ndarray:
    """PCM of any common dtype, [samples] or [samples, channels] (at most MAX_CHANNELS) -> float32
    mono in [-1, 1]. A block of a longer stream may have fewer samples than channels. Float samples
    peaking past MAX_FLOAT_PEAK are a ValueError (int16 values stored as floats, most likely)."""
    audio = np.asarray(audio)
    if audio.ndim not in (1, 2):
        raise ValueError(f"audio must be [samples] or [samples, channels], got shape {audio.shape}")
    if audio.size == 0:
        raise ValueError("audio is empty")
    if audio.ndim == 2 and audio.shape[1] > MAX_CHANNELS:
        raise _channel_first_error(audio.shape)
    if np.issubdtype(audio.dtype, np.floating) and not np.isfinite(audio).all():
        raise ValueError("audio contains NaN or infinite samples")
    # finite but no audio (read_wav's bound): ~1e18 failed inside torch's int8 quantization
    peak = float(np.abs(audio).max()) if np.issubdtype(audio.dtype, np.floating) else 0.0
    if peak > MAX_FLOAT_SAMPLE:
        raise ValueError(f"float samples up to {peak:.3g}, where audio lies within [-1, 1] (at most "
                         f"{MAX_FLOAT_SAMPLE:g} is taken): not audio")
    # Every model's input passes here (prepare_audio, the streamed front end), so this is the one
    # place the rule is kept; read_wav still reads such files, for the WAV player to rescale.
    if peak > MAX_FLOAT_PEAK:
        raise ValueError(f"float samples up to {peak:.6g}, where audio lies within [-1, 1] (peaks up to "
                         f"{MAX_FLOAT_PEAK:g} are taken): this looks like int16 values stored as floats; "
                         f"divide them by 32768")
    x = pcm_to_float(audio)
    if x.ndim == 2:   # mixed down after scaling, so integer sums cannot overflow
        x = x.mean(axis=1, dtype=np.float32)
    return np.ascontiguousarray(x)


def resample(audio: np.ndarray, sample_rate: int, target: int = SAMPLE_RATE) -> np.ndarray:
    """Polyphase resampling (anti-aliased) from any integer rate to `target`."""
    if sample_rate == target:
        return audio
    from scipy.signal import resample_poly

    g = gcd(int(sample_rate), target)
    return resample_poly(audio, target // g, int(sample_rate) // g).astype(np.float32)


# The input rates prepare_audio resamples from (the CLI's bounds on a file's header): past them no
# recording lies, and the polyphase filter grows with the rate (its length ~20x the rate's
# reduced ratio to the target): 1000 samples declared at 99,999,989 Hz were a filter of 2e10
# taps, the process killed for its memory.
MIN_INPUT_RATE, MAX_INPUT_RATE = 1_000, 768_000


def prepare_audio(audio: np.ndarray, sample_rate: int = SAMPLE_RATE, target: int = SAMPLE_RATE) -> np.ndarray:
    """Validate and convert user audio to mono float32 at `target` Hz; ValueError on bad input
    (a sample_rate that is not a whole number of Hz from MIN_INPUT_RATE to MAX_INPUT_RATE)."""
    valid = (isinstance(sample_rate, (int, float, np.integer, np.floating))
             and not isinstance(sample_rate, bool) and np.isfinite(sample_rate)
             and sample_rate > 0 and float(sample_rate).is_integer())
    if not valid:
        raise ValueError(f"sample_rate must be a positive whole number of Hz, got {sample_rate!r}")
    if not MIN_INPUT_RATE <= sample_rate <= MAX_INPUT_RATE:
        raise ValueError(f"sample_rate {sample_rate!r} Hz is outside {MIN_INPUT_RATE} to {MAX_INPUT_RATE} Hz, "
                         f"where recordings lie")
    audio = np.asarray(audio)
    # A whole clip with more channels than samples is a short channel-first one (a stream's last
    # block may be that short, so to_float_mono alone cannot refuse it).
    if audio.ndim == 2 and audio.size and audio.shape[1] > audio.shape[0]:
        raise _channel_first_error(audio.shape)
    return resample(to_float_mono(audio), int(sample_rate), target)


def log_mel_spectrogram(audio: np.ndarray | torch.Tensor, n_mels: int = 80,
                        padding: int = 0, device: torch.device | None = None) -> torch.Tensor:
    """[n_mels, frames] log-mel of 16 kHz float audio, after appending `padding` zero samples,
    computed on `device` (None: where the audio is) and left there.

    The max - 8 floor is taken over the whole (padded) input, as openai-whisper does; feeding a
    30 s window gives exactly the 3000 frames the encoder expects.
    """
    x = torch.as_tensor(audio, dtype=torch.float32)
    if device is not None:
        x = x.to(device)
    if padding > 0:
        x = torch.nn.functional.pad(x, (0, padding))
    stft = torch.stft(x, N_FFT, HOP_LENGTH, window=_hann_window(x.device), return_complex=True)
    power = stft[..., :-1].abs() ** 2
    mel = mel_filters_tensor(n_mels, x.device) @ power
    log_spec = torch.clamp(mel, min=1e-10).log10()
    log_spec = torch.maximum(log_spec, log_spec.max() - 8.0)
    return (log_spec + 4.0) / 4.0
