"""Rates and latency percentiles over a sliding window, for diagnostics."""
from __future__ import annotations

import threading
import time
from collections import deque

import numpy as np


class RateStats:
    def __init__(self, window_s: float = 10.0, max_events: int = 10_000) -> None:
        self.window_s = window_s
        self._events: dict[str, deque[float]] = {}
        self._latencies: deque[tuple[float, float]] = deque(maxlen=max_events)
        self._max_events = max_events
        self._lock = threading.Lock()
        self._started = time.monotonic()

    def restart(self) -> None:
        """Count from now, as if just begun: a node's rates begin when it starts taking input (an
        activation after a model load of a minute), not when it was built."""
        with self._lock:
            self._events.clear()
            self._latencies.clear()
            self._started = time.monotonic()

    def tick(self, name: str, latency: float | None = None) -> None:
        now = time.monotonic()
        with self._lock:
            self._events.setdefault(name, deque(maxlen=self._max_events)).append(now)
            if latency is not None:
                self._latencies.append((now, latency))

    def rate(self, name: str) -> float:
        """Events per second over the window, or over the time since this began where that is
        shorter (at least a second): a node 2 s up at 10 Hz says 10 Hz, not 2."""
        now = time.monotonic()
        with self._lock:
            times = [t for t in self._events.get(name, ()) if now - t <= self.window_s]
        return len(times) / min(self.window_s, max(now - self._started, 1.0))

    def latency_percentiles(self, qs=(50, 90, 99)) -> dict[int, float]:
        now = time.monotonic()
        with self._lock:
            values = [v for t, v in self._latencies if now - t <= self.window_s]
        if not values:
            return {}
        return {q: float(v) for q, v in zip(qs, np.percentile(values, qs))}
