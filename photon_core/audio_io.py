"""Audio files and PCM sample formats, with the standard library (and soundfile where installed).

WAV files are read here, chunk by chunk, rather than with the `wave` module: it refuses
WAVE_FORMAT_EXTENSIBLE (what sox and most tools write for 24-bit, float or more than 2 channels)
and IEEE float data, and it fails without the file's name on damaged headers.
"""
from __future__ import annotations

import logging
import struct
import wave
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Iterator

import numpy as np

_log = logging.getLogger(__name__)

_PCM, _FLOAT, _EXTENSIBLE = 0x0001, 0x0003, 0xFFFE
_PCM_DTYPES: dict[int, np.dtype] = {1: np.dtype("u1"), 2: np.dtype("<i2"), 4: np.dtype("<i4")}   # 3 bytes: see _int24
_FLOAT_DTYPES: dict[int, np.dtype] = {4: np.dtype("<f4"), 8: np.dtype("<f8")}

# Float samples are nominally within [-1, 1]. Files are read up to 2**15: files written on the
# int16 scale exist, and the WAV player rescales them. Beyond that the values are not audio, and
# their squares overflow float32 inside the models.
MAX_FLOAT_SAMPLE = 32768.0

# The models take less (audio_frontend.to_float_mono): their input is not scale-free. Whisper's and
# Qwen3-ASR's log-mel is floored at its max - 8 and then (x + 4) / 4, so audio x32768 moved every
# feature by ~2.3, and the speech gates' floors are in dBFS. Real float audio overshoots full scale a
# little (inter-sample peaks after resampling, gain before a limiter: rarely past 2, +6 dB), and 4
# leaves it room; int16 values stored as floats peak past 4 unless the clip is under -78 dBFS.
MAX_FLOAT_PEAK = 4.0


class AudioFileError(ValueError):
    """An audio file that cannot be read; the message names the file and says why."""


def pcm_to_float(samples: np.ndarray) -> np.ndarray:
    """PCM of any common dtype as float32 in [-1, 1], same shape. 8-bit PCM is unsigned
    (silence at 128); wider integers are signed (WAV's convention): uint16/uint32/uint64 are
    refused, as no convention says where their silence is, and int64 (no PCM is 64-bit: a list of
    ints) too."""
    samples = np.asarray(samples)
    if samples.dtype == np.uint8:
        return (samples.astype(np.float32) - 128.0) / 128.0
    if np.issubdtype(samples.dtype, np.unsignedinteger):
        # Scaled like a signed type they divide by -min = 0: NaN and inf, then a misleading
        # "audio contains NaN" far from the cause.
        raise ValueError(f"unsupported audio dtype {samples.dtype}: PCM wider than 8 bits is signed "
                         f"(int16, int32); for offset-binary samples subtract 2**{samples.dtype.itemsize * 8 - 1} "
                         f"into a signed type first")
    if samples.dtype == np.int64:
        # No audio format holds 64-bit PCM: these are int16 or int32 values that came as a list
        # (np.asarray makes int64 of it), and scaled by 2**63 they were silence.
        raise ValueError("unsupported audio dtype int64: no PCM is 64-bit; integer samples given as a "
                         "list or an int64 array are int16 or int32 values: pass np.asarray(samples, np.int16) "
                         "(or np.int32)")
    if np.issubdtype(samples.dtype, np.integer):
        return samples.astype(np.float32) / float(-np.iinfo(samples.dtype).min)
    if np.issubdtype(samples.dtype, np.floating):
        return samples.astype(np.float32, copy=False)
    raise ValueError(f"unsupported audio dtype {samples.dtype}")


