"""Where a decode step's time goes on a GPU, and what the megakernel's build variants change: one
prepared run (<= ~4 minutes on an H200 or an H100) for the device tool, results written as each row
finishes.

    BENCH_OUT=$OUT python bench/gpu_timeline.py --out $OUT          (device tool, timeout_s ~300)
    python bench/gpu_timeline.py --dry-run --out /tmp/tl           (CPU: tiny shapes, the interpreter)

Parts, in this order (the first ones are what the next design step needs most):
1. builds: Moondream 2's text decoder and Whisper tiny.en's decoder at batch 1 on random weights of
   the real shapes (gpu_proof.families), bf16 weights, fp32 caches (built under
   compiler.cuda_kv_dtype(fp32), as gpu_proof builds: on CUDA a step's caches are bf16 by default)
   filled with history at the positions the first run timed (Moondream 2: 830; Whisper: 224, cross
   length 1491); each kernel variant, and each traced build, handed to a pool of compile processes
   as soon as its step is built.
2. peers, while the pool compiles: transformers in one CUDA graph, the same shapes (Phi with
   Moondream 2's text dims, a StaticCache with the same prefix; Whisper tiny.en's decoder with self
   and cross StaticCaches), one decode forward + argmax per replay.
3. per configuration (model, batch, tiling): first one traced launch of the plain build (and of
   prefetch, on Moondream 2) analysed by photon_core.megakernel.timeline (what the next design step
   waits on), then each variant's logits against the plain build's at the same state (they must
   agree to rounding: only load scheduling differs) and its median CUDA-graph replay, each variant
   on its own (a failure is recorded, the next variant runs); on the prod tiling also the per-op engine
   (megakernel/perop_engine.py: the same step graph op by op with torch's kernels, on the same
   buffers), its chained build (kernels/chained.py: one Triton kernel an op, launches chained by
   programmatic dependent launch on sm_90: each starts, and issues its weight loads, while the one
   before finishes; a few seconds of JIT compiles) and what backend "auto" chooses at load
   (engine_choice.choose, its own replays).
4. Moondream 2 at batch 8 (plain, unroll4+aligned, unroll8+aligned, unroll8+aligned+static,
   wide256+aligned, aligned+pipe15 and prefetch). Its build (~28 s of host work) runs while the pool
   still compiles part 1's variants when more than a wave of its jobs is left after the peers (the
   build then costs the first measurement little), else after part 3; its variants compile in the
   pool as soon as it is built. Run if the budget left covers what it still needs (build, compiles,
   replays: OPTIONAL_S).
5. Whisper tiny.en and Moondream 2 at batch 1 with dense linear tasks of 4 column tiles
   (Tiling.linear_span 4; plain and wide512+aligned), each if the budget covers its build, compiles
   (in the pool) and replays.
6. Moondream 3.1 at batch 1 (its bf16 experts; plain and wide512+aligned, whose expert tasks stream
   16 KB a trip where the plain loop's stream 4 KB; the per-op engine plain and chained, whose
   experts run as kernels/chained.moe), then the megakernel with expert tasks of 4 column tiles
   (Tiling.expert_span; the span-1 build's ~18 GB arena freed first), each if the budget covers it.

Variants (kernel.KernelVariant): plain (today's build), prefetch2 / 1 (each linear task's weight
tile into L2 before its dependency wait, one bulk copy per row / per line), aligned+pipe4 /
aligned+pipe8 (K loops of 4 / 8 stages whose 16-byte weight loads Triton's pipeliner turns into
copies into shared memory, 2 / 6 trips ahead of the one in use: under 3.6 16 / 48 KB a program
in flight, 25 / 59 KB of shared memory, none of it in registers; the plain build's 2-byte loads
are not staged, SASS; at batch 8, whose K step the product's registers keep at 2 KB a trip,
aligned+pipe15: 13 trips ahead, 26 KB where unroll8+aligned has 16), dot64+pipe4 (the K loop on the
tensor cores, x split into two bf16 terms; its weights in 2-byte loads and 104-184 B of spills at
batch 1, SASS), wide512+aligned / wide256+aligned (512- / 256-element steps reduced as they come:
32 / 16 KB of weights in flight a program a trip as 16-byte loads, no spill under 3.6 or 3.9, the
cost model's best builds: bench/RESULTS.md "Megakernel K loop from the SASS"), aligned (the dense
tasks' weights in 16-byte loads: the default build's are 2-byte loads, the same 4 KB a trip),
unroll4+aligned (four weight tiles issued before the first is multiplied: 16 KB at batch 1, 8 KB at
batch 8; unroll8+aligned: eight, 16 KB at batch 8 without a spill under 3.6, auto's candidate above
batch 1), +static (no claims:
program p runs tasks p, p + P, ..., the next one's header loaded while one runs; the cost model
guesses 12% off Moondream 2 B1's streaming build). Tilings: prod (compiler.Tiling(),
what photon_core builds) and split (64-column tiles; stages with fewer tiles than programs
narrowed, then split along K).

Outputs in --out (3 files with gpu.sh's gpu.log, 4 if a kill lands mid-write; the device tool
brings back at most 8): gpu_timeline.json and traces.npz (every trace), each rewritten after every
row (written whole to a side file, then renamed: a kill keeps every row finished), and what this
prints (gpu.sh's gpu.log). The floor is the step's bytes (weights once, K/V read at the caches'
element size) at the device's nominal HBM bandwidth (photon_core.gpu_proof.hbm: H200 4.8 TB/s, H100
SXM 3.35; an unknown device keeps 4.8 and machine.hbm_source says so); x_copy_rate is the same
against the device-to-device copy rate measured at the start.
"""
from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from photon_core.gpu_proof.results_file import replace_whole  # noqa: E402

