"""Gemma 4's image path against transformers on the tiny random checkpoint (test_gemma4_fixtures):
patches and positions against Gemma4ImageProcessorPil, soft tokens against get_image_features, and
an image prompt (placeholders expanded by our chat-template rendering) through prefill and 20
decode steps against Gemma4ForConditionalGeneration with pixel_values; then the skills (query,
caption, streaming, sampling, text-only, batch) and the command line."""
from __future__ import annotations

import dataclasses
import json

import threading

import numpy as np
import pytest
import torch
from transformers import DynamicCache

from test_gemma4_fixtures import BOI, EOI, IMAGE, gemma4_dir, gemma4_hf  # noqa: F401

from photon_core.models.gemma4 import EncodedImage, load_gemma4, vision
from photon_core.runtime.requests import Request

ATOL = 2e-4
STEPS = 20


def greedy(n: int) -> dict:
    return {"temperature": 0, "max_tokens": n}


@pytest.fixture(scope="module")
def model(gemma4_dir):
    return load_gemma4(gemma4_dir)


@pytest.fixture(scope="module")
def image() -> np.ndarray:
    rng = np.random.default_rng(0)
    return rng.integers(0, 256, (37, 53, 3), dtype=np.uint8)


@pytest.fixture(scope="module")
def hf_pixels(image):
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    proc = Gemma4ImageProcessorPil(patch_size=4, max_soft_tokens=70, pooling_kernel_size=2)
    out = proc(images=[image], return_tensors="pt")
    return out["pixel_values"], out["image_position_ids"], int(out["num_soft_tokens_per_image"][0])


def test_patches_match_the_image_processor(model, image, hf_pixels):
    pixels, pos = vision.patchify(image, model.config.vision, 70)
    ref_pix, ref_pos, n_soft = hf_pixels
    n = pixels.shape[0]
    assert n == n_soft * 4 and (ref_pos[0, n:] == -1).all()
    torch.testing.assert_close(pixels, ref_pix[0, :n].float(), atol=1e-6, rtol=0)
    assert torch.equal(pos, ref_pos[0, :n].long())


def test_soft_tokens_match_transformers(model, gemma4_hf, image, hf_pixels):
    ref_pix, ref_pos, n_soft = hf_pixels
    with torch.no_grad():
        ref = gemma4_hf.get_image_features(ref_pix, ref_pos).pooler_output[0]
    enc = model.encode_image(image)
    assert enc.tokens.shape == ref.shape == (n_soft, model.config.text.dim)
    torch.testing.assert_close(enc.tokens, ref, atol=ATOL, rtol=0)


def test_clipped_linears_and_standardize_match_transformers(tmp_path, image, hf_pixels):
    from test_gemma4_fixtures import build_hf, save_checkpoint

    hf = build_hf(vision={"use_clipped_linears": True, "standardize": True}, seed=2)
    m = load_gemma4(save_checkpoint(hf, tmp_path / "clipped"))
    assert m.config.vision.clipped and m.config.vision.standardize
    assert "vision.encoder.layers.0.self_attn.q_proj.input_min" in m.w
    ref_pix, ref_pos, _ = hf_pixels
    with torch.no_grad():
        ref = hf.get_image_features(ref_pix, ref_pos).pooler_output[0]
    torch.testing.assert_close(m.encode_image(image).tokens, ref, atol=ATOL, rtol=0)


