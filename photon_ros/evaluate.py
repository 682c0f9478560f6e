"""Evaluate a graph on a recorded bag: replay it, record the results, write CSVs and a report.

    python -m photon_ros.evaluate BAG --graph vision|speech|all [--rate 1.0|max] [--out DIR]
        [--config photon.yaml] [--set vision.detect='[cup]'] [--image-topic T] [--audio-topic T]
        [--depth-topic T] [--camera-info-topic T] [--window N] [--storage sqlite3|mcap] [--settle-timeout S]

The graph is the one `photon_ros.bringup` starts from the same YAML, minus the audio source (the
bag is the source), in this process over real DDS. It is configured to take the bag's input
types (Image or CompressedImage; AudioChunk, Int16MultiArray or Float32MultiArray, and both
audio_common_msgs families' audio where that package is installed: ros-drivers' with its AudioInfo
topic, replayed beside it). With
vision.use_depth the bag's depth image (aligned to the colour image) and the colour camera's
CameraInfo are replayed too, and the 3D results recorded (no /tf: target_frame is refused). Out come:
  results/         a bag (the input's storage) of every result message, at its arrival time
  <topic>.csv      one row per result message: its stamp, the input that produced it, the delay
                   from publishing that input to receiving the result, and the message's fields
  inputs.csv       every input published, and whether each frame gave results
  report.png       latency over time, detections per frame, transcripts over the audio, frames
                   without results
  summary.json     counts, the nodes' own drop counters, any result that never came, and the
                   bag's messages that could not be decoded (skipped, counted per topic)

Replay at a rate keeps the bag's timing; at max, each stream goes as fast as the graph takes it
(photon_ros.replay). The speech node's idle flush (an utterance ends after idle_flush_s without
audio, by the clock) follows the pace: scaled by the rate, off at max rate, where the recording's
end ends the last utterance (graph_probe.SpeechProbe.pace). The evaluation ends when every result the inputs call for has arrived
(photon_ros.graph_probe predicts them), or when nothing has moved for --settle-timeout seconds.
Exit status: 0 when every result the inputs called for came, 3 when some never came, the graph
published nothing, or a node stopped taking input for --settle-timeout (the outputs are written
either way, with what came), 2 for unusable input, 1 for a graph that could not run. In the `all` graph the loop's rule against frames captured before its own last turn
is off: a bag's frames were captured with the recording robot's motion, not the loop's.
Modules: bag_io (bags), eval_graph (the graph, run), replay (timing), graph_probe (the nodes'
counters), result_log (results, CSVs), eval_report (the PNG); this one reads the bag's inputs
and writes the outputs.
"""
from __future__ import annotations

import argparse
import csv
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import yaml
from rclpy.exceptions import ParameterException

from photon_ros.audio_common_conversions import ROS_DRIVERS
from photon_ros.bag_io import (STORAGES, BagError, BagMessage, StreamedMessages, Undecodable, bag_storage,
                               bag_topics, read_messages)
from photon_ros.bringup import DEFAULT_CONFIG, node_parameters, use_large_data_profile
from photon_ros.eval_graph import ROLES, GraphRun, Run
from photon_ros.eval_report import ReportData, audio_envelope, plot_report
from photon_ros.graph_probe import GraphError
from photon_ros.replay import Published
from photon_ros.result_log import InputTimeline, Output, csv_name, result_rows, write_csv, write_results_bag
from photon_ros.speech_params import AUDIO_COMMON_INPUTS

# Input types the graph takes, and the node parameter value that makes it take each.
IMAGE_TYPES = {"sensor_msgs/msg/Image": "raw", "sensor_msgs/msg/CompressedImage": "compressed"}
AUDIO_TYPES = {"photon_ros/msg/AudioChunk": "audio_chunk", "std_msgs/msg/Int16MultiArray": "int16",
               "std_msgs/msg/Float32MultiArray": "float32",
               **{msgtype: input_type for input_type, (msgtype, _) in AUDIO_COMMON_INPUTS.items()}}
