"""Parts "stress", "poison" and "control": races and stale reads.

Stress: fixed inputs, many launches at 1, 3, #SMs and 2 x #SMs programs while another CUDA stream
copies 512 MB buffers; every launch's outputs bit-identical to the first, every other launch after
a NaN-fill of the scratch (a read that overtakes its producer then shows). Poison: the scratch
NaN-filled before every launch: no value left unwritten, outputs unchanged. Control: one dependency
wait dropped on purpose: the checker must reject the graph and the stress, launched past the
checker, must see outputs differ (else the stress is too weak); the task moved before its producer
is the forced worst case, which must show even under the interpreter."""
from __future__ import annotations

import time
from dataclasses import dataclass

from photon_core.gpu_proof.build import (Build, appended_refs, build, cache_of, copy_graph, fill, flags, offsets,
                                         slot, unchecked_kernel)
from photon_core.gpu_proof.checks import Ctx, argmax_ok, judge_profile, launch_plan, rel_err, timer, tolerance
from photon_core.gpu_proof.float64 import widened
from photon_core.gpu_proof.profile import profile_launch
from photon_core.megakernel.graph_family import dtype_of


class Noise:
    """A memory-heavy kernel on another CUDA stream: 512 MB device copies, enqueued beside every
    stress launch (about as long as the launch), so the megakernel runs against HBM and L2 traffic
    and SMs taken by someone else. Nothing on the CPU."""

    def __init__(self, ctx: Ctx, mb: int = 512, active: bool = True) -> None:
        self.stream = None
        self.per_launch = 1
        self.gbps = None
        if not ctx.cuda or not active:
            return
        import torch
        n = mb << 20
        self.src = torch.randint(0, 255, (n,), dtype=torch.uint8, device=ctx.dev)
        self.dst = torch.empty_like(self.src)
        self.stream = torch.cuda.Stream()
        self.copy_s = timer(lambda: self.dst.copy_(self.src), 10, 3, True)
        self.gbps = 2 * n / self.copy_s / 1e9

    def pace(self, launch_s: float) -> None:
        self.per_launch = max(1, round(launch_s / self.copy_s)) if self.stream is not None else 0

    def feed(self) -> None:
        if self.stream is None:
            return
        import torch
        with torch.cuda.stream(self.stream):
            for _ in range(self.per_launch):
                self.dst.copy_(self.src)

    def drain(self) -> None:
        if self.stream is not None:
            self.stream.synchronize()


