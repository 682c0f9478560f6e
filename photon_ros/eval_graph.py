"""The graph under evaluation, run in this process: its nodes (configured as bringup configures
them) and the evaluator's own node, which publishes the bag's inputs and subscribes to every
result, on one executor in a private rclpy context. `GraphRun.run()` waits for the models,
replays, then waits for every result the inputs call for.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import rclpy
from rclpy.executors import MultiThreadedExecutor
from rclpy.node import Node
from rclpy.qos import QoSProfile, ReliabilityPolicy

from photon_ros.bag_io import BagMessage, StreamedMessages, message_class, stamp_ns
from photon_ros.bringup import build_graph
from photon_ros.audio_common_conversions import AudioInfoFormat
from photon_ros.audio_conversions import EmptyAudio
from photon_ros.graph_probe import (GraphError, Predicted, SpeechProbe, VisionProbe, chunk_end, loop_statuses,
                                    predict_utterances)
from photon_ros.replay import ChunkGate, FrameGate, Published, ReplayStalled, Stream, replay
from photon_ros.result_log import FrameProgress, ResultLog, role_outputs

# The processing nodes of each graph; the audio source of bringup's graphs is the bag here.
ROLES = {"vision": ["vision"], "speech": ["speech"], "all": ["vision", "speech", "loop"]}
IMAGE_TOPICS = {"sensor_msgs/msg/Image": "image", "sensor_msgs/msg/CompressedImage": "image/compressed"}
LOAD_TIMEOUT_S = 300.0     # models load (and warm up) before the replay starts
MATCH_TIMEOUT_S = 30.0     # DDS discovery between the evaluator and the graph
TRANSPORT_S = 5.0          # a frame not at the node this long after it was sent is lost
GRACE_S = 0.5              # after the awaited results, for extras still in flight (captions, partials)
# At max rate a frame's depth and camera_info go this far ahead of the bag's order: before their
# frame (logged a few ms apart from it), never more than a frame or two ahead at 30 Hz (the node keeps 10).
COMPANION_LEAD_S = 0.05


def graph_nodes(config_path: Path, roles: list[str], context, overrides: dict[str, dict]) -> dict[str, Any]:
    """The graph's processing nodes, configured as bringup configures them (its build_graph, without
    an audio source: the bag is the source)."""
    nodes = build_graph(config_path, "all", context=context, overrides=overrides, roles=roles)
    for role, node in zip(roles, nodes):
        if node.get_parameter("use_sim_time").value:
            for made in nodes:
                made.destroy_node()
            raise GraphError(f"{role}: use_sim_time is not supported here: the replay publishes no /clock (the "
                             "graph runs on this machine's clock, the bag's stamps kept as recorded)")
    return dict(zip(roles, nodes))


@dataclass
class Run:
    """What happened during one replay."""
    published: list[Published]    # in publishing order
    log: ResultLog
    chunk_ends: dict[int, float | None]   # audio chunk index -> capture time after its last sample
    counters: dict[str, Any]
    pending: list[str]            # results awaited that never came
    # audio: chunk index -> (its first sample, samples, rate), and the utterances predicted in them
    chunk_samples: dict[int, tuple[int, int, int]] = field(default_factory=dict)
    utterances: list[Predicted] = field(default_factory=list)


class GraphRun:
    def __init__(self, messages: dict[str, Sequence[BagMessage]], types: dict[str, str], graph: str,
                 config: Path, overrides: dict[str, dict]) -> None:
        self.messages, self.types = messages, types
        self.context = rclpy.Context()
        rclpy.init(context=self.context)
        self.nodes: dict[str, Any] = {}
        self.node = self.executor = None
        self.spin_error: BaseException | None = None
        self.failed = threading.Event()    # set when a callback of the graph raised: stops the replay
        self.closing = threading.Event()
        self.spinner: threading.Thread | None = None
        try:
            self.nodes = graph_nodes(config, ROLES[graph], self.context, overrides)
            self.node = Node("photon_evaluate", context=self.context)
            self.vision = VisionProbe(self.nodes["vision"]) if "vision" in self.nodes else None
            self.speech = SpeechProbe(self.nodes["speech"]) if "speech" in self.nodes else None
            self.progress = self._frame_progress()
            outputs = [o for role in ROLES[graph] for o in role_outputs(role, self.nodes.get(role))]
            self.log = ResultLog(self.node, outputs, self.progress.add if self.progress else None)
            self.audio, self.cut = self._decoded_audio()
            self.starts = self._audio_starts()
            self.executor = MultiThreadedExecutor(num_threads=4, context=self.context)
            for node in [*self.nodes.values(), self.node]:
                self.executor.add_node(node)
            self.spinner = threading.Thread(target=self._spin, daemon=True)
            self.spinner.start()
        except BaseException:
            self.close()
            raise

    def _frame_progress(self) -> FrameProgress | None:
        """How a frame is seen answered (every awaited result in); None where it cannot be: no
        prompt every frame answers (a caption still coming cannot be told from none), or frames
        sharing stamps (their results cannot be told apart). The worker's frames_done ends the
        wait then (_vision_pending)."""
        if self.vision is None or "image" not in self.messages:
            return None
        prompts = self.vision.prompts()
        frames = self.messages["image"]
        stamps = ([frames.stamp_of(i) for i in range(len(frames))] if isinstance(frames, StreamedMessages)
                  else [stamp_ns(m.msg) for m in frames])
        if not prompts or len(set(stamps)) < len(stamps):
            return None
        return FrameProgress(prompts)

    def _decoded_audio(self) -> tuple[list, list[bool]]:
        """PCM of each audio message as the speech node will decode it (None where it cannot:
        the node skips those chunks), ros-drivers' audio with the AudioInfo logged before it; and
        for each, whether the node cuts the stream there (a refused chunk is a hole in the audio,
        an empty one is not)."""
        if self.speech is None:
            return [], []
        infos, info, pcms, cuts = list(self.messages.get("audio_info", [])), AudioInfoFormat(), [], []
        for m in self.messages.get("audio", []):
            while infos and infos[0].log_time_ns <= m.log_time_ns:
                info.update(infos.pop(0).msg)
            try:
                pcm, cut = self.speech.decode(m.msg, info), False
            except EmptyAudio:
                pcm, cut = None, False
            except ValueError:
                pcm, cut = None, True
            pcms.append(pcm)
            cuts.append(cut)
        return pcms, cuts

    def _audio_starts(self) -> list[float | None]:
        """Capture time of each audio message's first sample as the node computes it."""
        if self.speech is None:
            return []
        return self.speech.starts([m.msg for m in self.messages.get("audio", [])], self.audio)

    def _spin(self) -> None:
        while self.context.ok() and not self.closing.is_set():
            try:
                self.executor.spin_once(timeout_sec=0.05)
            except Exception as err:  # noqa: BLE001 - reported by check(); shutdown races end the loop
                if self.context.ok():
                    self.spin_error = err
                    self.failed.set()
                return

    def check(self) -> None:
        """GraphError once a callback of the graph has raised (the executor stops there)."""
        if self.spin_error is not None:
            raise GraphError(f"a callback of the graph raised {type(self.spin_error).__name__}: "
                             f"{self.spin_error}") from self.spin_error

    def close(self) -> None:
        # Spinning stops first: a callback dispatched while its node is destroyed fails.
        self.closing.set()
        if self.spinner is not None:
            self.spinner.join(timeout=10)
        if self.executor is not None:
            self.executor.shutdown()
        for node in self.nodes.values():
            node.destroy_node()      # stops the workers before their publishers go
        if self.node is not None:
            self.node.destroy_node()
        rclpy.try_shutdown(context=self.context)

    # --- before the replay ----------------------------------------------------------------------
    def streams(self, rate: float | None, window: int, stall_s: float) -> tuple[list[Stream], dict[int, float | None]]:
        """A replay stream per input, with its publisher and (at max rate) its gate; and the end
        time of each audio chunk as the speech node will compute it."""
        streams, ends = [], {}
        qos = lambda depth: QoSProfile(depth=depth, reliability=ReliabilityPolicy.RELIABLE)  # noqa: E731
        if "image" in self.messages:
            topic = IMAGE_TOPICS[self.types["image"]]
            publisher = self.node.create_publisher(message_class(self.types["image"]), topic, qos(10))
            gate = FrameGate(self.vision, self.progress, window, TRANSPORT_S, stall_s) if rate is None else None
            streams.append(Stream("image", topic, self.messages["image"], publisher, gate))
        for name in ("depth", "camera_info"):   # (use_depth) as the bag has them, in its order with the frames
            if name in self.messages:
                publisher = self.node.create_publisher(message_class(self.types[name]), name, qos(10))
                streams.append(Stream(name, name, self.messages[name], publisher, lead_s=COMPANION_LEAD_S))
        if "audio_info" in self.messages and self.speech is not None:   # ros-drivers' format, beside its audio
            publisher = self.node.create_publisher(message_class(self.types["audio_info"]), "audio_info", qos(10))
            streams.append(Stream("audio_info", "audio_info", self.messages["audio_info"], publisher,
                                  lead_s=COMPANION_LEAD_S))
        if "audio" in self.messages and self.speech is not None:
            messages = self.messages["audio"]
            publisher = self.node.create_publisher(message_class(self.types["audio"]), "audio", qos(100))
            ends = {i: None if pcm is None else chunk_end(start, pcm)
                    for i, (start, pcm) in enumerate(zip(self.starts, self.audio))}
            gate = None
            if rate is None:
                gate = ChunkGate(self.speech, [ends[i] for i in range(len(messages))], stall_s=stall_s)
            streams.append(Stream("audio", "audio", messages, publisher, gate))
        return streams, ends

    def wait_ready(self, streams: list[Stream]) -> None:
        """Models loaded, and DDS has matched our publishers and subscriptions with the graph."""
        probes = [p for p in (self.vision, self.speech) if p is not None]
        if not _wait(lambda: all(p.loaded() for p in probes), LOAD_TIMEOUT_S, self.check):
            raise GraphError(f"the models did not load within {LOAD_TIMEOUT_S:g} s")
        if not _wait(lambda: not self.unmatched(streams), MATCH_TIMEOUT_S, self.check):
            raise GraphError(f"no match on {', '.join(self.unmatched(streams))} within {MATCH_TIMEOUT_S:g} s: "
                             f"the graph does not subscribe to or publish these topics (check --set "
                             f"overrides of vision.input / speech.input_type)")

    def unmatched(self, streams: list[Stream]) -> list[str]:
        """Input topics the graph does not subscribe to yet, and output topics nobody publishes."""
        return ([s.publisher.topic_name for s in streams if s.publisher.get_subscription_count() == 0]
                + self.log.unmatched())

    def predicted_utterances(self) -> list[Predicted]:
        """Final utterances the speech node will cut from the bag's audio."""
        if self.speech is None:
            return []
        # a refused chunk cuts the utterance around it, as in the node: unstamped audio shows no
        # hole, and one utterance was predicted where the node made two (the second's result lost)
        chunks = [(pcm, start) for start, pcm, cut in zip(self.starts, self.audio, self.cut) if pcm is not None or cut]
        return predict_utterances(chunks, self.speech.vad_config)

    def chunk_samples(self) -> dict[int, tuple[int, int, int]]:
        """Audio chunk index -> (its first sample, its samples, its rate), over the decodable
        chunks in order (as predict_utterances counts them)."""
        spans, first = {}, 0
        for i, pcm in enumerate(self.audio):
            if pcm is not None:
                spans[i] = (first, pcm.samples.size, pcm.sample_rate)
                first += pcm.samples.size
        return spans

    # --- after the replay -----------------------------------------------------------------------
    def pending(self, frames_sent: int, since_sent: float, utterances: int) -> list[str]:
        """Results the inputs call for that have not arrived yet (empty: all are in)."""
        finals = [r.msg for r in self.log.results("transcript") if r.msg.is_final]
        return (self._vision_pending(frames_sent, since_sent) + self._speech_pending(len(finals), utterances)
                + self._loop_pending(finals))

    def _vision_pending(self, frames_sent: int, since_sent: float) -> list[str]:
        if self.vision is None or not frames_sent:
            return []
        c, waiting = self.vision.counters(), []
        if c.received < frames_sent and since_sent < TRANSPORT_S:
            waiting.append(f"{frames_sent - c.received} frame(s) on the way to the vision node")
        if c.received > c.settled:
            waiting.append("a frame waits in the vision node's mailbox")
        if self.progress is None:
            # Results not told apart by frame (no prompt a frame always answers, or shared stamps):
            # all are out once the worker is done with every frame it took (it publishes first).
            if c.done < c.taken:
                waiting.append(f"the results of {c.taken - c.done} frame(s) the vision node is processing")
        elif self.progress.complete + c.bad < c.taken:
            waiting.append(f"results of {c.taken - c.bad - self.progress.complete} frame(s) "
                           f"({', '.join(f'{t} {p!r}' for t, p in sorted(self.progress.prompts))})")
        return waiting

    def _speech_pending(self, finals: int, utterances: int) -> list[str]:
        if self.speech is None:
            return []
        waiting = ["the end of an utterance the speech node has open"] if self.speech.in_speech() else []
        dropped = self.speech.counters()["utterances_dropped"]
        if finals + dropped < utterances:
            waiting.append(f"{utterances - finals - dropped} final transcript(s) of {utterances} "
                           f"utterance(s) in the audio")
        return waiting

    def _loop_pending(self, finals: list) -> list[str]:
        if "loop" not in self.nodes:
            return []
        missing = sum(loop_statuses(t) for t in finals) - len(self.log.results("status"))
        return [f"{missing} status line(s) of the loop node"] if missing > 0 else []

    def settle(self, frames_sent: int, utterances: int, timeout: float) -> list[str]:
        """Wait for the awaited results; give up once nothing has moved for `timeout` seconds.
        Returns what is still missing."""
        sent_at = moved = time.monotonic()
        last = None
        while waiting := self.pending(frames_sent, time.monotonic() - sent_at, utterances):
            self.check()
            state = (len(self.log), self.vision and self.vision.counters(),
                     self.speech and self.speech.audio_until(), self.speech and self.speech.in_speech())
            if state != last:
                last, moved = state, time.monotonic()
            elif time.monotonic() - moved > timeout:
                return waiting
            time.sleep(0.02)
        count, quiet_since = len(self.log), time.monotonic()
        while time.monotonic() - quiet_since < GRACE_S:
            time.sleep(0.05)
            if len(self.log) != count:
                count, quiet_since = len(self.log), time.monotonic()
        return []

    def counters(self, published: list[Published], utterances: int) -> dict[str, Any]:
        """The nodes' own counters, beside what was published."""
        counts: dict[str, Any] = {}
        frames = sum(1 for p in published if p.stream == "image")
        if self.vision is not None and frames:
            c = self.vision.counters()
            counts["vision"] = {"frames_published": frames, "frames_received": c.received,
                                "frames_processed": c.taken - c.bad, "frames_dropped": c.dropped,
                                "bad_frames": c.bad, "frames_lost_in_transport": max(0, frames - c.received)}
        if self.speech is not None:
            counts["speech"] = {"chunks_published": sum(1 for p in published if p.stream == "audio"),
                                "utterances_in_audio": utterances, **self.speech.counters()}
        return counts

    def end_of_audio(self, published: list[Published], timeout: float) -> None:
        """At max rate (no idle flush): once the node has handled every chunk, the recording's end
        ends the utterance in progress."""
        chunks = sum(1 for p in published if p.stream == "audio")
        if self.speech is None or not chunks:
            return
        if _wait(lambda: self.speech.chunks_handled() >= chunks, timeout, self.check):
            self.speech.end_of_recording()

    def run(self, rate: float | None, window: int, settle_timeout: float) -> Run:
        streams, ends = self.streams(rate, window, settle_timeout)
        self.wait_ready(streams)
        predicted = self.predicted_utterances()
        utterances = len(predicted)
        if self.speech is not None and rate != 1.0:
            self.speech.pace(rate)
        try:
            published = replay(streams, rate, self.failed)
        except ReplayStalled as stalled:   # what came until then is written out, with the reason
            self.check()
            return Run(stalled.published, self.log, ends, self.counters(stalled.published, utterances),
                       [f"the replay stopped: {stalled}"], self.chunk_samples(), predicted)
        self.check()
        if rate is None:
            self.end_of_audio(published, settle_timeout)
        frames = sum(1 for p in published if p.stream == "image")
        pending = self.settle(frames, utterances, settle_timeout)
        return Run(published, self.log, ends, self.counters(published, utterances), pending,
                   self.chunk_samples(), predicted)


def _wait(predicate: Callable[[], bool], timeout: float, check: Callable[[], None], poll: float = 0.05) -> bool:
    """Poll `predicate` until true or `timeout`; `check()` raises to give up early."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        check()
        if predicate():
            return True
        time.sleep(poll)
    return bool(predicate())
