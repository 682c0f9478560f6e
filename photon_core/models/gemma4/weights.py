"""Gemma 4 tensors: read from a Hugging Face folder (model.safetensors or shards listed by
model.safetensors.index.json), renamed to short names, checked against the config, cast once."""
from __future__ import annotations

import re
from pathlib import Path

import torch

from photon_core.weights.tensor_checks import listed, tensor_problems
from photon_core.weights.tensor_files import parse_dtype, read_folder, rename

from .config import Gemma4Config

# Gemma4ForConditionalGeneration prefixes its parts with "model."; a bare Gemma4Model does not.
RULES = [
    (r"(?:model\.)?language_model\.(.*)", r"text.\1"),
    (r"(?:model\.)?vision_tower\.(.*)", r"vision.\1"),
    (r"(?:model\.)?embed_vision\.(.*)", r"embed_vision.\1"),
    (r"lm_head\.weight", r"text.lm_head.weight"),
]
# The audio tower (transcription is not offered) and the key/value weights some exports keep for
# layers that reuse another layer's keys and values (transformers ignores those too).
DROP = [r"(?:model\.)?audio_tower\..*", r"(?:model\.)?embed_audio\..*"]


def expected_shapes(cfg: Gemma4Config) -> dict[str, tuple[int, ...]]:
    t = cfg.text
    s: dict[str, tuple[int, ...]] = {}
    s["text.embed_tokens.weight"] = (t.vocab_size, t.dim)
    s["text.norm.weight"] = (t.dim,)
    if t.ple_dim:
        s["text.embed_tokens_per_layer.weight"] = (t.ple_vocab, t.n_layers * t.ple_dim)
        s["text.per_layer_model_projection.weight"] = (t.n_layers * t.ple_dim, t.dim)
        s["text.per_layer_projection_norm.weight"] = (t.ple_dim,)
    for i, L in enumerate(t.layers):
        p = f"text.layers.{i}."
        for n in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                  "post_feedforward_layernorm"):
            s[p + n + ".weight"] = (t.dim,)
        s[p + "layer_scalar"] = (1,)
        s[p + "self_attn.q_proj.weight"] = (t.n_heads * L.head_dim, t.dim)
        s[p + "self_attn.q_norm.weight"] = (L.head_dim,)
        s[p + "self_attn.o_proj.weight"] = (t.dim, t.n_heads * L.head_dim)
        if L.kv_source == i:
            s[p + "self_attn.k_proj.weight"] = (L.n_kv_heads * L.head_dim, t.dim)
            s[p + "self_attn.k_norm.weight"] = (L.head_dim,)
            if not L.k_eq_v:
                s[p + "self_attn.v_proj.weight"] = (L.n_kv_heads * L.head_dim, t.dim)
        s[p + "mlp.gate_proj.weight"] = (L.ff_dim, t.dim)
        s[p + "mlp.up_proj.weight"] = (L.ff_dim, t.dim)
        s[p + "mlp.down_proj.weight"] = (t.dim, L.ff_dim)
        if t.ple_dim:
            s[p + "per_layer_input_gate.weight"] = (t.ple_dim, t.dim)
            s[p + "per_layer_projection.weight"] = (t.dim, t.ple_dim)
            s[p + "post_per_layer_input_norm.weight"] = (t.dim,)
    v = cfg.vision
    if v is not None:
        s["vision.patch_embedder.input_proj.weight"] = (v.dim, 3 * v.patch_size ** 2)
        s["vision.patch_embedder.position_embedding_table"] = (2, v.pos_table, v.dim)
        for i in range(v.n_layers):
            p = f"vision.encoder.layers.{i}."
            for n in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                      "post_feedforward_layernorm"):
                s[p + n + ".weight"] = (v.dim,)
            s[p + "self_attn.q_proj.linear.weight"] = (v.n_heads * v.head_dim, v.dim)
            s[p + "self_attn.k_proj.linear.weight"] = (v.n_kv_heads * v.head_dim, v.dim)
            s[p + "self_attn.v_proj.linear.weight"] = (v.n_kv_heads * v.head_dim, v.dim)
            s[p + "self_attn.o_proj.linear.weight"] = (v.dim, v.n_heads * v.head_dim)
            s[p + "self_attn.q_norm.weight"] = (v.head_dim,)
            s[p + "self_attn.k_norm.weight"] = (v.head_dim,)
            s[p + "mlp.gate_proj.linear.weight"] = (v.ff_dim, v.dim)
            s[p + "mlp.up_proj.linear.weight"] = (v.ff_dim, v.dim)
            s[p + "mlp.down_proj.linear.weight"] = (v.dim, v.ff_dim)
        if v.standardize:
            s["vision.std_bias"] = (v.dim,)
            s["vision.std_scale"] = (v.dim,)
        s["embed_vision.embedding_projection.weight"] = (t.dim, v.dim)
    return s


