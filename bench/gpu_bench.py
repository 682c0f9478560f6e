"""GPU benchmark of the Triton kernels and the Whisper decode megakernel (random weights, real shapes).

    BENCH_OUT=$OUT bash bench/gpu.sh bench   # H200/H100: this with --batches 1,8 (device tool timeout_s 300)
    python bench/gpu_bench.py --dry-run      # CPU, TRITON_INTERPRET=1, tiny shapes: checks the plumbing only

Part 1, per-op: each Triton kernel against the PyTorch eager op at decode shapes.
Part 2, per decode step of Whisper tiny.en's decoder (d 384, 6 heads, 4 layers, vocab 51864, fp32):
PyTorch eager vs per-op Triton replayed from a CUDA graph vs the megakernel (plain launch and CUDA
graph). Reported: time per step (median of CUDA-event timings after warm-up), achieved bandwidth =
weight bytes per step / time, and the ratio to the floor = weight bytes / HBM bandwidth (--hbm-tbps;
default the device's by its name, photon_core.gpu_proof.hbm, recorded in the results).
Every path is checked against the reference step first (logits rel. error, same argmax).
--json is rewritten (whole, then renamed) after the per-op part and after every batch, and each batch
runs guarded (a failure is recorded in "failures", the exit status is 1, the other batches still run):
a run killed by gpu.sh's timeout keeps everything it finished.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from photon_core.gpu_proof.results_file import replace_whole  # noqa: E402


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry-run", action="store_true", help="CPU interpreter, tiny shapes, 1 iteration")
    p.add_argument("--batches", default="1,2,4,8")
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--hbm-tbps", type=float, default=None,
                   help="HBM bandwidth for the floor (default: the device's by its name, photon_core.gpu_proof.hbm)")
    p.add_argument("--json", default="", help="also write the results here")
    p.add_argument("--sweep-block-n", default="16,32", help="extra megakernel tile widths to time ('' = none)")
    p.add_argument("--no-bf16", dest="bf16", action="store_false", help="skip the bf16-weights megakernel")
    p.add_argument("--write", action="store_true", help="put the step table into bench/RESULTS.md")
    return p.parse_args(argv)


def eager_ops():
    """PyTorch eager versions of the per-op functions triton_perop_step needs."""
    import torch
    import torch.nn.functional as F

    from photon_core.backends import reference as ref

    def kv_append(kc, vc, k, v, pos):
        idx = pos.long().view(-1, 1, 1, 1).expand(-1, kc.shape[1], 1, kc.shape[3])
        kc.scatter_(2, idx, k)
        vc.scatter_(2, idx, v)

    def decode_attention(q, kc, vc, lengths, scale=None):
        mask = torch.arange(kc.shape[2], device=q.device)[None, :] < lengths.view(-1, 1)
        return F.scaled_dot_product_attention(q, kc, vc, attn_mask=mask[:, None, None, :], scale=scale)

    return SimpleNamespace(linear=ref.linear, layer_norm=ref.layer_norm, argmax=ref.argmax,
                           kv_append=kv_append, decode_attention=decode_attention)


def bench_ops(args, dev, cuda: bool, d: int, vocab: int, t_self: int, t_enc: int) -> list[dict]:
    import torch

    from photon_core.backends import reference as ref
    from photon_core.backends.select import get_backend
    from photon_core.gpu_proof.checks import timer
    tri = get_backend("triton", dev)
    eager = eager_ops()
    rows = []
    for m in ((1,) if args.dry_run else (1, 8)):
        cases = {
            f"linear {d}->{3 * d} M{m}": (lambda x, w, b: tri.linear(x, w, b), lambda x, w, b: ref.linear(x, w, b),
                                         (torch.randn(m, d, device=dev), torch.randn(3 * d, d, device=dev),
                                          torch.randn(3 * d, device=dev))),
            f"linear+gelu {d}->{4 * d} M{m}": (lambda x, w, b: tri.linear(x, w, b, "gelu"),
                                              lambda x, w, b: ref.linear(x, w, b, "gelu"),
                                              (torch.randn(m, d, device=dev), torch.randn(4 * d, d, device=dev),
                                               torch.randn(4 * d, device=dev))),
            f"lm_head {d}->{vocab} M{m}": (lambda x, w: tri.linear(x, w), lambda x, w: ref.linear(x, w),
                                          (torch.randn(m, d, device=dev), torch.randn(vocab, d, device=dev))),
            f"layer_norm {d} M{m}": (tri.layer_norm, ref.layer_norm,
                                     (torch.randn(m, d, device=dev), torch.randn(d, device=dev),
                                      torch.randn(d, device=dev))),
            f"argmax {vocab} M{m}": (tri.argmax, ref.argmax, (torch.randn(m, vocab, device=dev),)),
        }
        dh, h = 64 if d >= 64 else d, max(1, d // 64)
        for name, t in (("self", t_self), ("cross", t_enc)):
            qkv = (torch.randn(m, h, 1, dh, device=dev), torch.randn(m, h, t, dh, device=dev),
                   torch.randn(m, h, t, dh, device=dev), torch.full((m,), t, device=dev, dtype=torch.int32))
            cases[f"decode_attn {name} T{t} M{m}"] = (tri.decode_attention, eager.decode_attention, qkv)
        for name, (f_tri, f_ref, inp) in cases.items():
            a, b = f_tri(*inp), f_ref(*inp)
            err = ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-6)).item()
            t_tri = timer(lambda: f_tri(*inp), args.iters, args.warmup, cuda)
            t_ref = timer(lambda: f_ref(*inp), args.iters, args.warmup, cuda)
            rows.append(dict(op=name, triton_us=t_tri * 1e6, eager_us=t_ref * 1e6, rel_err=err))
            print(f"  {name:34s} triton {t_tri * 1e6:9.1f} us   eager {t_ref * 1e6:9.1f} us   err {err:.1e}",
                  flush=True)
    return rows


def bench_step(args, dev, cuda: bool, wt, batch: int, max_len: int, t_enc: int, tiling) -> dict:
    """One batch's decode step on every path, every one reading fp32 KV caches (built outside
    cuda_kv_dtype, a megakernel step on CUDA gets bf16 ones: its error was bf16's rounding of the
    caches, not the kernel's, and it read fewer bytes than the paths it was timed against)."""
    import torch

    from photon_core.megakernel.compiler import cuda_kv_dtype
    with cuda_kv_dtype(torch.float32):
        return _bench_step(args, dev, cuda, wt, batch, max_len, t_enc, tiling)


