"""Moondream skills on a small random checkpoint: result shapes, the decode protocol, input handling,
loading (both namings, dtypes, config overrides) and the command line."""
from __future__ import annotations

import argparse
import dataclasses
import json
import math

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

import moondream_fixtures as mf
from photon_core.models.moondream import load_moondream, region, text
from photon_core import cli_vision as mdcli


@pytest.fixture(scope="module")
def model():
    return mf.model()


def ramp_image(h: int, w: int, k: int) -> np.ndarray:
    """A deterministic RGB image of ramps (also Moondream 3's tests' image)."""
    y, x = np.mgrid[0:h, 0:w]
    return np.stack([x % 256, y % 256, (k * x + y) % 256], -1).astype(np.uint8)


@pytest.fixture(scope="module")
def image():
    return ramp_image(240, 320, 3)


@pytest.fixture(scope="module")
def enc(model, image):
    return model.encode_image(image)


def _in_unit(*vals):
    return all(isinstance(v, float) and 0.0 <= v <= 1.0 for v in vals)


def check_boxes_and_points(model, enc, n_objects: int, n_points: int) -> None:
    """detect and point give exactly n_objects boxes and n_points points (the tiny checkpoints' biased
    LM head never says eos), ordered boxes, all values in [0, 1], each object with its score, a
    probability (at least 0.5: greedy decoding went on) (also Moondream 3's tests' check)."""
    det = model.detect(enc, "cup", settings={"max_objects": n_objects})
    assert set(det) == {"objects"} and len(det["objects"]) == n_objects
    for o in det["objects"]:
        assert set(o) == {"x_min", "y_min", "x_max", "y_max", "score"} and _in_unit(*o.values())
        assert o["x_min"] <= o["x_max"] and o["y_min"] <= o["y_max"] and o["score"] >= 0.5
    pts = model.point(enc, "cup", settings={"max_objects": n_points})
    assert set(pts) == {"points"} and len(pts["points"]) == n_points
    assert all(set(p) == {"x", "y", "score"} and _in_unit(*p.values()) and p["score"] >= 0.5
               for p in pts["points"])


def test_all_skills_well_formed(model, enc):
    check_boxes_and_points(model, enc, 4, 3)
    assert model.detect(enc, "cup", settings={"max_objects": 0}) == {"objects": []}
    cap = model.caption(enc, length="short", settings={"temperature": 0, "max_tokens": 6})["caption"]
    assert isinstance(cap, str) and len(cap.split()) == 6  # WordLevel: one word per token, no eos drawn
    ans = model.query(enc, "what is this ?", settings={"temperature": 0, "max_tokens": 5})["answer"]
    assert isinstance(ans, str) and len(ans.split()) == 5
    assert model.model_id == "moondream2"


def test_streaming_matches_plain(model, enc):
    for skill, kw in (("caption", {"length": "long"}), ("query", {"question": "what is the robot ?"})):
        plain = getattr(model, skill)(enc, settings={"temperature": 0, "max_tokens": 7}, **kw)
        key = "caption" if skill == "caption" else "answer"
        gen = getattr(model, skill)(enc, settings={"temperature": 0, "max_tokens": 7}, stream=True, **kw)[key]
        assert not isinstance(gen, str)
        pieces = list(gen)
        assert len(pieces) > 1 and "".join(pieces) == plain[key]


def test_sampling_settings(model, enc):
    torch.manual_seed(0)
    out = model.caption(enc, settings={"max_tokens": 4, "temperature": 0.8, "top_p": 0.5})["caption"]
    assert len(out.split()) == 4
    for bad in ({"top_p": 0.0}, {"temperature": -1.0}, {"max_tokens": -1}):
        with pytest.raises(ValueError):
            model.caption(enc, settings=bad)
    with pytest.raises(ValueError, match="length"):
        model.caption(enc, length="huge")
    with pytest.raises(ValueError):
        model.query(enc, "")


