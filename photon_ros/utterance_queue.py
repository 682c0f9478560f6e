"""A bounded queue of utterances waiting for the model, measured in seconds of audio.

When speech arrives faster than it can be transcribed, the oldest audio is dropped (the robot
should act on what was said last) and the drop is counted and reported; the queue never grows
without bound.

Partial requests (the utterance in progress, for a partial transcript) wait in a single slot
beside the queue: a newer partial replaces a waiting one, any final utterance is handed out
first, and a final clears the slot (its partial is stale once the whole utterance is there). So
partials never make a final wait for them in the queue, and they cost no budget.

A speculation (the final a pause will give if it lasts, `SpeechSegmenter.pending_final`) waits in
a second slot, served after finals and before partials, and cleared by a final too: once a final
is queued the speculation is either that final (decoded normally now) or stale. What a
speculation decoded is kept in `Speculations` and used for a final only if the final's samples
are exactly the ones it decoded.
"""
from __future__ import annotations

import threading
from collections import deque
from typing import Any

import numpy as np

from photon_ros.speech_segmenter import Utterance


def same_audio(a: Utterance, b: Utterance) -> bool:
    """Do two utterances hold exactly the same audio (start, rate and every sample)?"""
    return (a.start_time == b.start_time and a.sample_rate == b.sample_rate
            and a.samples.shape == b.samples.shape and bool(np.array_equal(a.samples, b.samples)))


class Speculations:
    """Results decoded ahead of a final, kept until the final comes. `take` hands a result out
    only for a final with exactly the speculation's audio; any final clears what is kept (the
    speech went on, or the cut was different: the final is decoded normally)."""

    def __init__(self) -> None:
        self._kept: tuple[Utterance, Any, float, Any] | None = None
        self.used = 0        # finals published from a speculation
        self.wasted = 0      # speculations decoded whose final turned out different

    def keep(self, utterance: Utterance, result: Any, seconds: float, settings: Any = None) -> None:
        """Keep a result decoded ahead, with the decoding `settings` it was made under (the
        language and initial_prompt: parameters that change at once)."""
        if self._kept is not None:
            self.wasted += 1
        self._kept = (utterance, result, seconds, settings)

    def take(self, final: Utterance, settings: Any = None) -> tuple[Any, float] | None:
        """(result, seconds it took) decoded on exactly `final`'s audio under the same `settings`,
        else None (a prompt changed meanwhile: the final is decoded with the new one)."""
        kept, self._kept = self._kept, None
        if kept is None:
            return None
        if not same_audio(kept[0], final) or kept[3] != settings:
            self.wasted += 1
            return None
        self.used += 1
        return kept[1], kept[2]


class UtteranceQueue:
    def __init__(self, max_seconds: float) -> None:
        self.max_seconds = max_seconds
        self._items: deque[Utterance] = deque()
        self._partial: Utterance | None = None
        self._speculation: Utterance | None = None
        self._seconds = 0.0
        self._cond = threading.Condition()
        self._closed = False
        self.dropped = 0
        self.dropped_seconds = 0.0
        self.partials_replaced = 0    # partial requests superseded before the model saw them

    def put(self, utterance: Utterance) -> list[Utterance]:
        """Queue a final utterance; returns the ones dropped to make room (oldest first)."""
        dropped = []
        with self._cond:
            self._items.append(utterance)
            self._seconds += utterance.duration
            if self._partial is not None:
                self._partial = None
                self.partials_replaced += 1
            self._speculation = None
            # Keep at least the newest utterance, even when it alone exceeds the budget.
            while self._seconds > self.max_seconds and len(self._items) > 1:
                old = self._items.popleft()
                self._seconds -= old.duration
                dropped.append(old)
            self.dropped += len(dropped)
            self.dropped_seconds += sum(u.duration for u in dropped)
            self._cond.notify()
        return dropped

    def offer_partial(self, utterance: Utterance) -> None:
        """Ask for a partial transcript of `utterance` (the audio so far); replaces any partial
        request still waiting."""
        with self._cond:
            if self._partial is not None:
                self.partials_replaced += 1
            self._partial = utterance
            self._cond.notify()

    def offer_speculation(self, utterance: Utterance) -> None:
        """Ask for `utterance` (speculative: the final a pause gives if it lasts) to be decoded
        ahead; replaces any speculation still waiting."""
        with self._cond:
            self._speculation = utterance
            self._cond.notify()

    def get(self, timeout: float | None = None, partials: bool = True) -> Utterance | None:
        """The oldest waiting final utterance, else the waiting speculation, else (if `partials`)
        the waiting partial request; None on timeout or after close()."""
        with self._cond:
            ready = lambda: (self._items or self._speculation or (partials and self._partial)  # noqa: E731
                             or self._closed)
            if not self._cond.wait_for(ready, timeout):
                return None
            if self._items:
                item = self._items.popleft()
                # An empty queue holds exactly 0 s, whatever the float sums left over.
                self._seconds = self._seconds - item.duration if self._items else 0.0
                return item
            if self._speculation is not None:
                item, self._speculation = self._speculation, None
                return item
            if not partials:
                return None
            item, self._partial = self._partial, None
            return item

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    @property
    def seconds(self) -> float:
        """Audio of the final utterances waiting."""
        with self._cond:
            return self._seconds

    def __len__(self) -> int:
        """Final utterances waiting (a partial request is not counted)."""
        with self._cond:
            return len(self._items)
