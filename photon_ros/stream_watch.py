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
