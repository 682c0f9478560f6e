"""Gathering concurrent image encodes into one batch.

Several camera streams served by one engine each ask for their newest frame to be encoded. Run
one after another, N cameras cost N vision passes; gathered, they cost one pass of N images
(the encoder and the prefill see a bigger batch, which is what GPUs and BLAS are fast at).
A request waits at most `window_s` for company, and a batch holds at most `max_batch` images.
"""
from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import Any, Callable


class EncodeBatcher:
    def __init__(self, encode_many: Callable[[list], list], lock: threading.Lock, max_batch: int = 8,
                 window_s: float = 0.005) -> None:
        self.encode_many = encode_many
        self.lock = lock                  # the engine's lock: a batch runs while no skill does
        self.max_batch = max_batch
        self.window_s = window_s
        self._pending: list[tuple[Any, Future]] = []
        self._cond = threading.Condition()
        self.batches = 0                  # how many passes ran, and their sizes (diagnostics, tests)
        self.sizes: list[int] = []
        threading.Thread(target=self._run, daemon=True, name="encode-batcher").start()

    def encode(self, image: Any) -> Any:
        """The encoding of `image`, computed in a batch with whatever else arrives meanwhile."""
        future: Future = Future()
        with self._cond:
            self._pending.append((image, future))
            self._cond.notify()
        return future.result()

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._pending)
                # Give other cameras a moment to join, unless the batch is already full.
                self._cond.wait_for(lambda: len(self._pending) >= self.max_batch, self.window_s)
                batch, self._pending = self._pending[:self.max_batch], self._pending[self.max_batch:]
            try:
                with self.lock:
                    results = self.encode_many([image for image, _ in batch])
            except Exception as err:  # noqa: BLE001 - each caller gets the error
                for _, future in batch:
                    future.set_exception(err)
                continue
            self.batches += 1
            self.sizes.append(len(batch))
            for (_, future), result in zip(batch, results):
                future.set_result(result)
