"""When has an audio stream stopped? Only the absence of chunks can tell, and that is a clock
reading, so it is made robust to the one case that fooled it: a stalled executor.

After a stall the executor runs this node's periodic tick before the chunks that queued up
meanwhile, so one idle tick proves nothing. A stream counts as stopped only when a tick finds it
idle and the next tick finds no chunk arrived in between.

Idle means longer than `idle_s`, than two of the stream's own chunks and, for a stream that
comes at a steady pace, than two of its gaps between chunks (up to PACE_MAX_FACTOR x idle_s): a
driver that sends a second of audio a message (microphone_node allows chunks up to 1 s) is not
stopped between them, nor is a source that sends short chunks seldom but steadily (a WAV player at
a tenth of real time, a simulator's microphone at its slow pace), whose commands were cut between
every two chunks. Gaps that are not steady (push-to-talk: short ones within a press, long ones
between presses) do not stretch it: each press still ends after idle_s.
"""
from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Callable

GAPS_KEPT = 8   # the stream's pace: the median of this many gaps
GAPS_TRUSTED = 3   # and is known from this many on (one gap may be a stop and a restart)
PACE_MAX_SPREAD = 2.0   # a steady pace: the longest kept gap at most this times the shortest
PACE_MAX_FACTOR = 4.0   # the pace stretches idle_s this many times at most


class StreamWatch:
    def __init__(self, idle_s: float) -> None:
        self.idle_s = idle_s
        self.last_chunk: float | None = None   # monotonic arrival time of the newest chunk
        self.chunk_s = 0.0                     # its audio's duration
        self.gaps: deque[float] = deque(maxlen=GAPS_KEPT)   # between the arrivals of recent chunks
        self._arrived: float | None = None     # the newest chunk's arrival, kept across a stop
        self._armed = False

    def chunk(self, now: float, duration_s: float = 0.0) -> None:
        """A chunk of `duration_s` of audio arrived at monotonic time `now`."""
        if self._arrived is not None:
            self.gaps.append(max(0.0, now - self._arrived))
        self.last_chunk = self._arrived = now
        self.chunk_s = duration_s
        self._armed = False

    @property
    def limit_s(self) -> float:
        """How long without a chunk is idle."""
        limit = max(self.idle_s, 2.0 * self.chunk_s)
        gaps = self.gaps
        if len(gaps) >= GAPS_TRUSTED and max(gaps) <= PACE_MAX_SPREAD * min(gaps):
            limit = max(limit, min(2.0 * statistics.median(gaps), PACE_MAX_FACTOR * self.idle_s))
        return limit

    def ended(self) -> None:
        """The stream's end was reported by other means: no stop to report until the next chunk."""
        self.last_chunk, self._armed = None, False

    def stopped(self, now: float) -> bool:
        """Call from a periodic tick: True once per stop, on the second idle tick in a row."""
        if self.last_chunk is None or now - self.last_chunk <= self.limit_s:
            self._armed = False
            return False
        if not self._armed:
            self._armed = True
            return False
        self._armed = False
        self.last_chunk = None   # reported; the next chunk starts watching again
        return True


class ArrivalRate:
    """Does audio whose rate only a parameter states (std_msgs arrays carry none) arrive at it?
    Its samples are counted against the clock over a stretch of at least `min_s` without a stop
    (restart() at one): 48 kHz audio read as 16 kHz arrives three times too fast, and the model
    would hear it three times slower and lower, with nothing else to show it."""

    def __init__(self, min_s: float = 5.0, tolerance: float = 0.1) -> None:
        self.min_s, self.tolerance = min_s, tolerance
        self.restart()

    def restart(self) -> None:
        self.first: float | None = None   # arrival of the stretch's first chunk
        self.last = 0.0
        self.samples = 0                  # after the first chunk
        self.rate = 0

    def chunk(self, now: float, samples: int, rate: int) -> None:
        if self.first is None or rate != self.rate:
            self.restart()
            self.first, self.last, self.rate = now, now, rate
            return
        self.last, self.samples = now, self.samples + samples

    def mismatch(self) -> str:
        """Why the stated rate looks wrong ("" while it looks right, or too little is known)."""
        if self.first is None or self.last - self.first < self.min_s:
            return ""
        measured = self.samples / (self.last - self.first)
        if abs(measured / self.rate - 1) <= self.tolerance:
            return ""
        return (f"audio arrives at about {measured:.0f} samples/s but sample_rate says {self.rate} Hz: "
                "set the speech node's sample_rate to the source's")


class RecentLosses:
    """Which losses of input (each a running count) grew within the last `recent_s`: a monitor
    watches /diagnostics' level, not its counts, so a node raises it to WARN while a loss is news
    (ten 1 Hz statuses for a monitor or an aggregator to catch) and lets it fall once the loss is
    minutes old (the counts keep it). A count is tied to the object that counts it: a new one (a
    segmenter made after a rate change or a deactivation) counts from 0 again."""

    def __init__(self, recent_s: float = 10.0) -> None:
        self.recent_s = recent_s
        self._seen: dict[str, tuple[object, int, float | None, str]] = {}   # name -> (counter, count, at, text)

    def note(self, name: str, counter: object, count: int, describe: Callable[[], str], now: float) -> str:
        """The loss as `describe()` said it when `count` last grew, if that was within recent_s;
        else ""."""
        old_counter, old_count, at, text = self._seen.get(name, (counter, 0, None, ""))
        if count > (old_count if old_counter is counter else 0):
            at, text = now, describe()
        self._seen[name] = (counter, count, at, text)
        return text if at is not None and now - at <= self.recent_s else ""