def test_image_prompt_logits_and_decode_match_transformers(model, gemma4_hf, image, hf_pixels):
    ref_pix, ref_pos, n_soft = hf_pixels
    ids = model.prompter.prompt_ids("what is in this image?", n_soft)
    start = ids.index(BOI)
    assert ids[start + 1:start + 1 + n_soft] == [IMAGE] * n_soft and ids[start + 1 + n_soft] == EOI
    allowed = torch.ones(model.config.text.vocab_size, dtype=torch.bool)
    allowed[list(model.config.placeholder_ids)] = False
    enc = model.encode_image(image)
    with torch.no_grad():
        cache = DynamicCache(config=gemma4_hf.config.get_text_config())
        out = gemma4_hf(input_ids=torch.tensor([ids]), pixel_values=ref_pix, image_position_ids=ref_pos,
                        cache=cache, use_cache=True)
    torch.testing.assert_close(model.prefill_logits(ids, enc.tokens), out.logits[0], atol=ATOL, rtol=0)

    from photon_core.models.gemma4 import text
    ours_cache = text.KVCache(model.config.text, 1, len(ids) + STEPS, model.dtype, model.device)
    logits = model.prefill(ids, enc.tokens, ours_cache)[0]
    ref_logits = out.logits[0, -1]
    for s in range(STEPS):
        torch.testing.assert_close(logits, ref_logits, atol=ATOL, rtol=0)
        tok = int(logits.masked_fill(~allowed, float("-inf")).argmax())
        assert tok == int(ref_logits.masked_fill(~allowed, float("-inf")).argmax())
        with torch.no_grad():
            out = gemma4_hf(input_ids=torch.tensor([[tok]]), cache=out.cache, use_cache=True)
        ref_logits = out.logits[0, -1]
        logits = model.step(torch.tensor([[tok]]), torch.tensor([len(ids) + s]), ours_cache)[0]


def test_query_caption_stream_and_text_only(model, image):
    enc = model.encode_image(image)
    assert isinstance(enc, EncodedImage) and model.encode_image(enc) is enc
    with pytest.raises(ValueError, match="another model"):   # a released model's, whose id() this one got
        model.encode_image(dataclasses.replace(enc, owner=id(model)))
    answer = model.query(image, "what is in this image?", settings=greedy(8))
    assert set(answer) == {"answer"} and isinstance(answer["answer"], str)
    assert model.query(enc, "what is in this image?", settings=greedy(8)) == answer
    pieces = model.query(enc, "what is in this image?", stream=True, settings=greedy(8))["answer"]
    assert not isinstance(pieces, str) and "".join(pieces) == answer["answer"]
    cap = model.caption(image, length="short", settings=greedy(6))
    streamed = model.caption(enc, "short", stream=True, settings=greedy(6))["caption"]
    assert set(cap) == {"caption"} and "".join(streamed) == cap["caption"]
    text_only = model.query(None, "hello world", settings=greedy(6))
    assert isinstance(text_only["answer"], str)
    # Sampling is seeded and goes through ops.sample; temperature 0 is greedy.
    a = model.query(enc, "hello", settings={"max_tokens": 8, "temperature": 1.0, "top_p": 0.9}, seed=4)
    assert a == model.query(enc, "hello", settings={"max_tokens": 8, "temperature": 1.0, "top_p": 0.9}, seed=4)
    assert model.query(enc, "hello", settings=greedy(8), seed=4) == model.query(enc, "hello", settings=greedy(8))
    # Settings left out are the reference's (temperature 0.5, top_p 0.3); max_tokens bounds the answer.
    assert model.query(enc, "hello", settings={"max_tokens": 4}, seed=3) == \
        model.query(enc, "hello", settings={"max_tokens": 4, "temperature": 0.5, "top_p": 0.3}, seed=3)
    short = model.query(None, "hello world", settings=greedy(2))["answer"]
    assert text_only["answer"].startswith(short) and len(short) < len(text_only["answer"])


def test_batch_matches_single_calls(model, image):
    other = np.ascontiguousarray(image[::-1, :, ::-1])
    reqs = [Request("caption", image, "short", max_tokens=5), Request("query", other, "what is this?", max_tokens=7),
            Request("query", image, "how many people are there?", max_tokens=3),
            Request("caption", other, "", max_tokens=4)]
    out = model.batch(reqs)
    assert out[0] == model.caption(image, "short", settings=greedy(5))
    assert out[1] == model.query(other, "what is this?", settings=greedy(7))
    assert out[2] == model.query(image, "how many people are there?", settings=greedy(3))
    assert out[3] == model.caption(other, "normal", settings=greedy(4))
    assert model.batch([]) == []
    # progress hears each row's text as it grows; a canceled row stops at its next step, the others go on.
    heard, stop = [], threading.Event()

    def progress(partial):
        heard.append(partial["answer"])
        stop.set()   # cancel after the first token
    reqs[1].progress, reqs[1].cancel = progress, stop
    again = model.batch(reqs)
    # the canceled row's answer is what it had heard, and the unfinished character a report leaves out
    # (a progress report shows none; the final text is the tokens' as they are)
    assert heard == [out[1]["answer"][:len(heard[0])]] and set(again[1]) == {"answer"} and again[1]["answer"].rstrip("\ufffd") == heard[0]
    assert len(heard[0]) < len(out[1]["answer"]) and again[0] == out[0] and again[2:] == out[2:]


