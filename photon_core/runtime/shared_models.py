"""One loaded model per (checkpoint, device, dtype, backend) per process.

Several nodes in one process (several cameras, or vision plus the on-demand service) must share
one engine: weights are loaded once, `lock` serializes use of it so concurrent callers never
interleave inside a forward pass, and `batcher` gathers their requests into batches.

Every `shared_engine` / `shared_model` call is a hold on the engine; `release(engine)` gives one
back, and when none is left the engine leaves the cache and its memory is freed (a managed node's
cleanup). Callers that never release keep the engine for the life of the process, as before.
"""
from __future__ import annotations

import gc
import sys
import threading
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from pathlib import Path

    from photon_core.registry import Family
    from photon_core.runtime.batcher import Batcher


class SharedModel:
    def __init__(self, model: Any, key: tuple | None = None) -> None:
        self.model = model
        self.key = key
        self.holders = 0     # shared_engine/shared_model calls not yet released
        self.lock = threading.Lock()
        self._batcher: Batcher | None = None
        self._making = threading.Lock()   # the batcher's creation against retire()
        self.family: Family | None = None   # the registry family, when loaded through shared_engine

    @property
    def batcher(self) -> Batcher:
        """A Batcher over the model's `batch` (requests -> results; made on first use)."""
        if self._batcher is None:
            from photon_core.runtime.batcher import Batcher
            with self._making:
                if self.model is None:
                    raise RuntimeError("this engine was released (its batcher is closed)")
                if self._batcher is None:
                    self._batcher = Batcher(self.model.batch, self.lock)
        return self._batcher

    def retire(self) -> None:
        """Let go of the model so its memory can be freed, even while someone still holds this
        object: the batcher serves what is queued, stops its thread and drops the model."""
        with self._making:   # a batcher made meanwhile would keep the model (not the engine's lock:
            self.model = None   # an inference in flight must not hold up a release)
        if self._batcher is not None:
            self._batcher.close()


_models: dict[tuple, SharedModel] = {}
_loading = threading.Lock()       # the cache: held for lookups and changes, never across a load or a retire
_one_load = threading.Lock()      # one load at a time (a load peaks its memory), and a key loads once
_retiring = 0                     # released engines whose memory is not yet given back (under _loading)
_retired = threading.Condition(_loading)


def shared_model(key: tuple, load: Callable[[], Any]) -> SharedModel:
    """The process's model for `key`, loading it with `load()` the first time. Each call is one
    hold on it, given back with release(). A load holds up other loads only: a model already in
    the cache, and a release (another node's cleanup), do not wait for it. A load waits for the
    engines being released to give their memory back (two models at once could not fit)."""
    with _loading:
        engine = _models.get(key)
        if engine is not None:
            engine.holders += 1
            return engine
    with _one_load:
        with _loading:
            engine = _models.get(key)   # loaded by the caller this one waited for
            if engine is not None:
                engine.holders += 1
                return engine
            _retired.wait_for(lambda: _retiring == 0)
        model = load()
        with _loading:
            engine = _models[key] = SharedModel(model, key)
            engine.holders += 1
            return engine


def release(engine: SharedModel) -> bool:
    """Give back one hold on `engine`. When no hold is left it leaves the cache, lets go of its
    model and the memory is returned (garbage collection, and the CUDA caching allocator's
    blocks); True then. A later shared_engine() loads the checkpoint afresh. The engine's last
    batch is served outside the cache's lock: other nodes' shared_engine() calls do not wait for it."""
    global _retiring
    with _loading:
        if engine.holders <= 0:
            raise ValueError("release() of an engine that is not held")
        engine.holders -= 1
        if engine.holders:
            return False
        if engine.key is not None and _models.get(engine.key) is engine:
            del _models[engine.key]
        _retiring += 1
    try:
        engine.retire()
        free_memory()
    finally:
        with _loading:
            _retiring -= 1
            _retired.notify_all()
    return True


def free_memory() -> None:
    """Collect what released engines leave behind (reference cycles inside models are common)
    and, where CUDA is in use, hand the freed blocks back to the driver so other processes and
    nvidia-smi see them."""
    gc.collect()
    torch = sys.modules.get("torch")   # never import torch just to free nothing
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        from photon_core.runtime.cuda_graph import _CAPTURING
        # not while another thread captures (a node's decode rounds while this one releases its
        # engine, in one component container): empty_cache then fails the allocator's assert
        with _CAPTURING:
            torch.cuda.empty_cache()


def cached_engines() -> list[SharedModel]:
    """The engines this process holds now."""
    with _loading:
        return list(_models.values())


def shared_engine(name: str, device: str = "cpu", dtype: Any = None, backend: str = "auto",
                  skills: Iterable[str] = ()) -> SharedModel:
    """The process's engine for the checkpoint `name` resolves to, of whatever family recognises it
    (photon_core.registry), refused before loading if that family lacks one of `skills`. Names of the
    same checkpoint share one engine. One hold per call: release() it when done."""
    from photon_core import registry
    from photon_core.backends.select import get_backend

    get_backend(backend, device)   # an unusable backend is reported before any file is read
    skills = tuple(skills)
    found = registry.recognise(name, skills)   # a model not found: hints at families with `skills`
    registry.require_skills(found.family, skills)
    key = engine_key(found.family, found.checkpoint.path, device, dtype, backend)
    engine = shared_model(key, lambda: found.load(device, dtype, backend))
    engine.family = found.family
    return engine


def engine_key(family: Family, path: Path, device: str, dtype: Any, backend: str) -> tuple:
    """The cache key of an engine, with the device and dtype as the load will use them: written
    as given, dtype auto and "float32" on the CPU (or "cuda" and "cuda:0") loaded the same weights
    twice, each copy the model's whole memory, and cameras on different copies never batched."""
    return (family.name, str(path.resolve()), _device_key(device), _dtype_key(family, device, dtype), backend)


def _device_key(device: str) -> Any:
    """torch.device, with a bare "cuda" as "cuda:0" (the nodes never change the current device;
    asking torch.cuda which one it is would initialise CUDA). One the load will refuse: as given."""
    import torch
    try:
        place = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        return str(device)
    if place.type == "cuda" and place.index is None:
        return torch.device("cuda", 0)
    return torch.device("cpu") if place.type == "cpu" else place


def _dtype_key(family: Family, device: str, dtype: Any) -> Any:
    """The torch dtype the load will use: dtype None resolved as the family resolves it, where
    that is all None means (family.auto_dtype); None kept apart otherwise. torch.float32 and
    "float32" key alike; a dtype the load will refuse keys as given, never as a valid one."""
    from photon_core.weights.tensor_files import parse_dtype
    if dtype is None:
        if family.auto_dtype is None:
            return None
        dtype = family.auto_dtype(device)
    try:
        return parse_dtype(dtype)
    except (ValueError, TypeError):
        return str(dtype)