def check_float_samples(samples: np.ndarray, source: str, first_frame: int = 0) -> None:
    """AudioFileError naming `source` when float samples hold NaN, infinities or values no audio
    has (beyond MAX_FLOAT_SAMPLE); integer PCM always passes. `first_frame`: the file's frame
    number of samples[0] (a block of a longer file), so the message points into the file."""
    samples = np.asarray(samples)
    if not np.issubdtype(samples.dtype, np.floating) or samples.size == 0:
        return
    finite = np.isfinite(samples)
    if not finite.all():
        bad = first_frame + int(np.argmin(finite.reshape(len(samples), -1).all(axis=1)))
        raise AudioFileError(f"{source}: holds NaN or infinite samples ({int((~finite).sum())} of "
                             f"them, the first in frame {bad}): not audio")
    peak = float(np.abs(samples).max())
    if peak > MAX_FLOAT_SAMPLE:
        raise AudioFileError(f"{source}: float samples up to {peak:.3g}, where audio lies within "
                             f"[-1, 1] (at most {MAX_FLOAT_SAMPLE:g} is taken): not audio")


def read_wav(path: str | Path) -> tuple[np.ndarray, int]:
    """Samples ([n] mono or [n, channels]) and the sample rate of a WAV file: PCM as uint8
    (8-bit), int16, int32 (24-bit samples scaled to the int32 range, and 32-bit), IEEE float as
    float32; plain or WAVE_FORMAT_EXTENSIBLE headers, any channel count. Other files (FLAC, OGG,
    compressed WAV, ...) go through soundfile when it is installed and come back as float32.
    AudioFileError (a ValueError) names the file and the reason when it cannot be read. A data
    chunk the file cuts short (a recording that ended abruptly) is read to its last whole frame,
    with a warning."""
    path = Path(path)
    if path.is_dir():
        raise AudioFileError(f"{path}: is a directory, not an audio file")
    try:
        with open(path, "rb") as f:
            head = f.read(12)
            if len(head) == 12 and head[:4] == b"RIFF" and head[8:12] == b"WAVE":
                samples, rate = _read_riff_wave(f, path)
                check_float_samples(samples, str(path))
                return samples, rate
    except FileNotFoundError:
        raise AudioFileError(f"{path}: no such file") from None
    except OSError as err:
        raise AudioFileError(f"{path}: cannot read it ({err.strerror or err})") from None
    samples, rate = _read_with_soundfile(path, "not a RIFF/WAVE file")
    check_float_samples(samples, str(path))
    return samples, rate


class _Unsupported(Exception):
    """A well-formed WAV whose encoding this reader does not decode (soundfile may)."""


def _read_riff_wave(f, path: Path) -> tuple[np.ndarray, int]:
    fmt, size = _seek_data(f, path)
    try:
        dtype, width, channels, rate = _parse_fmt(fmt, path)
    except _Unsupported as err:
        return _read_with_soundfile(path, str(err))
    return _right_justified_24(_read_data(f, size, dtype, width, channels, path), fmt, path), rate


def _right_justified_24(samples: np.ndarray, fmt: bytes, path: Path) -> np.ndarray:
    """Plain PCM headers declaring fewer bits than their 4-byte words leave open where the bits
    sit: left-justified (the WAVE rule, read as they are) or right-justified, as `arecord -f
    S24_LE` writes them, which read as int32 were 48 dB too quiet, under the speech detector's
    floor. Told apart by the data (_justified_shift); right-justified ones are shifted into place."""
    if samples.dtype != np.int32 or samples.size == 0:
        return samples
    shift = _justified_shift(fmt, bool((samples & 0xFF).any()), int(samples.min()), int(samples.max()), path)
    return samples << shift if shift else samples


def _justified_shift(fmt: bytes, low_byte_used: bool, lowest: int, highest: int, path: Path) -> int:
    """How far a file's int32 words must be shifted left to put its declared bits on top: 0 for a
    low byte never used (left-justified) or for values that do not fit the declared bits; 32 - bits
    where all of them fit, sign-extended (right-justified: warned). Decided over the whole file,
    so a stream's blocks are read alike."""
    tag, _, _, _, _, bits = struct.unpack("<HHIIHH", fmt[:16])
    if tag != _PCM or not 8 < bits < 32 or not low_byte_used:
        return 0
    if -(1 << (bits - 1)) <= lowest and highest < 1 << (bits - 1):
        _log.warning("%s: %d-bit samples right-justified in 32-bit words (as arecord S24_LE writes them): "
                     "read as such", path, bits)
        return 32 - bits
    return 0


