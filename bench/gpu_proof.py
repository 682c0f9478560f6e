"""Proof that the decode megakernel is right on a GPU, and what it costs: every part of the spec's
"Proving it on a GPU" (/work/shared/specs/megakernel.md), for every compiled family's step graph,
failing loudly (exit status 1 on any failed check).

    python bench/gpu_proof.py [--write]     # a CUDA GPU: real shapes, random weights (5-7 min on an H200 for
                                            # Whisper + Moondream 2, est.; the GraphFamily ones add more)
    python bench/gpu_proof.py --dry-run     # CPU, TRITON_INTERPRET=1, tiny shapes: every part's machinery
    BENCH_OUT=$OUT bash bench/gpu.sh --write   # in a GPU session: this proof, then bench/gpu_bench.py

Families (random weights of the real shapes: no checkpoint travels to a GPU session), each with the
tiling photon_core builds today (Tiling()) unless named otherwise:
  whisper-tiny.en        d 384, 6 heads, 4 layers, vocab 51864, 448 positions, 1500 encoder frames
  whisper-turbo          large-v3-turbo's decoder: d 1280, 20 heads, 4 layers, vocab 51866
  moondream2             MoondreamConfig(): d 2048, 32 heads, 24 layers, vocab 51200, region heads
  whisper-tiny.en/split  tiny.en with the roofline's GPU tiling (few-tile stages narrowed, split-K)
and, through one generic GraphFamily over any step graph (random weights from graph.weight_shapes,
run_reference the only reference; bf16 weights, batch 1 and 8, parts steps, poison and timing):
  qwen3-asr-0.6b         Qwen3-0.6B's decoder: d 1024, 16 / 8 KV heads of 128, 28 layers, vocab
                         151936, 1024 positions; the kernel advances rows itself
  qwen3.5-0.8b           d 1024, 24 layers (18 Gated DeltaNet with conv / delta-rule states, 6 gated
                         attention), vocab 248320, 1024 positions
  gemma4-e2b             E2B's text decoder: 35 layers, 512-slot sliding-window rings (rows cross
                         them), 20 KV-shared layers, per-layer inputs, vocab 262144, 1024 positions
  moondream3             Moondream 3.1 9B-A2B (if its decode step exists): tau attention, 20 MoE
                         layers of 64 experts (top 8), region heads, 1024 positions

Parts (each prints its elapsed time; the JSON is rewritten after every part, so a run killed by a
timeout still leaves what it proved):
  1 steps     consecutive decode steps at batch 1 and 8 (rows at different positions), fp32 and bf16
              weights, each step a CUDA-graph replay (Whisper: advance mode, the kernel writes the next
              token and position itself; Moondream: the host writes the next input embedding and
              positions in place). After every step: exposed values (logits, hidden), every argmax
              result, the appended K/V (in a ring cache: the slot its position maps to), recurrent
              states and the advanced tokens/positions vs stepgraph.run_reference on the same graph
              and the family's own reference_step (where it has one); error flag and claim counter.
              References use the weights as the arena holds them (bf16-rounded for bf16), so both
              dtypes must agree to fp32 rounding; caches past each row's length hold NaN.
  2 stress    fixed inputs, >= 1000 launches with 1, 3, #SMs and 2x#SMs programs while another stream
              copies 512 MB buffers: every launch's outputs (values, partials, results, the cache
              slots it writes) bit-identical to the first. Every other launch follows a NaN-fill of
              the scratch, so a read that overtakes its producer shows (stale values would not).
  3 poison    NaN-fill the scratch (not caches, not inputs) before every launch: no value left
              unwritten, outputs finite where the reference is, bit-identical to the unpoisoned ones.
  4 control   drop one dependency wait on purpose: the checker must reject the graph, and the stress
              of part 2, launched bypassing the checker, must see outputs differ (else the stress is
              too weak and the proof fails). Also the same task moved before its producer: a forced
              worst-case interleaving the stress must catch, on the GPU and under the interpreter.
  5 liveness  a wait nobody signals, small spin limit: in a subprocess with a timeout, the launch
              must return and raise_on_error must name that task (a hang fails instead of hanging).
  6 rounds    the production decode loop (photon_core.megakernel.decode_loop) of every family whose
              step advances itself, in the stress dtype from the same random state three ways: the
              host driving each step (launch, error flag, claim count and token read back: the old
              path), one captured step replayed per token with one read each, rounds of up to 8
              steps per CUDA-graph replay with one read per round, and the same rounds with the
              token picked by torch ops on the exposed logits (Whisper's path); and of Moondream 2,
              whose step is fed embeddings, host-driven vs rounds whose device ops embed each token
              into the next input (`feed`), and its detect/point rounds (object_rounds.py: device
              ops choose encoded coordinates, sizes or embeddings) captured vs launched eagerly.
              Tokens identical; time per token of each (host clock around whole requests, median).
  7 timing    CUDA events, warm-up, median of many replays of the step's CUDA graph: time per step,
              bytes / time, time / HBM floor (bytes = weights once + K/V read), the ratio to Whisper's
              per-op Triton step in a CUDA graph, and batch 8 vs 1. Only after every correctness
              check passed (--time-anyway overrides); --budget-s skips timing (never the
              correctness parts) when the run's time is short, and says so.

Under the interpreter programs run one after another, so no race can show: the dry run's positive
control checks the checker's rejection, the stress loop's machinery and the forced interleaving.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import json
import math
import os
import subprocess
import sys
import time
import traceback
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Iterator

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from gpu_common import graphed, timer  # noqa: E402

PARTS = ("steps", "stress", "poison", "control", "liveness", "rounds", "timing")
TOL = 1e-3            # max |mk - ref| / max |ref|, both dtypes (the references use the arena's weights)
# Polls before a wait gives up (~1 s; the longest legitimate wait, 3 programs behind a whole LM
# head, is milliseconds): a lost signal becomes an error, not a hang that eats the GPU session.
GPU_SPIN_LIMIT = 1 << 20
FP32_NOTE = 1e-4      # fp32 errors above this are flagged in the summary (expected: ~1e-6)


@dataclass(frozen=True)
class Sizes:
    """How much each part does: GPU sizes are meant to fit 5-7 minutes on an H200 (an estimate: the
    time caps and --budget-s bound what the estimate cannot), dry-run ones half a minute of the CPU
    interpreter."""
    steps: int
    launches: int             # race stress per program count
    min_launches: int         # what a time cap may reduce a slow (few-program) stress to
    cap_few_s: float          # time cap per stress with fewer programs than SMs (they cannot race much)
    cap_many_s: float         # time cap per stress with >= #SMs programs
    poison_launches: int
    control_launches: int     # launches the dropped-wait stress gets to show a difference
    iters: int
    warmup: int
    liveness_timeout_s: float
    round_tokens: int         # tokens per request in part 6 (launches: one fewer)
    round_repeats: int        # timed requests per way of decoding (median)


GPU_SIZES = Sizes(64, 1000, 10, 3.0, 30.0, 100, 1000, 200, 20, 180.0, 33, 5)
DRY_SIZES = Sizes(2, 2, 2, float("inf"), float("inf"), 2, 2, 1, 0, 120.0, 4, 1)


# ---------------------------------------------------------------------------------------------------
# Bookkeeping


class Checks:
    """Every check's outcome; any failure makes the exit status 1."""

    def __init__(self) -> None:
        self.passed = 0
        self.failed: list[str] = []

    def expect(self, ok: bool, what: str) -> bool:
        if ok:
            self.passed += 1
        else:
            self.failed.append(what)
            print(f"    FAIL: {what}", flush=True)
        return bool(ok)


@dataclass
class Ctx:
    args: argparse.Namespace
    dev: Any                   # torch.device
    cuda: bool
    sizes: Sizes
    sms: int
    checks: Checks
    out: dict
    t0: float = field(default_factory=time.time)
    builds: dict = field(default_factory=dict)
    arenas: dict = field(default_factory=dict)     # id(fp32 arena) -> {dtype: arena}
    probes: dict = field(default_factory=dict)
    noise: Any = None

    def elapsed(self) -> float:
        return time.time() - self.t0

    def left(self) -> float:
        return self.args.budget_s - self.elapsed()

    def programs(self) -> tuple[int, ...]:
        return (1, 3, self.sms, 2 * self.sms) if self.cuda else (1, 3)

    def sync(self) -> None:
        if self.cuda:
            import torch
            torch.cuda.synchronize()

    def save(self) -> None:
        self.out["seconds"] = round(self.elapsed(), 1)
        self.out["checks"] = dict(passed=self.checks.passed, failed=self.checks.failed)
        self.out["passed"] = not self.checks.failed
        if self.args.json:
            Path(self.args.json).write_text(json.dumps(self.out, indent=1, default=str))


def rel_err(got, want) -> float:
    """max |got - want| / max |want| over the entries where `want` is finite; inf when the two
    disagree on which entries are finite (a NaN or a lost -inf mask)."""
    import torch
    got, want = got.float(), want.float()
    finite = torch.isfinite(want)
    if not torch.equal(torch.isfinite(got), finite) or not bool(
            torch.equal(got[~finite], want[~finite]) if (~finite).any() else True):
        return float("inf")
    if not finite.any():
        return 0.0
    return ((got[finite] - want[finite]).abs().max() / want[finite].abs().max().clamp_min(1e-30)).item()


def argmax_ok(chosen: list[int], values, tol: float = TOL) -> tuple[int, int]:
    """(exact, tolerated) of the kernel's argmax picks against the reference's values [B, C]: a
    pick that differs must be a near-tie (within tol x max |value|) in the reference's own values."""
    import torch
    exact = tolerated = 0
    scale = values[torch.isfinite(values)].abs().max().item() if torch.isfinite(values).any() else 1.0
    for r, c in enumerate(chosen):
        row = values[r]
        best = int(row.argmax())
        if c == best:
            exact += 1
        elif 0 <= c < row.numel() and row[c].item() >= row[best].item() - tol * scale:
            tolerated += 1
    return exact, tolerated


# ---------------------------------------------------------------------------------------------------
# Families: random weights of real shapes, the compiled steps, inputs and their own references


@dataclass
class Rows:
    tokens: list[int]
    positions: list[int]
    cross_len: list[int] | None


def spaced(batch: int, start: int, spacing: int) -> list[int]:
    """Row positions start, start + spacing, ...: rows at different positions."""
    return [start + spacing * r for r in range(batch)]


