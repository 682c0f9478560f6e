"""Qwen3-ASR's tensor names: both shipped layouts mapped onto one schema (the Hugging Face one,
without its "model." prefix), and the checks that say plainly what is missing."""
from __future__ import annotations

import re
from pathlib import Path

import torch

from photon_core.weights.tensor_files import read_folder, rename
from photon_core.weights.tensor_checks import listed, tensor_problems

from .config import Qwen3ASRConfig

# (regex matching a whole name, replacement). The original layout (Qwen/Qwen3-ASR-*) kept the
# projector inside the audio tower as proj1/proj2 and the decoder under thinker.model.
RULES = (
    (r"thinker\.audio_tower\.proj1\.(.*)", r"multi_modal_projector.linear_1.\1"),
    (r"thinker\.audio_tower\.proj2\.(.*)", r"multi_modal_projector.linear_2.\1"),
    (r"thinker\.audio_tower\.(.*)", r"audio_tower.\1"),
    (r"thinker\.model\.(.*)", r"language_model.\1"),
    (r"thinker\.lm_head\.(.*)", r"lm_head.\1"),
    (r"model\.((?:audio_tower|language_model|multi_modal_projector)\..*)", r"\1"),
    (r"(lm_head\..*)", r"\1"),
)
# Buffers some exports carry; recomputed here.
DROP = (r".*rotary_emb\.inv_freq", r".*positional_embedding.*")

# Present in every Qwen3-ASR checkpoint, in the schema's names.
REQUIRED = ("audio_tower.conv2d1.weight", "audio_tower.conv_out.weight",
            "multi_modal_projector.linear_1.weight", "language_model.embed_tokens.weight",
            "language_model.layers.0.self_attn.q_norm.weight", "language_model.norm.weight")


def schema_name(name: str) -> str:
    """A checkpoint tensor name in the schema (either layout); other names come back unchanged."""
    for pattern, repl in RULES:
        if re.fullmatch(pattern, name):
            return re.sub(pattern, repl, name)
    return name


def looks_like_qwen3_asr(names: set[str]) -> bool:
    """The tensor names alone: an audio tower with the 2-D conv stem, a projector and a decoder
    with per-head q/k norms (a Qwen3 text stack). Qwen3-Omni also has the stem but keeps a
    `thinker.visual`, and its decoder is a mixture of experts; Qwen 3.5 has no audio tower."""
    schema = {schema_name(n) for n in names}
    if any(n.startswith(("thinker.visual.", "visual.", "model.visual.")) for n in names):
        return False
    if any(".mlp.experts." in n for n in schema):
        return False
    return all(r in schema for r in REQUIRED)


