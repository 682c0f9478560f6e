"""Moondream 3 (3.1 9B-A2B, 3-preview): MoE text decoder with tau attention on Moondream 2's vision
tower; detect, point, caption, query (Moondream 2's skills) and segment."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from photon_core.models.moondream import is_moondream3
from photon_core.models.moondream.config import refusal as config_refusal
from photon_core.registry import Family
from photon_core.weights.checkpoint_files import CheckpointFiles
from photon_core.weights.resolve import Resolved
from photon_core.weights.tensor_files import default_dtype

from . import weights
from .config import Moondream3Config
from .model import Moondream3Model, load_moondream3


def recognise(files: CheckpointFiles) -> bool:
    return is_moondream3(files)


def refuse(files: CheckpointFiles) -> str | None:
    return config_refusal(Moondream3Config, files.config)


def places(name: str) -> list[str | Path]:
    if name in weights.MODELS:
        return [weights.MODELS[name][0]]
    return []


def _load(checkpoint: Resolved, device: str, dtype: Any, backend: str) -> Moondream3Model:
    from photon_core.backends.select import get_backend

    if backend == "auto":
        # The megakernel (auto's choice on a GPU) is opt-in for Moondream 3 (backend="megakernel"):
        # its MoE step has so far been proven under the Triton interpreter only. (Memory is not the
        # reason: its experts stay FP8 and are held once, and loading puts no weight on the device
        # twice; memory.device_memory, memory.load_memory.)
        backend = "triton" if str(device).startswith("cuda") else "reference"
    ops = get_backend(backend, device)
    dtype = dtype if dtype is not None else default_dtype(device)
    model = load_moondream3(checkpoint.path, device=device, dtype=dtype, backend=ops)
    if checkpoint.name in weights.IDS:
        model.model_id = checkpoint.name
    return model


FAMILY = Family(
    name="moondream3",
    skills=frozenset({"detect", "point", "caption", "query", "segment"}),
    looks_for="config.json model_type 'moondream3' or a text.moe config, or Moondream 3's MoE/tau tensors "
              "(text_model.transformer.h.N.mlp.experts.weight, tau_wqwv, moe_quant.*, region_model."
              "coordinate_head) in safetensors or model_fp8.pt",
    recognise=recognise,
    load=_load,
    auto_dtype=default_dtype,
    # The vision commands (detect, point, caption, query, segment) load any family's checkpoint.
    cli="photon_core.cli_vision",
    refuse=refuse,
    places=places,
    hints=("`hf download moondream/moondream3.1-9B-A2B` gives Moondream 3.1",),
)

__all__ = ["Moondream3Config", "Moondream3Model", "load_moondream3", "FAMILY"]
