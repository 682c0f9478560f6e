"""The other side of test_audio_common_conversions.py, run in a subprocess whose environment
(interface_workspaces.workspace_env) makes one family's `audio_common_msgs` importable:

  cases              stdin: pickled cases; each built as the family's real generated message,
                     serialized to CDR and back, converted; stdout: pickled results.
  publish WAV [T,..] [--prime | --lead-in] [--latched-info]
                     a driver of the family publishing the WAV (16-bit mono) over DDS, as the
                     real driver does: topics, message types, QoS, stamps on the sample clock;
                     it starts once the topics T (default: all of them) have a subscriber. With
                     --prime, early messages first (chunks of PRIMING_FRAMES, an AudioInfo at
                     PRIMING_RATE: no real message's) on every topic, until "go" on stdin; with
                     --lead-in, silence on the sample clock at real time until "go", then the WAV.
                     --latched-info (ros-drivers): AudioInfo latched (reliable, transient local,
                     as newer audio_capture publishes it), sent once at the start, never again.
  evaluate WAV DIR   a recording of the family's driver saying the WAV, evaluated through the speech
                     graph (photon_ros.evaluate); JSON of the outcome on stdout.
  subscribe N OUT    a node receiving the family's audio topics, converting every message with
                     photon_ros.audio_common_conversions; stops once N samples came on each topic
                     (or after 30 s) and writes what it got to OUT (.npz). It ignores the early
                     messages, and says "primed" on stdout once one came on every topic."""
from __future__ import annotations

import array
import os
import pickle
import select
import sys
import time

import numpy as np

from photon_ros.audio_common_conversions import (MGONZS13, AudioInfoFormat, audio_common_to_pcm,
                                                 audio_common_types, family_of)

CHUNK = 512            # frames per message, both drivers' default size
START = 1_700_000_000  # the sample clock's first stamp, seconds
PORTAUDIO_INT16 = 8
PRIMING_FRAMES = CHUNK + 1   # the early chunks' length: longer than every real chunk
PRIMING_RATE = 1             # the early AudioInfo's sample rate: no real one's
_TYPECODES = {"float32_data": "f", "int32_data": "i", "int16_data": "h", "int8_data": "b", "uint8_data": "B"}


def types() -> tuple[str, dict[str, type]]:
    found = {name.rsplit("/", 1)[1]: cls for name, cls in audio_common_types().items()}
    if not found:
        raise SystemExit("audio_common_msgs is not importable in this environment")
    return family_of(next(iter(found.values()))), found


def _typed(field: str, values) -> array.array:
    out = array.array(_TYPECODES[field])
    out.frombytes(np.asarray(values, dtype=out.typecode).tobytes())
    return out


def build(family: str, t: dict[str, type], case: dict):
    """A case ({"kind": "audio" | "info", ...fields}) as the family's generated message."""
    if family == MGONZS13:
        msg = t["AudioStamped"]()
        msg.header.stamp.sec, msg.header.stamp.nanosec = case.get("stamp", (0, 0))
        msg.header.frame_id = case.get("frame_id", "")
        for field, values in case["arrays"].items():
            setattr(msg.audio.audio_data, field, _typed(field, values))
        for field in ("format", "channels", "rate", "chunk"):
            setattr(msg.audio.info, field, case["info"][field])
        return msg
    if case["kind"] == "info":
        msg = t["AudioInfo"]()
        for field in ("channels", "sample_rate", "sample_format", "bitrate", "coding_format"):
            setattr(msg, field, case[field])
        return msg
    msg = t["AudioDataStamped"]() if case.get("stamped") else t["AudioData"]()
    body = msg.audio if case.get("stamped") else msg
    body.data = case["data"]
    if case.get("stamped"):
        msg.header.stamp.sec, msg.header.stamp.nanosec = case.get("stamp", (0, 0))
        msg.header.frame_id = case.get("frame_id", "")
    return msg


