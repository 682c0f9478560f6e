"""A bounded queue of utterances waiting for the model, measured in seconds of audio.

When speech arrives faster than it can be transcribed, the oldest audio is dropped (the robot
should act on what was said last) and the drop is counted and reported; the queue never grows
without bound.
"""
from __future__ import annotations

import threading
from collections import deque

from photon_ros.speech_segmenter import Utterance


class UtteranceQueue:
    def __init__(self, max_seconds: float) -> None:
        self.max_seconds = max_seconds
        self._items: deque[Utterance] = deque()
        self._seconds = 0.0
        self._cond = threading.Condition()
        self._closed = False
        self.dropped = 0
        self.dropped_seconds = 0.0

    def put(self, utterance: Utterance) -> list[Utterance]:
        """Queue an utterance; returns the ones dropped to make room (oldest first)."""
        dropped = []
        with self._cond:
            self._items.append(utterance)
            self._seconds += utterance.duration
            # Keep at least the newest utterance, even when it alone exceeds the budget.
            while self._seconds > self.max_seconds and len(self._items) > 1:
                old = self._items.popleft()
                self._seconds -= old.duration
                dropped.append(old)
            self.dropped += len(dropped)
            self.dropped_seconds += sum(u.duration for u in dropped)
            self._cond.notify()
        return dropped

    def get(self, timeout: float | None = None) -> Utterance | None:
        """The oldest waiting utterance, or None on timeout or after close()."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._items or self._closed, timeout):
                return None
            if not self._items:
                return None
            item = self._items.popleft()
            self._seconds -= item.duration
            return item

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    @property
    def seconds(self) -> float:
        with self._cond:
            return self._seconds

    def __len__(self) -> int:
        with self._cond:
            return len(self._items)
