"""Fine-tuned Moondream 2 variants (LoRA adapters, photon_core/models/moondream/lora.py).

Against the public reference (vikhyat/moondream moondream/torch, MOONDREAM_REF_SRC; those tests skip
without it): a random adapter saved as the training code names it, found by its id in a Hugging Face
cache folder by the reference's own loader and by ours; the same greedy tokens and logits from both
decoders over an image-sized bidirectional prefix, a prompt and decode steps. Without the reference:
a zero adapter is exactly the base model, the adapter really changes the output, bad adapters are
named, ids and model names resolve as the reference and the client resolve them, files are read
without running code, and Moondream 3 and the megakernel backend refuse variants with the reason."""
from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # must precede the first import of triton (the Triton test runs on CPU)

import dataclasses  # noqa: E402
import pickle  # noqa: E402
import sys  # noqa: E402
import types  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from PIL import Image  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

import moondream_fixtures as mf  # noqa: E402
from photon_core.backends import reference as ref_ops  # noqa: E402
from photon_core.backends.select import get_backend  # noqa: E402
from photon_core.models.moondream import load_moondream, lora, text  # noqa: E402
from photon_core.models.moondream.config import MoondreamConfig  # noqa: E402

REF = os.environ.get("MOONDREAM_REF_SRC")
needs_ref = pytest.mark.skipif(not REF or not (Path(REF) / "moondream" / "torch" / "moondream.py").is_file(),
                               reason="set MOONDREAM_REF_SRC to a checkout of github.com/vikhyat/moondream")
VARIANT_ID = "01JTESTFINETUNE@250"
from moondream_fixtures import TRAINED_NAMES, lora_adapter as adapter  # noqa: E402,F401


def save_in_cache(hub: Path, variant_id: str, sd: dict) -> Path:
    folder = hub / "md_variants" / variant_id
    folder.mkdir(parents=True)
    torch.save(sd, folder / "final.pt")
    return folder / "final.pt"


def run(model, x: torch.Tensor, prompt: torch.Tensor, steps: int, variant, ragged: bool = False):
    """Prefill x [B, P, dim] (the image-sized prefix) and prompt ids [B, T], then greedy decode:
    (tokens [B, steps], logits [B, steps, vocab]); decode positions as a [B] tensor when ragged."""
    cfg, w = model.config.text, model.text_w
    cache = text.KVCache(cfg, 800, torch.float32, "cpu", batch=x.shape[0])
    text.forward(x, 0, w, cfg, cache, ref_ops, lora=variant)
    pos = x.shape[1]
    h = text.forward(text.embed(prompt, w), pos, w, cfg, cache, ref_ops, lora=variant)
    pos += prompt.shape[1]
    tokens, logits = [], []
    for _ in range(steps):
        lg = text.lm_logits(h[:, -1], w, ref_ops)
        tok = lg.argmax(-1)
        tokens.append(tok)
        logits.append(lg)
        at = torch.full((x.shape[0],), pos) if ragged else pos
        h = text.forward(text.embed(tok[:, None], w), at, w, cfg, cache, ref_ops, lora=variant)
        pos += 1
    return torch.stack(tokens, 1), torch.stack(logits, 1)


@pytest.fixture(scope="module")
def model():
    return load_moondream(mf.checkpoint("new", seed=7, object_bias=False, vision_layers=27))


@pytest.fixture(scope="module")
def inputs(model):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 733, model.config.text.dim, generator=g)   # past the 730-token bidirectional prefix
    prompt = torch.tensor([[1, 15, 16, 17], [1, 18, 12, 11]])
    return x, prompt


# ---------------------------------------------------------------- against the public reference

@pytest.fixture(scope="module")
def ref_model(model):
    saved = {k: v for k, v in sys.modules.items() if k == "moondream" or k.startswith("moondream.")}
    pkg = types.ModuleType("moondream")  # bypass the package __init__; load moondream.torch.* only
    pkg.__path__ = [str(Path(REF) / "moondream")]
    sys.modules["moondream"] = pkg
    import moondream.torch.image_crops as ric
    import moondream.torch.lora as rlora
    import moondream.torch.moondream as rmd
    import moondream.torch.text as rtext
    import moondream.torch.weights as rw
    from moondream.torch.config import MoondreamConfig as RConfig
    mp = pytest.MonkeyPatch()
    mp.setattr(rmd, "Tokenizer", types.SimpleNamespace(from_pretrained=lambda name: mf.build_tokenizer()))

    # The reference's own crops, as in test_moondream_reference: PIL's resize (not pyvips), its
    # bfloat16-normalised crops cast for the float32 model.
    mp.setattr(ric, "HAS_VIPS", False)
    mp.setattr(ric, "Image", Image, raising=False)
    ref_prepare = rmd.prepare_crops

    def prepare_crops(image, config, device):
        crops, tiling = ref_prepare(image, config, device)
        return crops.to(torch.float32), tiling

    mp.setattr(rmd, "prepare_crops", prepare_crops)
    ref = rmd.MoondreamModel(RConfig.from_dict(mf.small_config(vision_layers=27)), dtype=torch.float32)
    rw.load_weights_into_model(str(mf.checkpoint("new", seed=7, object_bias=False, vision_layers=27)
                                   / "model.safetensors"), ref)
    yield types.SimpleNamespace(model=ref, lora=rlora, text=rtext)
    mp.undo()
    for k in [k for k in sys.modules if k == "moondream" or k.startswith("moondream.")]:
        del sys.modules[k]
    sys.modules.update(saved)


