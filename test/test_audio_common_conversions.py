"""Both audio_common_msgs families -> mono PCM (photon_ros.audio_common_conversions).

In this process, messages are plain objects with the generated classes' attributes and array
types (array.array for numeric sequences); every sample format, channel count and mismatch.
In subprocesses with the test-only workspace packages (test/workspaces, built once into
~/.cache/photon by interface_workspaces): the same formats through the real generated classes
and their CDR serialization, and an espeak-ng command published over DDS by a driver process
of each family and converted by a listener process, compared with the WAV sample for sample."""
from __future__ import annotations

import array
import importlib.util
import json
import math
import os
import pickle
import select
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from audio_common_peer import CHUNK as DRIVER_CHUNK
from interface_workspaces import AUDIO_COMMON_FAMILIES as FAMILIES
from interface_workspaces import install_dir, package_dir, workspace_env
from photon_core.audio_io import read_wav
from photon_ros.audio_common_conversions import (FLOAT_PEAK_LIMIT, MGONZS13, ROS_DRIVERS,
                                                 AudioInfoFormat, audio_common_to_pcm, audio_common_types,
                                                 family_of, mgonzs13_to_pcm)
from photon_ros.audio_conversions import EmptyAudio, pcm_to_audio_chunk
from photon_ros.speech_segmenter import SegmenterConfig
from speech_audio import espeak_wav

PEER = Path(__file__).with_name("audio_common_peer.py")
RNG = np.random.default_rng(28)

# PortAudio flag, AudioData array, array typecode, numpy dtype
MGONZS13_FORMATS = {
    "paFloat32": (1, "float32_data", "f", np.float32),
    "paInt32": (2, "int32_data", "i", np.int32),
    "paInt16": (8, "int16_data", "h", np.int16),
    "paInt8": (16, "int8_data", "b", np.int8),
    "paUInt8": (32, "uint8_data", "B", np.uint8),
}
ARRAYS = [spec[1] for spec in MGONZS13_FORMATS.values()]
GST_DTYPES = {"U8": "u1", "S8": "i1", "S16LE": "<i2", "S16BE": ">i2", "S32LE": "<i4", "S32BE": ">i4",
              "F32LE": "<f4", "F32BE": ">f4", "F64LE": "<f8", "F64BE": ">f8"}
# RIHS01 type hashes of the originals' definitions: mgonzs13/audio_common at f0767f3c and
# ros-drivers/audio_common (ros2) at 06c280a7, computed with `rosidl hash` from their .msg files.
# Equal hashes mean equal field names, types and order: the stand-ins are the same types on the wire.
UPSTREAM_HASHES = {
    "mgonzs13": {
        "AudioData": "RIHS01_28873bc02f2963cbc2e6e7dbadd149384f99daddba98ddc2a7cd2550a0b9b5c3",
        "AudioInfo": "RIHS01_2418e6f9b3639c2844652701c489705b045d5b970c0674573a0f668d6af3b58b",
        "Audio": "RIHS01_56bb1432a8bc1cf3579fa7dcfa6107180f29e799b30e51a880e5591ccc789de2",
        "AudioStamped": "RIHS01_f6ad36427cfe3e7132f91509dca5a3be31b9b681f182db6e606e95e781b21611",
    },
    "ros_drivers": {
        "AudioData": "RIHS01_a9742fba1567e649bbdba6ae034a72c7ef129b97c7a4da50fd2f3e1bfd8ffa86",
        "AudioDataStamped": "RIHS01_6fc679d5a868ed68e4d301f1ef42abecc86140afb57d255656ff2d9e476ea9e3",
        "AudioInfo": "RIHS01_b3494d204e513d2cceefae1888e5be3da7c8c8ca31eb277f7b5b62f364bcb1fb",
    },
}


def random_samples(dtype, n: int) -> np.ndarray:
    """Samples spread over the whole range of `dtype`, its extremes included."""
    dtype = np.dtype(dtype)
    if dtype.kind == "f":
        values = RNG.uniform(-1.0, 1.0, n)
        values[:2] = [-1.0, 1.0]
        return values.astype(dtype)
    info = np.iinfo(dtype)
    values = RNG.integers(info.min, info.max, n, endpoint=True)
    values[:2] = [info.min, info.max]
    return values.astype(dtype)


