"""A family's compiled decode steps, one per batch bucket, written once for every family.

A family's decode on the megakernel is a compiled step graph (its decoder_step.py) for each batch
bucket (1, 2, 4, 8) a request or batch lands in. CompiledSteps holds them: each bucket's step is
built on first use and streams the first bucket's weights arena (one copy of the weights however
many buckets run), and is built together with its device rounds (megakernel.decode_loop's
DeviceDecode), before any request writes the step's state: on CUDA building the rounds captures
(so runs) them. A step's arena (caches, activations) holds one request or batch at a time, so a
model decodes under `exclusive()` (a caller on another thread waits its turn, up to
EXCLUSIVE_WAIT_S; the holder's own thread, e.g. a call inside a stream's loop, gets a clear error
at once, as it would wait for itself) or, for a family that
interleaves requests step by step, under `turn()` with each request's state `bind`-ed to the rows
before its step.

A family subclasses it with what is its own: how a bucket's step is built (`build_step`), what
is built with it (`build_loop`), how a row is prefilled and how the heads are read.

Which engine runs a bucket's step (the megakernel, or its graph op by op with torch's kernels:
megakernel/perop_engine.py) is the steps' `engine_policy`, taken when they are made from
`engine_policy(...)` (photon_core.load with backend "auto" makes a model's steps under "auto") or
$PHOTON_DECODE_ENGINE: "megakernel", "perop", or "auto" (on CUDA both measured when a bucket is
built and the faster kept: megakernel/engine_choice.py). Every choice is recorded in
`engine_choices()` for the nodes' /diagnostics.
"""
from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ContextManager, Generic, Protocol, TypeVar

import torch

if TYPE_CHECKING:
    from photon_core.megakernel.compiler import CompiledStep

# Declared here, where they import without Triton (the megakernel package imports its Triton
# kernels); megakernel.graph and megakernel.compiler take them from here.
BATCH_BUCKETS = (1, 2, 4, 8)
WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


ENGINE_POLICIES = ("megakernel", "perop", "auto")
ENGINE_ENV = "PHOTON_DECODE_ENGINE"


class ThreadSetting:
    """A setting that what a thread builds inside `scope(value)` reads (`get()`), `default` outside
    any scope: per thread, because models load and buckets build in the nodes' own threads."""

    def __init__(self, what: str, choices: tuple[str, ...], default: str) -> None:
        self.what, self.choices, self.default = what, choices, default
        self._local = threading.local()

    def get(self) -> str:
        return getattr(self._local, "value", self.default)

    @contextmanager
    def scope(self, value: str) -> Iterator[None]:
        if value not in self.choices:
            raise ValueError(f"{self.what} {value!r}: one of {self.choices}")
        before, self._local.value = self.get(), value
        try:
            yield
        finally:
            self._local.value = before


_policy = ThreadSetting("decode engine", ENGINE_POLICIES, "megakernel")


def engine_policy(policy: str) -> ContextManager[None]:
    """Compiled steps made inside run on `policy`'s engine (ENGINE_POLICIES) unless
    $PHOTON_DECODE_ENGINE names one."""
    return _policy.scope(policy)


def current_engine_policy() -> str:
    env = os.environ.get(ENGINE_ENV, "").strip()
    if env and env not in ENGINE_POLICIES:
        raise ValueError(f"${ENGINE_ENV}={env!r}: one of {ENGINE_POLICIES}")
    return env or _policy.get()


def engine_label(engine: str, variant: str = "plain") -> str:
    """How an engine is named in logs, records and /diagnostics: the engine with its build where
    that is not the plain one ("megakernel wide512+aligned", "perop chained")."""
    return engine if variant == "plain" else f"{engine} {variant}"