class Spy:
    """Records text.forward / lm_logits / region calls made by the skills loop."""

    def __init__(self, monkeypatch):
        self.events = []
        for mod, name in ((text, "forward"), (text, "lm_logits"), (region, "decode_coords"),
                          (region, "decode_sizes"), (region, "encode_coords"), (region, "encode_sizes")):
            real = getattr(mod, name)

            def wrapped(*a, _real=real, _name=name, **k):
                out = _real(*a, **k)
                self.events.append((_name, a, out))
                return out
            monkeypatch.setattr(mod, name, wrapped)

    def names(self):
        return [e[0] for e in self.events]

    def decode_steps(self):
        return [e for e in self.events if e[0] == "forward" and e[1][0].shape[1] == 1]


def _region_weights(folder):
    sd = {k[len("model."):]: v for k, v in load_file(str(folder / "model.safetensors")).items()}
    return sd


def _coord_embedding(sd, x):
    f = 2 * math.pi * x * sd["region.coord_features"][0]
    feats = torch.cat([f.cos(), f.sin()])
    return feats @ sd["region.coord_encoder.weight"].T + sd["region.coord_encoder.bias"]


def _size_embedding(sd, w, h):
    f = 2 * math.pi * (torch.tensor([w, h]) @ sd["region.size_features"])
    feats = torch.cat([f.cos(), f.sin()])
    return feats @ sd["region.size_encoder.weight"].T + sd["region.size_encoder.bias"]


@pytest.mark.parametrize("skill,steps", [("detect", 3), ("point", 2)])
def test_decode_protocol(model, enc, monkeypatch, skill, steps):
    n = 3
    spy = Spy(monkeypatch)
    result = getattr(model, skill)(enc, "cup", settings={"max_objects": n})
    objs = result["objects" if skill == "detect" else "points"]
    assert len(objs) == n
    ev = spy.events
    # Prefill of the prompt, then exactly `steps` single-token decode steps per object, but the
    # last object's last value is never fed: max_objects is reached, no decision is left to make.
    fwd = [e for e in ev if e[0] == "forward"]
    tmpl = model.config.tokenizer.templates[skill]
    assert fwd[0][1][0].shape[1] == len(tmpl["prefix"]) + len(mf.build_tokenizer().encode(" cup").ids) + 1
    assert len(spy.decode_steps()) == steps * n - 1
    # The LM head runs once per object boundary (each starting an object) and nowhere else.
    assert spy.names().count("lm_logits") == n
    sd = _region_weights(mf.checkpoint())
    last_hidden = None
    for i, (name, args, out) in enumerate(ev):
        if name == "forward":
            last_hidden = out[:, -1]
        elif name == "lm_logits":
            # The LM head gets the hidden state before post_ln (it applies post_ln itself) ...
            assert torch.equal(args[0], last_hidden)
        elif name in ("decode_coords", "decode_sizes"):
            # ... and the region heads read exactly that same state.
            assert torch.equal(args[0], last_hidden)
            # The decoded value is encoded and fed as the very next input embedding.
            nxt = next((e for e in ev[i + 1:] if e[0] == "forward"), None)
            if nxt is None:   # only the last object's last value: max_objects reached, nothing to decide
                assert not any(e[0] in ("decode_coords", "decode_sizes") for e in ev[i + 1:])
                continue
            fed = nxt[1][0][0, 0]
            expect = _coord_embedding(sd, out[0]) if name == "decode_coords" else _size_embedding(sd, *out[0])
            torch.testing.assert_close(fed, expect, rtol=1e-4, atol=1e-5)
    # Results are the decoded values: centres from decode_coords, sizes from decode_sizes.
    coords = [e[2][0] for e in ev if e[0] == "decode_coords"]
    assert len(coords) == 2 * n
    if skill == "point":
        assert [(p["x"], p["y"]) for p in objs] == list(zip(coords[::2], coords[1::2]))
    else:
        sizes = [e[2][0] for e in ev if e[0] == "decode_sizes"]
        assert len(sizes) == n
        for o, x, y, (w, h) in zip(objs, coords[::2], coords[1::2], sizes):
            assert o["x_min"] == pytest.approx(min(max(x - w / 2, 0), 1)) and o["y_max"] == pytest.approx(min(max(y + h / 2, 0), 1))


