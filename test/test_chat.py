"""chat() in the moondream client's shape (runtime.chat_messages) on Qwen 3.5 and Gemma 4: multi-turn
conversations (system, images, earlier assistant turns) rendered by transformers' own chat template
code and decoded greedily by transformers on the same tiny random checkpoints give the tokens
ours give; streaming gives the same content; reasoning is split off; bad messages are refused."""
from __future__ import annotations

import base64
import io

import pytest
import torch
from PIL import Image
from test_gemma4_fixtures import EOS, gemma4_dir, gemma4_hf  # noqa: F401
from test_gemma4_text import banned_mask, hf_greedy

import test_qwen3_5_fixtures as qfx
from photon_core import client as md
from photon_core.models.gemma4 import load_gemma4
from photon_core.models.qwen3_5 import load_qwen3_5, prompt
from photon_core.runtime import chat_messages


def _hf_tokenizer(folder, **specials):
    from transformers import PreTrainedTokenizerFast
    tok = PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"), **specials)
    tok.chat_template = (folder / "chat_template.jinja").read_text()
    return tok


def _for_hf(messages):
    """The same conversation as transformers' templates take it: image parts as {"type": "image"}."""
    return [{**m, "content": m["content"] if isinstance(m["content"], str) else
             [{"type": "image"} if p["type"] != "text" else p for p in m["content"]]} for m in messages]


def _expected(decode, tokens, stops, n):
    """The reply transformers' greedy tokens make: text up to the first stop token."""
    cut = next((i for i, t in enumerate(tokens) if t in stops), None)
    text = decode(tokens[:cut] if cut is not None else tokens[:n])
    return {"message": {"role": "assistant", "content": text},
            "finish_reason": "stop" if cut is not None and cut < n else "length"}


# ------------------------------------------------------------------------------------------ Qwen 3.5

@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen3_5_chat")
    hf = qfx.build(folder, "deltas3", seed=1)
    return hf, load_qwen3_5(folder), folder


def _qwen_hf_reply(hf, model, folder, messages, images, n, thinking=False):
    from transformers import Qwen2VLImageProcessorPil

    text = _hf_tokenizer(folder).apply_chat_template(_for_hf(messages), add_generation_prompt=True,
                                                     tokenize=False, enable_thinking=thinking)
    ids = model.prompts.tokenizer.encode(text, add_special_tokens=False).ids
    pp, extra = model.preprocess, {}
    if images:
        inputs = Qwen2VLImageProcessorPil(patch_size=pp.patch, temporal_patch_size=pp.temporal_patch,
                                          merge_size=pp.merge, image_mean=list(pp.mean), image_std=list(pp.std),
                                          size={"shortest_edge": pp.min_pixels, "longest_edge": pp.max_pixels})(
            images=images, return_tensors="pt")
        counts = [int(g.prod()) // pp.merge ** 2 for g in inputs["image_grid_thw"]]
        ids = prompt.expand_images(ids, model.config.image_token_id, counts)
        extra = dict(pixel_values=inputs["pixel_values"], image_grid_thw=inputs["image_grid_thw"])
    ids_t = torch.tensor([ids])
    if extra:
        extra["mm_token_type_ids"] = (ids_t == model.config.image_token_id).int()
    with torch.no_grad():
        out = hf.generate(input_ids=ids_t, max_new_tokens=n, do_sample=False, pad_token_id=qfx.VOCAB - 1,
                          eos_token_id=sorted(model.prompts.stop_ids), **extra)
    return _expected(model.prompts.decode, out[0, len(ids):].tolist(), model.prompts.stop_ids, n)


def test_qwen_conversation_matches_transformers(qwen):
    hf, model, folder = qwen
    a, b = qfx.image(48, 64, seed=5), qfx.image(40, 40, seed=6)
    messages = [{"role": "system", "content": "the quick brown fox"},
                {"role": "user", "content": [{"type": "image", "image": a}, {"type": "text", "text": "what is this?"}]},
                {"role": "assistant", "content": "a lazy dog"},
                {"role": "user", "content": [{"type": "text", "text": "and this one?"}, {"type": "image", "image": b}]}]
    want = _qwen_hf_reply(hf, model, folder, messages, [a, b], 8)
    got = model.chat(messages, settings={"max_tokens": 8}, reasoning=False)
    assert got == want
    text_only = [{"role": "user", "content": "describe the fox"}]
    plain = model.chat(text_only, settings={"max_tokens": 10}, reasoning=False)
    assert plain == _qwen_hf_reply(hf, model, folder, text_only, [], 10)
    streamed = model.chat(text_only, stream=True, settings={"max_tokens": 10}, reasoning=False)
    assert set(streamed) == {"message"} and "".join(streamed["message"]) == plain["message"]["content"]
    # The client hands chat to the model; a data: URL image part is the same picture.
    buf = io.BytesIO()
    Image.fromarray(a).save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    as_url = [messages[0], {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                        {"type": "text", "text": "what is this?"}]}]
    client = md.photon(str(folder), device="cpu")
    assert client.supports("chat")
    assert client.chat(as_url, settings={"max_tokens": 8}, reasoning=False) == \
        model.chat(messages[:2], settings={"max_tokens": 8}, reasoning=False)
    # Thinking (Qwen's default): the reply up to "</think>" is the reasoning, the rest the content.
    full = _qwen_hf_reply(hf, model, folder, text_only, [], 10, thinking=True)
    reasoning, _, content = full["message"]["content"].partition("</think>")
    want = {"role": "assistant", "content": content} | ({"reasoning": reasoning} if reasoning else {})
    assert model.chat(text_only, settings={"max_tokens": 10}) == {"message": want,
                                                                  "finish_reason": full["finish_reason"]}


