"""Speech node: audio topic in, one final Transcript per utterance out, partial ones while it lasts.

    audio (photon_ros/AudioChunk by default; std_msgs/Int16MultiArray or Float32MultiArray with
           input_type "int16" / "float32", their sample rate and channels given as parameters)
      -> energy VAD cuts utterances (subscription callback, cheap), by samples, never by the clock;
         lost audio (a jump in the chunks' stamps) or a stream that stops mid-speech ends the
         utterance as incomplete, and its transcript says so (audio_complete, audio_note)
      -> bounded queue (oldest audio dropped, with a warning, when speech outruns the model), and
         beside it one slot for a partial request: the utterance so far, every
         `partial_interval_s` of its audio while the speaker is speaking
      -> when the speaker pauses for `vad.tail_s`, the final that pause gives if it lasts the
         hangover (its samples fixed by the audio: up to the last speech frame plus the tail) is
         offered for decoding ahead (`speculate`), so its transcript is ready when the hangover ends
      -> worker thread: transcribe (through the engine's batcher when the model batches, else
         under the engine's lock), finals before a speculation before any partial
      -> transcript (photon_ros/Transcript), header stamped at the utterance's first sample (the
         same stamp on an utterance's partials and its final: it names the utterance).
    /diagnostics: lifecycle and model state, chunks received / bad / ignored, audio lost at jumps,
    finals published (incomplete ones counted), utterances dropped from a backlog, audio waiting.

Partial transcripts (is_final false) carry only stable text in `text`: the words that two
partial decodes in a row agreed on (local agreement), which later partials of the utterance
only extend. The latest decode in full, stable and tentative words, is the one segment of a
partial (start 0, end the audio so far). The final transcript is a fresh decode of the whole
utterance and is the one to act on; a partial already running when the utterance ends finishes
first (the model cannot be interrupted), so partials are only started while the speaker speaks.
The first partial comes `first_partial_s` of audio after the utterance starts, the next ones every
`partial_interval_s`.

A speculative decode is used for the final only when it was decoded on exactly the final's samples
(speech that resumes within the hangover makes it stale: the utterance goes on and its final is
decoded normally), so transcripts are the same with and without speculation. It is started only
when no final is waiting and never for an utterance that has already ended.

Several microphones: `python -m photon_ros.speech_node --microphones left,right` spins one speech
node per microphone in one process (namespaces left, right: left/audio -> left/transcript, ...),
on one executor and one shared engine, as several camera nodes share one vision engine.

A managed node (photon_ros.managed): configure loads the model (`model`, `device`) and creates
the topics, activate starts transcribing, cleanup releases the model; with `autostart` (the
default) it configures and activates itself. Deactivate drops the utterance in progress and those
waiting for the model, unpublished: a manager deactivates the node to stop listening (the robot
is talking, or is busy), and half a command, or one heard before the pause, is not a command to
act on after it.
"""
from __future__ import annotations

if __name__ == "__main__":   # `python -m`: a Ctrl-C during the imports below (seconds) ends it at once
    from photon_ros.run_node import exit_on_ctrl_c
    exit_on_ctrl_c()

import argparse
import re
import sys
import threading
import time

import numpy as np
from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus
from rclpy.callback_groups import MutuallyExclusiveCallbackGroup
from rclpy.clock import Clock, ClockType
from rclpy.lifecycle import LifecycleState, TransitionCallbackReturn
from rclpy.qos import QoSProfile, ReliabilityPolicy
from std_msgs.msg import Float32MultiArray, Header, Int16MultiArray

from photon_core.runtime.decode import engine_diagnostics
from photon_core.runtime.requests import TranscribeRequest
from photon_core.runtime.shared_models import SharedModel
from photon_ros.diagnostics import publish_status
from photon_ros.audio_conversions import (EmptyAudio, Pcm, audio_chunk_to_pcm, float32_array_to_pcm,
                                          int16_array_to_pcm)
from photon_ros.input_health import InputHealth
from photon_ros.latched_topic import LatchedReader
from photon_ros.managed import ManagedNode, health, ready_or_released
from photon_ros.msg import AudioChunk, Transcript
from photon_ros.params import NodeParams
from photon_ros.result_messages import seconds_to_time, time_to_seconds, transcript_message
from photon_ros.run_node import exit_leaving_no_thread, exit_on_help, finish, init_rclpy, run_node, spin_nodes
from photon_ros.audio_common_conversions import (MGONZS13, ROS_DRIVERS, AudioInfoFormat, audio_common_to_pcm,
                                                 audio_common_types)
from photon_ros.speech_params import (AUDIO_COMMON_INPUTS, audio_common_input, check_vad, checked_rate,
                                      speech_params, vad_config)
from photon_ros.speech_segmenter import SpeechSegmenter, Utterance
from photon_ros.sample_clock import ReadStamps
from photon_ros.stream_watch import ArrivalRate, RecentLosses, StreamWatch
from photon_ros.utterance_queue import Speculations, UtteranceQueue

