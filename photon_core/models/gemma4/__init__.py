"""Gemma 4 (E2B / E4B) vision-language model in plain ops: query and caption (text and image)."""
from __future__ import annotations

from typing import Any

from photon_core.registry import Family
from photon_core.weights.checkpoint_files import CheckpointFiles
from photon_core.weights.resolve import Resolved
from photon_core.weights.tensor_files import default_dtype

from .config import Gemma4Config
from .model import EncodedImage, Gemma4Model, load_gemma4

_ARCHITECTURES = ("Gemma4ForConditionalGeneration", "Gemma4Model")


def recognise(files: CheckpointFiles) -> bool:
    """Only config.json decides: model_type 'gemma4' or a Gemma 4 multimodal architecture."""
    return files.model_type == "gemma4" or any(a in _ARCHITECTURES for a in files.architectures)


def refuse(files: CheckpointFiles) -> str | None:
    try:
        Gemma4Config.from_dict(files.config)
    except NotImplementedError as err:
        return str(err)
    except ValueError:
        pass   # a malformed config is reported by the loader
    return None


# Short names for the Hugging Face ids of the sizes this family runs (found in the local cache only).
SHORT_NAMES = {f"gemma-4-{size}{tail}": f"google/gemma-4-{size.upper()}{tail}"
               for size in ("e2b", "e4b") for tail in ("", "-it")}


def places(name: str) -> list[str]:
    repo = SHORT_NAMES.get(name.lower())
    return [] if repo is None else [repo, repo.lower()]


def _load(checkpoint: Resolved, device: str, dtype: Any, backend: str) -> Gemma4Model:
    from photon_core.backends.select import get_backend

    # The megakernel module also carries every per-op kernel (vision, prefill); the model then
    # decodes each token through its compiled step graph (megakernel_decode.py).
    ops = get_backend(backend, device)
    return load_gemma4(checkpoint.path, device=device, dtype=dtype if dtype is not None else default_dtype(device), backend=ops)


FAMILY = Family(
    name="gemma4",
    skills=frozenset({"caption", "query"}),
    looks_for="config.json model_type 'gemma4' (architectures Gemma4ForConditionalGeneration)",
    recognise=recognise,
    load=_load,
    auto_dtype=default_dtype,
    cli="photon_core.cli_vision",
    refuse=refuse,
    places=places,
    hints=("`hf download google/gemma-4-E2B-it` gives Gemma 4 E2B",),
)

__all__ = ["FAMILY", "EncodedImage", "Gemma4Model", "load_gemma4"]
