"""Finding and reading Moondream 3 checkpoints, without executing any code from them.

Two files exist: Moondream 3.1's `model.safetensors` and Moondream 3 preview's `model_fp8.pt` (a
plain state dict, read with torch.load(weights_only=True, mmap=True)). Both use the older Moondream
naming (`text_model.transformer.h.{i}...`, `vision_encoder...`, `region_model...`) plus the MoE and
tau tensors. Names are normalised to the reference module names Moondream 2's code reads
(`text.blocks.{i}.attn.qkv.weight`, `vision.pos_emb`, ...) and these Moondream 3 ones:

    text.blocks.{i}.router.{weight,bias}            <- h.{i}.gate.*                 [E, H], [E]
    text.blocks.{i}.experts_gate_up                 <- h.{i}.mlp.experts.weight      [E, 2I, H]
    text.blocks.{i}.experts_down                    <- h.{i}.mlp.output_experts.weight [E, H, I]
    text.blocks.{i}.tau_wqwv                        <- h.{i}.tau_wqwv, or cat(tau_wq, tau_wv) [2*heads, qkv]
    text.blocks.{i}.tau_alpha                       <- h.{i}.tau_alpha               [heads]
    region.coord_head / region.size_head / region.ln <- region_model.coordinate_head / size_head / ln

FP8 experts (float8_e4m3fn, with per-output-row scales `moe_quant.{up,down}_scale` [E, rows]) are
dequantized here on the CPU, w = fp8.float() * scale[..., None], then cast to the model dtype; with
keep_fp8 (the megakernel backend) they stay FP8 bytes next to their fp32 scales
(`...experts_gate_up_scale`, `...experts_down_scale`): the compiled step reads them as FP8.
"""
from __future__ import annotations

from pathlib import Path

import torch

from photon_core.models.moondream import weights as md2_weights
from photon_core.weights.tensor_checks import refuse_integers
from photon_core.weights.tensor_files import parse_dtype, rename  # noqa: F401

# model id -> (Hugging Face repo, weights file in it)
MODELS = {
    "moondream3.1-9B-A2B": ("moondream/moondream3.1-9B-A2B", "model.safetensors"),
    "moondream3-preview": ("moondream/moondream3-preview", "model_fp8.pt"),
}
IDS = set(MODELS) | {repo for repo, _ in MODELS.values()}
WEIGHT_FILES = ("model.safetensors", "model_fp8.pt", "model.pt")
FP8 = torch.float8_e4m3fn

# Moondream 3 names first (first match wins), then Moondream 2's older-naming schema.
_MD3_RULES = [
    (r"text_model\.transformer\.h\.(\d+)\.gate\.(weight|bias)", r"text.blocks.\1.router.\2"),
    (r"text_model\.transformer\.h\.(\d+)\.mlp\.experts\.weight", r"text.blocks.\1.experts_gate_up"),
    (r"text_model\.transformer\.h\.(\d+)\.mlp\.output_experts\.weight", r"text.blocks.\1.experts_down"),
    (r"text_model\.transformer\.h\.(\d+)\.moe_quant\.up_scale", r"text.blocks.\1.experts_gate_up_scale"),
    (r"text_model\.transformer\.h\.(\d+)\.moe_quant\.down_scale", r"text.blocks.\1.experts_down_scale"),
    (r"text_model\.transformer\.h\.(\d+)\.(tau_wqwv|tau_wq|tau_wv|tau_alpha)", r"text.blocks.\1.\2"),
    (r"region_model\.coordinate_head\.(weight|bias)", r"region.coord_head.\1"),
    (r"region_model\.size_head\.(weight|bias)", r"region.size_head.\1"),
]
SCHEMA = _MD3_RULES + md2_weights.SCHEMA
# Stored transposed (old name -> reference name), as in older Moondream 2 releases.
_TRANSPOSED = {"region_model.coordinate_features.weight": "region.coord_features",
               "region_model.size_features.weight": "region.size_features"}


Checkpoint = md2_weights.Checkpoint


def _how_to_get() -> str:
    return ("Download the weights once with `hf download moondream/moondream3.1-9B-A2B` "
            "(or pass a folder holding model.safetensors / model_fp8.pt and tokenizer.json).")


def resolve(path_or_id: str | Path) -> Checkpoint:
    """A local file or folder, or a Moondream 3 model id looked up in the Hugging Face cache
    (never downloaded)."""
    name = str(path_or_id)
    found = md2_weights.local_weights(Path(name).expanduser(), WEIGHT_FILES, "model.safetensors or model_fp8.pt",
                                      _how_to_get())
    if found is not None:
        weights, folder = found
    elif name in IDS:
        short = next(k for k, (repo, _) in MODELS.items() if name in (k, repo))
        weights, folder = md2_weights.cached_weights(*MODELS[short], "Moondream 3", name, _how_to_get())
    else:
        raise md2_weights.unknown_id(name, MODELS, _how_to_get())
    return md2_weights.with_config(weights, folder)


