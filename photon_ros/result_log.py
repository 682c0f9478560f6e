"""The graph's results as the evaluator receives them, tied to the inputs that produced them, and
written out: one CSV per result topic (one row per message) and a bag of the results.

A result names its input by the header it copies: a vision result carries its frame's stamp, a
transcript the capture time of its utterance's first sample. From that the rows get the input's
index, the result's place on the input timeline (seconds from the first input stamp) and the
delay from publishing the input to receiving the result: for a transcript, from publishing the
chunk that held the utterance's last sample (the earliest it could have been transcribed).
"""
from __future__ import annotations

import bisect
import csv
import json
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from builtin_interfaces.msg import Duration, Time
from geometry_msgs.msg import PointStamped, PoseStamped, Twist, TwistStamped
from rclpy.qos import QoSProfile, ReliabilityPolicy
from std_msgs.msg import String

from photon_ros.bag_io import BagWriter, stamp_ns
from photon_ros.msg import Detections, ImageTarget, Objects3D, Points, Segmentation, Transcript, VisionText
from photon_ros.replay import Published
from photon_ros.result_messages import time_to_seconds


@dataclass(frozen=True)
class Output:
    topic: str
    msg_class: type
    source: str | None      # what produced it: "frame", "utterance", or None (not one input)


def role_outputs(role: str, node: Any = None) -> list[Output]:
    """The result topics of a node of the graph (relative names, as the nodes publish them); `node`,
    the role's node where its types depend on its parameters (the loop's cmd_vel)."""
    cmd_vel = TwistStamped if getattr(node, "stamped", False) else Twist
    params = getattr(getattr(node, "params", None), "values", {})
    depth = role == "vision" and bool(params.get("use_depth"))   # its 3D results too
    outputs = {
        "vision": [Output("detections", Detections, "frame"), Output("points", Points, "frame"),
                   Output("caption", VisionText, "frame"), Output("segmentation", Segmentation, "frame")]
                  + _detection2d_output()
                  + ([Output("objects_3d", Objects3D, "frame"), Output("point_positions", PointStamped, "frame")]
                     + _detection3d_output() if depth else []),
        "speech": [Output("transcript", Transcript, "utterance")],
        # what a planner receives from the loop, all of it: where (image, metres), its goal, its motion
        "loop": [Output("image_target", ImageTarget, None), Output("target", PointStamped, None),
                 Output("goal_pose", PoseStamped, None), Output("cmd_vel", cmd_vel, None),
                 Output("status", String, None)],
    }
    return outputs.get(role, [])


def _detection3d_output() -> list[Output]:
    try:   # as detections_2d
        from vision_msgs.msg import Detection3DArray
    except ImportError:
        return []
    return [Output("detections_3d", Detection3DArray, "frame")]


def _detection2d_output() -> list[Output]:
    try:   # vision_msgs comes from the ROS apt repositories; the node publishes it only there
        from vision_msgs.msg import Detection2DArray
    except ImportError:
        return []
    return [Output("detections_2d", Detection2DArray, "frame")]


@dataclass
class Result:
    topic: str
    msg: Any
    received_ns: int        # wall clock (what a recorder would log)
    at: float               # time.monotonic(), comparable with Published.at


class ResultLog:
    """Subscribes to the outputs on `node` and keeps every message with its arrival time."""

    def __init__(self, node, outputs: list[Output], listener=None) -> None:
        # Reliable and deep: the evaluator must not be the one that loses results.
        qos = QoSProfile(depth=1000, reliability=ReliabilityPolicy.RELIABLE)
        self.outputs = outputs
        self.listener = listener      # called with (topic, msg) for every result
        self._results: list[Result] = []
        self._lock = threading.Lock()
        self.subscriptions = [node.create_subscription(o.msg_class, o.topic, self._keeper(o.topic), qos)
                              for o in outputs]

    def _keeper(self, topic: str):
        def keep(msg) -> None:
            with self._lock:
                self._results.append(Result(topic, msg, time.time_ns(), time.monotonic()))
            if self.listener is not None:
                self.listener(topic, msg)
        return keep

    def results(self, topic: str | None = None) -> list[Result]:
        with self._lock:
            return [r for r in self._results if topic is None or r.topic == topic]

    def __len__(self) -> int:
        with self._lock:
            return len(self._results)

    def unmatched(self) -> list[str]:
        """Output topics no publisher of the graph has been matched with yet."""
        return [s.topic_name for s in self.subscriptions if s.get_publisher_count() == 0]


class FrameProgress:
    """Counts the frames whose awaited results have all arrived: one per detect and per point
    prompt (graph_probe.VisionProbe.prompts). Frames are told apart by their stamps."""

    def __init__(self, prompts: list[tuple[str, str]]) -> None:
        self.prompts = set(prompts)
        self.complete = 0
        self._seen: dict[int | None, set] = {}
        self._lock = threading.Lock()

    def add(self, topic: str, msg: Any) -> None:
        key = (topic, getattr(msg, "prompt", None))
        if key not in self.prompts:
            return
        with self._lock:
            seen = self._seen.setdefault(stamp_ns(msg), set())
            was_complete = self.prompts <= seen
            seen.add(key)
            if not was_complete and self.prompts <= seen:
                self.complete += 1