def _bench_step(args, dev, cuda: bool, wt, batch: int, max_len: int, t_enc: int, tiling) -> dict:
    import torch

    from photon_core.backends.select import get_backend
    from photon_core.gpu_proof.checks import graphed, timer
    from photon_core.models.whisper.decoder_step import (WhisperDecoderMegakernel, reference_cross_kv,
                                                        reference_step, triton_perop_step)
    d, h = wt.d_model, wt.n_heads
    dh = d // h
    enc = torch.randn(batch, t_enc, d, device=dev)
    cross = reference_cross_kv(wt, enc)
    pos0 = max_len // 2  # a half-full cache: attention cost of a typical step
    pos = torch.full((batch,), pos0, device=dev, dtype=torch.int32)
    toks = torch.randint(0, wt.vocab, (batch,), device=dev, dtype=torch.int32)
    xlen = torch.full((batch,), t_enc, device=dev, dtype=torch.int32)

    def caches():
        return [(torch.randn(batch, h, max_len, dh, device=dev), torch.randn(batch, h, max_len, dh, device=dev))
                for _ in wt.layers]

    kv = caches()
    kv_ref = [(k.clone(), v.clone()) for k, v in kv]
    want = reference_step(wt, toks.tolist(), pos.tolist(), kv_ref, cross)

    mk = WhisperDecoderMegakernel(wt, batch, max_len, t_enc, tiling)
    mk.check = False
    mk.set_encoder_output(enc)
    for li, (k, v) in enumerate(kv):
        mk.view(f"L{li}.kcache").copy_(k)
        mk.view(f"L{li}.vcache").copy_(v)
    mk.step(toks, pos)
    mk.kernel.raise_on_error()
    mk_err = ((mk.logits - want).abs().max() / want.abs().max()).item()
    mk_same = mk.out.tolist() == want.argmax(-1).tolist()

    tri = get_backend("triton", dev)
    eager = eager_ops()
    logits_t, tok_t = triton_perop_step(tri, wt, toks, pos, [(k.clone(), v.clone()) for k, v in kv], cross, xlen)
    perop_err = ((logits_t - want).abs().max() / want.abs().max()).item()
    perop_same = tok_t.tolist() == want.argmax(-1).tolist()

    kv_e, kv_t = caches(), caches()
    eager_fn = lambda: triton_perop_step(eager, wt, toks, pos, kv_e, cross, xlen)  # noqa: E731
    perop_fn = graphed(lambda: triton_perop_step(tri, wt, toks, pos, kv_t, cross, xlen), cuda)
    mk_fn = mk.kernel.launch
    mk_graph = graphed(mk.kernel.launch, cuda)
    res = dict(batch=batch, tasks=len(mk.graph.tasks), programs=mk.kernel.num_programs,
               kv_dtype=str(mk.view("L0.kcache").dtype),
               megakernel_rel_err=mk_err, megakernel_same_argmax=mk_same,
               perop_rel_err=perop_err, perop_same_argmax=perop_same)
    nbytes = wt.weight_bytes_per_step()
    floor = nbytes / (args.hbm_tbps * 1e12)
    for name, fn in (("eager", eager_fn), ("perop_triton_graph", perop_fn), ("megakernel", mk_fn),
                     ("megakernel_graph", mk_graph)):
        t = timer(fn, args.iters, args.warmup, cuda)
        res[name] = dict(us=t * 1e6, gbps=nbytes / t / 1e9, x_floor=t / floor)
        print(f"  B{batch} {name:20s} {t * 1e6:9.1f} us/step  {nbytes / t / 1e9:8.1f} GB/s  {t / floor:6.2f}x floor",
              flush=True)
    mk.kernel.raise_on_error()  # the timed launches too
    if args.bf16:
        # Same graph, weights stored in bf16 (math in fp32): half the bytes, so its own floor.
        mk16 = WhisperDecoderMegakernel(wt, batch, max_len, t_enc, tiling, weight_dtype=torch.bfloat16)
        mk16.check = False
        mk16.set_encoder_output(enc)
        for li, (k, v) in enumerate(kv):
            mk16.view(f"L{li}.kcache").copy_(k)
            mk16.view(f"L{li}.vcache").copy_(v)
        mk16.step(toks, pos)
        mk16.kernel.raise_on_error()
        res["megakernel_bf16_rel_err"] = ((mk16.logits - want).abs().max() / want.abs().max()).item()
        res["megakernel_bf16_same_argmax"] = mk16.out.tolist() == want.argmax(-1).tolist()
        t = timer(graphed(mk16.kernel.launch, cuda), args.iters, args.warmup, cuda)
        half = nbytes // 2
        res["megakernel_bf16_graph"] = dict(us=t * 1e6, gbps=half / t / 1e9, x_floor=t / (floor / 2))
        print(f"  B{batch} {'megakernel_bf16_graph':20s} {t * 1e6:9.1f} us/step  {half / t / 1e9:8.1f} GB/s  "
              f"{t / (floor / 2):6.2f}x bf16 floor  (err vs fp32 ref {res['megakernel_bf16_rel_err']:.1e}, "
              f"same argmax {res['megakernel_bf16_same_argmax']})", flush=True)
        mk16.kernel.raise_on_error()
    for bn in [int(x) for x in args.sweep_block_n.split(",") if x]:
        # Narrower tiles: more tasks per stage (a d-wide stage has d / block_n of them), so more SMs
        # busy in the short stages of a small model, at the price of more x re-reads per weight byte.
        import dataclasses
        t_bn = dataclasses.replace(tiling, block_n=bn, block_k=max(16, min(128, 8192 // (bn * batch))))
        mkb = WhisperDecoderMegakernel(wt, batch, max_len, t_enc, t_bn)
        mkb.check = False
        mkb.set_encoder_output(enc)
        for li, (k, v) in enumerate(kv):
            mkb.view(f"L{li}.kcache").copy_(k)
            mkb.view(f"L{li}.vcache").copy_(v)
        mkb.step(toks, pos)
        mkb.kernel.raise_on_error()
        err = ((mkb.logits - want).abs().max() / want.abs().max()).item()
        t = timer(graphed(mkb.kernel.launch, cuda), args.iters, args.warmup, cuda)
        res[f"megakernel_graph_bn{bn}"] = dict(us=t * 1e6, gbps=nbytes / t / 1e9, x_floor=t / floor,
                                              rel_err=err, tasks=len(mkb.graph.tasks))
        print(f"  B{batch} {'megakernel_graph_bn' + str(bn):20s} {t * 1e6:9.1f} us/step  {nbytes / t / 1e9:8.1f} GB/s  "
              f"{t / floor:6.2f}x floor  ({len(mkb.graph.tasks)} tasks, err {err:.1e})", flush=True)
    res["floor_us"] = floor * 1e6
    res["weight_bytes"] = nbytes
    print(f"  B{batch} tasks {res['tasks']}, programs {res['programs']}, megakernel err {mk_err:.1e} "
          f"same argmax {mk_same}, per-op err {perop_err:.1e} same argmax {perop_same}", flush=True)
    return res


def write_json(path: str, out: dict) -> None:
    """The results so far, written whole to a side file and renamed over `path` (a kill mid-write
    leaves the previous file)."""
    if path:
        replace_whole(path, json.dumps(out, indent=1, default=str))


def main(argv: list[str] | None = None) -> dict:
    args = parse(argv)
    if args.dry_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch
    cuda = torch.cuda.is_available() and not args.dry_run
    if not cuda and not args.dry_run:
        raise SystemExit("gpu_bench needs a CUDA GPU; use --dry-run to exercise it on CPU")
    dev = torch.device("cuda" if cuda else "cpu")
    from photon_core.models.whisper.decoder_step import Tiling, WhisperDecoderWeights
    torch.manual_seed(0)
    if args.dry_run:
        args.iters, args.warmup = 1, 0
        d, heads, layers, vocab, max_len, t_enc = 64, 2, 1, 100, 8, 8
        batches = [1]
        tiling = Tiling(64, 64, 16, 1, 1)
    else:
        d, heads, layers, vocab, max_len, t_enc = 384, 6, 4, 51864, 448, 1500
        batches = [int(b) for b in args.batches.split(",")]
        tiling = None  # per batch, below
    from photon_core.gpu_proof.hbm import hbm_tbps
    device = torch.cuda.get_device_name() if cuda else "cpu (interpreter dry run)"
    args.hbm_tbps, hbm_source = hbm_tbps(device, args.hbm_tbps)
    out: dict = dict(device=device, hbm_tbps=args.hbm_tbps, hbm_source=hbm_source,
                     shapes=dict(d=d, heads=heads, layers=layers, vocab=vocab, max_len=max_len, t_enc=t_enc))
    t0 = time.time()
    print(f"per-op kernels ({out['device']}; floors at {args.hbm_tbps} TB/s: {hbm_source})", flush=True)
    try:
        out["ops"] = bench_ops(args, dev, cuda, d, vocab, max_len // 2, t_enc)
    except Exception as e:  # noqa: BLE001  the decode steps still run
        fail(out, "per-op kernels", e)
    out["seconds"] = time.time() - t0
    write_json(args.json, out)
    wt = WhisperDecoderWeights.random(d, heads, layers, vocab, max(max_len, 8), seed=0, device=dev)
    print(f"decode step, weights {wt.weight_bytes_per_step() / 1e6:.1f} MB fp32, "
          f"floor at {args.hbm_tbps} TB/s", flush=True)
    out["steps"] = []
    for b in batches:
        # A linear task holds a [B, block_n, block_k] product in registers: keep it at 8K elements.
        try:
            out["steps"].append(bench_step(args, dev, cuda, wt, b, max_len, t_enc,
                                           tiling or Tiling(block_n=64, block_k=max(16, 128 // b), block_t=64,
                                                            self_splits=4, cross_splits=8)))
        except Exception as e:  # noqa: BLE001  the other batches still run
            fail(out, f"decode step B{b}", e)
        out["seconds"] = time.time() - t0
        write_json(args.json, out)
    publish_steps(out, args)
    return out


def fail(out: dict, part: str, e: BaseException) -> None:
    """Record a failed part (its error and the end of its traceback) and say so."""
    import traceback
    print(f"  {part} FAILED: {type(e).__name__}: {e}", flush=True)
    out.setdefault("failures", []).append(dict(part=part, error=f"{type(e).__name__}: {e}"[:500],
                                               trace=traceback.format_exc()[-1500:]))


def publish_steps(out: dict, args) -> None:
    """The decode-step table, printed, and with --write put into bench/RESULTS.md (report.publish
    replaces this benchmark's own section)."""
    from report import heading, publish
    shapes = out["shapes"]
    title = "Whisper decode step on GPU: eager vs per-op graph vs megakernel" + (
        " (dry run)" if args.dry_run else "")
    lines = heading(title) + [
        f"{out['device']}; decoder d {shapes['d']}, {shapes['layers']} layers, vocab {shapes['vocab']}, "
        f"{shapes['max_len'] // 2} of {shapes['max_len']} positions, {shapes['t_enc']} frames; random weights. "
        f"Median of {args.iters} timings after {args.warmup} warm-up; floor = weight bytes / {args.hbm_tbps} TB/s.",
        "", "| batch | path | us/step | GB/s | x floor |", "|---:|---|---:|---:|---:|"]
    for step in out["steps"]:
        for path, r in step.items():
            if isinstance(r, dict) and "us" in r:
                lines.append(f"| {step['batch']} | {path} | {r['us']:.1f} | {r['gbps']:.0f} | {r['x_floor']:.2f} |")
    if args.write and args.dry_run:
        print("(--write ignored: a dry run's numbers do not belong in bench/RESULTS.md)", flush=True)
    publish(lines, args.write and not args.dry_run)


if __name__ == "__main__":
    sys.exit(1 if main().get("failures") else 0)