def run_cases() -> None:
    from rclpy.serialization import deserialize_message, serialize_message

    family, t = types()
    cases = pickle.loads(sys.stdin.buffer.read())
    info = AudioInfoFormat()
    results = []
    for case in cases:
        msg = build(family, t, case)
        msg = deserialize_message(serialize_message(msg), type(msg))   # through the wire format
        if case["kind"] == "info":
            info.update(msg)
            results.append(("info", info.ready, info.reason))
            continue
        try:
            out = audio_common_to_pcm(msg, info)
            stamp = None if out.stamp is None else (out.stamp.sec, out.stamp.nanosec)
            results.append(("pcm", out.pcm.samples, out.pcm.sample_rate, stamp, out.frame_id))
        except ValueError as err:
            results.append(("error", str(err)))
    sys.stdout.buffer.write(pickle.dumps({"family": family, "types": sorted(t), "results": results}))


def _stamp(first_frame: int, rate: int):
    """The capture time of a chunk's first frame, in integer nanoseconds (a float of seconds
    since 1970 is only good to a few hundred)."""
    from builtin_interfaces.msg import Time
    sec, nanosec = divmod(START * 10**9 + round(first_frame * 10**9 / rate), 10**9)
    return Time(sec=sec, nanosec=nanosec)


class _Stdin:
    """What the test says on stdin ("go"), read without waiting longer than asked."""

    def __init__(self) -> None:
        self.said, self.closed = b"", False

    def go(self, timeout: float) -> bool:
        if not self.closed and select.select([0], [], [], timeout)[0]:
            chunk = os.read(0, 64)
            self.closed = not chunk
            self.said += chunk
        return b"go" in self.said.split()


def early(family: str, msg) -> bool:
    """Is this audio message one of the driver's early ones (publish --prime)?"""
    if family == MGONZS13:
        return len(msg.audio.audio_data.int16_data) == PRIMING_FRAMES
    return len(getattr(msg, "audio", msg).data) == 2 * PRIMING_FRAMES   # AudioDataStamped or AudioData


def audio_stamped(t: dict, chunk: np.ndarray, rate: int, stamp) -> object:
    """mgonzs13's AudioStamped of 16-bit mono `chunk`, as its audio_capturer_node sends it."""
    msg = t["AudioStamped"]()
    msg.header.stamp, msg.header.frame_id = stamp, "mic"
    msg.audio.audio_data.int16_data = _typed("int16_data", chunk)
    msg.audio.info.format, msg.audio.info.channels = PORTAUDIO_INT16, 1
    msg.audio.info.rate, msg.audio.info.chunk = rate, CHUNK
    return msg