# ros-drivers' audio carries no format: its AudioInfo topic is replayed beside it.
AUDIO_INFO_TYPE = "audio_common_msgs/msg/AudioInfo"
NEEDS = {"vision": ["image"], "speech": ["audio"], "all": ["image", "audio"]}
# With vision.use_depth: the depth image aligned to the colour image, and the colour camera's info.
DEPTH_TYPE, INFO_TYPE = "sensor_msgs/msg/Image", "sensor_msgs/msg/CameraInfo"


@dataclass
class Inputs:
    """The bag's messages the graph will get, per stream ("image", "audio")."""
    bag: Path
    topics: dict[str, str] = field(default_factory=dict)           # stream -> bag topic
    types: dict[str, str] = field(default_factory=dict)            # stream -> message type
    messages: dict[str, Sequence[BagMessage]] = field(default_factory=dict)
    ignored: dict[str, str] = field(default_factory=dict)          # bag topic -> type, not replayed
    undecodable: list[Undecodable] = field(default_factory=list)   # damaged records, skipped

    def undecodable_counts(self) -> dict[str, int]:
        """bag topic -> how many of its messages could not be decoded (and were not replayed)."""
        counts: dict[str, int] = {}
        for bad in self.undecodable:
            counts[bad.topic] = counts.get(bad.topic, 0) + 1
        return counts


def choose_topic(topics: dict[str, str], accepted: dict[str, str], wanted: str | None, what: str) -> str | None:
    """The bag topic to replay as `what`: `wanted`, else the only topic of an accepted type."""
    if wanted is not None:
        name = wanted if wanted in topics else "/" + wanted.lstrip("/")
        if name not in topics:
            raise BagError(f"the bag has no topic {wanted!r} (it has {', '.join(sorted(topics)) or 'none'})")
        if topics[name] not in accepted:
            raise BagError(f"{name} is {topics[name]}, which the graph cannot take as {what} "
                           f"(it takes {', '.join(accepted)})")
        return name
    candidates = sorted(t for t, kind in topics.items() if kind in accepted)
    if len(candidates) > 1:
        raise BagError(f"the bag has several {what} topics ({', '.join(candidates)}): "
                       f"choose one with --{what}-topic")
    return candidates[0] if candidates else None


def _namespace(topic: str) -> str:
    """/camera/color/image_raw/compressed -> /camera/color"""
    parts = topic.rstrip("/").split("/")
    while parts and parts[-1] in ("compressed", "image_raw", "image_rect_raw", "image_rect", "image"):
        parts.pop()
    return "/".join(parts)


def choose_depth_topic(topics: dict[str, str], image_topic: str, wanted: str | None) -> str:
    """The depth image aligned to the colour image: `wanted`, else the only Image topic named for
    depth, the aligned one where there are several (a RealSense records both)."""
    if wanted is not None:
        return choose_topic(topics, {DEPTH_TYPE: ""}, wanted, "depth")
    depth = sorted(t for t, kind in topics.items() if kind == DEPTH_TYPE and t != image_topic and "depth" in t)
    aligned = [t for t in depth if "aligned" in t]
    if len(aligned) == 1 or len(depth) == 1:
        return (aligned or depth)[0]
    if not depth:
        raise BagError("vision.use_depth is set but the bag has no depth image (an Image topic named for "
                       "depth; compressed depth is not taken): give it with --depth-topic, or evaluate without depth")
    raise BagError(f"the bag has several depth images ({', '.join(depth)}): choose the one aligned to "
                   f"{image_topic} with --depth-topic")


def choose_info_topic(topics: dict[str, str], image_topic: str, depth_topic: str, wanted: str | None) -> str:
    """The colour camera's CameraInfo: `wanted`, else the one beside the image (or beside the
    aligned depth, which carries the colour camera's), else the only one."""
    if wanted is not None:
        return choose_topic(topics, {INFO_TYPE: ""}, wanted, "camera-info")
    infos = sorted(t for t, kind in topics.items() if kind == INFO_TYPE)
    for near in (image_topic, depth_topic):
        if (beside := _namespace(near) + "/camera_info") in infos:
            return beside
    if len(infos) == 1:
        return infos[0]
    raise BagError(f"vision.use_depth is set and the bag has {'no' if not infos else 'several'} CameraInfo "
                   f"topic{'s' if len(infos) != 1 else ''}{' (' + ', '.join(infos) + ')' if infos else ''} "
                   f"beside none of {image_topic}, {depth_topic}: choose one with --camera-info-topic")


