"""The families of the end-to-end benchmark, in the order a run takes them (the most important first:
a run cut short keeps them): Moondream 2 (whose detect has a goal of its own) and Whisper
large-v3-turbo (likewise), then the other vision and speech families, Moondream 3.1 last (no peer
to compare with, and the largest model to set up)."""
from __future__ import annotations

import importlib

from e2e_family import Family

ORDER = ("moondream2", "whisper-large-v3-turbo", "qwen3.5-0.8b", "gemma4-e2b", "parakeet-tdt-0.6b",
         "qwen3-asr-0.6b", "whisper-tiny.en", "moondream3")
_WHERE = {"moondream2": ("e2e_moondream", "Moondream2"), "moondream3": ("e2e_moondream", "Moondream3"),
          "qwen3.5-0.8b": ("e2e_vlm", "Qwen35"), "gemma4-e2b": ("e2e_vlm", "Gemma4"),
          "whisper-large-v3-turbo": ("e2e_whisper", "WhisperTurbo"), "whisper-tiny.en": ("e2e_whisper", "WhisperTiny"),
          "parakeet-tdt-0.6b": ("e2e_asr", "Parakeet"), "qwen3-asr-0.6b": ("e2e_asr", "Qwen3ASR")}


def family_class(name: str) -> type[Family]:
    """The e2e Family class of `name` (its module imported on demand: each pulls in its model code)."""
    if name not in _WHERE:
        raise ValueError(f"unknown family {name!r}; families: {', '.join(ORDER)}")
    module, cls = _WHERE[name]
    found: type[Family] = getattr(importlib.import_module(module), cls)
    return found
