"""Where a request's time goes: the phases of one instrumented run, taken by wrapping the functions
(or torch modules) that do each phase's work, with the device synchronized at each boundary.

The wrappers are put in place only for the instrumented run (`Clock.installed()`), never for the
timed repeats, whose whole latency they would perturb. A phase is the outermost hooked call only:
a hooked function that calls another hooked one counts once, as its own phase. What no hook covers
(host work between them, the decode loop, results) is `decode` = whole - the other phases.

Phases (PHASES): decode_image (the JPEG decode, timed by the benchmark itself), preprocess (crops,
resizing and patches; the log-mel of audio), encoder (vision or audio encoder and projection),
prefill (the prompt through the decoder), decode (the rest). Time to first token: when the first
token's logits exist. For a side whose first token comes from the prefill's last logits, the end of
its last prefill call; for one that runs the prompt's last token as its first decode step (the
megakernel paths of Moondream), the end of the first call of its `first_token` hook.
"""
from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

PHASES = ("decode_image", "preprocess", "encoder", "prefill", "decode")

_MISSING = object()

# A hook's phase may depend on the call (one decoder forward is the prefill with a long input, a
# decode step with one token): classify(args, kwargs, nth call) -> phase, or None to not count it.
Classify = Callable[[tuple, dict, int], "str | None"]


@dataclass
class Hook:
    """owner.attr (a module, class or object attribute; or a torch nn.Module when attr is None,
    hooked through its forward hooks) counted as `phase` (or as classify says); first_token: this
    call's first end is when the first token exists."""
    owner: Any
    attr: str | None
    phase: str | None = None
    classify: Classify | None = None
    first_token: bool = False


@dataclass
class Event:
    phase: str
    start: float
    end: float
    first_token: bool = False


