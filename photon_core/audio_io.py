"""Audio files and PCM sample formats, with the standard library (and soundfile where installed)."""
from __future__ import annotations

import wave
from pathlib import Path

import numpy as np

_WAV_DTYPES = {1: np.dtype("u1"), 2: np.dtype("<i2"), 4: np.dtype("<i4")}


def pcm_to_float(samples: np.ndarray) -> np.ndarray:
    """PCM of any common dtype as float32 in [-1, 1], same shape. 8-bit PCM is unsigned
    (silence at 128); wider integers are signed."""
    samples = np.asarray(samples)
    if samples.dtype == np.uint8:
        return (samples.astype(np.float32) - 128.0) / 128.0
    if np.issubdtype(samples.dtype, np.integer):
        return samples.astype(np.float32) / float(-np.iinfo(samples.dtype).min)
    if np.issubdtype(samples.dtype, np.floating):
        return samples.astype(np.float32, copy=False)
    raise ValueError(f"unsupported audio dtype {samples.dtype}")


def read_wav(path: str | Path) -> tuple[np.ndarray, int]:
    """PCM samples as stored ([n] mono or [n, channels]; uint8, int16 or int32 for PCM WAV) and
    the sample rate. Other formats (24-bit or float WAV, FLAC, ...) go through soundfile when it is
    installed and come back as float32."""
    try:
        with wave.open(str(path), "rb") as f:
            width, channels, rate = f.getsampwidth(), f.getnchannels(), f.getframerate()
            if width in _WAV_DTYPES:
                samples = np.frombuffer(f.readframes(f.getnframes()), dtype=_WAV_DTYPES[width])
                return (samples.reshape(-1, channels) if channels > 1 else samples), rate
    except (wave.Error, EOFError):
        pass
    try:
        import soundfile
    except ImportError:
        raise ValueError(f"{path}: not a PCM 8/16/32-bit WAV file; install soundfile to read other "
                         f"formats, or convert it with `sox {path} -b 16 out.wav`") from None
    samples, rate = soundfile.read(str(path), dtype="float32", always_2d=False)
    return samples, rate


def write_wav(path: str | Path, samples: np.ndarray, rate: int) -> None:
    """int16 or float ([-1, 1]) samples, [n] or [n, channels], as a 16-bit PCM WAV."""
    samples = np.asarray(samples)
    if samples.dtype != np.int16:
        samples = np.clip(np.round(pcm_to_float(samples) * 32768.0), -32768, 32767).astype(np.int16)
    channels = 1 if samples.ndim == 1 else samples.shape[1]
    with wave.open(str(path), "wb") as f:
        f.setnchannels(channels)
        f.setsampwidth(2)
        f.setframerate(int(rate))
        f.writeframes(samples.astype("<i2").tobytes())
