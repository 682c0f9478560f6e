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

from photon_core.weights.config_values import config_float, config_int


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


# Bounds on config numbers that size allocations at load (the audio encoder's sinusoid table is
# n_positions x d_model, built before any tensor is checked), comfortably above the real
# checkpoints' values (Qwen3-ASR 0.6B / 1.7B): audio 128 mels, d_model 896-1024, 18-24 layers,
# 14-16 heads, ffn 3584-4096, output 1024-2048, n_window 50, n_window_infer 800, 480 conv channels,
# 1500 positions; text vocabulary 151936, hidden 1024-2048, 28 layers, 16 heads, 8 kv heads,
# head_dim 128, intermediate 3072-6144, 65536 positions.
AUDIO_LIMITS = {"num_mel_bins": 1024, "d_model": 16384, "encoder_layers": 256, "encoder_attention_heads": 256,
                "encoder_ffn_dim": 1 << 17, "output_dim": 1 << 16, "n_window": 1 << 12, "n_window_infer": 1 << 16,
                "downsample_hidden_size": 8192, "positions": 1 << 15}
TEXT_LIMITS = {"vocab_size": 1 << 21, "hidden_size": 1 << 16, "num_hidden_layers": 512, "num_attention_heads": 1024,
               "num_key_value_heads": 1024, "head_dim": 1024, "intermediate_size": 1 << 18,
               "max_position_embeddings": 1 << 22}


def parse_config(raw: dict[str, Any], source: str = "config.json") -> Qwen3ASRConfig:
    """The config from config.json's dict; ValueError naming `source` and a missing or out-of-range
    field."""
    original = "thinker_config" in raw
    top = raw["thinker_config"] if original else raw
    try:
        a, t = top["audio_config"], top["text_config"]
    except (KeyError, TypeError) as err:
        raise ValueError(f"{source}: Qwen3-ASR config.json lacks {err.args[0]!r}") from None
    if not isinstance(a, dict) or not isinstance(t, dict):
        raise ValueError(f"{source}: audio_config and text_config must be objects")
    prefix = "thinker_config." if original else ""

    def audio_int(key: str, default: int, low: int = 1, limit: str | None = None) -> int:
        return config_int(a.get(key, default), source, f"{prefix}audio_config.{key}", low,
                          AUDIO_LIMITS[limit or key])

    def text_int(key: str, default: Any) -> int:
        return config_int(t.get(key, default), source, f"{prefix}text_config.{key}", 1, TEXT_LIMITS[key])

    positions_key = "max_position_embeddings" if "max_position_embeddings" in a else "max_source_positions"
    d_model = audio_int("d_model", 1024, low=4)   # the sinusoid table needs d_model / 2 - 1 > 0
    audio = AudioConfig(
        n_mels=audio_int("num_mel_bins", 128), d_model=d_model, n_layers=audio_int("encoder_layers", 24),
        n_heads=audio_int("encoder_attention_heads", 16), ffn_dim=audio_int("encoder_ffn_dim", 4096),
        output_dim=audio_int("output_dim", 3584), n_window=audio_int("n_window", 50),
        n_window_infer=audio_int("n_window_infer", 800),
        conv_channels=audio_int("downsample_hidden_size", 480),
        n_positions=audio_int(positions_key, 13, limit="positions"),
        activation=a.get("activation_function", "gelu"))
    if audio.n_window_infer % audio.chunk_frames:
        raise ValueError(f"{source}: n_window_infer {audio.n_window_infer} is not a multiple of 2 * n_window")
    if audio.d_model % audio.n_heads:
        raise ValueError(f"{source}: audio_config.encoder_attention_heads ({audio.n_heads}) must divide d_model "
                         f"({audio.d_model})")
    if audio.activation != "gelu":
        raise NotImplementedError(f"Qwen3-ASR audio activation {audio.activation!r} is not supported yet")
    hidden = text_int("hidden_size", 2048)
    n_heads = text_int("num_attention_heads", 16)
    tie = bool(t.get("tie_word_embeddings", raw.get("tie_word_embeddings", top.get("tie_word_embeddings", True))))
    text = TextConfig(
        vocab_size=text_int("vocab_size", 151936), hidden=hidden,
        n_layers=text_int("num_hidden_layers", 28), n_heads=n_heads,
        n_kv_heads=text_int("num_key_value_heads", n_heads),
        head_dim=text_int("head_dim", None) if t.get("head_dim") else hidden // n_heads,
        intermediate=text_int("intermediate_size", 6144),
        rms_eps=config_float(t.get("rms_norm_eps", 1e-6), source, "text_config.rms_norm_eps", positive=True),
        rope_theta=_rope_theta(t), max_positions=text_int("max_position_embeddings", 65536),
        tie_embeddings=tie)
    if text.n_heads % text.n_kv_heads or text.head_dim < 2:
        raise ValueError(f"{source}: text_config: num_key_value_heads ({text.n_kv_heads}) must divide "
                         f"num_attention_heads ({text.n_heads}), head_dim ({text.head_dim}) be 2 or more")
    if t.get("attention_bias"):
        raise NotImplementedError("Qwen3-ASR text attention with biases is not supported yet")
    if t.get("use_sliding_window"):
        raise NotImplementedError("Qwen3-ASR text sliding-window attention is not supported yet")
    if t.get("hidden_act", "silu") != "silu":
        raise NotImplementedError(f"Qwen3-ASR text activation {t.get('hidden_act')!r} is not supported yet")
    audio_token = top.get("audio_token_id", top.get("audio_token_index", 151676))
    eos = _eos(raw.get("eos_token_id", top.get("eos_token_id"))) or (151643, 151645)
    return Qwen3ASRConfig(audio, text, config_int(audio_token, source, "audio_token_id", 0), eos, original)


def load_config(folder: str | Path) -> Qwen3ASRConfig:
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{folder}: no config.json (a Qwen3-ASR checkpoint has one)")
    config = parse_config(json.loads(path.read_text()), str(path))
    gen = Path(folder) / "generation_config.json"
    if gen.is_file():   # generation's own stop tokens win, as in transformers' generate
        extra = _eos(json.loads(gen.read_text()).get("eos_token_id"))
        if extra:
            config = Qwen3ASRConfig(config.audio, config.text, config.audio_token_id,
                                    tuple(dict.fromkeys(extra + config.eos_token_ids)), config.original_layout)
    return config