def test_hidden_before_post_ln(model, enc):
    h = torch.randn(1, model.config.text.dim)
    ln_w, ln_b = model.text_w.post_ln
    lm_w, lm_b = model.text_w.lm_head
    expect = torch.nn.functional.layer_norm(h, (h.shape[-1],), ln_w, ln_b) @ lm_w.T + lm_b
    torch.testing.assert_close(text.lm_logits(h, model.text_w, model.ops), expect, rtol=1e-4, atol=1e-4)


def test_scores_are_the_probability_of_another_object(model, enc, monkeypatch):
    """An object's score is P(coord) among {coord, eos} at its boundary, computed here by hand from
    each boundary's hidden state and the checkpoint file's post_ln and LM head. Setting coord's LM
    bias to eos's + margin moves every score to sigmoid(hidden-state gap + margin) and leaves the
    points as they were (the hidden states do not depend on the LM head); a margin below every
    boundary's gap ends the list at its first boundary."""
    n = 3
    spy = Spy(monkeypatch)
    base = model.point(enc, "cup", settings={"max_objects": n})["points"]
    hidden = torch.cat([args[0] for name, args, _ in spy.events if name == "lm_logits"]).double()
    assert hidden.shape[0] == n                            # n boundaries that went on (then the budget ends it)
    sd = _region_weights(mf.checkpoint())
    h = torch.nn.functional.layer_norm(hidden, (hidden.shape[-1],), sd["text.post_ln.weight"].double(),
                                       sd["text.post_ln.bias"].double())
    w, b = sd["text.lm_head.weight"].double(), sd["text.lm_head.bias"].double()
    gap = h @ (w[mf.COORD_ID] - w[mf.EOS_ID])             # l_coord - l_eos without the biases

    def expected(bias_gap: float) -> list[float]:
        return torch.sigmoid(gap + bias_gap)[:n].tolist()

    assert [p["score"] for p in base] == pytest.approx(expected(float(b[mf.COORD_ID] - b[mf.EOS_ID])), abs=1e-6)
    weight, bias = model.text_w.lm_head
    for margin in (1.0, 2.5):
        shifted = bias.clone()
        shifted[mf.COORD_ID] = bias[mf.EOS_ID] + margin
        monkeypatch.setattr(model.text_w, "lm_head", (weight, shifted))
        got = model.point(enc, "cup", settings={"max_objects": n})["points"]
        assert [(p["x"], p["y"]) for p in got] == [(p["x"], p["y"]) for p in base]
        scores = [p["score"] for p in got]
        assert scores == pytest.approx(expected(margin), abs=1e-5)
        assert 0.5 <= min(scores) and max(scores) < 0.999 and max(scores) - min(scores) > 0.05
    shifted[mf.COORD_ID] = bias[mf.EOS_ID] - gap.max().item() - 0.5
    assert model.point(enc, "cup", settings={"max_objects": n}) == {"points": []}