_CLIP = re.compile(r"vision\.encoder\.layers\.\d+\.(self_attn|mlp)\.\w+\.(input|output)_(min|max)")


def _drop_rules(cfg: Gemma4Config) -> list[str]:
    drop = list(DROP)
    for i, L in enumerate(cfg.text.layers):
        if L.kv_source != i:
            drop.append(rf"(?:model\.)?language_model\.layers\.{i}\.self_attn\.(k_proj|v_proj|k_norm|v_norm)\..*")
    if cfg.vision is None:
        drop += [r"(?:model\.)?vision_tower\..*", r"(?:model\.)?embed_vision\..*"]
    return drop


def load_state(folder: str | Path, cfg: Gemma4Config, dtype: torch.dtype | str,
               device: torch.device | str) -> dict[str, torch.Tensor]:
    """Every tensor the config implies, renamed, shape-checked and cast to `dtype` on `device`."""
    dtype = parse_dtype(dtype)
    raw = read_folder(folder)
    state = rename(raw, RULES, drop=_drop_rules(cfg))
    want = expected_shapes(cfg)
    if "text.lm_head.weight" in state and not cfg.text.tie_embeddings:
        want["text.lm_head.weight"] = (cfg.text.vocab_size, cfg.text.dim)
    elif not cfg.text.tie_embeddings:
        raise ValueError(f"{folder}: tie_word_embeddings is false but there is no lm_head.weight")
    problems = tensor_problems(state, {k: (v, True) for k, v in want.items()})
    problems.pop("not floating point", None)   # refused below with their dtype
    if problems:
        raise ValueError(f"{folder}: the tensors do not match the Gemma 4 config: {listed(problems, shown=5)}")
    # A tensor nobody expects means another model (or another Gemma 4 variant) under this config.
    extra = sorted(k for k in state if k not in want and not _CLIP.fullmatch(k))
    if extra:
        raise ValueError(f"{folder}: unexpected tensor(s) for this Gemma 4 config: {extra[:5]}")
    bad = [k for k, t in state.items() if not t.is_floating_point()]
    if bad:
        raise ValueError(f"{folder}: tensors {bad[:3]} are not floating point ({state[bad[0]].dtype}); "
                         "quantized Gemma 4 checkpoints are not supported yet")
    return fuse({k: t.to(device=device, dtype=dtype) for k, t in state.items()}, cfg)


def fuse(state: dict[str, torch.Tensor], cfg: Gemma4Config) -> dict[str, torch.Tensor]:
    """One projection where the checkpoint has several reading the same input: q|k|v (q|k when
    values are the keys) as `self_attn.qkv`, gate|up as `mlp.gate_up` (one launch instead of
    three / two per layer and step). The parts are dropped so the weights are held once."""
    for i, L in enumerate(cfg.text.layers):
        p = f"text.layers.{i}."
        if L.kv_source == i:
            names = ["q_proj", "k_proj"] + ([] if L.k_eq_v else ["v_proj"])
            state[p + "self_attn.qkv.weight"] = torch.cat([state.pop(f"{p}self_attn.{n}.weight") for n in names])
        state[p + "mlp.gate_up.weight"] = torch.cat([state.pop(p + "mlp.gate_proj.weight"),
                                                     state.pop(p + "mlp.up_proj.weight")])
    return state
