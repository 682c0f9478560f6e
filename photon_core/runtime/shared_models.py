"""One loaded model per (checkpoint, device, dtype, backend) per process.

Several nodes in one process (several cameras, or vision plus the on-demand service) must share
one engine: weights are loaded once, `lock` serializes use of it so concurrent callers never
interleave inside a forward pass, and `batcher` gathers their requests into batches.
"""
from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any, Callable


class SharedModel:
    def __init__(self, model: Any) -> None:
        self.model = model
        self.lock = threading.Lock()
        self._batcher = None
        self.family = None   # the registry family, when loaded through shared_engine

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


def shared_engine(name: str, device: str = "cpu", dtype: Any = None, backend: str = "auto",
                  skills: Iterable[str] = ()) -> SharedModel:
    """The process's engine for the checkpoint `name` resolves to, of whatever family recognises it
    (photon_core.registry), refused before loading if that family lacks one of `skills`. Names of the
    same checkpoint share one engine."""
    from photon_core import registry
    from photon_core.backends.select import get_backend

    get_backend(backend, device)   # an unusable backend is reported before any file is read
    found = registry.recognise(name)
    registry.require_skills(found.family, skills)
    key = (found.family.name, str(found.checkpoint.path.resolve()), device, str(dtype), backend)
    engine = shared_model(key, lambda: found.family.load(found.checkpoint, device, dtype, backend))
    engine.family = found.family
    return engine
