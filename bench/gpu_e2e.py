"""A skill's whole latency on a GPU, phase by phase, against what users would run instead (issue 39):
one prepared run of <= 5 minutes for the device tool, random weights of the real shapes, nothing
downloaded. Also its CPU dry run (tiny shapes, every phase timed, the peers' code run on the CPU) and
the CPU figures (real shapes on the CPU).

    timeout 300 python3 bench/gpu_e2e.py --out $OUT --moondream-ref .moondream-ref --write   (device tool,
        timeout_s 330, carry [".moondream-ref"]: the reference's checkout copied into the repository
        beforehand, ignored by git: cp -r $MOONDREAM_REF_SRC .moondream-ref; echo /.moondream-ref/ >>
        .git/info/exclude); a later call: the same with --only <the families it skipped>
    python bench/gpu_e2e.py --plan                         (the plan and its estimates; no model built)
    python bench/gpu_e2e.py --dry-run --out /tmp/e2e       (CPU: tiny shapes, reference backend)
    python bench/gpu_e2e.py --device cpu --only moondream2 --levels 1 --write   (CPU figures)

Families (e2e_families.ORDER, most important first) and their peers: Moondream 2 and 3.1 (detect,
point, caption, query on a 756x756 image and a 1920x1080 frame, as JPEG bytes; peer: the public
Moondream reference, Moondream 2 only, from --moondream-ref or MOONDREAM_REF_SRC, skipped with the
reason when absent), Qwen 3.5 0.8B and Gemma 4 E2B (caption, query; peer: transformers' generate with
a static cache), Whisper large-v3-turbo and tiny.en, Parakeet TDT 0.6B, Qwen3-ASR 0.6B (5 s and 30 s
of audio; peer: transformers). Each family module's docstring says how both sides are made to do
the same work. Concurrency c (--levels, default 1, 8, 4): c requests at once, each with its own
image or clip; ours serves them as one batch, transformers as one batched generate, the reference
one after another.

Per configuration (family, task, c, side): a warm-up call (first-call costs: per-op Triton
compiles, a bucket's build), `--repeats` timed calls (fewer for slow ones; median), then one call
with the phase hooks (e2e_phases: image decode, crops / log-mel, encoder, prefill, decode; time to
first token). Results go to --out (BENCH_OUT) after every configuration: gpu_e2e.json and
gpu_e2e.md (the table); with --write the table also replaces its section of bench/RESULTS.md (a copy
lands in --out, as the device's working tree does not come back).

Budget: --budget-s (default 270 s from the start; the device tool's timeout_s should leave ~30 s
more). The plan (e2e_plan) is printed first; a configuration whose estimate (scaled by what its
family measured so far) would pass the budget is skipped, and the results say so. On CUDA, child
processes (--prewarm, default 4) build every family's decode buckets ahead of the measurements
(e2e_prewarm), sharing the build cache and Triton's cache in --cache-dir.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import signal
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

T0 = time.time()
ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT, ROOT / "test", ROOT / "bench"):
    sys.path.insert(0, str(p))

from photon_core.gpu_proof.results_file import replace_whole  # noqa: E402
import e2e_plan as plan_mod  # noqa: E402
from e2e_families import ORDER, family_class  # noqa: E402

SECTION = {"cuda": "End to end on GPU: whole skills against their peers (random weights, real shapes)",
           "cpu": "End to end on CPU: whole skills against their peers (random weights, real shapes)"}


def log(msg: str) -> None:
    print(f"[{time.time() - T0:6.1f} s] {msg}", flush=True)


# ------------------------------------------------------------------------------- measuring


def sync(device: Any) -> None:
    if device.type == "cuda":
        import torch
        torch.cuda.synchronize()


def measure(fam: Any, cfg: plan_mod.Config, repeats: int, device: Any) -> dict[str, Any]:
    """One configuration: warm-up, timed repeats, one instrumented call."""
    side = "peer" if cfg.side.startswith("peer") else "ours"
    run = getattr(fam, side)
    clock = fam.sides[side].clock
    inputs = fam.inputs(cfg.task, cfg.concurrency)
    sync(device)
    t = time.perf_counter()
    tokens = run(cfg.task, inputs)
    sync(device)
    first = time.perf_counter() - t
    # --repeats 0 (the dry run's tests: every path, no figures): no timed call after the warm-up,
    # whose time stands for the latency.
    n = plan_mod.repeats_for(first, repeats) if repeats else 0
    times = []
    for _ in range(n):
        sync(device)
        t = time.perf_counter()
        tokens = run(cfg.task, inputs)
        sync(device)
        times.append(time.perf_counter() - t)
    clock.events.clear()
    sync(device)
    t0 = time.perf_counter()
    with clock.installed():
        run(cfg.task, inputs)
    sync(device)
    s = clock.summary(t0, time.perf_counter())
    lat = statistics.median(times) if times else first
    return dict(latency_s=lat, times_s=times, throughput_rps=cfg.concurrency / lat, first_call_s=first,
                ttft_s=s["ttft"], phases_s=s["phases"], instrumented_s=s["whole"], tokens=tokens, repeats=n)


def derived(one: dict[str, Any], c: int) -> dict[str, Any]:
    """A serial peer at concurrency c from its concurrency-1 row: c requests queue, request i ends
    after i + 1 requests' time, so the mean latency is (c + 1) / 2 of one, the mean time to first
    token one's plus (c - 1) / 2 requests, and the throughput stays one request's."""
    t = one["latency_s"]
    ttft = one["ttft_s"]
    return dict(latency_s=t * (c + 1) / 2, times_s=[], throughput_rps=1 / t, first_call_s=None,
                ttft_s=None if ttft is None else ttft + t * (c - 1) / 2, phases_s=one["phases_s"],
                instrumented_s=None, tokens=one["tokens"], repeats=0, derived=True)


# ------------------------------------------------------------------------------- the run


class Run:
    def __init__(self, args: argparse.Namespace) -> None:
        import torch
        self.args = args
        self.device = torch.device(args.device)
        self.dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
        self.out: dict[str, Any] = dict(rows=[], skipped=[], failures=[], families={}, prewarm=[])
        self.budget = plan_mod.Budget(args.budget_s, T0)
        args.out.mkdir(parents=True, exist_ok=True)

    def save(self) -> None:
        self.out["seconds"] = round(time.time() - T0, 1)
        replace_whole(self.args.out / "gpu_e2e.json", json.dumps(self.out, indent=1, default=str))
        replace_whole(self.args.out / "gpu_e2e.md", "\n".join(self.section()) + "\n")

    def fail(self, what: str, e: BaseException) -> None:
        log(f"{what} FAILED: {type(e).__name__}: {e}")
        self.out["failures"].append(dict(part=what, error=f"{type(e).__name__}: {e}"[:600],
                                         trace=traceback.format_exc()[-2000:]))

    def machine(self) -> dict[str, Any]:
        import torch
        from report import machine
        m = dict(host=machine(), python=sys.version.split()[0], torch=torch.__version__,
                 load_1min=round(os.getloadavg()[0], 2))
        for mod in ("transformers", "triton"):
            try:
                m[mod] = __import__(mod).__version__
            except ImportError:
                m[mod] = None
        if self.device.type == "cuda":
            m["gpu"] = torch.cuda.get_device_name()
        return m

    def check_device(self) -> None:
        """What the timed paths compute on the device, checked first (e2e_checks)."""
        import e2e_checks
        try:
            r = e2e_checks.crops_match_pil(self.device, e2e_checks.DRY_FRAMES if self.args.dry_run else e2e_checks.FRAMES)
            self.out["checks"] = {"crops_match_pil": r}
            log(f"crops on {self.device} = PIL's: {r['ok']} ({r['frames']})")
            if not r["ok"]:
                self.fail("crops on the device", RuntimeError(f"not PIL's bytes: {r['frames']}"))
        except Exception as e:  # noqa: BLE001  the timing still runs
            self.fail("crops on the device", e)
        self.save()

    def main(self) -> int:
        a = self.args
        self.out["machine"] = self.machine()
        self.out["args"] = {k: str(v) for k, v in vars(a).items()}
        log(f"machine: {self.out['machine']}")
        families = a.only or list(ORDER)
        classes = {f: family_class(f) for f in families}
        tasks = {f: classes[f].tasks() for f in families}
        if a.tasks:
            tasks = {f: [t for t in ts if any(w in t.name for w in a.tasks)] for f, ts in tasks.items()}
        if a.dry_run:   # a quarter of each budget: the dry run checks the paths, it measures nothing
            tasks = {f: [dataclasses.replace(t, tokens=max(2, t.tokens // 4)) for t in ts] for f, ts in tasks.items()}
        serial = {"moondream2"}
        no_peer = {"moondream3"}
        cfgs = plan_mod.configs(families, tasks, a.levels, serial, no_peer, a.compile_peers, a.measure_serial)
        # Our decode buckets are compiled on the megakernel backend (auto's choice on CUDA; on the
        # CPU, Triton's interpreter); the plan speaks of an H200 run, whatever the device here.
        compiles = a.backend == "megakernel" or self.device.type == "cuda" and a.backend == "auto" or a.plan
        from photon_core.runtime.decode import bucket_for
        levels = tuple(sorted({1, *(bucket_for(c) for c in a.levels)}))
        buckets = {f: levels if compiles and f != "parakeet-tdt-0.6b" else () for f in families}
        setups = {f: plan_mod.family_setup_s(f, buckets[f], a.prewarm > 0 or a.plan) for f in families}
        lines = plan_mod.table(cfgs, a.repeats, setups)
        print("\n".join(lines), flush=True)
        self.out["plan"] = lines
        self.save()
        if a.plan:
            return 0
        self.check_device()
        # Children only for the families the plan expects to reach within the budget.
        starts = plan_mod.family_starts(cfgs, a.repeats, setups)
        reached = [f for f in families if starts.get(f, 0.0) < a.budget_s]
        prewarm = self.start_prewarm(reached, buckets) if a.prewarm > 0 else None
        try:
            for f in families:
                self.family(f, [c for c in cfgs if c.family == f], prewarm, buckets[f])
        finally:
            if prewarm is not None:
                prewarm.close()
                self.out["prewarm"] = prewarm.results
            self.save()
        if a.write:
            self.write()
        log(f"done: {len(self.out['rows'])} rows, {len(self.out['skipped'])} skipped, "
            f"{len(self.out['failures'])} failed parts")
        return 1 if self.out["failures"] else 0

    def start_prewarm(self, families: list[str], buckets: dict[str, tuple[int, ...]]) -> Any:
        from e2e_prewarm import Job, Prewarm, child_env, gpu_room, script_command
        a = self.args
        # concurrency order: 1, then the largest (the order the measurements need them)
        jobs = [Job(f, b) for f in families for b in sorted(buckets[f], key=lambda b: (b != 1, -b))]
        if not jobs:
            return None
        common = ["--device", a.device, "--dtype", a.dtype, "--backend", a.backend]
        common += ["--dry-run"] * a.dry_run
        pw = Prewarm(script_command(__file__, common), jobs, a.prewarm, child_env(str(a.cache_dir)),
                     room=gpu_room(30.0) if self.device.type == "cuda" else (lambda: True))
        pw.pump()
        log(f"prewarm: {len(jobs)} children, {a.prewarm} at a time")
        return pw

    def family(self, name: str, cfgs: list[plan_mod.Config], prewarm: Any, buckets: tuple[int, ...]) -> None:
        import torch
        a = self.args
        info: dict[str, Any] = self.out["families"].setdefault(name, {})
        est = plan_mod.family_setup_s(name, buckets, prewarm is not None)
        if self.budget.left(time.time()) < est + 5:
            for c in cfgs:
                self.out["skipped"].append(dict(config=c.key, reason=f"budget: {self.budget.left(time.time()):.0f} s "
                                                 f"left, the family's setup alone needs ~{est:.0f} s"))
            log(f"{name}: skipped (budget)")
            self.save()
            return
        cls = family_class(name)
        refusal = cls.cpu_refusal() if self.device.type == "cpu" and not a.dry_run else None
        if refusal:
            for c in cfgs:
                self.out["skipped"].append(dict(config=c.key, reason=refusal))
            info.update(peer_skip=refusal, notes=[])
            log(f"{name}: skipped ({refusal})")
            self.save()
            return
        dtype = self.dtype
        if self.device.type == "cpu" and not a.dry_run and cls.cpu_dtype():
            dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[cls.cpu_dtype()]
            info["dtype"] = cls.cpu_dtype()
        if prewarm is not None:
            prewarm.wait(name, (1,), timeout_s=max(0.0, self.budget.left(time.time()) - 60))
        t = time.time()
        try:
            fam = cls(self.device, dtype, a.dry_run, a.backend, a.moondream_ref)
            fam.setup()
        except Exception as e:  # noqa: BLE001  one family's failure must not end the run
            self.fail(f"setup {name}", e)
            for c in cfgs:
                self.out["skipped"].append(dict(config=c.key, reason=f"setup failed: {type(e).__name__}"))
            self.save()
            return
        info.update(setup_s=round(time.time() - t, 1), peer=fam.sides["peer"].label,
                    peer_skip=fam.sides["peer"].skip, notes=fam.notes + fam.sides["peer"].notes, kind=fam.kind)
        log(f"{name}: set up in {info['setup_s']} s" + (f"; peer skipped: {fam.sides['peer'].skip}"
                                                         if fam.sides["peer"].skip else ""))
        self.save()
        seen: set[tuple[str, str]] = set()
        ones: dict[tuple[str, str], dict[str, Any]] = {}
        for cfg in cfgs:
            side = "peer" if cfg.side.startswith("peer") else "ours"
            if fam.sides[side].skip:
                self.out["skipped"].append(dict(config=cfg.key, reason=fam.sides[side].skip))
                continue
            shape = (cfg.task.input, cfg.side)
            first_of_shape = shape not in seen
            est = self.budget.estimate(cfg, a.repeats, first_of_shape)
            left = self.budget.left(time.time())
            if est > left:
                self.out["skipped"].append(dict(config=cfg.key,
                                                reason=f"budget: ~{est:.0f} s estimated, {left:.0f} s left"))
                log(f"skip {cfg.key}: ~{est:.0f} s estimated, {left:.0f} s left")
                continue
            if cfg.side == "peer+compile" and not getattr(fam, "peer_compiled", False):
                fam.compile_peer()
            if prewarm is not None and side == "ours" and buckets:
                from photon_core.runtime.decode import bucket_for
                prewarm.wait(name, (bucket_for(cfg.concurrency),), timeout_s=max(0.0, left - est - 10))
            seen.add(shape)
            t = time.time()
            try:
                r = measure(fam, cfg, a.repeats, self.device)
            except Exception as e:  # noqa: BLE001
                self.fail(cfg.key, e)
                self.save()
                continue
            took = time.time() - t
            self.budget.learn(cfg, a.repeats, first_of_shape, took)
            if cfg.concurrency == 1:
                ones[(cfg.task.name, cfg.side)] = r
            self.add_row(fam, cfg, r, prewarm)
            if prewarm is not None:
                prewarm.pump()     # start the next children as earlier ones end
            if fam.sides[side].serial and cfg.concurrency == 1 and not a.measure_serial:
                for c in sorted({*a.levels} - {1}):
                    self.add_row(fam, plan_mod.Config(name, cfg.task, c, cfg.side), derived(r, c), prewarm)
            self.save()
        # what backend "auto" chose on this GPU: each decode bucket's engine, each many-row shape's
        # linear / attention, each encoder shape's eager call or graph replay (issues 38.4 and 39.2)
        from photon_core.runtime.decode import engine_choices
        from photon_core.runtime.measured import choices
        from photon_core.runtime.shape_graphs import graph_choices
        info["decode_engines"] = {f"{c.model} B{c.batch}": c.line() for c in engine_choices()}
        info["op_choices"] = {" ".join(map(str, k)): dict(chosen=v, ms={n: round(t * 1e3, 3) for n, t in ts.items()})
                              for k, (v, ts) in choices().items()}
        info["encoder_graphs"] = {f"{k[0]} {k[2]}": dict(chosen=v, ms={n: round(t * 1e3, 3) for n, t in ts.items()})
                                  for k, (v, ts) in graph_choices().items()}
        self.save()
        del fam
        gc.collect()
        if self.device.type == "cuda":
            import torch
            torch.cuda.empty_cache()

    def add_row(self, fam: Any, cfg: plan_mod.Config, r: dict[str, Any], prewarm: Any) -> None:
        side = "peer" if cfg.side.startswith("peer") else "ours"
        row = dict(family=cfg.family, kind=fam.kind, task=cfg.task.name, skill=cfg.task.skill, input=cfg.task.input,
                   budget_tokens=cfg.task.tokens, concurrency=cfg.concurrency, side=cfg.side,
                   label=fam.sides[side].label + ("+compile" if cfg.side == "peer+compile" else ""),
                   children_running=prewarm.running() if prewarm is not None else 0, **r)
        self.out["rows"].append(row)
        ttft = "-" if r["ttft_s"] is None else f"{r['ttft_s'] * 1e3:.1f}"
        ph = " ".join(f"{k}={v * 1e3:.1f}" for k, v in r["phases_s"].items())
        log(f"{cfg.key}: {r['latency_s'] * 1e3:.1f} ms" + (" (derived)" if r.get("derived") else
                                                          f" (first {r['first_call_s']:.2f} s, x{r['repeats']})")
            + f", ttft {ttft} ms, {r['throughput_rps']:.2f} req/s; {ph}")

    # ------------------------------------------------------------------------------- the table

    def section(self) -> list[str]:
        from e2e_report import section
        return section(self.out, self.args)

    def write(self) -> None:
        from report import RESULTS, replace_section
        if self.args.dry_run:
            log("--write ignored for a dry run (tiny shapes are not figures)")
            return
        text = "\n".join(self.section()) + "\n"
        RESULTS.write_text(replace_section(RESULTS.read_text(), text))
        replace_whole(self.args.out / "RESULTS.md", RESULTS.read_text())
        log(f"wrote the section into {RESULTS} (and a copy in {self.args.out})")


# ------------------------------------------------------------------------------- a prewarm child


def child(args: argparse.Namespace) -> int:
    import torch
    t = time.time()
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    fam = family_class(args.child)(torch.device(args.device), dtype, args.dry_run, args.backend, None)
    fam.with_peer = False
    fam.setup()
    setup = time.time() - t
    res = fam.warm_bucket(args.bucket)
    print(json.dumps(dict(setup_s=round(setup, 1), warm_s=round(time.time() - t - setup, 1), **res)), flush=True)
    return 0


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("BENCH_OUT", tempfile.gettempdir() + "/gpu_e2e")))
    ap.add_argument("--device", default=None, help="cuda (default when there is one) or cpu")
    ap.add_argument("--dtype", choices=("bf16", "fp32"), default=None, help="default: bf16 on CUDA, fp32 on the CPU")
    ap.add_argument("--backend", default="auto", help="ours: auto (megakernel on CUDA, reference on the CPU), "
                    "reference, triton or megakernel (on the CPU: Triton's interpreter, tiny shapes only)")
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes (on the CPU unless --device says)")
    ap.add_argument("--only", nargs="*", choices=ORDER, help="families (default: all, in run order)")
    ap.add_argument("--tasks", nargs="*", help="only tasks whose name holds one of these (e.g. 'detect 756', '30 s')")
    ap.add_argument("--levels", default=None, help="concurrency levels (default 1,8,4; dry run 1,2)")
    ap.add_argument("--repeats", type=int, default=None, help="timed calls per configuration, fewer for slow "
                    "calls (default 3; dry run 1; 0: none, the warm-up call's time is the latency)")
    ap.add_argument("--budget-s", type=float, default=None, help="skip what would pass this (default 270 on CUDA)")
    ap.add_argument("--moondream-ref", default=os.environ.get("MOONDREAM_REF_SRC"),
                    help="folder holding moondream/torch/ of github.com/vikhyat/moondream (default $MOONDREAM_REF_SRC)")
    ap.add_argument("--compile-peers", action="store_true", help="also the peers with torch.compile (minutes each)")
    ap.add_argument("--measure-serial", action="store_true", help="measure the serial peer at every level")
    ap.add_argument("--prewarm", type=int, default=None, help="child processes building our buckets ahead "
                    "(default 4 on CUDA, 0 on the CPU)")
    ap.add_argument("--cache-dir", type=Path, default=Path(tempfile.gettempdir()) / "photon-e2e-cache",
                    help="the build cache and Triton's cache the run and its children share")
    ap.add_argument("--plan", action="store_true", help="print the plan and stop")
    ap.add_argument("--write", action="store_true", help="replace this benchmark's section of bench/RESULTS.md")
    # A prewarm child of a family not known fails here, before torch and transformers load.
    ap.add_argument("--child", choices=ORDER, help=argparse.SUPPRESS)
    ap.add_argument("--bucket", type=int, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.device is None:
        import torch
        a.device = "cuda" if torch.cuda.is_available() and not a.dry_run else "cpu"
    a.dtype = a.dtype or ("bf16" if a.device == "cuda" else "fp32")
    a.levels = tuple(int(x) for x in str(a.levels or ("1,2" if a.dry_run else "1,8,4")).split(","))
    a.repeats = a.repeats if a.repeats is not None else 1 if a.dry_run else 3
    if a.budget_s is None:
        a.budget_s = 270.0 if a.device == "cuda" else float("inf")
    if a.prewarm is None:
        a.prewarm = 4 if a.device == "cuda" else 0
    if a.dry_run and a.write:
        ap.error("--write takes real shapes only (not --dry-run)")
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    if a.backend == "megakernel" and a.device == "cpu" or a.dry_run and a.backend in ("triton", "megakernel"):
        os.environ.setdefault("TRITON_INTERPRET", "1")   # before triton is first imported
    if a.prewarm or a.child:
        from e2e_prewarm import child_env
        os.environ.update(child_env(str(a.cache_dir)))
    try:   # transformers' advice on generation settings fills the log; the results say what ran
        import warnings

        import transformers
        transformers.logging.set_verbosity_error()
        warnings.filterwarnings("ignore", category=UserWarning, module="transformers")
    except ImportError:
        pass
    if a.child:
        return child(a)
    # A kill (the device tool's timeout, `timeout`) unwinds like an error: the prewarm children are
    # ended and the results saved (Run.main's finally) instead of outliving the run.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    return Run(a).main()


if __name__ == "__main__":
    sys.exit(main())
