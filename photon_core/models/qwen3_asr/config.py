"""Qwen3-ASR's configuration, read from the checkpoint's config.json.

Two layouts ship: the Hugging Face one (`Qwen/Qwen3-ASR-*-hf`: audio_config / text_config at the
top) and the original one (`Qwen/Qwen3-ASR-*`: the same under `thinker_config`). Both carry
model_type "qwen3_asr".
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class AudioConfig:
    n_mels: int
    d_model: int
    n_layers: int
    n_heads: int
    ffn_dim: int
    output_dim: int
    n_window: int            # half a conv chunk, in mel frames
    n_window_infer: int      # an attention window, in mel frames (a multiple of 2 * n_window)
    conv_channels: int
    n_positions: int         # sinusoid positions per chunk (13 for 100-frame chunks)
    activation: str

    @property
    def chunk_frames(self) -> int:
        return 2 * self.n_window


@dataclass(frozen=True)
class TextConfig:
    vocab_size: int
    hidden: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate: int
    rms_eps: float
    rope_theta: float
    max_positions: int
    tie_embeddings: bool


@dataclass(frozen=True)
class Qwen3ASRConfig:
    audio: AudioConfig
    text: TextConfig
    audio_token_id: int
    eos_token_ids: tuple[int, ...]
    original_layout: bool    # thinker.* tensor names


def _rope_theta(text: dict[str, Any]) -> float:
    params = text.get("rope_parameters") or text.get("rope_scaling") or {}
    theta = params.get("rope_theta", text.get("rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default"))
    # The original checkpoints state an interleaved multimodal rope; for audio + text input all
    # three position streams are the token index, which is plain 1-D rope.
    if kind not in ("default", "mrope", None):
        raise NotImplementedError(f"Qwen3-ASR text rope type {kind!r} is not supported yet")
    return float(theta)


def _eos(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(int(v) for v in value) if isinstance(value, (list, tuple)) else (int(value),)


def parse_config(raw: dict[str, Any]) -> Qwen3ASRConfig:
    """The config from config.json's dict; ValueError naming a missing field."""
    original = "thinker_config" in raw
    top = raw["thinker_config"] if original else raw
    try:
        a, t = top["audio_config"], top["text_config"]
    except KeyError as err:
        raise ValueError(f"Qwen3-ASR config.json lacks {err.args[0]!r}") from None
    d_model = a.get("d_model", 1024)
    audio = AudioConfig(
        n_mels=a.get("num_mel_bins", 128), d_model=d_model, n_layers=a.get("encoder_layers", 24),
        n_heads=a.get("encoder_attention_heads", 16), ffn_dim=a.get("encoder_ffn_dim", 4096),
        output_dim=a.get("output_dim", 3584), n_window=a.get("n_window", 50),
        n_window_infer=a.get("n_window_infer", 800),
        conv_channels=a.get("downsample_hidden_size", 480),
        n_positions=a.get("max_position_embeddings", a.get("max_source_positions", 13)),
        activation=a.get("activation_function", "gelu"))
    if audio.n_window_infer % audio.chunk_frames:
        raise ValueError(f"n_window_infer {audio.n_window_infer} is not a multiple of 2 * n_window")
    if audio.activation != "gelu":
        raise NotImplementedError(f"Qwen3-ASR audio activation {audio.activation!r} is not supported yet")
    hidden = t.get("hidden_size", 2048)
    n_heads = t.get("num_attention_heads", 16)
    tie = bool(t.get("tie_word_embeddings", raw.get("tie_word_embeddings", top.get("tie_word_embeddings", True))))
    text = TextConfig(
        vocab_size=t["vocab_size"] if "vocab_size" in t else 151936, hidden=hidden,
        n_layers=t.get("num_hidden_layers", 28), n_heads=n_heads,
        n_kv_heads=t.get("num_key_value_heads", n_heads), head_dim=t.get("head_dim") or hidden // n_heads,
        intermediate=t.get("intermediate_size", 6144), rms_eps=float(t.get("rms_norm_eps", 1e-6)),
        rope_theta=_rope_theta(t), max_positions=t.get("max_position_embeddings", 65536),
        tie_embeddings=tie)
    if t.get("attention_bias"):
        raise NotImplementedError("Qwen3-ASR text attention with biases is not supported yet")
    if t.get("use_sliding_window"):
        raise NotImplementedError("Qwen3-ASR text sliding-window attention is not supported yet")
    if t.get("hidden_act", "silu") != "silu":
        raise NotImplementedError(f"Qwen3-ASR text activation {t.get('hidden_act')!r} is not supported yet")
    audio_token = top.get("audio_token_id", top.get("audio_token_index", 151676))
    eos = _eos(raw.get("eos_token_id", top.get("eos_token_id"))) or (151643, 151645)
    return Qwen3ASRConfig(audio, text, int(audio_token), eos, original)


def load_config(folder: str | Path) -> Qwen3ASRConfig:
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{folder}: no config.json (a Qwen3-ASR checkpoint has one)")
    config = parse_config(json.loads(path.read_text()))
    gen = Path(folder) / "generation_config.json"
    if gen.is_file():   # generation's own stop tokens win, as in transformers' generate
        extra = _eos(json.loads(gen.read_text()).get("eos_token_id"))
        if extra:
            config = Qwen3ASRConfig(config.audio, config.text, config.audio_token_id,
                                    tuple(dict.fromkeys(extra + config.eos_token_ids)), config.original_layout)
    return config
