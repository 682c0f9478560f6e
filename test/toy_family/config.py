"""The toy family's configuration: a Llama config.json (the keys transformers' LlamaConfig reads)
under model_type "photon_toy_llama", so no real checkpoint is ever claimed by it."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MODEL_TYPE = "photon_toy_llama"


@dataclass(frozen=True)
class ToyConfig:
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
    bos_token_id: int
    eos_token_id: int


def parse_config(raw: dict[str, Any]) -> ToyConfig:
    """The config from config.json's dict; ValueError naming a missing key or an unsupported one."""
    try:
        hidden, n_heads = int(raw["hidden_size"]), int(raw["num_attention_heads"])
        rope = raw.get("rope_parameters") or {}
        cfg = ToyConfig(
            vocab_size=int(raw["vocab_size"]), hidden=hidden, n_layers=int(raw["num_hidden_layers"]),
            n_heads=n_heads, n_kv_heads=int(raw.get("num_key_value_heads", n_heads)),
            head_dim=int(raw.get("head_dim") or hidden // n_heads), intermediate=int(raw["intermediate_size"]),
            rms_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", raw.get("rope_theta", 10000.0))),
            max_positions=int(raw.get("max_position_embeddings", 2048)),
            tie_embeddings=bool(raw.get("tie_word_embeddings", False)),
            bos_token_id=int(raw["bos_token_id"]), eos_token_id=int(raw["eos_token_id"]))
    except KeyError as err:
        raise ValueError(f"toy Llama config.json lacks {err.args[0]!r}") from None
    if rope.get("rope_type", "default") != "default" or raw.get("rope_scaling"):
        raise NotImplementedError("the toy Llama family runs plain rotary only (no rope scaling)")
    if raw.get("hidden_act", "silu") != "silu" or raw.get("attention_bias") or raw.get("mlp_bias"):
        raise NotImplementedError("the toy Llama family runs SiLU MLPs without biases only")
    if cfg.n_heads % cfg.n_kv_heads:
        raise ValueError(f"{cfg.n_heads} query heads are not a multiple of {cfg.n_kv_heads} K/V heads")
    return cfg


def load_config(folder: str | Path) -> ToyConfig:
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{folder}: no config.json (a toy Llama checkpoint has one)")
    return parse_config(json.loads(path.read_text()))
