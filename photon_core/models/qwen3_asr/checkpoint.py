"""Qwen3-ASR's tensor names: both shipped layouts mapped onto one schema (the Hugging Face one,
without its "model." prefix), and the checks that say plainly what is missing."""
from __future__ import annotations

import re
from pathlib import Path

import torch

from photon_core.weights.tensor_files import read_folder, rename

# (regex matching a whole name, replacement). The original layout (Qwen/Qwen3-ASR-*) kept the
# projector inside the audio tower as proj1/proj2 and the decoder under thinker.model.
RULES = (
    (r"thinker\.audio_tower\.proj1\.(.*)", r"multi_modal_projector.linear_1.\1"),
    (r"thinker\.audio_tower\.proj2\.(.*)", r"multi_modal_projector.linear_2.\1"),
    (r"thinker\.audio_tower\.(.*)", r"audio_tower.\1"),
    (r"thinker\.model\.(.*)", r"language_model.\1"),
    (r"thinker\.lm_head\.(.*)", r"lm_head.\1"),
    (r"model\.((?:audio_tower|language_model|multi_modal_projector)\..*)", r"\1"),
    (r"(lm_head\..*)", r"\1"),
)
# Buffers some exports carry; recomputed here.
DROP = (r".*rotary_emb\.inv_freq", r".*positional_embedding.*")

# Present in every Qwen3-ASR checkpoint, in the schema's names.
REQUIRED = ("audio_tower.conv2d1.weight", "audio_tower.conv_out.weight",
            "multi_modal_projector.linear_1.weight", "language_model.embed_tokens.weight",
            "language_model.layers.0.self_attn.q_norm.weight", "language_model.norm.weight")


def schema_name(name: str) -> str:
    """A checkpoint tensor name in the schema (either layout); other names come back unchanged."""
    for pattern, repl in RULES:
        if re.fullmatch(pattern, name):
            return re.sub(pattern, repl, name)
    return name


def looks_like_qwen3_asr(names: set[str]) -> bool:
    """The tensor names alone: an audio tower with the 2-D conv stem, a projector and a decoder
    with per-head q/k norms (a Qwen3 text stack). Qwen3-Omni also has the stem but keeps a
    `thinker.visual`, and its decoder is a mixture of experts; Qwen 3.5 has no audio tower."""
    schema = {schema_name(n) for n in names}
    if any(n.startswith(("thinker.visual.", "visual.", "model.visual.")) for n in names):
        return False
    if any(".mlp.experts." in n for n in schema):
        return False
    return all(r in schema for r in REQUIRED)


def load_tensors(folder: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint under the schema's names (safetensors, no code executed);
    ValueError naming missing or unexpected tensors."""
    tensors = rename(read_folder(folder), RULES, drop=DROP)
    missing = [m for m in REQUIRED if m not in tensors]
    if missing:
        raise ValueError(f"{folder}: not a complete Qwen3-ASR checkpoint, missing tensors {missing}")
    return tensors


def owned(x: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """x on device in dtype, in memory of its own. A safetensors tensor already in place is a
    private file mapping: clean pages the kernel drops under memory pressure and reads back from
    disk on the next pass (a stall per decode step); a copy stays resident like any other."""
    y = x.to(device, dtype)
    return y.clone() if y.data_ptr() == x.data_ptr() else y