@dataclass(frozen=True)
class EngineChoice:
    """Which engine runs one model's step of one bucket, and why: "measured" (each timed as
    CUDA-graph replays, ms a step: the plain megakernel, its streaming build where one was timed,
    the per-op engine), "recorded" (a measurement of an earlier start), "asked" (the policy named
    it) or "fallback" (another engine failed: `note` says how)."""
    model: str
    batch: int
    engine: str
    how: str
    megakernel_ms: float | None = None
    perop_ms: float | None = None
    note: str = ""
    variant: str = "plain"             # the running engine's build (a KernelVariant name, or "chained")
    variant_ms: float | None = None    # the megakernel's streaming build's time, where it was timed
    timed_variant: str = ""            # which build that was
    chained_ms: float | None = None    # the per-op engine's chained build's time, where it was timed

    def line(self) -> str:
        times = ", ".join(f"{k} {v:.3f} ms" for k, v in (("megakernel", self.megakernel_ms),
                                                          (engine_label("megakernel", self.timed_variant),
                                                           self.variant_ms),
                                                          ("per-op", self.perop_ms),
                                                          ("per-op chained", self.chained_ms)) if v is not None)
        return f"{engine_label(self.engine, self.variant)} ({self.how}{': ' + times if times else ''}{'; ' + self.note if self.note else ''})"


_choices: dict[tuple[str, int], EngineChoice] = {}


def record_engine_choice(choice: EngineChoice) -> None:
    _choices[choice.model, choice.batch] = choice


def engine_choices() -> list[EngineChoice]:
    """The latest choice per (model, bucket) in this process."""
    return list(_choices.values())


def engine_diagnostics() -> dict[str, str]:
    """/diagnostics values: one per model and bucket whose step was built in this process, and one
    per GPU where `auto` runs PyTorch because our kernels cannot run there (backends.select)."""
    from photon_core.backends.select import fallbacks
    return {**{f"decode_engine {c.model} B{c.batch}": c.line() for c in engine_choices()},
            **{f"backend {device}": f"reference (PyTorch): {why}" for device, why in fallbacks().items()}}


def bucket_for(rows: int) -> int:
    """The smallest batch bucket holding `rows` (1..8); the rows past `rows` are padding."""
    if rows < 1 or rows > BATCH_BUCKETS[-1]:
        raise ValueError(f"{rows} rows: a compiled step holds 1 to {BATCH_BUCKETS[-1]}; split the batch")
    return next(b for b in BATCH_BUCKETS if rows <= b)


def resolve_weight_dtype(requested: torch.dtype | None, model_dtype: torch.dtype,
                 device: torch.device | str | None = None) -> torch.dtype:
    """What each compiled step streams (the math stays fp32): `requested`, or by default bfloat16
    on CUDA (half the bytes) and the model's dtype elsewhere (device None: always the model's)."""
    if requested is None:
        requested = torch.bfloat16 if device is not None and torch.device(device).type == "cuda" else model_dtype
    if requested not in WEIGHT_DTYPES:
        raise ValueError(f"megakernel weights must be float32, bfloat16 or float16, not {requested}")
    return requested


def decode_length(requested: int | None, context: int, default: int | None = None) -> int:
    """The positions the compiled caches hold: `requested`, or min(context, default) (the caches
    are per bucket and layer, so a model's full context rarely fits). At least 2: a prompt token
    and one decoded after it."""
    n = min(context, default or context) if requested is None else requested
    if not 2 <= n <= context:
        raise ValueError(f"max_len {n} must be in [2, {context}] (the model's context)")
    return n


def require_triton_ops(ops: Any, family: str, loader: str) -> None:
    """The compiled steps need a backend that compiles them (backends.contract.CAPABILITIES); the
    prefill before them runs on its per-op Triton kernels."""
    if not getattr(ops, "COMPILES_STEPS", False):
        raise ValueError(f"the {family} decode megakernel needs a model on the Triton ops "
                         f"({loader}(..., backend=get_backend('megakernel', device)))")


# Where a step keeps its K/V: one layered region (("kcache", "vcache"), views [L, B, H, T, D]) or,
# per layer, layer -> the names of its own [B, H, T, D] caches (layers of different lengths).
KVNames = tuple[str, str] | Callable[[int], tuple[str, str]]


