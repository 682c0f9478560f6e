"""One loaded model per (kind, name, device, dtype) per process.

Several nodes in one process (several cameras, or vision plus the on-demand service) must share
one engine: weights are loaded once, and `lock` serializes use of it so concurrent callers never
interleave inside a forward pass.
"""
from __future__ import annotations

import threading
from typing import Any, Callable


class SharedModel:
    def __init__(self, model: Any) -> None:
        self.model = model
        self.lock = threading.Lock()


_models: dict[tuple, SharedModel] = {}
_loading = threading.Lock()


def shared_model(key: tuple, load: Callable[[], Any]) -> SharedModel:
    """The process's model for `key`, loading it with `load()` the first time."""
    with _loading:
        if key not in _models:
            _models[key] = SharedModel(load())
        return _models[key]