class WhisperFamily:
    """Whisper's decoder step (models/whisper/decoder_step.py) on WhisperDecoderWeights.random."""
    advance = True     # the step graph can advance itself: replays decode onwards with no host write

    def __init__(self, name: str, d: int, heads: int, layers: int, vocab: int, max_len: int, enc_len: int,
                 tiling: Callable[[int], Any], batches: tuple[int, ...], dtypes: tuple[str, ...],
                 stress_dtype: str, steps_rows: tuple[int, int], fixed_rows: tuple[int, int],
                 perop: bool = True, control: bool = False, parts: tuple[str, ...] = PARTS) -> None:
        self.name, self.shape, self.parts = name, (d, heads, layers, vocab), parts
        self.max_len, self.enc_len, self.tiling = max_len, enc_len, tiling
        self.batches, self.dtypes, self.stress_dtype = batches, dtypes, stress_dtype
        self.steps_rows, self.fixed_rows, self.perop, self.control = steps_rows, fixed_rows, perop, control
        self.wt = None
        self._ref: dict = {}

    def load(self, dev) -> None:
        from photon_core.models.whisper.decoder_step import WhisperDecoderWeights
        if self.wt is None:
            d, h, layers, vocab = self.shape
            self.wt = WhisperDecoderWeights.random(d, h, layers, vocab, n_ctx=self.max_len, seed=0, device=dev)

    def build(self, batch: int, advance: bool, shared=None):
        from photon_core.models.whisper.decoder_step import WhisperDecoderMegakernel
        return WhisperDecoderMegakernel(self.wt, batch, self.max_len, self.enc_len, self.tiling(batch),
                                        advance=advance)

    def rows(self, batch: int, purpose: str) -> Rows:
        import torch
        start, spacing = self.steps_rows if purpose == "steps" else self.fixed_rows
        g = torch.Generator().manual_seed(batch)
        tokens = torch.randint(0, self.shape[3], (batch,), generator=g).tolist()
        return Rows(tokens, spaced(batch, start, spacing),
                    [self.enc_len - max(1, self.enc_len // 30) * r for r in range(batch)])

    def inputs(self, batch: int, tokens: list[int]) -> dict:
        return {}

    def ref_weights(self, dtype) -> dict:
        """name -> fp32 tensor as the weights arena of `dtype` holds it, for run_reference."""
        from photon_core.models.whisper.decoder_step import step_weights
        return step_weights(self._rounded(dtype))

    def _rounded(self, dtype):
        import dataclasses

        import torch
        if dtype == torch.float32:
            return self.wt
        if dtype not in self._ref:
            def rnd(t):
                return t.to(dtype).float()
            wt = self.wt
            layers = [dataclasses.replace(lw, **{f.name: rnd(getattr(lw, f.name)) for f in dataclasses.fields(lw)})
                      for lw in wt.layers]
            self._ref[dtype] = dataclasses.replace(wt, token_embedding=rnd(wt.token_embedding),
                                                   positional_embedding=rnd(wt.positional_embedding),
                                                   layers=layers, ln_w=rnd(wt.ln_w), ln_b=rnd(wt.ln_b))
        return self._ref[dtype]

    def own_state(self, caches: dict) -> dict:
        """Separate copies of the caches for decoder_step.reference_step (it appends in place)."""
        n = self.shape[2]
        return dict(self_kv=[(caches[f"L{i}.kcache"].clone(), caches[f"L{i}.vcache"].clone()) for i in range(n)],
                    cross_kv=[(caches[f"L{i}.xk"], caches[f"L{i}.xv"]) for i in range(n)])

    def own_reference(self, dtype, state: dict, tokens, positions, rows: Rows, inputs: dict) -> dict:
        from photon_core.models.whisper.decoder_step import reference_step
        return {"logits": reference_step(self._rounded(dtype), tokens, positions, state["self_kv"],
                                         state["cross_kv"], rows.cross_len)}


def prove_feed_rounds(ctx: Ctx, fam, batch: int) -> dict | None:
    """Part 6 for a step fed input embeddings (Moondream 2's caption/query): the host driving each
    step (launch, flags, the token column read, its embedding and the next positions written) vs
    rounds whose token column's embedding device ops write into the next input (decode_loop's
    `feed`), captured as CUDA graphs. Tokens identical; time per token of each."""
    import torch

    from photon_core.megakernel.decode_loop import DeviceDecode
    b = build(ctx, fam, batch)
    step = b.step(advance=False)
    g, B = step.graph_def, batch
    text = ("token",)
    kernel = b.kernel(step, text)
    b.use_dtype(step, dtype_of(fam.stress_dtype))   # before capture: graphs keep the arena they saw
    x, col = step.view("x"), step.out.view(B, -1)[:, g.results.index("token")]

    def feed(tok) -> None:
        x.copy_(fam.emb[tok.long()])
    # Built before the state is filled: on a GPU building captures the rounds, which runs steps.
    loop = DeviceDecode(step, pick=lambda: col, results=text, feed=feed)
    rows = fam.rows(batch, "fixed")
    fill(step, rows, seed=60 + batch)
    apply_inputs(step, fam, rows.tokens, rows.positions)
    n = ctx.sizes.round_tokens

    def host_driven() -> list[list[int]]:
        out, pos = [[t] for t in rows.tokens], list(rows.positions)
        for _ in range(n - 1):
            kernel.launch()
            kernel.raise_on_error()
            toks = col.tolist()
            for r, t in enumerate(toks):
                out[r].append(t)
            pos = [p + 1 for p in pos]
            step.set_step(None, pos)
            x.copy_(fam.emb[torch.tensor(toks, device=x.device)])
        return out

    ways = {"host": (step, host_driven), "rounds": (step, lambda: loop.generate(rows.tokens, n, ()))}
    same, us = compare_ways(ctx, ways, n, f"rounds {fam.name} B{batch} (feed)")
    res = dict(family=fam.name, batch=batch, dtype=fam.stress_dtype, tokens=n, same=same, ways=list(ways),
               us_per_token=us, rounds_read=loop.rounds, x_host=us["rounds"] / us["host"], feed=True)
    print(f"  {fam.name:22s} B{batch} {fam.stress_dtype}: {n - 1} steps fed embeddings, tokens identical {same}; "
          f"us/token host-driven {us['host']:.1f}, rounds of 8 {us['rounds']:.1f} ({res['x_host']:.2f}x)", flush=True)
    return res


def prove_object_rounds(ctx: Ctx, fam, batch: int) -> dict:
    """Part 6 for Moondream 2's detect/point rounds (models/moondream/object_rounds.py): rounds of
    captured CUDA graphs whose device ops choose each row's next input (the encoded coordinate or
    size, or the token's embedding) and its next phase, against the same rounds run launch by
    launch without graphs, from the same state: records, phases and inputs identical (the CPU tests
    prove the eager rounds equal to the host's protocol); time per step of each."""
    import torch

    from photon_core.models.moondream.object_rounds import ObjectRounds
    b = build(ctx, fam, batch)
    step = b.step(advance=False)
    b.kernel(step)
    b.use_dtype(step, dtype_of(fam.stress_dtype))   # before capture: graphs keep the arena they saw
    fm = fam.object_decode(ctx.dev)
    # Built before the state is filled: on a GPU building captures the rounds, which runs steps.
    ways = {"graphs": ObjectRounds(fm, step), "eager": ObjectRounds(fm, step, cuda_graphs=False)}
    rows = fam.rows(batch, "fixed")
    fill(step, rows, seed=70 + batch)
    tk, B = fam.cfg.tokenizer, batch
    phases = [r % 4 for r in range(B)]                      # boundary, y, size, answer rows
    detect = [r % 3 != 1 for r in range(B)]                 # detect rows and point rows
    bias = torch.zeros(B, fam.dm.vocab, device=ctx.dev)
    # Object rows choose between coord and eos at a boundary, so rows both start objects and stop.
    bias[[r for r in range(B) if phases[r] != 3]] = float("-inf")
    bias[[r for r in range(B) if phases[r] != 3], tk.coord_id] = 2.0     # objects more often than not
    bias[[r for r in range(B) if phases[r] != 3], tk.eos_id] = 0.0
    x0 = fam.emb[torch.tensor(rows.tokens, device=ctx.dev)]
    sizes, got, secs = (3, 5, 8), {}, {}
    for name, dev_rounds in ways.items():
        with preserved(step):
            step.set_step(None, rows.positions)
            step.set_input("logit_bias", bias)
            step.view("x").copy_(x0)
            dev_rounds.phase.copy_(torch.tensor(phases))
            dev_rounds.detect.copy_(torch.tensor(detect))
            ctx.sync()
            t = time.perf_counter()
            records = [dev_rounds.loop.run_round(n)[0] for n in sizes]   # 3 and 5: several graphs a round
            ctx.sync()
            secs[name] = time.perf_counter() - t
            got[name] = (records, dev_rounds.phase.tolist(), step.view("x").clone())
    (rg, pg, xg), (re, pe, xe) = got["graphs"], got["eager"]
    same = rg == re and pg == pe and bool(torch.equal(xg, xe))
    starts = sum(rec[r][0] == tk.coord_id for rnd in re for rec in rnd for r in range(B) if phases[r] != 3)
    ctx.checks.expect(same and starts > 0, f"object rounds {fam.name} B{batch}: captured rounds differ from the "
                                           f"same rounds launched eagerly, or no row started an object ({starts})")
    us = {k: v / sum(sizes) * 1e6 for k, v in secs.items()}
    print(f"  {fam.name:22s} B{batch} {fam.stress_dtype}: detect/point rounds of {sizes}, captured == eager "
          f"{same}; us/step captured {us['graphs']:.1f}, eager {us['eager']:.1f}", flush=True)
    return dict(family=fam.name, batch=batch, dtype=fam.stress_dtype, steps=sum(sizes), same=same,
                objects_started=starts, ways=["graphs", "eager"], us_per_token=us, objects=True)


class MoondreamFamily:
    """Moondream 2's decode step (models/moondream/decoder_step.py) on random weights of the config's
    dims, built through MoondreamDecoderMegakernel from text/region weight objects of the model's
    layout (so gather_weights is on the path too)."""
    advance = False
    feeds_embeddings = True   # its step reads an input embedding (`x`), from the token table `emb`
    perop = False      # no per-op step function exists for this family (decoder_step has none)
    parts = PARTS
    control = False    # checking its 20-53K-task graphs again takes the checker tens of seconds

    def __init__(self, name: str, cfg, max_len: int, tiling: Callable[[int], Any], batches: tuple[int, ...],
                 dtypes: tuple[str, ...], stress_dtype: str, steps_rows: tuple[int, int],
                 fixed_rows: tuple[int, int]) -> None:
        self.name, self.cfg, self.max_len, self.tiling = name, cfg, max_len, tiling
        self.batches, self.dtypes, self.stress_dtype = batches, dtypes, stress_dtype
        self.steps_rows, self.fixed_rows = steps_rows, fixed_rows
        self.master: dict | None = None
        self._ref: dict = {}
        self._bias: dict = {}

    def load(self, dev) -> None:
        import torch

        from photon_core.models.moondream.decoder_step import dims_of, weight_shapes
        if self.master is not None:
            return
        self.dm = dm = dims_of(self.cfg)
        self.dev = dev
        g = torch.Generator(device=dev).manual_seed(0)

        def randn(*shape: int, scale: float) -> torch.Tensor:
            return torch.randn(*shape, generator=g, device=dev) * scale

        # Rotary tables as TextWeights.from_state computes them; the rest random, scaled so that
        # activations stay O(1) through 24 layers.
        inv = 1.0 / (self.cfg.text.rope_theta ** (torch.arange(0, dm.rot, 2, dtype=torch.float32) / dm.rot))
        angles = (torch.arange(dm.max_context, dtype=torch.float32)[:, None] * inv[None, :]).to(dev)
        master = {}
        for k, shape in weight_shapes(dm).items():
            if k in ("rope_cos", "rope_sin"):
                master[k] = angles.cos() if k == "rope_cos" else angles.sin()
            elif k.endswith("ln.w"):
                master[k] = 1 + randn(*shape, scale=0.1)
            elif len(shape) == 1:
                master[k] = randn(*shape, scale=0.1)
            else:
                master[k] = randn(*shape, scale=shape[1] ** -0.5)
        self.master = master
        self.emb = randn(dm.vocab, dm.d, scale=1.0)     # input embeddings of the tokens decoded

    @staticmethod
    def _objects(w: dict) -> tuple[Any, Any]:
        """text.TextWeights- and region.RegionWeights-like objects (gather_weights' inverse)."""
        def pair(i: int, part: str) -> tuple:
            return (w[f"L{i}.ln.w"], w[f"L{i}.ln.b"]) if part == "ln" else (w[f"L{i}.{part}_w"], w[f"L{i}.{part}_b"])

        n = 1 + max(int(k.split(".")[0][1:]) for k in w if k.startswith("L"))
        blocks = [SimpleNamespace(**{part: pair(i, part) for part in ("ln", "qkv", "proj", "fc1", "fc2")})
                  for i in range(n)]
        text_w = SimpleNamespace(blocks=blocks, post_ln=(w["post_ln.w"], w["post_ln.b"]),
                                 lm_head=(w["lm_w"], w["lm_b"]), cos=w["rope_cos"], sin=w["rope_sin"])
        region_w = SimpleNamespace(coord_fc1=(w["c_fc1_w"], w["c_fc1_b"]), coord_fc2=(w["c_fc2_w"], w["c_fc2_b"]),
                                   size_fc1=(w["s_fc1_w"], w["s_fc1_b"]), size_fc2=(w["s_fc2_w"], w["s_fc2_b"]))
        return text_w, region_w

    def object_decode(self, dev) -> Any:
        """What object_rounds.ObjectRounds reads of a MegakernelDecode: the model's token table
        (`emb`), random region encoders of the config's shapes, the Triton ops, the config."""
        import torch

        from photon_core.backends.select import get_backend
        from photon_core.models.moondream import region, text
        r, d = self.cfg.region, self.dm.d
        g = torch.Generator(device=dev).manual_seed(1)

        def randn(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=g, device=dev) * (shape[-1] ** -0.5 if len(shape) > 1 else 0.1)
        encoders = SimpleNamespace(coord_features=randn(1, r.coord_feat_dim // 2) * 10,
                                   coord_encoder=(randn(d, r.coord_feat_dim), randn(d)),
                                   size_features=randn(2, r.size_feat_dim // 2) * 10,
                                   size_encoder=(randn(d, r.size_feat_dim), randn(d)))
        model = SimpleNamespace(region_w=encoders, region_impl=region, text_impl=text,
                                text_w=SimpleNamespace(wte=self.emb), ops=get_backend("triton", dev))
        return SimpleNamespace(model=model, config=self.cfg)

    def build(self, batch: int, advance: bool, shared=None):
        from photon_core.models.moondream.decoder_step import MoondreamDecoderMegakernel
        text_w, region_w = self._objects(self.master)
        # Every bucket streams one copy of the weights, as MegakernelDecode does.
        return MoondreamDecoderMegakernel(text_w, region_w, self.cfg, batch, self.max_len, self.tiling(batch),
                                          weights=shared)

    def rows(self, batch: int, purpose: str) -> Rows:
        import torch
        start, spacing = self.steps_rows if purpose == "steps" else self.fixed_rows
        g = torch.Generator().manual_seed(batch)
        return Rows(torch.randint(0, self.dm.vocab, (batch,), generator=g).tolist(), spaced(batch, start, spacing),
                    None)

    def bias(self, batch: int):
        """Per-row logit bias: ~10% of the vocabulary masked with -inf, as the skills' masks do."""
        import torch
        if batch not in self._bias:
            g = torch.Generator().manual_seed(100 + batch)
            masked = torch.rand(batch, self.dm.vocab, generator=g) < 0.1
            self._bias[batch] = torch.zeros(batch, self.dm.vocab).masked_fill(masked, float("-inf")).to(self.dev)
        return self._bias[batch]

    def inputs(self, batch: int, tokens: list[int]) -> dict:
        import torch
        return {"x": self.emb[torch.tensor(tokens, device=self.dev)], "logit_bias": self.bias(batch)}

    def ref_weights(self, dtype) -> dict:
        import torch
        if dtype == torch.float32:
            return self.master
        if dtype not in self._ref:
            self._ref[dtype] = {k: v.to(dtype).float() for k, v in self.master.items()}
        return self._ref[dtype]

    def own_state(self, caches: dict) -> dict:
        k, v = caches["kcache"].clone(), caches["vcache"].clone()
        return dict(rows=[SimpleNamespace(k=k[:, r:r + 1], v=v[:, r:r + 1], length=k.shape[3])
                          for r in range(k.shape[1])])

    def own_reference(self, dtype, state: dict, tokens, positions, rows: Rows, inputs: dict) -> dict:
        from photon_core.models.moondream.decoder_step import reference_step
        text_w, region_w = self._objects(self.ref_weights(dtype))
        want = reference_step(text_w, region_w, self.cfg, state["rows"], inputs["x"], positions,
                              inputs["logit_bias"])
        return {"logits": want["logits"], "hidden": want["hidden"]}


class GraphFamily:
    """Any family's step graph (`graph_fn()` -> StepGraph) compiled with CompiledStep directly, on
    random weights generated from graph.weight_shapes by the role each weight plays in the graph, so
    that activations stay O(1): linear / embedding / expert matrices N(0, 1) / sqrt(K) (K: the last
    dimension), norm scales 1 + 0.1 N(0, 1) (0.1 N(0, 1) where the norm adds an offset of 1),
    rotary tables of real angles (theta 1e4), the delta rule's A_log = log U(1, 16) and dt_bias =
    softplus^-1 of dt log-uniform in [1e-3, 0.1] (Mamba's initialisation), conv taps N(0, 1) /
    sqrt(W), other vectors 0.1 N(0, 1). Weights are generated one at a time straight into the
    arena (no master copy; bf16 alone when the family is proved in bf16 only: a 9B graph in fp32
    and bf16 besides the others would crowd an H200); the references read the arenas (bf16 rounding
    included; folded norm offsets taken back out).

    Host inputs (g.input): one added to logits an argmax reads is a per-row logit bias (~10% of the
    columns -inf, as the skills' masks); any other is an input embedding, a fixed N(0, 1) row per
    token. Recurrent states get random history in fill(). No own reference: run_reference on the
    same graph is the reference. `advance` is the graph's own (an argmax(advance=True))."""
    perop = False
    control = False

    def __init__(self, name: str, graph_fn: Callable[[], Any], tiling: Callable[[int], Any],
                 batches: tuple[int, ...], dtypes: tuple[str, ...], stress_dtype: str, steps_rows: tuple[int, int],
                 fixed_rows: tuple[int, int], parts: tuple[str, ...] = PARTS) -> None:
        self.name, self.graph_fn, self.tiling, self.parts = name, graph_fn, tiling, parts
        self.batches, self.dtypes, self.stress_dtype = batches, dtypes, stress_dtype
        self.steps_rows, self.fixed_rows = steps_rows, fixed_rows
        self.graph = graph_fn()
        self.advance = any(n.op == "argmax" and n.args["advance"] for n in self.graph.nodes)
        embeds = [n.args["tok"] for n in self.graph.nodes if n.op == "embed"]
        argmax = next(n.args for n in self.graph.nodes if n.op == "argmax")
        self.vocab = self.graph.weight_shapes[embeds[0]][0] if embeds else argmax["c1"] - argmax["c0"]
        self.arena32 = None
        self.arenas: dict = {}     # dtype -> weights arena; Build.use_dtype shares this dict
        self._tables: dict = {}
        self._bias: dict = {}

    # -- random weights -----------------------------------------------------------------------------
    def roles(self) -> dict[str, tuple]:
        """weight name -> (role, detail) from the nodes that read it."""
        r: dict[str, tuple] = {}

        def scale(w, offset=0.0):
            if w is not None:
                r[w] = ("offset_scale",) if offset else ("scale",)
        for n in self.graph.nodes:
            a = n.args
            if n.op in ("layer_norm", "rms_norm"):
                scale(a["w"], a.get("offset", 0.0))
            elif n.op == "add_norm":
                scale(a["w"], a["offset"])
                scale(a["scale_w"])
            elif n.op == "kv_append":
                if a["rotary"] is not None:
                    r[a["rotary"].cos] = ("cos", a["rotary"].dims)
                    r[a["rotary"].sin] = ("sin", a["rotary"].dims)
                if a["norm"] is not None:
                    scale(a["norm"].q, a["norm"].offset)
                    scale(a["norm"].k, a["norm"].offset)
                if a["tau"] is not None:
                    r[a["tau"].alpha] = ("vector",)
            elif n.op == "delta_rule":
                r[a["a_log"]], r[a["dt_bias"]] = ("a_log",), ("dt_bias",)
                scale(a["norm_w"])
        return r

    def _weight(self, name: str, shape: tuple[int, ...], role: tuple, gen):
        import math

        import torch
        dev = self.dev

        def randn(scale: float):
            return torch.randn(*shape, generator=gen, device=dev) * scale

        kind = role[0] if role else ("matrix" if len(shape) > 1 else "vector")
        if kind in ("cos", "sin"):
            half = shape[1]
            inv = 1e4 ** (-torch.arange(half, dtype=torch.float32, device=dev) / half)
            ang = torch.arange(shape[0], dtype=torch.float32, device=dev)[:, None] * inv[None]
            return ang.cos() if kind == "cos" else ang.sin()
        if kind == "scale":
            return 1 + randn(0.1)
        if kind == "offset_scale":
            return randn(0.1)
        if kind == "a_log":
            return torch.log(1 + 15 * torch.rand(*shape, generator=gen, device=dev))
        if kind == "dt_bias":
            dt = torch.exp(math.log(1e-3) + (math.log(0.1) - math.log(1e-3)) * torch.rand(*shape, generator=gen,
                                                                                             device=dev))
            return dt + torch.log(-torch.expm1(-dt))          # softplus^-1(dt)
        if kind == "matrix":
            return randn(shape[-1] ** -0.5)
        return randn(0.1)

    def load(self, dev) -> None:
        self.dev = dev

    def build(self, batch: int, advance: bool, shared=None):
        import torch

        from photon_core.megakernel.compiler import CompiledStep
        from photon_core.megakernel.stepgraph import Node
        g = self.graph
        if self.advance and not advance:    # the same graph, the host stepping rows instead
            g = copy.copy(g)
            g.nodes = [Node(n.op, n.out, dict(n.args, advance=False)) if n.op == "argmax" else n for n in g.nodes]
        shared = shared if shared is not None else self.arena32
        if shared is not None:
            tensors = {k: torch.empty(0) for k in g.weight_shapes}
        else:
            roles = self.roles()
            gen = torch.Generator(device=self.dev).manual_seed(0)
            tensors = LazyWeights(g.weight_shapes, lambda k: self._weight(k, g.weight_shapes[k], roles.get(k), gen))
        # Built in the finest dtype the family is proved in (bf16 alone: no fp32 copy of a 9B arena).
        dtype = torch.float32 if "fp32" in self.dtypes else dtype_of(self.dtypes[0])
        step = CompiledStep(g, tensors, batch, self.tiling(batch), dtype, shared_weights=shared, device=self.dev)
        if self.arena32 is None:     # the first arena (fp32 unless the family is proved in bf16 only)
            self.arena32 = self.arenas[dtype] = step.weights
            self.plan = step.plan
        return step

    # -- rows, inputs, references ------------------------------------------------------------------
    def rows(self, batch: int, purpose: str) -> Rows:
        import torch
        start, spacing = self.steps_rows if purpose == "steps" else self.fixed_rows
        g = torch.Generator().manual_seed(batch)
        return Rows(torch.randint(0, self.vocab, (batch,), generator=g).tolist(), spaced(batch, start, spacing),
                    None)

    def inputs(self, batch: int, tokens: list[int]) -> dict:
        import torch
        out = {}
        # A logit bias: the residual of a linear an argmax reads (Moondream 3's input embedding is
        # a residual too, of its first MLP).
        picked = {n.args["x"].name for n in self.graph.nodes if n.op == "argmax"}
        residuals = {n.args["residual"].name for n in self.graph.nodes
                     if n.op == "linear" and n.args["residual"] is not None and n.out.name in picked}
        for n in self.graph.nodes:
            if n.op != "input":
                continue
            v = n.out
            if v.name in residuals:      # a logit bias: ~10% of the columns barred, per row
                key = (v.name, batch)
                if key not in self._bias:
                    g = torch.Generator().manual_seed(100 + batch)
                    masked = torch.rand(batch, v.width, generator=g) < 0.1
                    self._bias[key] = torch.zeros(batch, v.width).masked_fill(masked, float("-inf")).to(self.dev)
                out[v.name] = self._bias[key]
            else:                        # an input embedding of the row's token
                if v.name not in self._tables:
                    g = torch.Generator(device=self.dev).manual_seed(7)
                    self._tables[v.name] = torch.randn(self.vocab, v.width, generator=g, device=self.dev)
                out[v.name] = self._tables[v.name][torch.tensor(tokens, device=self.dev) % self.vocab]
        return out

    def ref_weights(self, dtype) -> dict:
        """name -> the weight as the arena of `dtype` holds it (views; run_reference casts them to
        fp32 per use), folded norm offsets taken back out (exactly: Sterbenz)."""
        if dtype not in self.arenas:
            if self.arena32.element_size() < dtype.itemsize:
                raise ValueError(f"{self.name}: built in {self.arena32.dtype}, cannot give {dtype} weights")
            self.arenas[dtype] = self.arena32.to(dtype)
        arena, p = self.arenas[dtype], self.plan
        out = {}
        for k, shape in self.graph.weight_shapes.items():
            off, n = p.warena.regions[k]
            if k in p.ldw:
                rows = math.prod(shape[:-1])
                t = arena[off:off + n].view(rows, p.ldw[k])[:, :shape[-1]].view(shape)
            else:
                t = arena[off:off + n].view(shape)
            out[k] = t.float() - p.weight_offset[k] if k in p.weight_offset else t
        return out

    def own_state(self, caches: dict) -> dict:
        return {}

    def own_reference(self, dtype, state: dict, tokens, positions, rows: Rows, inputs: dict) -> dict:
        return {}


class LazyWeights(Mapping):
    """name -> tensor made on first use and not kept: CompiledStep copies each into its arena."""

    def __init__(self, shapes: dict, make: Callable[[str], Any]) -> None:
        self.shapes, self.make = shapes, make

    def __getitem__(self, key: str):
        if key not in self.shapes:
            raise KeyError(key)
        return self.make(key)

    def __iter__(self):
        return iter(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)


def families(dry: bool, sms: int) -> dict[str, Any]:
    from photon_core.megakernel.compiler import Tiling
    from photon_core.models.moondream.config import MoondreamConfig, RegionConfig, TextConfig
    both = ("fp32", "bf16")
    if dry:
        # Tiny shapes the interpreter runs in a fraction of a second per launch (it costs ~10 ms of
        # Python per task): few tasks, two self-attention KV splits, and (split) split-K.
        prod = lambda b: Tiling(64, 64, 16, 2, 1)  # noqa: E731
        split = lambda b: Tiling(32, 32, 16, 2, 2, min_tasks=4, min_block_n=16, max_split_k=2)  # noqa: E731
        cfg = MoondreamConfig(text=TextConfig(dim=64, ff_dim=128, n_layers=1, vocab_size=96, max_context=32,
                                              n_heads=2, n_kv_heads=2, prefix_attn=4),
                              region=RegionConfig(dim=64, coord_out_dim=64, size_out_dim=128, inner_dim=64))
        fams = [WhisperFamily("whisper-tiny.en", 64, 2, 1, 96, 16, 8, prod, (1, 2), both, "fp32", (1, 2), (8, -1),
                              control=True),
                # Its stress on the interpreter would add nothing the other two do not show.
                WhisperFamily("whisper-tiny.en/split", 64, 2, 1, 96, 16, 8, split, (1,), ("bf16",), "bf16",
                              (1, 2), (8, -1), perop=False, parts=("steps",)),
                MoondreamFamily("moondream2", cfg, 32, prod, (1, 2), both, "bf16", (4, 3), (12, 1))]
    else:
        # What photon_core builds today: Tiling() for every family and batch.
        prod = lambda b: Tiling()  # noqa: E731
        # The roofline's GPU tiling: 64-column tiles, stages of few tiles narrowed / split-K to 2 x #SMs.
        split = lambda b: Tiling(block_n=64, block_k=max(16, 128 // b), block_t=64, self_splits=4,  # noqa: E731
                                 cross_splits=8, min_tasks=2 * sms)
        cfg = MoondreamConfig()
        fams = [WhisperFamily("whisper-tiny.en", 384, 6, 4, 51864, 448, 1500, prod, (1, 8), both, "fp32",
                              (1, 37), (224, -9), control=True),
                WhisperFamily("whisper-turbo", 1280, 20, 4, 51866, 448, 1500, prod, (1, 8), both, "bf16",
                              (1, 37), (224, -9)),
                WhisperFamily("whisper-tiny.en/split", 384, 6, 4, 51864, 448, 1500, split, (1, 8), ("bf16",),
                              "bf16", (1, 37), (224, -9), perop=False),
                MoondreamFamily("moondream2", cfg, cfg.text.max_context, prod, (1, 8), both, "bf16",
                                (cfg.text.prefix_attn, 29), (cfg.text.prefix_attn + 100, 16))]
    fams += graph_families(dry, prod)
    return {f.name: f for f in fams}


def graph_families(dry: bool, prod: Callable[[int], Any]) -> list[GraphFamily]:
    """The families compiled from their step graphs alone (GraphFamily): real sizes on a GPU (bf16
    weights, parts steps / poison / timing at batch 1 and 8, to keep the whole proof near its
    budget), tiny ones in the dry run (1-3 layers, width 64, vocabulary 96). Moondream 3 only
    where its decode step exists."""
    import torch

    import roofline
    from photon_core.models.gemma4 import decoder_step as gemma4
    from photon_core.models.gemma4.config import TextConfig as GemmaText
    from photon_core.models.qwen3_5 import decoder_step as qwen3_5
    from photon_core.models.qwen3_asr import decoder_step as qwen3_asr
    try:
        from photon_core.models.moondream3 import decoder_step as moondream3
    except ImportError:
        moondream3 = None
    parts = dict.fromkeys(("asr", "q35", "gem", "md3"), ("steps", "poison", "rounds", "timing"))
    if dry:
        # Interpreter time: timing (nothing real to time) only where its byte count differs (states,
        # windows); Qwen3-ASR (plain GQA, as Whisper and Moondream 2 poison it) only its steps.
        parts.update(asr=("steps", "rounds"), q35=("steps", "poison", "timing"), gem=("steps", "poison", "timing"),
                     md3=("steps", "poison"))
        batches, dtypes = (1, 2), ("fp32", "bf16")
        asr = roofline.qwen3_asr_dims(hidden=64, intermediate=128, vocab_size=96, n_layers=1, n_heads=4,
                                      n_kv_heads=2, head_dim=16)
        q35 = roofline.qwen3_5_config(hidden_size=64, intermediate_size=128, vocab_size=96, num_hidden_layers=2,
                                      layer_types=["linear_attention", "full_attention"], num_attention_heads=2,
                                      num_key_value_heads=1, head_dim=16, linear_num_key_heads=2,
                                      linear_key_head_dim=16, linear_num_value_heads=4, linear_value_head_dim=16)
        # sliding, full, and a sliding layer reading layer 0's ring (window 8: rows wrap it)
        gem = GemmaText.from_dict(dict(
            gemma4.E2B_TEXT, vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
            num_attention_heads=2, head_dim=16, global_head_dim=32, sliding_window=8,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"], vocab_size_per_layer_input=96,
            hidden_size_per_layer_input=16, num_kv_shared_layers=1, max_position_embeddings=64))
        lens = dict(asr=32, q35=32, gem=32)
        rows = dict(asr=((1, 2), (8, -1)), q35=((3, 5), (12, -4)), gem=((4, 9), (12, -5)), md3=((4, 3), (12, 1)))
        md3 = None
        if moondream3 is not None:
            from photon_core.models.moondream3.config import Moondream3Config, MoeConfig, RegionConfig
            from photon_core.models.moondream3.config import TextConfig as MD3Text
            md3 = Moondream3Config(text=MD3Text(dim=64, ff_dim=128, n_layers=2, vocab_size=96, max_context=32,
                                                n_heads=2, n_kv_heads=2, prefix_attn=4,
                                                moe=MoeConfig(num_experts=4, start_layer=1, experts_per_token=2,
                                                              expert_inner_dim=32)),
                                   region=RegionConfig(dim=64, coord_out_dim=64, size_out_dim=128))
            md3_len = 32
    else:
        batches, dtypes = (1, 8), ("bf16",)
        asr, q35 = roofline.qwen3_asr_dims("Qwen3-ASR 0.6B"), roofline.qwen3_5_config("Qwen 3.5 0.8B")
        gem = GemmaText.from_dict(gemma4.E2B_TEXT)
        lens = dict(asr=1024, q35=1024, gem=1024)
        # Gemma 4's rows cross its 512-slot rings during the steps (positions 500 on).
        rows = dict(asr=((1, 37), (224, -9)), q35=((1, 37), (224, -9)), gem=((500, 37), (700, -9)),
                    md3=((730, 29), (830, 16)))
        md3 = roofline.moondream3_config() if moondream3 is not None else None
        md3_len = 1024
    fams = [GraphFamily("qwen3-asr-0.6b", lambda: qwen3_asr.step_graph(asr, lens["asr"]), prod, batches, dtypes,
                        dtypes[-1], *rows["asr"], parts=parts["asr"]),
            GraphFamily("qwen3.5-0.8b", lambda: qwen3_5.step_graph(q35, lens["q35"], tied=True), prod, batches,
                        dtypes, dtypes[-1], *rows["q35"], parts=parts["q35"]),
            GraphFamily("gemma4-e2b", lambda: gemma4.step_graph(gem, lens["gem"], torch.bfloat16), prod, batches,
                        dtypes, dtypes[-1], *rows["gem"], parts=parts["gem"])]
    if md3 is not None:
        fams.append(GraphFamily("moondream3", lambda: moondream3.step_graph(moondream3.dims_of(md3), md3_len), prod,
                                batches, dtypes, dtypes[-1], *rows["md3"], parts=parts["md3"]))
    return fams


def dtype_of(name: str):
    import torch
    return {"fp32": torch.float32, "bf16": torch.bfloat16}[name]


# ---------------------------------------------------------------------------------------------------
# Compiled steps, shared by every part


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

    def step(self, advance: bool):
        advance = advance and self.fam.advance
        if advance not in self.steps:
            self.fam.load(self.ctx.dev)
            t = time.time()
            shared = getattr(self.fam, "arena32", None)
            step = self.fam.build(self.batch, advance, shared)
            if shared is None and not self.fam.advance:
                self.fam.arena32 = step.weights
            self.steps[advance] = step
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
        return kernels[results]

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


def apply_inputs(step, fam, tokens: list[int], positions: list[int]) -> dict:
    """Write one step's tokens, positions and host inputs where the kernel reads them."""
    has_embed = any(n.op == "embed" for n in step.graph_def.nodes)
    step.set_step(tokens if has_embed else None, positions)
    inputs = fam.inputs(step.batch, tokens)
    for name, value in inputs.items():
        step.set_input(name, value)
    return inputs


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
    claim counter, which ends at #tasks + #programs (each program's last claim finds no task)."""
    claims, err = kernel.ctrl[:2].tolist()     # graph.CTRL_CLAIM, graph.CTRL_ERROR
    want = len(kernel.graph.tasks) + kernel.num_programs
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


# ---------------------------------------------------------------------------------------------------
# Part 1: steps against the references


def compare(step, want: dict, own: dict, positions: list[int], results: list[str], caches: dict) -> dict:
    """Errors of one step: exposed values vs run_reference and the family's reference, argmax picks,
    the K/V just appended at each row's position (its slot in a ring) and the recurrent states."""
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
        e, t = argmax_ok(step.result(a["name"]).tolist(), want[a["x"].name][:, a["c0"]:a["c1"]])
        exact, tolerated, total = exact + e, tolerated + t, total + step.batch
    err.update(exact=exact, tolerated=tolerated, picks=total)
    return err


def prove_steps(ctx: Ctx, fam, batch: int, dtype_name: str) -> dict:
    import torch

    from photon_core.megakernel.stepgraph import run_reference
    dtype = dtype_of(dtype_name)
    b = build(ctx, fam, batch)
    step = b.step(advance=True)
    # Moondream's text-only graph (caption / query) is a second kernel over the same state.
    variants = {"full": None}
    if not fam.advance and batch == 1:
        variants["text"] = ("token",)
    kernels = {v: b.kernel(step, r) for v, r in variants.items()}
    b.use_dtype(step, dtype)
    rows = fam.rows(batch, "steps")
    caches = fill(step, rows, seed=batch)
    own_state = fam.own_state(caches)
    ref_w = fam.ref_weights(dtype)
    tokens, positions = list(rows.tokens), list(rows.positions)
    apply_inputs(step, fam, tokens, positions)
    with preserved(step):
        replay = {v: graphed(k.launch, ctx.cuda) for v, k in kernels.items()}
    worst = {"values": 0.0, "own": 0.0, "kv": 0.0}
    picks = dict(exact=0, tolerated=0, picks=0)
    bad: list[str] = []
    t = time.time()
    for s in range(ctx.sizes.steps):
        variant = "text" if "text" in variants and s % 2 == 1 else "full"
        results = ["token"] if variant == "text" else list(step.graph_def.results)
        inputs = fam.inputs(batch, tokens) if fam.advance else apply_inputs(step, fam, tokens, positions)
        want = run_reference(step.graph_def, ref_w, caches, tokens, positions, rows.cross_len, inputs)
        own = fam.own_reference(dtype, own_state, tokens, positions, rows, inputs)
        replay[variant]()
        ctx.sync()
        problem = flags(kernels[variant])
        if problem:
            bad.append(f"step {s}: {problem}")
            break
        err = compare(step, want, own, positions, results, caches)
        for k in worst:
            worst[k] = max(worst[k], err[k])
        for k in picks:
            picks[k] += err[k]
        if max(err["values"], err["own"], err["kv"]) > TOL or err["exact"] + err["tolerated"] < err["picks"]:
            bad.append(f"step {s} ({variant}): {err}")
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
               seconds=round(time.time() - t, 1))
    ctx.checks.expect(not bad, f"steps {fam.name} B{batch} {dtype_name}: {bad[:1]}")
    note = "  (fp32 error above 1e-4: look closer)" if dtype == torch.float32 and max(worst.values()) > FP32_NOTE else ""
    print(f"  {fam.name:22s} B{batch} {dtype_name}: {s + 1} steps ({'/'.join(variants)}), max rel err "
          f"values {worst['values']:.1e} own-ref {worst['own']:.1e} kv {worst['kv']:.1e}, argmax "
          f"{picks['exact']}/{picks['picks']} identical + {picks['tolerated']} near-ties, "
          f"{res['seconds']} s{note}", flush=True)
    return res


# ---------------------------------------------------------------------------------------------------
# Parts 2-4: race stress, poisoning, positive control


class Noise:
    """A memory-heavy kernel on another CUDA stream: 512 MB device copies, enqueued beside every
    stress launch (about as long as the launch), so the megakernel runs against HBM and L2 traffic
    and SMs taken by someone else. Nothing on the CPU."""

    def __init__(self, ctx: Ctx, mb: int = 512) -> None:
        self.stream = None
        self.per_launch = 1
        self.gbps = None
        if not ctx.cuda:
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
    value (a part 3 failure). The fingerprint of a launch
    is the scratch, the cache slots it appends to, the recurrent states, the results and dyn, as raw
    bits. Recurrent states are put back before every launch (`reset`): a step updates them, so
    fixed inputs include them."""

    def __init__(self, ctx: Ctx, fam, b: Build, dtype) -> None:
        import torch

        from photon_core.megakernel.stepgraph import run_reference
        self.fam, self.batch = fam, b.batch
        self.step = step = b.step(advance=False)
        self.kernel = b.kernel(step)
        b.use_dtype(step, dtype)
        self.rows = rows = fam.rows(b.batch, "fixed")
        caches = fill(step, rows, seed=10 + b.batch)
        inputs = apply_inputs(step, fam, rows.tokens, rows.positions)
        g = step.graph_def
        keep = set(g.caches) | set(g.states) | {n.out.name for n in g.nodes if n.op == "input"}
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
        want = run_reference(g, fam.ref_weights(dtype), caches, rows.tokens, rows.positions, rows.cross_len, inputs)
        self.ref_err = max(rel_err(step.view(name), want[v.name]) for name, v in g.exposed.items())
        self.finite_ok = all(torch.equal(torch.isfinite(step.view(name)), torch.isfinite(want[v.name]))
                             for name, v in g.exposed.items())
        picks = [argmax_ok(step.result(a["name"]).tolist(), want[a["x"].name][:, a["c0"]:a["c1"]])
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
        ctx.checks.expect(p.ref_err <= TOL and p.picks_ok and p.finite_ok,
                          f"probe {fam.name} B{batch}: fixed-input launch vs run_reference err {p.ref_err:.1e}, "
                          f"argmax ok {p.picks_ok}, finite pattern ok {p.finite_ok}")
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
           stop_on_diff: bool = False, capped: bool = False, launch_s: float | None = None) -> Stress:
    """`launches` launches of `kernel` (the probe's, or a mutated one on the same buffers) with
    `programs` programs, the noise stream busy beside them; after every `poison_every`-th launch
    the next one starts from NaN-filled scratch. Counted on the device, synchronised at the end (and
    every 25 launches with stop_on_diff)."""
    import torch
    dev = p.step.state.device
    saved = kernel.num_programs
    kernel.num_programs = programs
    expected = len(kernel.graph.tasks) + programs
    diff = torch.zeros((), dtype=torch.int32, device=dev)
    first = torch.full((), -1, dtype=torch.int64, device=dev)
    err = torch.zeros((), dtype=torch.int32, device=dev)
    claims = torch.zeros((), dtype=torch.int32, device=dev)
    if ctx.cuda:
        ctx.noise.pace(launch_s if launch_s is not None else measure_launch(ctx, kernel, programs, 1))
    t = time.time()
    done = 0
    try:
        for i in range(launches):
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
            if stop_on_diff and done % 25 == 0 and int(diff) > 0:
                break
        ctx.sync()
        ctx.noise.drain()
    finally:
        kernel.num_programs = saved
    return Stress(programs, done, int(diff), int(first), int(err), int(claims), round(time.time() - t, 2), capped)


def sized(ctx: Ctx, p: Probe, programs: int) -> tuple[int, bool, float | None]:
    """(launches, capped, seconds per launch) for one stress: the target, unless that would pass
    the time cap for this program count (1 or 3 programs of Moondream 2 stream 2.7 GB each launch
    through a few SMs)."""
    s = ctx.sizes
    cap = s.cap_many_s if programs >= ctx.sms else s.cap_few_s
    if not ctx.cuda:
        return s.launches, False, None
    t = measure_launch(ctx, p.kernel, programs, 1)
    if t * s.launches <= cap:
        return s.launches, False, t
    return max(s.min_launches, int(cap / t)), True, t


def prove_stress(ctx: Ctx, fam, batch: int) -> dict:
    p = probe(ctx, fam, batch)
    runs = []
    for programs in ctx.programs():
        n, capped, launch_s = sized(ctx, p, programs)
        r = stress(ctx, p, p.kernel, programs, n, poison_every=2, capped=capped, launch_s=launch_s)
        runs.append(r.__dict__)
        ok = r.differing == 0 and r.error_flag == 0 and r.bad_claims == 0
        ctx.checks.expect(ok, f"stress {fam.name} B{batch} {programs} programs: {r}")
        print(f"  {fam.name:22s} B{batch} {fam.stress_dtype} {programs:4d} programs: {r.launches} launches"
              f"{' (time cap)' if capped else ''}, {r.differing} differ, error flag {r.error_flag}, "
              f"bad claim counts {r.bad_claims}, {r.seconds} s", flush=True)
    return dict(family=fam.name, batch=batch, dtype=fam.stress_dtype, tasks=len(p.kernel.graph.tasks),
                fingerprint=p.idx.numel(), launch_ms=round(p.launch_s * 1e3, 3), runs=runs,
                noise_copy_gbps=ctx.noise.gbps)


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
    return dict(family=fam.name, batch=batch, programs=programs, run=r.__dict__, unwritten=p.unwritten,
                unused_split_slots=p.unused, first_has_nan=p.first_nan)


def copy_graph(g):
    """A copy whose tasks can be edited (waits dropped) without touching `g`."""
    import copy
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


def victim(graph) -> int:
    """The first task that waits on an attention (its partials, the last of each (row, head) merging):
    a linear tile claimed right behind the merges it reads, so without its wait it overtakes them
    whenever programs run side by side."""
    from photon_core.megakernel.graph import OP_ATTN_PARTIAL
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


# ---------------------------------------------------------------------------------------------------
# Part 5: liveness (the child runs in its own process, so a hang is a timeout, not a hung proof)


def prove_liveness(ctx: Ctx) -> dict:
    env = dict(os.environ)
    if ctx.cuda:
        env.pop("TRITON_INTERPRET", None)
    else:
        env["TRITON_INTERPRET"] = "1"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--liveness-child"] + (["--dry-run"] if not ctx.cuda else [])
    t = time.time()
    try:
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=ctx.sizes.liveness_timeout_s)
        lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
        res = json.loads(lines[-1]) if lines else dict(ok=False, message=r.stderr[-2000:])
        res["exit"] = r.returncode
    except subprocess.TimeoutExpired:
        res = dict(ok=False, message=f"no answer in {ctx.sizes.liveness_timeout_s} s: the launch hangs")
    res["seconds"] = round(time.time() - t, 1)
    ctx.checks.expect(bool(res.get("ok")) and res.get("exit") == 0, f"liveness: {res}")
    print(f"  never-signalled wait: {'returned and raised' if res.get('ok') else 'FAILED'} "
          f"({(res.get('message') or '')[:160]}), launch {res.get('launch_s', '?')} s, child {res['seconds']} s",
          flush=True)
    return res


def liveness_child(dry: bool) -> int:
    import torch

    from photon_core.megakernel.compiler import Tiling
    from photon_core.models.whisper.decoder_step import WhisperDecoderMegakernel, WhisperDecoderWeights
    cuda = torch.cuda.is_available() and not dry
    dev = torch.device("cuda" if cuda else "cpu")
    wt = WhisperDecoderWeights.random(64, 2, 1, 96, 16, seed=0, device=dev)
    step = WhisperDecoderMegakernel(wt, 1, 16, 8, Tiling(32, 64, 16, 2, 2))
    step.set_cross_kv([(torch.randn(1, 2, 8, 32, device=dev), torch.randn(1, 2, 8, 32, device=dev))])
    step.set_step([3], [2])
    g = copy_graph(step.graph)
    i = next(j for j, t in enumerate(g.tasks) if t.waits)
    g.counter("never-signalled")
    g.tasks[i].waits = [("never-signalled", 1)]
    bad = unchecked_kernel(step.kernel, g)
    bad.spin_limit = 1 << 12 if cuda else 2
    t = time.perf_counter()
    bad.launch()
    if cuda:
        torch.cuda.synchronize()
    launch_s = time.perf_counter() - t
    try:
        bad.raise_on_error()
        message = None
    except RuntimeError as e:
        message = str(e)
    ok = message is not None and "gave up waiting" in message and f"task {i} " in message
    print(json.dumps(dict(ok=ok, task=i, name=g.tasks[i].name, message=message, launch_s=round(launch_s, 3),
                          programs=bad.num_programs, spin_limit=bad.spin_limit, device=str(dev))), flush=True)
    return 0 if ok else 3


# ---------------------------------------------------------------------------------------------------
# Part 6: timing


def over_budget(ctx: Ctx, what: str, need_s: float = 20.0) -> bool:
    """Whether the run's budget leaves too little for one more timing configuration (then say so)."""
    if ctx.left() >= need_s:
        return False
    msg = f"timing of {what} SKIPPED: {ctx.left():.0f} s left of --budget-s {ctx.args.budget_s:.0f}"
    print(f"  {msg}", flush=True)
    ctx.out.setdefault("skipped", []).append(msg)
    return True


def kv_read_bytes(graph, rows: Rows) -> int:
    """K and V bytes one step's attention reads (fp32 caches): each row's own length per node (a
    window caps it); recurrent states read and written once per row."""
    n = 0
    for node in graph.nodes:
        if node.op == "attention":
            spec, window = node.args["k"].spec, node.args["window"]
            lengths = [p + 1 for p in rows.positions] if node.args["length"] == "self" else rows.cross_len
            n += sum(min(x, window or x) for x in lengths) * spec.heads * spec.head_dim * 2 * 4
    return n + sum(2 * 4 * math.prod(s.shape) for s in graph.states.values()) * len(rows.positions)


def perop_whisper(ctx: Ctx, fam, batch: int, rows: Rows, caches: dict) -> dict:
    """decoder_step.triton_perop_step (the per-op Triton kernels, fp32 weights) in a CUDA graph, at
    the same inputs; its logits checked against run_reference first."""
    import torch

    from photon_core.backends.select import get_backend
    from photon_core.megakernel.stepgraph import run_reference
    from photon_core.models.whisper.decoder_step import triton_perop_step
    tri = get_backend("triton", ctx.dev)
    dev, n = ctx.dev, fam.shape[2]
    toks = torch.tensor(rows.tokens, device=dev, dtype=torch.int32)
    pos = torch.tensor(rows.positions, device=dev, dtype=torch.int32)
    xlen = torch.tensor(rows.cross_len, device=dev, dtype=torch.int32)
    cross = [(caches[f"L{i}.xk"], caches[f"L{i}.xv"]) for i in range(n)]

    def kv():
        return [(caches[f"L{i}.kcache"].clone(), caches[f"L{i}.vcache"].clone()) for i in range(n)]

    g = build(ctx, fam, batch).step(advance=False).graph_def
    want = run_reference(g, fam.ref_weights(torch.float32), {k: v.clone() for k, v in caches.items()},
                         rows.tokens, rows.positions, rows.cross_len)
    logits, _ = triton_perop_step(tri, fam.wt, toks, pos, kv(), cross, xlen)
    err = rel_err(logits, want["logits"])
    ctx.checks.expect(err <= TOL, f"timing {fam.name} B{batch}: per-op step logits err {err:.1e}")
    state = kv()
    t = timer(graphed(lambda: triton_perop_step(tri, fam.wt, toks, pos, state, cross, xlen), ctx.cuda),
              ctx.sizes.iters, ctx.sizes.warmup, ctx.cuda)
    return dict(us=t * 1e6, rel_err=err)


def time_step(ctx: Ctx, fam, batch: int, dtype_name: str, perop: dict | None) -> dict:
    b = build(ctx, fam, batch)
    step = b.step(advance=False)
    kernel = b.kernel(step)
    b.use_dtype(step, dtype_of(dtype_name))
    rows = fam.rows(batch, "fixed")
    fill(step, rows, seed=20 + batch)
    apply_inputs(step, fam, rows.tokens, rows.positions)
    kernel.launch()
    ctx.sync()
    problem = flags(kernel)
    t = timer(graphed(kernel.launch, ctx.cuda), ctx.sizes.iters, ctx.sizes.warmup, ctx.cuda)
    ctx.sync()
    problem = problem or flags(kernel)
    ctx.checks.expect(problem is None, f"timing {fam.name} B{batch} {dtype_name}: {problem}")
    wbytes, kvbytes = step.weight_bytes_per_step(), kv_read_bytes(step.graph_def, rows)
    floor = (wbytes + kvbytes) / (ctx.args.hbm_tbps * 1e12)
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


def prove_timing(ctx: Ctx, fams: dict) -> list[dict]:
    out: list[dict] = []
    for fam in fams.values():
        for batch in batches(ctx, fam, "timing"):
            perop = None
            if fam.perop and not over_budget(ctx, f"{fam.name} B{batch} per-op"):
                # Per-op first: its compile and capture count against this configuration's budget.
                rows = fam.rows(batch, "fixed")
                step = build(ctx, fam, batch).step(advance=False)
                perop = guarded(ctx, f"timing per-op {fam.name} B{batch}",
                                lambda: perop_whisper(ctx, fam, batch, rows, fill(step, rows, seed=20 + batch)))
            for dt in [d for b, d in configs(ctx, fam, "timing") if b == batch]:
                if over_budget(ctx, f"{fam.name} B{batch} {dt}"):
                    continue
                r = guarded(ctx, f"timing {fam.name} B{batch} {dt}", lambda: time_step(ctx, fam, batch, dt, perop))
                if r is not None:
                    out.append(r)
    by = {(r["family"], r["dtype"], r["batch"]): r for r in out}
    for (f, dt, batch), r in by.items():
        one = by.get((f, dt, 1))
        if batch != 1 and one is not None:
            r["x_batch1"] = r["us"] / one["us"]
            print(f"  {f:22s} {dt}: batch {batch} takes {r['x_batch1']:.2f}x batch 1's time "
                  f"({batch / r['x_batch1']:.1f}x the rows per second)", flush=True)
    return out


def compare_ways(ctx: Ctx, ways: dict, n: int, what: str) -> tuple[bool, dict[str, float]]:
    """Each way of decoding ({name: (step, () -> tokens per row)}, "host" first) run round_repeats
    times from the same state (restored after each): whether all give host's tokens (a check, which
    also fails if the tokens never change), and each way's median time per token in us."""
    import statistics
    tokens, secs = {}, {k: [] for k in ways}
    for _ in range(ctx.sizes.round_repeats):
        for k, (s, fn) in ways.items():
            with preserved(s):
                ctx.sync()
                t = time.perf_counter()
                tokens[k] = fn()
                ctx.sync()
                secs[k].append(time.perf_counter() - t)
    same = all(t == tokens["host"] for t in tokens.values())
    varied = len({t for row in tokens["host"] for t in row}) > 1
    ctx.checks.expect(same and varied, f"{what}: tokens differ between the ways of decoding "
                                       f"({ {k: v[0][:6] for k, v in tokens.items()} }) or never change")
    return same, {k: statistics.median(v) / (n - 1) * 1e6 for k, v in secs.items()}


def prove_rounds(ctx: Ctx, fam, batch: int) -> dict | None:
    """Part 6: the production decode loop's ways give the same tokens; time per token each."""
    import torch

    from photon_core.megakernel.decode_loop import DeviceDecode
    b = build(ctx, fam, batch)
    step = b.step(advance=True)
    g = step.graph_def
    result = next((n.args["name"] for n in g.nodes if n.op == "argmax" and n.args["advance"]), None)
    if result is None or any(n.op == "input" for n in g.nodes):
        return None   # the host must write something every step: nothing to run in rounds
    # "pick": rounds whose token device torch ops choose after each launch (the path Whisper's
    # logit rules take): torch's argmax of the exposed logits, on the same graph without advance
    # (the loop steps positions itself), its own arena filled with the same history.
    plain = b.step(advance=False) if "logits" in g.exposed else None
    dtype, B = dtype_of(fam.stress_dtype), batch
    for s in filter(None, (step, plain)):
        b.kernel(s)
        b.use_dtype(s, dtype)   # before capture: graphs keep the arena they saw
    # Built before the states are filled: on a GPU building captures the rounds, which runs steps.
    loops = {"replay": (step, DeviceDecode(step, result, chunk=1)), "rounds": (step, DeviceDecode(step, result))}
    if plain is not None:
        logits = plain.view("logits")
        loops["pick"] = (plain, DeviceDecode(plain, pick=lambda: torch.argmax(logits[:B], dim=-1)))
    rows = fam.rows(batch, "fixed")
    for s in filter(None, (step, plain)):
        fill(s, rows, seed=60 + batch)
        s.set_step(rows.tokens, rows.positions)
    n, kernel = ctx.sizes.round_tokens, b.kernel(step)
    col = g.results.index(result)

    def host_driven() -> list[list[int]]:
        out = [[t] for t in rows.tokens]
        for _ in range(n - 1):
            kernel.launch()
            kernel.raise_on_error()                        # two reads: the error flag, the claim count
            step.out.view(B, -1)[:, col].tolist()          # the token column, as the old loop read it
            for r, t in enumerate(step.dyn[:B].tolist()):
                out[r].append(t)
        return out

    ways = {"host": (step, host_driven),
            **{k: (s, lambda lp=lp: lp.generate(rows.tokens, n, ())) for k, (s, lp) in loops.items()}}
    same, us = compare_ways(ctx, ways, n, f"rounds {fam.name} B{batch}")
    pick = f", rounds picking by torch ops {us['pick']:.1f}" if "pick" in us else ""
    res = dict(family=fam.name, batch=batch, dtype=fam.stress_dtype, tokens=n, same=same, ways=list(ways),
               us_per_token=us, rounds_read=loops["rounds"][1].rounds, x_host=us["rounds"] / us["host"])
    print(f"  {fam.name:22s} B{batch} {fam.stress_dtype}: {n - 1} steps, tokens identical {same}; us/token "
          f"host-driven {us['host']:.1f}, replay + read per token {us['replay']:.1f}, rounds of 8 "
          f"{us['rounds']:.1f} ({res['x_host']:.2f}x host-driven){pick}", flush=True)
    return res


# ---------------------------------------------------------------------------------------------------
# Driver


def guarded(ctx: Ctx, what: str, fn: Callable[[], Any]) -> Any:
    """Run one configuration; an exception is a failed check (with its traceback), not the end of the
    proof, so one broken configuration does not hide the others."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001
        traceback.print_exc()
        ctx.checks.expect(False, f"{what}: {type(e).__name__}: {e}")
        return None


def configs(ctx: Ctx, fam, part: str) -> list[tuple[int, str]]:
    """(batch, weight dtype) pairs a part runs for a family: every pair on a GPU. In the dry run,
    where each launch is a fraction of a second of Python, fewer: the steps pair each batch with one
    dtype (both batches and both dtypes still run), the stress-type parts take the largest batch in
    the stress dtype, timing (which times nothing real there) every batch in the stress dtype."""
    if part not in fam.parts:
        return []
    if ctx.cuda:
        return [(b, dt) for b in fam.batches for dt in fam.dtypes]
    if part == "steps":
        return [(b, fam.dtypes[i % len(fam.dtypes)]) for i, b in enumerate(fam.batches)]
    if part == "timing":
        return [(b, fam.stress_dtype) for b in fam.batches]
    return [(fam.batches[-1], fam.stress_dtype)]


def batches(ctx: Ctx, fam, part: str) -> list[int]:
    return list(dict.fromkeys(b for b, _ in configs(ctx, fam, part)))


def run_part(ctx: Ctx, part: str, fams: dict) -> Any:
    selected = [f for f in fams.values()]
    results: list = []
    if part == "steps":
        for f in selected:
            for batch, dt in configs(ctx, f, part):
                results.append(guarded(ctx, f"steps {f.name} B{batch} {dt}", lambda: prove_steps(ctx, f, batch, dt)))
    elif part in ("stress", "poison"):
        fn = prove_stress if part == "stress" else prove_poison
        for f in selected:
            for batch in batches(ctx, f, part):
                results.append(guarded(ctx, f"{part} {f.name} B{batch}", lambda: fn(ctx, f, batch)))
    elif part == "control":
        for f in selected:
            if f.control:
                for batch in batches(ctx, f, part):
                    results.append(guarded(ctx, f"control {f.name} B{batch}", lambda: prove_control(ctx, f, batch)))
    elif part == "rounds":
        for f in selected:
            # A step that advances itself, or one fed embeddings (Moondream 2's: its caption/query
            # rounds, and its detect/point rounds).
            proofs = ([prove_rounds] if f.advance else
                      [prove_feed_rounds, prove_object_rounds] if getattr(f, "feeds_embeddings", False) else [])
            for prove in proofs:
                for batch in batches(ctx, f, part):
                    # Its tokens are also proven on the CPU (test_megakernel_decode_loop.py): under a
                    # short budget it yields to the timing part, saying so.
                    if not over_budget(ctx, f"rounds {f.name} B{batch}"):
                        results.append(guarded(ctx, f"rounds {f.name} B{batch}", lambda: prove(ctx, f, batch)))
    elif part == "liveness":
        results.append(guarded(ctx, "liveness", lambda: prove_liveness(ctx)))
    elif part == "timing":
        results = guarded(ctx, "timing", lambda: prove_timing(ctx, fams)) or []
    return [r for r in results if r is not None]


def summary_lines(ctx: Ctx) -> list[str]:
    """One Markdown table (per family, batch and weight dtype), then the control and liveness."""
    from report import heading
    parts = ctx.out["parts"]
    title = "Megakernel proof on GPU" + (" (dry run: CPU interpreter, tiny shapes)" if not ctx.cuda else "")
    lines = heading(title) + [
        f"{ctx.out['device']}, {ctx.sms} SMs; random weights of the real shapes; Tiling() unless /split. Steps: "
        "max rel. error vs stepgraph.run_reference and the family's reference_step (weights as the arena holds "
        "them), argmax picks identical (+ near-ties). Stress: launches per program count, outputs that differed "
        "from the first (every other launch after a NaN-fill of the scratch, a 512 MB copy loop on another "
        "stream). Timing: CUDA-graph replay, median; floor = (weights + K/V read) / "
        f"{ctx.args.hbm_tbps} TB/s; per-op = Whisper's per-op Triton step in a CUDA graph (fp32 weights).", "",
        "| model | batch | weights | steps: err values / kv, picks | stress: launches x programs, differing "
        "| poisoned launches, differing | us/step | GB/s | x floor | x per-op | B/B1 time |",
        "|---|---:|---|---|---|---|---:|---:|---:|---:|---:|"]
    steps = {(r["family"], r["batch"], r["dtype"]): r for r in parts.get("steps", {}).get("results", [])}
    stress = {(r["family"], r["batch"]): r for r in parts.get("stress", {}).get("results", [])}
    poison = {(r["family"], r["batch"]): r for r in parts.get("poison", {}).get("results", [])}
    timing = {(r["family"], r["batch"], r["dtype"]): r for r in parts.get("timing", {}).get("results", [])}
    order = {name: i for i, name in enumerate(dict.fromkeys(k[0] for k in list(steps) + list(timing)))}
    keys = sorted(set(steps) | set(timing), key=lambda k: (order[k[0]], k[1], k[2] != "fp32"))
    for f, batch, dt in keys:
        s, t = steps.get((f, batch, dt)), timing.get((f, batch, dt))
        st = stress.get((f, batch)) if dt == (stress.get((f, batch)) or {}).get("dtype") else None
        po = poison.get((f, batch)) if st else None
        cells = [f, str(batch), dt,
                 f"{s['max_err']['values']:.0e} / {s['max_err']['kv']:.0e}, {s['exact']}+{s['tolerated']}/{s['picks']}"
                 if s else "-",
                 ", ".join(f"{r['launches']}x{r['programs']}: {r['differing']}" for r in st["runs"]) if st else "-",
                 f"{po['run']['launches']}: {po['run']['differing']}" if po else "-",
                 f"{t['us']:.1f}" if t else "-", f"{t['gbps']:.0f}" if t else "-", f"{t['x_floor']:.2f}" if t else "-",
                 f"{t['x_perop']:.2f}" if t and "x_perop" in t else "-",
                 f"{t['x_batch1']:.2f}" if t and "x_batch1" in t else "-"]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    for c in parts.get("control", {}).get("results", []):
        place = ", ".join(f"{r['programs']} programs: {r['differing']} of {r['launches']}" for r in c["in_place"])
        lines.append(f"Positive control ({c['family']} B{c['batch']}): waits {c['dropped']} of task {c['task']} "
                     f"`{c['name']}` dropped; checker rejects it: {bool(c['checker'])}; stress in place: {place} "
                     f"launches differ" + ("" if c["race_can_show"] else " (the interpreter cannot race)")
                     + f"; moved before its producer: {c['forced']['differing']} of {c['forced']['launches']} differ.")
    for r in parts.get("liveness", {}).get("results", []):
        lines.append(f"Liveness: a never-signalled wait (spin limit {r.get('spin_limit')}) returned in "
                     f"{r.get('launch_s')} s and raised: {bool(r.get('ok'))}.")
    for r in parts.get("rounds", {}).get("results", []):
        us = r["us_per_token"]
        if r.get("objects"):
            lines.append(f"Detect/point rounds ({r['family']} B{r['batch']} {r['dtype']}, rounds of 3, 5, 8): "
                         f"captured == eager {r['same']}; us/step captured {us['graphs']:.1f}, eager {us['eager']:.1f}.")
            continue
        if r.get("feed"):
            lines.append(f"Decode loop ({r['family']} B{r['batch']} {r['dtype']}, {r['tokens'] - 1} steps fed "
                         f"embeddings): tokens identical {r['same']}; us/token host-driven {us['host']:.1f}, "
                         f"rounds of 8 {us['rounds']:.1f} ({r['x_host']:.2f}x).")
            continue
        lines.append(f"Decode loop ({r['family']} B{r['batch']} {r['dtype']}, {r['tokens'] - 1} steps): tokens "
                     f"identical {r['same']}; us/token host-driven {us['host']:.1f}, one replay + read per token "
                     f"{us['replay']:.1f}, rounds of 8 {us['rounds']:.1f} ({r['x_host']:.2f}x)"
                     + (f", rounds picking by torch ops {us['pick']:.1f}" if "pick" in us else "") + ".")
    for msg in ctx.out.get("skipped", []):
        lines.append(f"Skipped: {msg}.")
    failed = ctx.checks.failed
    lines.append(f"Checks: {ctx.checks.passed} passed, {len(failed)} failed"
                 + (": " + "; ".join(x[:200] for x in failed[:5]) if failed else "") + ".")
    return lines


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry-run", action="store_true", help="CPU interpreter, tiny shapes, a few steps/launches")
    p.add_argument("--json", default="", help="write the results here (rewritten after every part)")
    p.add_argument("--write", action="store_true", help="put the summary table into bench/RESULTS.md")
    p.add_argument("--budget-s", type=float, default=540.0,
                   help="wall-clock budget: timing is skipped when it runs short (correctness never is)")
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {PARTS}")
    p.add_argument("--families", default="", help="comma-separated subset (default: all)")
    p.add_argument("--steps", type=int, default=0, help="override the steps of part 1")
    p.add_argument("--launches", type=int, default=0, help="override the launches per stress of part 2")
    p.add_argument("--hbm-tbps", type=float, default=4.8, help="HBM bandwidth for the floor (H200: 4.8)")
    p.add_argument("--time-anyway", action="store_true", help="time even after a failed correctness check")
    p.add_argument("--liveness-child", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    """Run the proof; returns the results (also written with --json). The exit status is cli()'s."""
    args = parse(argv)
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"   # before triton is first imported
    import torch
    cuda = torch.cuda.is_available() and not args.dry_run
    if not cuda and not args.dry_run:
        raise SystemExit("gpu_proof needs a CUDA GPU; use --dry-run to exercise it on the CPU interpreter")
    torch.set_grad_enabled(False)
    if args.dry_run:
        # The interpreter computes with numpy, which warns about the NaNs the poisoning and the
        # positive control put in on purpose.
        warnings.filterwarnings("ignore", "All-NaN slice encountered")
        warnings.filterwarnings("ignore", "invalid value encountered", RuntimeWarning)
    # The references are plain fp32 PyTorch: no TF32 in their matrix products.
    torch.set_float32_matmul_precision("highest")
    dev = torch.device("cuda" if cuda else "cpu")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count if cuda else 3
    sizes = DRY_SIZES if args.dry_run else GPU_SIZES
    sizes = replace(sizes, steps=args.steps or sizes.steps, launches=args.launches or sizes.launches)
    out = dict(device=torch.cuda.get_device_name(dev) if cuda else "cpu (TRITON_INTERPRET=1)", sms=sms,
               dry_run=args.dry_run, torch=torch.__version__, budget_s=args.budget_s, sizes=sizes.__dict__,
               parts={})
    ctx = Ctx(args, dev, cuda, sizes, sms, Checks(), out)
    fams = families(args.dry_run, sms)
    if args.families:
        wanted = args.families.split(",")
        unknown = set(wanted) - set(fams)
        if unknown:
            raise SystemExit(f"unknown families {sorted(unknown)}; choose from {list(fams)}")
        fams = {k: v for k, v in fams.items() if k in wanted}
    parts = [p for p in PARTS if p in args.parts.split(",")]
    mode = "" if cuda else ", interpreter: programs run one after another"
    print(f"megakernel proof on {out['device']} ({sms} SMs{mode}); families {list(fams)}; parts {parts}; "
          f"budget {args.budget_s:.0f} s", flush=True)
    ctx.noise = Noise(ctx)
    if ctx.noise.gbps:
        out["noise_copy_gbps"] = ctx.noise.gbps
        print(f"noise stream: 512 MB device copies at {ctx.noise.gbps:.0f} GB/s (read + write)", flush=True)
    for n, part in enumerate(parts, 1):
        t = time.time()
        print(f"\n[{n}/{len(parts)}] {part}  (at {ctx.elapsed():.0f} s)", flush=True)
        if part == "timing" and ctx.checks.failed and not args.time_anyway:
            # A kernel that failed a check is not timed (and one whose waits time out would spend
            # the session's minutes doing it); --time-anyway overrides.
            msg = f"timing SKIPPED: {len(ctx.checks.failed)} correctness checks failed"
        elif part == "timing" and ctx.left() < 30:
            msg = f"timing SKIPPED: {ctx.left():.0f} s left of --budget-s {args.budget_s:.0f}"
        else:
            msg = ""
        if msg:
            print(f"  {msg}", flush=True)
            out.setdefault("skipped", []).append(msg)
            out["parts"][part] = dict(skipped=True, seconds=0.0, results=[])
            continue
        failed_before = len(ctx.checks.failed)
        from photon_core.megakernel.compiler import cuda_kv_dtype
        # The checks compare against fp32 references (fp32 caches); timing runs the production
        # default, bf16 KV.
        with cuda_kv_dtype(torch.bfloat16 if part == "timing" else torch.float32):
            results = run_part(ctx, part, fams)
        secs = round(time.time() - t, 1)
        out["parts"][part] = dict(seconds=secs, results=results, failed=ctx.checks.failed[failed_before:])
        print(f"  -> {part}: {secs} s, {len(ctx.checks.failed) - failed_before} failed checks", flush=True)
        ctx.save()
    ctx.save()
    lines = summary_lines(ctx)
    from report import publish
    if args.write and args.dry_run:
        print("(--write ignored: a dry run's numbers do not belong in bench/RESULTS.md)", flush=True)
    publish(lines, args.write and not args.dry_run)
    print("part seconds: " + ", ".join(f"{k} {v['seconds']}" for k, v in out["parts"].items())
          + f"; total {ctx.elapsed():.0f} s", flush=True)
    if ctx.checks.failed:
        print(f"PROOF FAILED: {len(ctx.checks.failed)} of {ctx.checks.passed + len(ctx.checks.failed)} checks",
              flush=True)
        for f in ctx.checks.failed:
            print(f"  - {f[:400]}", flush=True)
    else:
        print(f"PROOF PASSED: {ctx.checks.passed} checks", flush=True)
    return out


def cli(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.liveness_child:
        if args.dry_run:
            os.environ["TRITON_INTERPRET"] = "1"
        return liveness_child(args.dry_run)
    return 0 if main(argv)["passed"] else 1


if __name__ == "__main__":
    sys.exit(cli())
