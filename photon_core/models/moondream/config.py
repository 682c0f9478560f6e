"""Moondream 2 dimensions and prompt ids, in the public reference's config layout.

A checkpoint folder may carry a config.json either in that layout (`{"text": {...}, "vision": {...},
"region": {...}, "tokenizer": {...}}`) or as the Hugging Face wrapper (`{"config": {...}, ...}`,
usually empty: the defaults below are moondream2's real sizes).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from photon_core.weights.config_values import config_float, config_int


@dataclass(frozen=True)
class TextConfig:
    dim: int = 2048
    ff_dim: int = 8192
    n_layers: int = 24
    vocab_size: int = 51200
    max_context: int = 2048
    n_heads: int = 32
    n_kv_heads: int = 32
    prefix_attn: int = 730
    rope_theta: float = 10000.0
    group_size: int | None = None  # int4 quantized checkpoints: not supported (checked at load)


@dataclass(frozen=True)
class VisionConfig:
    enc_dim: int = 1152
    enc_patch_size: int = 14
    enc_n_layers: int = 27
    enc_ff_dim: int = 4304
    enc_n_heads: int = 16
    proj_out_dim: int = 2048
    crop_size: int = 378
    in_channels: int = 3
    max_crops: int = 12
    overlap_margin: int = 4
    proj_inner_dim: int = 8192

    @property
    def grid(self) -> int:
        """Patches per crop side (27): also the side of the pooled feature map."""
        return self.crop_size // self.enc_patch_size


@dataclass(frozen=True)
class RegionDims:
    """The region head's sizes that Moondream 2 and 3 share (Moondream 3's RegionConfig adds its own)."""
    dim: int = 2048
    coord_feat_dim: int = 256
    coord_out_dim: int = 1024
    size_feat_dim: int = 512
    size_out_dim: int = 2048


@dataclass(frozen=True)
class RegionConfig(RegionDims):
    inner_dim: int = 8192
    group_size: int | None = None


def _default_templates() -> dict:
    return {
        "caption": {"short": [1, 32708, 2, 12492, 3], "normal": [1, 32708, 2, 6382, 3],
                    "long": [1, 32708, 2, 4059, 3]},
        "query": {"prefix": [1, 15381, 2], "suffix": [3]},
        "detect": {"prefix": [1, 7235, 476, 2], "suffix": [3]},
        "point": {"prefix": [1, 2581, 2], "suffix": [3]},
    }


@dataclass(frozen=True)
class TokenizerConfig:
    bos_id: int = 0
    eos_id: int = 0
    answer_id: int = 3
    thinking_id: int = 4
    coord_id: int = 5
    size_id: int = 6
    start_ground_points_id: int = 7
    end_ground_id: int = 9
    templates: dict = field(default_factory=_default_templates)


# Keys that only Moondream 3 configs carry: that model is the moondream3 family's, never run here.
MD3_KEYS = {"moe", "n_experts", "experts_per_token", "expert_inner_dim", "tau_attn"}


def is_moondream3_config(d: dict | None) -> bool:
    """A config.json (reference layout or the Hugging Face wrapper) that describes Moondream 3."""
    d = dict(d or {})
    if str(d.get("model_type", "")).startswith("moondream3"):
        return True
    d = unwrap(d)
    return isinstance(d.get("text"), dict) and bool(MD3_KEYS & set(d["text"]))


def unwrap(d: dict | None) -> dict:
    """The reference layout of a config.json: the Hugging Face wrapper keeps it under "config"."""
    d = dict(d or {})
    if isinstance(d.get("config"), dict) and not ({"text", "vision", "region"} & set(d)):
        d = dict(d["config"])
    return d


def check_keys(cls: type, d: dict, section: str) -> None:
    """A typo in config.json fails loudly instead of silently taking a default."""
    unknown = set(d) - {f.name for f in dataclasses.fields(cls)}
    if unknown:
        raise ValueError(f"config.json: unknown keys in '{section}': {sorted(unknown)}")


def build_sections(d: dict | None, classes: dict[str, type], build: Callable[[type, Any, str], Any]) -> dict:
    """section name -> that section's dataclass, each built by the family's `build`."""
    d = unwrap(d)
    return {name: build(c, d.get(name), name) for name, c in classes.items()}


def check_dims(t: Any, v: VisionConfig, r: Any, vision_divides: bool = True) -> None:
    """The checks both families' text / vision / region sections share."""
    if t.dim % t.n_heads or t.n_heads % t.n_kv_heads:
        raise ValueError("config.text: dim must divide into n_heads, n_heads into n_kv_heads")
    if vision_divides and (v.crop_size % v.enc_patch_size or v.enc_dim % v.enc_n_heads):
        raise ValueError("config.vision: crop_size / patch size or enc_dim / heads do not divide")
    if t.prefix_attn != 1 + v.grid * v.grid:
        raise ValueError(f"config: text.prefix_attn ({t.prefix_attn}) must be 1 + image tokens "
                         f"({1 + v.grid * v.grid})")
    if v.proj_out_dim != t.dim or r.dim != t.dim:
        raise ValueError("config: vision.proj_out_dim and region.dim must equal text.dim")
    if r.size_out_dim % 2:
        raise ValueError("config.region.size_out_dim must be even (width and height bins)")