def ref_run(ref, x: torch.Tensor, prompt: torch.Tensor, steps: int, lora_tree):
    """The reference's own prefill/decode (MoondreamModel._prefill / _decode_one_tok), one row."""
    m = ref.model
    p = x.shape[1]
    m._prefill(x, m.attn_mask[:, :, :p, :], torch.arange(p), lora_tree)
    emb = ref.text.text_encoder(prompt, m.text)
    t = prompt.shape[1]
    logits, _ = m._decode_one_tok(emb, m.attn_mask[:, :, p:p + t, :], torch.arange(p, p + t), lora_tree)
    pos, tokens, all_logits = p + t, [], []
    for _ in range(steps):
        tok = logits.argmax(-1)
        tokens.append(tok)
        all_logits.append(logits)
        emb = ref.text.text_encoder(tok[:, None], m.text)
        logits, _ = m._decode_one_tok(emb, m.attn_mask[:, :, pos:pos + 1, :], torch.tensor([pos]), lora_tree)
        pos += 1
    return torch.stack(tokens, 1), torch.stack(all_logits, 1)


@needs_ref
def test_variant_matches_the_reference(model, ref_model, inputs, tmp_path, monkeypatch):
    """One final.pt in a Hugging Face cache, found by id by both loaders; identical greedy tokens and
    logits within 1e-5, one request at a time and two decoded together (per-row positions)."""
    save_in_cache(tmp_path / "hub", VARIANT_ID, adapter(model.config.text, rank=4, seed=11))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    ref_model.lora.variant_state_dict.cache_clear()
    tree = ref_model.lora.variant_state_dict(VARIANT_ID)   # its own cache lookup: the file exists, no download
    ours = lora.variant_for(model, VARIANT_ID)
    x, prompt = inputs
    steps = 6
    with torch.inference_mode():
        tok_ours, lg_ours = run(model, x, prompt, steps, ours)
        tok_ragged, lg_ragged = run(model, x, prompt, steps, ours, ragged=True)
        tok_base, _ = run(model, x, prompt, steps, None)
        for b in range(x.shape[0]):
            tok_ref, lg_ref = ref_run(ref_model, x[b:b + 1], prompt[b:b + 1], steps, tree)
            assert tok_ours[b].tolist() == tok_ref[0].tolist() == tok_ragged[b].tolist()
            torch.testing.assert_close(lg_ours[b], lg_ref[0], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(lg_ragged[b], lg_ref[0], rtol=1e-5, atol=1e-5)
    assert not torch.equal(tok_ours, tok_base)   # the adapter matters: the comparison is not of base models


@needs_ref
def test_query_with_a_variant_matches_the_reference(model, ref_model, tmp_path, monkeypatch):
    """End to end: settings={"variant": id} on query (the image prefill adapted too, as the
    reference's encode_image does) gives the reference's greedy answer, which differs from the base's."""
    save_in_cache(tmp_path / "hub", VARIANT_ID, adapter(model.config.text, rank=4, seed=11))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    ref_model.lora.variant_state_dict.cache_clear()
    y, x = np.mgrid[0:300, 0:520]
    picture = np.stack([(x * 3) % 256, (y * 5) % 256, (x + 2 * y) % 256], -1).astype(np.uint8)
    answers = []
    for variant in (VARIANT_ID, None):
        settings = {"temperature": 0, "max_tokens": 8, "variant": variant}
        enc = ref_model.model.encode_image(Image.fromarray(picture), settings={"variant": variant})
        want = ref_model.model.query(enc, "what is this ?", settings=settings)["answer"]
        assert model.query(picture, "what is this ?", settings=settings)["answer"] == want
        answers.append(want)
    assert answers[0] != answers[1] and len(answers[0].split()) == 8


# ---------------------------------------------------------------- without the reference

def test_zero_adapter_is_the_base_model_exactly(model, inputs, tmp_path):
    """B = 0: every delta is exactly zero, so outputs equal the base model's bit for bit; and a
    nonzero adapter changes them (the path is taken)."""
    x, prompt = inputs
    path = tmp_path / "zero.pt"
    torch.save(adapter(model.config.text, zero_b=True), path)
    zero = lora.variant_for(model, str(path))
    path2 = tmp_path / "live.safetensors"
    save_file(adapter(model.config.text, seed=2, trained_names=False), str(path2))
    live = lora.variant_for(model, str(path2))
    with torch.inference_mode():
        tok_base, lg_base = run(model, x, prompt, 3, None, ragged=True)
        tok_zero, lg_zero = run(model, x, prompt, 3, zero, ragged=True)
        _, lg_live = run(model, x, prompt, 3, live, ragged=True)
    assert torch.equal(lg_zero, lg_base) and torch.equal(tok_zero, tok_base)
    assert (lg_live - lg_base).abs().max() > 0.1


def test_an_image_encoded_for_one_variant_is_refused_by_another(model, tmp_path):
    """An EncodedImage's cache is the prefill of its variant's adapter: a request of another variant
    (or the base model) refuses it rather than continue another model's cache; its own answers as
    the image itself does."""
    path = tmp_path / "live.safetensors"
    save_file(adapter(model.config.text, seed=2, trained_names=False), str(path))
    name, pic = str(path), np.random.default_rng(0).integers(0, 256, (64, 80, 3), dtype=np.uint8)
    base, tuned = model.encode_image(pic), model.encode_image(pic, settings={"variant": name})
    assert (base.variant, tuned.variant) == (None, name)
    with pytest.raises(ValueError, match="encoded with the base model but the request asks for variant"):
        model.point(base, "cup", settings={"variant": name})
    with pytest.raises(ValueError, match="encoded with variant .* but the request asks for the base model"):
        model.query(tuned, "What is it?", settings={"max_tokens": 2})
    assert model.point(tuned, "cup", settings={"variant": name}) == model.point(pic, "cup", settings={"variant": name})


def test_triton_backend_serves_variants():
    """The adapted decoder on the per-op Triton backend (CPU interpreter) against the reference ops:
    a prefill with a bidirectional prefix, then ragged decode steps of two rows."""
    cfg = mf.small_config()
    cfg["text"]["vocab_size"] = 256
    sd = mf.random_state(cfg, seed=9, object_bias=False)
    # A 4-token prefix instead of 730 keeps the interpreter fast (decoder only: no image grid here).
    text_cfg = dataclasses.replace(MoondreamConfig.from_dict(cfg).text, prefix_attn=4, max_context=64)
    w = text.TextWeights.from_state(sd, text_cfg)
    variant = lora.build_variant(lora.reference_names(adapter(text_cfg, seed=3)), text_cfg, torch.float32, "cpu")
    x = torch.randn(2, 6, text_cfg.dim, generator=torch.Generator().manual_seed(0))
    steps = torch.randn(2, 2, text_cfg.dim, generator=torch.Generator().manual_seed(1))
    outs = []
    for ops in (ref_ops, get_backend("triton", "cpu")):
        cache = text.KVCache(text_cfg, 10, torch.float32, "cpu", batch=2)
        h = [text.forward(x, 0, w, text_cfg, cache, ops, lora=variant)]
        for s in range(2):   # ragged decode (per-row positions), as batched requests run
            pos = torch.tensor([6 + s, 6 + s])
            h.append(text.forward(steps[:, s:s + 1], pos, w, text_cfg, cache, ops, lora=variant))
        outs.append(torch.cat([t.reshape(-1, text_cfg.dim) for t in h]))
    base_cache = text.KVCache(text_cfg, 10, torch.float32, "cpu", batch=2)
    base = text.forward(x, 0, w, text_cfg, base_cache, ref_ops)
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-4, atol=1e-4)
    assert (outs[0][:12] - base.reshape(-1, text_cfg.dim)).abs().max() > 0.1


