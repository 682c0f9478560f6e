"""Qwen 3.5 (hybrid Gated DeltaNet / gated attention decoder + dynamic-resolution ViT): query, caption."""
from __future__ import annotations

from typing import Any

from photon_core.registry import Family
from photon_core.weights.checkpoint_files import CheckpointFiles
from photon_core.weights.resolve import Resolved
from photon_core.weights.tensor_files import default_dtype

from .config import ARCHITECTURES, MODEL_TYPES, MOE_MODEL_TYPES, Qwen35Config
from .model import EncodedImage, Qwen35Model, load_qwen3_5


def recognise(files: CheckpointFiles) -> bool:
    """Only config.json decides: model_type qwen3_5 (or its text-only / MoE variants), or a Qwen 3.5
    architecture name. Qwen3-ASR, Qwen3-VL and other Qwen families carry other model types."""
    if files.model_type in MODEL_TYPES + MOE_MODEL_TYPES:
        return True
    return files.model_type is None and any(a in ARCHITECTURES for a in files.architectures)


def refuse(files: CheckpointFiles) -> str | None:
    try:
        Qwen35Config.from_dict(files.config or {})
    except NotImplementedError as err:
        return str(err)
    except ValueError:
        pass   # a malformed config is reported by the loader
    return None


def _load(checkpoint: Resolved, device: str, dtype: Any, backend: str) -> Qwen35Model:
    from photon_core.backends.select import get_backend

    ops = get_backend(backend, device)
    return load_qwen3_5(checkpoint.path, device=device, dtype=dtype if dtype is not None else default_dtype(device),
                        backend=ops, model_id=checkpoint.model_id)


FAMILY = Family(
    name="qwen3_5",
    skills=frozenset({"caption", "query"}),
    looks_for="config.json model_type 'qwen3_5' (or 'qwen3_5_text'), or architectures "
              "Qwen3_5ForConditionalGeneration / Qwen3_5ForCausalLM",
    recognise=recognise,
    load=_load,
    auto_dtype=default_dtype,
    # The vision commands are shared: the first family naming them registers them, and they load
    # whatever --model names; naming them here keeps caption/query when this family is alone.
    cli="photon_core.cli_vision",
    refuse=refuse,
    hints=("download a Qwen 3.5 checkpoint folder (e.g. `hf download Qwen/Qwen3.5-0.8B`) "
           "and pass its path",),
)

__all__ = ["FAMILY", "EncodedImage", "Qwen35Model", "load_qwen3_5"]
