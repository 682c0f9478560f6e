"""The per-op engine's chained build at real sizes, before a GPU times it: launches a decode step
makes, the nodes it leaves to torch, and a prediction of its time on an H200 (batch 1, bf16).

    python bench/chained_build.py [--write]

Each family's real step graph (bench/roofline.py's shapes and contexts) planned as PerOpKernel
plans its chained build (megakernel/perop_engine._chained_ops: norms, GLUs, gates and activations
fused into the linears that read them), with chained.linear_blocks' tiles for 132 SMs. No weights,
no kernels run.

The prediction is a guess with its parts stated, to be replaced by the GPU's replays
(bench/gpu_timeline.py's "per-op engine chained" rows): each launch costs its work plus `gap`, the
time between one kernel's end and the next one's first dependent instruction under programmatic
dependent launch in a CUDA graph, which nothing here has measured (0.5, 1 and 2 us shown).
Work: a linear's programs stream their weights two tiles ahead, a trip of the fitted cost model's
k_step (0.81 us, an H200 HBM trip under load as the megakernel saw it) per step when the programs
fit the GPU at once, and never faster than their bytes at 80% of 4.8 TB/s; plus an L2 trip (the
fitted l2, 0.76 us) for x and one for a fused norm's statistics. MoE (Moondream 3's FP8 experts):
its two launches stream the chosen experts the same way, with an L2 trip each for the routing.
Qwen 3.5's delta rule: a program a value head, its fp32 state's slabs a trip each, twice.
Attention (one launch): the row's keys in 32-key steps over its splits, a trip each, then the
last split's merge, an L2 trip.
Everything else (the step's begin, embeds, appends, gates, norms, the conv step, argmax's two
stages): two L2 trips.
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import report  # noqa: E402
import roofline  # noqa: E402

from photon_core.kernels import chained  # noqa: E402
from photon_core.megakernel.cost_model import FITTED  # noqa: E402
from photon_core.megakernel.perop_engine import _chained_ops  # noqa: E402

SMS, PROGRAMS_PER_SM, BANDWIDTH, EFFICIENCY = 132, 4, 4.8e12, 0.8
GAPS_US = (0.5, 1.0, 2.0)
# kernels/chained.py's launches a node makes where not one (argmax: its two stages, counted below)
LAUNCHES = {"moe": 2}
PEERS_US = {"Moondream 2": 2981, "Whisper tiny.en": 365}   # transformers in one CUDA graph, H200, 2026-12-04


def models() -> list:
    out = [roofline.whisper("Whisper tiny.en", 384, 6, 4, 51864), roofline.moondream2(),
           roofline.whisper("Whisper large-v3-turbo", 1280, 20, 4, 51866), roofline.qwen3_asr("Qwen3-ASR 0.6B"),
           roofline.qwen3_5("Qwen 3.5 0.8B"), roofline.gemma4_e2b()]
    md3 = roofline.moondream3()
    return out + ([md3] if md3 is not None else [])


def stream_s(programs: int, trips: int, nbytes: int) -> float:
    """Seconds of `programs` each streaming `trips` weight tiles two ahead (half an HBM trip a step),
    never faster than their bytes at EFFICIENCY of the bandwidth."""
    waves = math.ceil(programs / (SMS * PROGRAMS_PER_SM))
    return max(waves * (trips + 1) * FITTED.k_step / 2, nbytes / (BANDWIDTH * EFFICIENCY))


def linear_us(n: int, k: int, fused_norm: bool) -> float:
    _, bn, bk = chained.linear_blocks(1, n, k, 2, 2 * SMS)
    return (stream_s(math.ceil(n / bn), math.ceil(k / bk), n * k * 2) + FITTED.l2 * (2 if fused_norm else 1)) * 1e6


def moe_us(node, g) -> float:
    """Experts up (each program routes its row from the logits, an L2 trip, then streams gate and up
    tiles of its expert) and down (the pairs' experts and weights from L2, then K x F of each
    output block), the chosen experts' bytes at 1 (FP8) or 2 bytes a weight."""
    _, f2, d = g.weight_shapes[node.args["gate_up"]]
    f, k = f2 // 2, node.args["top_k"]
    unit = 1 if node.args["gate_up_scale"] else 2
    bf, bd, bn, bfd = chained.moe_blocks(k, f, 1, d, 2 * SMS, unit)
    up = stream_s(k * math.ceil(f / bf), math.ceil(d / bd), k * f2 * d * unit)
    down = stream_s(math.ceil(d / bn), k * math.ceil(f / bfd), k * d * f * unit)
    return (up + down + 2 * FITTED.l2) * 1e6


