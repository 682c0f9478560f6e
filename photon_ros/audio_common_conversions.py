"""Audio of the two ROS 2 `audio_common_msgs` packages -> float32 mono Pcm, no node needed.

Robots publish microphone audio with one of two packages, both named `audio_common_msgs`, so at
most one is importable in a process. Messages are recognised by their fields (duck typing) and the
package is imported only by `audio_common_types()`, so this module imports without either.

mgonzs13/audio_common: `AudioStamped` (header, `audio`) or `Audio` (`audio_data`, `info`). The
format travels in every message: `info.format` is a PortAudio sample-format flag naming the one
`audio_data` array that holds the interleaved samples; `info.channels` and `info.rate` the layout.
Its capturer (audio_capturer_node, C++) stamps a chunk with its clock just before the blocking read
that returns it: about its first sample, late by however long its loop was held up (the speech
node counts such stamps in samples: sample_clock.ReadStamps).

ros-drivers/audio_common (ros2): `AudioData` (`data`, raw bytes) or `AudioDataStamped` (header,
`audio`). The format travels apart, as `AudioInfo` on its own topic: `AudioInfoFormat` keeps the
latest one, and chunks are refused, with the reason, until a usable one has arrived. Only
`coding_format` "wave" is raw PCM; the driver's default, "mp3", is refused.

How a node subscribes (topic names relative to the driver's namespace; QoS as the drivers offer):
  `audio_common_types()` gives the classes importable here ({}: neither package, nothing to do).
  mgonzs13 ("audio_common_msgs/msg/AudioStamped" among them): audio_capturer_node publishes
    AudioStamped on "audio" with sensor-data QoS (best effort, volatile). Decode each message with
    `mgonzs13_to_pcm` (or `audio_common_to_pcm`).
  ros-drivers ("audio_common_msgs/msg/AudioDataStamped" among them): audio_capture_node publishes
    the same audio twice, AudioData on "audio" and AudioDataStamped on "audio_stamped" (reliable,
    depth 10), and AudioInfo on "audio_info" (reliable, depth 1, sent at start and every 5 s:
    volatile in older releases, where the first chunks can come before the first AudioInfo;
    latched, transient local, in newer ones, where a late volatile reader waits for the repeat).
    Its launch files put the three in the namespace "audio". Take one AudioInfoFormat per stream:
    subscribe to "audio_info" with a volatile reader of depth 1 feeding `update`, and a latched
    one once a publisher offers it (photon_ros.latched_topic), and to ONE audio topic, preferably
    "audio_stamped" (its capture stamps show lost audio), decoding with `to_pcm`.
  Best-effort readers match both best-effort and reliable writers. A ValueError means: skip that
  chunk and report its message (it names the reason, e.g. no AudioInfo yet, or mp3).

A declared format the data does not fit raises ValueError naming the mismatch.
"""
from __future__ import annotations

import importlib
from typing import Any, NamedTuple

import numpy as np

from photon_ros.audio_conversions import FLOAT_PEAK_LIMIT, EmptyAudio, Pcm, bytes_to_samples, samples_to_pcm

MGONZS13, ROS_DRIVERS = "mgonzs13", "ros_drivers"

# PortAudio's sample-format flags (portaudio.h; PyAudio's paInt16 etc. are the same numbers),
# each with the AudioData array that carries it and that array's sample type.
_PORTAUDIO_FORMATS: dict[int, tuple[str, str, np.dtype]] = {
    1: ("paFloat32", "float32_data", np.dtype(np.float32)),
    2: ("paInt32", "int32_data", np.dtype(np.int32)),
    8: ("paInt16", "int16_data", np.dtype(np.int16)),
    16: ("paInt8", "int8_data", np.dtype(np.int8)),
    32: ("paUInt8", "uint8_data", np.dtype(np.uint8)),
}
_PORTAUDIO_UNCARRIED = {4: "paInt24", 0x10000: "paCustomFormat"}   # no AudioData array holds these
_MGONZS13_ARRAYS = tuple(spec[1] for spec in _PORTAUDIO_FORMATS.values())

# GStreamer raw-audio format names (what ros-drivers' sample_format carries) that map onto one
# numpy dtype. 24-bit and unsigned 16/32-bit formats are left out: they need their own unpacking.
_GSTREAMER_FORMATS: dict[str, np.dtype] = {
    name: np.dtype(code) for name, code in {
        "U8": "u1", "S8": "i1",
        "S16LE": "<i2", "S16BE": ">i2", "S32LE": "<i4", "S32BE": ">i4",
        "F32LE": "<f4", "F32BE": ">f4", "F64LE": "<f8", "F64BE": ">f8",
    }.items()
}
_RAW_CODINGS = ("wave", "raw")   # the capture node's caps for "wave" are raw PCM (no WAV header)



