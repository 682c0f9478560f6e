"""Part "steps": consecutive decode steps, each a CUDA-graph replay, against eager.run_reference
on the same graph and the family's own reference_step: exposed values, argmax picks, the K/V just
appended (its slot in a ring), recurrent states and, where the step advances itself, the next
tokens and positions it wrote. The first and the last full step are also judged against the
float64 reference by their per-layer error profile, which sets the tolerance of the others
(checks.judge_profile, checks.tolerance)."""
from __future__ import annotations

import time

from photon_core.gpu_proof import checks
from photon_core.gpu_proof.build import adopt_history, appended_refs, build, cache_of, fill, flags, preserved, slot
from photon_core.gpu_proof.checks import (FP32_NOTE, Ctx, Profile, argmax_ok, graphed, judge_profile, rel_err,
                                          tolerance)
from photon_core.gpu_proof.float64 import widened
from photon_core.gpu_proof.profile import float64_steps, profile_launch
from photon_core.megakernel.graph_family import dtype_of


def compare(step, want: dict, own: dict, positions: list[int], results: list[str], caches: dict,
            tol: float) -> dict:
    """Errors of one step: exposed values vs run_reference and the family's reference, argmax picks
    (a differing one must be a near-tie within `tol`), the K/V just appended at each row's position
    (its slot in a ring) and the recurrent states."""
    import torch
    g = step.graph_def
    err = {"values": 0.0, "own": 0.0, "kv": 0.0}
    for name, value in g.exposed.items():
        err["values"] = max(err["values"], rel_err(step.view(name), want[value.name]))
    for name, t in own.items():
        err["own"] = max(err["own"], rel_err(step.view(name), t))
    rows = torch.arange(step.batch, device=step.state.device)
    at = torch.tensor(positions, device=step.state.device)
    for ref in appended_refs(g):
        # [B, H, Dh]: each row's entry at its own position (one comparison per cache, not per row).
        at_ = slot(ref, at)
        got, exp = cache_of(step.view, ref)[rows, :, at_], cache_of(caches.__getitem__, ref)[rows, :, at_]
        err["kv"] = max(err["kv"], rel_err(got, exp))
    for name in g.states:
        err["kv"] = max(err["kv"], rel_err(step.view(name), caches[name]))
    exact = tolerated = total = 0
    for node in g.nodes:
        a = node.args
        if node.op != "argmax" or a["name"] not in results:
            continue
        e, t = argmax_ok(step.result(a["name"]).tolist(), want[a["x"].name][:, a["c0"]:a["c1"]], tol)
        exact, tolerated, total = exact + e, tolerated + t, total + step.batch
    err.update(exact=exact, tolerated=tolerated, picks=total)
    return err


