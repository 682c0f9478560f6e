"""Checkpoint readers: CTranslate2 model.bin (real tiny.en and synthetic files), Hugging Face
safetensors, OpenAI .pt; all must give openai-whisper's forward pass on the same weights."""
from __future__ import annotations

import json
from dataclasses import asdict

import pytest
import torch

from photon_core.models.whisper.config import WhisperDims, name_from_dims
from photon_core.models.whisper.model import WhisperNet, WhisperWeights
from photon_core.models.whisper import checkpoint as wc
from photon_core.weights.ctranslate2 import UnsupportedQuantization, read_ctranslate2

from whisper_fixtures import (openai_to_ct2_variables, openai_to_hf, random_openai_model,
                              tiny_en_path, write_ct2)

whisper = pytest.importorskip("whisper")


@pytest.fixture(scope="module")
def random_model():
    model, dims = random_openai_model(seed=0)
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return model, dims, sd


@pytest.fixture(scope="module")
def probe(random_model):
    """Reference outputs of the random openai-whisper model on a random mel and token prefix."""
    model, _, _ = random_model
    torch.manual_seed(1)
    mel = torch.randn(1, 80, 3000)
    tokens = torch.tensor([[50257, 50362, 1000, 2000, 3000]])
    with torch.no_grad():
        feats = model.encoder(mel)
        logits = model.decoder(tokens, feats)
    return mel, tokens, feats, logits


def forward(ckpt: wc.WhisperCheckpoint, mel, tokens):
    dims = WhisperDims.from_state_dict(ckpt.state_dict, ckpt.n_audio_head, ckpt.n_text_head)
    net = WhisperNet(WhisperWeights(ckpt.state_dict, dims))
    with torch.inference_mode():
        feats = net.encode(mel)
        cache = net.new_cache(net.cross_kv(feats))
        # prompt pass then one cached step, to cover the KV cache
        h1 = net.decode(tokens[:, :-1], 0, cache)
        h2 = net.decode(tokens[:, -1:], tokens.shape[1] - 1, cache)
        logits = net.logits(torch.cat([h1, h2], dim=1))
    return dims, feats, logits


def assert_same_forward(ckpt, probe, dims_ref, tol=1e-3):
    mel, tokens, feats_ref, logits_ref = probe
    dims, feats, logits = forward(ckpt, mel, tokens)
    assert dims.as_dict() == asdict(dims_ref)
    assert (feats - feats_ref).abs().max().item() < tol
    assert (logits - logits_ref).abs().max().item() < tol * 10
    assert torch.equal(logits.argmax(-1), logits_ref.argmax(-1))


def test_ct2_tiny_en_layout():
    ct2 = read_ctranslate2(tiny_en_path())
    assert ct2.binary_version == 6 and ct2.spec_name == "WhisperSpec"
    assert ct2.get("encoder/conv1/weight").shape == (384, 80, 3)
    assert ct2.get("encoder/conv2/weight").shape == (384, 384, 3)
    assert ct2.get("encoder/layer_0/self_attention/linear_0/weight").shape == (1152, 384)
    assert ct2.get("decoder/layer_3/attention/linear_1/weight").shape == (768, 384)
    assert ct2.get("decoder/embeddings/weight").shape == (51864, 384)
    assert ct2.get("decoder/projection/weight") is ct2.get("decoder/embeddings/weight")
    assert ct2.get("decoder/embeddings/weight").dtype == torch.float16
    assert int(ct2.get("decoder/num_heads")) == 6
    ckpt = wc.load_checkpoint_file(tiny_en_path())
    dims = WhisperDims.from_state_dict(ckpt.state_dict, ckpt.n_audio_head, ckpt.n_text_head)
    assert dims == WhisperDims(80, 1500, 384, 6, 4, 51864, 448, 384, 6, 4)
    assert name_from_dims(dims) == "whisper-tiny.en"
    # every openai-whisper parameter is provided, nothing extra
    ref = whisper.model.Whisper(whisper.model.ModelDimensions(**dims.as_dict()))
    assert set(ckpt.state_dict) == set(ref.state_dict())