class DecodedAudio(NamedTuple):
    pcm: Pcm
    stamp: Any | None       # the header's builtin_interfaces/Time; None for unstamped messages
    frame_id: str           # "" for unstamped messages


def audio_common_types() -> dict[str, type]:
    """The message classes of the `audio_common_msgs` importable here, by ROS type name, e.g.
    {"audio_common_msgs/msg/AudioStamped": AudioStamped, ...}; {} when neither package is
    installed. `family_of` tells the family of one of them."""
    try:
        module = importlib.import_module("audio_common_msgs.msg")
    except ImportError:
        return {}
    names = ("AudioStamped", "Audio", "AudioData", "AudioDataStamped", "AudioInfo")
    return {f"audio_common_msgs/msg/{name}": getattr(module, name)
            for name in names if hasattr(module, name)}


def family_of(msg_or_type: Any) -> str | None:
    """MGONZS13, ROS_DRIVERS or None, for a message or a generated message class. Classes are
    told apart by their declared fields, messages by their attributes."""
    fields = getattr(msg_or_type, "get_fields_and_field_types", None)
    if isinstance(msg_or_type, type) and fields is not None:
        declared = fields()
        nested = declared.get("audio", "")
        if nested.endswith("/Audio") or {"audio_data", "float32_data", "format"} & declared.keys():
            return MGONZS13
        if nested.endswith("/AudioData") or ({"data", "sample_format"} & declared.keys()
                                              and "layout" not in declared):
            return ROS_DRIVERS
        return None
    body = getattr(msg_or_type, "audio", msg_or_type)
    if hasattr(body, "audio_data") and hasattr(body, "info"):
        return MGONZS13
    # our AudioChunk and std_msgs arrays have a `data` too, beside fields AudioData lacks
    if hasattr(body, "data") and not (hasattr(body, "sample_format") or hasattr(body, "layout")):
        return ROS_DRIVERS
    return None


def _header_of(msg: Any) -> tuple[Any | None, str]:
    header = getattr(msg, "header", None)
    return (None, "") if header is None else (header.stamp, header.frame_id)


def _in_context(err: ValueError, context: str) -> ValueError:
    """err's message after `context`, an EmptyAudio kept one: the speech node cuts the utterance
    at a refused chunk as at lost audio, but an empty one lost none."""
    return (EmptyAudio if isinstance(err, EmptyAudio) else ValueError)(f"{context}: {err}")


def _typed_array(values: Any, dtype: np.dtype, field: str) -> np.ndarray:
    """A message array field (array.array, numpy array or list) as `dtype`. Generated classes
    already hold the right type; plain lists are checked against the type's range rather than
    wrapped around."""
    if isinstance(values, (bytes, bytearray, memoryview)):
        values = np.frombuffer(values, dtype=np.uint8)
    array = np.asarray(values)
    if array.dtype == dtype:
        return array
    if array.size and dtype.kind in "iu":
        if array.dtype.kind not in "iu":
            raise ValueError(f"{field} holds {array.dtype} values, not integers")
        info = np.iinfo(dtype)
        low, high = array.min(), array.max()
        if low < info.min or high > info.max:
            raise ValueError(f"{field} holds values in {low}..{high}, outside {dtype} "
                             f"({info.min}..{info.max})")
    return array.astype(dtype)


def mgonzs13_to_pcm(msg: Any) -> DecodedAudio:
    """An mgonzs13 `AudioStamped` or `Audio` as mono Pcm, with its stamp."""
    audio = getattr(msg, "audio", msg)
    if not (hasattr(audio, "audio_data") and hasattr(audio, "info")):
        raise ValueError(f"{type(msg).__name__} is not an mgonzs13 audio_common_msgs "
                         f"Audio/AudioStamped")
    info, data = audio.info, audio.audio_data
    code = int(info.format)
    spec = _PORTAUDIO_FORMATS.get(code)
    if spec is None:
        known = ", ".join(f"{c} ({s[0]})" for c, s in _PORTAUDIO_FORMATS.items())
        name = _PORTAUDIO_UNCARRIED.get(code, "unset" if code == 0 else "not a PortAudio format")
        raise ValueError(f"info.format {code} ({name}) is not a format AudioData carries; "
                         f"expected one of {known}")
    name, field, dtype = spec
    filled = {f: len(getattr(data, f)) for f in _MGONZS13_ARRAYS if len(getattr(data, f))}
    others = ", ".join(f"{f} holds {n} values" for f, n in filled.items() if f != field)
    if field not in filled:
        raise (ValueError if others else EmptyAudio)(f"info.format is {code} ({name}) but {field} is empty"
                                                     + (f"; {others}" if others else ""))
    if others:
        raise ValueError(f"info.format is {code} ({name}) but besides {field}, {others}: "
                         f"which array is the audio is ambiguous")
    values = _typed_array(getattr(data, field), dtype, field)
    what = f"{field} ({name}, {int(info.channels)} channel(s), {int(info.rate)} Hz)"
    try:
        pcm = samples_to_pcm(values, int(info.channels), int(info.rate))
    except ValueError as err:
        raise _in_context(err, what) from None
    return DecodedAudio(pcm, *_header_of(msg))