def attention_us(node, context: int) -> float:
    spec, window = node.args["k"].spec, node.args["window"]
    keys = context // 2 if node.args["length"] == "self" else spec.length
    keys = min(keys, window or keys, spec.length)
    splits = max(1, min(16, math.ceil(spec.length / (4 * chained.ATTENTION_BLOCK_T))))
    steps = math.ceil(keys / splits / chained.ATTENTION_BLOCK_T)
    bytes_s = 2 * spec.heads * keys * spec.head_dim * 2 / (BANDWIDTH * EFFICIENCY)
    return (max(steps * FITTED.k_step, bytes_s) + FITTED.l2) * 1e6


def delta_us(node) -> float:
    """A gated delta rule step: one program a value head, its [Dk, Dv] fp32 state read in slabs of
    DELTA_SLAB twice (the prediction, then the update: a trip a slab each) and written once; q, k
    and the gates from L2 first."""
    hv, dk, dv = node.args["state"].shape
    slabs = math.ceil(dk / max(1, min(dk, chained.DELTA_SLAB // dv)))
    return (stream_s(hv, 2 * slabs, 3 * hv * dk * dv * 4) + FITTED.l2) * 1e6


def analyse(model, context: int = 1024) -> dict:
    g = model.graph
    observed = {v.name for v in g.exposed.values()}
    runners, fused = _chained_ops(g, list(g.nodes), observed)
    launches, work, left = 1, 2 * FITTED.l2 * 1e6, []        # the step's begin
    for node in g.nodes:
        if node.op == "argmax":
            launches += 2
            work += 2 * FITTED.l2 * 1e6
            continue
        if node.op == "input":
            continue
        if id(node) not in runners:
            left.append(node.op)
            continue
        if runners[id(node)] is None:           # a norm its readers apply
            continue
        launches += LAUNCHES.get(node.op, 1)
        if node.op == "linear":
            n, k = g.weight_shapes[node.args["w"]]
            work += linear_us(n, k, id(node) in fused and fused[id(node)].op in ("layer_norm", "rms_norm"))
        elif node.op == "attention":
            work += attention_us(node, context)
        elif node.op == "moe":
            work += moe_us(node, g)
        elif node.op == "delta_rule":
            work += delta_us(node)
        else:
            work += 2 * FITTED.l2 * 1e6
    floor = (g.weight_bytes(2) + roofline.state_bytes(g, context)) / BANDWIDTH * 1e6
    return dict(name=model.name, launches=launches, left=left, work=work, floor=floor,
                fused=len({id(n) for n in fused.values()}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--write", action="store_true", help="put the section in bench/RESULTS.md")
    args = p.parse_args()
    gaps = " | ".join(f"gap {g} us: us (x floor, / peer)" for g in GAPS_US)
    lines = report.heading("Per-op engine's chained build at real sizes (prediction, no GPU)") + [
        "Batch 1, bf16 weights and KV, context 1024 (keys at half of it); each family's real step graph planned as "
        "the chained build plans it (perop_engine._chained_ops: norms, GLUs, gates and activations read only by "
        "linears applied by them), tiles for 132 SMs (chained.linear_blocks). "
        "A prediction with guessed parts (the script's docstring): the linears' streams at the cost model's "
        "fitted HBM trip, two tiles ahead, never above 80% of 4.8 TB/s; `gap` (a launch's end to the next one's "
        "first dependent instruction under PDL in a CUDA graph) unmeasured, so three values. The GPU's "
        "replays (bench/gpu_timeline.py, rows \"per-op engine chained\") replace it.", "",
        f"| model | launches a step | norms, GLUs, gates fused | not chained | floor us | work us | {gaps} |",
        "|---|---:|---:|---|---:|---:|" + "---|" * len(GAPS_US)]
    for m in models():
        a = analyse(m)
        cells = []
        for gap in GAPS_US:
            us = a["work"] + gap * a["launches"]
            peer = PEERS_US.get(a["name"])
            cells.append(f"{us:.0f} ({us / a['floor']:.1f}x{f', {us / peer:.2f}' if peer else ''})")
        left = ", ".join(sorted(set(a["left"]))) or "-"
        mark = " (+ torch's)" if a["left"] else ""
        lines.append(f"| {a['name']} | {a['launches']}{mark} | {a['fused']} | {left} | {a['floor']:.0f} | "
                     f"{a['work']:.0f} | " + " | ".join(cells) + " |")
    lines += ["", "Peers (transformers in one CUDA graph, H200, ../shared/gpu-runs/h200-2026-12-04): Moondream 2 "
              "2981 us, Whisper tiny.en 365 us. The megakernel measured 7670 and 587 us there; the cost model's "
              "streaming builds predict 1846 and 288 us (\"Megakernel cost model\" above)."]
    report.publish(lines, args.write)


if __name__ == "__main__":
    main()
