"""Moondream 2 (vision-language model) in plain PyTorch ops: detect, point, caption, query."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from photon_core.registry import Family
from photon_core.weights.checkpoint_files import CheckpointFiles
from photon_core.weights.resolve import Resolved
from photon_core.weights.tensor_files import default_dtype

from . import weights
from .batch import Request
from .config import MoondreamConfig, is_moondream3_config
from .config import refusal as config_refusal
from .model import EncodedImage, MoondreamModel, load_moondream

# Both tensor namings (see weights.py) have a vision tower, a text model and the region head;
# the region head is what sets Moondream apart from other vision-language models.
_NEW_PARTS = (("model.vision.", "vision."), ("model.text.", "text."), ("model.region.", "region."))
_OLD_PARTS = (("vision_encoder.",), ("text_model.",), ("region_model.",))


def has_moondream_parts(files: CheckpointFiles) -> bool:
    """A vision tower, a text model and a region head, under either naming."""
    names = [n.replace("._orig_mod", "") for n in files.tensor_names]
    return any(all(any(n.startswith(prefixes) for n in names) for prefixes in parts)
               for parts in (_NEW_PARTS, _OLD_PARTS))


def is_moondream3(files: CheckpointFiles) -> bool:
    """Moondream 3 checkpoints (config or tensor names) belong to the moondream3 family. The
    marker names ("experts", "tau_", ...) are in other mixture-of-experts models too (Qwen 3.5 MoE,
    Gemma 4 26B-A4B): they mark Moondream 3 only beside Moondream's own parts."""
    if is_moondream3_config(files.config):
        return True
    return bool(weights.moondream3_markers(files.tensor_names)) and has_moondream_parts(files)


def recognise(files: CheckpointFiles) -> bool:
    if is_moondream3(files):
        return False
    if (files.model_type or "").startswith("moondream"):
        return True
    return has_moondream_parts(files)


def refuse(files: CheckpointFiles) -> str | None:
    """int4-quantized checkpoints: recognised here, not runnable yet."""
    return config_refusal(MoondreamConfig, files.config)


def places(name: str) -> list[str | Path]:
    if name in weights.MD2_IDS:
        return [weights.HF_REPO]
    return []


def _load(checkpoint: Resolved, device: str, dtype: Any, backend: str) -> MoondreamModel:
    from photon_core.backends.select import get_backend

    ops = get_backend(backend, device)
    dtype = dtype if dtype is not None else default_dtype(device)
    return load_moondream(checkpoint.path, device=device, dtype=dtype, backend=ops)


FAMILY = Family(
    name="moondream",
    skills=frozenset({"detect", "point", "caption", "query"}),
    looks_for="config.json model_type 'moondream*' (not moondream3), or vision, text and region tensors "
              "(model.vision.* / vision_encoder.*, ...) in safetensors or .pt files, without Moondream 3's "
              "MoE/tau tensors",
    recognise=recognise,
    load=_load,
    auto_dtype=default_dtype,
    cli="photon_core.cli_vision",
    refuse=refuse,
    places=places,
    hints=(f"`hf download {weights.HF_REPO}` gives moondream2",),
)

__all__ = ["Request", "EncodedImage", "MoondreamModel", "load_moondream", "FAMILY"]