@pytest.mark.parametrize("dtype, version, tol", [
    (torch.float32, 6, 1e-3), (torch.float16, 6, 2e-2), (torch.bfloat16, 6, 2e-1),
    (torch.float32, 3, 1e-3), (torch.float32, 1, 1e-3)])
def test_ct2_synthetic_matches_openai(tmp_path, random_model, probe, dtype, version, tol):
    model, dims, sd = random_model
    variables = openai_to_ct2_variables(sd, 2, 2, n_heads=2)
    if version < 4:   # old files had no int16 scalars worth keeping; heads come from d // 64
        variables = {k: v for k, v in variables.items() if not k.endswith("num_heads")}
    aliases = {"decoder/projection/weight": "decoder/embeddings/weight"}
    write_ct2(tmp_path, variables, dtype, version=version, aliases=aliases)
    ct2 = read_ctranslate2(tmp_path / "model.bin")
    assert ct2.binary_version == version
    assert ct2.get("encoder/conv1/weight").dtype == dtype
    ckpt = wc.load_checkpoint_file(tmp_path)
    if version < 4:
        ckpt.n_audio_head = ckpt.n_text_head = 2   # d 128 // 64 is 2 as well; be explicit
    if dtype == torch.float32:
        assert_same_forward(ckpt, probe, dims)
    else:   # weights rounded to 16 bits: compare with openai-whisper on the rounded weights
        rounded = {k: v.to(dtype).float() for k, v in sd.items()}
        ref = whisper.model.Whisper(dims).eval()
        ref.load_state_dict(rounded)
        mel, tokens, _, _ = probe
        with torch.no_grad():
            feats_ref = ref.encoder(mel)
            logits_ref = ref.decoder(tokens, feats_ref)
        assert_same_forward(ckpt, (mel, tokens, feats_ref, logits_ref), dims, tol=1e-3)


def test_ct2_int8_is_refused_with_clear_error(tmp_path, random_model):
    _, _, sd = random_model
    variables = openai_to_ct2_variables(sd, 2, 2, n_heads=2)
    w = variables["encoder/layer_0/ffn/linear_0/weight"]
    scale = w.abs().amax(dim=1) / 127
    variables["encoder/layer_0/ffn/linear_0/weight"] = (w / scale[:, None]).round().to(torch.int8)
    variables["encoder/layer_0/ffn/linear_0/weight_scale"] = scale
    write_ct2(tmp_path, variables)
    with pytest.raises(UnsupportedQuantization, match="int8.*not yet supported"):
        wc.load_checkpoint_file(tmp_path)
    raw = read_ctranslate2(tmp_path, allow_quantized=True)
    assert raw.get("encoder/layer_0/ffn/linear_0/weight").dtype == torch.int8


