"""Qwen 3.5 configuration, read from the checkpoint's config.json (the transformers layout:
model_type "qwen3_5" with text_config and vision_config, or a text-only "qwen3_5_text")."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

MODEL_TYPES = ("qwen3_5", "qwen3_5_text")
ARCHITECTURES = ("Qwen3_5ForConditionalGeneration", "Qwen3_5ForCausalLM")
# Qwen 3.5 checkpoints with mixture-of-experts MLPs: recognised, not runnable yet.
MOE_MODEL_TYPES = ("qwen3_5_moe", "qwen3_5_moe_text")


@dataclass(frozen=True)
class TextConfig:
    vocab_size: int
    dim: int
    intermediate: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    rot_dim: int                    # rotary covers the first rot_dim features of each head
    rope_theta: float
    mrope_section: tuple[int, int, int]
    eps: float
    layer_types: tuple[str, ...]    # "linear_attention" (Gated DeltaNet) or "full_attention"
    attention_bias: bool
    conv_kernel: int
    lin_k_heads: int
    lin_v_heads: int
    lin_k_dim: int
    lin_v_dim: int
    max_context: int

    @property
    def conv_dim(self) -> int:
        return 2 * self.lin_k_heads * self.lin_k_dim + self.lin_v_heads * self.lin_v_dim

    def is_attention(self, layer: int) -> bool:
        return self.layer_types[layer] == "full_attention"


@dataclass(frozen=True)
class VisionConfig:
    depth: int
    dim: int
    intermediate: int
    n_heads: int
    in_channels: int
    patch: int
    merge: int
    temporal_patch: int
    out_dim: int
    num_pos: int                    # learned position table, a square grid of side sqrt(num_pos)
    rope_theta: float
    activation: str                 # our linear activation name

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


@dataclass(frozen=True)
class Qwen35Config:
    text: TextConfig
    vision: VisionConfig | None     # None: a text-only checkpoint
    image_token_id: int | None
    vision_start_id: int | None
    vision_end_id: int | None
    tie_embeddings: bool

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "Qwen35Config":
        model_type = raw.get("model_type")
        if model_type in MOE_MODEL_TYPES:
            raise NotImplementedError("Qwen 3.5 mixture-of-experts checkpoints (qwen3_5_moe) are not supported yet")
        if model_type not in MODEL_TYPES:
            raise ValueError(f"config.json model_type {model_type!r} is not a Qwen 3.5 one {MODEL_TYPES}")
        text_raw = raw.get("text_config", raw) if model_type == "qwen3_5" else raw
        vision_raw = raw.get("vision_config") if model_type == "qwen3_5" else None
        tie = bool(raw.get("tie_word_embeddings", text_raw.get("tie_word_embeddings", False)))
        return cls(text=_text(text_raw), vision=_vision(vision_raw) if vision_raw else None,
                   image_token_id=raw.get("image_token_id", 248056 if vision_raw else None),
                   vision_start_id=raw.get("vision_start_token_id", 248053 if vision_raw else None),
                   vision_end_id=raw.get("vision_end_token_id", 248054 if vision_raw else None),
                   tie_embeddings=tie)


# What transformers' Qwen3_5TextConfig takes for a size its config.json leaves out (a config saved
# with only the values that differ from these reads as the same model there and here).
_TEXT_DEFAULTS = {"vocab_size": 248320, "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 32,
                  "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 256}


def _text(raw: dict) -> TextConfig:
    where = "text_config"
    size: dict[str, Any] = {k: raw.get(k) if raw.get(k) is not None else v for k, v in _TEXT_DEFAULTS.items()}
    n_layers = int(size["num_hidden_layers"])
    layer_types = raw.get("layer_types")
    if layer_types is None:   # older configs state the pattern as an interval
        every = int(raw.get("full_attention_interval", 4))
        layer_types = ["full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(n_layers)]
    if len(layer_types) != n_layers or set(layer_types) - {"full_attention", "linear_attention"}:
        raise ValueError(f"config.json {where}: layer_types {layer_types} do not fit {n_layers} layers")
    if raw.get("hidden_act", "silu") != "silu":
        raise NotImplementedError(f"Qwen 3.5 text hidden_act {raw['hidden_act']!r} is not supported yet")
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "mrope"):
        raise NotImplementedError(f"Qwen 3.5 rope_type {rope_type!r} is not supported yet")
    theta = float(rope.get("rope_theta", raw.get("rope_theta", 10000.0)))
    n_heads, dim, head_dim = int(size["num_attention_heads"]), int(size["hidden_size"]), int(size["head_dim"])
    partial = float(rope.get("partial_rotary_factor", raw.get("partial_rotary_factor", 0.25)))
    rot_dim = int(head_dim * partial)
    section = tuple(int(s) for s in rope.get("mrope_section", (11, 11, 10)))
    if len(section) != 3 or rot_dim % 2 or rot_dim > head_dim:
        raise ValueError(f"config.json {where}: rotary dims (rot_dim {rot_dim}, mrope_section {section}) invalid")
    return TextConfig(
        vocab_size=int(size["vocab_size"]), dim=dim,
        intermediate=int(size["intermediate_size"]), n_layers=n_layers, n_heads=n_heads,
        n_kv_heads=int(size["num_key_value_heads"]), head_dim=head_dim, rot_dim=rot_dim,
        rope_theta=theta, mrope_section=section, eps=float(raw.get("rms_norm_eps", 1e-6)),
        layer_types=tuple(layer_types), attention_bias=bool(raw.get("attention_bias", False)),
        conv_kernel=int(raw.get("linear_conv_kernel_dim", 4)),
        lin_k_heads=int(raw.get("linear_num_key_heads", 16)), lin_v_heads=int(raw.get("linear_num_value_heads", 32)),
        lin_k_dim=int(raw.get("linear_key_head_dim", 128)), lin_v_dim=int(raw.get("linear_value_head_dim", 128)),
        max_context=int(raw.get("max_position_embeddings", 32768)))


_VISION_ACTS = {"gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu", "silu": "silu"}


def _vision(raw: dict) -> VisionConfig:
    act = raw.get("hidden_act", "gelu_pytorch_tanh")
    if act not in _VISION_ACTS:
        raise NotImplementedError(f"Qwen 3.5 vision hidden_act {act!r} is not supported yet")
    rope = raw.get("rope_parameters") or {}
    patch, tpatch = raw.get("patch_size", 16), raw.get("temporal_patch_size", 2)
    if not isinstance(patch, int) or not isinstance(tpatch, int):
        raise NotImplementedError("Qwen 3.5 vision: non-square patch sizes are not supported yet")
    return VisionConfig(
        depth=int(raw.get("depth", 27)), dim=int(raw.get("hidden_size", 1152)),
        intermediate=int(raw.get("intermediate_size", 4304)), n_heads=int(raw.get("num_heads", 16)),
        in_channels=int(raw.get("in_channels", 3)), patch=patch, merge=int(raw.get("spatial_merge_size", 2)),
        temporal_patch=tpatch, out_dim=int(raw.get("out_hidden_size", 3584)),
        num_pos=int(raw.get("num_position_embeddings", 2304)), rope_theta=float(rope.get("rope_theta", 10000.0)),
        activation=_VISION_ACTS[act])