def choose_audio_info_topic(topics: dict[str, str], audio_topic: str) -> str:
    """ros-drivers' AudioInfo for its audio: the one beside it, else the only one."""
    infos = sorted(t for t, kind in topics.items() if kind == AUDIO_INFO_TYPE)
    beside = audio_topic.rsplit("/", 1)[0] + "/audio_info"
    if beside in infos or len(infos) == 1:
        return beside if beside in infos else infos[0]
    raise BagError(f"{audio_topic} is ros-drivers audio, which carries no format, and the bag has "
                   + (f"several AudioInfo topics ({', '.join(infos)}), none beside it" if infos else
                      "no AudioInfo topic: record audio_info with the audio"))


def load_inputs(bag: Path, graph: str, image_topic: str | None = None, audio_topic: str | None = None,
                depth: bool = False, depth_topic: str | None = None, info_topic: str | None = None) -> Inputs:
    """Read the topics the graph needs from the bag (with `depth`, the vision node's depth image
    and camera_info too); BagError when it lacks them."""
    topics = bag_topics(bag)
    inputs = Inputs(Path(bag))
    # only the streams the graph takes: a speech graph need not choose among a RealSense's images
    # a depth camera's depth images are not the colour images the model takes
    colour = {t: k for t, k in topics.items() if "depth" not in t} if image_topic is None else topics
    choose = {"image": lambda: choose_topic(colour, IMAGE_TYPES, image_topic, "image"),
              "audio": lambda: choose_topic(topics, AUDIO_TYPES, audio_topic, "audio")}
    chosen = {stream: choose[stream]() for stream in NEEDS[graph]}
    for stream in NEEDS[graph]:
        if chosen[stream] is None:
            kinds = IMAGE_TYPES if stream == "image" else AUDIO_TYPES
            raise BagError(f"{bag}: no {stream} topic for the {graph} graph (topics of type "
                           f"{', '.join(kinds)}); the bag has: "
                           + (", ".join(f"{t} ({k})" for t, k in sorted(topics.items())) or "nothing"))
        inputs.topics[stream] = chosen[stream]
        inputs.types[stream] = topics[chosen[stream]]
    if depth and "image" in chosen:
        inputs.topics["depth"] = choose_depth_topic(topics, inputs.topics["image"], depth_topic)
        inputs.topics["camera_info"] = choose_info_topic(topics, inputs.topics["image"], inputs.topics["depth"],
                                                         info_topic)
        inputs.types.update(depth=DEPTH_TYPE, camera_info=INFO_TYPE)
    if AUDIO_COMMON_INPUTS.get(AUDIO_TYPES.get(inputs.types.get("audio", ""), ""), ("", ""))[1] == ROS_DRIVERS:
        inputs.topics["audio_info"] = choose_audio_info_topic(topics, inputs.topics["audio"])
        inputs.types["audio_info"] = AUDIO_INFO_TYPE
    for stream, topic in inputs.topics.items():
        # A damaged record is skipped and counted (summary.json, the report): one bad message
        # should not cost the evaluation of a whole recording.
        skipped: list[Undecodable] = []
        # images are read again as they are replayed, not held (a bag's frames can be gigabytes)
        inputs.messages[stream] = (StreamedMessages(bag, topic, skipped) if stream in ("image", "depth")
                                   else list(read_messages(bag, [topic], skipped)))
        inputs.undecodable += skipped
        if not inputs.messages[stream]:
            if skipped:
                raise BagError(f"{bag}: none of the {len(skipped)} messages on {topic} can be decoded "
                               f"(the first: {skipped[0].error})")
            raise BagError(f"{bag}: topic {topic} holds no messages")
    inputs.ignored = {t: k for t, k in topics.items() if t not in inputs.topics.values()}
    return inputs