class Probe:
    """Fixed inputs on one compiled step, and what every launch must reproduce bit for bit.

    Scratch: every state element outside the caches and host inputs. A launch after a NaN-fill of
    the scratch shows which elements no task writes: those the step leaves unwritten by design
    (`sparse_scratch`: unused split-K slots, MoE slabs of rows not choosing the pair's expert) are
    dropped from the scratch (the finite outputs show they are not read); any other is an unwritten
    value (a poison failure). The fingerprint of a launch
    is the scratch, the cache slots it appends to, the recurrent states, the results and dyn, as raw
    bits. Recurrent states are put back before every launch (`reset`): a step updates them, so
    fixed inputs include them."""

    def __init__(self, ctx: Ctx, fam, b: Build, dtype) -> None:
        import torch

        from photon_core.megakernel.eager import run_reference
        self.fam, self.batch = fam, b.batch
        self.step = step = b.step(advance=False)
        self.kernel = b.kernel(step)
        b.use_dtype(step, dtype)
        self.rows = rows = fam.rows(b.batch, "fixed")
        caches = fill(step, rows, seed=10 + b.batch)
        inputs = b.apply_inputs(step, rows.tokens, rows.positions)
        g = step.graph_def
        keep = set(g.caches) | set(g.states) | {n.value.name for n in g.nodes if n.op == "input"}
        self.saved_states = [(step.view(k), step.view(k).clone()) for k in g.states]
        regions = [(k, off, n) for k, (off, n) in step.sarena.regions.items() if k not in keep]
        dev = step.state.device
        cand = torch.cat([torch.arange(off, off + n, device=dev) for _, off, n in regions])
        step.state.index_fill_(0, cand, float("nan"))
        self.reset()
        self.kernel.launch()
        ctx.sync()
        left = torch.isnan(step.state[cand])
        self.unused, self.unwritten = 0, {}
        sparse = step.sparse_scratch()
        at = 0
        for k, _, n in regions:
            cnt = int(left[at:at + n].sum())
            if cnt and k in sparse:
                self.unused += cnt
            elif cnt:
                self.unwritten[k] = cnt
            at += n
        self.scratch = cand[~left]
        slots = [offsets(cache_of(step.view, ref)[r, :, slot(ref, p)]) for ref in appended_refs(g)
                 for r, p in enumerate(rows.positions)]
        slots += [offsets(view) for view, _ in self.saved_states]
        self.idx = torch.cat([self.scratch] + slots)
        self.reset()
        self.kernel.launch()
        ctx.sync()
        self.launch_flags = flags(self.kernel)
        self.first = self.fingerprint().clone()
        self.first_nan = bool(torch.isnan(step.state[self.scratch]).any())
        # The fixed-input launch judged like a step (checks.judge_profile): against the float64
        # reference by its per-layer profile, then against the fp32 one within the noise it showed.
        caches64 = widened(caches)
        weights = fam.ref_weights(dtype)
        want = run_reference(g, weights, caches, rows.tokens, rows.positions, rows.cross_len, inputs)
        self.profile = profile_launch(step, weights, caches64, want, caches, rows.tokens, rows.positions,
                                      rows.cross_len, inputs)
        del caches64
        self.verdict = judge_profile(self.profile)
        self.tol = tolerance([self.profile])
        self.ref_err = max(rel_err(step.view(name), want[v.name]) for name, v in g.exposed.items())
        self.finite_ok = all(torch.equal(torch.isfinite(step.view(name)), torch.isfinite(want[v.name]))
                             for name, v in g.exposed.items())
        picks = [argmax_ok(step.result(a["name"]).tolist(), want[a["x"].name][:, a["c0"]:a["c1"]], self.tol)
                 for n in g.nodes if n.op == "argmax" for a in (n.args,)]
        self.picks_ok = sum(e + t for e, t in picks) == len(picks) * b.batch
        self.launch_s = measure_launch(ctx, self.kernel) if ctx.cuda else 0.0

    def fingerprint(self):
        import torch
        s = self.step
        return torch.cat([s.state[self.idx].view(torch.int32), s.out, s.dyn])

    def reset(self) -> None:
        for view, saved in self.saved_states:
            view.copy_(saved)

    def poison(self) -> None:
        self.step.state.index_fill_(0, self.scratch, float("nan"))

    def describe(self) -> str:
        launch = f", launch {self.launch_s * 1e3:.2f} ms at {self.kernel.num_programs} programs" if self.launch_s else ""
        return (f"{self.fam.name} B{self.batch}: {len(self.kernel.graph.tasks)} tasks, fingerprint "
                f"{self.idx.numel()} state elements{launch}")


def measure_launch(ctx: Ctx, kernel, programs: int | None = None, n: int = 3) -> float:
    """Seconds per plain launch (for sizing the stress and the noise beside it)."""
    saved = kernel.num_programs
    kernel.num_programs = programs or saved
    kernel.launch()
    ctx.sync()
    t = time.perf_counter()
    for _ in range(n):
        kernel.launch()
    ctx.sync()
    kernel.num_programs = saved
    return (time.perf_counter() - t) / n


def probe(ctx: Ctx, fam, batch: int) -> Probe:
    key = (fam.name, batch)
    if key not in ctx.probes:
        p = Probe(ctx, fam, build(ctx, fam, batch), dtype_of(fam.stress_dtype))
        print(f"  probe {p.describe()}", flush=True)
        ctx.checks.expect(p.launch_flags is None, f"probe {fam.name} B{batch}: {p.launch_flags}")
        ctx.checks.expect(p.verdict is None and p.ref_err <= p.tol and p.picks_ok and p.finite_ok,
                          f"probe {fam.name} B{batch}: fixed-input launch: float64 profile "
                          f"{p.verdict or 'passes'}; vs run_reference err {p.ref_err:.1e} (tolerance "
                          f"{p.tol:.1e}), argmax ok {p.picks_ok}, finite pattern ok {p.finite_ok}")
        ctx.probes[key] = p
    return ctx.probes[key]


