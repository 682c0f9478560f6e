"""Qwen3-ASR speech recognition (0.6B, 1.7B) on photon_core backends:
`load_qwen3_asr(path).transcribe(audio)`, the same face as Whisper's."""
from __future__ import annotations

from typing import Any

from photon_core.registry import Family
from photon_core.weights.checkpoint_files import CheckpointFiles
from photon_core.weights.resolve import Resolved

from .checkpoint import looks_like_qwen3_asr
from .transcribe import Qwen3ASRSpeech, load_qwen3_asr

_ARCHITECTURES = ("Qwen3ASRForConditionalGeneration", "Qwen3ASRForTokenClassification",
                  "Qwen3ASRForcedAlignerForTokenClassification")


def recognise(files: CheckpointFiles) -> bool:
    """config.json model_type 'qwen3_asr' (both layouts) or a Qwen3-ASR architecture; without a
    config, the tensor names (audio tower with the 2-D conv stem + projector + Qwen3 decoder)."""
    if files.model_type == "qwen3_asr" or any(a in _ARCHITECTURES for a in files.architectures):
        return True
    if files.config is not None:   # another family's config: its model_type decides, not names
        return False
    try:
        return looks_like_qwen3_asr(set(files.tensor_names))
    except (OSError, ValueError):
        return False


def refuse(files: CheckpointFiles) -> str | None:
    """The forced aligner shares the model_type but is a token classifier, not a transcriber."""
    if any("TokenClassification" in a for a in files.architectures):
        return "a Qwen3-ASR forced aligner (token classification): alignment is not supported yet"
    try:
        names = files.tensor_names
    except (OSError, ValueError):
        return None
    if any(n.endswith("classify_head.weight") or n == "score.weight" for n in names):
        return "a Qwen3-ASR forced aligner (token classification): alignment is not supported yet"
    return None


def _load(checkpoint: Resolved, device: str, dtype: Any, backend: str) -> Qwen3ASRSpeech:
    speech = load_qwen3_asr(checkpoint.path if checkpoint.path.is_dir() else checkpoint.path.parent,
                            device=device, dtype=dtype, backend=backend)
    speech.model_id = checkpoint.model_id
    return speech


FAMILY = Family(
    name="qwen3_asr",
    skills=frozenset({"transcribe"}),
    looks_for="config.json model_type 'qwen3_asr' (Hugging Face or original layout), or audio_tower."
              "conv2d1 + multi_modal_projector + language_model q_norm tensors without a config",
    recognise=recognise,
    load=_load,
    # `transcribe` on the command line is one command for every family that transcribes: it
    # loads whatever --model names.
    cli="photon_core.cli_speech",
    refuse=refuse,
)

__all__ = ["load_qwen3_asr", "Qwen3ASRSpeech", "FAMILY"]
