"""Moondream 3's skills end to end on tiny random checkpoints with the real tensor names, in both
shipped formats (model.safetensors, model_fp8.pt): result shapes, the same results from both files,
detect's region-head protocol written out by hand, the query prompt, and segment against its prompt
protocol (segment.py's docstring) with a scripted LM head."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import test_moondream3_checkpoints as ck
from test_moondream_skills import check_boxes_and_points, ramp_image
from photon_core.models.moondream import Request, skills
from photon_core.models.moondream3 import segment as seg
from photon_core.models.moondream3 import text as md3_text

# Moondream 3.1's coordinate = bin / 1023 (the last of its 1024 bins is 1.0), as the makers' engine
# decodes it: m87-labs/kestrel, kestrel/models/moondream/region.py, linspace(0, 1, 1024)[bin].
COORD_DIVISOR = 1023


@pytest.fixture(scope="module")
def model():
    return ck.model("safetensors")


@pytest.fixture(scope="module")
def image():
    return ramp_image(200, 300, 2)


@pytest.fixture(scope="module")
def enc(model, image):
    return model.encode_image(image)


def test_all_skills_well_formed(model, enc, image):
    check_boxes_and_points(model, enc, 3, 2)
    # The text skills on the checkpoint without the +coord bias: with it every answer token is a
    # coord, fed back as a region value and no text (as kestrel), so the answers would be empty.
    plain = ck.model("safetensors", object_bias=False)
    penc = plain.encode_image(image)
    cap = plain.caption(penc, length="short", settings={"temperature": 0, "max_tokens": 4})["caption"]
    assert isinstance(cap, str) and cap
    ans = plain.query(penc, "what is this ?", settings={"temperature": 0, "max_tokens": 4})["answer"]
    assert isinstance(ans, str) and ans
    turn = {"role": "user", "content": [{"type": "image", "image": penc}, {"type": "text", "text": "what is this ?"}]}
    reply = plain.chat([turn], settings={"temperature": 0, "max_tokens": 4, "reasoning": False})
    assert reply == {"message": {"role": "assistant", "content": ans}, "finish_reason": "length"}
    out = model.segment(enc, "cup", settings={"max_tokens": 6})
    assert set(out) >= {"path", "bbox"} and isinstance(out["path"], str)


def test_both_file_formats_give_the_same_results(model, image):
    pt = ck.model("pt")
    reqs = [Request("detect", image, "cup", max_objects=2), Request("point", image, "dog", max_objects=2),
            Request("caption", image, "short", max_tokens=3), Request("query", image, "what is this ?", max_tokens=3)]
    assert model.batch(reqs) == pt.batch(reqs)


def test_query_prompt_has_one_answer_marker(model):
    ids = model.tokenizer.encode("what is this ?")
    assert skills.query_prompt(model, "what is this ?") == [1, 15381, 2] + ids + [3]
    assert seg.segment_prompt(model, "robot") == [1, 17374, 2] + model.tokenizer.encode("robot") + [3]


def _plain_region(model, hidden: torch.Tensor, head: str) -> torch.Tensor:
    sd = ck.checkpoint("safetensors")[1]
    h = F.layer_norm(hidden, (hidden.shape[-1],), sd["region.ln.weight"], sd["region.ln.bias"])
    return h @ sd[f"region.{head}.weight"].T + sd[f"region.{head}.bias"]


def _plain_encode(sd, values: list[float], kind: str) -> torch.Tensor:
    feats = sd["region.coord_features"] if kind == "coord" else sd["region.size_features"]
    x = torch.tensor(values)[None] @ feats * 2 * torch.pi
    name = "region.coord_encoder" if kind == "coord" else "region.size_encoder"
    return torch.cat([x.cos(), x.sin()], -1) @ sd[name + ".weight"].T + sd[name + ".bias"]


def test_detect_follows_the_region_protocol(model, enc):
    """One box by hand: x from the region head on the prompt's last hidden state, fed back as an
    encoded coordinate; y from the next; then the size (log-scale bins); box = centre +- size/2;
    score = P(coord) among {coord, eos} of the LM head on that first hidden state."""
    sd = ck.checkpoint("safetensors")[1]
    prompt = skills.object_prompt(model, "detect", "cup")
    cache = md3_text.KVCache(model.config.text, enc.pos + len(prompt) + 3, torch.float32, "cpu")
    cache.k[:, :, :, :enc.pos], cache.v[:, :, :, :enc.pos] = enc.k, enc.v
    fwd = lambda emb, p: md3_text.forward(emb, p, model.text_w, model.config.text, cache, model.ops)[0, -1]  # noqa: E731
    h = fwd(md3_text.embed(torch.tensor([prompt]), model.text_w), enc.pos)
    lm = F.layer_norm(h, (h.shape[-1],), sd["text.post_ln.weight"], sd["text.post_ln.bias"]) @ sd["text.lm_head.weight"].T
    lm = lm + sd["text.lm_head.bias"]
    score = torch.softmax(lm[[model.config.tokenizer.coord_id, model.config.tokenizer.eos_id]].double(), 0)[0].item()
    x = int(_plain_region(model, h, "coord_head").argmax()) / COORD_DIVISOR
    h = fwd(_plain_encode(sd, [x], "coord")[None], enc.pos + len(prompt))
    y = int(_plain_region(model, h, "coord_head").argmax()) / COORD_DIVISOR
    h = fwd(_plain_encode(sd, [y], "coord")[None], enc.pos + len(prompt) + 1)
    bins = _plain_region(model, h, "size_head").view(2, -1).argmax(-1).tolist()
    w, hh = (2.0 ** (b / 1023 * 10 - 10) for b in bins)
    box = model.detect(enc, "cup", settings={"max_objects": 1})["objects"][0]
    want = {"x_min": x - w / 2, "y_min": y - hh / 2, "x_max": x + w / 2, "y_max": y + hh / 2}
    want = {k: min(max(v, 0.0), 1.0) for k, v in want.items()}
    assert box == pytest.approx({**want, "score": score}, abs=1e-6)


def test_segment_follows_its_prompt_protocol(model, enc, monkeypatch):
    """A scripted LM head (coord, coord, size, then path words, then eos): the box comes from the
    region head on the hidden states the protocol implies, the path from the words, and the inputs
    fed back (encoded coordinates and size, word embeddings) are what a single forward over the
    whole continuation sees."""
    tok = model.tokenizer
    words = ["M", "96", "192", "L", "-", "48", "960", "C", "1", "2", "3", "4", "5", "6", "z"]
    word_ids = [tok.encode(wd)[0] for wd in words]
    real = md3_text.lm_logits
    hiddens = _script(monkeypatch, model, [5, 5, 6] + word_ids + [0])
    out = model.segment(enc, "robot", settings={"max_tokens": 50})
    monkeypatch.setattr(md3_text, "lm_logits", real)
    assert out["path"] == "M 0.1 0.2 L -0.05 1 C 0.001 0.002 0.003 0.004 0.005 0.006 z"
    # Protocol by hand on one forward over prompt + everything fed back.
    sd = ck.checkpoint("safetensors")[1]
    prompt = seg.segment_prompt(model, "robot")
    x = int(_plain_region(model, hiddens[0][0], "coord_head").argmax()) / COORD_DIVISOR
    y = int(_plain_region(model, hiddens[1][0], "coord_head").argmax()) / COORD_DIVISOR
    bins = _plain_region(model, hiddens[2][0], "size_head").view(2, -1).argmax(-1).tolist()
    sw, sh = (2.0 ** (b / 1023 * 10 - 10) for b in bins)
    fed = torch.cat([md3_text.embed(torch.tensor([prompt]), model.text_w)[0], _plain_encode(sd, [x], "coord"),
                     _plain_encode(sd, [y], "coord"), _plain_encode(sd, [sw, sh], "size"),
                     md3_text.embed(torch.tensor(word_ids), model.text_w)])
    cache = md3_text.KVCache(model.config.text, enc.pos + fed.shape[0], torch.float32, "cpu")
    cache.k[:, :, :, :enc.pos], cache.v[:, :, :, :enc.pos] = enc.k, enc.v
    full = md3_text.forward(fed[None], enc.pos, model.text_w, model.config.text, cache, model.ops)[0]
    steps = torch.cat(hiddens)                       # the hidden state each LM-head call saw
    torch.testing.assert_close(steps, full[len(prompt) - 1:], rtol=1e-4, atol=1e-4)
    clamp = lambda v: min(max(v, 0.0), 1.0)  # noqa: E731
    assert out["bbox"] == pytest.approx({"x_min": clamp(x - sw / 2), "y_min": clamp(y - sh / 2),
                                         "x_max": clamp(x + sw / 2), "y_max": clamp(y + sh / 2)}, abs=1e-6)


def test_segment_path_words_and_errors(model, enc):
    assert seg.svg_path(["M", "0", "480", "l", "-", "960", "3", "7", "Z"]) == "M 0 0.5 l -1 0.003 Z"
    with pytest.raises(ValueError, match="expected a command"):
        seg.svg_path(["12", "M"])
    with pytest.raises(ValueError, match="expected an integer"):
        seg.svg_path(["M", "cup"])
    assert seg.bbox([0.5], []) is None
    assert seg.bbox([0.9, 0.1], [(0.4, 0.4)]) == pytest.approx({"x_min": 0.7, "y_min": 0.0, "x_max": 1.0, "y_max": 0.3})
    assert seg.path_words(model.tokenizer, [0, 5, 6] + model.tokenizer.encode("M 12")) == ["M", "12"]
    with pytest.raises(NotImplementedError, match="not supported yet"):
        model.segment(enc, "cup", refine=True)
    with pytest.raises(ValueError, match="non-empty"):
        model.segment(enc, " ")


def _script(monkeypatch, model, tokens: list[int]) -> list[torch.Tensor]:
    """Every LM-head call from now on picks the next of `tokens`; returns the hidden states it saw."""
    seen, it = [], iter(tokens)

    def scripted(hidden, w, ops):
        seen.append(hidden.clone())
        logits = torch.full((hidden.shape[0], model.config.text.vocab_size), -1e9)
        logits[:, next(it)] = 0.0
        return logits
    monkeypatch.setattr(md3_text, "lm_logits", scripted)
    return seen


def test_reasoning_follows_kestrels_query_template(model, enc, monkeypatch):
    """kestrel's Moondream 3 query: question + reasoning opener [4]; the reasoning runs until the
    model picks the answer marker (3), which is fed back with nothing forced after it, and the
    answer follows; nothing is barred while reasoning, where eos ends the request."""
    tok = model.tokenizer
    think, answer = tok.encode(" look left"), tok.encode(" a cup")
    assert skills.query_prompt(model, "what ?", reasoning=True) == [1, 15381, 2] + tok.encode("what ?") + [4]
    seen = _script(monkeypatch, model, think + [3] + answer + [0])
    out = model.query(enc, "what ?", reasoning=True, settings={"temperature": 0, "max_tokens": 10})
    assert out == {"reasoning": {"text": tok.decode(think), "grounding": []}, "answer": tok.decode(answer)}
    # The hidden states the head saw are those of one forward over prompt + every token fed back.
    prompt = skills.query_prompt(model, "what ?", reasoning=True)
    fed = md3_text.embed(torch.tensor([prompt + think + [3] + answer]), model.text_w)
    cache = md3_text.KVCache(model.config.text, enc.pos + fed.shape[1], torch.float32, "cpu")
    cache.k[:, :, :, :enc.pos], cache.v[:, :, :, :enc.pos] = enc.k, enc.v
    full = md3_text.forward(fed, enc.pos, model.text_w, model.config.text, cache, model.ops)[0]
    torch.testing.assert_close(torch.cat(seen), full[len(prompt) - 1:], rtol=1e-4, atol=1e-4)
    _script(monkeypatch, model, think[:1] + [0])
    out = model.query(enc, "what ?", reasoning=True, settings={"temperature": 0, "max_tokens": 10})
    assert out == {"reasoning": {"text": tok.decode(think[:1]), "grounding": []}, "answer": ""}


def test_segment_spatial_refs_and_native_stream(model, enc, monkeypatch):
    """spatial_refs enter the segment prompt after its prefix, encoded by the region encoder (as a
    query's); stream=True yields the bbox, then one chunk per path command, then the result."""
    from segment_fixtures import DIAMOND_PATH, script_segment

    refs = [(0.5, 0.25), (0.1, 0.2, 0.3, 0.6)]
    ids = seg.segment_prompt(model, "cup", refs)
    assert ids == [1, 17374, 2, 5, 5, 5, 5, 6] + model.tokenizer.encode("cup") + [3]
    script_segment(monkeypatch, ck.checkpoint("safetensors")[0])
    plain = model.segment(enc, "cup", spatial_refs=refs, settings={"max_tokens": 40})
    assert plain["path"] == DIAMOND_PATH
    updates = list(model.segment(enc, "cup", spatial_refs=refs, stream=True, settings={"max_tokens": 40}))
    assert updates[0] == {"bbox": plain["bbox"]}
    assert [u["chunk"] for u in updates[1:-1]] == ["M 0.5 0", " L 1 0.5", " L 0.5 1", " L 0 0.5", " Z"]
    assert updates[-1] == {**plain, "completed": True}
    # The refs reach the prompt's embeddings: the box differs from the one without them.
    assert model.segment(enc, "cup", settings={"max_tokens": 40})["bbox"] != plain["bbox"]
    with pytest.raises(ValueError, match="spatial_refs"):
        model.segment(enc, "cup", spatial_refs=[(0.5, 1.5)])