def test_chat_errors(qwen):
    _, model, folder = qwen
    for bad, why in (([], "non-empty"), ([{"role": "user", "content": "a"}, {"role": "system", "content": "b"}],
                                         "first message"),
                     ([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}], "last message"),
                     ([{"role": "robot", "content": "a"}], "role"), ([{"role": "user", "content": ""}], "text or"),
                     ([{"role": "user", "content": [{"type": "audio"}]}], "content parts"),
                     ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}],
                      "data: URL")):
        with pytest.raises(ValueError, match=why):
            model.chat(bad)
    with pytest.raises(TypeError, match="max_objects"):
        model.chat([{"role": "user", "content": "hi"}], settings={"max_objects": 2})
    with pytest.raises(TypeError, match="max_tokens"):   # checked as every skill's settings (Settings.of)
        model.chat([{"role": "user", "content": "hi"}], settings={"max_tokens": "8"})
    with pytest.raises(NotImplementedError, match="variants"):
        md.photon(f"{folder}/ft1@3", device="cpu").chat([{"role": "user", "content": "hi"}])


def test_reply_splits_reasoning_from_content():
    words = {1: "let", 2: " me", 3: " think", 9: "</think>", 4: "\n\nyes", 5: " indeed"}

    def decode(ids):
        return "".join(words[i] for i in ids)
    by_id = chat_messages.reply(iter([1, 2, 3, 9, 4, 5]), decode, room=10, stream=False, end_of_reasoning=9)
    assert by_id == {"message": {"role": "assistant", "content": "\n\nyes indeed", "reasoning": "let me think"},
                     "finish_reason": "stop"}
    by_text = chat_messages.reply(iter([1, 2, 3, 9, 4, 5]), decode, room=6, stream=False, end_of_reasoning="</think>")
    assert by_text == {**by_id, "finish_reason": "length"}
    streamed = chat_messages.reply(iter([1, 2, 3, 9, 4, 5]), decode, room=6, stream=True, end_of_reasoning=9)
    assert list(streamed["message"]) == ["\n\nyes", " indeed"]
    cut = chat_messages.reply(iter([1, 2]), decode, room=2, stream=False, end_of_reasoning=9)
    assert cut == {"message": {"role": "assistant", "content": "", "reasoning": "let me"}, "finish_reason": "length"}


# ------------------------------------------------------------------------------------------ Gemma 4

def test_gemma_conversation_matches_transformers(gemma4_dir, gemma4_hf):  # noqa: F811
    model = load_gemma4(gemma4_dir)
    messages = [{"role": "system", "content": "the cat sat on the mat"},
                {"role": "user", "content": "what is in this image?"},
                {"role": "assistant", "content": "a red car"},
                {"role": "user", "content": [{"type": "text", "text": "hello world"}]}]
    text = _hf_tokenizer(gemma4_dir, bos_token="<bos>").apply_chat_template(
        _for_hf(messages), add_generation_prompt=True, tokenize=False)
    ids = model.prompter.encode(text)
    _, toks = hf_greedy(gemma4_hf, ids, 10, banned_mask(model))
    want = _expected(model.prompter.decode, toks, model.eos_ids, 10)
    assert model.chat(messages, settings={"max_tokens": 10}) == want
    assert "".join(model.chat(messages, stream=True, settings={"max_tokens": 10})["message"]) == \
        want["message"]["content"]
    # One user turn with an image is the query prompt (checked against transformers in test_gemma4_vision).
    image = qfx.image(40, 56, seed=3)
    one = model.chat([{"role": "user", "content": [{"type": "image", "image": image},
                                                   {"type": "text", "text": "what is this?"}]}],
                     settings={"max_tokens": 8})
    greedy = {"temperature": 0, "max_tokens": 8}
    assert one["message"]["content"] == model.query(image, "what is this?", settings=greedy)["answer"]
    with pytest.raises(ValueError, match="no thinking mode"):
        model.chat(messages, reasoning=True)


def _png_header(width: int, height: int) -> str:
    """A data URL of a PNG that declares width x height and holds no pixels (PIL reads the size
    from the header; a decode would be the harm)."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    png = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)) + chunk(b"IEND", b"")
    return "data:image/png;base64," + base64.b64encode(png).decode()


@pytest.mark.parametrize("width, height", [(10_000, 10_000), (15_000, 13_000)])
def test_a_huge_image_url_is_refused_before_its_pixels_are_decoded(width, height):
    # 100 Mpixel: over our limit (PIL only warns); 195 Mpixel: PIL's own refusal, as a ValueError too
    with pytest.raises(ValueError, match="over the limit|too large"):
        chat_messages.image_from_url(_png_header(width, height))


def test_image_urls_with_line_breaks_read_and_other_urls_say_what_they_must_be():
    """MIME base64 breaks its lines, and a URL pasted from a file ends in a newline: no data (they
    were refused as 'excess data'); a data URL without ;base64 is refused saying so."""
    import io

    from PIL import Image
    buf = io.BytesIO()
    Image.new("RGB", (4, 3), (10, 20, 30)).save(buf, "PNG")
    b64 = base64.b64encode(buf.getvalue()).decode()
    for url in (f"data:image/png;base64,{b64}\n", "data:image/png;base64," + "\r\n".join(
            b64[i:i + 76] for i in range(0, len(b64), 76)), f" data:image/png;base64,{b64}"):
        assert chat_messages.image_from_url(url).size == (4, 3)
    with pytest.raises(ValueError, match="base64 data: URL.*got 'data:image/png'"):
        chat_messages.image_from_url("data:image/png,%89PNG")