def vision_setting(config: Path, overrides: dict[str, dict], name: str, default: Any) -> Any:
    """A vision node parameter as the graph will have it: the override, else the config file's
    (as bringup reads it), else the node's default."""
    if name in overrides.get("vision", {}):
        return overrides["vision"][name]
    params = node_parameters(yaml.safe_load(Path(config).read_text()) or {}, "vision")
    return next((p.value for p in params if p.name == name), default)


def depth_wanted(graph: str, config: Path, overrides: dict[str, dict], depth_topic: str | None,
                 info_topic: str | None) -> bool:
    """Whether the vision node uses depth (its depth image and camera_info are replayed then);
    ValueError for what the replay cannot give it."""
    if graph == "speech":
        return False
    use_depth = bool(vision_setting(config, overrides, "use_depth", False))
    if not use_depth and (depth_topic or info_topic):
        raise ValueError("--depth-topic / --camera-info-topic are for a vision node with depth: "
                         "add --set vision.use_depth=true")
    if use_depth and vision_setting(config, overrides, "target_frame", ""):
        raise ValueError("vision.target_frame is set, but the replay does not publish the bag's /tf: "
                         "results would not reach that frame. Leave it empty (positions in the camera's frame)")
    return use_depth


def input_overrides(inputs: Inputs) -> dict[str, dict[str, Any]]:
    """Node parameters that make the graph take the bag's input types, and the loop judge its
    inputs as a replay must: they were captured with the recording robot's motion, on a clock the
    graph's does not share, so its rules against frames from before its own last turn and against
    commands said long ago (a live robot's) are off."""
    overrides: dict[str, dict[str, Any]] = {"loop": {"refuse_frames_before_turn": False, "max_command_age_s": 0.0}}
    if "image" in inputs.types:
        overrides["vision"] = {"input": IMAGE_TYPES[inputs.types["image"]]}
    if "audio" in inputs.types:
        overrides["speech"] = {"input_type": AUDIO_TYPES[inputs.types["audio"]]}
    return overrides


def parse_sets(items: list[str]) -> dict[str, dict[str, Any]]:
    """["vision.detect=[cup, ball]", "speech.vad.hangover_s=0.4"] -> {node: {param: value}};
    values are YAML, as in photon.yaml."""
    overrides: dict[str, dict[str, Any]] = {}
    for item in items:
        name, sep, value = item.partition("=")
        node, dot, param = name.partition(".")
        if not (sep and dot and node and param):
            raise ValueError(f"--set {item!r}: expected NODE.PARAM=VALUE, e.g. vision.detect='[cup]'")
        parsed = yaml.safe_load(value)
        if parsed is None:
            raise ValueError(f"--set {item!r}: no value (an empty string is written '\"\"')")
        overrides.setdefault(node, {})[param] = parsed
    return overrides


def merge_overrides(*layers: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    merged: dict[str, dict[str, Any]] = {}
    for layer in layers:
        for node, params in layer.items():
            merged.setdefault(node, {}).update(params)
    return merged


def parse_rate(text: str) -> float | None:
    """"max" -> None (as fast as the graph takes it); "1.0" -> 1.0 (the bag's pace)."""
    if text == "max":
        return None
    try:
        rate = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"rate must be a positive finite number or 'max', got {text!r}") from None
    # inf too: the speech node's idle flush, divided by the rate, would be 0, which it refuses
    # only once the models have loaded
    if not 0 < rate < math.inf:
        raise argparse.ArgumentTypeError(f"rate must be a positive finite number or 'max', got {text!r}")
    return rate