def publish(wav: str, wait_for: list[str] | None = None, prime: bool = False, lead_in: bool = False,
            latched_info: bool = False) -> None:
    import rclpy
    from rclpy.qos import DurabilityPolicy, QoSProfile, qos_profile_sensor_data

    from photon_core.audio_io import read_wav

    samples, rate = read_wav(wav)
    assert samples.dtype == np.int16 and samples.ndim == 1, "a 16-bit mono WAV"
    family, t = types()
    rclpy.init()
    node = rclpy.create_node("audio_driver")
    if family == MGONZS13:   # audio_capturer_node: one topic, sensor-data QoS
        pubs = {"audio": node.create_publisher(t["AudioStamped"], "audio", qos_profile_sensor_data)}
    else:                    # audio_capture_node: two audio topics (depth 10), info apart (depth 1)
        pubs = {"audio": node.create_publisher(t["AudioData"], "audio", 10),
                "audio_stamped": node.create_publisher(t["AudioDataStamped"], "audio_stamped", 10),
                "audio_info": node.create_publisher(t["AudioInfo"], "audio_info", QoSProfile(
                    depth=1, durability=DurabilityPolicy.TRANSIENT_LOCAL if latched_info else DurabilityPolicy.VOLATILE))}
    if latched_info:   # once, before anyone subscribed: only a latched reader can still get it
        pubs["audio_info"].publish(t["AudioInfo"](channels=1, sample_rate=rate, sample_format="S16LE",
                                                  bitrate=0, coding_format="wave"))
    deadline = time.monotonic() + 30
    awaited = [pubs[name] for name in (wait_for or pubs)]
    while any(p.get_subscription_count() == 0 for p in awaited) and time.monotonic() < deadline:
        time.sleep(0.05)

    def send(chunk: np.ndarray, first_frame: int) -> None:
        stamp = _stamp(first_frame, rate)
        if family == MGONZS13:
            pubs["audio"].publish(audio_stamped(t, chunk, rate, stamp))
            return
        data = chunk.astype("<i2").tobytes()
        pubs["audio"].publish(t["AudioData"](data=data))
        stamped = t["AudioDataStamped"]()
        stamped.header.stamp, stamped.header.frame_id = stamp, "mic"
        stamped.audio.data = data
        pubs["audio_stamped"].publish(stamped)

    def send_info(sample_rate: int = rate) -> None:
        if latched_info:
            return   # sent once, at the start
        pubs["audio_info"].publish(t["AudioInfo"](channels=1, sample_rate=sample_rate, sample_format="S16LE",
                                                  bitrate=0, coding_format="wave"))

    if prime:
        # The graph's counts say both ends are known, not that the listener's readers have matched
        # these writers yet: a message sent in between is dropped unseen, and a stream's first one
        # has no predecessor to show it missing. So early messages (100 s before the sample clock's
        # start; the listener ignores them) go out until it has had one on every topic and the
        # test says "go".
        stdin, deadline = _Stdin(), time.monotonic() + 30
        while not stdin.go(0.05) and not stdin.closed and time.monotonic() < deadline:
            send(np.zeros(PRIMING_FRAMES, np.int16), -100 * rate)
            if family != MGONZS13:
                send_info(PRIMING_RATE)
        if not stdin.go(0):
            raise SystemExit("driver: no 'go' on stdin (the listener never had an early message on every topic)")
    elif not lead_in:
        time.sleep(0.5)   # discovery both ways before the first message
    if family != MGONZS13:
        # The driver's first chunks can precede its first AudioInfo: the receiver must refuse
        # them. They are silence at a stamp before the speech, so they can be told apart.
        send(np.zeros(CHUNK, np.int16), -4 * CHUNK)
        time.sleep(0.5)
        send_info()
        time.sleep(0.5)
    lead = 0   # frames of silence before the WAV
    if lead_in:
        # As a microphone does before anyone speaks: silence, at real time, until the receiver
        # has decoded some of it and the test says "go" (the graph's counts can come before the
        # readers have matched these writers: the WAV's first chunks would be dropped unseen).
        stdin, deadline = _Stdin(), time.monotonic() + 120
        while not stdin.go(CHUNK / rate) and not stdin.closed and time.monotonic() < deadline:
            send(np.zeros(CHUNK, np.int16), lead)
            lead += CHUNK
            if family != MGONZS13 and lead % (20 * CHUNK) == 0:
                send_info()
        if not stdin.go(0):
            raise SystemExit("driver: no 'go' on stdin (the receiver never decoded the lead-in)")
    for k, i in enumerate(range(0, samples.size, CHUNK)):
        send(samples[i:i + CHUNK], lead + i)
        if family != MGONZS13 and k % 20 == 19:
            send_info()   # the driver repeats it (every 5 s), as a late subscriber needs it
        time.sleep(0.005)
    time.sleep(0.5)
    node.destroy_node()
    rclpy.shutdown()