def copy_prefilled_kv(step: "CompiledStep", names: KVNames,
                      kv: Mapping[int, tuple[torch.Tensor, torch.Tensor]] | Sequence[tuple[torch.Tensor, torch.Tensor]],
                      rows: slice, length: int | None = None) -> None:
    """A per-op prefill's keys and values into `rows` of a compiled step's caches, positions
    [0, length) (None: every position the source holds): how a decode continues on the megakernel
    after its prompt ran per op. kv: layer -> (k, v) [rows, H, >= length, D], by layer index or in
    layer order; cast to the step's KV dtype. ValueError when they do not fit."""
    for i, (k, v) in (kv.items() if isinstance(kv, Mapping) else enumerate(kv)):
        if callable(names):
            kn, vn = names(i)
            dk, dv = step.view(kn), step.view(vn)
        else:
            dk, dv = step.view(names[0])[i], step.view(names[1])[i]
        n = k.shape[2] if length is None else length
        if n > k.shape[2] or n > v.shape[2]:
            # sliced to fewer positions, torch would broadcast a 1-position source over all n
            raise ValueError(f"prefilled K/V of layer {i} hold {min(k.shape[2], v.shape[2])} positions; "
                             f"{n} were asked for")
        if n > dk.shape[2] or len(range(*rows.indices(dk.shape[0]))) != k.shape[0]:
            raise ValueError(f"prefilled K/V of {k.shape[0]} rows x {n} positions do not fit rows {rows.start}:"
                             f"{rows.stop} of layer {i}'s cache [{dk.shape[0]} rows, {dk.shape[2]} positions]")
        # NaN stored as 0 (a NaN prefill is refused by its logits anyway): the per-op engine reads
        # every slot under a mask, and NaN left past a later request's keys would survive it
        dk[rows, :, :n] = k[:, :, :n].nan_to_num(0.0, 0.0, 0.0)
        dv[rows, :, :n] = v[:, :, :n].nan_to_num(0.0, 0.0, 0.0)


class Bindable(Protocol):
    """A compiled step that takes a request's decode state into its rows (Qwen 3.5's)."""

    batch: int

    def holds(self, state: Any) -> bool: ...
    def load_state(self, state: Any) -> None: ...
    def release(self, state: Any) -> None: ...


S = TypeVar("S", bound="CompiledStep")


# How long a request waits for another's compiled steps (a long caption on a CPU takes minutes;
# a stream's holder may never finish it).
EXCLUSIVE_WAIT_S = 600.0