@dataclass
class Stress:
    programs: int
    launches: int
    differing: int
    first_diff: int
    error_flag: int
    bad_claims: int
    seconds: float
    capped: bool = False


def stress(ctx: Ctx, p: Probe, kernel, programs: int, launches: int, poison_every: int,
           stop_on_diff: bool = False, sized: bool = False) -> Stress:
    """`launches` launches of `kernel` (the probe's, or a mutated one on the same buffers) with
    `programs` programs, the noise stream busy beside them; after every `poison_every`-th launch
    the next one starts from NaN-filled scratch. Counted on the device, synchronised at the end (and
    every 25 launches with stop_on_diff). `sized`: `launches` is the target, cut to the time cap
    by the first launch's time (checks.launch_plan, as the time plan predicts it)."""
    import torch
    dev = p.step.state.device
    saved = kernel.num_programs
    kernel.num_programs = programs
    expected = kernel.claims_at_exit(programs)
    diff = torch.zeros((), dtype=torch.int32, device=dev)
    first = torch.full((), -1, dtype=torch.int64, device=dev)
    err = torch.zeros((), dtype=torch.int32, device=dev)
    claims = torch.zeros((), dtype=torch.int32, device=dev)
    if ctx.cuda:
        # Until the first launch is timed: the probe's launch, spread over fewer programs.
        ctx.noise.pace(p.launch_s * max(1.0, ctx.sms / programs))
    t = time.time()
    done, capped = 0, False
    try:
        while done < launches:
            i = done
            if poison_every and i % poison_every == poison_every - 1:
                p.poison()
            ctx.noise.feed()
            p.reset()
            kernel.launch()
            d = (p.fingerprint() != p.first).any()
            diff += d
            first = torch.where(d & (first < 0), torch.full_like(first, i), first)
            err = torch.maximum(err, kernel.ctrl[1])
            claims += kernel.ctrl[0] != expected
            done += 1
            if sized and done == 1:
                ctx.sync()
                one = time.time() - t
                launches, capped = launch_plan(one, programs, ctx.sms, ctx.sizes)
                if ctx.cuda:
                    ctx.noise.pace(one)
            if stop_on_diff and done % 25 == 0 and int(diff) > 0:
                break
        ctx.sync()
        ctx.noise.drain()
    finally:
        kernel.num_programs = saved
    return Stress(programs, done, int(diff), int(first), int(err), int(claims), round(time.time() - t, 2), capped)


def prove_stress(ctx: Ctx, fam, batch: int) -> dict:
    p = probe(ctx, fam, batch)
    runs = []
    for programs in ctx.programs():
        r = stress(ctx, p, p.kernel, programs, ctx.sizes.launches, poison_every=2, sized=True)
        runs.append(r.__dict__)
        ok = r.differing == 0 and r.error_flag == 0 and r.bad_claims == 0
        ctx.checks.expect(ok, f"stress {fam.name} B{batch} {programs} programs: {r}")
        print(f"  {fam.name:22s} B{batch} {fam.stress_dtype} {programs:4d} programs: {r.launches} launches"
              f"{' (time cap)' if r.capped else ''}, {r.differing} differ, error flag {r.error_flag}, "
              f"bad claim counts {r.bad_claims}, {r.seconds} s", flush=True)
    return dict(family=fam.name, batch=batch, dtype=fam.stress_dtype, tasks=len(p.kernel.graph.tasks),
                fingerprint=p.idx.numel(), launch_ms=round(p.launch_s * 1e3, 3), runs=runs,
                noise_copy_gbps=ctx.noise.gbps, probe_float64=p.profile.summary(), probe_tolerance=p.tol)


def prove_poison(ctx: Ctx, fam, batch: int) -> dict:
    import torch
    p = probe(ctx, fam, batch)
    programs = ctx.programs()[-1]
    r = stress(ctx, p, p.kernel, programs, ctx.sizes.poison_launches, poison_every=1)
    nan_left = bool(torch.isnan(p.step.state[p.scratch]).any())
    ok = (not p.unwritten and not p.first_nan and p.finite_ok and not nan_left and r.differing == 0
          and r.error_flag == 0 and r.bad_claims == 0)
    ctx.checks.expect(ok, f"poison {fam.name} B{batch}: unwritten {p.unwritten}, NaN in the first launch "
                          f"{p.first_nan}, finite pattern ok {p.finite_ok}, NaN after {nan_left}, {r}")
    print(f"  {fam.name:22s} B{batch} {programs} programs: {r.launches} poisoned launches, {r.differing} differ, "
          f"unwritten values {p.unwritten or 'none'}, unused slots by design {p.unused}, {r.seconds} s", flush=True)
    return dict(family=fam.name, batch=batch, dtype=fam.stress_dtype, programs=programs, run=r.__dict__,
                unwritten=p.unwritten, unused_split_slots=p.unused, first_has_nan=p.first_nan,
                probe_float64=p.profile.summary(), probe_tolerance=p.tol)