def subscribe(expected: int, out: str) -> None:
    import rclpy
    from rclpy.qos import QoSProfile, ReliabilityPolicy

    family, t = types()
    rclpy.init()
    node = rclpy.create_node("audio_listener")
    # As the speech node should: best-effort readers (they match best-effort and reliable
    # writers), volatile depth 1 for the repeated AudioInfo.
    audio_qos = QoSProfile(depth=100, reliability=ReliabilityPolicy.BEST_EFFORT)
    info = AudioInfoFormat()
    got: dict[str, list] = {}
    refused: list[str] = []
    primed: set[str] = set()

    def early_came(topic: str) -> None:
        if topic not in primed:
            primed.add(topic)
            if primed == set(topics) | ({"audio_info"} if family != MGONZS13 else set()):
                print("primed", flush=True)

    def take_info(msg) -> None:
        if msg.sample_rate == PRIMING_RATE:
            early_came("audio_info")
        else:
            info.update(msg)

    def take(topic: str):
        def callback(msg) -> None:
            if early(family, msg):
                early_came(topic)
                return
            try:
                out = audio_common_to_pcm(msg, info)
            except ValueError as err:
                refused.append(f"{topic}: {err}")
                return
            stamp = -1 if out.stamp is None else out.stamp.sec * 10**9 + out.stamp.nanosec
            got.setdefault(topic, []).append((stamp, out.pcm, out.frame_id))
        return callback

    if family == MGONZS13:
        topics = {"audio": t["AudioStamped"]}
    else:
        topics = {"audio": t["AudioData"], "audio_stamped": t["AudioDataStamped"]}
        node.create_subscription(t["AudioInfo"], "audio_info", take_info,
                                 QoSProfile(depth=1, reliability=ReliabilityPolicy.BEST_EFFORT))
    for topic, cls in topics.items():
        node.create_subscription(cls, topic, take(topic), audio_qos)

    def done() -> bool:
        return all(sum(p.samples.size for _, p, _ in got.get(topic, [])) >= expected for topic in topics)

    deadline = time.monotonic() + 30
    while not done() and time.monotonic() < deadline:
        rclpy.spin_once(node, timeout_sec=0.05)
    result = {"family": np.array(family), "refused": np.array(refused, dtype=object)}
    for topic in topics:
        chunks = got.get(topic, [])
        result[f"{topic}.samples"] = np.concatenate([p.samples for _, p, _ in chunks] or [np.zeros(0)])
        result[f"{topic}.rates"] = np.array([p.sample_rate for _, p, _ in chunks])
        result[f"{topic}.stamps"] = np.array([s for s, _, _ in chunks], dtype=np.int64)
        result[f"{topic}.frame_ids"] = np.array([f for _, _, f in chunks])
    np.savez(out, **result)
    node.destroy_node()
    rclpy.shutdown()


def record_and_evaluate(wav: str, folder: str) -> None:
    """A recording of the family's driver saying the WAV (its messages as publish sends them,
    stamped on the sample clock, logged as each chunk's capture ends; ros-drivers' AudioInfo
    first and every 5 s), evaluated through the speech graph at max rate. stdout: JSON of the exit
    status, the final transcripts and the summary."""
    import csv
    import json
    from pathlib import Path

    from photon_core.audio_io import read_wav
    from photon_ros import evaluate
    from photon_ros.bag_io import BagWriter

    samples, rate = read_wav(wav)
    family, t = types()
    bag, out = Path(folder) / "bag", Path(folder) / "eval"
    audio = np.concatenate([np.zeros(rate // 2, np.int16), samples, np.zeros(rate, np.int16)])
    with BagWriter(bag, "mcap") as writer:
        for k, i in enumerate(range(0, audio.size, CHUNK)):
            chunk, stamp = audio[i:i + CHUNK], _stamp(i, rate)
            log_ns = stamp.sec * 10**9 + stamp.nanosec + round(chunk.size * 10**9 / rate)
            if family == MGONZS13:
                writer.write("/audio", audio_stamped(t, chunk, rate, stamp), log_ns)
                continue
            if k % round(5 * rate / CHUNK) == 0:
                writer.write("/audio_info", t["AudioInfo"](channels=1, sample_rate=rate, sample_format="S16LE",
                                                            bitrate=0, coding_format="wave"), log_ns - 1)
            msg = t["AudioDataStamped"]()
            msg.header.stamp, msg.header.frame_id = stamp, "mic"
            msg.audio.data = chunk.astype("<i2").tobytes()
            writer.write("/audio_stamped", msg, log_ns)
    rc = evaluate.main([str(bag), "--graph", "speech", "--rate", "max", "--out", str(out)])
    with open(out / "transcript.csv", newline="") as f:
        finals = [r for r in csv.DictReader(f) if r["is_final"] == "True"]
    print(json.dumps({"rc": rc, "finals": finals, "summary": json.loads((out / "summary.json").read_text())}))


if __name__ == "__main__":
    mode, args = sys.argv[1], sys.argv[2:]
    if mode == "cases":
        run_cases()
    elif mode == "publish":
        flags = {"--prime", "--lead-in", "--latched-info"}
        prime, lead_in, latched = "--prime" in args, "--lead-in" in args, "--latched-info" in args
        args = [a for a in args if a not in flags]
        publish(args[0], args[1].split(",") if len(args) > 1 else None, prime, lead_in, latched)
    elif mode == "subscribe":
        subscribe(int(args[0]), args[1])
    elif mode == "evaluate":
        record_and_evaluate(args[0], args[1])
    else:
        raise SystemExit(f"unknown mode {mode!r}")
