"""The fastest of several implementations of one op for one shape, measured the first time it is met.

Encoders and prefill are compute-bound, and which implementation is fastest depends on the GPU and the
shape: our Triton kernels (written to the ops contract's exact semantics, fp32 math) or torch's own
(the vendor's GEMM on the tensor cores, flash attention). Issue 39: chosen by measurement per shape.
`Choices.run(key, candidates)` runs the chosen candidate of `key`; the first call of a key times
each candidate (`REPEATS` runs after one warm-up, CUDA events) and keeps the fastest for the rest
of the process; a candidate that raises is not chosen. The candidates must be pure functions of
their inputs (each runs several times on the same tensors). Nothing is measured while a CUDA graph
is being captured, or off a GPU: the first candidate (our kernel) runs then.

A few ms once per distinct shape (an encoder has a handful); choices are logged once and listed by
`choices()`.
"""
from __future__ import annotations

import logging
import statistics
import threading
from collections.abc import Callable, Hashable, Mapping
from typing import Any

import torch

log = logging.getLogger(__name__)

REPEATS = 3
Timer = Callable[[Callable[[], Any]], float]    # seconds one run of the function takes


def cuda_seconds(fn: Callable[[], Any]) -> float:
    """Median seconds of `REPEATS` runs of fn on the current CUDA stream, after one warm-up."""
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(REPEATS):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def measurable(t: torch.Tensor) -> bool:
    """Whether a choice can be measured on t's device now (a GPU, not capturing a graph)."""
    return t.is_cuda and not torch.cuda.is_current_stream_capturing()


class Choices:
    """Per key, the name of the fastest candidate (and each candidate's seconds)."""

    def __init__(self, timer: Timer = cuda_seconds) -> None:
        self.timer = timer
        self.chosen: dict[Hashable, str] = {}
        self.seconds: dict[Hashable, dict[str, float]] = {}
        self._lock = threading.Lock()

    def run(self, key: Hashable, candidates: Mapping[str, Callable[[], Any]], measure: bool) -> Any:
        """The result of key's chosen candidate; measured now if key is new and `measure`, else
        the first candidate where nothing was chosen yet."""
        name = self.chosen.get(key)
        if name is None and measure:
            with self._lock:
                name = self.chosen.get(key) or self._measure(key, candidates)
        return candidates[name or next(iter(candidates))]()

    def overrule(self, key: Hashable, name: str) -> None:
        """Run `name` for key from now on, whatever was measured (a candidate found wrong)."""
        with self._lock:
            self.chosen[key] = name

    def forget(self, key: Hashable) -> None:
        """Drop key's choice: its next call is measured again."""
        with self._lock:
            self.chosen.pop(key, None)
            self.seconds.pop(key, None)

    def _measure(self, key: Hashable, candidates: Mapping[str, Callable[[], Any]]) -> str:
        times: dict[str, float] = {}
        errors: list[Exception] = []
        for name, fn in candidates.items():
            try:
                times[name] = self.timer(fn)
            except Exception as e:  # noqa: BLE001  another candidate computes the same
                errors.append(e)
                log.warning("%s: %s failed (%s: %s); not chosen", key, name, type(e).__name__, e)
        if not times:   # the caller's own mistake (a shape, a dtype) as the unmeasured call raises it
            raise errors[0]
        best = min(times, key=times.__getitem__)
        self.seconds[key], self.chosen[key] = times, best
        log.info("%s: %s (%s)", key, best, ", ".join(f"{k} {v * 1e3:.3f} ms" for k, v in times.items()))
        return best


CHOICES = Choices()


def choices() -> dict[Hashable, tuple[str, dict[str, float]]]:
    """What this process chose per key, with each candidate's seconds."""
    with CHOICES._lock:
        return {k: (v, CHOICES.seconds[k]) for k, v in CHOICES.chosen.items()}


__all__ = ["Choices", "CHOICES", "choices", "cuda_seconds", "measurable", "REPEATS"]