INPUT_TYPES = {"audio_chunk": AudioChunk, "int16": Int16MultiArray, "float32": Float32MultiArray}
RELIABILITIES = {"best_effort": ReliabilityPolicy.BEST_EFFORT, "reliable": ReliabilityPolicy.RELIABLE}
# A partial is started only while the speaker is speaking: a pause this long may be the end of
# the utterance, whose final is decoded ahead once the pause reaches the tail (0.1 s), and that
# decode must not wait behind a partial's.
PARTIAL_MAX_PAUSE_S = 0.05
# The key run_model adds to a model's result: the (language, initial_prompt) it was decoded with.
SETTINGS_USED = "_settings_used"


def _comparable(words: list[str]) -> list[str]:
    """Words as compared between decodes: case and punctuation are not disagreement."""
    return [re.sub(r"[^\w']", "", w.lower()) for w in words]


def _common_prefix(a: list[str], b: list[str]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


class StableText:
    """Local agreement over the partial decodes of one utterance: a word is committed once two
    decodes in a row put the same words before it and it; committed words are never taken back
    (a later decode that disagrees leaves them and only its words after them are tentative)."""

    def __init__(self) -> None:
        self.utterance: float | None = None     # start time of the utterance the words belong to
        self.committed: list[str] = []
        self._previous: list[str] = []          # the last decode, comparable

    def update(self, utterance: float, text: str) -> tuple[str, str]:
        """Feed the newest partial decode of `utterance`; returns (committed, tentative) text."""
        if utterance != self.utterance:
            self.utterance, self.committed, self._previous = utterance, [], []
        words = text.split()
        said, n = _comparable(words), len(self.committed)
        agreed = _common_prefix(self._previous, said)
        if agreed > n and said[:n] == _comparable(self.committed):
            self.committed = self.committed + words[n:agreed]
        self._previous = said
        return " ".join(self.committed), " ".join(words[len(self.committed):])


def audio_qos(reliability: str) -> QoSProfile:
    """The audio subscription's QoS. Best effort by default: a best-effort reader matches
    best-effort publishers (microphone drivers publish with sensor-data QoS) and reliable ones
    alike, where a reliable reader never matches the former; audio lost on the way then shows as
    a jump in the chunks' stamps, which the segmenter reports. Deep enough for a second of 10 ms
    chunks arriving while a callback runs late."""
    if reliability not in RELIABILITIES:
        raise ValueError(f"reliability must be one of {sorted(RELIABILITIES)}, got {reliability!r}")
    return QoSProfile(depth=100, reliability=RELIABILITIES[reliability])


def load_speech_model(name: str, device: str) -> SharedModel:
    """The process's shared engine for this checkpoint, of any family that transcribes (the
    registry recognises it from the files). Imported here so the node starts (and reports) even
    when the engine cannot load."""
    from photon_core.runtime.shared_models import shared_engine

    return shared_engine(name, device, skills=["transcribe"])


def model_refuses(model, language: str | None, initial_prompt: str | None) -> str:
    """Why `model` cannot take this language or prompt ("" when it can): its optional
    check_language / check_prompt (photon_core.contracts.SpeechModel), as "<parameter>: <reason>"."""
    for name, value, hook in (("language", language, "check_language"),
                              ("initial_prompt", initial_prompt, "check_prompt")):
        check = getattr(model, hook, None)
        if check is None:
            continue
        try:
            check(value)
        except ValueError as err:
            return f"{name}: {err}"
    return ""


def drain(queue: UtteranceQueue) -> list[Utterance]:
    """Everything waiting in `queue` (final utterances and a partial request), taken out."""
    taken = []
    while (utterance := queue.get(timeout=0)) is not None:
        taken.append(utterance)
    return taken


class SpeechNode(ManagedNode):
    kind = "speech"

    def __init__(self, **kwargs) -> None:
        super().__init__("speech", **kwargs)
        # Checked at startup (a bad value stops the node with the reason, rather than the first
        # audio callback that builds the segmenter) and on every change.
        self.params = NodeParams(self, speech_params(), apply=self.apply_params, check_all=self.check_params)
        self.vad_config = vad_config(self.params.values)
        self.model_name = self.params["model"]   # the one loaded: read again at configure
        self.queue = UtteranceQueue(self.params["max_pending_s"])
        self.segmenter: SpeechSegmenter | None = None
        self.last_frame_id = self.params["frame_id"]
        self.watch = StreamWatch(self.params["idle_flush_s"])
        self.arrival = ArrivalRate()   # std_msgs arrays: is sample_rate the rate they come at?
        self.losses = RecentLosses()   # commands dropped, audio lost: WARN while recent
        self.read_stamps = ReadStamps(self.jump_tolerance)   # for a driver that stamps its reads
        self.skipped_chunks = 0
        self.health = InputHealth()     # chunks lost on the way, chunks failing in a row
        self.transcribing = InputHealth()   # transcriptions failing in a row, the last error
        self.transcripts_failed = 0
        self.ignored_chunks = 0         # chunks that arrived while the node was not active
        self.chunks_received = 0
        self.chunks_handled = 0         # chunks whose audio is in the segmenter, refused, or ignored
        self.input_type = self.params["input_type"]   # as the subscription takes it (create_interfaces)
        self.audio_reliability = self.params["reliability"]   # the subscription's, alike: /diagnostics says it
        self.finals_published = 0
        self.incomplete_published = 0   # finals whose audio was cut (audio_complete false)
        self.lock = threading.Lock()   # the segmenter is fed by the callback and flushed by a timer
        self.next_partial: tuple[float | None, float] = (None, 0.0)   # (utterance, at speech_s)
        self.stable = StableText()     # worker thread only
        self.partial_stamp: float | None = None   # the utterance the last partial was published for (worker)
        self.speculations = Speculations()   # worker thread only
        self.speculated: tuple[float, int] | None = None   # (utterance, samples) last offered

        self.publisher = self.subscription = None
        self.info_subscription = None
        self.latched_info: LatchedReader | None = None   # audio_info from a driver that latches it
        self.audio_info: AudioInfoFormat | None = None   # ros-drivers input: the latest AudioInfo
        # On the steady clock, not the node's (as the microphone's): under use_sim_time a simulator
        # not started, paused or gone stopped them, and an utterance cut off by a microphone that
        # stopped never ended, while /diagnostics said nothing.
        steady = Clock(clock_type=ClockType.STEADY_TIME)
        self.create_timer(0.1, self.flush_if_idle, clock=steady)
        self.create_timer(5.0, self.warn_on_type_mismatch, clock=steady)
        # A plain publisher on a timer of its own group: /diagnostics speaks in every lifecycle state,
        # also while a configure holds the default group for the whole model load.
        self.pub_diagnostics = self.create_publisher(DiagnosticArray, "/diagnostics", QoSProfile(
            depth=10, reliability=ReliabilityPolicy.RELIABLE))
        self.create_timer(1.0, self.publish_diagnostics, callback_group=MutuallyExclusiveCallbackGroup(),
                          clock=steady)
        self.start_worker()

    @property
    def language(self) -> str | None:
        return self.params["language"] or None

    @property
    def initial_prompt(self) -> str:
        return self.params["initial_prompt"]

    def apply_params(self, changes: dict) -> None:
        """Changes that take effect at once (called once they are accepted)."""
        with self.lock:
            if any(name.startswith("vad.") for name in changes):
                # The next utterance is cut by the new rules (take_audio swaps them in between
                # utterances: one utterance, one set of rules).
                self.vad_config = vad_config({**self.params.values, **changes})
            if "idle_flush_s" in changes:
                self.watch.idle_s = changes["idle_flush_s"]
        self.get_logger().info("parameters changed: " + ", ".join(f"{k}={v!r}" for k, v in changes.items()))

    def check_params(self, values: dict) -> str:
        """Why these parameter values are refused ("" if they are not): the VAD's rules, and a
        language or prompt the loaded model cannot take (English-only Whisper and "de", which
        would make every transcription fail; Parakeet and any language or prompt, which it would
        ignore while its transcripts named them)."""
        model = self.model
        if (reason := check_vad(values)) or model is None:
            return reason   # no model yet: configure's warm-up checks them
        # Language and prompt apply now, to the model loaded, even while another one waits for the
        # next configure: accepted for that one, every transcription until then failed.
        reason = model_refuses(model, values["language"] or None, values["initial_prompt"] or None)
        if reason and values["model"] != self.model_name:
            reason += (f" (it applies now, to {self.model_name!r}; {values['model']!r} is loaded at the "
                       "next configure: set it after that)")
        return reason

    @property
    def model(self):
        """The speech model while one is loaded (configured), else None."""
        engine = self.engine
        return engine.model if engine is not None else None

    # --- lifecycle: topics and model ---------------------------------------------------------
    def on_configure(self, state: LifecycleState) -> TransitionCallbackReturn:
        # Here, not at activate: configure replaces the model and the subscription that the old
        # failures and counts were about, where a deactivate and activate keep both (a model that
        # still fails must still say so).
        self.input_starts_afresh()
        return super().on_configure(state)

    def input_starts_afresh(self) -> None:
        """Forget how the previous configuration's input went: its failures in a row (a fixed model
        in a quiet room never succeeds to clear them), its chunks (else "no audio received" could
        never be said again) and the publisher its subscription could not match."""
        self.health.reset()
        self.transcribing.reset()
        self.chunks_received = self.chunks_handled = 0
        self.last_input_at = None   # the silence timeout counts from this configuration's first chunk
        self.incompatible_qos = ""

    def create_interfaces(self) -> None:
        self.publisher = self.create_lifecycle_publisher(Transcript, "transcript", QoSProfile(
            depth=10, reliability=ReliabilityPolicy.RELIABLE))
        # what the subscription takes until the next configure, whatever input_type says meanwhile
        # (a change waits for it: decoding by the new value crashed on the old messages)
        self.input_type = input_type = self.params["input_type"]
        self.audio_reliability = self.params["reliability"]
        qos = audio_qos(self.audio_reliability)
        if input_type in AUDIO_COMMON_INPUTS:
            msg_type = audio_common_input(input_type)
            if AUDIO_COMMON_INPUTS[input_type][1] == ROS_DRIVERS:   # its format comes apart, repeated
                self.audio_info = AudioInfoFormat()
                info_type = audio_common_types()["audio_common_msgs/msg/AudioInfo"]
                # Older audio_capture repeats it volatile every 5 s; newer ones latch it, and a
                # volatile reader alone waited for a repeat that may never come: both readers,
                # one format (a repeat changes nothing).
                self.info_subscription = self.create_subscription(
                    info_type, "audio_info", self.audio_info.update,
                    QoSProfile(depth=1, reliability=ReliabilityPolicy.BEST_EFFORT))
                self.latched_info = LatchedReader(self, info_type, "audio_info", self.audio_info.update)
        else:
            msg_type = INPUT_TYPES[input_type]
        self.subscription = self.create_subscription(
            msg_type, "audio", self.on_audio, qos,
            event_callbacks=self.qos_events("audio", "its audio never arrives"))

    def destroy_interfaces(self) -> None:
        if self.info_subscription is not None:
            self.destroy_subscription(self.info_subscription)
        if self.latched_info is not None:
            self.latched_info.destroy()
        self.info_subscription = self.audio_info = self.latched_info = None
        if self.subscription is not None:
            self.destroy_subscription(self.subscription)
        if self.publisher is not None:
            self.destroy_lifecycle_publisher(self.publisher)
        self.publisher = self.subscription = None

    def load_engine(self) -> SharedModel:
        started = time.monotonic()

        def warm_up(engine: SharedModel) -> None:
            model = engine.model
            if reason := model_refuses(model, self.language, self.initial_prompt or None):
                raise ValueError(reason)
            # The first call of each path is slower: pay for them before speech arrives. Under
            # the engine's lock: another node of this process may be transcribing on it (a
            # compiled decode step's buffers are the engine's, one call at a time).
            with engine.lock:
                model.warmup(language=self.language, initial_prompt=self.initial_prompt or None)
                if callable(getattr(model, "batch", None)):
                    # Transcriptions go through batch() then, a path of its own: a final's and a partial's.
                    silence = np.zeros(16000, np.float32)
                    prompt = self.initial_prompt or None
                    model.batch([TranscribeRequest(silence, 16000, self.language, prompt),
                                 TranscribeRequest(silence, 16000, self.language, prompt,
                                                   {"timestamps": False, "temperature": 0.0})])

        engine = ready_or_released(load_speech_model(self.model_name, self.params["device"]), warm_up)
        self.get_logger().info(f"loaded {engine.model.model_id} in {time.monotonic() - started:.1f} s")
        return engine

    def drop_pending(self) -> None:
        with self.lock:   # the callback and the idle timer feed the segmenter and the queue under it
            in_progress = self.segmenter.current() if self.segmenter is not None else None
            self.segmenter = None
            self.watch = StreamWatch(self.params["idle_flush_s"])
            self.stream_restarts()
            dropped = ([u for u in drain(self.queue) if u.final and not u.speculative]
                       + ([in_progress] if in_progress else []))
        if dropped:
            self.get_logger().info(f"deactivated: dropped {len(dropped)} utterance(s) not yet transcribed "
                                   f"({sum(u.duration for u in dropped):.1f} s of audio)")

    def stream_restarts(self) -> None:
        """The next chunk starts a new stream (after a stop or a deactivation): its rate and its
        driver's read stamps are judged afresh, not against the stream before. Under self.lock."""
        self.arrival.restart()
        self.read_stamps = ReadStamps(self.jump_tolerance)

    # --- input: callback and timer (cheap) ---------------------------------------------------
    def on_audio(self, msg, info) -> None:
        self.chunks_received += 1
        self.input_arrived()
        lost = self.health.arrived(info)
        try:
            with self.activity.admitting() as admitted:
                if admitted:
                    self.take_audio(msg, lost)
                else:
                    self.ignored_chunks += 1
        finally:
            self.chunks_handled += 1

    def take_audio(self, msg, lost: int = 0) -> None:
        """msg's audio into the segmenter; `lost`: its publisher's messages lost just before it."""
        if lost:
            self.read_stamps.reanchor()   # counted on across them, the next chunks were stamped early
        try:
            pcm, start, stamped, frame_id = self.decode(msg)
        except Exception as err:  # noqa: BLE001 - one chunk, not the node (an exception here left the executor)
            reason = str(err) if isinstance(err, ValueError) else f"{type(err).__name__}: {err}"
            self.skipped_chunks += 1
            self.health.failed(reason)
            self.get_logger().warning(f"skipping audio chunk: {reason}", throttle_duration_sec=5.0)
            if not isinstance(err, EmptyAudio):
                self.read_stamps.reanchor()   # its samples never reach the count either
            with self.lock:
                # Its audio is a hole in the stream (a short one showed nowhere: the utterance
                # around it passed as whole): cut as at a jump. An empty one lost nothing.
                if self.segmenter is not None and not isinstance(err, EmptyAudio):
                    for utterance in self.segmenter.chunk_refused("a malformed audio chunk was skipped"):
                        self.enqueue(utterance)
            return
        self.health.succeeded()
        with self.lock:
            if self.segmenter is None or self.segmenter.sample_rate != pcm.sample_rate:
                self.restart_segmenter(pcm.sample_rate)
            elif self.segmenter.config is not self.vad_config and not self.segmenter.in_speech:
                self.segmenter.reconfigure(self.vad_config)
            self.last_frame_id = frame_id
            chunk_s = pcm.samples.size / pcm.sample_rate
            self.watch.chunk(time.monotonic(), chunk_s)
            if isinstance(msg, (Int16MultiArray, Float32MultiArray)) and self.params["check_sample_rate"]:
                # the chunks lost just before it were sent at the rate too: without their samples it
                # read low, and a lossy link was blamed on sample_rate (a restart at each loss would
                # never judge a wrong rate on a link losing a chunk every few seconds)
                self.arrival.chunk(time.monotonic(), pcm.samples.size * (1 + lost), pcm.sample_rate)
            # as many chunks as this one lost in transport (sequence numbers): a hole in the
            # audio even where it is too short for the stamps to show
            gap = self.segmenter.transport_lost(lost * chunk_s) if lost else []
            for utterance in gap + self.segmenter.push(pcm.samples, start, stamped):
                self.enqueue(utterance)
            self.request_partial_if_due()
            self.offer_speculation_if_due()
            if self.segmenter.discontinuities > self.gaps_seen:
                self.gaps_seen = self.segmenter.discontinuities
                self.get_logger().warning(
                    f"audio stream jumped at {start:.3f} s: {self.segmenter.lost_s:.2f} s lost in "
                    f"{self.gaps_seen} jump(s) so far; utterances across a jump are marked incomplete")

    def decode(self, msg) -> tuple[Pcm, float, bool, str]:
        """PCM, capture time of its first sample, whether that time is a real capture stamp
        (only those can show lost audio), and frame id."""
        if isinstance(msg, AudioChunk):
            pcm = audio_chunk_to_pcm(msg)
            start = time_to_seconds(msg.header.stamp)
            frame_id = self.params["frame_id"] or msg.header.frame_id
        elif self.input_type in AUDIO_COMMON_INPUTS:
            decoded = audio_common_to_pcm(msg, self.audio_info)
            pcm = decoded.pcm
            start = time_to_seconds(decoded.stamp) if decoded.stamp is not None else 0.0
            if start > 0.0 and AUDIO_COMMON_INPUTS[self.input_type][1] == MGONZS13:
                # its capturer stamps a read as it starts: jitter counted away (sample_clock.ReadStamps)
                start = self.read_stamps.stamp(start, pcm.samples.size, pcm.sample_rate)
            frame_id = self.params["frame_id"] or decoded.frame_id
        else:
            convert = int16_array_to_pcm if isinstance(msg, Int16MultiArray) else float32_array_to_pcm
            pcm = convert(msg, self.params["sample_rate"], self.params["channels"])
            start = 0.0   # no header on these
            frame_id = self.params["frame_id"]
        checked_rate(pcm)
        stamped = start > 0.0
        if not stamped:   # the chunk ended about now; never before 0 (a simulator's clock before
            #               its first /clock reads 0): a negative stamp is no time at all
            start = max(0.0, self.now_seconds() - pcm.samples.size / pcm.sample_rate)
        return pcm, start, stamped, frame_id

    def jump_tolerance(self, chunk_s: float) -> float:
        return self.vad_config.jump_tolerance(chunk_s)

    def restart_segmenter(self, sample_rate: int) -> None:
        if self.segmenter is not None:
            self.get_logger().info(f"sample rate changed {self.segmenter.sample_rate} -> {sample_rate} Hz")
            changed = f"the sample rate changed {self.segmenter.sample_rate} -> {sample_rate} Hz"
            tail = self.segmenter.flush(f"{changed} mid-utterance")
            if tail is not None:
                self.enqueue(tail)
            self.segmenter = SpeechSegmenter(sample_rate, self.vad_config)
            # Speech going on across the change is the rest of a command whose start is in the
            # utterance just cut: incomplete too, until a pause shows the speaker stopped.
            self.segmenter.continues_after(f"{changed} before it")
        else:
            self.segmenter = SpeechSegmenter(sample_rate, self.vad_config)
        self.gaps_seen = 0

    def request_partial_if_due(self) -> None:
        """Every `partial_interval_s` of an utterance's audio (counted in samples, like the cuts),
        while the speaker is speaking, offer the audio so far for a partial transcript."""
        seg = self.segmenter
        if self.params["partial_interval_s"] <= 0 or seg.utterance_start is None:
            return
        utterance, due = self.next_partial
        if utterance != seg.utterance_start:   # a new utterance: its first partial is first_partial_s in
            utterance, due = seg.utterance_start, seg.speech_s + self.params["first_partial_s"]
        if seg.speech_s >= due and seg.pause_s < PARTIAL_MAX_PAUSE_S:
            partial = seg.current()
            partial.seen_at, partial.frame_id = time.monotonic(), self.last_frame_id
            partial.epoch = self.activity.current()
            self.queue.offer_partial(partial)
            due = seg.speech_s + self.params["partial_interval_s"]
        self.next_partial = (utterance, due)

    def offer_speculation_if_due(self) -> None:
        """Once the speaker's pause reaches the tail, offer the final it gives if it lasts the
        hangover, once per pause (a pause after resumed speech is a new candidate)."""
        if not self.params["speculate"]:
            return
        candidate = self.segmenter.pending_final()
        if candidate is None or (candidate.start_time, candidate.samples.size) == self.speculated:
            return
        self.speculated = (candidate.start_time, candidate.samples.size)
        candidate.speculative, candidate.frame_id = True, self.last_frame_id
        candidate.seen_at, candidate.epoch = time.monotonic(), self.activity.current()
        self.queue.offer_speculation(candidate)

    def speculation_still_wanted(self, speculation: Utterance) -> bool:
        """Is the pause that made `speculation` still going on (its final not yet cut)? Speech
        that resumed makes it stale, and once the final is cut it is decoded as a final."""
        with self.lock:
            candidate = self.segmenter.pending_final() if self.segmenter is not None else None
        return (candidate is not None and candidate.start_time == speculation.start_time
                and candidate.samples.size == speculation.samples.size)

    def partial_still_wanted(self, partial: Utterance) -> bool:
        """Is the partial's utterance still being spoken? Once it has ended (its final is queued
        or coming) or the speaker pauses, decoding the partial could only delay the final."""
        with self.lock:
            seg = self.segmenter
            return (seg is not None and seg.utterance_start == partial.start_time
                    and seg.pause_s < PARTIAL_MAX_PAUSE_S)

    def flush_if_idle(self) -> None:
        with self.lock:
            if self.watch.stopped(time.monotonic()):
                # the limit the watch used: idle_flush_s, or longer for long chunks or a slow stream
                self.stream_ended(f"the audio stream stopped mid-utterance (no audio for {self.watch.limit_s:.3g} s)")

    def end_stream(self, note: str) -> None:
        """The audio source has ended (a replayed recording's last chunk is in): the utterance in
        progress ends now, incomplete with `note`, as the idle timer ends it after idle_flush_s."""
        with self.lock:
            self.watch.ended()   # the idle timer does not end it again
            self.stream_ended(note)

    def stream_ended(self, note: str) -> None:
        """Under self.lock."""
        if self.segmenter is not None:
            self.stream_restarts()
            utterance = self.segmenter.stream_stopped(note)
            if utterance is not None:
                self.enqueue(utterance)

    def warn_on_type_mismatch(self) -> None:
        """Publishers of another type on our topic never reach us (DDS does not match them):
        say so, since a silent speech node is the hardest failure to debug."""
        input_type = self.input_type
        expected = {"audio_chunk": "photon_ros/msg/AudioChunk", "int16": "std_msgs/msg/Int16MultiArray",
                    "float32": "std_msgs/msg/Float32MultiArray",
                    **{k: name for k, (name, _) in AUDIO_COMMON_INPUTS.items()}}[input_type]
        topic = self.resolve_topic_name("audio")
        for info in self.get_publishers_info_by_topic(topic):
            if info.topic_type != expected:
                self.get_logger().warning(
                    f"{info.node_name} publishes {info.topic_type} on {topic}, but this node takes "
                    f"{expected} (parameter input_type={input_type!r}); its audio is ignored",
                    throttle_duration_sec=30.0)

    def enqueue(self, utterance: Utterance) -> None:
        utterance.seen_at = time.monotonic()
        utterance.frame_id = self.last_frame_id
        utterance.epoch = self.activity.current()
        dropped = self.queue.put(utterance)
        if dropped:
            self.get_logger().warning(
                f"speech arrives faster than it can be transcribed: dropped {len(dropped)} oldest "
                f"utterance(s), {sum(u.duration for u in dropped):.1f} s of audio "
                f"({self.queue.dropped} dropped so far)")

    def now_seconds(self) -> float:
        return self.get_clock().now().nanoseconds * 1e-9

    # --- worker: the model ----------------------------------------------------------------------
    def work(self) -> None:
        # After a partial decode the worker takes no partial for as long as that one took: partials
        # use at most half of its time, and the audio callbacks and other nodes keep the rest.
        rest_until = 0.0
        while not self.stopping.is_set():
            if self.activity.wait_running(timeout=0.1) is None:
                continue
            utterance = self.queue.get(timeout=0.1, partials=time.monotonic() >= rest_until)
            if utterance is None:
                continue
            # the activation that queued it, not the one read before waiting: a deactivate and
            # activate within that wait dropped a final of the new activation, counted nowhere
            epoch = utterance.epoch if utterance.epoch is not None else self.activity.current()
            with self.activity.work(epoch) as running:
                if not running:   # deactivated since it was taken: dropped with the rest
                    continue
                if utterance.speculative:
                    self.decode_ahead(utterance)
                elif utterance.final:
                    self.transcribe_one(utterance, epoch)
                elif self.partial_still_wanted(utterance):
                    rest_until = time.monotonic() + self.transcribe_partial(utterance, epoch)

    def run_model(self, utterance: Utterance, **options) -> tuple[dict | None, float]:
        """The model's result (None when it failed: one bad utterance must not stop the node; or
        for a speculation, when the engine was busy) and the seconds it took."""
        started = time.monotonic()
        language, prompt = self.language, self.initial_prompt   # read once: a change meanwhile is the next's
        request = TranscribeRequest(utterance.samples, utterance.sample_rate, language, prompt or None, options)
        engine = self.engine
        try:
            if callable(getattr(engine.model, "batch", None)):
                # Other speech nodes of this process (other microphones) share the engine: their
                # utterances are decoded in one batch with this one.
                result = engine.batcher.submit([request])[0]
            else:
                # Never two transcriptions at once on one engine. A speculation does not wait in
                # line for it (another node's final may be waiting too): the final comes anyway.
                if not engine.lock.acquire(blocking=not utterance.speculative):
                    return None, time.monotonic() - started
                try:
                    result = engine.model.transcribe(**request.kwargs())
                finally:
                    engine.lock.release()
        except Exception as err:  # noqa: BLE001
            self.get_logger().error(f"transcription failed: {type(err).__name__}: {err}")
            self.transcripts_failed += 1
            self.transcribing.failed(f"{type(err).__name__}: {err}")
            return None, time.monotonic() - started
        self.transcribing.succeeded()
        # the settings it was decoded with, for the transcript (read when it was published, it named
        # a prompt set during the decode, which the model never saw) and a speculation's match
        return {**result, SETTINGS_USED: (language, prompt)}, time.monotonic() - started

    def publish(self, result: dict, utterance: Utterance, processing: float, epoch: int) -> Transcript | None:
        """Publish the transcript, unless the node was deactivated since the work began (None then)."""
        header = Header(stamp=seconds_to_time(utterance.start_time), frame_id=utterance.frame_id)
        msg = transcript_message(result, header, audio_duration=utterance.duration,
                                 processing_time=processing,
                                 latency=time.monotonic() - utterance.seen_at,
                                 prompt=result.get(SETTINGS_USED, (None, self.initial_prompt))[1], model_id=self.model.model_id,
                                 is_final=utterance.final, audio_complete=utterance.complete,
                                 audio_note=utterance.note)
        with self.activity.publishing(epoch) as current:
            if not current:
                return None
            self.publisher.publish(msg)
        if msg.is_final:
            self.finals_published += 1
            self.incomplete_published += not msg.audio_complete
        return msg

    def publish_diagnostics(self) -> None:
        state = self.lifecycle_state()
        status = DiagnosticStatus(hardware_id=str(self.model_name))
        status.level, status.message = health(state, self.loading, self.model_error, self.chunks_received, "audio",
                                              self.input_silence(), self.params["input_timeout_s"])
        if self.incompatible_qos and self.chunks_received == 0 and status.level < DiagnosticStatus.ERROR:
            status.level, status.message = DiagnosticStatus.WARN, self.incompatible_qos
        failing = self.health.failing("audio chunks") or self.transcribing.failing("transcriptions")
        if failing and state == "active":
            status.level, status.message = DiagnosticStatus.ERROR, failing
        wrong_rate = self.arrival.mismatch() if state == "active" else ""
        if wrong_rate:
            self.get_logger().warning(wrong_rate, throttle_duration_sec=30.0)
            if status.level < DiagnosticStatus.WARN:
                status.level, status.message = DiagnosticStatus.WARN, wrong_rate
        segmenter = self.segmenter
        # Commands thrown away from a backlog (speech outran the model) and audio lost at jumps in
        # the stamps are counted below; the level says so while they are recent.
        now = time.monotonic()
        losses = [loss for loss in (
            self.losses.note("backlog", self.queue, self.queue.dropped,
                             lambda: f"{self.queue.dropped} utterance(s) ({self.queue.dropped_seconds:.1f} s of "
                                     f"speech) dropped untranscribed: speech outran the model", now),
            self.losses.note("jumps", segmenter, segmenter.discontinuities if segmenter else 0,
                             lambda: f"audio lost at {segmenter.discontinuities} jump(s) in the stream "
                                     f"({segmenter.lost_s:.2f} s missing): utterances across them are incomplete", now),
        ) if loss]
        if losses and state == "active" and status.level < DiagnosticStatus.WARN:
            status.level, status.message = DiagnosticStatus.WARN, "; ".join(losses)
        values = {
            "model": str(self.model_name),
            "model_loaded": str(self.model is not None),
            "lifecycle_state": state,
            "chunks_received": str(self.chunks_received),
            "audio_qos": self.audio_reliability,
            "chunks_skipped_bad": str(self.skipped_chunks),
            "chunks_lost_in_transport": str(self.health.lost_in_transport),
            "chunks_ignored_inactive": str(self.ignored_chunks),
            "audio_jumps": str(segmenter.discontinuities if segmenter else 0),
            "audio_lost_s": f"{segmenter.lost_s if segmenter else 0.0:.2f}",
            "transcripts_final": str(self.finals_published),
            "transcripts_incomplete": str(self.incomplete_published),
            "transcripts_failed": str(self.transcripts_failed),
            "utterances_dropped_backlog": str(self.queue.dropped),
            "pending_audio_s": f"{self.queue.seconds:.2f}",
            "finals_decoded_ahead": str(self.speculations.used),
            "speculations_wasted": str(self.speculations.wasted),
            # which engine decodes each bucket on this GPU, and both times where measured (issue 38)
            **engine_diagnostics(),
        }
        publish_status(self, self.pub_diagnostics, status, values)

    def transcribe_partial(self, utterance: Utterance, epoch: int) -> float:
        """Publish a partial transcript of the utterance so far; returns the seconds it took."""
        # Greedy at one temperature and without timestamps: a partial must cost one bounded
        # decode (no fallback retries), since a final may arrive while it runs.
        result, processing = self.run_model(utterance, timestamps=False, temperature=0.0)
        if result is None or not result["text"].strip():
            return processing
        committed, tentative = self.stable.update(utterance.start_time, result["text"])
        whole = " ".join(t for t in (committed, tentative) if t)
        partial = {"text": committed, "language": result["language"], SETTINGS_USED: result[SETTINGS_USED],
                   "segments": [{"start": 0.0, "end": utterance.duration, "text": whole}]}
        if self.publish(partial, utterance, processing, epoch) is None:
            return processing
        self.partial_stamp = utterance.start_time
        self.get_logger().debug(f"[partial, {utterance.duration:.1f} s audio, {processing:.2f} s] "
                                f"{committed} | {tentative}")
        return processing

    def decode_ahead(self, speculation: Utterance) -> None:
        """Decode the final a pause will give, as a final is decoded, and keep the result for it."""
        if not self.speculation_still_wanted(speculation):
            return
        result, processing = self.run_model(speculation)
        if result is not None:   # kept for a final taken under the settings it was decoded with
            self.speculations.keep(speculation, result, processing, result[SETTINGS_USED])

    def transcribe_one(self, utterance: Utterance, epoch: int) -> None:
        ahead = self.speculations.take(utterance, (self.language, self.initial_prompt))
        result, processing = ahead if ahead is not None else self.run_model(utterance)
        if result is None or not result["text"].strip():
            if result is not None:
                self.get_logger().debug(f"no speech in {utterance.duration:.1f} s of audio")
            if self.partial_stamp == utterance.start_time:
                # Its partials said a later message would replace them: an empty final does
                # (no words, or the decode failed), so a display or planner is not left holding them.
                empty = {"text": "", "language": (result or {}).get("language") or self.language or "",
                         "segments": [], **({SETTINGS_USED: result[SETTINGS_USED]} if result else {})}
                self.publish(empty, utterance, processing, epoch)
            return
        msg = self.publish(result, utterance, processing, epoch)
        if msg is None:
            return
        line = f"[{utterance.duration:.1f} s audio, {processing:.2f} s] {msg.text}"
        if utterance.complete:
            self.get_logger().info(line)
        else:
            self.get_logger().warning(f"{line} (INCOMPLETE: {utterance.note})")

    def destroy_node(self) -> None:
        self.stopping.set()
        if hasattr(self, "queue"):   # absent when __init__ refused a parameter
            self.queue.close()   # wakes the worker at once
        super().destroy_node()


def speech_nodes(microphones: list[str], **kwargs) -> list[SpeechNode]:
    """One speech node per microphone, in that microphone's namespace (its audio and transcript
    topics under it); in one process they share one engine."""
    return [SpeechNode(namespace=name, **kwargs) for name in microphones]


def run_speech_nodes(microphones: list[str], args: list[str] | None = None) -> int:
    """Spin the speech nodes of `microphones` on one multi-threaded executor until shutdown."""
    nodes: list[SpeechNode] = []
    try:
        init_rclpy(args)
        for name in microphones:   # one at a time: if one cannot start, the others are destroyed
            nodes += speech_nodes([name])
    except KeyboardInterrupt:   # Ctrl-C while starting: stop what started, status 0
        finish(None, nodes)
        exit_leaving_no_thread(0)
        return 0
    except Exception as err:  # noqa: BLE001 - report why the nodes cannot start
        print(f"speech_node: {err}", file=sys.stderr)
        finish(None, nodes)
        exit_leaving_no_thread(1)
        return 1
    return spin_nodes(nodes)


def split_microphones(argv: list[str]) -> tuple[list[str], list[str]]:
    """`--microphones a,b` out of a command line: the namespaces, and the rest (ROS arguments)."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--microphones", default="")
    known, rest = parser.parse_known_args(argv[1:])
    return [m for m in known.microphones.split(",") if m], argv[:1] + rest


def main(args=None) -> None:
    exit_on_help(args, __doc__, "photon_ros.speech_node", "speech", "[--microphones A,B]",
                 "  --microphones A,B      one speech node per microphone in one process, in namespaces A, B\n"
                 "                         (A/audio -> A/transcript, ...), sharing one model")
    microphones, rest = split_microphones(list(sys.argv if args is None else args))
    if microphones:
        sys.exit(run_speech_nodes(microphones, rest))
    run_node(SpeechNode, args)


if __name__ == "__main__":
    main()
