"""Thread count for a repeated small workload (a decoder's per-token step), chosen by timing it.

On an idle 2-core CPU, Whisper tiny's token step runs ~30% faster on 2 threads (the LM head and the
cross-attention stream ~40 MB per token: two cores pull more memory bandwidth than one); on a busy
one (other ROS nodes on the cores) 2 threads decode ~4x slower in the median, because each op's
thread barrier waits for a descheduled worker. Neither choice is right on a robot whose load comes
and goes, so the step is timed: each thread count keeps an exponential average of its recent
seconds per step, the faster one runs, and the other is re-tried now and then (less often each
time it loses, so a count that stays slower costs little; a re-try's time replaces the old
average, so one step tells that the load has gone).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Hashable, Sequence, TypeVar

import torch

T = TypeVar("T")


@dataclass
class _Workload:
    seconds: dict[int, float] = field(default_factory=dict)   # thread count -> average s per step
    interval: int = 0        # steps between re-tries of a count that is not the fastest
    since: int = 0           # steps since the last re-try
    turn: int = 0            # which other count is re-tried next


class ThreadTuner:
    """Picks, per workload key (steps of one shape cost alike), the thread count whose recent
    steps ran fastest. `run(key, fn)` runs fn under the chosen count and times it. A key seen for
    the first time starts on the count that was fastest for the last key timed (the load is the
    machine's, not the shape's) and tries the others at the first re-try."""

    def __init__(self, choices: Sequence[int], retry_every: int = 16, max_retry_every: int = 512,
                 alpha: float = 0.5) -> None:
        self.choices = tuple(dict.fromkeys(int(c) for c in choices))
        if not self.choices or min(self.choices) < 1:
            raise ValueError(f"thread counts must be positive, got {choices!r}")
        self.retry_every, self.max_retry_every, self.alpha = retry_every, max_retry_every, alpha
        self._workloads: dict[Hashable, _Workload] = {}
        self._preferred = self.choices[0]

    def fastest(self, key: Hashable) -> int | None:
        """The count with the lowest average for `key` among those timed (None: none yet)."""
        w = self._workloads.get(key)
        if w is None or not w.seconds:
            return None
        return min(w.seconds, key=lambda c: (w.seconds[c], c))

    def _workload(self, key: Hashable) -> _Workload:
        return self._workloads.setdefault(key, _Workload(interval=self.retry_every))

    def choose(self, key: Hashable) -> int:
        w = self._workload(key)
        best = self.fastest(key) or self._preferred
        w.since += 1
        if len(self.choices) > 1 and w.since > w.interval:
            w.since = 0
            others = [c for c in self.choices if c != best]
            untried = [c for c in others if c not in w.seconds]
            if untried:
                return untried[0]
            w.turn = (w.turn + 1) % len(others)
            return others[w.turn]
        return best

    def record(self, key: Hashable, threads: int, seconds: float) -> None:
        w = self._workload(key)
        before = self.fastest(key)
        old = w.seconds.get(threads)
        retry = before is not None and threads != before
        # A re-try measures the present load: it replaces what that count timed long ago.
        w.seconds[threads] = seconds if old is None or retry else old + self.alpha * (seconds - old)
        after = self.fastest(key)
        if retry:
            # if it did not win, wait twice as long before the next one
            w.interval = self.retry_every if after != before else min(self.max_retry_every, 2 * w.interval)
        self._preferred = after if after is not None else self._preferred

    def run(self, key: Hashable, fn: Callable[[], T]) -> T:
        threads = self.choose(key)
        previous = torch.get_num_threads()
        torch.set_num_threads(threads)
        start = time.perf_counter()
        try:
            out = fn()
        finally:
            torch.set_num_threads(previous)
        self.record(key, threads, time.perf_counter() - start)
        return out