def prove_steps(ctx: Ctx, fam, batch: int, dtype_name: str) -> dict:
    import torch

    from photon_core.megakernel.eager import run_reference
    dtype = dtype_of(dtype_name)
    b = build(ctx, fam, batch)
    step = b.step(advance=True)
    # Moondream's text-only graph (caption / query) is a second kernel over the same state.
    variants: dict[str, tuple[str, ...] | None] = {"full": None}
    if not fam.advance and batch == 1:
        variants["text"] = ("token",)
    kernels = {v: b.kernel(step, r) for v, r in variants.items()}
    b.use_dtype(step, dtype)
    rows = fam.rows(batch, "steps")
    caches = fill(step, rows, seed=batch)
    own_state = fam.own_state(caches)
    ref_w = fam.ref_weights(dtype)
    tokens, positions = list(rows.tokens), list(rows.positions)
    b.apply_inputs(step, tokens, positions)
    with preserved(step):
        replay = {v: graphed(k.launch, ctx.cuda) for v, k in kernels.items()}
    worst = {"values": 0.0, "own": 0.0, "kv": 0.0}
    picks = dict(exact=0, tolerated=0, picks=0)
    bad: list[str] = []
    profiles: list[Profile] = []
    at64: list[int] = []
    tol = checks.TOL
    which = ["text" if "text" in variants and s % 2 == 1 else "full" for s in range(ctx.sizes.steps)]
    in64 = float64_steps([s for s, v in enumerate(which) if v == "full"])
    t = time.time()
    for s in range(ctx.sizes.steps):
        variant = which[s]
        results = ["token"] if variant == "text" else list(step.graph_def.results)
        inputs = fam.inputs(batch, tokens) if fam.advance else b.apply_inputs(step, tokens, positions)
        caches64 = None
        if s in in64:
            if s:
                adopt_history(step, caches, positions)
            caches64 = widened(caches)       # the history, before run_reference appends
        want = run_reference(step.graph_def, ref_w, caches, tokens, positions, rows.cross_len, inputs)
        own = fam.own_reference(dtype, own_state, tokens, positions, rows, inputs)
        replay[variant]()
        ctx.sync()
        problem = flags(kernels[variant])
        if problem:
            bad.append(f"step {s}: {problem}")
            break
        if caches64 is not None:
            prof = profile_launch(step, ref_w, caches64, want, caches, tokens, positions, rows.cross_len, inputs)
            del caches64
            profiles.append(prof)
            at64.append(s)
            verdict = judge_profile(prof)
            if verdict:
                bad.append(f"step {s} ({variant}, float64 profile): {verdict}")
                break
            tol = tolerance(profiles)
        err = compare(step, want, own, positions, results, caches, tol)
        for k in worst:
            worst[k] = max(worst[k], err[k])
        for k in picks:
            picks[k] += err[k]
        if max(err["values"], err["own"], err["kv"]) > tol or err["exact"] + err["tolerated"] < err["picks"]:
            bad.append(f"step {s} ({variant}): {err}, tolerance {tol:.1e}")
            break
        chosen = step.result("token").tolist()
        nxt = [p + 1 for p in positions]
        if fam.advance:
            dyn = step.dyn.tolist()
            if dyn[:batch] != chosen or dyn[batch:2 * batch] != nxt:
                bad.append(f"step {s}: dyn after the step is {dyn}, expected tokens {chosen}, positions {nxt}")
                break
        tokens, positions = chosen, nxt
    res = dict(family=fam.name, batch=batch, dtype=dtype_name, steps=s + 1, variants=list(variants),
               tasks=len(step.graph.tasks), programs=kernels["full"].num_programs, max_err=worst, **picks,
               tolerance=tol, float64={str(at): p.summary() for at, p in zip(at64, profiles)}, passed=not bad,
               seconds=round(time.time() - t, 1))
    ctx.checks.expect(not bad, f"steps {fam.name} B{batch} {dtype_name}: {bad[:1]}")
    note = "  (fp32 error above 1e-4: look closer)" if dtype == torch.float32 and max(worst.values()) > FP32_NOTE else ""
    print(f"  {fam.name:22s} B{batch} {dtype_name}: {s + 1} steps ({'/'.join(variants)}), max rel err "
          f"values {worst['values']:.1e} own-ref {worst['own']:.1e} kv {worst['kv']:.1e}, argmax "
          f"{picks['exact']}/{picks['picks']} identical + {picks['tolerated']} near-ties, "
          f"{res['seconds']} s{note}", flush=True)
    for at, p in zip(at64, profiles):
        print(f"    {profile_line(at, p)}", flush=True)
    return res


def profile_line(step: int, p: Profile) -> str:
    """The float64 profile in one line: the output layer's errors, the worst layer's ratio, and the
    megakernel's curve at a few depths (its shape is the verdict's evidence)."""
    ratio, where = p.worst_ratio()
    n = len(p.layers)
    marks = sorted({0, n // 4, n // 2, 3 * n // 4, n - 1}) if n else []
    curve = ", ".join(f"{p.layers[i]} {p.mk[i]:.0e}/{p.ref32[i]:.0e}" for i in marks)
    return (f"float64 step {step}: {n} layers, megakernel / fp32-reference error {curve}; worst ratio "
            f"{ratio:.1f} at {where}")
