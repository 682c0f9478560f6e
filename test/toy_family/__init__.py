"""A toy eighth model family for the test suite: a tiny Llama-shaped decoder (RMSNorm, rotary,
grouped-query attention, SwiGLU, tied or untied LM head) on random weights, written as one folder
the way photon_core/README.md's "Adding a family" says. It is not shipped: the registry offers it
only when $PHOTON_EXTRA_FAMILIES names this package (test/test_toy_family.py does).

Its skill is `query` without an image: it meets photon_core.contracts.TextModel."""
from __future__ import annotations

from typing import Any

from photon_core.registry import Family
from photon_core.weights.checkpoint_files import CheckpointFiles
from photon_core.weights.resolve import Resolved

from .config import MODEL_TYPE
from .model import ToyLlama, load_toy


def recognise(files: CheckpointFiles) -> bool:
    return files.model_type == MODEL_TYPE


def _load(checkpoint: Resolved, device: str, dtype: Any, backend: str) -> ToyLlama:
    model = load_toy(checkpoint.path if checkpoint.path.is_dir() else checkpoint.path.parent, device, dtype, backend)
    model.model_id = checkpoint.model_id
    return model


FAMILY = Family(name="toy_llama", skills=frozenset({"query"}), looks_for=f"config.json model_type {MODEL_TYPE!r}",
                recognise=recognise, load=_load)

__all__ = ["FAMILY", "ToyLlama", "load_toy"]