class CompiledSteps(Generic[S]):
    """The compiled decode steps of one model by batch bucket, sharing the first one's weights."""

    family = "This model"   # for messages: "<family> on the megakernel decodes ..."
    max_rows = BATCH_BUCKETS[-1]

    def __init__(self, max_len: int, weight_dtype: torch.dtype) -> None:
        self.max_len, self.weight_dtype = max_len, weight_dtype
        self._steps: dict[int, S] = {}
        self._loops: dict[int, Any] = {}
        self._owner: dict[int, weakref.ref] = {}
        self._lock = threading.Lock()
        # The thread that entered exclusive(), as its Thread object: a thread id is reused by the
        # OS once its thread ends, and a new thread with the id was told it held the arenas.
        self._holder: threading.Thread | None = None
        self.engine_policy = current_engine_policy()

    # -- what a family supplies ------------------------------------------------------------------
    def build_step(self, batch: int, weights: torch.Tensor | None) -> S:
        """The compiled step of one bucket; weights: the weights arena to share (None: the first
        bucket's step makes its own)."""
        raise NotImplementedError

    def build_loop(self, step: S) -> Any:
        """What is built with each step, before anything writes its state (default: its greedy
        rounds on the device; None: nothing)."""
        from photon_core.megakernel.decode_loop import DeviceDecode
        return DeviceDecode(step)

    # -- the steps ---------------------------------------------------------------------------------
    def decoder(self, batch: int = 1) -> S:
        """The compiled step of one batch bucket, built on first use (with its loop) on the first
        bucket's weights arena; a failed build keeps no half-built bucket."""
        if batch not in BATCH_BUCKETS:
            raise ValueError(f"batch {batch} is not a bucket {BATCH_BUCKETS}")
        if batch not in self._steps:
            shared = next(iter(self._steps.values())).weights if self._steps else None
            step = self._build_on_engine(batch, shared)
            self._loops[batch] = self.build_loop(step)
            self._steps[batch] = step
        return self._steps[batch]

    def _build_on_engine(self, batch: int, shared: torch.Tensor | None) -> S:
        """build_step on the policy's engine: "auto" builds the step without a megakernel, then lets
        engine_choice pick (a recorded choice, or both measured on CUDA)."""
        if self.engine_policy == "megakernel":
            step = self.build_step(batch, shared)
            record_engine_choice(EngineChoice(self._model_name(step), batch, "megakernel", "asked"))
            return step
        from photon_core.megakernel.compiler import first_engine
        with first_engine("perop"):
            step = self.build_step(batch, shared)
        if self.engine_policy == "auto":
            from photon_core.megakernel.engine_choice import choose
            record_engine_choice(choose(step))
        else:
            record_engine_choice(EngineChoice(self._model_name(step), batch, "perop", "asked"))
        return step

    def _model_name(self, step: Any) -> str:
        graph = getattr(step, "graph_def", None)
        return graph.name if graph is not None else self.family

    def reset(self) -> None:
        """Drop every bucket's step and loop (and which state each held): the next use builds them
        afresh."""
        self._steps.clear()
        self._loops.clear()
        self._owner.clear()

    def loop(self, batch: int) -> Any:
        """What build_loop made for one bucket (its device rounds by default)."""
        self.decoder(batch)
        return self._loops[batch]

    def for_rows(self, rows: int) -> S:
        """The step of the smallest bucket holding `rows`."""
        return self.decoder(bucket_for(rows))

    def fits(self, rows: int, length: int) -> bool:
        return 1 <= rows <= self.max_rows and length <= self.max_len

    def check_fits(self, rows: int, length: int) -> None:
        if rows > self.max_rows:
            raise ValueError(f"{rows} rows exceed the largest megakernel batch ({self.max_rows})")
        if length > self.max_len:
            raise ValueError(f"a request of {length} positions exceeds the megakernel's caches "
                             f"({self.max_len}); load the model with a larger max_len")

    # -- one user at a time --------------------------------------------------------------------
    @contextmanager
    def exclusive(self, wait_s: float | None = None) -> Iterator[None]:
        """Hold the steps' arenas for one request or batch. Another thread's caller meanwhile waits
        for them (up to `wait_s`, EXCLUSIVE_WAIT_S by default: a stream left open holds them), as
        the moondream client queues requests; the thread that entered it raises at once.

        A stream's body runs in whichever thread consumes it, so a stream opened in one thread
        and consumed in another holds the arenas under its opening thread: a call inside its loop
        in the consuming thread cannot be told from another request and waits, and its error
        then names that cause."""
        busy = (f"{self.family} on the megakernel decodes one request or batch at a time (its compiled "
                "steps' arenas)")
        me = threading.current_thread()
        if self._holder is me:   # a Thread object, never another thread's (ended or not)
            raise RuntimeError(f"{busy}, and this thread holds them (a stream still open?): finish or close "
                               "it first")
        wait = EXCLUSIVE_WAIT_S if wait_s is None else wait_s
        if not self._lock.acquire(timeout=wait):
            holder = self._holder
            ended = (" (the thread that opened it has ended)" if holder is not None and not holder.is_alive()
                     else "")
            raise RuntimeError(f"{busy}; another request held them for over {wait:g} s: a stream left "
                               f"open{ended}? If this thread is itself consuming an open stream of this model "
                               "(one opened in another thread), it was waiting for itself: finish or close "
                               "the stream first")
        self._holder = me
        try:
            yield
        finally:
            self._holder = None
            self._lock.release()

    @contextmanager
    def turn(self) -> Iterator[None]:
        """Wait for the arenas (requests interleaving step by step, each bound before its step)."""
        with self._lock:
            yield

    def bind(self, state: Any, rows: int, length: int) -> S:
        """The step of the bucket holding `rows` with `state` (`length` positions) in its rows
        (call inside `turn()`): a state bound there before gets its own copies back first, so
        interleaved requests stay correct; a state already bound costs nothing."""
        self.check_fits(rows, length)
        step: Bindable = self.for_rows(rows)   # type: ignore[assignment]
        if not step.holds(state):
            ref = self._owner.get(step.batch)
            owner = ref() if ref is not None else None
            if owner is not None and owner is not state and step.holds(owner):
                step.release(owner)
            with torch.no_grad():
                step.load_state(state)
            self._owner[step.batch] = weakref.ref(state)
        return step   # type: ignore[return-value]


__all__ = ["BATCH_BUCKETS", "CompiledSteps", "ENGINE_POLICIES", "EngineChoice", "engine_label", "engine_policy", "engine_choices",
           "engine_diagnostics", "current_engine_policy", "record_engine_choice", "KVNames", "bucket_for", "copy_prefilled_kv", "decode_length",
           "require_triton_ops", "resolve_weight_dtype"]
