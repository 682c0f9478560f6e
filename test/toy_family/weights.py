"""The toy family's tensor names: Llama's own (model.layers.N.self_attn.q_proj.weight, ...), kept
as the schema; a checkpoint missing one, or holding a tensor Llama has not, is refused by name."""
from __future__ import annotations

from pathlib import Path

import torch

from photon_core.weights.tensor_files import read_folder, rename

from .config import ToyConfig

RULES = ((r"(model\.embed_tokens\.weight|model\.norm\.weight|lm_head\.weight)", r"\1"),
         (r"(model\.layers\.\d+\.(?:input_layernorm|post_attention_layernorm)\.weight)", r"\1"),
         (r"(model\.layers\.\d+\.self_attn\.[qkvo]_proj\.weight)", r"\1"),
         (r"(model\.layers\.\d+\.mlp\.(?:gate|up|down)_proj\.weight)", r"\1"))
DROP = (r".*rotary_emb\.inv_freq",)   # a buffer some exports carry; recomputed here


def layer_tensors(i: int) -> dict[str, str]:
    """Llama's names of layer i, by role."""
    p = f"model.layers.{i}."
    a, m = p + "self_attn.", p + "mlp."
    return {"in_norm": p + "input_layernorm.weight", "q": a + "q_proj.weight", "k": a + "k_proj.weight",
            "v": a + "v_proj.weight", "o": a + "o_proj.weight", "post_norm": p + "post_attention_layernorm.weight",
            "gate": m + "gate_proj.weight", "up": m + "up_proj.weight", "down": m + "down_proj.weight"}


def required(cfg: ToyConfig) -> list[str]:
    names = ["model.embed_tokens.weight", "model.norm.weight"] + ([] if cfg.tie_embeddings else ["lm_head.weight"])
    return names + [n for i in range(cfg.n_layers) for n in layer_tensors(i).values()]


def load_tensors(folder: str | Path, cfg: ToyConfig) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint (safetensors, no code executed); ValueError naming what is missing."""
    tensors = rename(read_folder(folder), RULES, drop=DROP)
    missing = [n for n in required(cfg) if n not in tensors]
    if missing:
        raise ValueError(f"{folder}: not a complete toy Llama checkpoint, missing tensors {missing[:6]}")
    return tensors
