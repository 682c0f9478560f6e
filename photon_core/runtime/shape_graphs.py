"""An encoder replayed from a CUDA graph per input shape, where that is measured to be faster.

An encoder's call on a fixed input shape (a camera's crops, Whisper's 30 s window, a clip length
that recurs) launches the same few hundred kernels every time. On a GPU each launch costs host
time (Python, the ops contract's dispatch, the driver: several us) that can exceed the kernel's
own, and then the GPU waits on the host. Captured once, a call is one graph launch plus a copy of
its input in and of its output out. Issue 39.2: whether that wins is measured per shape, not
assumed: a shape's first call times its eager call and its replay (runtime/measured.Choices, CUDA
events; a capture that fails, a host synchronisation inside the encoder say, is logged and leaves
the shape eager) and keeps the faster, once its replay of a second input has matched the eager
call's result (a graph never gives a robot features of an earlier frame). Off a GPU, or inside another capture, the encoder runs as
it is.

Memory: the graphs of one encoder share a pool. That is safe because their replays never overlap
(a lock) and each replay's output is cloned before the next one, so a later graph reusing an
earlier one's temporaries clobbers nothing anyone holds. At most `max_shapes` graphs are kept (the
least recently used dropped, its shape measured again if it returns): a robot's cameras and
microphones have few shapes, and a Jetson has little memory to spare.
"""
from __future__ import annotations

import itertools
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any

import torch

from photon_core.runtime.measured import Choices, cuda_seconds

log = logging.getLogger(__name__)

MAX_SHAPES = 4
# a replay runs the eager call's kernels: any difference beyond rounding is a wrong capture
REPLAY_RTOL = 1e-2
# every encoder's eager-or-graph choice per shape, for logs and benchmarks (graph_choices)
GRAPH_CHOICES = Choices()
Output = Any   # a Tensor, or a tuple of Tensors
Capture = Callable[[Callable[[], Output], Any], tuple[Any, Output]]   # (fn, pool) -> (graph, output)
_serial = itertools.count()


def capture_cuda(fn: Callable[[], Output], pool: Any) -> tuple[Any, Output]:
    """fn captured in a CUDA graph drawing on `pool` (one warm-up: the eager call before it
    compiled and measured everything fn launches). Thread-local capture: a request comes while
    other threads of the process (another model, a node's callbacks) keep using the GPU."""
    from photon_core.runtime.cuda_graph import capture
    return capture(fn, warmup=1, pool=pool)


def new_pool() -> Any:
    return torch.cuda.graph_pool_handle()


class ShapeGraphs:
    """fn(*inputs) -> a Tensor or a tuple of them, inputs tensors only (weights and settings closed
    over), called eagerly or replayed from a graph of the inputs' shape, whichever this GPU runs
    faster."""

    def __init__(self, name: str, fn: Callable[..., Output], max_shapes: int = MAX_SHAPES,
                 capture: Capture = capture_cuda, choices: Choices = GRAPH_CHOICES,
                 on_gpu: Callable[[tuple[torch.Tensor, ...]], bool] | None = None,
                 pool: Callable[[], Any] = new_pool) -> None:
        self.name, self.fn, self.max_shapes = name, fn, max_shapes
        self._capture, self._choices, self._new_pool = capture, choices, pool
        self._on_gpu = on_gpu or _capturable
        self._serial = next(_serial)
        self._graphs: OrderedDict[Hashable, tuple[Any, list[torch.Tensor], Output]] = OrderedDict()
        self._pool: Any = None
        self._lock = threading.RLock()

    def __call__(self, *inputs: torch.Tensor) -> Output:
        if not self._on_gpu(inputs):
            return self.fn(*inputs)
        key = (self.name, self._serial, tuple((tuple(t.shape), t.dtype, tuple(t.stride()), str(t.device))
                                              for t in inputs))
        with self._lock:
            new = key not in self._choices.chosen
            out = self._choices.run(key, {"eager": lambda: self.fn(*inputs),
                                          "graph": lambda: self._replay(key, inputs)}, True)
            if new and self._choices.chosen.get(key) == "graph":
                try:
                    right = self._replays_right(key, inputs)
                except BaseException:
                    # unchecked (out of memory while checking, say): never replayed
                    self._choices.overrule(key, "eager")
                    self._graphs.pop(key, None)
                    raise
                if not right:
                    self._choices.overrule(key, "eager")
                    out = self.fn(*inputs)
            if self._choices.chosen.get(key) != "graph":
                self._graphs.pop(key, None)      # measured slower (or its capture failed): memory back
            while len(self._graphs) > self.max_shapes:
                old, _ = self._graphs.popitem(last=False)
                self._choices.forget(old)
            return out

    def shapes(self) -> int:
        """Graphs held now."""
        return len(self._graphs)

    def _replays_right(self, key: tuple, inputs: tuple[torch.Tensor, ...]) -> bool:
        """Whether the graph, on an input other than the one it was captured on (each input
        reversed along its last axis: same shape, same range of values), gives what the eager
        call gives, within REPLAY_RTOL of the result's largest value: a capture that froze a value
        of its first input (a host-side read) would replay that input's result."""
        other = tuple(t.flip(-1) for t in inputs)
        pairs = list(zip(_tensors(self.fn(*other)), _tensors(self._replay(key, other))))
        err = max((got.float() - want.float()).abs().max().item() for want, got in pairs)
        if all((got.float() - want.float()).abs().max().item() <= REPLAY_RTOL * want.float().abs().max().item()
               for want, got in pairs):
            return True
        log.error("%s %s: the graph's replay differs from the eager call by %.3g on a second input; "
                  "this shape stays eager", self.name, key[2], err)
        return False

    def _replay(self, key: Hashable, inputs: tuple[torch.Tensor, ...]) -> Output:
        entry = self._graphs.get(key)
        if entry is None:
            if self._pool is None:
                self._pool = self._new_pool()
            static = [t.clone() for t in inputs]
            try:
                graph, out = self._capture(lambda: self.fn(*static), self._pool)
            except BaseException:
                self._pool = None   # a failed capture may leave routing to its pool: the next takes a new one
                raise
            entry = self._graphs[key] = (graph, static, out)
        self._graphs.move_to_end(key)
        graph, static, out = entry
        for s, t in zip(static, inputs):
            s.copy_(t)
        graph.replay()
        return tuple(t.clone() for t in out) if isinstance(out, tuple) else out.clone()


def _tensors(out: Output) -> tuple[torch.Tensor, ...]:
    return out if isinstance(out, tuple) else (out,)


def _capturable(inputs: tuple[torch.Tensor, ...]) -> bool:
    return bool(inputs) and all(t.is_cuda for t in inputs) and not torch.cuda.is_current_stream_capturing()


def graph_choices() -> dict[Hashable, tuple[str, dict[str, float]]]:
    """Per (encoder, instance, input signature): eager or graph, and each one's measured seconds."""
    with GRAPH_CHOICES._lock:
        return {k: (v, dict(GRAPH_CHOICES.seconds[k])) for k, v in GRAPH_CHOICES.chosen.items()}


__all__ = ["ShapeGraphs", "GRAPH_CHOICES", "MAX_SHAPES", "graph_choices", "cuda_seconds"]
