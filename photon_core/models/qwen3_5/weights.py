"""Qwen 3.5 tensor names: the transformers layout (model.language_model.*, model.visual.*, lm_head),
or a text-only checkpoint (model.*), renamed to "text.*" / "vision.*"; the multi-token-prediction
head (mtp.*) is not used for plain decoding and is left out."""
from __future__ import annotations

from pathlib import Path

import torch

from photon_core.weights.tensor_files import read_folder, rename

from .config import Qwen35Config

RULES = (
    (r"model\.language_model\.(.*)", r"text.\1"),
    (r"model\.visual\.(.*)", r"vision.\1"),
    (r"lm_head\.weight", r"text.lm_head.weight"),
    (r"model\.(.*)", r"text.\1"),          # text-only (Qwen3_5ForCausalLM) checkpoints
)
DROP = (r"mtp\..*",)
_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def load_state(folder: str | Path, cfg: Qwen35Config, dtype: torch.dtype,
               device: torch.device | str) -> dict[str, torch.Tensor]:
    """Every tensor the model needs, renamed, checked and cast to `dtype` on `device`.
    FileNotFoundError names a missing shard; ValueError a quantized/integer tensor or a missing one."""
    state = rename(read_folder(folder), RULES, drop=DROP)
    odd = sorted(f"{k} ({t.dtype})" for k, t in state.items() if t.dtype not in _FLOATS)
    if odd:
        raise ValueError(f"{folder}: tensors must be float32/float16/bfloat16 (quantized checkpoints are not "
                         f"supported yet); found {', '.join(odd[:3])}{' ...' if len(odd) > 3 else ''}")
    if "text.lm_head.weight" not in state:
        if not cfg.tie_embeddings:
            raise ValueError(f"{folder}: no lm_head.weight and tie_word_embeddings is false")
        if "text.embed_tokens.weight" in state:
            state["text.lm_head.weight"] = state["text.embed_tokens.weight"]
    missing = [n for n in expected_names(cfg) if n not in state or state[n] is None]
    if missing:
        raise ValueError(f"{folder}: missing tensors {missing[:4]}{' ...' if len(missing) > 4 else ''} "
                         f"(a shard or a part of the checkpoint is absent)")
    return {k: t.to(device=device, dtype=dtype) for k, t in state.items()}


def expected_names(cfg: Qwen35Config) -> list[str]:
    t = cfg.text
    names = ["text.embed_tokens.weight", "text.norm.weight", "text.lm_head.weight"]
    for i in range(t.n_layers):
        p = f"text.layers.{i}."
        names += [p + n for n in ("input_layernorm.weight", "post_attention_layernorm.weight",
                                  "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")]
        if t.is_attention(i):
            names += [p + f"self_attn.{n}.weight" for n in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")]
        else:
            names += [p + f"linear_attn.{n}" for n in (
                "in_proj_qkv.weight", "in_proj_z.weight", "in_proj_b.weight", "in_proj_a.weight",
                "conv1d.weight", "dt_bias", "A_log", "norm.weight", "out_proj.weight")]
    if cfg.vision is not None:
        names += ["vision.patch_embed.proj.weight", "vision.pos_embed.weight", "vision.merger.norm.weight",
                  "vision.merger.linear_fc1.weight", "vision.merger.linear_fc2.weight"]
        for i in range(cfg.vision.depth):
            names += [f"vision.blocks.{i}.{n}.weight" for n in ("norm1", "norm2", "attn.qkv", "attn.proj",
                                                                 "mlp.linear_fc1", "mlp.linear_fc2")]
    return names
