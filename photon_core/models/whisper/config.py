"""Whisper model dimensions, read from the weights themselves (no per-size tables)."""
from __future__ import annotations

import re
from dataclasses import asdict, dataclass

import torch

# Every released Whisper size uses 64-dim attention heads; used only when a format does not
# store the head count.
HEAD_DIM = 64
ENGLISH_ONLY_VOCAB = 51864


@dataclass(frozen=True)
class WhisperDims:
    n_mels: int
    n_audio_ctx: int
    n_audio_state: int
    n_audio_head: int
    n_audio_layer: int
    n_vocab: int
    n_text_ctx: int
    n_text_state: int
    n_text_head: int
    n_text_layer: int

    @property
    def is_multilingual(self) -> bool:
        return self.n_vocab >= ENGLISH_ONLY_VOCAB + 1

    def as_dict(self) -> dict[str, int]:
        return asdict(self)

    @classmethod
    def from_state_dict(cls, sd: dict[str, torch.Tensor], n_audio_head: int | None = None,
                        n_text_head: int | None = None) -> WhisperDims:
        """Dims of a checkpoint in internal (openai-whisper) names; head counts when known."""
        def count(prefix: str) -> int:
            pat = re.compile(re.escape(prefix) + r"(\d+)\.")
            return len({m.group(1) for k in sd if (m := pat.match(k))})

        conv1 = sd["encoder.conv1.weight"]
        emb = sd["decoder.token_embedding.weight"]
        return cls(
            n_mels=conv1.shape[1],
            n_audio_ctx=sd["encoder.positional_embedding"].shape[0],
            n_audio_state=conv1.shape[0],
            n_audio_head=n_audio_head or conv1.shape[0] // HEAD_DIM,
            n_audio_layer=count("encoder.blocks."),
            n_vocab=emb.shape[0],
            n_text_ctx=sd["decoder.positional_embedding"].shape[0],
            n_text_state=emb.shape[1],
            n_text_head=n_text_head or emb.shape[1] // HEAD_DIM,
            n_text_layer=count("decoder.blocks."),
        )


_SIZES = {(384, 4): "tiny", (512, 6): "base", (768, 12): "small", (1024, 24): "medium",
          (1280, 32): "large"}


def name_from_dims(dims: WhisperDims) -> str:
    """A short model name such as "whisper-tiny.en", for checkpoints that do not carry one."""
    size = _SIZES.get((dims.n_audio_state, dims.n_audio_layer), f"d{dims.n_audio_state}")
    if size == "large":
        if dims.n_mels == 128:
            size = "large-v3-turbo" if dims.n_text_layer == 4 else "large-v3"
    return f"whisper-{size}" + ("" if dims.is_multilingual else ".en")
