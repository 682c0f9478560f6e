"""Part "timing": CUDA events around many replays of a step's CUDA graph (median after warm-up):
time per step, bytes / time, time against the HBM floor (weights once + K/V read, at --hbm-tbps),
against Whisper's per-op Triton step in a CUDA graph, and batch 8 against batch 1. Steps are timed
as the checks built them (fp32 caches; the per-op step reads fp32 caches too)."""
from __future__ import annotations

import math
import time
from typing import Callable

from photon_core.gpu_proof import checks
from photon_core.gpu_proof.build import build, fill, flags
from photon_core.gpu_proof.checks import Ctx, graphed, guarded, over_budget, rel_err, timer
from photon_core.megakernel.graph_family import Rows, dtype_of


def kv_read_bytes(graph, rows: Rows, kv_bytes: int = 4) -> int:
    """K and V bytes one step's attention reads (`kv_bytes` an element): each row's own length per
    node (a window caps it); recurrent states (fp32) read and written once per row."""
    n = 0
    for node in graph.nodes:
        if node.op == "attention":
            spec, window = node.args["k"].spec, node.args["window"]
            lengths = [p + 1 for p in rows.positions] if node.args["length"] == "self" else rows.cross_len
            if lengths is None:
                raise ValueError(f"{graph.name}: cross-attention needs the rows' cross lengths")
            n += sum(min(x, window or x) for x in lengths) * spec.heads * spec.head_dim * 2 * kv_bytes
    return n + sum(2 * 4 * math.prod(s.shape) for s in graph.states.values()) * len(rows.positions)


def per_call_s(ctx: Ctx, fn: Callable[[], object], checked_s: float) -> float:
    """Seconds per call of `fn`, just run once to be checked (taking `checked_s`): the median of
    ctx.sizes.iters CUDA-graph replays after its warm-up, or with iters 0 (the dry run: an
    interpreted launch is most of a second and its time means nothing) that checked call's own
    time, with no second run."""
    if not ctx.sizes.iters:
        return checked_s
    return timer(graphed(fn, ctx.cuda), ctx.sizes.iters, ctx.sizes.warmup, ctx.cuda)


def perop_whisper(ctx: Ctx, fam, batch: int, rows: Rows, caches: dict) -> dict:
    """decoder_step.triton_perop_step (the per-op Triton kernels, fp32 weights) in a CUDA graph, at
    the same inputs; its logits checked against run_reference first."""
    import torch

    from photon_core.backends.select import get_backend
    from photon_core.megakernel.eager import run_reference
    from photon_core.models.whisper.decoder_step import triton_perop_step
    tri = get_backend("triton", ctx.dev)
    dev = ctx.dev
    toks = torch.tensor(rows.tokens, device=dev, dtype=torch.int32)
    pos = torch.tensor(rows.positions, device=dev, dtype=torch.int32)
    xlen = torch.tensor(rows.cross_len, device=dev, dtype=torch.int32)
    g = build(ctx, fam, batch).step(advance=False).graph_def
    want = run_reference(g, fam.ref_weights(torch.float32), {k: v.clone() for k, v in caches.items()},
                         rows.tokens, rows.positions, rows.cross_len)
    checked = fam.own_state(caches)     # cache copies of its own: the step appends in place
    t0 = time.perf_counter()
    logits, _ = triton_perop_step(tri, fam.wt, toks, pos, checked["self_kv"], checked["cross_kv"], xlen)
    err = rel_err(logits, want["logits"])
    checked_s = time.perf_counter() - t0
    ctx.checks.expect(err <= checks.TOL, f"timing {fam.name} B{batch}: per-op step logits err {err:.1e}")
    state = fam.own_state(caches)
    t = per_call_s(ctx, lambda: triton_perop_step(tri, fam.wt, toks, pos, state["self_kv"], state["cross_kv"], xlen),
                   checked_s)
    return dict(us=t * 1e6, rel_err=err)


