"""Device memory of Moondream 3 on the megakernel backend, from the config's shapes alone (nothing is
allocated): the compiled decode step (megakernel.memory.step_memory: weights arena with FP8 experts,
KV caches at max_len, values, task table), the weights the per-op paths hold outside it (vision
encoder and projection, token embeddings, region encoders; the text decoder's own tensors are views
of the arena, decoder_step.share_arena), and the largest transients of a request (device_memory);
and the peak while loading (load_memory).
"""
from __future__ import annotations

import math

import torch

from photon_core.megakernel.compiler import Tiling, plan
from photon_core.megakernel.memory import step_memory

from .config import Moondream3Config
from .decoder_step import dims_of, step_graph, weight_shapes
from .model import expected_shapes

# Checkpoint tensors (reference names) the compiled step's arena holds; the per-op path reads those
# through share_arena's views, so they are counted once.
_IN_ARENA = ("text.blocks.", "text.post_ln.", "text.lm_head.", "region.ln.", "region.coord_head.",
             "region.size_head.")


def device_memory(cfg: Moondream3Config, max_len: int = 4096, batch: int = 1, dtype: torch.dtype = torch.bfloat16,
                  kv_dtype: torch.dtype = torch.bfloat16, fp8: bool = True, tiling: Tiling = Tiling(),
                  crops: int | None = None) -> dict[str, int]:
    """Bytes by part for one batch bucket: "step: ..." (step_memory), "per-op weights: ..." (in
    `dtype`), and the transients "prefill: one MoE layer dequantized" (text.expert_weights) and
    "vision: MLP activations" (`crops` crops' fc1 input and output at once; default the global crop
    plus the most local ones). Not counted: the CUDA
    context, the allocator's slack, and other batch buckets (each adds its own KV caches)."""
    dm = dims_of(cfg, fp8)
    out = {f"step: {k}": v for k, v in step_memory(step_graph(dm, max_len), batch, tiling, dtype, kv_dtype).items()}
    size = dtype.itemsize
    outside: dict[str, int] = {}
    for k, shape in expected_shapes(cfg).items():
        if not k.startswith(_IN_ARENA):
            part = "vision" if k.startswith("vision.") else k.split(".")[0] + "." + k.split(".")[1]
            outside[part] = outside.get(part, 0) + math.prod(shape) * size
    out.update({f"per-op weights: {k}": v for k, v in sorted(outside.items())})
    if dm.experts:
        out["prefill: one MoE layer dequantized"] = dm.experts * 3 * dm.expert_ff * dm.d * size
    v = cfg.vision
    crops = v.max_crops + 1 if crops is None else crops
    patches = (v.crop_size // v.enc_patch_size) ** 2
    out["vision: MLP activations"] = crops * patches * (v.enc_dim + v.enc_ff_dim) * size
    return out


# device_memory's parts that exist only while a request runs, not after the load.
_REQUEST_TRANSIENTS = ("prefill: ", "vision: ")


def load_memory(cfg: Moondream3Config, max_len: int = 4096, batch: int = 1, dtype: torch.dtype = torch.bfloat16,
                kv_dtype: torch.dtype = torch.bfloat16, fp8: bool = True,
                tiling: Tiling = Tiling()) -> dict[str, int]:
    """The device's peak while load_moondream3 loads the model on the megakernel backend, by part:
    what stays resident (device_memory's parts without the request transients) plus "load: one
    tensor in transit". The checkpoint is read to the CPU; the compiled step's arena is allocated
    on the device and filled tensor by tensor, each first copied to the device as the CPU holds it
    (CompiledStep: FP8 experts as bytes, scales and offset-folded weights in float32, the rest in
    `dtype`); every other weight is then moved once to its final place. So at most one arena
    tensor's device copy exists beside what the loaded model keeps: the sum is a bound. (As
    CompiledStep orders it, that copy exists only while the arena fills, before the state arena
    and the per-op weights arrive, so the peak itself is max(resident, arena + that copy).)"""
    out = {k: v for k, v in device_memory(cfg, max_len, batch, dtype, kv_dtype, fp8, tiling).items()
           if not k.startswith(_REQUEST_TRANSIENTS)}
    dm = dims_of(cfg, fp8)
    p = plan(step_graph(dm, max_len), batch, tiling, dtype, kv_dtype)

    def in_transit(k: str, shape: tuple[int, ...]) -> int:
        size = 1 if k in p.fp8 else 4 if k in p.weight_offset or k in p.fp8.values() else dtype.itemsize
        return math.prod(shape) * size

    out["load: one tensor in transit"] = max(in_transit(k, s) for k, s in weight_shapes(dm).items())
    return out