def test_files_folders_and_ids_resolve_and_loads_are_shared(model, tmp_path, monkeypatch):
    sd = adapter(model.config.text, seed=4)
    hub = tmp_path / "home" / "hub"
    cached = save_in_cache(hub, VARIANT_ID, sd)
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    by_id = lora.variant_for(model, VARIANT_ID)
    assert by_id.source == cached and by_id.rank == 4 and len(by_id.layers) == model.config.text.n_layers
    assert lora.variant_for(model, VARIANT_ID) is by_id                 # several requests, one load
    assert lora.variant_for(model, str(cached.parent)) is by_id         # the same file by its folder
    assert lora.variant_for(model, None) is None
    st = tmp_path / "st"
    st.mkdir()
    save_file({k: v.contiguous() for k, v in sd.items()}, str(st / "adapter.safetensors"))
    from_st = lora.variant_for(model, str(st))
    assert from_st is not by_id and from_st.source == st / "adapter.safetensors"
    for mine, theirs in zip(from_st.layers, by_id.layers):
        assert torch.equal(mine.fc2.b, theirs.fc2.b) and torch.equal(mine.qkv.a, theirs.qkv.a)
    layer0 = by_id.layers[0]
    want = sd["text_model.transformer.h.0.mixer.out_proj.parametrizations.weight.0.A"]
    assert torch.equal(layer0.proj.a, want) and layer0.proj.a.dtype == model.dtype
    torch.save(adapter(model.config.text, seed=5), cached)               # rewritten on disk: read again
    os.utime(cached, ns=(1, 1))
    assert lora.variant_for(model, VARIANT_ID) is not by_id


