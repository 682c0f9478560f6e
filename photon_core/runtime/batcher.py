"""Gathering concurrent requests into one batch.

Several camera streams served by one engine each ask for work on their newest frame (a few
detect/point/caption requests per frame). Run one after another, N cameras cost N passes through
the model per decode step; gathered, one pass serves them all (the model sees a bigger batch,
which is what GPUs and BLAS are fast at). A caller's requests go in as one group and stay
together; a batch waits at most `window_s` for company and holds at most `max_batch` requests
(a single larger group still runs, alone).
"""
from __future__ import annotations

import threading
from concurrent.futures import Future
from concurrent.futures import TimeoutError as WaitTimedOut   # (before 3.11 not the builtin)
from dataclasses import dataclass, field
from typing import Callable

# How often a caller waiting with a cancel event looks at it (a timed-out robot goal answers within it).
CANCEL_POLL_S = 0.02


class Canceled(Exception):
    """The caller's cancel was set before its requests began to run: they never ran."""


@dataclass(eq=False)
class _Group:
    """One caller's requests, answered together."""
    items: list
    future: Future = field(default_factory=Future)
    cancel: threading.Event | None = None
    started: bool = False       # taken into a batch that holds the engine: it runs
    abandoned: bool = False     # its caller stopped waiting (canceled before it started)

    def canceled(self) -> bool:
        return self.abandoned or (self.cancel is not None and self.cancel.is_set())


def _stopped(groups: list[_Group], err: BaseException) -> None:
    """The callers of `groups` not yet answered hear that the batcher's thread stops."""
    for group in groups:
        if not group.future.done():
            group.future.set_exception(RuntimeError(f"this engine's batcher stopped ({type(err).__name__}: {err})"))


SIZES_KEPT = 1000


class Batcher:
    def __init__(self, run_many: Callable[[list], list] | None, lock: threading.Lock, max_batch: int = 8,
                 window_s: float = 0.005) -> None:
        self.run_many = run_many          # items -> results, in order (None once closed)
        self.lock = lock                  # the engine's lock: a batch runs while nothing else does
        self.max_batch = max_batch
        self.window_s = window_s
        self._pending: list[_Group] = []
        self._cond = threading.Condition()
        self.sizes: list[int] = []        # requests per batch of the last SIZES_KEPT that ran (tests)
        self._closed = False
        self._thread = threading.Thread(target=self._run, daemon=True, name="batcher")
        self._thread.start()

    def submit(self, items: list, cancel: threading.Event | None = None) -> list:
        """Results of `items`, computed in a batch with whatever other callers submit meanwhile.
        Raises what running them raised (another caller's bad request never fails this one).
        With `cancel`: once it is set while the items still wait for their batch (behind a batch
        that runs, or the engine's lock), they are dropped and Canceled is raised at once; once
        they run, the caller waits for their results (the model drops canceled rows itself)."""
        if not items:
            return []
        group = _Group(list(items), cancel=cancel)
        with self._cond:
            if self._closed:
                raise RuntimeError("this engine was released (its batcher is closed)")
            self._pending.append(group)
            self._cond.notify()
        if cancel is None:
            return group.future.result()
        while True:
            try:
                return group.future.result(timeout=CANCEL_POLL_S)
            except WaitTimedOut:
                if cancel.is_set():
                    with self._cond:
                        if not group.started and not group.future.done():
                            group.abandoned = True
                            if group in self._pending:
                                self._pending.remove(group)
                            raise Canceled("canceled while waiting for its batch")

    def _queued(self) -> int:
        return sum(len(group.items) for group in self._pending)

    def _take(self) -> list[_Group]:
        groups: list[_Group] = []
        count = 0
        while self._pending and (not groups or count + len(self._pending[0].items) <= self.max_batch):
            groups.append(self._pending.pop(0))
            count += len(groups[-1].items)
        return groups

    def close(self, timeout: float = 60.0) -> None:
        """Serve what is queued, then stop the thread (and drop run_many, and with it the model)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout)
        self.run_many = None

    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    self._cond.wait_for(lambda: self._pending or self._closed)
                    if not self._pending:
                        return   # closed, nothing left to serve
                    # Give other cameras a moment to join, unless the batch is already full.
                    self._cond.wait_for(lambda: self._queued() >= self.max_batch or self._closed, self.window_s)
                    groups = self._take()
                self._serve(groups)
        except BaseException as err:
            # The thread ends (SystemExit from a callback, say): no caller may wait for it forever.
            with self._cond:
                self._closed = True
                left, self._pending = self._pending, []
            _stopped(left, err)
            raise

    def _start(self, groups: list[_Group]) -> list[_Group]:
        """The groups that run, marked started; canceled ones are answered Canceled instead."""
        with self._cond:
            running = [g for g in groups if not g.canceled()]
            for group in groups:
                if group.canceled() and not group.future.done():
                    group.future.set_exception(Canceled("canceled while waiting for its batch"))
                group.started = not group.canceled()
        return running

    def _serve(self, groups: list[_Group]) -> None:
        try:
            with self.lock:
                groups = self._start(groups)   # a cancel that came while the lock was awaited
                if not groups:
                    return
                items = [item for group in groups for item in group.items]
                if self.run_many is None:
                    raise RuntimeError("this engine was released (its batcher is closed)")
                results = self.run_many(items)
            if len(results) != len(items):
                # Sliced by position, a short list would hand one caller (camera) another's results.
                raise RuntimeError(f"the model returned {len(results)} results for {len(items)} requests")
        except BaseException as err:  # noqa: BLE001 - handed to the callers
            if not isinstance(err, Exception):   # SystemExit, KeyboardInterrupt: the thread stops (_run)
                _stopped(groups, err)
                raise
            if len(groups) == 1:
                groups[0].future.set_exception(err)
            else:
                # Find whose request failed: each group alone, so the others still get results.
                try:
                    for group in groups:
                        self._serve([group])
                except BaseException as stop:   # one group's retry stopped the thread: tell the rest
                    _stopped(groups, stop)
                    raise
            return
        self.sizes.append(len(items))
        if len(self.sizes) > 2 * SIZES_KEPT:   # a camera at 30 Hz runs 2.6 million batches a day
            del self.sizes[:-SIZES_KEPT]
        start = 0
        for group in groups:
            group.future.set_result(results[start:start + len(group.items)])
            start += len(group.items)
