"""Tiny random Gemma 4 checkpoints saved by transformers (real tensor names and file layout), with a
byte-level BPE tokenizer, a small Gemma-style chat template and a processor config; plus the tests
of recognition and of the loader's errors on broken checkpoints.

The text stack has 4 layers: sliding, full, sliding, full, the last two sharing the keys/values of
the first two (num_kv_shared_layers=2, so also double-wide MLPs), per-layer inputs, a final logit
softcap, proportional rotary on the full layers and a sliding window of 6 tokens (prompts are
longer, so the window slides). Norm weights, layer scalars and the vision position table are
randomised (transformers initialises them to ones)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

SPECIALS = ["<pad>", "<eos>", "<bos>", "<|turn>", "<turn|>", "<|image|>", "<|image>", "<image|>",
            "<|video|>", "<|audio|>", "<|audio>", "<audio|>"]
PAD, EOS, BOS, SOT, EOT, IMAGE, BOI, EOI, VIDEO, AUDIO, BOA, EOA = range(len(SPECIALS))
VOCAB = 320
WINDOW = 6
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|turn>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
    "{% if c['type'] == 'image' %}<|image|>{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<turn|>\n{% endfor %}{% if add_generation_prompt %}<|turn>model\n{% endif %}")
CORPUS = ["the cat sat on the mat", "a photo of a red car on the road", "what is in this image?",
          "describe this image in detail.", "there is a dog and a person in the park", "hello world",
          "Describe this image in one sentence.", "How many people are there?"] * 20


def text_config(**over) -> dict:
    cfg = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
               num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=32,
               sliding_window=WINDOW, max_position_embeddings=512,
               layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
               vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=8, num_kv_shared_layers=2,
               use_double_wide_mlp=True, final_logit_softcapping=30.0, initializer_range=0.05,
               pad_token_id=PAD, eos_token_id=EOS, bos_token_id=BOS)
    cfg.update(over)
    return cfg


def vision_config(**over) -> dict:
    return dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=2, head_dim=16, pooling_kernel_size=2, patch_size=4,
                position_embedding_size=64, initializer_range=0.05, **over)


def build_hf(vision: bool | dict = True, seed: int = 0, **text_over):
    """vision: False (none), True (the default tower) or a dict of vision_config overrides."""
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    torch.manual_seed(seed)
    vcfg = vision_config(**(vision if isinstance(vision, dict) else {})) if vision is not False else None
    cfg = Gemma4Config(text_config=text_config(**text_over), vision_config=vcfg,
                       audio_config=None, image_token_id=IMAGE, boi_token_id=BOI, eoi_token_id=EOI,
                       video_token_id=VIDEO, audio_token_id=AUDIO, boa_token_id=BOA, eoa_token_index=EOA)
    model = Gemma4ForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1 and name.endswith("weight"):   # RMSNorm scales
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif "position_embedding_table" in name:
                p.copy_(0.5 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.copy_(0.5 + torch.rand_like(b))
            elif name.endswith(("input_min", "output_min")):    # clipped linears: bounds that bite
                b.fill_(-0.05)
            elif name.endswith(("input_max", "output_max")):
                b.fill_(0.05)
            elif name.endswith("std_bias"):
                b.copy_(torch.randn_like(b))
            elif name.endswith("std_scale"):
                b.copy_(0.5 + torch.rand_like(b))
    return model


def write_tokenizer(folder: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    assert tok.get_vocab_size() <= VOCAB and tok.token_to_id("<|image|>") == IMAGE
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "image_token": "<|image|>",
         "boi_token": "<|image>", "eoi_token": "<image|>"}))
    (folder / "chat_template.jinja").write_text(TEMPLATE)
    (folder / "processor_config.json").write_text(json.dumps(
        {"image_processor": {"max_soft_tokens": 70, "patch_size": 4, "pooling_kernel_size": 2}}))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [EOS, EOT]}))


def save_checkpoint(model, folder: Path, max_shard_size: str | None = None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(folder, **kwargs)
    write_tokenizer(folder)
    return folder


@pytest.fixture(scope="session")
def gemma4_hf():
    return build_hf()


@pytest.fixture(scope="session")
def gemma4_dir(gemma4_hf, tmp_path_factory) -> Path:
    return save_checkpoint(gemma4_hf, tmp_path_factory.mktemp("gemma4") / "gemma4-tiny")


# ---------------------------------------------------------------- recognition and bad checkpoints

def test_registry_recognises_gemma4(gemma4_dir):
    from photon_core import registry
    from photon_core.weights.checkpoint_files import CheckpointFiles
    from photon_core.models import gemma4

    assert registry.recognise(gemma4_dir).family.name == "gemma4"
    assert gemma4.recognise(CheckpointFiles(gemma4_dir))
    assert "query" in gemma4.FAMILY.skills and "caption" in gemma4.FAMILY.skills
    assert gemma4.places("gemma-4-E2B-it")[0] == "google/gemma-4-E2B-it" and gemma4.places("gemma3") == []


def test_recognise_claims_only_gemma4(tmp_path):
    from photon_core.models import gemma4
    from photon_core.weights.checkpoint_files import CheckpointFiles

    for model_type, arch in (("gemma3", "Gemma3ForConditionalGeneration"), ("moondream1", "HfMoondream"),
                             ("gemma4_text", "Gemma4ForCausalLM"), ("qwen3_5", "Qwen3_5ForConditionalGeneration")):
        (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type, "architectures": [arch]}))
        assert not gemma4.recognise(CheckpointFiles(tmp_path)), model_type


def test_moe_config_is_refused(tmp_path):
    from photon_core import registry

    cfg = {"model_type": "gemma4", "architectures": ["Gemma4ForConditionalGeneration"],
           "text_config": {**text_config(), "enable_moe_block": True}}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(NotImplementedError, match="mixture-of-experts"):
        registry.recognise(tmp_path)


def test_sizes_a_config_leaves_out_are_transformers_defaults():
    """A config.json written with only what differs from transformers' defaults is the same model
    here: head sizes, per-layer inputs, the layer plan (five sliding layers then a full one, the
    last layer always full) and the rotary settings as Gemma4TextConfig / Gemma4VisionConfig fill
    them in."""
    from transformers.models.gemma4.configuration_gemma4 import Gemma4TextConfig, Gemma4VisionConfig

    from photon_core.models.gemma4.config import TextConfig, VisionConfig

    for sparse in ({"num_hidden_layers": 7, "hidden_size": 64, "num_attention_heads": 4},
                   {"num_hidden_layers": 3, "layer_types": ["full_attention", "sliding_attention",
                                                            "sliding_attention"]}, {}):
        ours, ref = TextConfig.from_dict(dict(sparse)), Gemma4TextConfig(**sparse)
        assert [L.kind for L in ours.layers] == ref.layer_types
        per_layer = [ref.per_layer_config[i] for i in range(ref.num_hidden_layers)]   # each layer's view
        assert [L.head_dim for L in ours.layers] == [c.head_dim for c in per_layer]
        assert [L.n_kv_heads for L in ours.layers] == [c.num_key_value_heads for c in per_layer]
        assert (ours.vocab_size, ours.dim, ours.n_heads, ours.sliding_window, ours.ple_dim, ours.ple_vocab) == \
            (ref.vocab_size, ref.hidden_size, ref.num_attention_heads, ref.sliding_window,
             ref.hidden_size_per_layer_input, ref.vocab_size_per_layer_input)
        assert ours.layers[0].ff_dim == ref.intermediate_size
        for kind, r in ours.rope.items():
            p = ref.rope_parameters[kind]
            assert (r.kind, r.theta, r.partial) == \
                (p["rope_type"], p["rope_theta"], p.get("partial_rotary_factor", 1.0))
    sparse = {"hidden_size": 96, "num_attention_heads": 12}
    ours_v, ref_v = VisionConfig.from_dict(dict(sparse)), Gemma4VisionConfig(**sparse)
    assert (ours_v.head_dim, ours_v.n_kv_heads, ours_v.n_layers, ours_v.ff_dim, ours_v.pool, ours_v.patch_size) == \
        (ref_v.head_dim, ref_v.num_key_value_heads, ref_v.num_hidden_layers, ref_v.intermediate_size,
         ref_v.pooling_kernel_size, ref_v.patch_size)


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_bad_checkpoints_say_what_is_wrong(gemma4_hf, gemma4_dir, tmp_path):
    from photon_core.models.gemma4 import load_gemma4
    from safetensors.torch import load_file, save_file

    sharded = save_checkpoint(gemma4_hf, tmp_path / "sharded", max_shard_size="100KB")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1
    (sharded / shards[-1]).unlink()
    with pytest.raises(FileNotFoundError, match=shards[-1]):
        load_gemma4(sharded)

    broken = _copy(gemma4_dir, tmp_path / "broken")
    sd = load_file(str(broken / "model.safetensors"))
    del sd["model.language_model.layers.1.self_attn.k_proj.weight"]
    sd["model.language_model.norm.weight"] = torch.ones(63)
    save_file(sd, str(broken / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"layers\.1\.self_attn\.k_proj.*norm\.weight"):
        load_gemma4(broken)

    strange = _copy(gemma4_dir, tmp_path / "strange")
    sd = load_file(str(strange / "model.safetensors"))
    sd["model.language_model.extra.weight"] = torch.ones(3)
    save_file(sd, str(strange / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="unexpected tensor"):
        load_gemma4(strange)

    no_tok = _copy(gemma4_dir, tmp_path / "no_tok")
    (no_tok / "tokenizer.json").unlink()
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        load_gemma4(no_tok)

    # a budget the image processor cannot take: refused at load (every image request failed)
    odd_budget = _copy(gemma4_dir, tmp_path / "odd_budget")
    (odd_budget / "processor_config.json").write_text(json.dumps({"image_processor": {"max_soft_tokens": 256}}))
    with pytest.raises(ValueError, match=r"max_soft_tokens must be one of .*got 256"):
        load_gemma4(odd_budget)

    with pytest.raises(ValueError, match="dtype"):
        load_gemma4(gemma4_dir, dtype="int8")