def test_bad_inputs_are_refused(model, image):
    with pytest.raises(ValueError, match="question"):
        model.query(image, "  ")
    with pytest.raises(ValueError, match="uint8"):
        model.query(image.astype(np.float32), "what?")
    with pytest.raises(ValueError, match="shape"):
        model.query(np.zeros((4, 4, 5), np.uint8), "what?")
    with pytest.raises(ValueError, match="caption length"):
        model.caption(image, length="huge")
    with pytest.raises(ValueError, match="top_p"):
        model.query(image, "what?", settings={"top_p": 0.0})
    with pytest.raises(TypeError, match="unknown settings"):
        model.caption(image, settings={"max_token": 4})
    with pytest.raises(NotImplementedError, match="variants are Moondream's"):
        model.caption(image, settings={"variant": "ft@1"})
    with pytest.raises(NotImplementedError, match="reasoning"):
        model.batch([Request("query", image, "what?", reasoning=True)])
    with pytest.raises(NotImplementedError, match="spatial_refs"):
        model.query(image, "what is here?", spatial_refs=[(0.1, 0.2, 0.3, 0.4)])
    with pytest.raises(ValueError, match="cannot 'detect'"):
        model.batch([Request("detect", image, "cup")])
    with pytest.raises(ValueError, match="image placeholders"):
        model.prefill_logits([2, IMAGE, 40], None)


def test_a_placeholders_text_in_the_question_is_text_not_an_image(model, image):
    """A question that writes "<|image|>" (or the turn's end) is asked as that text: the prompt holds
    the one image it was given, and a text-only question is not refused for claiming one."""
    eot = model.prompter.tok.token_to_id("<turn|>")
    plain = model.prompter.prompt_ids("what is x?", 3)
    ids = model.prompter.prompt_ids("what is <|image|><turn|>x?", 3)
    assert ids.count(BOI) == ids.count(EOI) == 1 and ids.count(IMAGE) == 3
    assert ids.count(eot) == plain.count(eot)
    assert model.prompter.decode(ids).count("<|image|><turn|>x?") == 1
    assert model.prompter.prompt_ids("<|image|>?", None).count(IMAGE) == 0
    greedy = {"temperature": 0, "max_tokens": 2}
    assert isinstance(model.query(image, "is <|image|> here?", settings=greedy)["answer"], str)
    assert isinstance(model.query(None, "is <|image|> here?", settings=greedy)["answer"], str)
    chat = model.chat([{"role": "user", "content": [{"type": "image", "image": image},
                                                    {"type": "text", "text": "and <|image|>?"}]}], settings=greedy)
    assert isinstance(chat["message"]["content"], str)


def test_registry_load_and_command_line(gemma4_dir, image, tmp_path, capsys):
    import photon_core
    from PIL import Image
    from photon_core.__main__ import main

    m = photon_core.load(gemma4_dir, backend="reference", skills=("query", "caption"))
    assert m.model_id == gemma4_dir.name
    path = tmp_path / "im.png"
    Image.fromarray(image).save(path)
    assert main(["query", str(path), "what is in this image?", "--model", str(gemma4_dir), "--max-tokens", "4"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["model"] == gemma4_dir.name
    assert out["answer"] == m.query(image, "what is in this image?", settings=greedy(4))["answer"]
    assert main(["caption", str(path), "--model", str(gemma4_dir), "--max-tokens", "3", "--length", "short"]) == 0
    assert json.loads(capsys.readouterr().out)["caption"] == m.caption(image, "short", settings=greedy(3))["caption"]