# --- tying results to inputs ----------------------------------------------------------------------
@dataclass
class InputTimeline:
    """The published inputs, indexed for the lookups results need. Its clock is the recording's:
    input stamps, or for unstamped input the bag's log times (the recorder's clock), from the
    earliest of them (t0_ns).

    A transcript of stamped audio names its chunks by its stamp. One of unstamped audio (std_msgs
    arrays, zero stamps) carries the speech node's clock, which says nothing about the bag, and at
    max rate not even the order of arrival: it is tied to the utterance the node's segmenter cut,
    predicted over the same samples (graph_probe.predict_utterances). An utterance's partials and
    final share its stamp; its final's duration is the predicted one's to the sample, which finds
    it among the predicted in order, past utterances that gave no transcript (nothing heard in
    them, a failed decode, a queue that dropped them)."""
    frames: dict[int, Published]               # header stamp (ns) -> the frame published with it
    chunk_ends: list[float]                    # end capture time (s) of each stamped audio chunk, sorted
    chunks: list[Published]                    # in the same order
    t0_ns: int                                 # zero of the timeline: the first input's recorded time
    shared: set[int] = field(default_factory=set)   # stamps several frames carry: no result is told apart
    # unstamped audio: its chunks in sample order as (first sample, samples, rate, published), and
    # the predicted utterances (graph_probe.Predicted)
    samples: list[tuple[int, int, int, Published]] = field(default_factory=list)
    utterances: list[Any] = field(default_factory=list)
    _utterance: dict[int, Any] = field(default_factory=dict)   # transcript stamp -> its Predicted

    def __post_init__(self) -> None:
        self.firsts = [first for first, _, _, _ in self.samples]

    @classmethod
    def build(cls, published: list[Published], chunk_ends: dict[int, float | None],
              chunk_samples: dict[int, tuple[int, int, int]] | None = None,
              utterances: list | None = None) -> "InputTimeline":
        # A result names its frame by the frame's stamp: where several frames share one (a camera
        # that leaves it 0, a driver that repeats it), its frame is not known, and none is named.
        counts = Counter(p.stamp_ns for p in published if p.stream == "image" and p.stamp_ns is not None)
        shared = {stamp for stamp, n in counts.items() if n > 1}
        frames = {p.stamp_ns: p for p in published
                  if p.stream == "image" and p.stamp_ns is not None and p.stamp_ns not in shared}
        audio = [p for p in published if p.stream == "audio"]
        chunks = sorted(((chunk_ends[p.index], p) for p in audio if chunk_ends.get(p.index) is not None),
                        key=lambda c: c[0])
        unstamped = [p for p in sorted(audio, key=lambda p: p.index)
                     if chunk_ends.get(p.index) is None and not p.stamp_ns and p.index in (chunk_samples or {})]
        samples = [(*(chunk_samples or {})[p.index], p) for p in unstamped]
        t0 = min((p.stamp_ns or p.log_time_ns for p in published), default=0)
        return cls(frames, [end for end, _ in chunks], [p for _, p in chunks], t0, shared, samples,
                   list(utterances or []) if samples else [])

    def seconds(self, stamp: int | None) -> float | None:
        """A recorded stamp on the timeline; None for none, or 0 (unstamped: not a time on it)."""
        return None if not stamp else (stamp - self.t0_ns) / 1e9

    def input_seconds(self, p: Published) -> float:
        """Where an input is on the timeline: its stamp, or its log time when it has none."""
        return (p.stamp_ns or p.log_time_ns) / 1e9 - self.t0_ns / 1e9

    def match_utterances(self, transcripts: list[Any]) -> None:
        """Find the predicted utterance of each transcript stamp (transcripts in arrival order)."""
        groups: dict[int, list] = {}
        for msg in transcripts:
            if stamp := stamp_ns(msg):
                groups.setdefault(stamp, []).append(msg)
        k = 0
        for stamp, msgs in groups.items():
            finals = [m for m in msgs if m.is_final]
            j = k
            if finals:   # the first predicted from here on that lasts as long (to a sample)
                heard = _seconds(finals[-1].audio_duration)
                while j < len(self.utterances) and abs(self.utterances[j].duration - heard) > 0.5 / self.utterances[j].rate:
                    j += 1
            if j < len(self.utterances):
                self._utterance[stamp], k = self.utterances[j], j + 1

    def _chunk_at(self, sample: int) -> tuple[int, int, int, Published]:
        """The unstamped chunk holding `sample` (the last one past the end)."""
        i = bisect.bisect_right(self.firsts, sample) - 1
        return self.samples[max(0, min(i, len(self.samples) - 1))]

    def _span(self, msg: Any) -> tuple[int, int] | None:
        """(first sample, one past the last) of a transcript of unstamped audio, from its utterance."""
        u = self._utterance.get(stamp_ns(msg))
        if u is None or u.start is not None:   # unknown, or stamped: its stamp says
            return None
        return u.first, u.first + max(1, round(_seconds(msg.audio_duration) * u.rate))

    def result_seconds(self, output: Output, msg: Any) -> float | None:
        """Where a result is on the timeline: its stamp, or for a transcript of unstamped audio
        its first sample's place in the bag (the log time of the chunk that held it, a chunk
        logged as its capture ends)."""
        if output.source == "utterance" and self.samples and not self._stamped(msg):
            span = self._span(msg)
            if span is None:
                return None
            first, n, rate, chunk = self._chunk_at(span[0])
            return (chunk.log_time_ns - self.t0_ns) / 1e9 - (first + n - span[0]) / rate
        return self.seconds(stamp_ns(msg))

    def _stamped(self, msg: Any) -> bool:
        """A transcript of stamped audio, where the stream has unstamped chunks too."""
        u = self._utterance.get(stamp_ns(msg))
        return u is not None and u.start is not None

    def source(self, output: Output, msg: Any) -> Published | None:
        """The input that produced `msg`, when one input did: for a transcript, the chunk that held
        its last sample (the earliest it could have been transcribed)."""
        stamp = stamp_ns(msg)
        if output.source == "frame":
            return self.frames.get(stamp)
        if output.source == "utterance" and self.samples and not self._stamped(msg):
            span = self._span(msg)
            return None if span is None else self._chunk_at(span[1] - 1)[3]
        if output.source == "utterance" and self.chunks:
            last_sample = time_to_seconds(msg.header.stamp) + _seconds(msg.audio_duration)
            i = bisect.bisect_left(self.chunk_ends, last_sample - 1e-6)
            return self.chunks[min(i, len(self.chunks) - 1)]
        return None


