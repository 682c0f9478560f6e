"""Cut a stream of audio chunks into utterances with an energy voice-activity detector.

Why energy and not a neural VAD: it needs no model file, costs microseconds per chunk inside the
subscription callback, and Whisper's own no-speech probability already rejects the non-speech
sounds (fans, clicks) that get past it. The detector adapts to the room: speech is a frame whose
level stands `threshold_db` above a slowly tracked noise floor (and above an absolute minimum).
Two things keep it working in noise (measured on bench/speech_set.py at 10-20 dB SNR): the level
is the power in the speech band (`band_hz`), where white, pink and brown noise put only part of
their power, and once speech has started a frame only needs `continue_db` above the floor to
count as speech, so the weak consonants of noisy speech do not read as pauses (hysteresis).
With both, every command of the set whose pauses stay within 0.2 s is one utterance at every noise
level and ends within 0.3 s of its last sound (test_speech_segmenter.py), so a neural VAD
(silero-vad: a new dependency and a model run in the callback) has nothing left to fix there.

The floor is learnt from the first frame and then from non-speech frames: it falls at once to a
quieter frame and rises slowly (`noise_adapt_s`). Left at that, a floor that ever sits more than
`threshold_db` under the steady noise is stuck: the noise reads as speech, speech frames never
update the floor, and the node sends 28 s "utterances" of noise without end. Two rules keep it
from sticking. Digital silence (below -100 dBFS: an overrun filled with zeros, a muted mic, a
driver's padding) says nothing about the room, so it never sets or lowers the floor; a stream that
opens with it has no floor until a quiet frame of the room comes (meanwhile `min_level_db` alone
judges, so a command spoken as the mic unmutes is found). And a minimum-statistics guard: the levels of the last `floor_window_s` of frames (speech
included, digital silence not) are kept; when that window is full and even its quietest frame
stands more than `continue_db` above the floor (or, with none yet, above `min_level_db`: every
frame of the window counted as speech), nothing in it came near the floor: speech, with
its pauses and weak sounds, comes near it within seconds (the speech set at 10-20 dB SNR is cut as
before), steady noise over a stuck floor never does, so the floor rises to that minimum. A room
that gets louder (a fan turns on) thus costs one utterance of noise of about `floor_window_s`,
which Whisper's no-speech check rejects, and speech after it is found.

An utterance starts after `min_speech_s` of speech (with `preroll_s` of audio before it, so the
first syllable is not clipped) and ends after `hangover_s` of non-speech, at `max_utterance_s`, or
when the stream stops (flush). Speech cut at `max_utterance_s` goes on at once as the next
utterance (incomplete), under the rules inside an utterance: under the start rule, syllables
shorter than `min_speech_s` would never restart one and the rest of the speech would be lost. An
utterance ended by a pause keeps only `tail_s` of that pause after its last speech frame
(`end_cut`): its samples are defined by the audio alone, so once the pause reaches `tail_s` the
final utterance is known if the pause goes on (`pending_final()`), and the node can decode it while
the rest of the hangover is still being waited for. `hangover_s` is how long the speaker must pause
for the command to count as said: a pause between words that long ends the utterance too, so it is
a trade between latency and pauses; 0.3 s keeps pauses up to 0.2 s whole. `current()` hands out the
utterance in progress for partial transcripts. Memory is bounded by `max_utterance_s` plus the
preroll.

Every decision is counted in samples, never read from a clock, so the same audio is cut the same
way however it is chunked and however late it arrives. Lost audio is the one thing samples cannot
show: the chunks' capture stamps can. A chunk that does not start where the previous one ended
(later or earlier by more than half a chunk, or than `max_gap_s`; jumps within `min_gap_s` are
jitter even between tiny chunks) ends the utterance in progress
as incomplete, and speech after such a jump is incomplete too until a pause of `hangover_s` (one
that would end an utterance) shows the speaker stopped: a planner must not act on half a command
as if it were the whole one. Half a chunk, because losing one chunk moves the stamps by a whole
one (at `max_gap_s` = the chunk, one lost chunk would pass unseen); stamps may jitter up to that.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

# Below this a frame is digital silence, not a room: zeros, or no more than 16-bit quantisation
# noise (about -101 dBFS); a microphone's own noise sits well above it.
DIGITAL_SILENCE_DB = -100.0


@dataclass
class SegmenterConfig:
    frame_s: float = 0.03
    threshold_db: float = 12.0       # speech starts this far above the noise floor
    continue_db: float = 6.0         # and, once started, goes on while this far above it
    min_level_db: float = -55.0      # and above this absolute level (dBFS)
    min_speech_s: float = 0.12
    hangover_s: float = 0.3          # non-speech that ends an utterance
    tail_s: float = 0.1              # of it, kept after the last speech frame (at most hangover_s)
    preroll_s: float = 0.3
    max_utterance_s: float = 28.0    # Whisper sees 30 s windows; cut before one overflows
    min_utterance_s: float = 0.3
    noise_adapt_s: float = 2.0       # time constant of the noise-floor tracker
    floor_window_s: float = 3.0      # a floor this long below every frame is stuck: raised (see above)
    max_gap_s: float = 0.1           # stamps may jitter this much (and < half a chunk) between chunks; more is lost audio
    min_gap_s: float = 0.02          # ... and always this much (chunks of a few ms stamped on arrival)
    band_hz: tuple[float, float] | None = (250.0, 4000.0)   # None: the whole spectrum

    def jump_tolerance(self, chunk_s: float) -> float:
        """How far a chunk's stamp may be from where the last one ended before it is lost (or out
        of order) audio: one lost chunk moves the stamps by one chunk, as long as those the stream
        has been sending, so less than half of the last one, but at least min_gap_s of jitter."""
        return min(self.max_gap_s, max(self.min_gap_s, 0.5 * chunk_s))

    def check(self) -> None:
        """ValueError naming the first setting out of its range (a node checks at startup)."""
        positive = ("frame_s", "min_speech_s", "hangover_s", "max_utterance_s", "noise_adapt_s", "max_gap_s",
                    "floor_window_s")
        for name in positive:
            value = getattr(self, name)
            if not value > 0:   # NaN too
                raise ValueError(f"vad.{name} must be > 0, got {value}")
        for name in ("preroll_s", "min_utterance_s", "min_gap_s", "continue_db", "threshold_db"):
            value = getattr(self, name)
            if not value >= 0:
                raise ValueError(f"vad.{name} must be >= 0, got {value}")
        if not self.min_level_db <= 0:
            raise ValueError(f"vad.min_level_db must be <= 0 dBFS, got {self.min_level_db}")
        if not 0.0 <= self.tail_s <= self.hangover_s:
            raise ValueError(f"vad.tail_s must be within 0..vad.hangover_s ({self.hangover_s}), got {self.tail_s}")
        if self.band_hz is not None and not 0 <= self.band_hz[0] < self.band_hz[1]:
            raise ValueError(f"band_hz must be (low, high) with 0 <= low < high, got {self.band_hz}")


@dataclass
class Utterance:
    samples: np.ndarray              # float32 mono
    sample_rate: int
    start_time: float                # capture time of the first sample (seconds, the stream's clock)
    frame_id: str = ""               # of the audio source, set by the node
    seen_at: float = 0.0             # monotonic time the end was detected (latency starts here)
    complete: bool = True            # False when audio inside it was lost or the stream stopped
    note: str = ""                   # why it is incomplete
    final: bool = True               # False: the utterance so far, for a partial transcript
    speculative: bool = False        # the final a pause will give if it lasts (decoded ahead)
    epoch: int | None = None         # the node's activation that queued it (set by the node)

    @property
    def duration(self) -> float:
        return self.samples.size / self.sample_rate


def end_cut(frames: int, silent_run: int, tail_frames: int) -> int:
    """Frames an utterance of `frames` frames keeps when a pause of `silent_run` frames ends it:
    up to its last speech frame plus `tail_frames` of the pause. A function of the audio alone,
    so the cut is the same whenever the decision is made."""
    return frames - silent_run + min(tail_frames, silent_run)


class SpeechSegmenter:
    """Feed chunks with `push`; it returns the utterances they complete."""

    def __init__(self, sample_rate: int, config: SegmenterConfig | None = None) -> None:
        self.sample_rate = sample_rate
        self.config = cfg = config or SegmenterConfig()
        self.frame = max(1, round(cfg.frame_s * sample_rate))
        self._pending = np.zeros(0, np.float32)     # samples not yet forming a whole frame
        self._pending_start = None                  # capture time of _pending[0]
        self._frame_s = self.frame / sample_rate
        cfg.check()
        self.tail_frames = self._tail_frames(cfg)
        self._window = np.hanning(self.frame).astype(np.float32)
        freqs = np.fft.rfftfreq(self.frame, 1.0 / sample_rate)
        low, high = cfg.band_hz or (0.0, sample_rate / 2)
        self._band = (freqs >= low) & (freqs <= high)
        # Parseval: the band's share of the frame's mean square, so levels stay in dBFS.
        self._band_scale = 2.0 / (self.frame * float(np.sum(np.square(self._window))))
        # The frames that trigger the start belong to the utterance too, so keep them with the preroll.
        self._preroll: deque[np.ndarray] = deque(maxlen=self._preroll_frames(cfg))
        self._speech: list[np.ndarray] = []         # frames of the current utterance
        self._speech_start = 0.0
        self._in_speech = False
        self._heard = False                         # the utterance in progress holds a speech frame
        self._voiced_run = 0
        self._silent_run = 0
        self._noise_db: float | None = None         # None until a frame of the room (not digital silence)
        self._frames_seen = 0                       # frames stepped (digital silence included)
        # The last floor_window_s of levels, as a monotonic queue of (frame number, level) with
        # rising levels: its first entry is the window's minimum at O(1) amortised per frame.
        self._window_frames = max(1, round(cfg.floor_window_s / self._frame_s))
        self._recent: deque[tuple[int, float]] = deque()
        self._levels_seen = 0                       # frames that entered the window
        # Listening begins unheard-before: speech already under way (a node activated, or a
        # stream restarted, while someone spoke) is the tail of an utterance, until a pause.
        self._after_gap = "it began before listening did (no pause heard before it)"
        self._quiet_run = 0                         # non-speech frames in a row outside an utterance
        self._chunk_s = 0.0                         # duration of the last pushed chunk
        self._start_note = ""                       # why the current utterance began incomplete
        self.last_time = None                       # capture time after the last pushed sample
        self._stamped_end: float | None = None      # where the stamps say the stream has got to
        self.discontinuities = 0                    # jumps in the stamps seen so far
        self.lost_s = 0.0                           # seconds of audio missing at those jumps

    def push(self, samples: np.ndarray, start_time: float, stamped: bool = True) -> list[Utterance]:
        """Add a chunk whose first sample was captured at `start_time` (seconds). `stamped=False`
        says the time is only an arrival estimate: the chunk is taken as continuing the stream."""
        done = []
        chunk_s = samples.size / self.sample_rate
        # Measured from the last stamped chunk's end (and the unstamped audio since): an unstamped
        # chunk's time is an arrival estimate, perhaps on another clock (a simulator's before its
        # first /clock reads 0), and a first stamp after such chunks shows no lost audio.
        if stamped and self._stamped_end is not None:
            jump = start_time - self._stamped_end
            if abs(jump) > self.config.jump_tolerance(self._chunk_s):
                done += self._discontinuity(jump)
        self._chunk_s = chunk_s
        if self._pending.size == 0:
            self._pending_start = start_time
        self._pending = np.concatenate([self._pending, samples.astype(np.float32, copy=False)])
        self.last_time = start_time + samples.size / self.sample_rate
        if stamped:
            self._stamped_end = self.last_time
        elif self._stamped_end is not None:
            self._stamped_end += chunk_s
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
        """End the current utterance now (the stream ended); it is marked incomplete with `note`."""
        return self._finish_now(note)

    def stream_stopped(self, note: str = "the audio stream stopped mid-utterance") -> Utterance | None:
        """No chunk has come for a while (a stalled driver, push-to-talk released). The utterance
        in progress ends, incomplete with `note`, and speech that follows continues it: incomplete
        too, until a pause of hangover_s (a stalled driver's backlog is the rest of that speech).
        The time without chunks is not lost audio: the next chunk's stamp restarts the clock."""
        speaking = self._in_speech
        cut = self.flush(note)        # None also where the part was too short to keep
        self._restart_stream()
        if speaking:
            self._after_gap = "continues speech cut when the audio stream stopped"
        return cut

    def transport_lost(self, seconds: float) -> list[Utterance]:
        """Messages were lost before the next chunk (their publisher's sequence numbers show it),
        about `seconds` of audio: a discontinuity, however little (the stamps miss a jump of under
        min_gap_s). Counted once: the next chunk's stamp restarts the clock."""
        return self._discontinuity(seconds)

    def chunk_refused(self, what: str = "an audio chunk was refused") -> list[Utterance]:
        """The node refused a chunk of this stream (malformed: it could not be decoded): its audio
        is missing between the last chunk and the next, however short (a refused 10-20 ms chunk is
        within the stamps' jitter, and unstamped chunks show nothing). The utterance in progress
        ends incomplete and speech after it is incomplete until a pause, as at a jump; the stream's
        clock is kept, so a jump the stamps do show is still counted as lost audio."""
        cut = self._finish_now(f"audio lost after it ({what})")
        last_time, stamped_end = self.last_time, self._stamped_end
        self._restart_stream()
        self.last_time, self._stamped_end = last_time, stamped_end
        self._after_gap = f"audio lost before it ({what})"
        return [cut] if cut is not None else []

    def _tail_frames(self, cfg: SegmenterConfig) -> int:
        return round(cfg.tail_s / self._frame_s)

    def _preroll_frames(self, cfg: SegmenterConfig) -> int:
        return round((cfg.preroll_s + cfg.min_speech_s) / self._frame_s) + 1

    def reconfigure(self, config: SegmenterConfig) -> None:
        """New settings from the next frame on, keeping the noise floor and the stream's clock
        (lost audio is still seen across the change). Only between utterances: an utterance is cut
        by one set of rules. The frame and the band are fixed for a segmenter's life."""
        if self._in_speech:
            raise RuntimeError("reconfigure between utterances only")
        config.check()
        if (config.frame_s, config.band_hz) != (self.config.frame_s, self.config.band_hz):
            raise ValueError("frame_s and band_hz cannot change: make a new segmenter")
        self.config = config
        self.tail_frames = self._tail_frames(config)
        self._preroll = deque(self._preroll, maxlen=self._preroll_frames(config))
        self._window_frames = max(1, round(config.floor_window_s / self._frame_s))

    def continues_after(self, note: str) -> None:
        """The stream was cut before this segmenter's first sample (a format change): speech from
        here on is incomplete with `note`, as after lost audio, until a pause of `hangover_s`."""
        self._after_gap = note

    @property
    def in_speech(self) -> bool:
        return self._in_speech

    def current(self) -> Utterance | None:
        """The utterance in progress so far (a copy), or None outside speech. One concatenation
        per call: meant for a partial transcript every half second or so, not for every chunk.
        None too while a continuation after the length limit holds only the rest of a pause."""
        if not self._open:
            return None
        notes = [self._start_note] if self._start_note else []
        return Utterance(np.concatenate(self._speech), self.sample_rate, self._speech_start,
                         complete=not notes, note="; ".join(notes), final=False)

    def pending_final(self) -> Utterance | None:
        """The final utterance the current pause will end, if it lasts the hangover: available
        once the pause has reached the tail (None before, outside speech, or when too short).
        The same samples, start and notes as the final `push` will return then."""
        # a pause of at least one frame: with tail_s 0, no pause would offer the speech so far
        if not self._open or self._silent_run < max(1, self.tail_frames):
            return None
        return self._cut(self._speech[:end_cut(len(self._speech), self._silent_run, self.tail_frames)],
                         [self._start_note] if self._start_note else [])

    @property
    def speech_s(self) -> float:
        """Length of the utterance in progress (0 outside speech)."""
        return len(self._speech) * self._frame_s if self._in_speech else 0.0

    @property
    def pause_s(self) -> float:
        """Non-speech since the last speech frame of the utterance in progress."""
        return self._silent_run * self._frame_s if self._in_speech else 0.0

    @property
    def utterance_start(self) -> float | None:
        """Capture time of the first sample of the utterance in progress: it names the utterance.
        None while it holds no speech yet (see current())."""
        return self._speech_start if self._open else None

    @property
    def _open(self) -> bool:
        # A continuation that is only the rest of a pause is no utterance: silence sent to the
        # recogniser comes back as invented words.
        return self._in_speech and self._heard

    def _level_db(self, frame: np.ndarray) -> float:
        """Power in the speech band, dBFS."""
        spectrum = np.fft.rfft(frame * self._window)
        power = float(np.square(np.abs(spectrum[self._band])).sum()) * self._band_scale
        return 10.0 * np.log10(max(power, 1e-20))

    def _step(self, frame: np.ndarray, t: float) -> Utterance | None:
        cfg = self.config
        level = self._level_db(frame)
        room = level >= DIGITAL_SILENCE_DB          # digital silence tells nothing about the room
        if room and self._frames_seen == 0:
            self._noise_db = level                  # a mic opens before anyone speaks
        self._frames_seen += 1
        above = cfg.continue_db if self._in_speech else cfg.threshold_db
        floor = self._noise_db if self._noise_db is not None else -np.inf
        voiced = level > max(floor + above, cfg.min_level_db)
        if room:
            if not voiced:
                # Track the floor on non-speech frames: fall at once, rise slowly.
                alpha = min(1.0, cfg.frame_s / cfg.noise_adapt_s)
                self._noise_db = level if self._noise_db is None else \
                    min(level, self._noise_db + alpha * (level - self._noise_db))
            window_min = self._window_min(level)
            # Without a floor yet (after digital silence) only min_level_db has judged the frames:
            # a window all above it is stuck (noise between it and continue_db over it never ends).
            stuck_above = self._noise_db + cfg.continue_db if self._noise_db is not None else cfg.min_level_db
            if window_min is not None and window_min > stuck_above:
                # No frame in floor_window_s came near the floor: it is stuck under the noise.
                self._noise_db = window_min

        if not self._in_speech:
            self._preroll.append(frame)
            self._voiced_run = self._voiced_run + 1 if voiced else 0
            self._quiet_run = 0 if voiced else self._quiet_run + 1
            if self._quiet_run * self._frame_s >= cfg.hangover_s:
                # A pause that would end an utterance: speech after it is a new one, whole. (One
                # quiet frame is not: a plosive or a word boundary right after the gap.)
                self._after_gap = ""
            if self._voiced_run * self._frame_s >= cfg.min_speech_s:
                self._in_speech = self._heard = True
                self._start_note, self._after_gap = self._after_gap, ""
                self._speech = list(self._preroll)
                self._speech_start = t + self._frame_s - len(self._speech) * self._frame_s
                self._preroll.clear()
                self._silent_run = 0
            return None

        self._speech.append(frame)
        self._silent_run = 0 if voiced else self._silent_run + 1
        self._heard = self._heard or voiced
        duration = len(self._speech) * self._frame_s
        if self._silent_run * self._frame_s >= cfg.hangover_s:
            return self._finish(keep=end_cut(len(self._speech), self._silent_run, self.tail_frames))
        if duration >= cfg.max_utterance_s:
            # Speech goes on: the next frame begins its continuation, incomplete as well and judged
            # as inside an utterance (continue_db, hangover_s), not by the start rule: by threshold_db
            # its weak frames read as a pause, and syllables shorter than min_speech_s never
            # restarted one, so the rest of the speech was lost.
            limit = f"{cfg.max_utterance_s:g} s utterance limit"
            pause = self._silent_run   # a pause the cut falls in goes on counting after it
            cut = self._finish(f"cut at the {limit}")
            self._in_speech, self._heard, self._silent_run = True, False, pause
            self._start_note = f"continues speech cut at the {limit}"
            self._speech_start = t + self._frame_s
            return cut
        return None

    def _window_min(self, level: float) -> float | None:
        """Add a frame's level to the window; the window's minimum once it is full, else None."""
        n = self._levels_seen
        self._levels_seen += 1
        while self._recent and self._recent[-1][1] >= level:
            self._recent.pop()          # never the minimum again: this newer frame is as quiet
        self._recent.append((n, level))
        while self._recent[0][0] <= n - self._window_frames:
            self._recent.popleft()      # slid out of the window
        return self._recent[0][1] if self._levels_seen >= self._window_frames else None

    def _discontinuity(self, jump: float) -> list[Utterance]:
        """The stream jumped by `jump` seconds: audio before the jump does not join audio after it."""
        self.discontinuities += 1
        self.lost_s += max(jump, 0.0)
        what = (f"{jump:.2f} s of audio lost" if jump > 0
                else f"audio out of order (a chunk starts {-jump:.2f} s before the previous one ended)")
        cut = self._finish_now(f"{what} after it")
        self._restart_stream()
        self._after_gap = f"{what} before it"
        return [cut] if cut is not None else []

    def _restart_stream(self) -> None:
        """Audio before this point does not join audio after it: frames in the making, the
        preroll and the runs of (non-)speech are dropped, and the clock restarts."""
        self._pending = np.zeros(0, np.float32)
        self._preroll.clear()
        self._voiced_run = self._quiet_run = 0
        self.last_time = self._stamped_end = None

    def _finish_now(self, note: str) -> Utterance | None:
        """End the utterance in progress (if any) at a cut that is not a pause, incomplete with
        `note`. The samples not yet making a whole frame are its last audio before the cut: they
        go into it (up to a frame of speech was lost at every such cut) and leave the stream."""
        if not self._in_speech:
            return None
        if self._pending.size:
            self._speech.append(self._pending)
            self._pending_start += self._pending.size / self.sample_rate
            self._pending = np.zeros(0, np.float32)
        return self._finish(note)

    def _finish(self, note: str = "", keep: int | None = None) -> Utterance | None:
        """End the utterance in progress with its first `keep` frames (all by default)."""
        frames, self._speech = self._speech, []
        heard = self._heard
        self._in_speech = self._heard = False
        self._voiced_run = self._silent_run = 0
        notes = [n for n in (self._start_note, note) if n]
        self._start_note = ""
        if not heard:
            return None   # see _open
        return self._cut(frames if keep is None else frames[:keep], notes)

    def _cut(self, frames: list[np.ndarray], notes: list[str]) -> Utterance | None:
        samples = np.concatenate(frames) if frames else np.zeros(0, np.float32)
        if samples.size < self.config.min_utterance_s * self.sample_rate:
            return None
        return Utterance(samples, self.sample_rate, self._speech_start, complete=not notes,
                         note="; ".join(notes))
