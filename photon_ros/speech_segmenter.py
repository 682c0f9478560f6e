"""Cut a stream of audio chunks into utterances with an energy voice-activity detector.

Why energy and not a neural VAD: it needs no model file, costs microseconds per chunk inside the
subscription callback, and Whisper's own no-speech probability already rejects the non-speech
sounds (fans, clicks) that get past it. The detector adapts to the room: speech is a frame whose
level stands `threshold_db` above a slowly tracked noise floor (and above an absolute minimum).

An utterance starts after `min_speech_s` of speech (with `preroll_s` of audio before it, so the
first syllable is not clipped) and ends after `hangover_s` of non-speech, at `max_utterance_s`, or
when the stream stops (flush). Memory is bounded by `max_utterance_s` plus the preroll.

Every decision is counted in samples, never read from a clock, so the same audio is cut the same
way however it is chunked and however late it arrives. Lost audio is the one thing samples cannot
show: the chunks' capture stamps can. A chunk that does not start where the previous one ended
(more than `max_gap_s` later, or earlier) ends the utterance in progress as incomplete, and an
utterance that begins in speech right after such a jump is incomplete too: a planner must not act
on half a command as if it were the whole one.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np


@dataclass
class SegmenterConfig:
    frame_s: float = 0.03
    threshold_db: float = 12.0       # speech stands this far above the noise floor
    min_level_db: float = -55.0      # and above this absolute level (dBFS)
    min_speech_s: float = 0.12
    hangover_s: float = 0.6
    preroll_s: float = 0.3
    max_utterance_s: float = 28.0    # Whisper sees 30 s windows; cut before one overflows
    min_utterance_s: float = 0.3
    noise_adapt_s: float = 2.0       # time constant of the noise-floor tracker
    max_gap_s: float = 0.1           # stamps may jitter this much between chunks; more is lost audio


@dataclass
class Utterance:
    samples: np.ndarray              # float32 mono
    sample_rate: int
    start_time: float                # capture time of the first sample (seconds, the stream's clock)
    frame_id: str = ""               # of the audio source, set by the node
    seen_at: float = 0.0             # monotonic time the end was detected (latency starts here)
    complete: bool = True            # False when audio inside it was lost or the stream stopped
    note: str = ""                   # why it is incomplete

    @property
    def duration(self) -> float:
        return self.samples.size / self.sample_rate


class SpeechSegmenter:
    """Feed chunks with `push`; it returns the utterances they complete."""

    def __init__(self, sample_rate: int, config: SegmenterConfig | None = None) -> None:
        self.sample_rate = sample_rate
        self.config = cfg = config or SegmenterConfig()
        self.frame = max(1, round(cfg.frame_s * sample_rate))
        self._pending = np.zeros(0, np.float32)     # samples not yet forming a whole frame
        self._pending_start = None                  # capture time of _pending[0]
        self._frame_s = self.frame / sample_rate
        # The frames that trigger the start belong to the utterance too, so keep them with the preroll.
        self._preroll: deque[np.ndarray] = deque(
            maxlen=round((cfg.preroll_s + cfg.min_speech_s) / self._frame_s) + 1)
        self._speech: list[np.ndarray] = []         # frames of the current utterance
        self._speech_start = 0.0
        self._in_speech = False
        self._voiced_run = 0
        self._silent_run = 0
        self._noise_db: float | None = None
        self._after_gap = ""                        # set by lost audio until a non-speech frame
        self._start_note = ""                       # why the current utterance began incomplete
        self.last_time = None                       # capture time after the last pushed sample
        self.discontinuities = 0                    # jumps in the stamps seen so far
        self.lost_s = 0.0                           # seconds of audio missing at those jumps

    def push(self, samples: np.ndarray, start_time: float, stamped: bool = True) -> list[Utterance]:
        """Add a chunk whose first sample was captured at `start_time` (seconds). `stamped=False`
        says the time is only an arrival estimate: the chunk is taken as continuing the stream."""
        done = []
        if stamped and self.last_time is not None:
            jump = start_time - self.last_time
            if abs(jump) > self.config.max_gap_s:
                done += self._discontinuity(jump)
        if self._pending.size == 0:
            self._pending_start = start_time
        self._pending = np.concatenate([self._pending, samples.astype(np.float32, copy=False)])
        self.last_time = start_time + samples.size / self.sample_rate
        n_frames = self._pending.size // self.frame
        for i in range(n_frames):
            frame = self._pending[i * self.frame:(i + 1) * self.frame]
            t = self._pending_start + i * self.frame / self.sample_rate
            utterance = self._step(frame, t)
            if utterance is not None:
                done.append(utterance)
        used = n_frames * self.frame
        self._pending = self._pending[used:].copy()
        self._pending_start += used / self.sample_rate
        return done

    def flush(self, note: str = "the audio stream stopped mid-utterance") -> Utterance | None:
        """End the current utterance now (the stream stopped); it is marked incomplete with `note`."""
        return self._finish(note) if self._in_speech else None

    @property
    def in_speech(self) -> bool:
        return self._in_speech

    def _level_db(self, frame: np.ndarray) -> float:
        rms = float(np.sqrt(np.mean(np.square(frame, dtype=np.float64))))
        return 20.0 * np.log10(max(rms, 1e-10))

    def _step(self, frame: np.ndarray, t: float) -> Utterance | None:
        cfg = self.config
        level = self._level_db(frame)
        if self._noise_db is None:
            self._noise_db = level
        voiced = level > max(self._noise_db + cfg.threshold_db, cfg.min_level_db)
        if not voiced:
            # Track the floor on non-speech frames: fall at once, rise slowly.
            alpha = min(1.0, cfg.frame_s / cfg.noise_adapt_s)
            self._noise_db = min(level, self._noise_db + alpha * (level - self._noise_db))

        if not self._in_speech:
            self._preroll.append(frame)
            self._voiced_run = self._voiced_run + 1 if voiced else 0
            if not voiced:
                self._after_gap = ""   # speech after this frame began after the gap, whole
            if self._voiced_run * self._frame_s >= cfg.min_speech_s:
                self._in_speech = True
                self._start_note, self._after_gap = self._after_gap, ""
                self._speech = list(self._preroll)
                self._speech_start = t + self._frame_s - len(self._speech) * self._frame_s
                self._preroll.clear()
                self._silent_run = 0
            return None

        self._speech.append(frame)
        self._silent_run = 0 if voiced else self._silent_run + 1
        duration = len(self._speech) * self._frame_s
        if self._silent_run * self._frame_s >= cfg.hangover_s:
            return self._finish()
        if duration >= cfg.max_utterance_s:
            # Speech goes on: the next utterance is its continuation, incomplete as well.
            limit = f"{cfg.max_utterance_s:g} s utterance limit"
            cut = self._finish(f"cut at the {limit}")
            self._after_gap = f"continues speech cut at the {limit}"
            return cut
        return None

    def _discontinuity(self, jump: float) -> list[Utterance]:
        """The stream jumped by `jump` seconds: audio before the jump does not join audio after it."""
        self.discontinuities += 1
        self.lost_s += max(jump, 0.0)
        what = (f"{jump:.2f} s of audio lost" if jump > 0
                else f"audio out of order (a chunk starts {-jump:.2f} s before the previous one ended)")
        cut = self._finish(f"{what} after it") if self._in_speech else None
        self._pending = np.zeros(0, np.float32)
        self._preroll.clear()
        self._voiced_run = 0
        self._after_gap = f"{what} before it"
        return [cut] if cut is not None else []

    def _finish(self, note: str = "") -> Utterance | None:
        cfg = self.config
        frames, self._speech = self._speech, []
        self._in_speech = False
        self._voiced_run = self._silent_run = 0
        notes = [n for n in (self._start_note, note) if n]
        self._start_note = ""
        samples = np.concatenate(frames) if frames else np.zeros(0, np.float32)
        if samples.size < cfg.min_utterance_s * self.sample_rate:
            return None
        return Utterance(samples, self.sample_rate, self._speech_start, complete=not notes,
                         note="; ".join(notes))
