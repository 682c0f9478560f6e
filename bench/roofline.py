"""Roofline of the compiled decode step, per family and batch: what one step must move and how its
task graph is shaped, and from that a PREDICTED step time on H200 and Jetson Orin. No GPU needed:
graphs of real sizes are compiled on meta tensors (no weight memory).

    python bench/roofline.py [--write] [--quick]

Per (model, batch): weight bytes per step (bf16, every weight once; rotary tables one row), KV
bytes read (fp32 caches at a half-full context; cross-attention K/V over all encoder frames), the
HBM floor (bytes / bandwidth), the task count, the widest and narrowest stage, the dependency depth
(longest chain of waits) and the predicted time:

    predicted = bytes / (bandwidth * efficiency) + depth * level_latency

with efficiency 0.8 (what a bandwidth-bound megakernel reaches: Hazy Research's Llama-1B megakernel
ran at 78% of H100 bandwidth) and 1.5 us per dependency level (a release/acquire round trip plus a
claim and a task's row reads). These are assumptions, stated so a GPU run can refute them; the
measured numbers come from bench/gpu.sh.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from photon_core.megakernel.compiler import Tiling, lower, plan  # noqa: E402
from photon_core.megakernel.graph import OP_ATTN_PARTIAL  # noqa: E402
from report import heading, publish  # noqa: E402

GPUS = {"H200": 4.8e12, "Orin AGX 64GB": 204.8e9, "Orin NX 16GB": 102.4e9}   # HBM / LPDDR5 bytes/s
EFFICIENCY = 0.8
LEVEL_S = 1.5e-6


@dataclass
class Model:
    name: str
    graph: object        # StepGraph
    kv_bytes_per_row: int


def whisper(name: str, d: int, heads: int, layers: int, vocab: int = 51866, n_ctx: int = 448,
            enc: int = 1500) -> Model:
    from photon_core.models.whisper.decoder_step import DecoderLayerWeights, WhisperDecoderWeights, step_graph

    def m(*shape):
        return torch.empty(*shape, device="meta")

    layer = DecoderLayerWeights(m(d), m(d), m(3 * d, d), m(3 * d), m(d, d), m(d), m(d), m(d), m(d, d), m(d),
                                m(2 * d, d), m(2 * d), m(d, d), m(d), m(d), m(d), m(4 * d, d), m(4 * d),
                                m(d, 4 * d), m(d))
    wt = WhisperDecoderWeights(m(vocab, d), m(n_ctx, d), [layer] * layers, m(d), m(d), heads)
    kv = layers * 2 * d * 4 * (n_ctx // 2 + enc)        # self K/V at half context + cross K/V, fp32
    return Model(name, step_graph(wt, n_ctx, enc, advance=True), kv)


def moondream2() -> Model:
    from photon_core.models.moondream.config import MoondreamConfig
    from photon_core.models.moondream.decoder_step import dims_of, step_graph

    dm = dims_of(MoondreamConfig())
    ctx = 1024                                            # image prefix (730) + prompt + answer
    return Model("Moondream 2", step_graph(dm, dm.max_context), dm.layers * 2 * dm.d * 4 * ctx // 2)


def depth(g) -> int:
    """Longest chain of waits through the task graph (tasks are listed in topological order)."""
    level_of_counter: dict[str, int] = {}
    for t in g.tasks:
        level = 1 + max((level_of_counter.get(c, 0) for c, _ in t.waits), default=0)
        if t.signal is not None:
            level_of_counter[t.signal] = max(level_of_counter.get(t.signal, 0), level)
    return max(level_of_counter.values(), default=1)


def stages(g) -> dict[str, int]:
    counts: dict[str, int] = {}
    for t in g.tasks:
        key = t.name.split("[")[0]
        counts[key] = counts.get(key, 0) + 1
    return counts


def row(model: Model, batch: int, tiling: Tiling) -> dict:
    g = lower(plan(model.graph, batch, tiling))
    per_stage = stages(g)
    weights = model.graph.weight_bytes(2)
    kv = model.kv_bytes_per_row * batch
    out = dict(model=model.name, batch=batch, tasks=len(g.tasks), depth=depth(g),
               widest=max(per_stage.values()), narrowest=min(per_stage.values()),
               attn_tasks=sum(t.op == OP_ATTN_PARTIAL for t in g.tasks), weights=weights, kv=kv)
    for gpu, bw in GPUS.items():
        out[f"floor {gpu}"] = (weights + kv) / bw
        out[f"pred {gpu}"] = (weights + kv) / (bw * EFFICIENCY) + out["depth"] * LEVEL_S
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", action="store_true", help="replace this benchmark's section of bench/RESULTS.md")
    ap.add_argument("--quick", action="store_true", help="Whisper tiny only, batch 1 (a smoke test)")
    args = ap.parse_args()
    models = [whisper("Whisper tiny", 384, 6, 4)]
    if not args.quick:
        models += [whisper("Whisper large-v3-turbo", 1280, 20, 4), moondream2()]
    batches = [1] if args.quick else [1, 8]
    # The GPU tiling: 64-column tiles, stages of few tiles narrowed / split to fill 132 SMs x 2.
    tiling = Tiling(block_n=64, block_k=64, block_t=64, self_splits=4, cross_splits=8, min_tasks=264)
    rows = []
    for m in models:
        for b in batches:
            rows.append(row(m, b, replace(tiling, block_k=max(16, 128 // b))))
            r = rows[-1]
            print(f"{r['model']:24s} b{b}: {r['tasks']} tasks, depth {r['depth']}, "
                  f"{(r['weights'] + r['kv']) / 1e6:.0f} MB, predicted H200 {r['pred H200'] * 1e3:.3f} ms", flush=True)
    lines = heading("Megakernel roofline (prediction, no GPU)") + [
        "Graphs of real sizes compiled on meta tensors (tiling: 64-column tiles, few-tile stages "
        "narrowed or split-K to 264 tasks). Bytes: bf16 weights once + fp32 KV read at half context "
        "(Whisper: + cross K/V of 1500 frames). **Predicted** = bytes / (0.8 x bandwidth) + depth x "
        "1.5 us; floors are bytes / bandwidth. Measured times come from bench/gpu.sh when a GPU is lent.",
        "",
        "| model | batch | tasks | depth | stage tasks (min-max) | MB weights | MB KV | H200 floor ms | "
        "H200 pred ms | Orin AGX pred ms | Orin NX pred ms |",
        "|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['batch']} | {r['tasks']} | {r['depth']} | {r['narrowest']}-{r['widest']} | "
                     f"{r['weights'] / 1e6:.0f} | {r['kv'] / 1e6:.0f} | {r['floor H200'] * 1e3:.3f} | "
                     f"{r['pred H200'] * 1e3:.3f} | {r['pred Orin AGX 64GB'] * 1e3:.2f} | "
                     f"{r['pred Orin NX 16GB'] * 1e3:.2f} |")
    publish(lines, args.write)


if __name__ == "__main__":
    main()