def reference_mono(values: np.ndarray, channels: int) -> np.ndarray:
    """What the samples mean, worked out here independently: integers over their full scale
    (8-bit unsigned centred on 128), channels averaged."""
    values = np.asarray(values)
    if values.dtype.kind == "u":
        scaled = (values.astype(np.float64) - 128.0) / 128.0
    elif values.dtype.kind == "i":
        scaled = values.astype(np.float64) / 2.0 ** (8 * values.dtype.itemsize - 1)
    else:
        scaled = values.astype(np.float64)
    return scaled.reshape(-1, channels).mean(axis=1)


# --- plain objects with the generated classes' attributes ------------------------------------
def time_stamp(sec: int, nanosec: int) -> SimpleNamespace:
    return SimpleNamespace(sec=sec, nanosec=nanosec)


def mgonzs13_msg(arrays: dict, fmt: int, channels: int, rate: int, stamped: bool = True):
    typecodes = {spec[1]: spec[2] for spec in MGONZS13_FORMATS.values()}
    data = SimpleNamespace(**{f: array.array(typecodes[f]) for f in ARRAYS})
    for field, values in arrays.items():
        if not isinstance(values, list):   # lists stay lists: plain values a caller might set
            values = array.array(typecodes[field], values.tobytes())
        setattr(data, field, values)
    info = SimpleNamespace(format=fmt, channels=channels, rate=rate, chunk=0)
    audio = SimpleNamespace(audio_data=data, info=info)
    if not stamped:
        return audio
    return SimpleNamespace(header=SimpleNamespace(stamp=time_stamp(12, 345), frame_id="mic"), audio=audio)


def ros_info(sample_format="S16LE", channels=1, rate=16000, coding="wave"):
    return SimpleNamespace(channels=channels, sample_rate=rate, sample_format=sample_format,
                           bitrate=0, coding_format=coding)


def ros_msg(data: bytes, stamped: bool = False):
    body = SimpleNamespace(data=array.array("B", data))
    if not stamped:
        return body
    return SimpleNamespace(header=SimpleNamespace(stamp=time_stamp(7, 8), frame_id="mic"), audio=body)


@pytest.mark.parametrize("name", MGONZS13_FORMATS)
@pytest.mark.parametrize("channels, rate", [(1, 16000), (2, 44100), (4, 8000)])
def test_mgonzs13_every_format(name, channels, rate):
    code, field, _, dtype = MGONZS13_FORMATS[name]
    values = random_samples(dtype, 960 * channels)
    out = mgonzs13_to_pcm(mgonzs13_msg({field: values}, code, channels, rate))
    assert out.pcm.sample_rate == rate and out.pcm.samples.dtype == np.float32
    np.testing.assert_allclose(out.pcm.samples, reference_mono(values, channels), rtol=0, atol=1e-6)
    assert (out.stamp.sec, out.stamp.nanosec, out.frame_id) == (12, 345, "mic")
    unstamped = mgonzs13_to_pcm(mgonzs13_msg({field: values}, code, channels, rate, stamped=False))
    assert unstamped.stamp is None and unstamped.frame_id == ""
    np.testing.assert_array_equal(unstamped.pcm.samples, out.pcm.samples)


@pytest.mark.parametrize("sample_format", GST_DTYPES)
@pytest.mark.parametrize("channels, rate", [(1, 16000), (2, 48000)])
def test_ros_drivers_every_format(sample_format, channels, rate):
    values = random_samples(GST_DTYPES[sample_format], 800 * channels)
    fmt = AudioInfoFormat()
    fmt.update(ros_info(sample_format.lower() if sample_format == "S16LE" else sample_format, channels, rate))
    assert fmt.ready and fmt.reason == ""
    for stamped in (False, True):
        out = fmt.to_pcm(ros_msg(values.tobytes(), stamped))
        assert out.pcm.sample_rate == rate
        np.testing.assert_allclose(out.pcm.samples, reference_mono(values, channels), rtol=0, atol=1e-6)
        assert (out.stamp is None) == (not stamped)
    assert audio_common_to_pcm(ros_msg(values.tobytes()), fmt).pcm.samples.size == 800