def victim(graph) -> int:
    """The first task that waits on an attention (its partials, the last of each (row, head) merging):
    a linear tile claimed right behind the merges it reads, so without its wait it overtakes them
    whenever programs run side by side."""
    from photon_core.megakernel.ops import OP_ATTN_PARTIAL
    merges = {t.signal for t in graph.tasks if t.op == OP_ATTN_PARTIAL}
    return next(i for i, t in enumerate(graph.tasks) if any(c in merges for c, _ in t.waits))


def prove_control(ctx: Ctx, fam, batch: int) -> dict:
    from photon_core.megakernel.checker import GraphError, check
    p = probe(ctx, fam, batch)
    g = copy_graph(p.kernel.graph)
    i = victim(g)
    dropped = g.tasks[i].waits
    g.tasks[i].waits = []
    try:
        check(g)
        rejected = None
    except GraphError as e:
        rejected = str(e)
    ctx.checks.expect(rejected is not None and "race" in rejected,
                      f"control {fam.name} B{batch}: the checker accepted task {i} {g.tasks[i].name!r} without "
                      f"its waits {dropped} ({rejected})")
    print(f"  dropped the waits {dropped} of task {i} {g.tasks[i].name!r}; checker: {rejected}", flush=True)
    # In place: only programs running side by side can overtake the producer.
    bad = unchecked_kernel(p.kernel, g)
    runs = []
    for programs in ((ctx.sms, 2 * ctx.sms) if ctx.cuda else ctx.programs()):
        r = stress(ctx, p, bad, programs, ctx.sizes.control_launches, poison_every=2, stop_on_diff=True)
        runs.append(r.__dict__)
        print(f"  in place, {programs} programs: {r.differing} of {r.launches} launches differ"
              f"{f' (first at launch {r.first_diff})' if r.differing else ''}", flush=True)
    caught = any(r["differing"] for r in runs)
    if ctx.cuda:
        ctx.checks.expect(caught, f"control {fam.name} B{batch}: the race stress did not catch a dropped wait "
                                  f"in {[r['launches'] for r in runs]} launches: the stress is too weak")
    else:
        print("  (the interpreter runs programs one after another: a dropped wait cannot race there, so no "
              "difference is expected in place; on a GPU the proof requires one)", flush=True)
    # Forced: the same task moved in front of its producers, the worst interleaving made certain.
    forced = copy_graph(g)
    first_producer = min(j for j, t in enumerate(forced.tasks) if t.signal in {c for c, _ in dropped})
    forced.tasks.insert(first_producer, forced.tasks.pop(i))
    fk = unchecked_kernel(p.kernel, forced)
    r = stress(ctx, p, fk, ctx.programs()[-1] if ctx.cuda else 1, min(4, ctx.sizes.control_launches), poison_every=2)
    ctx.checks.expect(r.differing > 0, f"control {fam.name} B{batch}: a task moved before its producer went "
                                       f"unnoticed by the stress ({r}): the fingerprint or the poisoning is blind")
    print(f"  forced (task moved before its producer): {r.differing} of {r.launches} launches differ", flush=True)
    # The correct kernel on the same buffers afterwards: back to the first launch's bits.
    after = stress(ctx, p, p.kernel, ctx.programs()[-1], 2, poison_every=1)
    ctx.checks.expect(after.differing == 0, f"control {fam.name} B{batch}: the correct kernel after the control "
                                            f"differs from the first launch ({after})")
    return dict(family=fam.name, batch=batch, task=i, name=g.tasks[i].name, dropped=dropped,
                checker=rejected, in_place=runs, in_place_caught=caught, forced=r.__dict__,
                race_can_show=ctx.cuda)
