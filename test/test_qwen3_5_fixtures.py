"""Tiny random Qwen 3.5 checkpoints (transformers save_pretrained: real tensor names and config.json),
with a tiny byte-level BPE tokenizer.json, a Qwen-style chat template and a preprocessor config.
Imported by the test_qwen3_5_* modules; holds no tests itself."""
from __future__ import annotations

import json
from pathlib import Path

import torch

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
            "<|image_pad|>", "<|video_pad|>"]
VOCAB = 320
BPE_VOCAB = 300   # trained tokens; the specials follow

CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "<|im_start|>{{ message.role + '\\n' }}"
    "{%- if message.content is string -%}{{ message.content }}"
    "{%- else -%}{%- for item in message.content -%}"
    "{%- if item.type == 'image' -%}<|vision_start|><|image_pad|><|vision_end|>"
    "{%- elif item.type == 'text' -%}{{ item.text }}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}<|im_end|>{{ '\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_start|>{{ 'assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}{{ '<think>\\n\\n</think>\\n\\n' }}{%- endif -%}"
    "{%- endif -%}")

# One config with the default 3:1 DeltaNet/attention pattern (several DeltaNet layers between attention
# layers), one alternating with input and output embeddings tied (no lm_head.weight saved), with GQA in
# both and different head shapes.
CONFIGS = {
    "deltas3": dict(num_hidden_layers=4, layer_types=["linear_attention"] * 3 + ["full_attention"],
                    hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                    linear_value_head_dim=16, partial_rotary_factor=0.5, mrope_section=[3, 3, 2]),
    "alternate": dict(num_hidden_layers=4, layer_types=["linear_attention", "full_attention"] * 2,
                      hidden_size=48, intermediate_size=64, num_attention_heads=4, num_key_value_heads=1, head_dim=16,
                      linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=8,
                      linear_value_head_dim=24, partial_rotary_factor=0.25, mrope_section=[1, 1, 0],
                      tie_word_embeddings=True),
}


def build_tokenizer(folder: Path) -> dict[str, int]:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = ["a photo of a cat on a red sofa", "describe this image", "what is in the picture?",
            "the quick brown fox jumps over the lazy dog", "user assistant system think"] * 20
    trainer = trainers.BpeTrainer(vocab_size=BPE_VOCAB, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(text, trainer)
    tok.add_special_tokens(SPECIALS)
    tok.save(str(folder / "tokenizer.json"))
    ids = {s: tok.token_to_id(s) for s in SPECIALS}
    assert max(ids.values()) < VOCAB
    (folder / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}))
    return ids


def build(folder: Path, name: str = "deltas3", seed: int = 0, max_position_embeddings: int = 4096):
    """Write a tiny checkpoint into `folder`; returns the transformers model (eval, fp32)."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    folder.mkdir(parents=True, exist_ok=True)
    ids = build_tokenizer(folder)
    c = dict(CONFIGS[name])
    tie = c.pop("tie_word_embeddings", False)
    rope = dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=c.pop("partial_rotary_factor"),
                mrope_section=c.pop("mrope_section"), mrope_interleaved=True)
    text = dict(vocab_size=VOCAB, linear_conv_kernel_dim=4, rope_parameters=rope,
                max_position_embeddings=max_position_embeddings, eos_token_id=ids["<|im_end|>"], **c)
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=8, spatial_merge_size=2,
                  temporal_patch_size=2, out_hidden_size=c["hidden_size"], num_position_embeddings=16)
    cfg = Qwen3_5Config(text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
                        video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
                        vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=tie)
    torch.manual_seed(seed)
    model = Qwen3_5ForConditionalGeneration(cfg).eval()
    with torch.no_grad():   # random init leaves the norms at their identity; make them matter
        for n, p in model.named_parameters():
            if n.endswith("norm.weight") or "layernorm" in n or n.endswith("dt_bias"):
                p.add_(torch.randn_like(p) * 0.2)
    model.save_pretrained(folder)
    (folder / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "Qwen2VLImageProcessor", "patch_size": 8, "temporal_patch_size": 2,
        "merge_size": 2, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
        "size": {"shortest_edge": 16 * 16, "longest_edge": 64 * 64}}))
    return model


def image(h: int = 40, w: int = 56, seed: int = 0):
    import numpy as np
    return np.random.default_rng(seed).integers(0, 256, size=(h, w, 3), dtype=np.uint8)
