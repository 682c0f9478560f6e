"""Compiled steps shared by every part of the proof, and what the parts do to their buffers: fill
caches with history, write a step's inputs, save and restore state, read a launch's control
buffer, locate cache slots, and launch a graph the checker rejects (the positive control)."""
from __future__ import annotations

import contextlib
import copy
import time
from typing import Any, Callable, Iterator

from photon_core.gpu_proof.checks import GPU_SPIN_LIMIT, Ctx
from photon_core.megakernel.graph_family import Rows, dtype_of


class Build:
    """One family's compiled steps at one batch bucket, built once (lowering and checking Moondream 2
    at batch 8 takes tens of seconds of CPU) and shared by every part. Weight dtypes are switched by
    swapping the weights arena: its layout does not depend on the dtype, so `arena.to(bf16)` is what
    CompiledStep(weight_dtype=bf16) would build, without lowering and checking the graph again."""

    def __init__(self, ctx: Ctx, fam, batch: int) -> None:
        self.ctx, self.fam, self.batch = ctx, fam, batch
        self.steps: dict[bool, Any] = {}
        self.kernels: dict[int, dict] = {}
        self.fp32: dict[int, Any] = {}
        self.takes_tokens: dict[int, bool] = {}    # id(step) -> its graph embeds the row's token

    def step(self, advance: bool):
        advance = advance and self.fam.advance
        if advance not in self.steps:
            self.fam.load(self.ctx.dev)
            t = time.time()
            step = self.fam.build(self.batch, advance)
            self.steps[advance] = step
            self.takes_tokens[id(step)] = any(n.op == "embed" for n in step.graph_def.nodes)
            self.fp32[id(step)] = step.weights
            self.kernels[id(step)] = {}
            self.kernel(step)
            print(f"  built {self.fam.name} B{self.batch}{' advance' if advance else ''}: "
                  f"{len(step.graph.tasks)} tasks, {step.kernel.num_programs} programs, "
                  f"{time.time() - t:.1f} s (lower + check + encode)", flush=True)
        return self.steps[advance]

    def kernel(self, step, results: tuple[str, ...] | None = None):
        """The step's kernel (pruned to `results`), reading the step's current weights arena."""
        kernels = self.kernels[id(step)]
        if results not in kernels:
            k = step.kernel_for(results)
            if self.ctx.cuda:
                k.spin_limit = GPU_SPIN_LIMIT
            k.weights = step.weights
            kernels[results] = k
            if self.ctx.warm is not None:
                # Compiled in another process for every weight dtype it will run with, while this
                # one goes on lowering and checking (Triton's disk cache hands it over).
                pruned = "" if results is None else " " + "+".join(results)
                try:
                    self.ctx.warm.submit(k, [dtype_of(d) for d in self.fam.dtypes],
                                         f"{self.fam.name} B{self.batch}{pruned}")
                except Exception as e:  # noqa: BLE001  the pool only saves time: the launch compiles
                    print(f"  no parallel compile for {self.fam.name} B{self.batch}{pruned}: "
                          f"{type(e).__name__}: {e}", flush=True)
        return kernels[results]

    def apply_inputs(self, step, tokens: list[int], positions: list[int]) -> dict:
        """Write one step's tokens, positions and host inputs where the kernel reads them."""
        step.set_step(tokens if self.takes_tokens[id(step)] else None, positions)
        inputs = self.fam.inputs(step.batch, tokens)
        for name, value in inputs.items():
            step.set_input(name, value)
        return inputs

    def use_dtype(self, step, dtype) -> None:
        arena32 = self.fp32[id(step)]
        # A family that keeps its own arenas (GraphFamily: its references read them) shares the dict.
        arenas = self.ctx.arenas.setdefault(id(arena32), getattr(self.fam, "arenas", {}))
        if dtype not in arenas:
            arenas[dtype] = arena32 if dtype == arena32.dtype else arena32.to(dtype)
        step.weights = arenas[dtype]
        for k in self.kernels[id(step)].values():
            k.weights = step.weights


def build(ctx: Ctx, fam, batch: int) -> Build:
    key = (fam.name, batch)
    if key not in ctx.builds:
        ctx.builds[key] = Build(ctx, fam, batch)
    return ctx.builds[key]


