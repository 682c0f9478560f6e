"""Whisper model dimensions, read from the weights themselves (no per-size tables)."""
from __future__ import annotations

import re
from dataclasses import asdict, dataclass

import torch

from photon_core.weights.tensor_checks import listed, tensor_problems

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



# What a Whisper checkpoint must be for this engine: 30 s windows of 3000 mel frames, which the
# conv stem halves (every released size: 1500 audio positions); a vocabulary holding at least the
# English-only one, where the special tokens sit (51864; multilingual 51865, large-v3 51866); a text
# context holding a prompt and a window's tokens (every size: 448).
AUDIO_CTX = 1500
MIN_TEXT_CTX = 64
_TOP = ("encoder.conv1.weight", "encoder.positional_embedding", "decoder.token_embedding.weight",
        "decoder.positional_embedding")


def _shapes(dims: WhisperDims, sd: dict[str, torch.Tensor]) -> dict[str, tuple[tuple[int, ...], bool]]:
    """name -> (shape, required) of every tensor WhisperWeights reads, as `dims` imply."""
    da, dt = dims.n_audio_state, dims.n_text_state
    s: dict[str, tuple[tuple[int, ...], bool]] = {
        "encoder.conv1.weight": ((da, dims.n_mels, 3), True), "encoder.conv1.bias": ((da,), True),
        "encoder.conv2.weight": ((da, da, 3), True), "encoder.conv2.bias": ((da,), True),
        "encoder.positional_embedding": ((AUDIO_CTX, da), True),
        "encoder.ln_post.weight": ((da,), True), "encoder.ln_post.bias": ((da,), True),
        "decoder.ln.weight": ((dt,), True), "decoder.ln.bias": ((dt,), True)}

    def attention(p: str, width: int, width_in: int) -> None:
        s[f"{p}_ln.weight"], s[f"{p}_ln.bias"] = ((width,), True), ((width,), True)
        for name in ("query", "key", "value", "out"):
            s[f"{p}.{name}.weight"] = ((width, width_in if name in ("key", "value") else width), True)
            s[f"{p}.{name}.bias"] = ((width,), name != "key")   # openai's key projection has no bias

    blocks = [(f"encoder.blocks.{i}", da) for i in range(dims.n_audio_layer)]
    blocks += [(f"decoder.blocks.{i}", dt) for i in range(dims.n_text_layer)]
    for p, width in blocks:
        attention(f"{p}.attn", width, width)
        if p.startswith("decoder"):
            attention(f"{p}.cross_attn", width, da)
        mlp = sd.get(f"{p}.mlp.0.weight")
        ff = mlp.shape[0] if mlp is not None and mlp.dim() == 2 else 4 * width   # every size: 4 x width
        s.update({f"{p}.mlp_ln.weight": ((width,), True), f"{p}.mlp_ln.bias": ((width,), True),
                  f"{p}.mlp.0.weight": ((ff, width), True), f"{p}.mlp.0.bias": ((ff,), True),
                  f"{p}.mlp.2.weight": ((width, ff), True), f"{p}.mlp.2.bias": ((width,), True)})
    return s


def checked_dims(sd: dict[str, torch.Tensor], n_audio_head: object, n_text_head: object,
                 source: object, n_audio_layer: object = None, n_text_layer: object = None) -> WhisperDims:
    """WhisperDims.from_state_dict, after checking that the checkpoint is one this engine can run:
    head counts that are positive integers dividing the widths, every tensor the dims imply present
    with its shape and a float dtype, the audio and text contexts and vocabulary above. ValueError
    naming `source` and the field, instead of a KeyError at load or a shape error mid-transcription.
    Layer counts the checkpoint states (None: it states none) must be the ones its tensors hold: a
    checkpoint cut after a whole layer would otherwise run shallower and transcribe wrong."""
    from photon_core.weights.config_values import config_int

    missing = [n for n in _TOP if n not in sd or sd[n].dim() != (3 if n.endswith("conv1.weight") else 2)]
    if missing:
        raise ValueError(f"{source}: not a Whisper checkpoint: {missing} missing or not a matrix")
    heads = {name: None if value is None else config_int(value, source, name, 1, 1024)
             for name, value in (("encoder_attention_heads", n_audio_head), ("decoder_attention_heads", n_text_head))}
    dims = WhisperDims.from_state_dict(sd, heads["encoder_attention_heads"], heads["decoder_attention_heads"])
    problems = []
    for field, heads_n, width in (("encoder_attention_heads", dims.n_audio_head, dims.n_audio_state),
                                  ("decoder_attention_heads", dims.n_text_head, dims.n_text_state)):
        if heads_n < 1 or width % heads_n:
            problems.append(f"{field} ({heads_n}) must divide the width ({width})")
    for field, stated, held in (("encoder_layers", n_audio_layer, dims.n_audio_layer),
                                ("decoder_layers", n_text_layer, dims.n_text_layer)):
        if stated is not None and config_int(stated, source, field, 1, 1024) != held:
            problems.append(f"{field} is {stated} but the tensors hold {held} layers")
    if dims.n_vocab < ENGLISH_ONLY_VOCAB:
        problems.append(f"decoder.token_embedding has {dims.n_vocab} rows, fewer than Whisper's "
                        f"{ENGLISH_ONLY_VOCAB} tokens")
    if dims.n_text_ctx < MIN_TEXT_CTX:
        problems.append(f"decoder.positional_embedding has {dims.n_text_ctx} rows, fewer than {MIN_TEXT_CTX}")
    if mismatched := listed(tensor_problems(sd, _shapes(dims, sd))):
        problems.append(mismatched)
    if problems:
        raise ValueError(f"{source}: the Whisper checkpoint does not hold together: {'; '.join(problems)}")
    return dims