def load_tensors(folder: str | Path, config: Qwen3ASRConfig | None = None) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint under the schema's names (safetensors, no code executed);
    ValueError naming missing or unexpected tensors (with `config`: checked against it)."""
    tensors = rename(read_folder(folder), RULES, drop=DROP)
    missing = [m for m in REQUIRED if m not in tensors]
    if missing:
        raise ValueError(f"{folder}: not a complete Qwen3-ASR checkpoint, missing tensors {missing}")
    if config is not None:
        check_tensors(tensors, config, folder)
    return tensors


def expected_shapes(c: Qwen3ASRConfig) -> dict[str, tuple[tuple[int, ...], bool]]:
    """name -> (shape, required) of every tensor the encoder and decoder read, as the config implies."""
    a, t = c.audio, c.text
    s: dict[str, tuple[tuple[int, ...], bool]] = {}

    def put(name: str, shape: tuple[int, ...], required: bool = True) -> None:
        s[name] = (shape, required)

    freq = a.n_mels
    for i in (1, 2, 3):   # 3x3 convolutions, stride 2, padding 1, over (mel bins, frames)
        put(f"audio_tower.conv2d{i}.weight", (a.conv_channels, 1 if i == 1 else a.conv_channels, 3, 3))
        put(f"audio_tower.conv2d{i}.bias", (a.conv_channels,))
        freq = (freq - 1) // 2 + 1
    put("audio_tower.conv_out.weight", (a.d_model, a.conv_channels * freq))
    put("audio_tower.conv_out.bias", (a.d_model,), False)
    for i in range(a.n_layers):
        p = f"audio_tower.layers.{i}."
        for n in ("self_attn_layer_norm", "final_layer_norm"):
            put(p + n + ".weight", (a.d_model,))
            put(p + n + ".bias", (a.d_model,))
        for n in ("q_proj", "k_proj", "v_proj", "out_proj"):
            put(p + f"self_attn.{n}.weight", (a.d_model, a.d_model))
            put(p + f"self_attn.{n}.bias", (a.d_model,))
        put(p + "fc1.weight", (a.ffn_dim, a.d_model))
        put(p + "fc1.bias", (a.ffn_dim,))
        put(p + "fc2.weight", (a.d_model, a.ffn_dim))
        put(p + "fc2.bias", (a.d_model,))
    put("audio_tower.ln_post.weight", (a.d_model,))
    put("audio_tower.ln_post.bias", (a.d_model,))
    # the projector's output is read as text embeddings: its width is the decoder's
    put("multi_modal_projector.linear_1.weight", (a.d_model, a.d_model))
    put("multi_modal_projector.linear_1.bias", (a.d_model,))
    put("multi_modal_projector.linear_2.weight", (t.hidden, a.d_model))
    put("multi_modal_projector.linear_2.bias", (t.hidden,))
    q, kv = t.n_heads * t.head_dim, t.n_kv_heads * t.head_dim
    put("language_model.embed_tokens.weight", (t.vocab_size, t.hidden))
    for i in range(t.n_layers):
        p = f"language_model.layers.{i}."
        put(p + "input_layernorm.weight", (t.hidden,))
        put(p + "post_attention_layernorm.weight", (t.hidden,))
        put(p + "self_attn.q_proj.weight", (q, t.hidden))
        put(p + "self_attn.k_proj.weight", (kv, t.hidden))
        put(p + "self_attn.v_proj.weight", (kv, t.hidden))
        put(p + "self_attn.o_proj.weight", (t.hidden, q))
        put(p + "self_attn.q_norm.weight", (t.head_dim,))
        put(p + "self_attn.k_norm.weight", (t.head_dim,))
        put(p + "mlp.gate_proj.weight", (t.intermediate, t.hidden))
        put(p + "mlp.up_proj.weight", (t.intermediate, t.hidden))
        put(p + "mlp.down_proj.weight", (t.hidden, t.intermediate))
    put("language_model.norm.weight", (t.hidden,))
    put("lm_head.weight", (t.vocab_size, t.hidden), False)   # absent: tied to the embeddings
    return s


_LAYER = re.compile(r"(audio_tower|language_model)\.layers\.(\d+)\..*")


def check_tensors(tensors: dict[str, torch.Tensor], c: Qwen3ASRConfig, source: object) -> None:
    """Every tensor the config implies is there with its shape and a float dtype, and no layer lies
    beyond the config's count: a ValueError naming the checkpoint, instead of a KeyError at load, a
    shape error mid-transcription, quantized integers cast to floats, or layers silently left out."""
    problems = tensor_problems(tensors, expected_shapes(c))
    layers = {"audio_tower": c.audio.n_layers, "language_model": c.text.n_layers}
    beyond = sorted(n for n in tensors if (m := _LAYER.fullmatch(n)) and int(m.group(2)) >= layers[m.group(1)])
    problems["layers beyond the config's count"] = beyond
    if listed(problems):
        raise ValueError(f"{source}: the tensors do not match the Qwen3-ASR config (layers, widths, heads, "
                         f"vocabulary): {listed(problems)}")


def owned(x: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """x on device in dtype, in memory of its own. A safetensors tensor already in place is a
    private file mapping: clean pages the kernel drops under memory pressure and reads back from
    disk on the next pass (a stall per decode step); a copy stays resident like any other."""
    y = x.to(device, dtype)
    return y.clone() if y.data_ptr() == x.data_ptr() else y