class _RawFormat(NamedTuple):
    sample_format: str
    dtype: np.dtype
    channels: int
    sample_rate: int


class AudioInfoFormat:
    """The format of a ros-drivers audio stream: the latest `AudioInfo` from its own topic.
    `update` takes each AudioInfo; `to_pcm` decodes an AudioData / AudioDataStamped with the
    latest usable one, and refuses with `reason` while there is none (none received yet, or the
    latest one is unusable: mp3, an unknown sample format, no channels or rate)."""

    def __init__(self) -> None:
        self._format: _RawFormat | None = None
        self.reason = "no AudioInfo received yet on the audio_info topic (the driver sends it every 5 s)"

    @property
    def ready(self) -> bool:
        return self._format is not None

    def update(self, info: Any) -> None:
        try:
            self._format, self.reason = self._parse(info), ""
        except ValueError as err:
            self._format, self.reason = None, f"the latest AudioInfo is unusable: {err}"

    @staticmethod
    def _parse(info: Any) -> _RawFormat:
        coding = str(info.coding_format)
        if coding.lower() not in _RAW_CODINGS:
            raise ValueError(f"coding_format {coding!r} is not raw PCM; only "
                             f"{' / '.join(_RAW_CODINGS)} can be decoded (start audio_capture with "
                             f"format:=wave, e.g. its capture_wave.launch.py)")
        sample_format = str(info.sample_format)
        dtype = _GSTREAMER_FORMATS.get(sample_format.upper())
        if dtype is None:
            raise ValueError(f"sample_format {sample_format!r} is not supported; supported: "
                             f"{', '.join(_GSTREAMER_FORMATS)}")
        if int(info.channels) < 1:
            raise ValueError(f"channels is {int(info.channels)}")
        if int(info.sample_rate) < 1:
            raise ValueError(f"sample_rate is {int(info.sample_rate)}")
        return _RawFormat(sample_format.upper(), dtype, int(info.channels), int(info.sample_rate))

    def to_pcm(self, msg: Any) -> DecodedAudio:
        """An `AudioData` or `AudioDataStamped` as mono Pcm, with its stamp."""
        audio = getattr(msg, "audio", msg)
        if not hasattr(audio, "data"):
            raise ValueError(f"{type(msg).__name__} is not a ros-drivers audio_common_msgs "
                             f"AudioData/AudioDataStamped")
        fmt = self._format
        if fmt is None:
            raise ValueError(f"audio chunk refused: {self.reason}")
        what = f"{fmt.sample_format}, {fmt.channels} channel(s), {fmt.sample_rate} Hz per AudioInfo"
        try:
            values = bytes_to_samples(audio.data, fmt.dtype, fmt.sample_format)
            frame = fmt.channels * fmt.dtype.itemsize
            if values.size and len(values) % fmt.channels:
                raise ValueError(f"{values.nbytes} bytes are not a whole number of "
                                 f"{fmt.channels} x {fmt.dtype.itemsize}-byte frames ({frame} bytes)")
            pcm = samples_to_pcm(values, fmt.channels, fmt.sample_rate)
        except ValueError as err:
            raise _in_context(err, f"audio data does not fit its declared format ({what})") from None
        return DecodedAudio(pcm, *_header_of(msg))


def audio_common_to_pcm(msg: Any, info: AudioInfoFormat | None = None) -> DecodedAudio:
    """A message of either family as mono Pcm: mgonzs13 messages carry their format; ros-drivers
    messages need `info`, the stream's AudioInfoFormat."""
    family = family_of(msg)
    if family == MGONZS13:
        return mgonzs13_to_pcm(msg)
    if family == ROS_DRIVERS:
        if info is None:
            raise ValueError("a ros-drivers AudioData carries no format: pass the AudioInfoFormat "
                             "fed from its audio_info topic")
        return info.to_pcm(msg)
    raise ValueError(f"{type(msg).__name__} is no audio_common_msgs audio message")