def test_missing_id_says_where_it_looked_and_how_to_get_it(model, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(ValueError) as err:
        lora.variant_for(model, "01JNOTTHERE@10")
    msg = str(err.value)
    assert str(tmp_path / "hub" / "md_variants" / "01JNOTTHERE@10" / "final.pt") in msg
    assert "does not download" in msg and "/v1/variants/" in msg
    with pytest.raises(ValueError, match="no such file or folder .and not a variant id"):
        lora.variant_for(model, str(tmp_path / "nowhere" / "adapter.pt"))
    with pytest.raises(ValueError, match="empty"):
        lora.variant_for(model, "")
    with pytest.raises(TypeError):
        lora.variant_for(model, 5)


def test_bad_adapters_are_named(model, tmp_path):
    cfg = model.config.text

    def fails(sd, pattern):
        path = tmp_path / f"bad{len(list(tmp_path.iterdir()))}.pt"
        torch.save(sd, path)
        with pytest.raises(ValueError, match=pattern):
            lora.variant_for(model, str(path))

    sd = adapter(cfg, trained_names=False)
    sd["text.blocks.1.mlp.fc2.A"] = torch.zeros(4, cfg.dim)                      # fc2 reads ff_dim features
    fails(sd, r"text\.blocks\.1\.mlp\.fc2\.A has shape \(4, 128\), expected \('rank', 256\)")
    sd = adapter(cfg, trained_names=False)
    del sd["text.blocks.0.attn.proj.B"]
    fails(sd, r"missing \['text\.blocks\.0\.attn\.proj\.B'\]")
    sd = adapter(cfg, trained_names=False)
    sd["text.blocks.2.attn.qkv.A"] = torch.zeros(4, cfg.dim)                     # a third block: another model
    fails(sd, r"unexpected \['text\.blocks\.2\.attn\.qkv\.A'\]")
    sd = adapter(cfg, trained_names=False)
    sd["text.blocks.0.mlp.fc1.B"] = torch.zeros(cfg.ff_dim, 8)
    fails(sd, r"text\.blocks\.0\.mlp\.fc1: A has rank 4, B has rank 8")
    fails([1, 2], "flat dict of named tensors")
    (tmp_path / "adapter.txt").write_text("x")
    with pytest.raises(ValueError, match=r"\.safetensors"):
        lora.variant_for(model, str(tmp_path / "adapter.txt"))


class _RunsCode:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.mkdir, (str(self.marker),)


def test_a_pickle_with_code_is_refused_and_not_run(model, tmp_path):
    marker = tmp_path / "ran"
    path = tmp_path / "final.pt"
    with open(path, "wb") as f:
        pickle.dump({"text.blocks.0.attn.qkv.A": _RunsCode(marker)}, f, protocol=2)
    with pytest.raises(ValueError, match="weights_only=True"):
        lora.variant_for(model, str(tmp_path))
    assert not marker.exists()
    torch.save({"x": _RunsCode(marker)}, path)                                  # torch's zip format too
    with pytest.raises(ValueError, match="weights_only=True"):
        lora.variant_for(model, str(path))
    assert not marker.exists()


def test_moondream3_and_the_megakernel_refuse_variants(model, tmp_path):
    import test_moondream3_checkpoints as ck
    from photon_core.models.moondream3 import text as md3_text

    with pytest.raises(NotImplementedError, match="Moondream 2 only.*kestrel"):
        lora.variant_for(ck.model(), VARIANT_ID)
    m3 = ck.model()
    with pytest.raises(NotImplementedError, match="not supported on Moondream 3"):
        md3_text.forward(torch.zeros(1, 1, m3.config.text.dim), 0, m3.text_w, m3.config.text,
                         text.KVCache(m3.config.text, 4, torch.float32, "cpu"), m3.ops, lora=object())
    compiled = load_moondream(mf.checkpoint("new", seed=7, object_bias=False, vision_layers=27))
    compiled.decode = object()   # what the megakernel backend sets: its compiled decode step
    with pytest.raises(NotImplementedError, match="megakernel backend"):
        lora.variant_for(compiled, VARIANT_ID)
