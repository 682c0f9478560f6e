"""When has an audio stream stopped? Only the absence of chunks can tell, and that is a clock
reading, so it is made robust to the one case that fooled it: a stalled executor.

After a stall the executor runs this node's periodic tick before the chunks that queued up
meanwhile, so one idle tick proves nothing. A stream counts as stopped only when a tick finds it
idle and the next tick finds no chunk arrived in between.

Idle means longer than `idle_s` and than two of the stream's own chunks: a driver that sends a
second of audio a message (microphone_node allows chunks up to 1 s) is not stopped between them.
"""
from __future__ import annotations


class StreamWatch:
    def __init__(self, idle_s: float) -> None:
        self.idle_s = idle_s
        self.last_chunk: float | None = None   # monotonic arrival time of the newest chunk
        self.chunk_s = 0.0                     # its audio's duration
        self._armed = False

    def chunk(self, now: float, duration_s: float = 0.0) -> None:
        """A chunk of `duration_s` of audio arrived at monotonic time `now`."""
        self.last_chunk = now
        self.chunk_s = duration_s
        self._armed = False

    def stopped(self, now: float) -> bool:
        """Call from a periodic tick: True once per stop, on the second idle tick in a row."""
        if self.last_chunk is None or now - self.last_chunk <= max(self.idle_s, 2.0 * self.chunk_s):
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