def test_int16_mono_is_exact():
    ints = np.array([-32768, -1, 0, 1, 32767], np.int16)
    out = mgonzs13_to_pcm(mgonzs13_msg({"int16_data": ints}, 8, 1, 16000))
    np.testing.assert_array_equal(out.pcm.samples, ints / np.float32(32768))
    fmt = AudioInfoFormat()
    fmt.update(ros_info())
    out = fmt.to_pcm(ros_msg(ints.astype("<i2").tobytes()))
    np.testing.assert_array_equal(out.pcm.samples, ints / np.float32(32768))


@pytest.mark.parametrize("arrays, fmt, channels, rate, message", [
    ({"int16_data": np.ones(8, np.int16)}, 1, 1, 16000,
     "is 1 (paFloat32) but float32_data is empty; int16_data holds 8"),
    ({"float32_data": np.zeros(8, np.float32), "int16_data": np.ones(8, np.int16)}, 8, 1, 16000, "ambiguous"),
    ({"int16_data": np.ones(8, np.int16)}, 0, 1, 16000, "info.format 0 (unset)"),
    ({"int16_data": np.ones(8, np.int16)}, 4, 1, 16000, "paInt24"),
    ({"int16_data": np.ones(9, np.int16)}, 8, 2, 16000, "not a multiple of 2 channels"),
    ({"int16_data": np.ones(8, np.int16)}, 8, 0, 16000, "0 channels"),
    ({"int16_data": np.ones(8, np.int16)}, 8, 1, 0, "sample rate must be positive"),
    ({"float32_data": np.array([0.1, 3000.0], np.float32)}, 1, 1, 16000, "not float PCM"),
    ({"float32_data": np.array([0.1, np.nan], np.float32)}, 1, 1, 16000, "NaN or infinite"),
    ({"int16_data": [0, 40000]}, 8, 1, 16000, "outside int16"),
    ({"float32_data": array.array("f")}, 1, 1, 16000, "float32_data is empty"),
])
def test_mgonzs13_format_that_does_not_fit(arrays, fmt, channels, rate, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        mgonzs13_to_pcm(mgonzs13_msg(arrays, fmt, channels, rate))


def test_ros_drivers_refuses_chunks_until_usable_info():
    fmt = AudioInfoFormat()
    chunk = ros_msg(np.zeros(16, "<i2").tobytes())
    with pytest.raises(ValueError, match="no AudioInfo received yet"):
        fmt.to_pcm(chunk)
    with pytest.raises(ValueError, match="pass the AudioInfoFormat"):
        audio_common_to_pcm(chunk)
    fmt.update(ros_info(coding="mp3"))   # the driver's default coding
    assert not fmt.ready and "coding_format 'mp3' is not raw PCM" in fmt.reason
    with pytest.raises(ValueError, match="mp3"):
        fmt.to_pcm(chunk)
    fmt.update(ros_info(coding="wave"))
    assert fmt.to_pcm(chunk).pcm.samples.size == 16
    for bad, message in [(ros_info(sample_format="S24LE"), "'S24LE' is not supported"),
                         (ros_info(channels=0), "channels is 0"),
                         (ros_info(rate=0), "sample_rate is 0"),
                         (ros_info(coding=""), "coding_format '' is not raw PCM")]:
        fmt.update(bad)   # the latest info decides: a bad one stops decoding again
        with pytest.raises(ValueError, match=message):
            fmt.to_pcm(chunk)


@pytest.mark.parametrize("sample_format, channels, data, message", [
    ("S16LE", 1, b"\x00\x01\x02", "3 bytes, not a whole number of S16LE samples"),
    ("S32LE", 2, bytes(12), "12 bytes are not a whole number of 2 x 4-byte frames"),
    ("S16LE", 1, b"", "empty"),
    # S16LE speech declared as F32LE: integer bytes read as floats
    ("F32LE", 1, (np.sin(np.arange(64) / 3) * 20000).astype("<i2").tobytes(), "not float PCM|NaN"),
    ("F64LE", 1, np.array([0.5, 1e9]).tobytes(), "not float PCM"),
])
def test_ros_drivers_data_that_does_not_fit(sample_format, channels, data, message):
    fmt = AudioInfoFormat()
    fmt.update(ros_info(sample_format, channels))
    with pytest.raises(ValueError, match=f"does not fit its declared format .*({message})"):
        fmt.to_pcm(ros_msg(data))


def test_an_empty_chunk_is_empty_audio_in_both_families():
    """The speech node cuts the utterance at a refused chunk, as audio lost, but not at an empty
    one; ros-drivers' EmptyAudio came out a plain ValueError, and an empty chunk cut the command."""
    fmt = AudioInfoFormat()
    fmt.update(ros_info("S16LE", 2))
    for msg in (ros_msg(b""), ros_msg(b"", stamped=True)):
        with pytest.raises(EmptyAudio, match="does not fit its declared format .*empty"):
            fmt.to_pcm(msg)
        with pytest.raises(EmptyAudio):
            audio_common_to_pcm(msg, fmt)
    with pytest.raises(EmptyAudio, match="int16_data is empty"):
        mgonzs13_to_pcm(mgonzs13_msg({}, 8, 1, 16000))
    # malformed data is no EmptyAudio: its audio is lost
    for data in (b"\x00", bytes(6)):   # half a sample; one and a half stereo frames
        with pytest.raises(ValueError) as refused:
            fmt.to_pcm(ros_msg(data))
        assert not isinstance(refused.value, EmptyAudio)


def test_float_overshoot_within_the_limit_is_kept():
    values = np.array([0.5, -1.5, FLOAT_PEAK_LIMIT], np.float32)
    out = mgonzs13_to_pcm(mgonzs13_msg({"float32_data": values}, 1, 1, 16000))
    np.testing.assert_array_equal(out.pcm.samples, values)


def test_family_of_tells_the_families_and_nothing_else():
    assert family_of(mgonzs13_msg({}, 8, 1, 16000)) == MGONZS13
    assert family_of(mgonzs13_msg({}, 8, 1, 16000, stamped=False)) == MGONZS13
    assert family_of(ros_msg(b"")) == ROS_DRIVERS
    assert family_of(ros_msg(b"", stamped=True)) == ROS_DRIVERS
    from std_msgs.msg import UInt8MultiArray
    for other in (pcm_to_audio_chunk(np.zeros(4, np.float32), 16000), UInt8MultiArray(), ros_info()):
        assert family_of(other) is None
        with pytest.raises(ValueError, match="no audio_common_msgs audio message"):
            audio_common_to_pcm(other, AudioInfoFormat())


def test_no_types_without_the_packages():
    if importlib.util.find_spec("audio_common_msgs") is not None:
        pytest.skip("an audio_common_msgs is installed in this environment")
    assert audio_common_types() == {}


# --- the real generated classes, in subprocesses ---------------------------------------------
def run_peer(family: str, *args: str, stdin: bytes | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(PEER), *args], input=stdin, env=workspace_env(family),
                          capture_output=True, timeout=120)