# The floor's rate: the device's nominal HBM bandwidth (photon_core.gpu_proof.hbm, set by main();
# 4.8e12, the H200's, until then and for a device not known there); the measured copy rate (read +
# write) is recorded beside it.
HBM = dict(bytes_per_s=4.8e12)
RESULTS: dict[str, Any] = {}
TRACES: dict[str, Any] = {}
T0 = time.time()
OUT: list[Path] = []          # where checkpoint() saves (main's --out)
_SAVED_TRACES: list[int] = [-1]   # len(TRACES) at the last traces.npz written

# What each optional part needs from its start, seconds (build + the pool's compiles of its variants,
# in parallel + its replays), from the first GPU run's costs (H200, 2026-12-04: Moondream 2 B8 build
# 28.6 s, B1 4.7-8 s, Moondream 3.1 B1 9.2 s, Whisper < 1 s; one megakernel compile 12-17 s in a
# worker; a launch of Moondream 2 B8 17.5 ms, B1 7.7 ms), with margin for an H100's slower memory.
# A part starts only if the budget left covers it: a part cut by gpu.sh's kill still keeps every row
# it finished (saved after each), but one that cannot finish wastes the time of the parts after it.
POOL_COMPILE_S = 17.0            # the variants' compiles in the pool's workers, side by side
FIRST_LAUNCH_COMPILE_S = 15.0    # without a pool: each variant compiled at its first launch, in turn
OPTIONAL_S = {                   # name -> (build s, replays s); + the compiles (compiles_s)
    "moondream2 B8 prod": (30.0, 15.0),
    "whisper-tiny.en B1 prod linear span4": (2.0, 4.0),
    "moondream2 B1 prod linear span4": (9.0, 6.0),
    "moondream3 B1 bf16 experts": (12.0, 25.0),      # + the per-op engine, plain and chained (JIT compiles)
    "moondream3 B1 bf16 experts span4": (12.0, 6.0),
}


def compiles_s(n_variants: int, pool: bool) -> float:
    return POOL_COMPILE_S if pool else FIRST_LAUNCH_COMPILE_S * n_variants


def optional_need_s(name: str, n_variants: int, pool: bool, built: bool = False, compiled: bool = False) -> float:
    """Seconds the optional part `name` still needs: its build unless `built`, its compiles unless
    `compiled`, its replays."""
    build_s, replay_s = OPTIONAL_S[name]
    return (0.0 if built else build_s) + (0.0 if compiled else compiles_s(n_variants, pool)) + replay_s


def log(msg: str) -> None:
    print(f"[{time.time() - T0:6.1f} s] {msg}", flush=True)


def save(out: Path) -> None:
    """gpu_timeline.json, and traces.npz when a trace was added since it was last written."""
    import numpy as np
    replace_whole(out / "gpu_timeline.json", lambda f: f.write(json.dumps(RESULTS, indent=1, default=str).encode()))
    if TRACES and len(TRACES) != _SAVED_TRACES[0]:
        replace_whole(out / "traces.npz", lambda f: np.savez_compressed(f, **TRACES))
        _SAVED_TRACES[0] = len(TRACES)


def checkpoint() -> None:
    """Save to main's --out (after every row: a kill keeps every row finished)."""
    if OUT:
        save(OUT[0])