@dataclass
class Clock:
    """Hooks for one side of a comparison, and the events of its instrumented run."""
    sync: Callable[[], None]
    hooks: list[Hook] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    _depth: int = 0
    _calls: dict[int, int] = field(default_factory=dict)

    def add(self, owner: Any, attr: str | None, phase: str | None = None, classify: Classify | None = None,
            first_token: bool = False) -> None:
        if phase is None and classify is None and not first_token:
            raise ValueError("a hook needs a phase, a classify function or first_token")
        if phase is not None and phase not in PHASES:
            raise ValueError(f"unknown phase {phase!r}; phases: {PHASES}")
        self.hooks.append(Hook(owner, attr, phase, classify, first_token))

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the benchmark's own code as `name` (the JPEG decode): always recorded, as the
        benchmark calls it outside the model."""
        self.sync()
        t = time.perf_counter()
        try:
            yield
        finally:
            self.sync()
            self.events.append(Event(name, t, time.perf_counter()))

    @contextlib.contextmanager
    def installed(self) -> Iterator["Clock"]:
        """The hooks in place (events recorded), removed on exit whatever happens."""
        undo: list[Callable[[], None]] = []
        self._calls.clear()
        try:
            for i, h in enumerate(self.hooks):
                undo.append(self._install(i, h))
            yield self
        finally:
            for u in reversed(undo):
                u()

    def _install(self, i: int, h: Hook) -> Callable[[], None]:
        """Replace owner.attr by a timed wrapper; the returned function puts the original back."""
        if h.attr is None:
            return self._install_module(i, h)
        own = vars(h.owner).get(h.attr, _MISSING) if hasattr(h.owner, "__dict__") else _MISSING
        if isinstance(own, (staticmethod, classmethod)):
            raise TypeError(f"{h.owner!r}.{h.attr}: static and class methods are not hooked")
        real = getattr(h.owner, h.attr)
        clock = self
        if isinstance(h.owner, type):
            # A method on a class (its own or inherited): the wrapper takes `self` like it.
            def wrapper(obj: Any, *args: Any, **kwargs: Any) -> Any:
                with clock._timing(i, h, args, kwargs):
                    return real(obj, *args, **kwargs)
        else:
            # A module's function or an object's (bound) method.
            def wrapper(*args: Any, **kwargs: Any) -> Any:  # type: ignore[misc]
                with clock._timing(i, h, args, kwargs):
                    return real(*args, **kwargs)
        setattr(h.owner, h.attr, wrapper)

        def undo() -> None:
            if own is _MISSING:
                delattr(h.owner, h.attr)   # found through the class: the lookup finds it there again
            else:
                setattr(h.owner, h.attr, own)
        return undo

    def _install_module(self, i: int, h: Hook) -> Callable[[], None]:
        """A torch module's forward through its pre- and post-forward hooks."""
        starts: list[tuple[float, str | None, bool]] = []

        def pre(module: Any, args: tuple, kwargs: dict) -> None:
            outer = self._depth == 0
            self._depth += 1
            n = self._calls.get(i, 0)
            self._calls[i] = n + 1
            phase = h.classify(args, kwargs, n) if h.classify else h.phase
            if outer:
                self.sync()
            starts.append((time.perf_counter(), phase if outer else None, outer))

        def post(module: Any, args: tuple, kwargs: dict, out: Any) -> None:
            self._depth -= 1
            t, phase, outer = starts.pop()
            if outer:
                self.sync()
                end = time.perf_counter()
                if phase is not None or h.first_token:
                    self.events.append(Event(phase or "", t, end, h.first_token))
        a = h.owner.register_forward_pre_hook(pre, with_kwargs=True)
        b = h.owner.register_forward_hook(post, with_kwargs=True)

        def undo() -> None:
            a.remove()
            b.remove()
        return undo

    @contextlib.contextmanager
    def _timing(self, i: int, h: Hook, args: tuple, kwargs: dict) -> Iterator[None]:
        outer = self._depth == 0
        n = self._calls.get(i, 0)
        self._calls[i] = n + 1
        phase = (h.classify(args, kwargs, n) if h.classify else h.phase) if outer else None
        if outer:
            self.sync()
        t = time.perf_counter()
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
            if outer:
                self.sync()
                if phase is not None or h.first_token:
                    self.events.append(Event(phase or "", t, time.perf_counter(), h.first_token))

    def summary(self, start: float, end: float) -> dict[str, Any]:
        """Seconds per phase (decode: the rest of the whole), the whole, and the time to first
        token (None when nothing marked it)."""
        out = {p: 0.0 for p in PHASES}
        for e in self.events:
            if e.phase:
                out[e.phase] += e.end - e.start
        whole = end - start
        out["decode"] = max(0.0, whole - sum(v for k, v in out.items() if k != "decode"))
        marks = [e.end for e in self.events if e.first_token]
        prefills = [e.end for e in self.events if e.phase == "prefill"]
        first = min(marks) if marks else max(prefills) if prefills else None
        return {"phases": out, "whole": whole, "ttft": None if first is None else first - start}


def no_sync() -> None:
    """The CPU's clock needs no synchronisation."""


def cuda_sync() -> None:
    import torch
    torch.cuda.synchronize()


def by_length(long: str, short: str | None, arg: int = 0, key: str | None = None, dim: int = 1) -> Classify:
    """A decoder call is `long` (the prefill) when its input (positional `arg` or keyword `key`)
    has more than one position along `dim`, else `short` (a decode step; None: not counted)."""
    def classify(args: tuple, kwargs: dict, n: int) -> str | None:
        x = kwargs.get(key) if key is not None and kwargs.get(key) is not None else (
            args[arg] if len(args) > arg else None)
        if x is None:
            for v in kwargs.values():
                if hasattr(v, "shape"):
                    x = v
                    break
        length = x.shape[dim] if hasattr(x, "shape") and x.dim() > dim else 1
        return long if length > 1 else short
    return classify


def first_call(first: str, later: str | None) -> Classify:
    """`first` for the first call of the run, `later` for the others."""
    return lambda args, kwargs, n: first if n == 0 else later