def result_rows(log: ResultLog, timeline: InputTimeline) -> dict[str, list[dict]]:
    """topic -> one row per message received on it (every topic of the log, empty ones too)."""
    rows: dict[str, list[dict]] = {}
    timeline.match_utterances([r.msg for o in log.outputs if o.source == "utterance" for r in log.results(o.topic)])
    for output in log.outputs:
        rows[output.topic] = [_row(r, output, timeline) for r in log.results(output.topic)]
    return rows


def _row(result: Result, output: Output, timeline: InputTimeline) -> dict:
    source = timeline.source(output, result.msg)
    stamp = stamp_ns(result.msg)
    return {"received_ns": result.received_ns,
            "stamp_ns": stamp,
            "time_s": timeline.result_seconds(output, result.msg),
            "input_index": None if source is None else source.index,
            "delay_s": None if source is None else round(result.at - source.at, 6),
            **flatten_message(result.msg)}


def flatten_message(msg: Any, prefix: str = "") -> dict[str, Any]:
    """A message as flat columns: nested fields joined with dots, times and durations as seconds,
    sequences as JSON."""
    if isinstance(msg, (Time, Duration)):
        return {prefix.rstrip("."): _seconds(msg)}
    flat: dict[str, Any] = {}
    for name in msg.get_fields_and_field_types():
        value = getattr(msg, name)
        if hasattr(value, "get_fields_and_field_types"):
            flat.update(flatten_message(value, f"{prefix}{name}."))
        elif isinstance(value, (str, bool, int, float)):
            flat[prefix + name] = value
        else:
            flat[prefix + name] = json.dumps(_plain(value))
    return flat


def _plain(value: Any) -> Any:
    """Sequences of numbers or messages as JSON-ready lists."""
    if hasattr(value, "get_fields_and_field_types"):
        return flatten_message(value)
    if isinstance(value, (bytes, bytearray)):
        return list(value)
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, (list, tuple)) or hasattr(value, "__iter__"):
        return [_plain(v) for v in value]
    return value


def _seconds(t: Time | Duration) -> float:
    return t.sec + t.nanosec * 1e-9


# --- writing --------------------------------------------------------------------------------------
def csv_name(topic: str) -> str:
    return topic.strip("/").replace("/", "__") + ".csv"


def write_csv(path: Path, rows: list[dict]) -> None:
    """Rows as CSV; columns in the order they first appear. An empty table gets its header only
    when rows give none: the file still says the topic was recorded."""
    columns: dict[str, None] = dict.fromkeys(["received_ns", "stamp_ns", "time_s", "input_index", "delay_s"])
    for row in rows:
        columns.update(dict.fromkeys(row))
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(columns))
        writer.writeheader()
        writer.writerows(rows)


def write_results_bag(path: Path, storage: str, log: ResultLog, namespace: str = "/") -> int:
    """Every result at its arrival time, on its topic (fully qualified); returns the count."""
    results = sorted(log.results(), key=lambda r: r.received_ns)
    with BagWriter(path, storage) as bag:
        for result in results:
            bag.write(namespace.rstrip("/") + "/" + result.topic, result.msg, result.received_ns)
    return len(results)