def guarded(name: str, fn: Callable[[], Any]) -> Any:
    """Run one part; a failure is recorded and the run goes on (a CUDA error that poisons the
    context fails the parts after it too, each saying so)."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001  the run must record every part it can
        import traceback
        log(f"{name} FAILED: {type(e).__name__}: {e}")
        RESULTS.setdefault("failures", []).append(dict(part=name, error=f"{type(e).__name__}: {e}"[:500],
                                                       trace=traceback.format_exc()[-1500:]))
        return None


# ---------------------------------------------------------------- the steps


def families(dry: bool, programs: int) -> dict[str, Any]:
    """name -> (make a family at a tiling, the prod tiling, the split tiling): the proof's own
    Moondream 2, Whisper tiny.en and (where its decode step is in the tree) Moondream 3.1
    (bench/gpu_proof.py: real sizes, or tiny ones for the dry run), each tiling a family object of
    its own (its own weights: an arena is laid out per build)."""
    import gpu_proof
    fams = gpu_proof.families(dry, max(1, programs // 2))   # its split tiling: stages of >= 2 x that
    split = fams["whisper-tiny.en/split"].tiling

    def at(name: str) -> Callable[[Callable], Any]:
        def make(tiling: Callable) -> Any:
            fam = copy.copy(fams[name])
            # Its own dicts: a shallow copy shares them with fams[name], which this closure keeps
            # alive, and GraphFamily.build puts its weights arena into `arenas` (Moondream 3.1's:
            # ~18 GB of bf16 kept alive after its config is dropped).
            for key, value in list(vars(fam).items()):
                if isinstance(value, dict):
                    setattr(fam, key, dict(value))
            fam.tiling = tiling
            return fam
        return make
    return {name: (at(name), fams[name].tiling, split) for name in ("moondream2", "whisper-tiny.en", "moondream3")
            if name in fams}


class Config:
    """One compiled step (model, batch, tiling) at its timed state, and its kernel per variant."""

    def __init__(self, name: str, fam: Any, batch: int, dev: Any) -> None:
        import torch

        from photon_core.gpu_proof.build import fill
        from photon_core.megakernel.compiler import cuda_kv_dtype
        self.name, self.fam, self.batch = name, fam, batch
        t = time.time()
        fam.load(dev)
        # fp32 caches, as gpu_proof builds its steps and as the first run timed them (a step built on
        # CUDA outside this gets bf16 caches).
        with cuda_kv_dtype(torch.float32):
            self.step = step = fam.build(batch, False)
        w16 = step.weights.to(torch.bfloat16)
        step.weights = w16
        step.kernel.weights = w16
        # The family's own copies of the weights (Moondream 2's fp32 master and arena: ~11 GB at
        # real size) are not read again: this family object builds nothing else (families' make).
        for key in ("master", "arena32"):
            if getattr(fam, key, None) is not None:
                setattr(fam, key, None)
        if isinstance(getattr(fam, "arenas", None), dict):
            fam.arenas.clear()
        self.rows = fam.rows(batch, "timing")
        fill(step, self.rows, seed=7)
        step.scrub_nonfinite()   # fill's NaN past the rows' keys: the per-op engine's masked reads see them
        takes_tokens = any(n.op == "embed" for n in step.graph_def.nodes)
        step.set_step(self.rows.tokens if takes_tokens else None, self.rows.positions)
        for key, value in fam.inputs(batch, self.rows.tokens).items():
            step.set_input(key, value)
        self.saved = [x.clone() for x in (step.state, step.dyn, step.out)]
        self.kernels: dict[str, Any] = {}
        self.build_s = round(time.time() - t, 1)
        log(f"built {name}: {len(step.graph.tasks)} tasks, {self.build_s} s (lower + check + encode + fill)")

    def restore(self) -> None:
        for x, s in zip((self.step.state, self.step.dyn, self.step.out), self.saved):
            x.copy_(s)

    def kernel(self, variant: Any) -> Any:
        """The step's whole-graph kernel built as `variant` (its own Megakernel object: the task
        table and buffers are the step's)."""
        name = variant.name()
        if name not in self.kernels:
            base = self.step.kernel
            base.weights = self.step.weights
            k = copy.copy(base)
            k.variant = variant
            self.kernels[name] = k
        return self.kernels[name]


class Traced:
    """A kernel whose launch() is the traced build's launch: what Prewarm.submit reads of a kernel
    (launch, weights, graph, and expert_loop, which warmup_spec asks of every launch passing XLOOP:
    Megakernel.launch always does) is the wrapped kernel's."""

    def __init__(self, kernel: Any) -> None:
        self._kernel = kernel

    def __getattr__(self, name: str) -> Any:
        return getattr(self._kernel, name)

    def launch(self) -> None:
        self._kernel.launch(self._kernel.trace_buffer())


def submit_compiles(pool: Any, cfg: Config, variants: list, traced: list) -> list:
    """Each variant's launch (and each traced launch) compiled in a worker process; the jobs' keys."""
    import torch
    keys = []
    for v in traced:       # measured first (measure)
        keys += pool.submit(Traced(cfg.kernel(v)), [torch.bfloat16], f"{cfg.name} {v.name()} traced")
    for v in variants:
        keys += pool.submit(cfg.kernel(v), [torch.bfloat16], f"{cfg.name} {v.name()}")
    return keys


# ---------------------------------------------------------------- measuring


def copy_rate(dev: Any, cuda: bool) -> float:
    """Bytes per second of a 512 MB device-to-device copy (read + write), the floor's rate."""
    import torch
    if not cuda:
        return 4.0e12
    a = torch.empty(256 << 20, dtype=torch.int16, device=dev)
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        b.copy_(a)
    torch.cuda.synchronize()
    return 2 * a.numel() * 2 * 10 / (time.perf_counter() - t)