@pytest.mark.parametrize("family", FAMILIES)
def test_stand_ins_have_the_upstream_type_hashes(family):
    workspace_env(family)   # builds it when missing
    share = install_dir(family) / "share" / "audio_common_msgs" / "msg"
    names = sorted(p.stem for p in (package_dir(family) / "msg").glob("*.msg"))
    assert names == sorted(UPSTREAM_HASHES[family])
    for name, want in UPSTREAM_HASHES[family].items():
        hashes = json.loads((share / f"{name}.json").read_text())["type_hashes"]
        assert hashes[0]["type_name"] == f"audio_common_msgs/msg/{name}"
        assert hashes[0]["hash_string"] == want, name


def test_workspace_packages_stay_out_of_colcon_crawls():
    root = Path(__file__).resolve().parents[1]
    listed = subprocess.run(["colcon", "--log-base", os.devnull, "list", "--names-only",
                             "--base-paths", ".", "test"],
                            cwd=root, capture_output=True, text=True, timeout=60)
    assert listed.returncode == 0, listed.stderr
    assert listed.stdout.split() == ["photon_ros"]


def mgonzs13_cases():
    cases, expected = [], []
    for name, (code, field, _, dtype) in MGONZS13_FORMATS.items():
        for channels, rate in [(1, 16000), (2, 48000)]:
            values = random_samples(dtype, 256 * channels)
            cases.append({"kind": "audio", "arrays": {field: values.tolist()}, "stamp": (3, 4),
                          "frame_id": "mic",
                          "info": {"format": code, "channels": channels, "rate": rate, "chunk": 256}})
            expected.append(("pcm", reference_mono(values, channels), rate))
    cases.append({"kind": "audio", "arrays": {"int16_data": [1, 2]},
                  "info": {"format": 1, "channels": 1, "rate": 16000, "chunk": 2}})
    expected.append(("error", "float32_data is empty"))
    return cases, expected


