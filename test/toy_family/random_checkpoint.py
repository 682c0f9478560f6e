"""A toy Llama checkpoint with random weights: config.json and model.safetensors under Llama's
tensor names, what a test loads through the registry."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from .config import MODEL_TYPE
from .weights import layer_tensors


def write_checkpoint(folder: str | Path, seed: int = 0, tied: bool = False, hidden: int = 64, layers: int = 2,
                     heads: int = 4, kv_heads: int = 2, intermediate: int = 128, vocab: int = 264) -> dict:
    """Writes the checkpoint into `folder` and returns its config.json dict. Weights are scaled so
    that logits spread over several units (greedy picks are not decided by rounding) and the layers
    move the residual stream as much as the embedding does (a tied head would otherwise mostly
    predict the token it was fed)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    head_dim = hidden // heads
    config = {"model_type": MODEL_TYPE, "architectures": ["PhotonToyLlamaForCausalLM"], "vocab_size": vocab,
              "hidden_size": hidden, "intermediate_size": intermediate, "num_hidden_layers": layers,
              "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
              "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 128,
              "tie_word_embeddings": tied, "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
              "bos_token_id": 256, "eos_token_id": 257, "torch_dtype": "float32"}
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int, scale: float) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * scale

    def norm(n: int) -> torch.Tensor:
        return 1.0 + rand(n, scale=0.1)

    sd = {"model.embed_tokens.weight": rand(vocab, hidden, scale=1.0), "model.norm.weight": norm(hidden)}
    if not tied:
        sd["lm_head.weight"] = rand(vocab, hidden, scale=1.0)
    shapes = {"q": (heads * head_dim, hidden), "k": (kv_heads * head_dim, hidden), "v": (kv_heads * head_dim, hidden),
              "o": (hidden, heads * head_dim), "gate": (intermediate, hidden), "up": (intermediate, hidden),
              "down": (hidden, intermediate)}
    for i in range(layers):
        n = layer_tensors(i)
        sd[n["in_norm"]], sd[n["post_norm"]] = norm(hidden), norm(hidden)
        for role, shape in shapes.items():
            sd[n[role]] = rand(*shape, scale=2.0 * shape[1] ** -0.5)
    save_file({k: v.contiguous() for k, v in sd.items()}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    return config
