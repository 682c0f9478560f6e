"""Parakeet TDT speech recognition (FastConformer + token-and-duration transducer) on photon_core
backends: `load_parakeet(path).transcribe(samples, sample_rate)`."""
from __future__ import annotations

from typing import Any

from photon_core.registry import Family
from photon_core.weights.checkpoint_files import CheckpointFiles
from photon_core.weights.resolve import Resolved

from .transcribe import ParakeetSpeech, load_parakeet

_OTHER_HEADS = {"parakeet_ctc": "a Parakeet CTC checkpoint", "parakeet_rnnt": "a Parakeet RNN-T checkpoint"}


def recognise(files: CheckpointFiles) -> bool:
    if files.model_type in ("parakeet_tdt", *_OTHER_HEADS) or any(
            a.startswith("Parakeet") for a in files.architectures):
        return True
    return bool(files.nemo_files)


def refuse(files: CheckpointFiles) -> str | None:
    kind = _OTHER_HEADS.get(files.model_type or "")
    return f"{kind}: only Parakeet TDT is supported yet" if kind else None


def _load(checkpoint: Resolved, device: str, dtype: Any, backend: str) -> ParakeetSpeech:
    return load_parakeet(checkpoint.path, device=device, dtype=dtype, backend=backend,
                         model_id=checkpoint.model_id)


FAMILY = Family(
    name="parakeet",
    skills=frozenset({"transcribe"}),
    looks_for="config.json model_type 'parakeet_tdt' (transformers ParakeetForTDT folder) or a NeMo "
              ".nemo archive",
    recognise=recognise,
    load=_load,
    cli="photon_core.cli_speech",   # `transcribe`, shared by every transcribing family
    refuse=refuse,
)

__all__ = ["load_parakeet", "ParakeetSpeech", "FAMILY"]
