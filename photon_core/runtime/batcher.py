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
from typing import Callable


def _stopped(groups: list[tuple[list, Future]], err: BaseException) -> None:
    """The callers of `groups` not yet answered hear that the batcher's thread stops."""
    for _, future in groups:
        if not future.done():
            future.set_exception(RuntimeError(f"this engine's batcher stopped ({type(err).__name__}: {err})"))


class Batcher:
    def __init__(self, run_many: Callable[[list], list] | None, lock: threading.Lock, max_batch: int = 8,
                 window_s: float = 0.005) -> None:
        self.run_many = run_many          # items -> results, in order (None once closed)
        self.lock = lock                  # the engine's lock: a batch runs while nothing else does
        self.max_batch = max_batch
        self.window_s = window_s
        self._pending: list[tuple[list, Future]] = []
        self._cond = threading.Condition()
        self.sizes: list[int] = []        # requests per batch that ran (diagnostics, tests)
        self._closed = False
        self._thread = threading.Thread(target=self._run, daemon=True, name="batcher")
        self._thread.start()

    def submit(self, items: list) -> list:
        """Results of `items`, computed in a batch with whatever other callers submit meanwhile.
        Raises what running them raised (another caller's bad request never fails this one)."""
        if not items:
            return []
        future: Future = Future()
        with self._cond:
            if self._closed:
                raise RuntimeError("this engine was released (its batcher is closed)")
            self._pending.append((list(items), future))
            self._cond.notify()
        return future.result()

    def _queued(self) -> int:
        return sum(len(items) for items, _ in self._pending)

    def _take(self) -> list[tuple[list, Future]]:
        groups: list[tuple[list, Future]] = []
        count = 0
        while self._pending and (not groups or count + len(self._pending[0][0]) <= self.max_batch):
            groups.append(self._pending.pop(0))
            count += len(groups[-1][0])
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
            for _, future in left:
                future.set_exception(RuntimeError(f"this engine's batcher stopped ({type(err).__name__}: {err})"))
            raise

    def _serve(self, groups: list[tuple[list, Future]]) -> None:
        items = [item for group, _ in groups for item in group]
        try:
            with self.lock:
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
                groups[0][1].set_exception(err)
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
        start = 0
        for items_of, future in groups:
            future.set_result(results[start:start + len(items_of)])
            start += len(items_of)