@pytest.mark.parametrize("skill,steps", [("detect", 3), ("point", 2)])
def test_eos_only_at_object_boundary(model, enc, monkeypatch, skill, steps):
    """Scripted LM head: eos is the top token at every call except the first K boundaries. If eos were
    allowed (or the LM head consulted) inside an object, objects would be cut short."""
    k, vocab = 2, model.config.text.vocab_size
    calls = []

    def scripted(hidden, w, ops):
        logits = torch.zeros(1, vocab)
        logits[0, mf.EOS_ID] = 10.0
        logits[0, 1234] = 20.0  # not allowed at a boundary: the mask must ignore it
        logits[0, mf.COORD_ID] = 15.0 if len(calls) < k else 5.0
        calls.append(1)
        return logits

    monkeypatch.setattr(text, "lm_logits", scripted)
    steps_seen = []
    real_forward = text.forward
    monkeypatch.setattr(text, "forward", lambda x, *a, **kw: steps_seen.append(x.shape[1]) or real_forward(x, *a, **kw))
    out = getattr(model, skill)(enc, "cup", settings={"max_objects": 10})
    assert len(next(iter(out.values()))) == k
    assert len(calls) == k + 1
    assert steps_seen[1:] == [1] * (steps * k)


def test_text_never_emits_answer_token_and_stops_at_eos(model, enc, monkeypatch):
    vocab = model.config.text.vocab_size
    calls = []

    def scripted(hidden, w, ops):
        logits = torch.zeros(1, vocab)
        logits[0, mf.ANSWER_ID] = 100.0  # masked in text decoding
        logits[0, 11] = 50.0  # "cup"
        if len(calls) == 3:
            logits[0, mf.EOS_ID] = 200.0
        calls.append(1)
        return logits

    monkeypatch.setattr(text, "lm_logits", scripted)
    assert model.query(enc, "what is this ?", settings={"temperature": 0, "max_tokens": 50})["answer"] == "cup cup cup"


def test_reused_encoding_and_input_kinds_agree(model, image, enc):
    fresh = model.detect(image, "dog", settings={"max_objects": 3})
    assert model.detect(enc, "dog", settings={"max_objects": 3}) == fresh
    assert model.detect(Image.fromarray(image), "dog", settings={"max_objects": 3}) == fresh
    assert model.detect(np.ascontiguousarray(image[:, :, ::-1]), "dog", settings={"max_objects": 3}) != fresh  # BGR read as RGB
    bgr_enc = model.encode_image(np.ascontiguousarray(image[:, :, ::-1]), channel_order="bgr")
    assert model.detect(bgr_enc, "dog", settings={"max_objects": 3}) == fresh
    rgba = np.concatenate([image, np.full(image.shape[:2] + (1,), 255, np.uint8)], -1)
    assert model.point(rgba, "dog", settings={"max_objects": 2}) == model.point(enc, "dog", settings={"max_objects": 2})
    gray = model.point(image[:, :, 1].copy(), "dog", settings={"max_objects": 2})["points"]
    assert len(gray) == 2
    torch.testing.assert_close(model.encode_image(image).k, enc.k, rtol=0, atol=0)


def test_bad_images_raise_value_error(model):
    # float32 0..255 (float images hold 0..1: runtime.image_input)
    for bad in (np.zeros((0, 5, 3), np.uint8), np.full((5, 5, 3), 255, np.float32), np.zeros((5, 5, 5), np.uint8),
                "x.png"):
        with pytest.raises(ValueError):
            model.detect(bad, "cup")


def test_large_frame(model):
    img = np.random.default_rng(2).integers(0, 256, (3000, 4000, 3), dtype=np.uint8)
    enc = model.encode_image(img)
    assert enc.tiling == (2, 4) and enc.pos == 730
    assert len(model.detect(enc, "cup", settings={"max_objects": 2})["objects"]) == 2


def test_both_namings_load_to_identical_outputs(model, image, enc):
    old = load_moondream(mf.checkpoint("old"))
    enc_old = old.encode_image(image)
    assert torch.equal(enc_old.k, enc.k) and torch.equal(enc_old.v, enc.v)
    assert old.detect(enc_old, "cup", settings={"max_objects": 3}) == model.detect(enc, "cup", settings={"max_objects": 3})
    assert old.caption(enc_old, settings={"temperature": 0, "max_tokens": 5}) == model.caption(enc, settings={"temperature": 0, "max_tokens": 5})
    with pytest.raises(ValueError, match="another model"):
        old.detect(enc, "cup")
    # made by a model released since, whose id() `old` got: not old's own either
    with pytest.raises(ValueError, match="another model"):
        old.detect(dataclasses.replace(enc_old, owner=id(old)), "cup")