# --- outputs --------------------------------------------------------------------------------------
def write_outputs(out: Path, storage: str, inputs: Inputs, run: Run, title: str) -> dict[str, Any]:
    """The results bag, the CSVs, the report and the summary; returns the summary."""
    timeline = InputTimeline.build(run.published, run.chunk_ends, run.chunk_samples, run.utterances)
    rows = result_rows(run.log, timeline)
    write_results_bag(out / "results", storage, run.log)
    for topic, topic_rows in rows.items():
        write_csv(out / csv_name(topic), topic_rows)
    with_results = _frames_with_results(rows, run.log.outputs)
    frames = [p for p in run.published if p.stream == "image"]
    write_inputs_csv(out / "inputs.csv", run.published, inputs, with_results, timeline)
    times, low, high = audio_envelope(inputs.messages.get("audio", []), timeline.t0_ns)
    note = frames_note(run.counters.get("vision"))
    plot_report(out / "report.png", ReportData(
        title=title, rows=rows, frame_times=[timeline.input_seconds(p) for p in frames],
        frame_has_result=[frame_has_results(p, with_results, timeline) for p in frames], frame_note=note,
        audio_times=times, audio_low=low, audio_high=high))
    summary = {"bag": str(inputs.bag), "inputs": inputs.topics, "ignored_topics": inputs.ignored,
               "undecodable_messages": inputs.undecodable_counts(),
               "results": {topic: len(r) for topic, r in rows.items()}, **run.counters,
               "missing_results": run.pending,
               # their results name no frame: no input_index or delay_s, has_results left empty
               "frames_sharing_stamps": sum(1 for p in run.published if p.stream == "image"
                                            and p.stamp_ns in timeline.shared)}
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def frames_note(vision: dict | None) -> str:
    """The vision node's frame counters in a few words, for the report."""
    if not vision:
        return ""
    return (f"{vision['frames_published']} published, {vision['frames_processed']} processed, "
            f"{vision['frames_dropped']} dropped by the vision node (a newer frame came while it was "
            f"busy), {vision['bad_frames']} bad, {vision['frames_lost_in_transport']} lost on the way")


def _frames_with_results(rows: dict[str, list[dict]], outputs: list[Output]) -> set[int]:
    frame_topics = {o.topic for o in outputs if o.source == "frame"}
    return {r["stamp_ns"] for t in frame_topics for r in rows.get(t, []) if r["stamp_ns"] is not None}


def frame_has_results(frame: Published, with_results: set[int], timeline: InputTimeline) -> bool | None:
    """Whether a frame gave results; None where its stamp is shared with other frames (their
    results name none of them)."""
    return None if frame.stamp_ns in timeline.shared else frame.stamp_ns in with_results


def write_inputs_csv(path: Path, published: list[Published], inputs: Inputs, with_results: set[int],
                     timeline: InputTimeline) -> None:
    start = min((p.at for p in published), default=0.0)
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["stream", "bag_topic", "index", "stamp_ns", "time_s", "log_time_ns",
                         "published_s", "has_results"])
        for p in published:
            has = frame_has_results(p, with_results, timeline) if p.stream == "image" else None
            writer.writerow([p.stream, inputs.topics[p.stream], p.index, p.stamp_ns,
                             timeline.input_seconds(p), p.log_time_ns, round(p.at - start, 6),
                             "" if has is None else has])


