"""One loaded model per (kind, name, device, dtype) per process.

Several nodes in one process (several cameras, or vision plus the on-demand service) must share
one engine: weights are loaded once, `lock` serializes use of it so concurrent callers never
interleave inside a forward pass, and `batcher` gathers their requests into batches.
"""
from __future__ import annotations

import threading
from typing import Any, Callable


class SharedModel:
    def __init__(self, model: Any) -> None:
        self.model = model
        self.lock = threading.Lock()
        self._batcher = None

    @property
    def batcher(self):
        """A Batcher over the model's `batch` (requests -> results; made on first use)."""
        if self._batcher is None:
            from photon_core.runtime.batcher import Batcher
            with self.lock:
                if self._batcher is None:
                    self._batcher = Batcher(self.model.batch, self.lock)
        return self._batcher


_models: dict[tuple, SharedModel] = {}
_loading = threading.Lock()


def shared_model(key: tuple, load: Callable[[], Any]) -> SharedModel:
    """The process's model for `key`, loading it with `load()` the first time."""
    with _loading:
        if key not in _models:
            _models[key] = SharedModel(load())
        return _models[key]