def _seek_data(f, path: Path) -> tuple[bytes, int]:
    """Walks the chunks after "RIFF....WAVE" to the data chunk: (the fmt chunk's bytes, the data
    size its header declares), the file positioned at the first sample."""
    fmt = None
    while True:
        header = f.read(8)
        if len(header) < 8:
            what = "no data chunk" if fmt is not None else "no fmt chunk"
            raise AudioFileError(f"{path}: a damaged WAV file ({what})")
        chunk_id, size = header[:4], struct.unpack("<I", header[4:])[0]
        if chunk_id == b"fmt ":
            fmt = f.read(size)
            if len(fmt) < 16:
                raise AudioFileError(f"{path}: a damaged WAV file (its fmt chunk is {len(fmt)} bytes)")
            f.seek(size & 1, 1)   # chunks are padded to an even size
        elif chunk_id == b"data":
            if fmt is None:
                raise AudioFileError(f"{path}: a damaged WAV file (data before the fmt chunk)")
            if size == 0 and (rest := _placeholder_data(f)):
                _log.warning("%s: its data chunk declares 0 bytes but %d follow it (a writer that "
                             "never closed the file leaves 0): read them as its audio", path, rest)
                return fmt, rest
            return fmt, size
        else:
            f.seek(size + (size & 1), 1)


def _placeholder_data(f) -> int:
    """Bytes after an empty data chunk when they are audio (0 otherwise): anything but a run of
    chunks (4-letter ids, sizes that end at the end of the file) that a closed file may hold there."""
    start = f.tell()
    end = f.seek(0, 2)
    pos = start
    while pos + 8 <= end:
        f.seek(pos)
        header = f.read(8)
        size = struct.unpack("<I", header[4:])[0]
        if not all(32 <= b < 127 for b in header[:4]) or pos + 8 + size > end:
            break
        pos += 8 + size + (size & 1)
    f.seek(start)
    # chunks to within a few bytes of the end (a writer's padding): no audio there
    return 0 if pos >= end or (pos > start and end - pos < 8) else end - start


def _parse_fmt(fmt: bytes, path: Path) -> tuple[np.dtype | None, int, int, int]:
    """(dtype or None for 24-bit, bytes per sample, channels, rate) of a fmt chunk."""
    tag, channels, rate, _, block_align, bits = struct.unpack("<HHIIHH", fmt[:16])
    if tag == _EXTENSIBLE:
        if len(fmt) < 26:
            raise AudioFileError(f"{path}: a damaged WAV file (WAVE_FORMAT_EXTENSIBLE without its subformat)")
        tag = struct.unpack("<H", fmt[24:26])[0]   # the subformat GUID starts with the format tag
    if channels == 0:
        raise AudioFileError(f"{path}: declares 0 channels: a damaged WAV file")
    if rate == 0:
        raise AudioFileError(f"{path}: declares a sample rate of 0 Hz: a damaged WAV file")
    width = block_align // channels if block_align else 0
    if width == 0 or block_align != width * channels or bits > 8 * width:
        raise AudioFileError(f"{path}: inconsistent fmt chunk ({channels} channels of {bits} bits "
                             f"in {block_align}-byte frames): a damaged WAV file")
    if tag == _PCM and (width in _PCM_DTYPES or width == 3):
        return _PCM_DTYPES.get(width), width, channels, rate
    if tag == _FLOAT and width in _FLOAT_DTYPES:
        return _FLOAT_DTYPES[width], width, channels, rate
    kind = {_PCM: "PCM", _FLOAT: "float"}.get(tag, f"format tag 0x{tag:04x}")
    raise _Unsupported(f"{kind} samples of {8 * width} bits are not read here (PCM 8/16/24/32-bit "
                       f"and float 32/64-bit are)")


