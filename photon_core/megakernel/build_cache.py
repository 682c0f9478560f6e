"""Built task graphs kept on disk, so a node's second start lowers, checks and encodes nothing.

CompiledStep.kernel_for asks here before it builds: on a hit it takes the stored graph and table
(checker.check proved that graph when it was built, and the table is the bytes TaskGraph.encode
gave then); on a miss it builds, proves and stores. Building Moondream 2's batch-8 step takes
tens of seconds of host CPU (bench/RESULTS.md, "Start"), at every start and for every bucket.

Where: $PHOTON_CACHE_DIR/megakernel if set; else beside Triton's own kernel cache when
TRITON_CACHE_DIR names it (<its parent>/photon/megakernel: one volume to keep on a robot); else
${XDG_CACHE_HOME:-~/.cache}/photon/megakernel. PHOTON_BUILD_CACHE=0 turns the cache off (the test
suite does, test/conftest.py). Entries are never pruned: a new key writes a new file; delete the
folder to reclaim the space.

The key is everything the table is a function of:
- the step graph, canonically (graph_fingerprint): op by op, the values each reads, names and
  shapes of the weights in arena order, caches, states, results, exposed values, and every
  constant the tasks carry (epsilons, scales, windows: floats by their exact bits);
- the batch bucket, the tiling, the weights' and KV caches' dtypes, the results a pruned kernel
  computes;
- the code: a hash of the sources of this package, of kernels/linear.py (whose activation codes
  lowering writes into the table) and of kernels/triton_versions.py (the tuning the kernel is built
  with, its expert steps among it: an engine choice recorded beside the entry timed that build), so
  an edited lowering or tuning never reads a stale table or choice;
- Triton's and torch's versions and the device (a GPU by name and compute capability, or the
  CPU's interpreter), which the table does not depend on today but a kernel built for another
  one has no business reading it.
Checkpoint VALUES are not in the key because they never reach the table: lower() is given the
plan alone (offsets from the weights' shapes, constants from the graph); CompiledStep copies the
values into the arena after. So keying costs no pass over the weights (test_megakernel_build_cache
builds with other values and gets the same table). Steps reading tables in place
(CompiledStep(read_in_place=...)) hold those tensors' addresses in their table and are not cached.

Writes are atomic (a temporary file in the folder, then os.replace): a reader sees a whole entry or
none. A corrupt or unreadable entry (graph_file.EntryError: a digest covers every byte) is rebuilt
with a logged warning; a cache that cannot be written costs only the cache, with a warning.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import os
import sys
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from photon_core.megakernel import graph_file
from photon_core.megakernel.graph import TaskGraph
from photon_core.megakernel.stepgraph import StepGraph, Value

log = logging.getLogger(__name__)

PACKAGE = Path(__file__).resolve().parent
# What lowering runs besides this package: the activation codes it writes into tasks; the
# per-Triton tuning the kernel is built with (its expert steps among it); the helpers the kernel
# shares with the per-op engine's chained kernels (attention, FP8, conv, delta rule, routing); and
# those chained kernels: what an engine choice recorded beside an entry was measured on.
EXTRA_SOURCES = tuple(PACKAGE.parent / "kernels" / f for f in ("linear.py", "triton_versions.py", "chained.py", "fp8.py",
                                                                 "attention.py", "conv.py", "delta_rule.py", "moe.py"))


def cache_dir() -> Path | None:
    """The folder of the entries (see the module's docstring), or None when the cache is off."""
    if os.environ.get("PHOTON_BUILD_CACHE", "1") == "0":
        return None
    if os.environ.get("PHOTON_CACHE_DIR"):
        return Path(os.environ["PHOTON_CACHE_DIR"]) / "megakernel"
    if os.environ.get("TRITON_CACHE_DIR"):
        return Path(os.environ["TRITON_CACHE_DIR"]).resolve().parent / "photon" / "megakernel"
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "photon" / "megakernel"


@functools.lru_cache(maxsize=1)
def code_version() -> str:
    """Hash of the sources the build runs (empty when they are not there to read: no cache then)."""
    files = sorted(PACKAGE.rglob("*.py")) + [p for p in EXTRA_SOURCES if p.is_file()]
    if not files:
        return ""
    h = hashlib.sha256()
    for p in files:
        h.update(str(p.relative_to(PACKAGE.parent)).encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()


def graph_fingerprint(graph: StepGraph) -> str:
    """Hash of the step graph as lowering sees it. TypeError for an argument of a type it does not
    know how to state exactly (then the step is not cached, rather than keyed loosely)."""
    producer = {id(n.out): i for i, n in enumerate(graph.nodes) if n.out is not None}

    def canon(x: Any) -> Any:
        if x is None or isinstance(x, (bool, int, str)):
            return x
        if isinstance(x, float):
            return ["float", x.hex()]
        if isinstance(x, Value):
            # lowering finds a value's readers by identity (StepGraph.consumers): say which
            # node's output this object is (-1: none)
            return ["Value", x.name, x.width, producer.get(id(x), -1)]
        if isinstance(x, (tuple, list)):
            return [type(x).__name__, [canon(v) for v in x]]
        if dataclasses.is_dataclass(x) and not isinstance(x, type):
            return [type(x).__qualname__] + [[f.name, canon(getattr(x, f.name))] for f in dataclasses.fields(x)]
        raise TypeError(f"{graph.name}: cannot state {type(x).__name__} {x!r} exactly in a build-cache key")

    doc = [graph.name, [[k, list(s)] for k, s in graph.weight_shapes.items()],
           [[n.op, canon(n.out), [[k, canon(v)] for k, v in n.args.items()]] for n in graph.nodes],
           [[k, canon(c)] for k, c in graph.caches.items()], [[k, canon(s)] for k, s in graph.states.items()],
           list(graph.results), [[k, canon(v)] for k, v in graph.exposed.items()]]
    return hashlib.sha256(json.dumps(doc).encode()).hexdigest()


def device_tag(device: torch.device) -> str:
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        major, minor = torch.cuda.get_device_capability(index)
        return f"cuda {torch.cuda.get_device_name(index)} sm_{major}{minor}"
    return "cpu (interpreter)" if device.type == "cpu" else device.type


def _triton_version() -> str:
    try:
        import triton
    except ImportError:
        return "none"
    return str(triton.__version__)


_unkeyable: set[str] = set()


def entry_key(graph: StepGraph, batch: int, tiling: Any, weight_dtype: torch.dtype, kv_dtype: torch.dtype,
              results: Iterable[str] | None, device: torch.device) -> str | None:
    """The key of one kernel's entry, or None when the cache is off or the step cannot be keyed."""
    if cache_dir() is None or not code_version():
        return None
    try:
        fingerprint = graph_fingerprint(graph)
    except TypeError as e:
        if graph.name not in _unkeyable:
            _unkeyable.add(graph.name)
            log.warning("megakernel build cache: %s; building it at every start", e)
        return None
    parts = dict(format=graph_file.FORMAT, code=code_version(), graph=fingerprint, model=graph.name, batch=batch,
                 tiling=repr(tiling), weight_dtype=str(weight_dtype), kv_dtype=str(kv_dtype),
                 results=None if results is None else sorted(results), triton=_triton_version(),
                 torch=torch.__version__, python=f"{sys.version_info.major}.{sys.version_info.minor}",
                 device=device_tag(device))
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def _path(key: str) -> Path | None:
    folder = cache_dir()
    return None if folder is None else folder / f"{key}.safetensors"


def load(key: str) -> tuple[TaskGraph, torch.Tensor] | None:
    """The graph and table stored under `key`, or None (not there, or not usable: warned)."""
    path = _path(key)
    if path is None:
        return None
    try:
        if not path.is_file():   # inside: a folder this process may not open raises, a miss all the same
            return None
        graph, table, header = graph_file.read(path)
        if header.get("key") != key:
            raise graph_file.EntryError(f"it holds the entry of key {header.get('key')!r}")
    except Exception as e:  # noqa: BLE001  whatever is wrong with the file, a build replaces it
        log.warning("megakernel build cache: ignoring %s (%s: %s); building the step again",
                    path, type(e).__name__, e)
        return None
    return graph, table


def store(key: str, graph: TaskGraph, table: torch.Tensor) -> None:
    """Keep a proven graph and its table under `key` (atomically); a failure is only warned of."""
    path = _path(key)
    if path is None:
        return
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".safetensors")
        os.close(fd)
        tmp = Path(name)
        graph_file.write(tmp, graph, table, {"key": key})
        os.replace(tmp, path)
        tmp = None
    except Exception as e:  # noqa: BLE001  the step is built: a cache that cannot keep it costs the next start only
        log.warning("megakernel build cache: could not write %s (%s: %s)", path, type(e).__name__, e)
    finally:
        if tmp is not None:
            tmp.unlink(missing_ok=True)
