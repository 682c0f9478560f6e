"""Moondream 3 dimensions and prompt ids, in the reference config layout.

A config.json is either that layout (`{"text": {..., "moe": {...}}, "vision": {...}, "region":
{...}, "tokenizer": {...}}`) or the Hugging Face wrapper (`{"config": {...}, "model_type":
"moondream3", ...}`). Missing keys take Moondream 3.1's real sizes. The vision tower and the token
ids are Moondream 2's (its VisionConfig and TokenizerConfig are reused); the text decoder adds the
MoE layers and tau attention, and the region head is the linear one with a LayerNorm.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from photon_core.models.moondream import config as md2_config
from photon_core.models.moondream.config import (TokenizerConfig, VisionConfig, build_sections, check_dims,
                                                  check_keys)


@dataclass(frozen=True)
class MoeConfig:
    num_experts: int = 64
    start_layer: int = 4           # layers before it are dense (Moondream 2's GELU MLP)
    experts_per_token: int = 8
    expert_inner_dim: int = 1024
    # Row order of `mlp.experts.weight` [E, 2I, H]: "halves" is [gate rows; up rows] (the public
    # checkpoints; kestrel interleaves them itself at load time for its kernels); "interleaved8"
    # is gate[0:8], up[0:8], gate[8:16], ... (undone at load time).
    gate_up_layout: str = "halves"


@dataclass(frozen=True)
class TextConfig(md2_config.TextConfig):
    """Moondream 2's text sizes (same fields, same order), a longer context, another rope theta, and
    the MoE layers and tau attention."""
    max_context: int = 32768
    rope_theta: float = 1_500_000.0
    moe: MoeConfig | None = MoeConfig()
    tau_attn: bool = True


@dataclass(frozen=True)
class RegionConfig(md2_config.RegionDims):
    decoder_arch: str = "linear"    # Moondream 3's heads: one Linear each, after a LayerNorm
    use_ln: bool = True


def default_templates() -> dict:
    """Moondream 3's prompt ids: Moondream 2's, a query answered after a single answer marker,
    and segment."""
    return {
        "caption": {"short": [1, 32708, 2, 12492, 3], "normal": [1, 32708, 2, 6382, 3],
                    "long": [1, 32708, 2, 4059, 3]},
        "query": {"prefix": [1, 15381, 2], "answer_prefix": [3], "reasoning_prefix": [4],
                  "post_reasoning_prefix": []},
        "detect": {"prefix": [1, 7235, 476, 2], "suffix": [3]},
        "point": {"prefix": [1, 2581, 2], "suffix": [3]},
        "segment": {"prefix": [1, 17374, 2], "suffix": [3]},
    }


def _build(cls, d: dict | None, section: str):
    d = dict(d or {})
    check_keys(cls, d, section)
    if cls is TextConfig and isinstance(d.get("moe"), dict):
        d["moe"] = _build(MoeConfig, d["moe"], "text.moe")
    if cls is TokenizerConfig:
        d.setdefault("templates", default_templates())
    return cls(**d)


@dataclass(frozen=True)
class Moondream3Config:
    text: TextConfig = TextConfig()
    vision: VisionConfig = VisionConfig()
    region: RegionConfig = RegionConfig()
    tokenizer: TokenizerConfig = field(default_factory=lambda: TokenizerConfig(templates=default_templates()))

    @classmethod
    def from_dict(cls, d: dict | None) -> "Moondream3Config":
        cfg = cls(**build_sections(d, {"text": TextConfig, "vision": VisionConfig, "region": RegionConfig,
                                        "tokenizer": TokenizerConfig}, _build))
        cfg.validate()
        return cfg

    def validate(self) -> None:
        t, v, r, m = self.text, self.vision, self.region, self.text.moe
        if t.group_size is not None:
            raise NotImplementedError("int4-quantized Moondream 3 checkpoints are not supported yet")
        check_dims(t, v, r, vision_divides=False)
        if r.decoder_arch != "linear" or not r.use_ln:
            raise NotImplementedError(f"config.region: only Moondream 3's linear heads after a LayerNorm are "
                                      f"supported (decoder_arch 'linear', use_ln true), got "
                                      f"{r.decoder_arch!r}, use_ln={r.use_ln}")
        if m is not None:
            if not 0 < m.experts_per_token <= m.num_experts:
                raise ValueError("config.text.moe: need 0 < experts_per_token <= num_experts")
            if not 0 <= m.start_layer <= t.n_layers:
                raise ValueError("config.text.moe.start_layer must lie in [0, n_layers]")
            if m.gate_up_layout not in ("halves", "interleaved8"):
                raise ValueError(f"config.text.moe.gate_up_layout must be 'halves' or 'interleaved8', "
                                 f"got {m.gate_up_layout!r}")
            if m.gate_up_layout == "interleaved8" and m.expert_inner_dim % 8:
                raise ValueError("config.text.moe: an 8-row interleave needs expert_inner_dim % 8 == 0")

    def is_moe_layer(self, i: int) -> bool:
        return self.text.moe is not None and i >= self.text.moe.start_layer
