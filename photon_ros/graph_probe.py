"""What the evaluator reads from the graph's nodes, which it runs in its own process.

Replaying "as fast as the graph takes it" and knowing when every result is out both need the
nodes' own counters: a frame is taken when the vision worker takes it from its mailbox, a chunk
of audio when the speech node's segmenter has consumed it. Those counters are attributes of the
nodes, not topics; this module is the one place that reads them, so a change in a node shows up
here and nowhere else. The vision node also reports its counters on /diagnostics, but once a
second: too late to pace a replay by.

It also predicts what the graph must produce from the inputs it was given (the results the
evaluator waits for): one result per detect and point prompt per processed frame, one final
transcript per utterance (the speech node cuts utterances by counting samples, so the same
segmenter run here over the same audio finds the same ones), and the loop node's status lines
per final transcript.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import numpy as np

from rclpy.parameter import Parameter

from photon_ros.audio_common_conversions import MGONZS13, AudioInfoFormat, audio_common_to_pcm, family_of
from photon_ros.audio_conversions import (Pcm, audio_chunk_to_pcm, float32_array_to_pcm,
                                          int16_array_to_pcm)
from photon_ros.commands import parse_command
from photon_ros.loop_node import incomplete_reason
from photon_ros.msg import AudioChunk
from photon_ros.result_messages import time_to_seconds
from photon_ros.sample_clock import ReadStamps
from photon_ros.speech_params import checked_rate
from photon_ros.speech_segmenter import SegmenterConfig, SpeechSegmenter


# At max rate the idle flush is off (a finite parameter: no gap of a replay lasts this long).
NO_IDLE_FLUSH_S = 1e9


class GraphError(Exception):
    """The graph cannot be evaluated (a model failed to load, a node stopped taking input)."""


@dataclass(frozen=True)
class VisionCounters:
    received: int     # frames that reached the node
    taken: int        # frames its worker took to process
    dropped: int      # frames replaced in the mailbox by a newer one before the worker took them
    bad: int          # frames it could not convert (no results)
    done: int = 0     # frames taken that its worker is done with (every result of them published)

    @property
    def settled(self) -> int:
        """Frames whose fate is decided: taken or dropped."""
        return self.taken + self.dropped


class VisionProbe:
    def __init__(self, node) -> None:
        self.node = node

    def loaded(self) -> bool:
        """True once the model is ready; GraphError when it failed to load."""
        if self.node.model_error:
            raise GraphError(f"vision model did not load: {self.node.model_error}")
        return self.node.engine is not None

    def counters(self) -> VisionCounters:
        frames = self.node.frames
        return VisionCounters(frames.received, frames.taken, frames.dropped, self.node.bad_frames,
                              self.node.frames_done)

    def prompts(self) -> list[tuple[str, str]]:
        """(topic, prompt) of every result a processed frame always gives (captions come only
        when their period is due, so they are not counted on)."""
        return ([("detections", p) for p in self.node.detect_targets]
                + [("points", p) for p in self.node.point_targets]
                + [("segmentation", p) for p in self.node.segment_targets])


class SpeechProbe:
    def __init__(self, node) -> None:
        self.node = node

    def loaded(self) -> bool:
        if self.node.model_error:
            raise GraphError(f"speech model did not load: {self.node.model_error}")
        return self.node.model is not None

    def audio_until(self) -> float | None:
        """Capture time just after the last sample the node has consumed (None before any)."""
        segmenter = self.node.segmenter
        return None if segmenter is None else segmenter.last_time

    def chunks_taken(self) -> int:
        """Audio messages the node has taken off its subscription, or knows were lost on the way
        (its publishers' sequence numbers): the backlog behind them is what its queue holds."""
        return self.node.chunks_received + self.node.health.lost_in_transport

    def chunks_handled(self) -> int:
        """Audio messages the node is done with (in its segmenter, refused or ignored), or knows
        were lost on the way."""
        return self.node.chunks_handled + self.node.health.lost_in_transport

    def pace(self, rate: float | None) -> None:
        """The node ends an utterance after idle_flush_s without audio, by this machine's clock. A
        replay not at the bag's pace moves the bag's gaps: at a rate they last 1 / rate times as
        long (idle_flush_s scaled alike), and at max rate the audio waits wherever the frames
        before it in the bag wait for the vision model, for as long as that takes (no idle flush
        then: end_of_recording() ends the last utterance instead). Either way the utterances are
        cut where the robot's node cut them live."""
        idle = self.node.params["idle_flush_s"]
        paced = idle / rate if rate is not None else NO_IDLE_FLUSH_S
        if not self.node.set_parameters([Parameter("idle_flush_s", value=paced)])[0].successful:
            raise GraphError(f"speech: idle_flush_s could not be set to {paced:g} s for the replay")

    def end_of_recording(self) -> None:
        """The bag's audio is all in the node: the utterance in progress, if any, ends there."""
        self.node.end_stream("the recording's audio ended mid-utterance")

    def in_speech(self) -> bool:
        """An utterance is open: its end (or the idle flush) is still to come."""
        segmenter = self.node.segmenter
        return segmenter is not None and segmenter.in_speech

    def counters(self) -> dict[str, float]:
        segmenter = self.node.segmenter
        return {"utterances_dropped": self.node.queue.dropped,
                "skipped_chunks": self.node.skipped_chunks,
                "discontinuities": segmenter.discontinuities if segmenter else 0,
                "lost_audio_s": round(segmenter.lost_s, 3) if segmenter else 0.0}

    def decode(self, msg, info: AudioInfoFormat | None = None) -> Pcm:
        """The PCM the node makes of `msg` (same conversion and parameters; `info`: a ros-drivers
        stream's format, from its audio_info messages so far)."""
        if isinstance(msg, AudioChunk):
            return checked_rate(audio_chunk_to_pcm(msg))
        if family_of(msg) is not None:   # audio_common_msgs
            return checked_rate(audio_common_to_pcm(msg, info).pcm)
        params = self.node.params
        convert = int16_array_to_pcm if params["input_type"] == "int16" else float32_array_to_pcm
        return checked_rate(convert(msg, params["sample_rate"], params["channels"]))

    @property
    def vad_config(self) -> SegmenterConfig:
        return self.node.vad_config

    def starts(self, messages: list, pcms: list) -> list[float | None]:
        """The capture time of each chunk's first sample as the node computes it (None where it
        has none: unstamped, or undecodable): its stamp, which for mgonzs13's capturer is a
        read's start, counted in samples as the node counts it (sample_clock.ReadStamps)."""
        reads, starts = ReadStamps(self.node.jump_tolerance), []
        for msg, pcm in zip(messages, pcms):
            start = chunk_start(msg) if pcm is not None else None
            if start is not None and family_of(msg) == MGONZS13:
                start = reads.stamp(start, pcm.samples.size, pcm.sample_rate)
            starts.append(start)
        return starts


def chunk_end(start: float | None, pcm: Pcm) -> float | None:
    """The capture time after the chunk's last sample, computed as the node's segmenter computes
    it (so the two compare equal); None for audio without a stamp."""
    return None if start is None else start + pcm.samples.size / pcm.sample_rate


def chunk_start(msg) -> float | None:
    """The stamp of a chunk; None where the node sees none (std_msgs arrays and ros-drivers'
    AudioData have no header, and a zero stamp means "not stamped")."""
    header = getattr(msg, "header", None)
    if header is None:
        return None
    start = time_to_seconds(header.stamp)
    return start if start > 0.0 else None


@dataclass(frozen=True)
class Predicted:
    """A final utterance the speech node will cut."""
    start: float | None    # capture time of its first sample; None for unstamped audio
    first: int             # unstamped: its first sample, counted over the chunks' samples in order
    end: int               # one past its last sample (first + its samples)
    rate: int              # its sample rate

    @property
    def duration(self) -> float:
        return (self.end - self.first) / self.rate


def predict_utterances(chunks: Iterable[tuple[Pcm | None, float | None]], config: SegmenterConfig) -> list[Predicted]:
    """The final utterances the speech node will cut from these chunks (PCM, start stamp or None;
    PCM None: a chunk the node refused, where it cuts the utterance in progress):
    the node's segmenter run over the same samples, restarted where the sample rate changes and
    flushed at the end, as the node's idle timer (or the replay's end) does. Unstamped audio (the
    node stamps it with its own clock) runs on the samples' own clock: where each utterance lies
    in them is what ties its transcripts to the chunks."""
    found: list[Predicted] = []
    segmenter: SpeechSegmenter | None = None
    base = offset = 0            # samples before the current segmenter; before the current chunk
    stamped = False              # the last chunk pushed was

    def add(utterances: list) -> None:
        for u in utterances:
            first = base + round(u.start_time * u.sample_rate) if not stamped else 0
            found.append(Predicted(u.start_time if stamped else None, first, first + u.samples.size, u.sample_rate))

    for pcm, start in chunks:
        if pcm is None:
            if segmenter is not None:
                add(segmenter.chunk_refused())
            continue
        if segmenter is None or segmenter.sample_rate != pcm.sample_rate:
            if segmenter is not None and (tail := segmenter.flush()) is not None:
                add([tail])
            segmenter, base = SpeechSegmenter(pcm.sample_rate, config), offset
        stamped = start is not None
        clock = start if stamped else (offset - base) / pcm.sample_rate
        add(segmenter.push(np.asarray(pcm.samples), clock, stamped))
        offset += pcm.samples.size
    if segmenter is not None and (tail := segmenter.flush()) is not None:
        add([tail])
    return found


def loop_statuses(final_transcript) -> int:
    """Status lines the loop node says for one final transcript: one when it does not act on it,
    two when it asks the vision node (what it looks for, then what it found or why not)."""
    if incomplete_reason(final_transcript) or parse_command(final_transcript.text) is None:
        return 1
    return 2