# --- entry points ---------------------------------------------------------------------------------
def evaluate(bag: Path, graph: str = "all", rate: float | None = 1.0, out: Path | None = None,
             config: Path | None = None, overrides: dict[str, dict] | None = None,
             image_topic: str | None = None, audio_topic: str | None = None,
             storage: str | None = None, window: int = 1, settle_timeout: float = 120.0,
             depth_topic: str | None = None, info_topic: str | None = None) -> dict[str, Any]:
    """Replay `bag` through `graph` and write the outputs to `out`; returns the summary.
    BagError for a bag that cannot be used, GraphError for a graph that cannot run."""
    if window < 1:
        raise ValueError(f"--window must be at least 1 frame, got {window}")
    if not 0 < settle_timeout < math.inf:   # (NaN too: it would wait for ever on a stalled graph)
        raise ValueError(f"--settle-timeout must be a positive number of seconds, got {settle_timeout}")
    if config is not None and not Path(config).is_file():
        raise ValueError(f"--config {config}: no such file")
    known = {role for roles in ROLES.values() for role in roles}
    if set(overrides or {}) - known:
        raise ValueError(f"--set names no node of a graph: {', '.join(sorted(set(overrides) - known))} "
                         f"(nodes: {', '.join(sorted(known))})")
    bag = Path(bag)
    out = Path(out) if out is not None else Path.cwd() / f"{bag.name.split('.')[0]}_eval"
    if (out / "results").exists():
        raise BagError(f"{out / 'results'} exists already: choose another --out")
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file, not a folder")
    depth = depth_wanted(graph, config or DEFAULT_CONFIG, overrides or {}, depth_topic, info_topic)
    inputs = load_inputs(bag, graph, image_topic, audio_topic, depth, depth_topic, info_topic)
    storage = storage or bag_storage(bag)
    use_large_data_profile()   # before rclpy starts: Fast DDS reads it once
    # audio not at real time: the speech node's check of array audio's rate would cry wolf
    pace = {} if rate == 1.0 else {"speech": {"check_sample_rate": False}}
    graph_run = GraphRun(inputs.messages, inputs.types, graph, config or DEFAULT_CONFIG,
                         merge_overrides(input_overrides(inputs), pace, overrides or {}))
    try:
        run = graph_run.run(rate, window, settle_timeout)
    finally:
        graph_run.close()
    out.mkdir(parents=True, exist_ok=True)
    rate_text = "max" if rate is None else f"{rate:g}x"
    title = f"{bag.name}: {graph} graph, replayed at {rate_text}"
    if inputs.undecodable:
        title += f"; {len(inputs.undecodable)} undecodable message(s) skipped"
    return write_outputs(out, storage, inputs, run, title)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("bag", type=Path, help="rosbag2 folder, or a .mcap / .db3 file")
    parser.add_argument("--graph", choices=sorted(ROLES), default="all")
    parser.add_argument("--rate", type=parse_rate, default=1.0, help="1.0 = the bag's pace; 'max' = as fast "
                        "as the graph takes the inputs")
    parser.add_argument("--out", type=Path, help="output folder (default: ./<bag name>_eval)")
    parser.add_argument("--config", type=Path, help="node parameters (default: config/photon.yaml)")
    parser.add_argument("--set", action="append", default=[], metavar="NODE.PARAM=VALUE",
                        help="override a node parameter, e.g. --set vision.detect='[cup]'")
    parser.add_argument("--image-topic", help="the bag's image topic, when it has several")
    parser.add_argument("--audio-topic", help="the bag's audio topic, when it has several")
    parser.add_argument("--depth-topic", help="with vision.use_depth: the depth image aligned to the colour "
                        "image, when the bag's is not found by its name")
    parser.add_argument("--camera-info-topic", help="with vision.use_depth: the colour camera's CameraInfo, "
                        "when the bag's is not the one beside the image")
    parser.add_argument("--storage", choices=STORAGES, help="of the results bag (default: the input's)")
    parser.add_argument("--window", type=int, default=1, metavar="N",
                        help="at max rate, frames in flight at once (1: each frame's latency is its "
                        "own; 2: the model never idles; more: the vision node drops frames)")
    parser.add_argument("--settle-timeout", type=float, default=120.0, metavar="S",
                        help="end the evaluation when no result or counter has moved for S seconds")
    args = parser.parse_args(argv)
    try:
        overrides = parse_sets(args.set)
        summary = evaluate(args.bag, args.graph, args.rate, args.out, args.config, overrides,
                           args.image_topic, args.audio_topic, args.storage, args.window,
                           args.settle_timeout, args.depth_topic, args.camera_info_topic)
    except (BagError, ValueError, yaml.YAMLError, ParameterException) as err:   # bad input
        print(f"evaluate: {err}", file=sys.stderr)
        return 2
    except GraphError as err:
        print(f"evaluate: {err}", file=sys.stderr)
        return 1
    print(json.dumps(summary, indent=2))
    for topic, count in summary["undecodable_messages"].items():
        print(f"evaluate: skipped {count} undecodable message(s) on {topic}", file=sys.stderr)
    for missing in summary["missing_results"]:
        print(f"evaluate: never came: {missing}", file=sys.stderr)
    if summary["missing_results"] or not any(summary["results"].values()):
        print("evaluate: incomplete: " + ("results the inputs called for never came" if summary["missing_results"]
                                          else "the graph published no result at all"), file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
