"""The decode megakernel proved right on a GPU, then timed: the driver of photon_core.gpu_proof
(every part of the spec's "Proving it on a GPU", /work/shared/specs/megakernel.md), failing loudly
(exit status 1 on any failed check).

    python bench/gpu_proof.py --profile core      # Whisper tiny.en + Moondream 2: the core verdicts
    python bench/gpu_proof.py --profile others    # the other families, the decode loop, liveness
    python bench/gpu_proof.py --plan --profile core    # CPU: the time plan on an H200, part by part
    python bench/gpu_proof.py --dry-run [...]     # CPU, TRITON_INTERPRET=1, tiny shapes: every part's machinery

On a lent GPU session run it through bench/gpu.sh (`core`, then `others`: one call of <= 240 s
each; the header there has the commands). Every run prints its time plan first (gpu_proof.plan:
seconds per part predicted from the costs the first GPU run measured, gpu_proof.costs), so a log
shows predicted and actual side by side; tests hold each profile's plan to 240 s.

Profiles (families: random weights of the real shapes, no checkpoint travels; Tiling() unless /split):
  core    whisper-tiny.en (d 384, 4 layers, vocab 51864, 448 positions, 1500 frames) and moondream2
          (MoondreamConfig(): d 2048, 24 layers, vocab 51200, region heads) at batch 1 and 8, fp32 and
          bf16 weights: steps, timing, stress, poison; Whisper's positive control.
  others  whisper-turbo (large-v3-turbo's decoder) and whisper-tiny.en/split (the roofline's GPU
          tiling) at batch 1 and 8; through GraphFamily (bf16) at batch 1: qwen3-asr-0.6b,
          qwen3.5-0.8b, gemma4-e2b (its rows cross the 512-slot rings) and moondream3 (9B-A2B, if its
          decode step exists); the production decode loop (rounds) of Qwen3-ASR, Whisper tiny.en and
          Moondream 2 at batch 1, each in a child process; liveness.
  all     the union, every family at batch 1 and 8 (more than one GPU call holds).

Parts, in the order they run (photon_core.gpu_proof.<module>; every configuration's result is
written to --json as soon as it is done, so a run killed by a timeout keeps everything it finished):
  steps     consecutive decode steps, each a CUDA-graph replay, vs eager.run_reference and the
            family's reference_step: exposed values, argmax picks, appended K/V, states, advanced rows;
            the first and last full step also against a float64 reference, by their per-layer error
            profile (checks.judge_profile: fp32 noise passes, a step in the profile fails).
  timing    CUDA-graph replay, median: time per step vs the HBM floor and the per-op CUDA graph,
            batch 8 vs 1. Right after the steps, so a kill in a later part leaves it; a configuration
            whose steps failed is not timed (--time-anyway overrides), one is skipped (saying so)
            when --budget-s runs short. Under the GPU lock: no child process launches meanwhile.
  stress    fixed inputs, 1000 launches at 1, 3, #SMs and 2 x #SMs programs beside a 512 MB copy
            stream, each program count cut to a time cap by its first launch's time (checks.launch_plan:
            Moondream 2's slow launches): every launch bit-identical to the first (every other after
            a NaN-fill of scratch).
  poison    scratch NaN-filled before every launch: nothing unwritten, outputs unchanged.
  control   one wait dropped: the checker rejects it and the stress must see outputs differ; the task
            moved before its producer must be caught (also under the interpreter).
  liveness  a never-signalled wait returns and names its task (child process, started first).
  rounds    the production decode loop: host-driven, replay per token and device rounds agree. Each
            family in a child process (gpu_proof.children: a sticky CUDA error ends that child, not
            the run), started with the run beside the builds and merged when it ends.
After a configuration leaves this process's CUDA context unusable, the rest of the process's
configurations are skipped (saying why); the children's parts go on.

Before any part, every step the profile needs is built (lower + check, host work) and each kernel
variant is compiled in a pool of worker processes (proof.prewarm) while the next one builds.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
import warnings
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

# photon_core.megakernel imports Triton, which reads TRITON_INTERPRET once, when first imported:
# the package is imported inside the functions, after main() has set it for a dry run.
if TYPE_CHECKING:
    from photon_core.gpu_proof.checks import Ctx
    from photon_core.megakernel.graph_family import GraphFamily

# The proof's parts in the order they run; checks imports neither torch nor Triton, so importing it
# here does not fix TRITON_INTERPRET before main() sets it.
from photon_core.gpu_proof.checks import PARTS  # noqa: E402


@dataclass(frozen=True)
class Plan:
    """What a profile runs for one family: its parts, and its batches (None: the family's own)."""
    parts: tuple[str, ...]
    batches: tuple[int, ...] | None = None


PROFILES: dict[str, dict[str, Plan]] = {
    "core": {"whisper-tiny.en": Plan(("steps", "stress", "poison", "control", "timing")),
             "moondream2": Plan(("steps", "stress", "poison", "timing"))},
    "others": {"whisper-turbo": Plan(("steps", "stress", "poison", "timing")),
               "whisper-tiny.en/split": Plan(("steps", "timing")),
               # Batch 8 of these graphs takes the host a minute or more to lower and check each
               # (Qwen3-ASR's: 33K tasks); the all profile runs it.
               "qwen3-asr-0.6b": Plan(("steps", "poison", "rounds", "timing"), (1,)),
               "qwen3.5-0.8b": Plan(("steps", "poison", "timing"), (1,)),
               "gemma4-e2b": Plan(("steps", "poison", "timing"), (1,)),
               "moondream3": Plan(("steps", "poison", "timing"), (1,)),
               "whisper-tiny.en": Plan(("liveness", "rounds"), (1,)),
               "moondream2": Plan(("rounds",), (1,))},
}
PROFILES["all"] = {name: Plan(tuple(p for p in PARTS if any(p in pr[name].parts for pr in PROFILES.values()
                                                              if name in pr)))
                   for name in dict.fromkeys(n for pr in list(PROFILES.values()) for n in pr)}
TITLES = dict(core="Whisper tiny.en and Moondream 2", others="the other families", all="every family")
# What each profile's call may take, bench/gpu.sh's start to its end (its GPU_SH_LIMIT_S): the plan
# of `core` and of `others` must fit (test_megakernel_bench).
PLAN_LIMIT_S = 240.0
# The interpreter runs ~10 ms of Python per task: in the dry run these families run fewer parts
# (their other parts exercise nothing the rest do not: timing where the byte count differs, i.e.
# recurrent states and windows; Qwen3-ASR's plain GQA poisoned as Whisper's and Moondream 2's are).
DRY_PARTS = {"whisper-tiny.en/split": ("steps",), "qwen3-asr-0.6b": ("steps", "rounds"),
             "qwen3.5-0.8b": ("steps", "poison", "timing"), "gemma4-e2b": ("steps", "poison", "timing"),
             "moondream3": ("steps", "poison")}


def families(dry: bool, sms: int) -> dict[str, Any]:
    """Every family the proof knows, by name, at real sizes (tiny ones for the dry run)."""
    from photon_core.gpu_proof.families import MoondreamFamily, WhisperFamily
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
        fams = [WhisperFamily("whisper-tiny.en", 64, 2, 1, 96, 16, 8, prod, (1, 2), both, "fp32", (1, 2), (8, -1)),
                WhisperFamily("whisper-tiny.en/split", 64, 2, 1, 96, 16, 8, split, (1,), ("bf16",), "bf16",
                              (1, 2), (8, -1), perop=False),
                MoondreamFamily("moondream2", cfg, 32, prod, (1, 2), both, "bf16", (4, 3), (12, 1))]
    else:
        # What photon_core builds today: Tiling() for every family and batch.
        prod = lambda b: Tiling()  # noqa: E731
        # The roofline's GPU tiling: 64-column tiles, stages of few tiles narrowed / split-K to 2 x #SMs.
        split = lambda b: Tiling(block_n=64, block_k=max(16, 128 // b), block_t=64, self_splits=4,  # noqa: E731
                                 cross_splits=8, min_tasks=2 * sms)
        cfg = MoondreamConfig()
        fams = [WhisperFamily("whisper-tiny.en", 384, 6, 4, 51864, 448, 1500, prod, (1, 8), both, "fp32",
                              (1, 37), (224, -9)),
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
    weights: a 9B graph in fp32 besides the others would crowd an H200), tiny ones in the dry run
    (1-3 layers, width 64, vocabulary 96). Moondream 3 only where its decode step exists."""
    import torch

    import roofline
    from photon_core.megakernel.graph_family import GraphFamily
    from photon_core.models.gemma4 import decoder_step as gemma4
    from photon_core.models.gemma4.config import TextConfig as GemmaText
    from photon_core.models.qwen3_5 import decoder_step as qwen3_5
    from photon_core.models.qwen3_asr import decoder_step as qwen3_asr
    try:
        from photon_core.models.moondream3 import decoder_step as moondream3
    except ImportError:
        moondream3 = None
    if dry:
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
                        dtypes[-1], *rows["asr"]),
            GraphFamily("qwen3.5-0.8b", lambda: qwen3_5.step_graph(q35, lens["q35"], tied=True), prod, batches,
                        dtypes, dtypes[-1], *rows["q35"]),
            GraphFamily("gemma4-e2b", lambda: gemma4.step_graph(gem, lens["gem"], torch.bfloat16), prod, batches,
                        dtypes, dtypes[-1], *rows["gem"])]
    if md3 is not None:
        fams.append(GraphFamily("moondream3", lambda: moondream3.step_graph(moondream3.dims_of(md3), md3_len), prod,
                                batches, dtypes, dtypes[-1], *rows["md3"]))
    return fams



# ---------------------------------------------------------------------------------------------------
# Which configurations a profile runs


def plan_of(cuda: bool, fam, plan: Plan) -> Plan:
    """The family's plan with its batches resolved (dry-run families have batches (1, 2)) and the
    dry run's part limits applied."""
    batches = tuple(b for b in fam.batches if plan.batches is None or b in plan.batches) or fam.batches[:1]
    parts = plan.parts if cuda else tuple(p for p in plan.parts if p in DRY_PARTS.get(fam.name, PARTS))
    return Plan(parts, batches)


def configs(cuda: bool, fam, plan: Plan, part: str) -> list[tuple[int, str]]:
    """(batch, weight dtype) pairs a part runs for a family: every pair on a GPU. In the dry run,
    where each launch is a fraction of a second of Python, fewer: the steps pair each batch with one
    dtype (both batches and both dtypes still run), the stress-type parts take the largest batch in
    the stress dtype, timing (which times nothing real there) every batch in the stress dtype."""
    if part not in plan.parts:
        return []
    if cuda:
        return [(b, dt) for b in plan.batches for dt in fam.dtypes]
    if part == "steps":
        return [(b, fam.dtypes[i % len(fam.dtypes)]) for i, b in enumerate(plan.batches)]
    if part == "timing":
        return [(b, fam.stress_dtype) for b in plan.batches]
    return [(plan.batches[-1], fam.stress_dtype)]


def batches(cuda: bool, fam, plan: Plan, part: str) -> list[int]:
    return list(dict.fromkeys(b for b, _ in configs(cuda, fam, plan, part)))


def select(cuda: bool, profile: str, all_fams: dict, families_arg: str, parts_arg: str
           ) -> tuple[dict, dict[str, Plan], list[str], list[str]]:
    """(families, their plans, the parts run, families named but absent here) of a run."""
    pr = PROFILES[profile]
    wanted = families_arg.split(",") if families_arg else list(pr)
    unknown = set(wanted) - set(pr)
    if unknown:
        raise SystemExit(f"unknown families {sorted(unknown)} for profile {profile}; choose from {list(pr)}")
    fams = {k: all_fams[k] for k in pr if k in wanted and k in all_fams}
    absent = [k for k in pr if k in wanted and k not in all_fams]
    chosen = [p for p in PARTS if p in parts_arg.split(",")]
    plans = {k: (lambda pl: Plan(tuple(p for p in pl.parts if p in chosen), pl.batches))(plan_of(cuda, f, pr[k]))
             for k, f in fams.items()}
    fams = {k: f for k, f in fams.items() if plans[k].parts}
    parts = [p for p in chosen if any(p in pl.parts for pl in plans.values())]
    return fams, plans, parts, absent


def build_list(cuda: bool, fam, plan: Plan) -> list[tuple[int, str]]:
    """What the parts need built for a family, (batch, kind), in build order (largest batch first):
    "advance" / "plain" steps (a step that cannot advance itself is its own plain step) and "token",
    Moondream's pruned caption/query kernel at batch 1 (steps' "text" variant; rounds fed embeddings)."""
    out: list[tuple[int, str]] = []
    for batch in reversed(sorted({b for p in plan.parts for b in batches(cuda, fam, plan, p)})):
        parts = {p for p in plan.parts if batch in batches(cuda, fam, plan, p)}
        want: list[str] = []
        if "steps" in parts:
            want += ["advance"] if fam.advance else ["plain"] + (["token"] if batch == 1 else [])
        if {"stress", "poison", "control", "timing"} & parts:
            want.append("plain")
        if "rounds" in parts:
            if fam.advance:
                want += ["advance"] + (["plain"] if "logits" in fam_exposed(fam, batch) else [])
            elif getattr(fam, "feeds_embeddings", False):
                want += ["plain", "token"]
        out += [(batch, k) for k in dict.fromkeys(want)]
    return out


def fam_exposed(fam, batch: int) -> set[str]:
    """The exposed values of the family's step graph (the rounds' "pick" way needs logits)."""
    graph = getattr(fam, "graph", None)
    if graph is not None:
        return set(graph.exposed)
    return {"logits"}          # Whisper's and Moondream 2's steps expose logits


def prepare(ctx: Ctx, fams: dict, plans: dict[str, Plan]) -> None:
    """Build every step and kernel the parts will launch (lowering and checking: host work), largest
    first, each kernel's compiles submitted to the worker pool as soon as it exists, so the pool
    compiles while the host builds the rest; then wait for the compiles."""
    from photon_core.gpu_proof.build import build
    from photon_core.gpu_proof.checks import guarded
    from photon_core.gpu_proof.timing import warm_perop_whisper
    for name, fam in fams.items():     # per-op kernels first: they need no build
        if ctx.warm is not None and fam.perop and "timing" in plans[name].parts:
            for batch in batches(ctx.cuda, fam, plans[name], "timing"):
                ctx.warm.run(f"per-op {name} B{batch}", warm_perop_whisper, fam.shape, fam.max_len, fam.enc_len,
                             batch)
    for name in reversed(list(fams)):
        fam = fams[name]
        for batch, kind in build_list(ctx.cuda, fam, plans[name]):
            def need() -> None:
                b = build(ctx, fam, batch)
                if kind == "token":
                    b.kernel(b.step(advance=False), ("token",))
                else:
                    b.step(advance=kind == "advance")
            guarded(ctx, f"build {name} B{batch} {kind}", need)
    if ctx.warm is not None:
        t = time.time()
        print(f"  built everything at {ctx.elapsed():.0f} s; waiting for {len(ctx.warm.jobs)} compile jobs "
              f"({ctx.warm.workers} workers)", flush=True)
        try:
            ctx.warm.wait(max(10.0, ctx.left() - 60))
        except Exception as e:  # noqa: BLE001  the pool only saves time: launches compile what they need
            print(f"  compile pool failed ({type(e).__name__}: {e}): variants compile at first launch", flush=True)
        ctx.out["compiles"] = ctx.warm.done + ctx.out.get("compiles", [])
        print(f"  compiles done {time.time() - t:.0f} s after the builds (at {ctx.elapsed():.0f} s)", flush=True)
    ctx.save()


def steps_failed(ctx: Ctx, name: str, batch: int, dtype: str) -> bool:
    """Whether this configuration's steps ran and failed (then it is not timed)."""
    return any(r["family"] == name and r["batch"] == batch and r["dtype"] == dtype and not r.get("passed", True)
               for r in ctx.out.get("parts", {}).get("steps", {}).get("results", []))


def run_part(ctx: Ctx, part: str, fams: dict, plans: dict[str, Plan], liveness: Any, time_anyway: bool = False
             ) -> None:
    """Every configuration of one part, each recorded (and the results file written) when done."""
    from photon_core.gpu_proof import liveness as live
    from photon_core.gpu_proof.checks import guarded, over_budget, skip
    from photon_core.gpu_proof.races import prove_control, prove_poison, prove_stress
    from photon_core.gpu_proof.rounds import prove_feed_rounds, prove_object_rounds, prove_rounds
    from photon_core.gpu_proof.steps import prove_steps
    from photon_core.gpu_proof.timing import prove_timing
    ctx.record(part, None)
    for name, fam in fams.items():
        plan = plans[name]
        if part == "steps":
            for batch, dt in configs(ctx.cuda, fam, plan, part):
                ctx.record(part, guarded(ctx, f"steps {name} B{batch} {dt}", lambda: prove_steps(ctx, fam, batch, dt)))
        elif part in ("stress", "poison", "control"):
            fn = dict(stress=prove_stress, poison=prove_poison, control=prove_control)[part]
            for batch in batches(ctx.cuda, fam, plan, part):
                ctx.record(part, guarded(ctx, f"{part} {name} B{batch}", lambda: fn(ctx, fam, batch)))
        elif part == "rounds":
            # A step that advances itself, or one fed embeddings (Moondream 2's: its caption/query
            # rounds, and its detect/point rounds).
            proofs = ([prove_rounds] if fam.advance else
                      [prove_feed_rounds, prove_object_rounds] if getattr(fam, "feeds_embeddings", False) else [])
            for prove in proofs:
                for batch in batches(ctx.cuda, fam, plan, part):
                    if not over_budget(ctx, f"rounds {name} B{batch}"):
                        ctx.record(part, guarded(ctx, f"rounds {name} B{batch}", lambda: prove(ctx, fam, batch)))
        elif part == "liveness" and part in plan.parts:
            ctx.record(part, guarded(ctx, "liveness", lambda: live.finish(ctx, liveness)))
        elif part == "timing":
            for batch in batches(ctx.cuda, fam, plan, part):
                # Timing runs right after the steps (a kill later still leaves it): a configuration
                # whose steps failed is not timed (--time-anyway overrides).
                dts = []
                for b, d in configs(ctx.cuda, fam, plan, part):
                    if b == batch and steps_failed(ctx, name, b, d) and not time_anyway:
                        skip(ctx, f"timing {name} B{b} {d} SKIPPED: its steps failed")
                    elif b == batch:
                        dts.append(d)
                if dts:
                    ctx.record(part, guarded(ctx, f"timing {name} B{batch}",
                                             lambda: prove_timing(ctx, fam, batch, dts)))


def summary_lines(ctx: Ctx, profile: str) -> list[str]:
    """One Markdown table (per family, batch and weight dtype), then the control and liveness."""
    from photon_core.gpu_proof.checks import NOISE_RATIO
    from report import heading
    parts = ctx.out.get("parts", {})
    title = f"Megakernel proof on GPU: {TITLES[profile]}" + (" (dry run: CPU interpreter, tiny shapes)"
                                                             if not ctx.cuda else "")
    lines = heading(title) + [
        f"{ctx.out['device']}, {ctx.sms} SMs; random weights of the real shapes; Tiling() unless /split. Steps: "
        "max rel. error vs eager.run_reference and the family's reference_step (weights as the arena holds "
        "them), argmax picks identical (+ near-ties); f64: the worst layer's megakernel error against a float64 "
        "reference over the fp32 reference's (its running maximum), first and last step (checks.judge_profile: "
        f"fp32 noise up to {NOISE_RATIO:g}). Stress: launches per program count, outputs that differed "
        "from the first (every other launch after a NaN-fill of the scratch, a 512 MB copy loop on another "
        "stream). Timing: CUDA-graph replay, median; floor = (weights + K/V read) / "
        f"{ctx.hbm_tbps} TB/s ({ctx.out.get('hbm_source', 'given')}; fp32 caches, as checked); per-op = "
        "Whisper's per-op Triton step in a CUDA graph (fp32 weights).", "",
        "| model | batch | weights | steps: err values / kv, picks | stress: launches x programs, differing "
        "| poisoned launches, differing | us/step | GB/s | x floor | x per-op | B/B1 time |",
        "|---|---:|---|---|---|---|---:|---:|---:|---:|---:|"]
    steps = {(r["family"], r["batch"], r["dtype"]): r for r in parts.get("steps", {}).get("results", [])}
    stress = {(r["family"], r["batch"]): r for r in parts.get("stress", {}).get("results", [])}
    poison = {(r["family"], r["batch"]): r for r in parts.get("poison", {}).get("results", [])}
    timing = {(r["family"], r["batch"], r["dtype"]): r for r in parts.get("timing", {}).get("results", [])}
    # Stress and poisoning run in the family's stress dtype: their cells sit in that dtype's row.
    tested = [(f, b, r["dtype"]) for (f, b), r in list(stress.items()) + list(poison.items())]
    order = {name: i for i, name in enumerate(dict.fromkeys(k[0] for k in list(steps) + tested + list(timing)))}
    keys = sorted(set(steps) | set(tested) | set(timing), key=lambda k: (order[k[0]], k[1], k[2] != "fp32"))
    for f, batch, dt in keys:
        s, t = steps.get((f, batch, dt)), timing.get((f, batch, dt))
        st = stress.get((f, batch)) if dt == (stress.get((f, batch)) or {}).get("dtype") else None
        po = poison.get((f, batch)) if dt == (poison.get((f, batch)) or {}).get("dtype") else None
        cells = [f, str(batch), dt,
                 f"{s['max_err']['values']:.0e} / {s['max_err']['kv']:.0e}, {s['exact']}+{s['tolerated']}/{s['picks']}"
                 + (f", f64 x{max(v['worst_ratio'] for v in s['float64'].values()):.1f}" if s.get("float64") else "")
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
            sizes = ", ".join(map(str, r.get("rounds", (3, 5, 8))))
            lines.append(f"Detect/point rounds ({r['family']} B{r['batch']} {r['dtype']}, rounds of {sizes}): "
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
    compiles = [c for c in ctx.out.get("compiles", []) if c.get("compile_s") is not None]
    if compiles:
        lines.append(f"Compiles ({len(compiles)} in worker processes, beside the builds): "
                     + ", ".join(f"{c['label']} {c['compile_s']} s" for c in compiles)
                     + f"; builds and compiles took {ctx.out.get('build_seconds')} s of the run's "
                     f"{ctx.out.get('seconds')} s.")
    for msg in ctx.out.get("skipped", []):
        lines.append(f"Skipped: {msg}.")
    failed = ctx.checks.failed
    lines.append(f"Checks: {ctx.checks.passed} passed, {len(failed)} failed"
                 + (": " + "; ".join(x[:200] for x in failed[:5]) if failed else "") + ".")
    return lines


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--profile", choices=list(PROFILES), default="all", help="which families and parts (above)")
    p.add_argument("--dry-run", action="store_true", help="CPU interpreter, tiny shapes, a few steps/launches")
    p.add_argument("--plan", action="store_true", help="print the time plan on an H200 (gpu_proof.plan) and exit")
    p.add_argument("--json", default="", help="write the results here (rewritten after every configuration)")
    p.add_argument("--write", action="store_true", help="put the summary table into bench/RESULTS.md")
    p.add_argument("--budget-s", type=float, default=None,
                   help="wall-clock budget (default 540 s on a GPU, none in the dry run): timing and rounds "
                        "configurations are skipped when it runs short (correctness never is)")
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {PARTS}")
    p.add_argument("--families", default="", help="comma-separated subset of the profile's (default: all)")
    p.add_argument("--steps", type=int, default=0, help="override the steps of part steps")
    p.add_argument("--launches", type=int, default=0, help="override the launches per stress")
    p.add_argument("--hbm-tbps", type=float, default=None,
                   help="HBM bandwidth for the floor (default: the device's by its name, gpu_proof.hbm: H200 4.8, "
                        "H100 SXM 3.35, H100 PCIe 2.0; 4.8 for a device not known there, saying so)")
    p.add_argument("--time-anyway", action="store_true", help="time even after a failed correctness check")
    p.add_argument("--workers", type=int, default=0, help="compile processes (default: CPU cores - 2, at most 14, "
                                                          "fewer beside child processes; 1 compiles in order)")
    p.add_argument("--in-child", action="store_true",
                   help="(internal) run as one family's child process: rounds in this process, under the GPU lock")
    return p.parse_args(argv)


# ---------------------------------------------------------------------------------------------------
# Child processes and the time plan


def child_builds(fam, plan: Plan) -> list[tuple[int, str]]:
    """What a family's rounds child builds."""
    return build_list(True, fam, Plan(("rounds",), plan.batches))


def rounds_children(args: argparse.Namespace, fams: dict, plans: dict[str, Plan], budget_s: float) -> list:
    """One child process per family with rounds: this driver, for that family's rounds alone. Each
    child's results file and log go to a temporary folder, never beside --json: the device tool
    brings back at most 8 files from $OUT (/work/.library/device/README.md), and 3 children's json
    and log beside the parent's gpu.log, json and RESULTS.md made 9. Nothing is lost: the parent
    merges each child's results into its own json (children.merge) and prints each child's log
    into its output (gpu.log) as the child is merged."""
    import tempfile

    from photon_core.gpu_proof.children import Child
    stem = Path(args.json).stem if args.json else "proof"
    base = Path(tempfile.mkdtemp(prefix="gpu_proof_children_")) / f"{stem}.json"
    out = []
    for name in fams:
        if "rounds" not in plans[name].parts:
            continue
        tag = name.replace("/", "-")
        json_path = base.with_name(f"{base.stem}.rounds-{tag}.json")
        argv = [sys.executable, str(Path(__file__).resolve()), "--profile", args.profile, "--parts", "rounds",
                "--families", name, "--json", str(json_path), "--budget-s", f"{budget_s:.0f}", "--workers", "1",
                "--in-child"] + (["--dry-run"] if args.dry_run else [])
        out.append(Child(f"rounds {name}", argv, json_path, json_path.with_suffix(".log"), timeout_s=budget_s))
    return out


def gpu_work(profile: str, families_arg: str = "", parts_arg: str = ",".join(PARTS), sms: int = 132):
    """What `profile` runs on a GPU, for the time plan (real-size families; nothing is built)."""
    from photon_core.gpu_proof.plan import Work
    fams, plans, parts, _ = select(True, profile, families(False, sms), families_arg, parts_arg)
    children = {k: [(b, kind) for b, kind in child_builds(f, plans[k])] for k, f in fams.items()
                if "rounds" in plans[k].parts}
    parent = {k: Plan(tuple(p for p in pl.parts if p != "rounds"), pl.batches) for k, pl in plans.items()}
    configs_ = [(part, k, b, dt) for part in parts for k, f in fams.items()
                for b, dt in (configs(True, f, parent[k], part) if part in ("steps", "timing") else
                              [(b, f.stress_dtype) for b in batches(True, f, parent[k], part)])]
    builds = [(k, b, kind) for k in reversed(list(fams)) for b, kind in build_list(True, fams[k], parent[k])]
    return Work(parts=parts, configs=configs_, builds=builds,
                children={k: [(k, b, kind) for b, kind in v] for k, v in children.items()},
                stress_dtype={k: f.stress_dtype for k, f in fams.items()},
                perop={k for k, f in fams.items() if f.perop}, liveness="liveness" in parts)


def time_plan(args: argparse.Namespace):
    """The prediction for this run's profile (and --families / --parts) at the GPU's sizes."""
    from photon_core.gpu_proof.checks import GPU_SIZES
    from photon_core.gpu_proof.plan import predict
    sizes = replace(GPU_SIZES, steps=args.steps or GPU_SIZES.steps, launches=args.launches or GPU_SIZES.launches)
    return predict(gpu_work(args.profile, args.families, args.parts), sizes)


# ---------------------------------------------------------------------------------------------------
# The run


def main(argv: list[str] | None = None) -> dict:
    """Run the proof; returns the results (also written with --json). The exit status is cli()'s."""
    args = parse(argv)
    if args.plan:
        pred = time_plan(args)
        print("\n".join(pred.lines(limit_s=PLAN_LIMIT_S, details=True)), flush=True)
        return dict(passed=True, plan=dict(seconds=pred.seconds, total=pred.total, beside=pred.beside))
    if args.budget_s is None:
        args.budget_s = float("inf") if args.dry_run else 540.0
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
    import triton

    from photon_core.gpu_proof import liveness as live
    from photon_core.gpu_proof.checks import DRY_SIZES, GPU_SIZES, Ctx
    from photon_core.gpu_proof.children import Children, gpu_lock, merge
    from photon_core.gpu_proof.races import Noise
    from photon_core.megakernel.compiler import cuda_kv_dtype
    dev = torch.device("cuda" if cuda else "cpu")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count if cuda else 3
    sizes = DRY_SIZES if args.dry_run else GPU_SIZES
    sizes = replace(sizes, steps=args.steps or sizes.steps, launches=args.launches or sizes.launches)
    from photon_core.gpu_proof.hbm import hbm_tbps
    device = torch.cuda.get_device_name(dev) if cuda else "cpu (TRITON_INTERPRET=1)"
    tbps, tbps_source = hbm_tbps(device, args.hbm_tbps)
    out = dict(device=device, sms=sms, hbm_tbps=tbps, hbm_source=tbps_source,
               profile=args.profile, dry_run=args.dry_run, torch=torch.__version__, triton=triton.__version__,
               python=sys.version.split()[0], budget_s=args.budget_s, sizes=sizes.__dict__, parts={})
    ctx = Ctx(dev, cuda, sizes, sms, budget_s=args.budget_s, json_path=args.json, hbm_tbps=tbps, out=out)
    fams, plans, parts, absent = select(cuda, args.profile, families(args.dry_run, sms), args.families, args.parts)
    if absent:   # moondream3 without its decode step; whisper-turbo has no dry-run size (tiny.en's shapes)
        print(f"not run here: {absent}", flush=True)
        out["absent"] = absent
    mode = "" if cuda else ", interpreter: programs run one after another"
    print(f"megakernel proof ({args.profile}) on {out['device']} ({sms} SMs{mode}); Python {out['python']}, torch "
          f"{out['torch']}, Triton {out['triton']}; families {list(fams)}; parts {parts}; budget {args.budget_s:.0f} s; "
          f"floors at {tbps} TB/s: {tbps_source}", flush=True)
    if not args.in_child:
        pred = time_plan(args)
        out["plan"] = dict(seconds=pred.seconds, total=pred.total, beside=pred.beside)
        print("\n".join(pred.lines(limit_s=PLAN_LIMIT_S)), flush=True)
    # The liveness child compiles and launches a tiny kernel of its own: started first, it runs
    # beside the builds and is collected in its part.
    liveness = live.start(ctx) if "liveness" in parts and not args.in_child else None
    # Each family's rounds in a child process of its own (gpu_proof.children), started now: they
    # build beside this process's builds and take the GPU lock for their launches, which this
    # process holds until the liveness child has exited.
    children, lock = None, None
    from_children: list[str] = []      # failed checks merged from the children (the rounds part's)
    if "rounds" in parts and not args.in_child:
        import tempfile
        kids = rounds_children(args, fams, plans, max(10.0, args.budget_s - 10))
        lock = str(Path(tempfile.gettempdir()) / f"gpu_proof.{os.getpid()}.lock")
        hold = (lambda: liveness[0].poll() is None and time.time() - liveness[1] < sizes.liveness_timeout_s
                ) if liveness is not None else None
        children = Children(kids, parallel=cuda, lock_path=lock, hold=hold)
        children.start()
        plans = {k: Plan(tuple(p for p in pl.parts if p != "rounds"), pl.batches) for k, pl in plans.items()}

        def collect() -> None:
            for c in children.done():
                before = len(ctx.checks.failed)
                lines = merge(out, ctx.checks, c, "rounds")
                from_children.extend(ctx.checks.failed[before:])
                # Its log into this process's output (gpu.log) now: the child's own files are in a
                # temporary folder that does not come back (rounds_children), and a kill later in
                # the run must not lose it.
                print(f"  ({c.label}: child process ended, exit {c.rc}{', killed' if c.killed else ''}, "
                      f"{c.ended - c.started:.1f} s; results merged; its log {c.log_path}:)", flush=True)
                print("\n".join(f"  | {line}" for line in lines), flush=True)
        ctx.on_record = collect
    run_fams = {k: f for k, f in fams.items() if plans[k].parts}
    if cuda:
        from photon_core.gpu_proof.prewarm import Prewarm
        # Beside child processes (each builds on a core and compiles in a worker of its own) fewer
        # compile workers, so the builds on this process's core keep theirs.
        workers = args.workers or max(2, min(14, (os.cpu_count() or 2) - 2) - 2 * len(children.children if children
                                                                                   else []))
        try:
            ctx.warm = Prewarm(workers)
        except Exception as e:  # noqa: BLE001  without the pool every variant compiles at first launch
            print(f"compile pool not started ({type(e).__name__}: {e}): variants compile at first launch", flush=True)
    # The noise stream only beside the race parts (a child running rounds does not need its 1 GB).
    ctx.noise = Noise(ctx, active=bool({"stress", "poison", "control"} & set(parts)))
    if ctx.noise.gbps:
        out["noise_copy_gbps"] = ctx.noise.gbps
        print(f"noise stream: 512 MB device copies at {ctx.noise.gbps:.0f} GB/s (read + write)", flush=True)
    # Every step is built with fp32 caches: the checks compare against fp32 references, and the
    # timing part times what they proved.
    with cuda_kv_dtype(torch.float32):
        t = time.time()
        print(f"\n[build] every step the parts need (at {ctx.elapsed():.0f} s)", flush=True)
        prepare(ctx, run_fams, plans)
        out["build_seconds"] = round(time.time() - t, 1)
        for n, part in enumerate(parts, 1):
            t = time.time()
            print(f"\n[{n}/{len(parts)}] {part}  (at {ctx.elapsed():.0f} s)", flush=True)
            failed_before = len(ctx.checks.failed)
            if part == "rounds" and children is not None:
                ctx.record(part, None)
                children.wait(max(5.0, ctx.left()))
                collect()          # each child's log was printed as it was merged
                for c in children.children:
                    print(f"  [{c.label}: child process, exit {c.rc}{', killed' if c.killed else ''}, "
                          f"{c.ended - c.started:.1f} s]", flush=True)
            else:
                # Timing, and a child's rounds, on a GPU nothing else of this run uses (the lock: a
                # child finds its path in its environment); timing waits for it at most 30 s.
                quiet = (gpu_lock(lock, wait_s=30.0 if part == "timing" else None)
                         if part in ("timing", "rounds") else contextlib.nullcontext(True))
                with quiet as alone:
                    if not alone:
                        note = f"{part}: the GPU lock was not free after 30 s; timed beside a child process"
                        print(f"  {note}", flush=True)
                        out.setdefault("notes", []).append(note)
                    run_part(ctx, part, run_fams, plans, liveness, args.time_anyway)
            if part == "timing":
                from photon_core.gpu_proof.timing import batch_ratios
                batch_ratios(out["parts"][part]["results"])
            # A child's failures belong to the rounds part, whichever part was running when it ended.
            failed = ([f for f in ctx.checks.failed[failed_before:] if f not in from_children]
                      if part != "rounds" else list(from_children))
            out["parts"][part].update(seconds=round(time.time() - t, 1), failed=failed)
            print(f"  -> {part}: {out['parts'][part]['seconds']} s, {len(failed)} failed checks", flush=True)
            ctx.save()
    if ctx.warm is not None:
        ctx.warm.close()
    if lock is not None:
        Path(lock).unlink(missing_ok=True)
    ctx.save()
    if not args.in_child:       # a child's results are in its parent's table
        lines = summary_lines(ctx, args.profile)
        from report import publish
        if args.write and args.dry_run:
            print("(--write ignored: a dry run's numbers do not belong in bench/RESULTS.md)", flush=True)
        publish(lines, args.write and not args.dry_run)
    print(f"build {out.get('build_seconds')} s; part seconds: "
          + ", ".join(f"{k} {v['seconds']}" for k, v in out["parts"].items()) + f"; total {ctx.elapsed():.0f} s",
          flush=True)
    if ctx.checks.failed:
        print(f"PROOF FAILED: {len(ctx.checks.failed)} of {ctx.checks.passed + len(ctx.checks.failed)} checks",
              flush=True)
        for f in ctx.checks.failed:
            print(f"  - {f[:400]}", flush=True)
    else:
        print(f"PROOF PASSED: {ctx.checks.passed} checks", flush=True)
    return out


def cli(argv: list[str] | None = None) -> int:
    return 0 if main(argv)["passed"] else 1


if __name__ == "__main__":
    sys.exit(cli())