def test_config_json_overrides_dims(tmp_path, image):
    cfg = mf.small_config(vision_layers=1, text_layers=3)
    cfg["text"]["ff_dim"] = 96
    cfg["vision"]["enc_ff_dim"] = 48
    folder = mf.write_checkpoint(tmp_path / "ck", config=cfg)
    m = load_moondream(folder)
    assert (m.config.text.n_layers, m.config.text.ff_dim, m.config.vision.enc_n_layers) == (3, 96, 1)
    assert len(m.text_w.blocks) == 3 and m.text_w.blocks[0].fc1[0].shape == (96, 128)
    assert len(m.point(image, "cup", settings={"max_objects": 2})["points"]) == 2
    # A config that disagrees with the tensors is refused with the offending names.
    cfg["text"]["n_layers"] = 4
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="text.blocks.3"):
        load_moondream(folder)


@pytest.mark.parametrize("dtype", [torch.bfloat16, "float16"])
def test_half_precision_loads_and_runs(image, dtype):
    m = load_moondream(mf.checkpoint(), dtype=dtype)
    assert m.text_w.wte.dtype == (torch.bfloat16 if dtype == torch.bfloat16 else torch.float16)
    out = m.detect(image, "cup", settings={"max_objects": 2})["objects"]
    assert len(out) == 2 and all(_in_unit(*o.values()) for o in out)


def test_missing_tokenizer_is_explained(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty"))
    folder = tmp_path / "ck"
    folder.mkdir()
    (folder / "model.safetensors").symlink_to(mf.checkpoint() / "model.safetensors")
    (folder / "config.json").symlink_to(mf.checkpoint() / "config.json")
    with pytest.raises(FileNotFoundError, match="`hf download moondream/starmie-v1 tokenizer.json`"):
        load_moondream(folder)


def test_cli_detect_point_caption_query(tmp_path, image, capsys):
    img_path = tmp_path / "in.png"
    Image.fromarray(image).save(img_path)
    parser = argparse.ArgumentParser()
    mdcli.add_commands(parser.add_subparsers(dest="command", required=True))
    ck = str(mf.checkpoint())
    runs = [["detect", str(img_path), "cup", "--max-objects", "2", "--draw", str(tmp_path / "d.png")],
            ["point", str(img_path), "cup", "--max-objects", "2", "--draw", str(tmp_path / "p.png")],
            ["caption", str(img_path), "--max-tokens", "3"],
            ["query", str(img_path), "what is this ?", "--max-tokens", "3"]]
    outs = []
    for argv in runs:
        args = parser.parse_args(argv + ["--model", ck])
        assert args.run(args) == 0
        outs.append(json.loads(capsys.readouterr().out))
    assert len(outs[0]["objects"]) == 2 and len(outs[1]["points"]) == 2
    assert len(outs[2]["caption"].split()) == 3 and len(outs[3]["answer"].split()) == 3
    drawn = np.asarray(Image.open(tmp_path / "d.png"))
    assert drawn.shape == image.shape and not np.array_equal(drawn, image)
    assert (tmp_path / "p.png").exists()


def test_prompts_follow_the_published_templates(model):
    from photon_core.models.moondream import skills
    cup = mf.build_tokenizer().encode(" cup").ids
    assert skills.object_prompt(model, "detect", "cup") == [1, 7235, 476, 2] + cup + [3]
    assert skills.object_prompt(model, "point", "cup") == [1, 2581, 2] + cup + [3]
    assert skills.caption_prompt(model, "short") == [1, 32708, 2, 12492, 3]
    q = mf.build_tokenizer().encode("what is this ?").ids
    assert skills.query_prompt(model, "what is this ?") == [1, 15381, 2] + q + [3, 3]
