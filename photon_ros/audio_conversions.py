"""Audio messages <-> float32 mono PCM with its sample rate, no node needed.

Accepted inputs: our `photon_ros/AudioChunk` (format and rate travel with the data),
`std_msgs/Int16MultiArray` and `std_msgs/Float32MultiArray` (the rate and channel count cannot
travel with these, so the caller states them; a two-dimensional `layout` overrides the channel
count: [samples, channels], or [channels, samples] where its labels say so, see `_interleaved`).
Multi-channel audio is averaged to mono, since speech models take one channel. Malformed chunks
raise ValueError naming the problem. `bytes_to_samples` and `samples_to_pcm` are the decoding
steps, shared with photon_ros.audio_common_conversions.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
from std_msgs.msg import Float32MultiArray, Int16MultiArray, MultiArrayDimension

from photon_core.audio_io import check_float_samples, pcm_to_float
from photon_ros.msg import AudioChunk

# dtype of one sample, and the scale that maps it to [-1, 1]
_FORMATS: dict[str, tuple[str, float, float]] = {
    AudioChunk.FORMAT_S16LE: ("<i2", 32768.0, 0.0),
    AudioChunk.FORMAT_S32LE: ("<i4", 2147483648.0, 0.0),
    AudioChunk.FORMAT_F32LE: ("<f4", 1.0, 0.0),
    AudioChunk.FORMAT_U8: ("u1", 128.0, 128.0),
}


# Float PCM is nominally in [-1, 1]; overshoot up to this peak is kept (inter-sample peaks, gain
# before a limiter). Beyond it the data is not float PCM: integer-scaled samples in a float field,
# or integer bytes declared as floats. (The file readers take up to audio_io.MAX_FLOAT_SAMPLE: a
# file says what it holds; a message's float field is filled by code that may have forgotten to scale.)
FLOAT_PEAK_LIMIT = 2.0
# photon_core.runtime.audio_frontend.MAX_CHANNELS (that module imports torch): more channels than
# a microphone array has is a layout read the wrong way round, whose mixdown is a few samples.
MAX_CHANNELS = 64


class EmptyAudio(ValueError):
    """A message that holds no samples: refused, though no audio went missing with it."""


class Pcm(NamedTuple):
    samples: np.ndarray     # float32, mono, nominally in [-1, 1]
    sample_rate: int


def _to_mono(interleaved: np.ndarray, channels: int) -> np.ndarray:
    if channels < 1:
        raise ValueError(f"audio has {channels} channels")
    if interleaved.size == 0:
        raise EmptyAudio("audio chunk is empty")
    if interleaved.size % channels:
        raise ValueError(f"audio has {interleaved.size} samples, not a multiple of {channels} channels")
    if channels == 1:
        return interleaved
    return interleaved.reshape(-1, channels).mean(axis=1, dtype=np.float32)


def _check(samples: np.ndarray, sample_rate: int) -> Pcm:
    if sample_rate <= 0:
        raise ValueError(f"sample rate must be positive, got {sample_rate}")
    # The file readers' rule: NaN, infinities and values no audio has (1e30) are refused here, not
    # left to overflow the VAD and turn the model's probabilities into NaN.
    check_float_samples(samples, "audio")
    return Pcm(samples.astype(np.float32, copy=False), int(sample_rate))


def check_float_peak(values: np.ndarray, what: str = "audio") -> None:
    """ValueError where float samples peak beyond FLOAT_PEAK_LIMIT (integer samples pass)."""
    if values.dtype.kind != "f" or values.size == 0:
        return
    finite = values[np.isfinite(values)]   # NaN and infinities get their own error later
    peak = float(np.abs(finite).max()) if finite.size else 0.0
    if peak > FLOAT_PEAK_LIMIT:
        raise ValueError(f"{what}: float samples reach {peak:g}, far outside [-1, 1]: this is not "
                         f"float PCM (integer samples in a float field, or a wrong sample format?)")


def bytes_to_samples(data, dtype: str | np.dtype, sample_format: str) -> np.ndarray:
    """Raw sample bytes (bytes, or a uint8 array such as a message's uint8[] field) viewed as
    interleaved samples of `dtype`; `sample_format` names the format in the error."""
    raw = np.frombuffer(data, dtype=np.uint8)
    width = np.dtype(dtype).itemsize
    if raw.size % width:
        raise ValueError(f"audio data has {raw.size} bytes, not a whole number of "
                         f"{sample_format} samples")
    return raw.view(dtype)


def samples_to_pcm(values: np.ndarray, channels: int, sample_rate: int) -> Pcm:
    """Interleaved samples of any PCM dtype (8-bit unsigned with silence at 128, wider signed
    integers, floats in [-1, 1]; see photon_core.audio_io.pcm_to_float) as mono float32 Pcm."""
    check_float_peak(values)
    return _check(_to_mono(pcm_to_float(values), int(channels)), sample_rate)


def audio_chunk_to_pcm(msg: AudioChunk) -> Pcm:
    spec = _FORMATS.get(msg.sample_format)
    if spec is None:
        raise ValueError(f"unsupported sample format {msg.sample_format!r}; "
                         f"supported: {', '.join(_FORMATS)}")
    return samples_to_pcm(bytes_to_samples(msg.data, spec[0], msg.sample_format),
                          msg.channels, msg.sample_rate)


def _interleaved(msg, values: np.ndarray, default: int) -> tuple[np.ndarray, int]:
    """A MultiArray's samples interleaved, and its channel count. A two-dimensional layout says
    which: [samples, channels] (interleaved, as ours) or, where its first dimension is labelled a
    channel or its second samples ("mic", "samples"), [channels, samples] (planar, as some
    microphone arrays send): transposed here. A layout the data does not fill is refused: read as
    the other one, planar audio is noise; so is one of more than MAX_CHANNELS channels."""
    dims = msg.layout.dim
    if len(dims) < 2:
        return values, default
    rows, cols = int(dims[0].size), int(dims[1].size)
    if rows * cols != values.size:
        raise ValueError(f"the array's layout says {rows} x {cols} samples but it holds {values.size}")
    first, second = dims[0].label.lower(), dims[1].label.lower()
    planar = (("chan" in first and "chan" not in second)
              or ("sample" in second and "sample" not in first))
    channels = rows if planar else cols
    if channels > MAX_CHANNELS:
        read = "[channels, samples]" if planar else "[samples, channels]"
        raise ValueError(f"the array's {rows} x {cols} layout (labels {dims[0].label!r}, {dims[1].label!r}), "
                         f"read as {read}, has {channels} channels, more than {MAX_CHANNELS}: label its "
                         f"dimensions \"channels\" and \"samples\" in the order the data has them")
    if planar:
        return np.ascontiguousarray(values.reshape(rows, cols).T).reshape(-1), rows
    return values, cols


def int16_array_to_pcm(msg: Int16MultiArray, sample_rate: int, channels: int = 1) -> Pcm:
    values = np.asarray(msg.data, dtype=np.int16)[msg.layout.data_offset:]
    mono = _to_mono(*_interleaved(msg, values, channels))
    return _check(mono.astype(np.float32) / 32768.0, sample_rate)


def float32_array_to_pcm(msg: Float32MultiArray, sample_rate: int, channels: int = 1) -> Pcm:
    values = np.asarray(msg.data, dtype=np.float32)[msg.layout.data_offset:]
    check_float_peak(values)
    return _check(_to_mono(*_interleaved(msg, values, channels)), sample_rate)


def _as_interleaved(samples: np.ndarray) -> tuple[np.ndarray, int]:
    samples = np.asarray(samples)
    if samples.dtype.kind in "fc" and not np.isfinite(samples).all():
        # cast to an integer format they were garbage samples (with a RuntimeWarning at most);
        # as floats, a message every reader refuses
        raise ValueError("samples hold NaN or infinite values: not audio to publish")
    if samples.ndim == 1:
        return samples, 1
    if samples.ndim == 2:
        return samples.reshape(-1), samples.shape[1]
    raise ValueError(f"expected samples shaped [n] or [n, channels], got {samples.shape}")


def _as_float32(interleaved: np.ndarray) -> np.ndarray:
    """Float PCM as float32, refused where the cast overflows (a finite float64 of 1e39 became inf:
    a message every reader refuses)."""
    with np.errstate(over="ignore"):   # said below, as an error
        values = pcm_to_float(interleaved)
    if not np.isfinite(values).all():
        raise ValueError("samples overflow float32: not audio to publish")
    return values


def pcm_to_audio_chunk(samples: np.ndarray, sample_rate: int, sample_format: str = AudioChunk.FORMAT_S16LE,
                       header=None) -> AudioChunk:
    """Float ([-1, 1]) or int16 samples, [n] or [n, channels], as an AudioChunk."""
    spec = _FORMATS.get(sample_format)
    if spec is None:
        raise ValueError(f"unsupported sample format {sample_format!r}")
    dtype, scale, offset = spec
    interleaved, channels = _as_interleaved(samples)
    if sample_format == AudioChunk.FORMAT_S16LE and interleaved.dtype == np.int16:
        encoded = interleaved.astype("<i2")
    elif sample_format == AudioChunk.FORMAT_F32LE:
        encoded = _as_float32(interleaved).astype("<f4")
    elif sample_format == AudioChunk.FORMAT_S32LE and interleaved.dtype == np.int32:
        encoded = interleaved.astype("<i4")
    else:
        # in float64: float32 rounds 2**31 - 1 up to 2**31, which the cast wraps to -2**31
        info = np.iinfo(np.dtype(dtype))
        scaled = np.round(pcm_to_float(interleaved).astype(np.float64) * scale + offset)
        encoded = np.clip(scaled, info.min, info.max).astype(dtype)
    msg = AudioChunk()
    if header is not None:
        msg.header = header
    msg.sample_rate = int(sample_rate)
    msg.channels = channels
    msg.sample_format = sample_format
    msg.data = encoded.tobytes()
    return msg


def _layout(msg, n: int, channels: int) -> None:
    msg.layout.dim = [MultiArrayDimension(label="samples", size=n // channels, stride=n),
                      MultiArrayDimension(label="channels", size=channels, stride=channels)]


def pcm_to_int16_array(samples: np.ndarray) -> Int16MultiArray:
    interleaved, channels = _as_interleaved(samples)
    if interleaved.dtype != np.int16:
        interleaved = np.clip(np.round(pcm_to_float(interleaved) * 32768.0), -32768, 32767).astype(np.int16)
    msg = Int16MultiArray()
    _layout(msg, interleaved.size, channels)
    msg.data = interleaved
    return msg


def pcm_to_float32_array(samples: np.ndarray) -> Float32MultiArray:
    interleaved, channels = _as_interleaved(samples)
    msg = Float32MultiArray()
    _layout(msg, interleaved.size, channels)
    msg.data = _as_float32(interleaved)
    return msg