def test_hf_safetensors_matches_openai(tmp_path, random_model, probe):
    from safetensors.torch import save_file
    _, dims, sd = random_model
    hf = openai_to_hf(sd)
    hf.pop("proj_out.weight")   # tied; safetensors refuses shared storage
    save_file(hf, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(
        {"encoder_attention_heads": 2, "decoder_attention_heads": 2, "d_model": 128}))
    ckpt = wc.load_checkpoint_file(tmp_path)
    assert ckpt.fmt == "hf"
    assert_same_forward(ckpt, probe, dims)
    # a single .safetensors file, and a sharded checkpoint with an index
    assert_same_forward(wc.load_checkpoint_file(tmp_path / "model.safetensors"), probe, dims)
    shard_dir = tmp_path / "sharded"
    shard_dir.mkdir()
    keys = sorted(hf)
    halves = {"model-00001-of-00002.safetensors": keys[::2],
              "model-00002-of-00002.safetensors": keys[1::2]}
    weight_map = {}
    for fname, names in halves.items():
        save_file({k: hf[k] for k in names}, str(shard_dir / fname))
        weight_map.update({k: fname for k in names})
    (shard_dir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    assert_same_forward(wc.load_checkpoint_file(shard_dir), probe, dims)


def test_openai_pt_matches_openai(tmp_path, random_model, probe):
    _, dims, sd = random_model
    torch.save({"dims": asdict(dims), "model_state_dict": sd}, tmp_path / "tiny-random.pt")
    ckpt = wc.load_checkpoint_file(tmp_path / "tiny-random.pt")
    assert ckpt.fmt == "openai" and ckpt.n_audio_head == 2
    assert_same_forward(ckpt, probe, dims)


def test_pt_with_code_is_refused(tmp_path):
    class Evil:
        def __reduce__(self):
            return (print, ("executed",))
    torch.save({"model_state_dict": {}, "x": Evil()}, tmp_path / "evil.pt")
    with pytest.raises(Exception, match="(?i)weights_only|unsupported|global"):
        wc.load_checkpoint_file(tmp_path / "evil.pt")


def test_missing_model_error_says_where_and_how(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(wc.WhisperWeightsNotFound) as err:
        wc.resolve_whisper("openai/whisper-small")
    msg = str(err.value)
    assert "Hugging Face cache" in msg and str(tmp_path / "hub") in msg
    assert "hf download openai/whisper-small" in msg and "huggingface-cli" not in msg
    with pytest.raises(wc.WhisperWeightsNotFound, match="no Whisper weights found"):
        wc.load_checkpoint_file(tmp_path)


def test_resolution_package_and_hf_cache(tmp_path, monkeypatch):
    assert wc.resolve_whisper("whisper-tiny.en").path == tiny_en_path()
    assert wc.resolve_whisper("tiny.en").model_id == "whisper-tiny.en"
    snap = tmp_path / "hub" / "models--Systran--faster-whisper-tiny.en" / "snapshots" / "abc"
    snap.mkdir(parents=True)
    (snap / "model.bin").write_bytes(b"")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    found = wc.resolve_whisper("Systran/faster-whisper-tiny.en")
    assert found.path == snap and found.model_id == "whisper-tiny.en"


def test_multilingual_prompt_and_language_detection(tmp_path):
    """Multilingual layout (random weights): our SOT prompt and language detection agree with
    openai-whisper's, and a full transcribe runs through the detection path."""
    import numpy as np
    from whisper_fixtures import multilingual_tokenizer_json
    from photon_core.models.whisper import load_whisper

    model, dims = random_openai_model(seed=3, n_vocab=51865)
    torch.save({"dims": asdict(dims), "model_state_dict": model.state_dict()}, tmp_path / "m.pt")
    multilingual_tokenizer_json(tmp_path)
    ours = load_whisper(tmp_path, dtype="float32")
    ref_tok = whisper.tokenizer.get_tokenizer(multilingual=True, language="de", task="transcribe")
    assert ours.tokenizer.multilingual
    assert ours.tokenizer.sot_sequence("de") == list(ref_tok.sot_sequence)
    for name in ("eot", "sot", "sot_prev", "no_speech", "no_timestamps", "timestamp_begin"):
        assert getattr(ours.tokenizer, name) == getattr(ref_tok, name), name

    torch.manual_seed(0)
    mel = torch.randn(1, 80, 3000)
    with torch.no_grad():
        _, probs = model.detect_language(mel)
    assert ours.detect_language(ours.encode(mel)) == max(probs[0], key=probs[0].get)
    # without timestamps a random model cannot wander through many windows: one window, bounded
    result = ours.transcribe(np.random.default_rng(0).normal(0, 0.1, 16000).astype(np.float32),
                             temperature=0.0, timestamps=False)
    assert result["language"] in ours.tokenizer.languages
    assert ours.model_id == "whisper-d128"