def refusal(config_cls: Any, d: dict | None) -> str | None:
    """Why a recognised checkpoint cannot run (an unsupported config), or None; a malformed config
    is left for the loader to report, with the whole check."""
    try:
        config_cls.from_dict(d)
    except NotImplementedError as err:
        return str(err)
    except ValueError:
        pass
    return None


# Upper bounds on config numbers, so a crafted config.json cannot size allocations at load:
# max_context sets the rotary tables (max_context x rot_dim / 2 floats, twice) and max_crops the
# crops an image is encoded in. Real Moondream 2 values are the defaults above (max_context 2048,
# max_crops 12, dims up to 8192, vocabulary 51200); Moondream 3's max_context is 32768.
NUMBER_LIMITS = {"max_context": 1 << 17, "max_crops": 64, "vocab_size": 1 << 21, "n_layers": 256,
                 "enc_n_layers": 256, "in_channels": 4, "rope_theta": 1e9}
DIM_LIMIT = 1 << 16          # any other size (widths, heads, patch and crop sizes)
# Fields that may be 0: token ids and the crop overlap.
ZERO_ALLOWED = {"overlap_margin"} | {f.name for f in dataclasses.fields(TokenizerConfig)}


def check_numbers(section: Any, name: str) -> None:
    """Every number of a config section is an int (or, where declared float, a number) within its
    bounds: ValueError naming config.json and the field, instead of a ZeroDivisionError, TypeError
    or MemoryError at load."""
    for f in dataclasses.fields(section):
        value, kind = getattr(section, f.name), str(f.type)
        if kind.startswith("float"):
            config_float(value, "config.json", f"{name}.{f.name}", high=NUMBER_LIMITS.get(f.name), positive=True)
        elif kind.startswith("int") and not (value is None and "None" in kind):
            config_int(value, "config.json", f"{name}.{f.name}", 0 if f.name in ZERO_ALLOWED else 1,
                       int(NUMBER_LIMITS.get(f.name, DIM_LIMIT if f.name not in ZERO_ALLOWED else 1 << 21)))


def _build(cls, d: dict, section: str):
    if d is not None and not isinstance(d, dict):
        raise ValueError(f"config.json: '{section}' must be an object")
    d = dict(d or {})
    md3 = MD3_KEYS & set(d)
    if md3:
        raise ValueError(f"a Moondream 3 (MoE) config (config.{section} has {sorted(md3)}): load it with "
                         "photon_core.models.moondream3, not as Moondream 2")
    check_keys(cls, d, section)
    built = cls(**d)
    check_numbers(built, section)
    return built


class ModelConfig(Protocol):
    """What the code both Moondream versions share (model, skills, batched and megakernel decoding)
    reads of a config: MoondreamConfig below and moondream3's Moondream3Config, whose sections are
    subclasses of these."""
    @property
    def text(self) -> TextConfig: ...
    @property
    def vision(self) -> VisionConfig: ...
    @property
    def region(self) -> RegionDims: ...
    @property
    def tokenizer(self) -> TokenizerConfig: ...


@dataclass(frozen=True)
class MoondreamConfig:
    text: TextConfig = TextConfig()
    vision: VisionConfig = VisionConfig()
    region: RegionConfig = RegionConfig()
    tokenizer: TokenizerConfig = TokenizerConfig()

    @classmethod
    def from_dict(cls, d: dict | None) -> "MoondreamConfig":
        cfg = cls(**build_sections(d, {"text": TextConfig, "vision": VisionConfig, "region": RegionConfig,
                                        "tokenizer": TokenizerConfig}, _build))
        cfg.validate()
        return cfg

    def validate(self) -> None:
        t, v, r = self.text, self.vision, self.region
        if t.group_size is not None or r.group_size is not None:
            raise NotImplementedError("int4-quantized Moondream checkpoints are not supported yet")
        check_dims(t, v, r)