def replay_us(fn: Callable[[], Any], cuda: bool, iters: int) -> float:
    from photon_core.gpu_proof.checks import graphed, timer
    # on the CPU (the dry run) a time means nothing: one call, no warm-up (each is an interpreted launch)
    return timer(graphed(fn, cuda), iters, max(3, iters // 10) if cuda else 0, cuda) * 1e6


def timed_again(cfg: Config, k: Any, cuda: bool, iters: int, checked_us: float) -> float:
    """Microseconds per step of `k` (the variant or per-op build just checked): the median of
    `iters` replays from the config's state again, or with iters 0 (the dry run's --iters 0: an
    interpreted launch is most of a second and its time means nothing) the checking launch's own
    host time `checked_us`, launched once instead of twice."""
    if not iters:
        return checked_us
    cfg.restore()
    us = replay_us(k.launch, cuda, iters)
    k.raise_on_error()
    return us


def since_us(t: float) -> float:
    """Microseconds since time.perf_counter() read `t`."""
    return (time.perf_counter() - t) * 1e6


def floor_bytes_of(step: Any, rows: Any) -> int:
    """The step's bytes (weights once, K/V read at its caches' element size: fp32 caches, 4 bytes, as
    built here; 2 where a step has bf16 ones)."""
    from photon_core.gpu_proof.timing import kv_read_bytes
    return step.weight_bytes_per_step() + kv_read_bytes(step.graph_def, rows, step.plan.kv_dtype.itemsize)


def failed(part: str, e: BaseException) -> None:
    """Record one failed row (the run goes on with the next)."""
    import traceback
    log(f"{part} FAILED: {type(e).__name__}: {e}")
    RESULTS.setdefault("failures", []).append(dict(part=part, error=f"{type(e).__name__}: {e}"[:500],
                                                   trace=traceback.format_exc()[-1500:]))
    checkpoint()


def measure(cfg: Config, variants: list, traced: list, rate: float, cuda: bool, iters: int,
            perop: bool | None = None, choose: bool = True) -> None:
    """Trace `traced` first (what the next design step waits on), then time `variants` of cfg's step
    (each checked against the plain build's logits), then, where `perop` (default: a production
    tiling's config), the per-op engine's builds and (`choose`) auto's choice. Each traced launch,
    variant and per-op build on its own: a failure is recorded and the next one runs; the results
    are saved after every row."""
    from photon_core.gpu_proof.checks import rel_err
    from photon_core.megakernel import timeline
    from photon_core.megakernel.kernel import linear_k_step
    step = cfg.step
    logits_name = "logits"
    floor_bytes = floor_bytes_of(step, cfg.rows)
    floor_us = floor_bytes / HBM["bytes_per_s"] * 1e6
    kv_dtype = str(step.plan.kv_dtype).removeprefix("torch.")
    for v in traced:
        key = f"{cfg.name}.{v.name()}"
        try:
            k = cfg.kernel(v)
            if iters:             # (the dry run's --iters 0: no warm-up launch)
                cfg.restore()
                k.launch()        # warm (the compiled traced build is another kernel)
            cfg.restore()
            tr = k.traced_launch()
            k.raise_on_error()
            a = timeline.analyse(k.graph, tr, linear_k_step(k.meta, variant=k.variant))
        except Exception as e:  # noqa: BLE001  the variants still run
            failed(f"{cfg.name} traced {v.name()}", e)
            continue
        TRACES[key] = tr.numpy()
        RESULTS.setdefault("timelines", {})[key] = a
        print(timeline.report(key, a, unit="ns" if cuda else "ticks"), flush=True)
        checkpoint()
    rows = []
    plain_logits, plain_name = None, None
    for v in variants:
        try:
            k = cfg.kernel(v)
            cfg.restore()
            t = time.perf_counter()
            k.launch()
            k.raise_on_error()
            checked_us = since_us(t)
            got = step.view(logits_name).clone()
            if plain_logits is None:       # the first variant that ran (plain, unless plain failed)
                plain_logits, plain_name = got, v.name()
            err = rel_err(got, plain_logits)
            us = timed_again(cfg, k, cuda, iters, checked_us)
        except Exception as e:  # noqa: BLE001  the other variants still run
            failed(f"{cfg.name} {v.name()}", e)
            continue
        rows.append(dict(config=cfg.name, variant=v.name(), us=round(us, 1), rel_err_vs_plain=err,
                         floor_us=round(floor_us, 1), x_floor=round(us / floor_us, 2),
                         x_copy_rate=round(us / (floor_bytes / rate * 1e6), 2),
                         tasks=len(k.graph.tasks), programs=k.num_programs, bytes=floor_bytes, kv_dtype=kv_dtype))
        if plain_name != "plain":
            rows[-1]["err_vs"] = plain_name
        log(f"{cfg.name} {v.name():18s} {us:9.1f} us/step  {rows[-1]['x_floor']:6.2f}x floor  err vs plain {err:.1e}")
        RESULTS.setdefault("timing", []).append(rows[-1])
        checkpoint()
    perop = "prod" in cfg.name if perop is None else perop
    if perop:     # the per-op engine on the same step (perop_engine.py; issue 38.4)
        builds = ["plain", "chained"]    # torch's kernels; kernels/chained.py's, chained by PDL
        for build in builds:
            label = "per-op engine" + (f" {build}" if build != "plain" else "")
            try:
                step.set_engine("perop", build)
                k = step.kernel
                cfg.restore()
                t = time.perf_counter()
                k.launch()
                k.raise_on_error()
                checked_us = since_us(t)
                err = rel_err(step.view(logits_name), plain_logits) if plain_logits is not None else None
                us = timed_again(cfg, k, cuda, iters, checked_us)
            except Exception as e:  # noqa: BLE001  the other rows still run
                log(f"{cfg.name} {label}: failed ({type(e).__name__}: {e})")
                RESULTS.setdefault("failures", []).append(dict(part=f"{cfg.name} {label}",
                                                               error=f"{type(e).__name__}: {e}"[:500]))
                checkpoint()
                if build == "chained" and getattr(step.kernel, "pdl", False):
                    builds.append("chained-unlinked")   # the same kernels without PDL, as auto would try
                continue
            rows.append(dict(config=cfg.name, variant=label, us=round(us, 1), rel_err_vs_plain=err,
                             floor_us=round(floor_us, 1), x_floor=round(us / floor_us, 2),
                             x_copy_rate=round(us / (floor_bytes / rate * 1e6), 2), bytes=floor_bytes,
                             kv_dtype=kv_dtype, pdl=bool(getattr(k, "pdl", False))))
            log(f"{cfg.name} {label:18s} {us:9.1f} us/step  {rows[-1]['x_floor']:6.2f}x floor  err vs plain "
                + (f"{err:.1e}" if err is not None else "- (no megakernel variant ran)"))
            RESULTS.setdefault("timing", []).append(rows[-1])
            checkpoint()
        step.set_engine("megakernel")
    if perop and choose:
        # what backend "auto" decides at load (engine_choice.choose: its own replays, nothing recorded)
        from photon_core.megakernel import engine_choice
        cfg.restore()
        cache, os.environ["PHOTON_BUILD_CACHE"] = os.environ.get("PHOTON_BUILD_CACHE"), "0"   # measure, not read
        try:
            c = engine_choice.choose(step) if cuda else engine_choice.choose(step, lambda s: 1.0)
            RESULTS.setdefault("engine_choice", {})[cfg.name] = dict(
                engine=c.engine, variant=c.variant, how=c.how, megakernel_ms=c.megakernel_ms, perop_ms=c.perop_ms,
                variant_ms=c.variant_ms, timed_variant=c.timed_variant, chained_ms=c.chained_ms, note=c.note)
            log(f"{cfg.name}: auto chooses {c.line()}")
        except Exception as e:  # noqa: BLE001  recorded; the run goes on
            failed(f"{cfg.name} engine choice", e)
        finally:
            if cache is None:
                os.environ.pop("PHOTON_BUILD_CACHE")
            else:
                os.environ["PHOTON_BUILD_CACHE"] = cache
            step.set_engine("megakernel")
        checkpoint()
    cfg.restore()

def peer_phi(dev: Any, cuda: bool, dry: bool, batch: int, prefix: int, iters: int) -> dict:
    """transformers' Phi (Moondream 2's text decoder) decode step + argmax in one CUDA graph."""
    import torch
    from transformers import PhiConfig, PhiForCausalLM, StaticCache
    if dry:
        cfg = PhiConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                        num_attention_heads=2, partial_rotary_factor=0.5, max_position_embeddings=64)
    else:
        cfg = PhiConfig(vocab_size=51200, hidden_size=2048, intermediate_size=8192, num_hidden_layers=24,
                        num_attention_heads=32, partial_rotary_factor=0.5, max_position_embeddings=2048)
    dtype = torch.bfloat16
    with torch.device(dev):
        model = PhiForCausalLM(cfg).to(dtype).eval()
    cache = StaticCache(config=cfg, max_cache_len=prefix + 16)
    with torch.inference_mode():
        ids = torch.randint(0, cfg.vocab_size, (batch, prefix), device=dev)
        model(input_ids=ids, past_key_values=cache, use_cache=True, cache_position=torch.arange(prefix, device=dev))
        tok = torch.zeros(batch, 1, dtype=torch.long, device=dev)
        pos = torch.tensor([prefix], device=dev)
        nxt = torch.zeros(batch, dtype=torch.long, device=dev)

        def step() -> None:
            out = model(input_ids=tok, past_key_values=cache, use_cache=True, cache_position=pos)
            nxt.copy_(out.logits[:, -1].argmax(-1))
        us = replay_us(step, cuda, iters)
    return dict(peer="transformers Phi, one CUDA graph", batch=batch, prefix=prefix, us=round(us, 1))


def peer_whisper(dev: Any, cuda: bool, dry: bool, batch: int, position: int, enc: int, iters: int) -> dict:
    """transformers' Whisper decoder step (tiny.en shapes) + proj_out + argmax in one CUDA graph."""
    import torch
    from transformers import EncoderDecoderCache, StaticCache, WhisperConfig, WhisperForConditionalGeneration
    if dry:
        cfg = WhisperConfig(vocab_size=96, d_model=64, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                            decoder_attention_heads=2, decoder_ffn_dim=256, encoder_ffn_dim=256,
                            max_target_positions=16, max_source_positions=enc, pad_token_id=0, bos_token_id=1,
                            eos_token_id=2, decoder_start_token_id=1)
    else:
        cfg = WhisperConfig(vocab_size=51864, d_model=384, encoder_layers=4, decoder_layers=4,
                            encoder_attention_heads=6, decoder_attention_heads=6, decoder_ffn_dim=1536,
                            encoder_ffn_dim=1536, max_target_positions=448, max_source_positions=1500)
    dtype = torch.bfloat16
    with torch.device(dev):
        model = WhisperForConditionalGeneration(cfg).to(dtype).eval()
    dec = model.model.decoder
    cache = EncoderDecoderCache(StaticCache(config=cfg, max_cache_len=position + 16),
                                StaticCache(config=cfg, max_cache_len=enc))
    enc_out = torch.randn(batch, enc, cfg.d_model, device=dev, dtype=dtype)
    with torch.inference_mode():
        ids = torch.randint(0, cfg.vocab_size, (batch, position), device=dev)
        dec(input_ids=ids, encoder_hidden_states=enc_out, past_key_values=cache, use_cache=True,
            cache_position=torch.arange(position, device=dev))
        tok = torch.zeros(batch, 1, dtype=torch.long, device=dev)
        pos = torch.tensor([position], device=dev)
        nxt = torch.zeros(batch, dtype=torch.long, device=dev)

        def step() -> None:
            h = dec(input_ids=tok, encoder_hidden_states=enc_out, past_key_values=cache, use_cache=True,
                    cache_position=pos).last_hidden_state
            nxt.copy_(model.proj_out(h[:, -1]).argmax(-1))
        us = replay_us(step, cuda, iters)
    return dict(peer="transformers Whisper decoder, one CUDA graph", batch=batch, position=position, us=round(us, 1))


# ---------------------------------------------------------------- the run


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path(os.environ.get("BENCH_OUT", ROOT / "bench")))
    p.add_argument("--dry-run", action="store_true", help="CPU: tiny shapes under Triton's interpreter")
    p.add_argument("--budget-s", type=float, default=240.0, help="skip the optional parts past this")
    p.add_argument("--iters", type=int, default=100, help="CUDA-graph replays timed per variant (the dry run: "
                   "1, or 0 for none: each row's launch that checks it is its time, and no warm-up launches)")
    p.add_argument("--hbm-tbps", type=float, default=None,
                   help="HBM bandwidth for the floor (default: the device's, photon_core.gpu_proof.hbm)")
    args = p.parse_args(argv)
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"
    import torch
    import triton

    from photon_core.gpu_proof.hbm import hbm_tbps
    from photon_core.megakernel.kernel import KernelVariant
    args.out.mkdir(parents=True, exist_ok=True)
    OUT[:] = [args.out]
    cuda = torch.cuda.is_available() and not args.dry_run
    dev = torch.device("cuda" if cuda else "cpu")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count if cuda else 4
    device = torch.cuda.get_device_name() if cuda else "cpu (interpreter)"
    tbps, tbps_source = hbm_tbps(device, args.hbm_tbps)
    HBM["bytes_per_s"] = tbps * 1e12
    RESULTS["machine"] = dict(device=device, sms=sms, hbm_tbps=tbps, hbm_source=tbps_source,
                              python=sys.version.split()[0], torch=torch.__version__, triton=triton.__version__)
    # The dry run times nothing real: one replay per row, or none (--iters 0, the tests' choice: an
    # interpreted launch is most of a second; each row is still launched and checked once).
    iters = args.iters if cuda else min(1, args.iters)
    rate = copy_rate(dev, cuda)
    RESULTS["machine"]["copy_rate_tbps"] = round(rate / 1e12, 2)
    log(f"{RESULTS['machine']}")
    save(args.out)

    def left() -> float:
        return args.budget_s - (time.time() - T0)

    plain = KernelVariant()
    pipe4, pipe8 = KernelVariant(pipeline=4, aligned=True), KernelVariant(pipeline=8, aligned=True)
    pipe15 = KernelVariant(pipeline=15, aligned=True)
    pre1, pre2 = KernelVariant(prefetch=1), KernelVariant(prefetch=2)
    dot = KernelVariant(dot=64, pipeline=4)
    wide, wider = KernelVariant(wide=256, aligned=True), KernelVariant(wide=512, aligned=True)
    aligned, unrolled = KernelVariant(aligned=True), KernelVariant(unroll=4, aligned=True)
    # static: no claims, the next task's header loaded while one runs (per-task fixed time, issue 38.3)
    wider_static = KernelVariant(wide=512, aligned=True, static=True)
    unrolled8 = KernelVariant(unroll=8, aligned=True)
    unrolled8_static = KernelVariant(unroll=8, aligned=True, static=True)
    variants = ([plain, aligned, unrolled, wider, wider_static, wide, pipe4, pipe8, pre2, pre1, dot] if cuda
                else [plain, aligned, unrolled, wider, wider_static, wide, pipe4, dot])
    # wide256+aligned: its rows take turns in a loop since 2026-12-05 (no stack at batch 8, SASS)
    b8_name, b8_variants = "moondream2 B8 prod", [plain, unrolled, unrolled8, unrolled8_static, wide, pipe15, pre2]
    from photon_core.megakernel.kernel import Megakernel
    fams = families(args.dry_run, sms * Megakernel.tuning.programs_per_sm)
    pool = None
    if cuda:
        from photon_core.gpu_proof.prewarm import Prewarm
        pool = guarded("compile pool", Prewarm)

    def compile_in_pool(cfg: Config, vs: list, tr: list) -> list:
        """cfg's compiles submitted to the pool (none without one); their jobs' keys."""
        if pool is None:
            return []
        return guarded(f"compile {cfg.name}", lambda: submit_compiles(pool, cfg, vs, tr)) or []

    def wait_compiles(keys: list, need_after_s: float) -> None:
        """Wait for the jobs `keys` names, leaving `need_after_s` of the budget for what follows."""
        if pool is not None and keys:
            RESULTS.setdefault("compiles", []).extend(pool.wait(max(5.0, left() - need_after_s), keys=keys))
            checkpoint()

    # name, family maker, tiling, batch, variants, traced variants
    plan = [("moondream2 B1 prod", "moondream2", 1, 1, variants, [plain] + [pre2] * cuda),
            ("whisper-tiny.en B1 prod", "whisper-tiny.en", 1, 1, variants, [plain]),
            ("moondream2 B1 split", "moondream2", 2, 1, [plain] + [pre2] * cuda, []),
            ("whisper-tiny.en B1 split", "whisper-tiny.en", 2, 1, [plain] + [pre2] * cuda, [])]
    configs: list[tuple[Config, list, list]] = []
    first_keys: list = []
    for name, fam_name, tiling_at, batch, vs, tr in plan:
        make, *tilings = fams[fam_name]
        cfg = guarded(f"build {name}", lambda: Config(name, make(tilings[tiling_at - 1]), batch, dev))
        if cfg is None:
            continue
        configs.append((cfg, vs, tr))
        RESULTS.setdefault("builds", {})[name] = dict(tasks=len(cfg.step.graph.tasks), build_s=cfg.build_s)
        first_keys += compile_in_pool(cfg, vs, tr)
    cfg = None
    save(args.out)

    if not args.dry_run or os.environ.get("GPU_TIMELINE_PEERS", "1") == "1":
        rows = {c.name: c.rows for c, _, _ in configs}
        md = rows.get("moondream2 B1 prod")
        wh = rows.get("whisper-tiny.en B1 prod")
        peer_iters = max(1, iters)    # a peer has no checking launch to stand for its time
        for label, fn in (("peer phi B1", lambda: peer_phi(dev, cuda, args.dry_run, 1, md.positions[0], peer_iters)),
                          ("peer whisper B1", lambda: peer_whisper(dev, cuda, args.dry_run, 1, wh.positions[0],
                                                                    wh.cross_len[0], peer_iters))):
            r = guarded(label, fn)
            if r is not None:
                RESULTS.setdefault("peers", {})[label] = r
                log(f"{label}: {r['us']} us/step")
            save(args.out)

    # Moondream 2 B8's build (~28 s of host work) while the pool still has more than a wave of part 1's
    # compiles to do: hidden behind that wait instead of added after the measurements.
    b8, b8_keys = None, []
    if pool is not None:
        pending = sum(not f.done() for _, _, f in pool.jobs.values())
        if pending > pool.workers:
            log(f"building {b8_name} beside the pool's {pending} pending compiles ({pool.workers} workers)")
            make, prod, _ = fams["moondream2"]
            b8 = guarded(f"build {b8_name}", lambda: Config(b8_name, make(prod), 8, dev))
            if b8 is not None:
                b8_keys = compile_in_pool(b8, b8_variants, [])
                RESULTS.setdefault("builds", {})[b8_name] = dict(tasks=len(b8.step.graph.tasks), build_s=b8.build_s,
                                                                 early=True)
            save(args.out)
    wait_compiles(first_keys, 60.0)

    # Each configuration dropped once measured: its arenas and caches freed for the optional parts
    # (a Moondream 2 B1 config holds ~4-5 GB on the GPU; an H100 has 80 GB).
    while configs:
        cfg, vs, tr = configs.pop(0)
        guarded(f"measure {cfg.name}", lambda: measure(cfg, vs, tr, rate, cuda, iters))
        cfg = None
        save(args.out)
    free_memory(cuda)

    need = optional_need_s(b8_name, len(b8_variants), pool is not None, built=b8 is not None,
                           compiled=bool(b8_keys) and all(pool.jobs[k][2].done() for k in b8_keys))
    if cuda and left() >= need:
        if b8 is None:
            make, prod, _ = fams["moondream2"]
            b8 = guarded(f"build {b8_name}", lambda: Config(b8_name, make(prod), 8, dev))
            if b8 is not None:
                RESULTS.setdefault("builds", {})[b8_name] = dict(tasks=len(b8.step.graph.tasks), build_s=b8.build_s)
                b8_keys = compile_in_pool(b8, b8_variants, [])
        if b8 is not None:
            wait_compiles(b8_keys, OPTIONAL_S[b8_name][1])
            guarded(f"measure {b8_name}", lambda: measure(b8, b8_variants, [], rate, cuda, iters // 2))
    else:
        RESULTS["skipped"] = (f"{b8_name} (budget: {left():.0f} s left, {need:.0f} s needed)" if cuda else
                              f"{b8_name} (no GPU)")
        log(f"skipped {RESULTS['skipped']}")
    b8 = None
    free_memory(cuda)
    save(args.out)

    def optional(name: str, build: Callable[[], Config], vs: list, skipped_key: str, **kw: Any) -> bool:
        """One optional configuration: built, compiled in the pool and measured if the budget covers
        all three (else recorded under `skipped_key`); freed afterwards. Whether it ran."""
        need = optional_need_s(name, len(vs), pool is not None)
        if not (cuda and left() >= need):
            note = f"{name} (budget: {left():.0f} s left, {need:.0f} s needed)" if cuda else f"{name} (no GPU)"
            if skipped_key.startswith("skipped_linear"):
                RESULTS.setdefault(skipped_key, []).append(note)
            else:
                RESULTS[skipped_key] = note
            log(f"skipped {note}")
            save(args.out)
            return False
        cfg = guarded(f"build {name}", build)
        if cfg is not None:
            RESULTS.setdefault("builds", {})[name] = dict(tasks=len(cfg.step.graph.tasks), build_s=cfg.build_s)
            wait_compiles(compile_in_pool(cfg, vs, []), OPTIONAL_S[name][1])
            guarded(f"measure {name}", lambda: measure(cfg, vs, [], rate, cuda, iters // 2, **kw))
        cfg = None
        free_memory(cuda)
        save(args.out)
        return True

    # Dense linear tasks of 4 column tiles (Tiling.linear_span 4, kernel.LTILES), built for this to
    # measure: the cost model predicts Whisper tiny.en B1 -20%, Moondream 2 B1 -12%; span 1 is the default.
    for fam_name in ("whisper-tiny.en", "moondream2"):
        make, prod, _ = fams[fam_name]
        name = f"{fam_name} B1 prod linear span4"
        optional(name, lambda: Config(name, make(lambda b: replace(prod(b), linear_span=4)), 1, dev),
                 [plain, wider], "skipped_linear_span4")

    if "moondream3" in fams:
        make, prod, _ = fams["moondream3"]
        name = "moondream3 B1 bf16 experts"
        # The wide build streams the experts in wide steps (16 KB a trip, issue 38.3); the per-op
        # engine's chained build runs the experts as kernels/chained.moe (predicted the fastest).
        # (auto's choice not asked: its compiles of Moondream 3's builds could outrun the call)
        if optional(name, lambda: Config(name, make(prod), 1, dev), [plain, wider], "skipped_moondream3",
                    perop=True, choose=False):
            # expert tasks of several column tiles (Tiling.expert_span 4, kernel.XTILES): the cost model
            # predicts 1.2-1.6x on Moondream 3.1's step; span 1 above is the default until this measures
            # it. The span-1 build's arena (~18 GB of bf16 at real size) was freed first (optional).
            name = "moondream3 B1 bf16 experts span4"
            optional(name, lambda: Config(name, make(lambda b: replace(prod(b), expert_span=4)), 1, dev),
                     [plain, wider], "skipped_moondream3_span4")
    else:
        RESULTS["skipped_moondream3"] = "moondream3 B1 (no decode step in this tree)"
    RESULTS["seconds"] = round(time.time() - T0, 1)
    save(args.out)
    log(f"done: {len(RESULTS.get('failures', []))} failed parts")
    if pool is not None:
        pool.close()
    return 1 if RESULTS.get("failures") else 0


def free_memory(cuda: bool) -> None:
    """Collect what the dropped configurations held and give the GPU memory back to the driver."""
    gc.collect()
    if cuda:
        import torch
        torch.cuda.empty_cache()


if __name__ == "__main__":
    sys.exit(main())