def fill(step, rows: Rows, seed: int) -> dict:
    """Random history in every cache of the step: each row's first `position` (self) or `cross_len`
    (cross) entries; NaN past them in the kernel's caches (never read), zeros in the copy returned
    for the references. A ring cache (position p in slot p % length) is full once a row's position
    reaches its length: the same mask. Recurrent states: random, the same in both. Sets the cross
    lengths."""
    import torch
    g = step.graph_def
    dev = step.state.device
    appended = {n.args[k].spec.name for n in g.nodes if n.op == "kv_append" for k in ("k", "v")}
    gen = torch.Generator(device=dev).manual_seed(seed)
    ref = {}
    for name, spec in g.caches.items():
        view = step.view(name)
        lengths = rows.positions if name in appended else rows.cross_len
        valid = torch.arange(spec.length, device=dev)[None, :] < torch.tensor(lengths, device=dev)[:, None]
        valid = valid[:, None, :, None]                      # [B, 1, T, 1] against [(L,) B, H, T, Dh]
        hist = torch.randn(view.shape, generator=gen, device=dev) * 0.5
        view.copy_(hist.masked_fill(~valid, float("nan")))
        ref[name] = hist.masked_fill(~valid, 0.0)
    for name in g.states:
        view = step.view(name)
        view.copy_(torch.randn(view.shape, generator=gen, device=dev) * 0.5)
        ref[name] = view.clone()
    if rows.cross_len is not None:
        step.set_cross_len(rows.cross_len)
    return ref


def adopt_history(step, caches: dict, positions: list[int]) -> None:
    """Make the references' history the megakernel's own (in place in `caches`): each row's valid
    entries of the caches the step appends to (below its position; a ring's every slot once full)
    and the recurrent states. Steps apart, the two histories differ by their rounding, which a
    recurrent state accumulates step after step: a step judged against float64 starts from one."""
    import torch
    g = step.graph_def
    dev = step.state.device
    appended = {n.args[k].spec.name for n in g.nodes if n.op == "kv_append" for k in ("k", "v")}
    for name in appended:
        spec = g.caches[name]
        valid = torch.arange(spec.length, device=dev)[None, :] < torch.tensor(positions, device=dev)[:, None]
        caches[name].copy_(torch.where(valid[:, None, :, None], step.view(name).float(), caches[name]))
    for name in g.states:
        caches[name].copy_(step.view(name))


@contextlib.contextmanager
def preserved(step) -> Iterator[None]:
    """Restore the step's state, dyn and results afterwards (CUDA-graph capture runs the launch a
    few times first, which appends K/V and, in advance mode, steps every row)."""
    saved = [t.clone() for t in (step.state, step.dyn, step.out)]
    try:
        yield
    finally:
        for t, s in zip((step.state, step.dyn, step.out), saved):
            t.copy_(s)


def flags(kernel) -> str | None:
    """What is wrong with the last launch's control buffer (None: nothing): the error flag, and the
    claim counter, which ends where the build says (kernel.claims_at_exit)."""
    claims, err = kernel.ctrl[:2].tolist()     # graph.CTRL_CLAIM, graph.CTRL_ERROR
    want = kernel.claims_at_exit()
    try:
        kernel.raise_on_error()
    except RuntimeError as e:
        return str(e)
    if err or claims != want:
        return f"error flag {err}, claim counter {claims} (expected {want})"
    return None


def offsets(t) -> Any:
    """Storage offsets of every element of a strided view, flattened."""
    import torch
    idx = torch.full((), t.storage_offset(), dtype=torch.long, device=t.device)
    for size, stride in zip(t.shape, t.stride()):
        idx = idx.unsqueeze(-1) + torch.arange(size, device=t.device) * stride
    return idx.reshape(-1)


def cache_of(tensors: Callable[[str], Any], ref) -> Any:
    t = tensors(ref.spec.name)
    return t if ref.layer is None else t[ref.layer]


def appended_refs(graph) -> list:
    return [n.args[k] for n in graph.nodes if n.op == "kv_append" and n.args["append"] for k in ("k", "v")]


def slot(ref, positions):
    """Where a row at `positions` appends in the cache `ref`: a ring holds position p in slot p % length."""
    return positions % ref.spec.length if ref.spec.ring else positions


def copy_graph(g):
    """A copy whose tasks can be edited (waits dropped) without touching `g`."""
    return copy.deepcopy(g)


def unchecked_kernel(like, graph):
    """A Megakernel running `graph` on `like`'s buffers WITHOUT checker.check (the constructor
    always checks; this is test_megakernel_checker's object.__new__ route): the only way to launch
    a graph the checker rejects. Its own control buffer, sized for the graph's counters."""
    import torch

    from photon_core.megakernel.kernel import Megakernel
    mk = object.__new__(Megakernel)
    mk.__dict__.update(vars(like))
    mk.graph = graph
    mk.tasks = graph.encode().to(like.tasks.device)
    mk.ctrl = torch.zeros(graph.ctrl_size(), dtype=torch.int32, device=like.ctrl.device)
    return mk
