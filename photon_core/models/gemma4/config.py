"""Gemma 4 config, read from a checkpoint's config.json (the Hugging Face layout: model_type 'gemma4'
with text_config and vision_config). Only what E2B / E4B use is accepted; anything else is refused
with the reason rather than run wrong."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

ACTIVATIONS = {"gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu", "silu": "silu"}


def _need(d: dict, key: str, where: str) -> Any:
    if key not in d or d[key] is None:
        raise ValueError(f"config.json: {where} lacks {key!r}")
    return d[key]


# What transformers' Gemma4TextConfig / Gemma4VisionConfig take for a value config.json leaves out
# (a config saved with only what differs from these is the same model there and here).
TEXT_DEFAULTS = {"vocab_size": 262_144, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 30,
                 "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "sliding_window": 512,
                 "vocab_size_per_layer_input": 262_144, "hidden_size_per_layer_input": 256}
SLIDING_PATTERN = 6   # without layer_types: five sliding layers, then a full one
DEFAULT_ROPE: dict[str, dict[str, Any]] = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
    "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0}}
VISION_DEFAULTS = {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 16,
                   "num_attention_heads": 12, "num_key_value_heads": 12, "head_dim": 64}


@dataclass(frozen=True)
class Rope:
    kind: str            # "default" or "proportional"
    theta: float
    partial: float = 1.0  # proportional: the share of the head's frequency pairs that rotate
    factor: float = 1.0


@dataclass(frozen=True)
class LayerSpec:
    """One decoder layer as the config decides it."""
    sliding: bool
    head_dim: int
    n_kv_heads: int
    ff_dim: int
    kv_source: int        # the layer whose keys/values this one attends over (itself unless shared)
    k_eq_v: bool          # values are the raw key projection (no v_proj)

    @property
    def kind(self) -> str:
        return "sliding_attention" if self.sliding else "full_attention"


@dataclass(frozen=True)
class TextConfig:
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    eps: float
    activation: str
    sliding_window: int
    final_softcap: float | None
    ple_vocab: int
    ple_dim: int              # 0: no per-layer inputs
    pad_id: int
    bos_id: int
    eos_ids: tuple[int, ...]
    max_context: int
    rope: dict[str, Rope]
    layers: tuple[LayerSpec, ...]
    tie_embeddings: bool = True

    @property
    def embed_scale(self) -> float:
        return self.dim ** 0.5

    @classmethod
    def from_dict(cls, t: dict) -> "TextConfig":
        w = "text_config"
        if t.get("enable_moe_block"):
            raise NotImplementedError("Gemma 4 mixture-of-experts layers (enable_moe_block, the 26B-A4B "
                                      "model) are not supported yet; E2B and E4B are")
        if t.get("use_bidirectional_attention") not in (None, False):
            raise NotImplementedError(f"use_bidirectional_attention={t['use_bidirectional_attention']!r} "
                                      "is not supported yet (E2B / E4B use causal attention)")
        if t.get("attention_bias"):
            raise NotImplementedError("attention_bias=true is not supported (Gemma 4 has none)")
        act = t.get("hidden_activation", "gelu_pytorch_tanh")
        if act not in ACTIVATIONS:
            raise NotImplementedError(f"hidden_activation {act!r} is not supported")
        d = {**TEXT_DEFAULTS, **t}   # sizes config.json leaves out are transformers' defaults
        n_layers = int(_need(d, "num_hidden_layers", w))
        types = list(t.get("layer_types") or ["full_attention" if (i + 1) % SLIDING_PATTERN == 0
                                              else "sliding_attention" for i in range(n_layers)])
        if len(types) != n_layers or set(types) - {"sliding_attention", "full_attention"}:
            raise ValueError(f"config.json: layer_types must name sliding_attention/full_attention for each "
                             f"of the {n_layers} layers, got {types}")
        types[-1] = "full_attention"   # as transformers makes it (with a warning) whatever the config says
        head_dim = int(_need(d, "head_dim", w))
        n_kv = int(_need(d, "num_key_value_heads", w))
        per_layer = {int(k): v for k, v in (t.get("per_layer_config") or {}).items()}
        k_eq_v = bool(t.get("attention_k_eq_v", False))
        if not per_layer:   # configs written before per_layer_config existed
            glob = {"head_dim": int(t.get("global_head_dim", 512))}
            if k_eq_v and t.get("num_global_key_value_heads"):
                glob["num_key_value_heads"] = int(t["num_global_key_value_heads"])
            per_layer = {i: glob for i, kind in enumerate(types) if kind == "full_attention"}
        n_shared = int(t.get("num_kv_shared_layers", 0) or 0)
        first_shared = n_layers - n_shared
        if n_shared and (first_shared <= 0 or {types[i] for i in range(first_shared)} != set(types)):
            raise ValueError("config.json: num_kv_shared_layers leaves no earlier layer of every attention type "
                             "to share keys/values from")
        ff = int(_need(d, "intermediate_size", w))
        double = bool(t.get("use_double_wide_mlp", False))
        layers = []
        for i, kind in enumerate(types):
            sliding = kind == "sliding_attention"
            over = per_layer.get(i, {})
            source = i if i < first_shared else max(j for j in range(first_shared) if types[j] == kind)
            layers.append(LayerSpec(
                sliding=sliding, head_dim=int(over.get("head_dim", head_dim)),
                n_kv_heads=int(over.get("num_key_value_heads", n_kv)),
                ff_dim=ff * (2 if double and i >= first_shared else 1), kv_source=source,
                k_eq_v=k_eq_v and not sliding))
        rope = {}
        params = t.get("rope_parameters") or DEFAULT_ROPE
        for kind in set(types):
            p = params.get(kind)
            if p is None:
                raise ValueError(f"config.json: rope_parameters lacks {kind!r}")
            rtype = p.get("rope_type", "default")
            if rtype not in ("default", "proportional"):
                raise NotImplementedError(f"rope_type {rtype!r} ({kind}) is not supported yet")
            rope[kind] = Rope(rtype, float(p.get("rope_theta", 10000.0)),
                              float(p.get("partial_rotary_factor", 1.0)), float(p.get("factor", 1.0)))
        ple_vocab = int(d["vocab_size_per_layer_input"] or 0)   # null: no per-layer inputs
        ple_dim = int(d["hidden_size_per_layer_input"] or 0)
        vocab = int(_need(d, "vocab_size", w))
        if ple_dim and ple_vocab < vocab:
            raise ValueError("config.json: vocab_size_per_layer_input is smaller than vocab_size; every token "
                             "needs a per-layer embedding")
        eos = t.get("eos_token_id", 1)
        eos = tuple(eos) if isinstance(eos, list) else (int(eos),) if eos is not None else ()
        n_heads = int(_need(d, "num_attention_heads", w))
        for spec in layers:
            if n_heads % spec.n_kv_heads:
                raise ValueError(f"config.json: {spec.n_kv_heads} kv heads do not divide {n_heads} heads")
        return cls(
            vocab_size=vocab, dim=int(_need(d, "hidden_size", w)), n_layers=n_layers,
            n_heads=n_heads, eps=float(t.get("rms_norm_eps", 1e-6)),
            activation=ACTIVATIONS[act], sliding_window=int(_need(d, "sliding_window", w)),
            final_softcap=t.get("final_logit_softcapping"),
            ple_vocab=ple_vocab, ple_dim=ple_dim,
            pad_id=int(t.get("pad_token_id") or 0), bos_id=int(t.get("bos_token_id", 2)), eos_ids=eos,
            max_context=int(t.get("max_position_embeddings", 131072)), rope=rope, layers=tuple(layers),
            tie_embeddings=bool(t.get("tie_word_embeddings", True)))


@dataclass(frozen=True)
class VisionConfig:
    dim: int
    ff_dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    eps: float
    activation: str
    patch_size: int
    pool: int                 # pooling_kernel_size: k x k patches make one soft token
    pos_table: int            # position_embedding_size
    rope_theta: float
    standardize: bool
    clipped: bool             # use_clipped_linears: clamp bounds stored in the checkpoint

    @classmethod
    def from_dict(cls, v: dict) -> "VisionConfig":
        w = "vision_config"
        rope = v.get("rope_parameters") or {}
        if rope.get("rope_type", "axial") != "axial":
            raise NotImplementedError(f"vision rope_type {rope.get('rope_type')!r} is not supported")
        act = v.get("hidden_activation", "gelu_pytorch_tanh")
        if act not in ACTIVATIONS:
            raise NotImplementedError(f"vision hidden_activation {act!r} is not supported")
        v = {**VISION_DEFAULTS, **{k: x for k, x in v.items() if x is not None}}
        return cls(dim=int(v["hidden_size"]), ff_dim=int(_need(v, "intermediate_size", w)),
                   n_layers=int(v["num_hidden_layers"]), n_heads=int(v["num_attention_heads"]),
                   n_kv_heads=int(v["num_key_value_heads"]), head_dim=int(v["head_dim"]),
                   eps=float(v.get("rms_norm_eps", 1e-6)),
                   activation=ACTIVATIONS[act], patch_size=int(v.get("patch_size", 16)),
                   pool=int(v.get("pooling_kernel_size") or 3),
                   pos_table=int(v.get("position_embedding_size", 10240)),
                   rope_theta=float(rope.get("rope_theta", 100.0)), standardize=bool(v.get("standardize", False)),
                   clipped=bool(v.get("use_clipped_linears", False)))


@dataclass(frozen=True)
class Gemma4Config:
    text: TextConfig
    vision: VisionConfig | None
    image_token_id: int
    boi_token_id: int
    eoi_token_id: int
    placeholder_ids: tuple[int, ...] = ()   # image/video/audio soft-token slots: never generated

    @classmethod
    def from_dict(cls, d: dict | None) -> "Gemma4Config":
        if not isinstance(d, dict):
            raise ValueError("a Gemma 4 checkpoint needs config.json")
        if d.get("model_type") != "gemma4":
            raise ValueError(f"config.json: model_type {d.get('model_type')!r} is not 'gemma4'")
        text = TextConfig.from_dict(_need(d, "text_config", "config.json"))
        vision = VisionConfig.from_dict(d["vision_config"]) if d.get("vision_config") else None
        image_id = int(d.get("image_token_id", 258880))
        slots = {image_id} | {int(d[k]) for k in ("video_token_id", "audio_token_id") if d.get(k) is not None}
        return cls(text=text, vision=vision, image_token_id=image_id,
                   boi_token_id=int(d.get("boi_token_id", 255999)), eoi_token_id=int(d.get("eoi_token_id", 258882)),
                   placeholder_ids=tuple(sorted(i for i in slots if i < text.vocab_size)))