def read(path: Path) -> dict[str, torch.Tensor]:
    state = md2_weights.read(path, (".pt", ".pth"))
    if path.suffix != ".safetensors" and (not isinstance(state, dict)
                                          or not all(isinstance(v, torch.Tensor) for v in state.values())):
        raise ValueError(f"{path}: expected a plain state dict of tensors")
    return state


def dequantize_fp8(weight: torch.Tensor, scale: torch.Tensor, name: str) -> torch.Tensor:
    """FP8 e4m3 weight [E, rows, cols] with per-row scales [E, rows] -> float32 weight (CPU)."""
    if weight.dtype != FP8:
        raise ValueError(f"{name}: has FP8 scales but is stored as {weight.dtype}, expected float8_e4m3fn")
    if tuple(scale.shape) != tuple(weight.shape[:2]):
        raise ValueError(f"{name}: scale shape {tuple(scale.shape)} does not match the weight's rows "
                         f"{tuple(weight.shape[:2])}")
    return weight.to(torch.float32) * scale.to(torch.float32)[..., None]


def deinterleave_rows8(gate_up: torch.Tensor) -> torch.Tensor:
    """[E, 2I, H] in the 8-row interleave gate[0:8], up[0:8], gate[8:16], ... -> [gate; up] halves."""
    e, two_i = gate_up.shape[:2]
    blocks = gate_up.reshape(e, two_i // 16, 2, 8, *gate_up.shape[2:])
    return torch.cat([blocks[:, :, 0].reshape(e, two_i // 2, *gate_up.shape[2:]),
                      blocks[:, :, 1].reshape(e, two_i // 2, *gate_up.shape[2:])], dim=1)


def normalize_names(tensors: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32,
                    keep_fp8: bool = False) -> dict[str, torch.Tensor]:
    """Checkpoint names -> reference names; FP8 experts dequantized (each cast to `dtype` at once,
    so the float32 copy of only one expert tensor exists at a time), or with `keep_fp8` kept as
    they are with their scales (float32) beside them; tau_wq + tau_wv fused."""
    tensors = {k.replace("._orig_mod", ""): t for k, t in tensors.items()}
    out = rename(tensors, SCHEMA, keep=(r"(vision|text|region)\..*",))
    for old, new in _TRANSPOSED.items():
        if old in tensors:
            out[new] = out[new].T
    for key in [k for k in out if k.endswith(("experts_gate_up_scale", "experts_down_scale"))]:
        name = key[:-len("_scale")]
        if name not in out:
            raise ValueError(f"{key}: an FP8 scale without its expert weight {name}")
        if keep_fp8:
            dequantize_fp8(out[name][:1, :1], out[key][:1, :1], name)   # the dtype check, on one row
            if tuple(out[key].shape) != tuple(out[name].shape[:2]):
                raise ValueError(f"{name}: scale shape {tuple(out[key].shape)} does not match the weight's rows "
                                 f"{tuple(out[name].shape[:2])}")
            out[key] = out[key].to(torch.float32)
        else:
            out[name] = dequantize_fp8(out[name], out.pop(key), name).to(dtype)
    fp8 = sorted(k for k, t in out.items() if t.dtype == FP8 and k + "_scale" not in out)
    if fp8:
        raise ValueError(f"FP8 tensors without their moe_quant scales: {fp8[:3]}")
    for key in [k for k in out if k.endswith(".tau_wq")]:
        stem = key[:-len("tau_wq")]
        if stem + "tau_wv" not in out:
            raise ValueError(f"{key} without {stem}tau_wv")
        out[stem + "tau_wqwv"] = torch.cat([out.pop(key), out.pop(stem + "tau_wv")], dim=0)
    return out


def load_tensors(path: Path, dtype: torch.dtype, device: str | torch.device = "cpu",
                 gate_up_layout: str = "halves", keep_fp8: bool = False) -> dict[str, torch.Tensor]:
    """Reference-named tensors in `dtype` on `device`; with keep_fp8, FP8 experts and their fp32
    scales as stored (rows de-interleaved alike)."""
    raw = read(path)
    refuse_integers(raw, path)
    tensors = normalize_names(raw, dtype, keep_fp8)
    if gate_up_layout == "interleaved8":
        for key in [k for k in tensors if k.endswith((".experts_gate_up", ".experts_gate_up_scale"))]:
            tensors[key] = deinterleave_rows8(tensors[key])
    return {k: v.to(device=device, dtype=v.dtype if v.dtype == FP8 or k.endswith("_scale") else dtype).contiguous()
            for k, v in tensors.items()}