def warm_perop_whisper(shape: tuple[int, int, int, int], max_len: int, enc_len: int, batch: int) -> float:
    """(In a proof.prewarm worker.) One per-op Whisper step at perop_whisper's shapes, on random
    inputs: Triton compiles into its disk cache every per-op kernel perop_whisper launches at `batch`
    (their specialisations depend on shapes only). Seconds taken."""
    import time

    import torch

    from photon_core.backends.select import get_backend
    from photon_core.models.whisper.decoder_step import WhisperDecoderWeights, triton_perop_step
    dev = torch.device("cuda")
    d, h, layers, vocab = shape
    t0 = time.perf_counter()
    wt = WhisperDecoderWeights.random(d, h, layers, vocab, n_ctx=max_len, seed=0, device=dev)

    def cache(length: int) -> torch.Tensor:
        return torch.randn(batch, h, length, d // h, device=dev)

    def ints(v: int) -> torch.Tensor:
        return torch.full((batch,), v, dtype=torch.int32, device=dev)
    triton_perop_step(get_backend("triton", dev), wt, ints(0), ints(1),
                      [(cache(max_len), cache(max_len)) for _ in range(layers)],
                      [(cache(enc_len), cache(enc_len)) for _ in range(layers)], ints(enc_len))
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def time_step(ctx: Ctx, fam, batch: int, dtype_name: str, perop: dict | None) -> dict:
    b = build(ctx, fam, batch)
    step = b.step(advance=False)
    kernel = b.kernel(step)
    b.use_dtype(step, dtype_of(dtype_name))
    rows = fam.rows(batch, "fixed")
    fill(step, rows, seed=20 + batch)
    b.apply_inputs(step, rows.tokens, rows.positions)
    t0 = time.perf_counter()
    kernel.launch()
    ctx.sync()
    checked_s = time.perf_counter() - t0
    problem = flags(kernel)
    t = per_call_s(ctx, kernel.launch, checked_s)
    ctx.sync()
    problem = problem or flags(kernel)
    ctx.checks.expect(problem is None, f"timing {fam.name} B{batch} {dtype_name}: {problem}")
    wbytes = step.weight_bytes_per_step()
    kvbytes = kv_read_bytes(step.graph_def, rows, step.plan.kv_dtype.itemsize)
    floor = (wbytes + kvbytes) / (ctx.hbm_tbps * 1e12)
    res = dict(family=fam.name, batch=batch, dtype=dtype_name, us=t * 1e6, weight_bytes=wbytes, kv_bytes=kvbytes,
               gbps=(wbytes + kvbytes) / t / 1e9, floor_us=floor * 1e6, x_floor=t / floor,
               tasks=len(kernel.graph.tasks), programs=kernel.num_programs)
    if perop is not None:
        res["perop_fp32_us"] = perop["us"]
        res["x_perop"] = res["us"] / perop["us"]
    print(f"  {fam.name:22s} B{batch} {dtype_name}: {res['us']:9.1f} us/step {res['gbps']:7.1f} GB/s "
          f"{res['x_floor']:6.2f}x floor ({(wbytes + kvbytes) / 1e6:.0f} MB: {kvbytes / 1e6:.0f} MB K/V)"
          + (f", {res['x_perop']:.2f}x the per-op graph ({perop['us']:.1f} us, fp32 weights)" if perop else ""),
          flush=True)
    return res


def prove_timing(ctx: Ctx, fam, batch: int, dtypes: list[str]) -> list[dict]:
    """One family at one batch: its per-op step in a CUDA graph first (where the family has one),
    then the megakernel's step in each weight dtype, each against the HBM floor and the per-op time."""
    perop = None
    if fam.perop and not over_budget(ctx, f"timing {fam.name} B{batch} per-op"):
        # Per-op first: its compile and capture count against this configuration's budget.
        rows = fam.rows(batch, "fixed")
        step = build(ctx, fam, batch).step(advance=False)
        perop = guarded(ctx, f"timing per-op {fam.name} B{batch}",
                        lambda: perop_whisper(ctx, fam, batch, rows, fill(step, rows, seed=20 + batch)))
    out = []
    for dt in dtypes:
        if not over_budget(ctx, f"timing {fam.name} B{batch} {dt}"):
            r = guarded(ctx, f"timing {fam.name} B{batch} {dt}", lambda: time_step(ctx, fam, batch, dt, perop))
            if r is not None:
                out.append(r)
    return out


def batch_ratios(results: list[dict]) -> None:
    """Each batch's time against batch 1's (same family and dtype), added to its result as x_batch1."""
    by = {(r["family"], r["dtype"], r["batch"]): r for r in results}
    for (f, dt, batch), r in by.items():
        one = by.get((f, dt, 1))
        if batch != 1 and one is not None:
            r["x_batch1"] = r["us"] / one["us"]
            print(f"  {f:22s} {dt}: batch {batch} takes {r['x_batch1']:.2f}x batch 1's time "
                  f"({batch / r['x_batch1']:.1f}x the rows per second)", flush=True)