def ros_drivers_cases():
    cases = [{"kind": "audio", "data": bytes(8)}]
    expected = [("error", "no AudioInfo received yet")]
    cases.append({"kind": "info", "channels": 1, "sample_rate": 16000, "sample_format": "S16LE",
                  "bitrate": 128, "coding_format": "mp3"})
    expected.append(("info", False, "mp3"))
    for sample_format, dtype in GST_DTYPES.items():
        for channels, rate in [(1, 16000), (2, 48000)]:
            cases.append({"kind": "info", "channels": channels, "sample_rate": rate,
                          "sample_format": sample_format, "bitrate": 0, "coding_format": "wave"})
            expected.append(("info", True, ""))
            values = random_samples(dtype, 256 * channels)
            cases.append({"kind": "audio", "data": values.tobytes(), "stamped": channels == 2,
                          "stamp": (3, 4), "frame_id": "mic"})
            expected.append(("pcm", reference_mono(values, channels), rate))
    cases.append({"kind": "audio", "data": bytes(7)})   # F64BE stereo frames are 16 bytes
    expected.append(("error", "not a whole number"))
    return cases, expected


@pytest.mark.parametrize("family, make_cases",
                         [("mgonzs13", mgonzs13_cases), ("ros_drivers", ros_drivers_cases)])
def test_generated_classes_through_cdr(family, make_cases):
    cases, expected = make_cases()
    done = run_peer(family, "cases", stdin=pickle.dumps(cases))
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    report = pickle.loads(done.stdout)
    assert report["family"] == family and report["types"] == sorted(UPSTREAM_HASHES[family])
    assert len(report["results"]) == len(expected)
    for case, got, want in zip(cases, report["results"], expected):
        assert got[0] == want[0], (case.get("info", case), got)
        if want[0] == "pcm":
            np.testing.assert_allclose(got[1], want[1], rtol=0, atol=1e-6)
            assert got[2] == want[2]
            stamped = family == MGONZS13 or case.get("stamped")
            assert got[3:] == (((3, 4), "mic") if stamped else (None, ""))
        elif want[0] == "info":
            assert got[1] == want[1] and want[2] in got[2]
        else:
            assert want[1] in got[1]


def said(proc: subprocess.Popen, line: bytes, timeout: float) -> bool:
    """Whether `proc` wrote `line` on its stdout within `timeout` s (read from the descriptor, so
    nothing stays in a buffer that communicate() would not see)."""
    seen, deadline = b"", time.monotonic() + timeout
    while line not in seen.split(b"\n") and time.monotonic() < deadline:
        if select.select([proc.stdout], [], [], max(0.0, deadline - time.monotonic()))[0]:
            chunk = os.read(proc.stdout.fileno(), 4096)
            if not chunk:
                break
            seen += chunk
    return line in seen.split(b"\n")