def _read_data(f, declared: int, dtype: np.dtype | None, width: int, channels: int,
               path: Path) -> np.ndarray:
    raw = f.read(declared)
    frame = width * channels
    whole = len(raw) // frame * frame
    if whole < declared:
        # Streaming writers leave a placeholder size; recordings cut short end mid-frame. What is
        # there is read; a result from part of a file is said, not silent.
        _log.warning("%s: the audio data ends after %d of the %d bytes its header declares "
                     "(%d byte(s) of a partial frame dropped): read %d whole frames",
                     path, len(raw), declared, len(raw) - whole, whole // frame)
    raw = raw[:whole]
    if dtype is None:
        samples = _int24(raw)
    else:
        samples = np.frombuffer(raw, dtype=dtype)
        if dtype.kind == "f":
            samples = samples.astype(np.float32, copy=False)
    return samples.reshape(-1, channels) if channels > 1 else samples


def _int24(raw: bytes) -> np.ndarray:
    """Little-endian 24-bit samples as int32, scaled to the int32 range (low byte zero)."""
    wide = np.zeros((len(raw) // 3, 4), np.uint8)
    wide[:, 1:] = np.frombuffer(raw, dtype=np.uint8).reshape(-1, 3)
    return wide.view("<i4").reshape(-1).astype(np.int32, copy=False)


def _read_with_soundfile(path: Path, why: str) -> tuple[np.ndarray, int]:
    try:
        import soundfile
    except ImportError:
        raise AudioFileError(f"{path}: {why}; install soundfile to read other formats, or convert "
                             f"it with `sox {path} -e signed-integer -b 16 out.wav`") from None
    try:
        samples, rate = soundfile.read(str(path), dtype="float32", always_2d=False)
    except RuntimeError as err:   # soundfile's errors for files it cannot read derive from it
        raise AudioFileError(f"{path}: {why}, and soundfile cannot read it either ({err})") from None
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


# Frames per block when a stream's caller does not say: 2**16 (4 s at 16 kHz, 0.34 s at 192 kHz),
# a few MB at most for any channel count a file is likely to hold.
STREAM_BLOCK_FRAMES = 1 << 16


class AudioStream(ABC):
    """An audio file read block by block, for files too long to hold whole: each `blocks()` call
    reads it from the start again (a caller may make two passes), each block as `read_wav` would
    give that stretch of the file ([n] mono or [n, channels], the same dtypes), float blocks
    checked as read_wav checks the whole file. Open one with `open_audio_stream`."""

    def __init__(self, path: Path, rate: int, channels: int, frames: int):
        self.path = path
        self.rate = rate
        self.channels = channels
        self.frames = frames   # whole frames that will be read

    @abstractmethod
    def blocks(self, frames: int = STREAM_BLOCK_FRAMES) -> Iterator[np.ndarray]:
        """The file's samples from its start, `frames` frames a block (the last one shorter)."""


class _RiffStream(AudioStream):
    def __init__(self, path: Path, rate: int, channels: int, frames: int, offset: int,
                 dtype: np.dtype | None, width: int, fmt: bytes = b""):
        super().__init__(path, rate, channels, frames)
        self._offset, self._dtype, self._width = offset, dtype, width
        self._shift = 0
        if dtype == np.int32 and len(fmt) >= 16 and frames:
            # where 24 bits sit in their 4-byte words, read once over the file as read_wav does
            low, lo, hi = False, 0, 0
            for block in self.blocks():
                low, lo, hi = low or bool((block & 0xFF).any()), min(lo, int(block.min())), max(hi, int(block.max()))
            self._shift = _justified_shift(fmt, low, lo, hi, path)

    def blocks(self, frames: int = STREAM_BLOCK_FRAMES) -> Iterator[np.ndarray]:
        if frames <= 0:
            raise ValueError(f"frames per block must be positive, got {frames}")
        frame_bytes = self._width * self.channels
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                done = 0
                while done < self.frames:
                    n = min(frames, self.frames - done)
                    raw = f.read(n * frame_bytes)
                    if len(raw) < n * frame_bytes:   # the file changed since it was opened
                        raise AudioFileError(f"{self.path}: ended after {done + len(raw) // frame_bytes} "
                                             f"of its {self.frames} frames while being read")
                    samples = (_int24(raw) if self._dtype is None
                               else np.frombuffer(raw, dtype=self._dtype))
                    if self._dtype is not None and self._dtype.kind == "f":
                        samples = samples.astype(np.float32, copy=False)
                    if self._shift:
                        samples = samples << self._shift
                    if self.channels > 1:
                        samples = samples.reshape(-1, self.channels)
                    check_float_samples(samples, str(self.path), first_frame=done)
                    yield samples
                    done += n
        except OSError as err:
            raise AudioFileError(f"{self.path}: cannot read it ({err.strerror or err})") from None


class _SoundfileStream(AudioStream):
    def blocks(self, frames: int = STREAM_BLOCK_FRAMES) -> Iterator[np.ndarray]:
        if frames <= 0:
            raise ValueError(f"frames per block must be positive, got {frames}")
        import soundfile
        done = 0
        try:
            with soundfile.SoundFile(str(self.path)) as f:
                while done < self.frames:
                    samples = f.read(min(frames, self.frames - done), dtype="float32", always_2d=False)
                    if len(samples) == 0:
                        break
                    check_float_samples(samples, str(self.path), first_frame=done)
                    yield samples
                    done += len(samples)
        except RuntimeError as err:   # soundfile's errors derive from it
            raise AudioFileError(f"{self.path}: cannot read it ({err})") from None


def open_audio_stream(path: str | Path) -> AudioStream:
    """`read_wav`'s files (the same formats, errors and warnings) as an AudioStream: the header is
    read and checked now, the samples only as blocks are asked for, so memory does not grow with
    the file's length."""
    path = Path(path)
    if path.is_dir():
        raise AudioFileError(f"{path}: is a directory, not an audio file")
    why = "not a RIFF/WAVE file"
    try:
        with open(path, "rb") as f:
            head = f.read(12)
            if len(head) == 12 and head[:4] == b"RIFF" and head[8:12] == b"WAVE":
                fmt, declared = _seek_data(f, path)
                try:
                    dtype, width, channels, rate = _parse_fmt(fmt, path)
                except _Unsupported as err:
                    why = str(err)
                else:
                    offset = f.tell()
                    available = f.seek(0, 2) - offset
                    frame = width * channels
                    whole = min(declared, available) // frame * frame
                    if whole < declared:   # read_wav's warning for a file cut short
                        _log.warning("%s: the audio data ends after %d of the %d bytes its header "
                                     "declares (%d byte(s) of a partial frame dropped): read %d whole "
                                     "frames", path, min(declared, available), declared,
                                     min(declared, available) - whole, whole // frame)
                    return _RiffStream(path, rate, channels, whole // frame, offset, dtype, width, fmt)
    except FileNotFoundError:
        raise AudioFileError(f"{path}: no such file") from None
    except OSError as err:
        raise AudioFileError(f"{path}: cannot read it ({err.strerror or err})") from None
    try:
        import soundfile
    except ImportError:
        raise AudioFileError(f"{path}: {why}; install soundfile to read other formats, or convert "
                             f"it with `sox {path} -e signed-integer -b 16 out.wav`") from None
    try:
        info = soundfile.info(str(path))
    except RuntimeError as err:
        raise AudioFileError(f"{path}: {why}, and soundfile cannot read it either ({err})") from None
    return _SoundfileStream(path, int(info.samplerate), int(info.channels), int(info.frames))
