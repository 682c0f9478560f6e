"""Qwen 3.5 against transformers' Qwen3_5ForConditionalGeneration on the same tiny random checkpoints:
prefill logits and 20 greedy decode steps (text-only and image prompts, two configs), vision
preprocessing and features, recognition, and errors for bad checkpoints and inputs."""
from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch

import test_qwen3_5_fixtures as fx
from photon_core import registry
from photon_core.models.qwen3_5 import load_qwen3_5, text, vision

STEPS = 20
TOL = 2e-4


@pytest.fixture(scope="module", params=sorted(fx.CONFIGS))
def pair(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(f"qwen3_5_{request.param}")
    hf = fx.build(folder, request.param)
    return hf, load_qwen3_5(folder), folder


def _hf_greedy(hf, ids: torch.Tensor, **extra):
    with torch.no_grad():
        full = hf(input_ids=ids, **extra).logits[0]
        out = hf.generate(input_ids=ids, max_new_tokens=STEPS, do_sample=False, output_logits=True,
                          return_dict_in_generate=True, eos_token_id=None, pad_token_id=fx.VOCAB - 1, **extra)
    return full, out.sequences[0, ids.shape[1]:], [lg[0] for lg in out.logits]


def _ours(model, image, question):
    """Prefill logits [T, V] of the chat prompt, and the prompt ids our side built."""
    x, pos, delta = model.prompt_inputs(image, question)
    state = text.DecodeState(model.config.text, 1, x.shape[1] + STEPS + 1, model.dtype, model.device)
    state.rope_delta[0] = delta
    with torch.no_grad():
        h = text.prefill(x, pos, state, model.text_w, model.config.text, model.ops)
    return text.logits(h[0], model.text_w, model.ops), state


def _check_decode(model, state, last, hf_tokens, hf_logits):
    cur, mine = last, []
    for s in range(STEPS):
        torch.testing.assert_close(cur, hf_logits[s], atol=TOL, rtol=0)
        mine.append(int(model.ops.argmax(cur)))
        cur = model.step(torch.tensor([[int(hf_tokens[s])]]), state)[0]   # teacher-forced on the reference
    assert mine == hf_tokens.tolist()


def test_text_prompt_matches_transformers(pair):
    hf, model, _ = pair
    q = "what is in the picture?"
    ids = torch.tensor([model.prompts.chat_ids(q, with_image=False)])
    full, toks, step_logits = _hf_greedy(hf, ids)
    ours, state = _ours(model, None, q)
    torch.testing.assert_close(ours, full, atol=TOL, rtol=0)
    _check_decode(model, state, ours[-1], toks, step_logits)


def test_long_text_prefill_crosses_chunks(pair):
    """A prompt longer than one delta-rule chunk (64 tokens), random tokens, no chat template."""
    hf, model, _ = pair
    ids = torch.randint(0, 290, (1, 100), generator=torch.Generator().manual_seed(3))
    full, toks, step_logits = _hf_greedy(hf, ids)
    state = text.DecodeState(model.config.text, 1, 100 + STEPS + 1, torch.float32, "cpu")
    with torch.no_grad():
        h = text.prefill(text.embed(ids, model.text_w), torch.arange(100), state, model.text_w,
                         model.config.text, model.ops)
    ours = text.logits(h[0], model.text_w, model.ops)
    torch.testing.assert_close(ours, full, atol=TOL, rtol=0)
    _check_decode(model, state, ours[-1], toks, step_logits)


def _hf_image_inputs(model, img):
    from transformers import Qwen2VLImageProcessorPil

    pp = model.preprocess
    proc = Qwen2VLImageProcessorPil(patch_size=pp.patch, temporal_patch_size=pp.temporal_patch,
                                    merge_size=pp.merge, image_mean=list(pp.mean), image_std=list(pp.std),
                                    size={"shortest_edge": pp.min_pixels, "longest_edge": pp.max_pixels})
    return proc(images=[img], return_tensors="pt")


@pytest.mark.parametrize("shape", [(40, 56), (70, 33)])
def test_image_prompt_matches_transformers(pair, shape):
    hf, model, _ = pair
    img = fx.image(*shape, seed=shape[0])
    q = "describe this image"
    inputs = _hf_image_inputs(model, img)
    enc = model.encode_image(img)
    ids = model.prompts.chat_ids(q, with_image=True)
    from photon_core.models.qwen3_5 import prompt
    ids = torch.tensor([prompt.expand_images(ids, model.config.image_token_id, [enc.grid[0] * enc.grid[1]])])
    extra = dict(pixel_values=inputs["pixel_values"], image_grid_thw=inputs["image_grid_thw"],
                 mm_token_type_ids=(ids == model.config.image_token_id).int())
    full, toks, step_logits = _hf_greedy(hf, ids, **extra)
    ours, state = _ours(model, img, q)
    torch.testing.assert_close(ours, full, atol=TOL, rtol=0)
    _check_decode(model, state, ours[-1], toks, step_logits)


def test_preprocessing_and_vision_features_match(pair):
    hf, model, _ = pair
    for shape in [(40, 56), (200, 90), (9, 30)]:   # kept, shrunk to the pixel budget, enlarged to the minimum
        img = fx.image(*shape, seed=1)
        inputs = _hf_image_inputs(model, img)
        patches, (gh, gw) = vision.preprocess(img, model.preprocess)
        assert [1, gh, gw] == inputs["image_grid_thw"][0].tolist()
        torch.testing.assert_close(patches, inputs["pixel_values"], atol=1e-6, rtol=0)
        with torch.no_grad():
            ref = hf.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"]).pooler_output[0]
        torch.testing.assert_close(model.encode_image(img).features, ref, atol=1e-5, rtol=0)
    enc = model.encode_image(img)
    assert model.encode_image(enc) is enc
    with pytest.raises(ValueError, match="another model"):   # a released model's, whose id() this one got
        model.query(dataclasses.replace(enc, owner=id(model)), "what is it?")


@pytest.mark.parametrize("files", [
    # a top-level min_pixels / max_pixels overrides size (the Qwen2-VL layout beside the new one)
    {"preprocessor_config.json": {"patch_size": 8, "merge_size": 2, "image_mean": [0.5] * 3, "image_std": [0.5] * 3,
                                  "size": {"shortest_edge": 256, "longest_edge": 4096},
                                  "min_pixels": 1024, "max_pixels": 2304}},
    # newer exports nest the image processor in processor_config.json, which comes first
    {"processor_config.json": {"image_processor": {"patch_size": 8, "image_mean": [0.2, 0.3, 0.4],
                                                   "image_std": [0.6, 0.7, 0.8],
                                                   "size": {"shortest_edge": 512, "longest_edge": 1536}}},
     "preprocessor_config.json": {"patch_size": 8, "size": {"shortest_edge": 256, "longest_edge": 4096}}},
    # settings left out take the processor class's defaults (CLIP normalisation, its pixel budget)
    {"preprocessor_config.json": {"patch_size": 8, "size": {"shortest_edge": 256, "longest_edge": 4096}}},
    {"preprocessor_config.json": {"patch_size": 8, "image_mean": [0.5] * 3, "image_std": [0.5] * 3}},
])
def test_image_processor_settings_are_read_as_transformers_reads_them(tmp_path, files):
    from types import SimpleNamespace

    from transformers import Qwen2VLImageProcessorPil

    for name, content in files.items():
        (tmp_path / name).write_text(json.dumps(content))
    ref = Qwen2VLImageProcessorPil.from_pretrained(tmp_path)
    pp = vision.Preprocess.from_folder(tmp_path, SimpleNamespace(patch=8, temporal_patch=2, merge=2))
    assert (pp.min_pixels, pp.max_pixels) == (ref.size.shortest_edge, ref.size.longest_edge)
    assert pp.mean == pytest.approx(ref.image_mean, abs=1e-7) and pp.std == pytest.approx(ref.image_std, abs=1e-7)
    img = fx.image(30, 170, seed=2)
    inputs = ref(images=[img], return_tensors="pt")
    patches, grid = vision.preprocess(img, pp)
    assert [1, *grid] == inputs["image_grid_thw"][0].tolist()
    torch.testing.assert_close(patches, inputs["pixel_values"], atol=1e-5, rtol=0)


def test_sizes_a_config_leaves_out_are_transformers_defaults():
    """A config.json written with only what differs from transformers' defaults (head_dim 256
    here where hidden_size / heads is 128, 4 kv heads) is the same model here."""
    from transformers import Qwen3_5TextConfig

    from photon_core.models.qwen3_5.config import Qwen35Config

    sparse = {"hidden_size": 1024, "num_attention_heads": 8, "num_hidden_layers": 4}
    ours = Qwen35Config.from_dict({"model_type": "qwen3_5_text", **sparse}).text
    ref = Qwen3_5TextConfig(**sparse)
    assert (ours.head_dim, ours.n_kv_heads, ours.vocab_size, ours.intermediate, ours.n_layers, ours.dim) == \
        (ref.head_dim, ref.num_key_value_heads, ref.vocab_size, ref.intermediate_size, ref.num_hidden_layers,
         ref.hidden_size)
    assert ours.rot_dim == int(ref.head_dim * ref.rope_parameters["partial_rotary_factor"])
    assert list(ours.layer_types) == ref.layer_types
    # and with nothing at all, every size is transformers' default
    bare, ref = Qwen35Config.from_dict({"model_type": "qwen3_5_text"}).text, Qwen3_5TextConfig()
    assert (bare.dim, bare.n_layers, bare.n_heads, bare.head_dim, bare.vocab_size) == \
        (ref.hidden_size, ref.num_hidden_layers, ref.num_attention_heads, ref.head_dim, ref.vocab_size)


# ---------------------------------------------------------------- recognition and bad inputs

def test_recognised_as_qwen3_5_only(pair, tmp_path):
    _, model, folder = pair
    assert registry.recognise(folder).family.name == "qwen3_5"
    from photon_core.models.qwen3_5 import recognise
    from photon_core.weights.checkpoint_files import CheckpointFiles
    for other in ("moondream1", "whisper", "gemma4", "qwen3_asr", "qwen3_vl", "qwen3_next", "qwen2_vl"):
        d = tmp_path / other
        d.mkdir()
        (d / "config.json").write_text(json.dumps({"model_type": other, "architectures": ["X"]}))
        assert not recognise(CheckpointFiles(d)), other
    moe = tmp_path / "moe"
    moe.mkdir()
    (moe / "config.json").write_text(json.dumps({"model_type": "qwen3_5_moe", "text_config": {}}))
    with pytest.raises(NotImplementedError, match="mixture-of-experts"):
        registry.recognise(moe)


def test_missing_shard_is_named(pair, tmp_path):
    hf, _, folder = pair
    sharded = tmp_path / "sharded"
    hf.save_pretrained(sharded, max_shard_size="20KB")
    for f in folder.iterdir():
        if f.suffix in (".json", ".jinja") and not (sharded / f.name).exists():
            shutil.copy(f, sharded / f.name)
    shards = sorted(sharded.glob("model-*.safetensors"))
    assert len(shards) > 1
    torch.testing.assert_close(load_qwen3_5(sharded).text_w.lm_head, hf.lm_head.weight)
    shards[1].unlink()
    with pytest.raises(FileNotFoundError, match=shards[1].name):
        load_qwen3_5(sharded)


def test_tensors_of_other_shapes_than_the_config_are_refused_at_load(pair, tmp_path):
    """A tensor cut short, or a config.json of another size than its tensors, is a ValueError at load
    naming the tensor, not a matmul error in the middle of a caption."""
    from safetensors.torch import load_file, save_file

    _, _, folder = pair
    cut = tmp_path / "cut"
    shutil.copytree(folder, cut)
    sd = load_file(str(cut / "model.safetensors"))
    name = "model.language_model.layers.0.mlp.down_proj.weight"
    sd[name] = sd[name][:, :-8].clone()
    save_file(sd, str(cut / "model.safetensors"))
    with pytest.raises(ValueError, match=r"wrong shapes \['text.layers.0.mlp.down_proj.weight"):
        load_qwen3_5(cut)
    wider = tmp_path / "wider"
    shutil.copytree(folder, wider)
    cfg = json.loads((wider / "config.json").read_text())
    cfg["vision_config"]["intermediate_size"] *= 2
    (wider / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"do not match the Qwen 3.5 config.*vision.blocks.0.mlp.linear_fc1.weight"):
        load_qwen3_5(wider)
    # a config of fewer layers than the tensors hold: the model would run shallower than trained
    fewer = tmp_path / "fewer"
    shutil.copytree(folder, fewer)
    cfg = json.loads((fewer / "config.json").read_text())
    text = cfg.get("text_config", cfg)
    text["num_hidden_layers"] -= 1
    if "layer_types" in text:
        text["layer_types"] = text["layer_types"][:-1]
    (fewer / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"layers beyond the config's count.*text.layers"):
        load_qwen3_5(fewer)


def test_bad_dtypes_and_images(pair, tmp_path):
    _, model, folder = pair
    with pytest.raises(ValueError, match="dtype"):
        load_qwen3_5(folder, dtype="int8")
    from safetensors.torch import load_file, save_file
    quant = tmp_path / "quant"
    shutil.copytree(folder, quant)
    sd = load_file(str(quant / "model.safetensors"))
    name = next(k for k in sd if k.endswith("mlp.down_proj.weight"))
    sd[name] = sd[name].to(torch.int8)
    save_file(sd, str(quant / "model.safetensors"))
    with pytest.raises(ValueError, match="down_proj.*int8"):
        load_qwen3_5(quant)
    small = tmp_path / "small"
    shutil.copytree(folder, small)
    cfg = json.loads((small / "config.json").read_text())
    cfg["text_config"]["max_position_embeddings"] = 70   # room for 6 image tokens
    (small / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="image too large"):
        load_qwen3_5(small).query(fx.image(64, 64), "what?")   # 16 image tokens
    with pytest.raises(ValueError, match="aspect ratio"):
        model.query(fx.image(2, 500), "what?")
    with pytest.raises(ValueError, match=r"\[H, W, 3\]"):
        model.query(torch.zeros(4, 4, 2).numpy(), "what?")
    with pytest.raises(ValueError, match="caption length"):
        model.caption(fx.image(), length="epic")


def test_text_only_checkpoint(tmp_path):
    """A Qwen3_5ForCausalLM checkpoint (model_type qwen3_5_text, tensors model.layers.*): text works,
    an image is refused plainly."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    c = dict(fx.CONFIGS["deltas3"])
    rope = dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=c.pop("partial_rotary_factor"),
                mrope_section=c.pop("mrope_section"))
    torch.manual_seed(4)
    hf = Qwen3_5ForCausalLM(Qwen3_5TextConfig(vocab_size=fx.VOCAB, rope_parameters=rope, **c)).eval()
    hf.save_pretrained(tmp_path)
    fx.build_tokenizer(tmp_path)
    assert registry.recognise(tmp_path).family.name == "qwen3_5"
    model = load_qwen3_5(tmp_path)
    ids = torch.tensor([model.prompts.chat_ids("hello there", with_image=False)])
    with torch.no_grad():
        ref = hf(input_ids=ids).logits[0, -1]
    _, ours = model.prefill(None, "hello there", extra=1)
    torch.testing.assert_close(ours, ref, atol=TOL, rtol=0)
    with pytest.raises(ValueError, match="text-only"):
        model.query(fx.image(), "what?")


def test_bfloat16_follows_float32(pair):
    _, model, folder = pair
    low = load_qwen3_5(folder, dtype="bfloat16")
    assert low.text_w.embed.dtype == torch.bfloat16
    img = fx.image(seed=4)
    _, a = model.prefill(img, "what?", extra=1)
    _, b = low.prefill(img, "what?", extra=1)
    assert (a - b).abs().max() < 0.05 * a.abs().max()
    assert isinstance(low.query(img, "what?", settings={"max_tokens": 3})["answer"], str)