@pytest.mark.parametrize("family", FAMILIES)
def test_espeak_command_over_dds(family, tmp_path):
    """A driver process of the family publishes a spoken command; a listener process converts
    what it receives back into the WAV's samples, exactly (16-bit samples / 32768)."""
    wav = espeak_wav("Go to the kitchen.")
    samples, rate = read_wav(wav)
    out = tmp_path / "received.npz"
    env = workspace_env(family)
    listener = subprocess.Popen([sys.executable, str(PEER), "subscribe", str(samples.size), str(out)],
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    # The driver's first messages must all arrive (the chunk before any AudioInfo, the first
    # AudioInfo, the WAV's first chunk): it sends early ones until the listener has had one on
    # every topic, then the WAV after "go".
    driver = subprocess.Popen([sys.executable, str(PEER), "publish", str(wav), "--prime"], env=env,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    primed = said(listener, b"primed", 60)
    driver_err = driver.communicate(b"go\n" if primed else b"", timeout=90)[1]
    listener_out, listener_err = listener.communicate(timeout=60)
    assert primed and driver.returncode == 0, driver_err.decode()[-3000:] + listener_err.decode()[-3000:]
    assert listener.returncode == 0, listener_err.decode()[-3000:]
    got = np.load(out, allow_pickle=True)
    assert str(got["family"]) == family
    topics = ["audio"] if family == MGONZS13 else ["audio", "audio_stamped"]
    refused = list(got["refused"])
    if family == ROS_DRIVERS:   # its one chunk sent before the first AudioInfo, on each topic
        assert sorted(r.split(":")[0] for r in refused) == topics, refused
        assert all("no AudioInfo received yet" in r for r in refused), refused
    else:
        assert refused == []
    want = samples.astype(np.float32) / np.float32(32768)
    for topic in topics:
        received = got[f"{topic}.samples"]
        assert received.size == want.size, f"{topic}: {received.size} of {want.size} samples arrived"
        np.testing.assert_array_equal(received, want)
        assert set(got[f"{topic}.rates"]) == {rate}
        stamps = got[f"{topic}.stamps"]
        if topic == "audio" and family == ROS_DRIVERS:   # AudioData has no header
            assert (stamps == -1).all() and set(got[f"{topic}.frame_ids"]) == {""}
        else:   # one stamp per 512-frame chunk, on the sample clock the driver started at
            first = np.arange(stamps.size) * 512
            expected_ns = 1_700_000_000 * 10**9 + np.round(first / rate * 1e9).astype(np.int64)
            assert np.abs(stamps - expected_ns).max() <= 1
            assert set(got[f"{topic}.frame_ids"]) == {"mic"}


def decoded_chunks(counts: list):
    """A /diagnostics callback appending the chunks the speech node decoded (received, neither
    bad nor ignored) to `counts`."""
    def on_diagnostics(array) -> None:
        for status in array.status:
            v = {kv.key: kv.value for kv in status.values}
            if status.name.startswith("photon_ros: ") and "chunks_received" in v:
                counts.append(int(v["chunks_received"]) - int(v["chunks_skipped_bad"])
                              - int(v["chunks_ignored_inactive"]))
    return on_diagnostics


@pytest.mark.parametrize("family, input_type", [(MGONZS13, "audio_stamped"), (ROS_DRIVERS, "audio_data_stamped")])
def test_the_speech_node_transcribes_each_driver(family, input_type):
    """The speech node in a process of its own, subscribed as its input_type says (for ros-drivers
    AudioDataStamped remapped from the driver's audio_stamped, and its AudioInfo), hears a driver
    process of the family say a command."""
    from diagnostic_msgs.msg import DiagnosticArray
    from photon_ros.msg import Transcript
    from rclpy.qos import QoSProfile, ReliabilityPolicy
    from ros_harness import RosGraph, wait_for

    finals, decoded = [], []
    reliable = QoSProfile(depth=10, reliability=ReliabilityPolicy.RELIABLE)
    graph = RosGraph()
    listener = graph.node("listener")
    listener.create_subscription(Transcript, "/transcript", lambda m: m.is_final and finals.append(m), reliable)

    listener.create_subscription(DiagnosticArray, "/diagnostics", decoded_chunks(decoded), reliable)
    env = workspace_env(family)
    remap = ["-r", "audio:=/audio_stamped"] if family == ROS_DRIVERS else []
    node = subprocess.Popen([sys.executable, "-m", "photon_ros.speech_node", "--ros-args", "-p",
                             f"input_type:={input_type}", "-p", "partial_interval_s:=0.0", *remap],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait = ["audio_stamped", "audio_info"] if family == ROS_DRIVERS else ["audio"]
        # The command's first chunk carries speech, and ros-drivers' needs an AudioInfo before it:
        # the driver sends silence until the node has decoded some (so its readers have matched
        # the driver's writers, audio_info's included), then the command on "go".
        # Speech is a whole command only after a pause heard before it (hangover_s): until the
        # node has decoded twice that much of the lead-in, "go" could make the command the tail
        # of an utterance under way when listening began (a CI run: 1 chunk, then "go").
        wav = espeak_wav("Find the red ball.")
        lead_chunks = math.ceil(2 * SegmenterConfig().hangover_s * read_wav(wav)[1] / DRIVER_CHUNK)
        driver = subprocess.Popen([sys.executable, str(PEER), "publish", str(wav),
                                   ",".join(wait), "--lead-in"], env=env, stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        heard = wait_for(lambda: max(decoded, default=0) >= lead_chunks or driver.poll() is not None, timeout=110)
        driver_err = driver.communicate(b"go\n" if heard else b"", timeout=120)[1]
        assert heard and driver.returncode == 0, driver_err.decode()[-3000:]
        assert wait_for(lambda: finals, timeout=120), "no transcript"
    finally:
        node.terminate()
        log = node.communicate(timeout=30)[0]
        graph.close()
    assert [w.strip(".,").lower() for w in finals[0].text.split()] == ["find", "the", "red", "ball"], log[-3000:]
    assert finals[0].audio_complete and finals[0].header.frame_id == "mic", finals[0].audio_note


def test_the_speech_node_takes_a_latched_audio_info():
    """Newer ros-drivers audio_capture latches its AudioInfo (reliable, transient local) and the
    driver here sends it once, before the speech node starts: the node decodes the driver's
    chunks with it (a volatile reader alone never gets it; the real driver's repeat came 5 s later,
    with every chunk before it refused)."""
    from diagnostic_msgs.msg import DiagnosticArray
    from rclpy.qos import QoSProfile, ReliabilityPolicy
    from ros_harness import RosGraph, wait_for

    decoded: list[int] = []
    graph = RosGraph()
    listener = graph.node("listener")
    listener.create_subscription(DiagnosticArray, "/diagnostics", decoded_chunks(decoded),
                                 QoSProfile(depth=10, reliability=ReliabilityPolicy.RELIABLE))
    env = workspace_env(ROS_DRIVERS)
    driver = subprocess.Popen([sys.executable, str(PEER), "publish", str(espeak_wav("Stop.")), "audio_stamped",
                               "--lead-in", "--latched-info"], env=env, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    node = None
    try:
        assert wait_for(lambda: listener.get_publishers_info_by_topic("/audio_info"), timeout=30)
        time.sleep(0.5)   # its one AudioInfo is out before the node exists
        node = subprocess.Popen([sys.executable, "-m", "photon_ros.speech_node", "--ros-args", "-p",
                                 "input_type:=audio_data_stamped", "-r", "audio:=/audio_stamped"],
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        heard = wait_for(lambda: max(decoded, default=0) >= 1 or driver.poll() is not None, timeout=60)
    finally:
        driver.kill()
        driver.communicate(timeout=30)
        log = node.communicate(timeout=30)[0] if node is not None and node.terminate() is None else ""
        graph.close()
    assert heard and max(decoded) >= 1, log[-3000:]


@pytest.mark.parametrize("family", FAMILIES)
def test_a_recording_of_each_driver_is_evaluated(family, tmp_path):
    """A bag recorded from either family's driver goes through the evaluator as the live node takes
    it (it was refused: "no audio topic"): ros-drivers' audio with its AudioInfo topic replayed
    beside it, each transcript tied to the chunk that ended its utterance."""
    run = subprocess.run([sys.executable, str(PEER), "evaluate", str(espeak_wav("Find the red ball.")), str(tmp_path)],
                         env=workspace_env(family), capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    outcome = json.loads(run.stdout.strip().splitlines()[-1])
    assert outcome["rc"] == 0, run.stderr[-3000:]
    (final,) = outcome["finals"]
    assert [w.strip(".,").lower() for w in final["text"].split()] == ["find", "the", "red", "ball"]
    assert final["audio_complete"] == "True" and final["header.frame_id"] == "mic" and final["input_index"]
    summary = outcome["summary"]
    assert summary["speech"]["skipped_chunks"] == 0 and summary["speech"]["discontinuities"] == 0
    assert set(summary["inputs"]) == ({"audio"} if family == MGONZS13 else {"audio", "audio_info"})
