"""Qwen 3.5 tensor names: the transformers layout (model.language_model.*, model.visual.*, lm_head),
or a text-only checkpoint (model.*), renamed to "text.*" / "vision.*"; the multi-token-prediction
head (mtp.*) is not used for plain decoding and is left out."""
from __future__ import annotations

import re
from pathlib import Path

import torch

from photon_core.weights.tensor_checks import listed, tensor_problems
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
    problems = tensor_problems(state, {n: (shape, True) for n, shape in expected_shapes(cfg).items()})
    if "missing" in problems:
        raise ValueError(f"{folder}: {listed({'missing tensors': problems['missing']})} "
                         f"(a shard or a part of the checkpoint is absent)")
    # A tensor of another shape would fail only mid-inference, in a matmul; layers past the
    # config's counts would leave the model shallower than trained.
    problems["layers beyond the config's count"] = layers_beyond(state, cfg)
    if listed(problems):
        raise ValueError(f"{folder}: the tensors do not match the Qwen 3.5 config (layers, widths, heads, "
                         f"vocabulary): {listed(problems)}")
    return {k: t.to(device=device, dtype=dtype) for k, t in state.items()}


_LAYER = re.compile(r"(text\.layers|vision\.blocks)\.(\d+)\..*")


def layers_beyond(state: dict[str, torch.Tensor], cfg: Qwen35Config) -> list[str]:
    """Tensors of layers past the config's counts (text layers, vision blocks), sorted."""
    counts = {"text.layers": cfg.text.n_layers}
    if cfg.vision is not None:   # a text-only config reads none of a vision tower's tensors
        counts["vision.blocks"] = cfg.vision.depth
    return sorted(k for k in state if (m := _LAYER.fullmatch(k)) and m.group(1) in counts
                  and int(m.group(2)) >= counts[m.group(1)])


def expected_names(cfg: Qwen35Config) -> list[str]:
    return list(expected_shapes(cfg))


def expected_shapes(cfg: Qwen35Config) -> dict[str, tuple[int, ...]]:
    """name -> shape of every tensor the model reads, as the config implies."""
    t = cfg.text
    d = t.dim
    s: dict[str, tuple[int, ...]] = {"text.embed_tokens.weight": (t.vocab_size, d), "text.norm.weight": (d,),
                                     "text.lm_head.weight": (t.vocab_size, d)}
    q, kv, v = t.n_heads * t.head_dim, t.n_kv_heads * t.head_dim, t.lin_v_heads * t.lin_v_dim
    for i in range(t.n_layers):
        p = f"text.layers.{i}."
        s.update({p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,),
                  p + "mlp.gate_proj.weight": (t.intermediate, d), p + "mlp.up_proj.weight": (t.intermediate, d),
                  p + "mlp.down_proj.weight": (d, t.intermediate)})
        if t.is_attention(i):
            a = p + "self_attn."
            s.update({a + "q_proj.weight": (2 * q, d),   # each head's query and its output gate
                      a + "k_proj.weight": (kv, d), a + "v_proj.weight": (kv, d), a + "o_proj.weight": (d, q),
                      a + "q_norm.weight": (t.head_dim,), a + "k_norm.weight": (t.head_dim,)})
        else:
            a = p + "linear_attn."
            s.update({a + "in_proj_qkv.weight": (t.conv_dim, d), a + "in_proj_z.weight": (v, d),
                      a + "in_proj_b.weight": (t.lin_v_heads, d), a + "in_proj_a.weight": (t.lin_v_heads, d),
                      a + "conv1d.weight": (t.conv_dim, 1, t.conv_kernel), a + "dt_bias": (t.lin_v_heads,),
                      a + "A_log": (t.lin_v_heads,), a + "norm.weight": (t.lin_v_dim,), a + "out_proj.weight": (d, v)})
    vc = cfg.vision
    if vc is not None:
        merged = vc.dim * vc.merge ** 2
        s.update({"vision.patch_embed.proj.weight": (vc.dim, vc.in_channels, vc.temporal_patch, vc.patch, vc.patch),
                  "vision.pos_embed.weight": (vc.num_pos, vc.dim), "vision.merger.norm.weight": (vc.dim,),
                  # the merger's output is read as text embeddings: its width is the decoder's
                  "vision.merger.linear_fc1.weight": (merged, merged), "vision.merger.linear_fc2.weight": (d, merged)})
        for i in range(vc.depth):
            p = f"vision.blocks.{i}."
            s.update({p + "norm1.weight": (vc.dim,), p + "norm2.weight": (vc.dim,),
                      p + "attn.qkv.weight": (3 * vc.dim, vc.dim), p + "attn.proj.weight": (vc.dim, vc.dim),
                      p + "mlp.linear_fc1.weight": (vc.intermediate, vc.dim),
                      p + "mlp.linear_fc2.weight": (vc.dim, vc.intermediate)})
    return s
