"""Skill semantics that differ between the Moondream versions, each as its public reference decides:
Moondream 2 as its public code (vikhyat/moondream, moondream/torch), Moondream 3 as its makers'
engine (m87-labs/kestrel, the engine behind the moondream client's local mode).

The LM head is scripted (every call puts all its weight on the next token of a list), so the
tokens a skill keeps, and those it has to refuse, are chosen here."""
from __future__ import annotations

import pytest
import torch

import moondream_fixtures as mf
import test_moondream3_checkpoints as ck
from test_moondream_skills import ramp_image
from photon_core.models.moondream import Request, skills
from photon_core.models.moondream import text as md2_text
from photon_core.models.moondream3 import text as md3_text

GREEDY = {"temperature": 0, "max_tokens": 10}


def _script(monkeypatch, module, vocab: int, tokens: list[int]) -> list[torch.Tensor]:
    """Every LM-head call of `module` from now on picks the next of `tokens` (the others at -1e9).
    Returns the list the hidden states it is called on go into, one [rows, dim] per call."""
    it = iter(tokens)
    seen: list[torch.Tensor] = []

    def scripted(hidden, w, ops):
        seen.append(hidden.detach().clone())
        logits = torch.full((hidden.shape[0], vocab), -1e9)
        logits[:, next(it)] = 0.0
        return logits
    monkeypatch.setattr(module, "lm_logits", scripted)
    return seen


@pytest.fixture(scope="module")
def md3():
    return ck.model("safetensors")


@pytest.fixture(scope="module")
def md3_enc(md3):
    return md3.encode_image(ramp_image(200, 300, 2))


@pytest.mark.parametrize("call", ["caption", "caption streamed", "query", "query streamed", "query batched",
                                  "reasoning", "reasoning streamed"])
def test_moondream3_answers_may_hold_the_answer_marker(md3, md3_enc, monkeypatch, call):
    """kestrel bars no token in a Moondream 3 answer (its query template's
    answer_suppressed_token_ids are Moondream 2's only; its caption suppresses the answer marker
    for moondream2 only): an answer marker the model picks there is an answer token like any
    other, fed back as its embedding, and the answer goes on to eos. (Barred, as Moondream 2's
    public code bars it, the next best token was taken instead: here eos, cutting the answer.)"""
    tok, tk = md3.tokenizer, md3.config.tokenizer
    answer = tok.encode(" a cup") + [tk.answer_id] + tok.encode(" dog")
    reasoning = call.startswith("reasoning")
    think = tok.encode(" look") + [tk.answer_id] if reasoning else []   # the marker ends the reasoning
    _script(monkeypatch, md3_text, md3.config.text.vocab_size, think + answer + [tk.eos_id])
    stream = call.endswith("streamed")
    if call.startswith("caption"):
        got = md3.caption(md3_enc, "short", stream=stream, settings=GREEDY)["caption"]
    elif call == "query batched":
        got = md3.batch([Request("query", md3_enc, "what ?", settings=GREEDY)])[0]["answer"]
    else:
        got = md3.query(md3_enc, "what ?", reasoning=reasoning, stream=stream, settings=GREEDY)["answer"]
    assert (got if isinstance(got, str) else "".join(got)) == tok.decode(answer)


def test_moondream2_answers_never_hold_the_answer_marker(monkeypatch):
    """Moondream 2 keeps its public code's rule: the answer marker is barred in an answer (the
    reference sets its logit to -inf; kestrel suppresses it for moondream2 too)."""
    model = mf.model()
    enc = model.encode_image(ramp_image(120, 160, 1))
    assert not bool(skills.answer_mask(model)[mf.ANSWER_ID])
    _script(monkeypatch, md2_text, model.config.text.vocab_size, model.tokenizer.encode("cup") + [mf.ANSWER_ID])
    # At the barred marker's turn every other token is at -1e9: the allowed argmax is eos (id 0).
    assert model.query(enc, "what is this ?", settings=GREEDY)["answer"] == "cup"


def _kestrel_inputs(model, tokens: list[int], seen: list[torch.Tensor]) -> torch.Tensor:
    """What kestrel feeds after each of `tokens` [1, len, dim]: a coord or size token's region
    encoding of the value the region heads read from the hidden state that picked it (seen[j]:
    kestrel's runtime.py post_sample types the sampled id as a CoordToken / SizeToken with that
    value, _embed_packed_token_batch encodes it), any other token's embedding."""
    tk, rw, ops, reg = model.config.tokenizer, model.region_w, model.ops, model.region_impl
    rows = []
    for tok, hidden in zip(tokens, seen):
        if tok == tk.coord_id:
            rows.append(reg.encode_coords(reg.decode_coords(hidden, rw, ops), rw, ops).reshape(1, -1))
        elif tok == tk.size_id:
            rows.append(reg.encode_sizes(reg.decode_sizes(hidden, rw, ops), rw, ops).reshape(1, -1))
        else:
            rows.append(md3_text.embed(torch.tensor([[tok]]), model.text_w).reshape(1, -1))
    return torch.cat(rows)[None]


def _one_forward(model, enc, prompt: list[int], fed: torch.Tensor) -> torch.Tensor:
    """The hidden states [len(prompt) + T, dim] of one forward over the prompt then `fed`."""
    x = torch.cat([md3_text.embed(torch.tensor([prompt]), model.text_w), fed], dim=1)
    cache = md3_text.KVCache(model.config.text, enc.pos + x.shape[1], torch.float32, "cpu")
    cache.k[:, :, :, :enc.pos], cache.v[:, :, :, :enc.pos] = enc.k, enc.v
    return md3_text.forward(x, enc.pos, model.text_w, model.config.text, cache, model.ops)[0]


@pytest.mark.parametrize("call", ["caption", "caption streamed", "query", "query streamed", "query batched",
                                  "chat", "reasoning", "reasoning streamed"])
def test_moondream3_feeds_coordinate_and_size_tokens_back_as_region_values(md3, md3_enc, monkeypatch, call):
    """kestrel types every coord or size id its decode picks, in an answer as in a reasoning, as a
    region token valued by the region heads on the hidden state that picked it, and feeds the
    region encoder's embedding of that value as the next input (kestrel/scheduler/tokens.py
    render_tokens_from_packed, models/moondream/runtime.py _embed_packed_token_batch); its skills
    keep such tokens out of the text (skills/query.py consume_step, caption.py finalize: text
    tokens only). The hidden states the scripted head saw are those of one forward over the
    prompt and those inputs; the answer is its words."""
    tok, tk = md3.tokenizer, md3.config.tokenizer
    ROOMY = {**GREEDY, "max_tokens": 20}   # reasoning and answer share it (kestrel)
    cup, dog = tok.encode(" cup"), tok.encode(" dog")
    answer = cup + [tk.coord_id, tk.coord_id, tk.size_id] + dog + [tk.size_id]
    reasoning = call.startswith("reasoning")
    think = tok.encode(" robot") + [tk.coord_id, tk.coord_id, tk.size_id] + [tk.answer_id] if reasoning else []
    seen = _script(monkeypatch, md3_text, md3.config.text.vocab_size, think + answer + [tk.eos_id])
    stream = call.endswith("streamed")
    if call.startswith("caption"):
        got = md3.caption(md3_enc, "short", stream=stream, settings=ROOMY)["caption"]
        prompt = skills.caption_prompt(md3, "short")
    elif call == "chat":
        turn = {"role": "user", "content": [{"type": "image", "image": md3_enc}, {"type": "text", "text": "what ?"}]}
        got = md3.chat([turn], settings={**ROOMY, "reasoning": False})["message"]["content"]
        prompt = skills.query_prompt(md3, "what ?")
    else:
        if call == "query batched":
            out = md3.batch([Request("query", md3_enc, "what ?", settings=ROOMY, reasoning=reasoning)])[0]
        else:
            out = md3.query(md3_enc, "what ?", reasoning=reasoning, stream=stream, settings=ROOMY)
        got = out["answer"]
        prompt = skills.query_prompt(md3, "what ?", reasoning=reasoning)
    assert (got if isinstance(got, str) else "".join(got)) == tok.decode(cup + dog)
    emitted = think + answer
    assert len(seen) == len(emitted) + 1
    full = _one_forward(md3, md3_enc, prompt, _kestrel_inputs(md3, emitted, seen))
    torch.testing.assert_close(torch.cat(seen), full[len(prompt) - 1:], rtol=1e-4, atol=1e-4)
    if reasoning:   # the reasoning's coordinates ground it; its text is its words
        x, y = (md3.region_impl.decode_coords(seen[j], md3.region_w, md3.ops)[0] for j in (1, 2))
        text = tok.decode(tok.encode(" robot"))
        want = {"text": text, "grounding": [{"start_idx": 0, "end_idx": len(text), "points": [(x, y)]}]}
        assert out["reasoning"] == want


def test_moondream2_answers_feed_coordinate_tokens_as_embeddings(monkeypatch):
    """Moondream 2 keeps its public code's rule: a coord token in an answer is fed back as its
    token embedding (only a reasoning's coord is fed as the region encoder's value), and is text."""
    model = mf.model()
    enc = model.encode_image(ramp_image(120, 160, 1))
    tok = model.tokenizer
    answer = tok.encode(" cup") + [mf.COORD_ID] + tok.encode(" dog")
    seen = _script(monkeypatch, md2_text, model.config.text.vocab_size, answer + [mf.EOS_ID])
    assert model.query(enc, "what ?", settings=GREEDY)["answer"] == tok.decode(answer)
    prompt = skills.query_prompt(model, "what ?")
    x = md2_text.embed(torch.tensor([prompt + answer]), model.text_w)
    cache = md2_text.KVCache(model.config.text, enc.pos + x.shape[1], torch.float32, "cpu")
    cache.k[:, :, :, :enc.pos], cache.v[:, :, :, :enc.pos] = enc.k, enc.v
    full = md2_text.forward(x, enc.pos, model.text_w, model.config.text, cache, model.ops)[0]
    torch.testing.assert_close(torch.cat(seen), full[len(prompt) - 1:], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("call", ["query", "query streamed", "chat"])
def test_moondream3_reasoning_and_answer_share_max_tokens(md3, md3_enc, monkeypatch, call):
    """kestrel's query has one max_new_tokens for the whole request (reasoning, answer marker,
    answer: every token counts, scheduler.py _mark_finished_if_needed) and at it the request ends
    ("length") with what it has: a reasoning cut there has no answer, and no answer marker is
    forced (skills/query.py: the answer starts only at the marker the model picks)."""
    tok, tk = md3.tokenizer, md3.config.tokenizer
    words = tok.encode(" a robot is this dog ? the cup")
    budget = {"temperature": 0, "max_tokens": 4}

    def ask() -> tuple[dict, str | None]:
        if call == "chat":
            turn = {"role": "user", "content": [{"type": "image", "image": md3_enc},
                                                {"type": "text", "text": "what ?"}]}
            reply = md3.chat([turn], settings=budget)
            msg = reply["message"]
            return {"reasoning": msg.get("reasoning", ""), "answer": msg["content"]}, reply["finish_reason"]
        out = md3.query(md3_enc, "what ?", reasoning=True, stream=call.endswith("streamed"), settings=budget)
        answer = out["answer"] if isinstance(out["answer"], str) else "".join(out["answer"])
        return {"reasoning": out["reasoning"]["text"], "answer": answer}, None

    seen = _script(monkeypatch, md3_text, md3.config.text.vocab_size, words + [tk.eos_id])
    got, finish = ask()
    assert got == {"reasoning": tok.decode(words[:4]), "answer": ""} and len(seen) == 4
    assert finish in (None, "length")
    # The marker after two reasoning tokens: one answer token is left of the four.
    seen = _script(monkeypatch, md3_text, md3.config.text.vocab_size, words[:2] + [tk.answer_id] + words[2:] + [0])
    got, finish = ask()
    assert got == {"reasoning": tok.decode(words[:2]), "answer": tok.decode(words[2:3])} and len(seen) == 4
    assert finish in (None, "length")
    # Ended by eos within the budget: "stop".
    _script(monkeypatch, md3_text, md3.config.text.vocab_size, words[:1] + [tk.answer_id] + words[1:2] + [0])
    got, finish = ask()
    assert got == {"reasoning": tok.decode(words[:1]), "answer": tok.decode(words[1:2])}
    assert finish in (None, "stop")


def test_moondream2_reasoning_and_answer_each_get_max_tokens(monkeypatch):
    """Moondream 2 keeps its public code's budget: max_tokens of reasoning, then the answer marker
    fed (forced where the reasoning ran out) and max_tokens of answer."""
    model = mf.model()
    enc = model.encode_image(ramp_image(120, 160, 1))
    tok = model.tokenizer
    words = tok.encode("a robot is this dog ? the cup")
    seen = _script(monkeypatch, md2_text, model.config.text.vocab_size, words + [mf.EOS_ID])
    out = model.query(enc, "what ?", reasoning=True, settings={"temperature": 0, "max_tokens": 3})
    # the fourth reasoning step's pick (words[3]) gives way to the forced marker
    assert out["reasoning"]["text"] == tok.decode(words[:3]) and out["answer"] == tok.decode(words[4:7])
    assert len(seen) == 7


@pytest.mark.parametrize("task", ["caption", "query", "chat"])
def test_moondream3_sampling_defaults_are_kestrels(md3, md3_enc, monkeypatch, task):
    """Settings left out sample as kestrel's caption, query and chat do: temperature 0.2, top_p 0.9
    (kestrel/skills/base.py AR_DEFAULT_TEMPERATURE / AR_DEFAULT_TOP_P, filled in by
    parse_settings); given ones win. Moondream 2 keeps its public reference's 0.5 / 0.3."""
    from photon_core.models.moondream import batch as batch_decoding
    from photon_core.runtime import sampling
    used: list[tuple[float, float]] = []

    def spy(logits, s, ops, allowed=None, generator=None):
        used.append((s.temperature, s.top_p))
        return sampling.pick(logits, s, ops, allowed, generator)
    monkeypatch.setattr(batch_decoding, "pick", spy)

    def run(settings) -> tuple[float, float]:
        used.clear()
        if task == "caption":
            md3.caption(md3_enc, "short", settings=settings)
        elif task == "query":
            md3.query(md3_enc, "what ?", settings=settings)
        else:
            turn = {"role": "user", "content": [{"type": "image", "image": md3_enc},
                                                {"type": "text", "text": "what ?"}]}
            md3.chat([turn], settings=settings)
        assert used and len(set(used)) == 1
        return used[0]
    assert run(None) == (0.2, 0.9)
    assert run({"max_tokens": 3}) == (0.2, 0.9)
    assert run({"max_tokens": 3, "temperature": 0.7}) == (0.7, 0.9)
    assert run({"max_tokens": 3, "top_p": 0.5}) == (0.2, 0.5)
    md2 = mf.model()
    opts = md2.request_settings(Request(task if task != "chat" else "query", None, "x", settings={}))
    assert (opts.temperature, opts.top_p) == (0.5, 0.3)


def _encoded_texts(monkeypatch, model) -> list[str]:
    """The texts `model`'s tokenizer is asked to encode from now on."""
    texts: list[str] = []
    encode = model.tokenizer.encode

    def spy(text: str) -> list[int]:
        texts.append(text)
        return encode(text)
    monkeypatch.setattr(model.tokenizer, "encode", spy)
    return texts


def test_moondream3_reads_prompts_as_kestrel(md3, md3_enc, monkeypatch):
    """kestrel's skills strip the object (detect, point, segment) and the question (query) of
    surrounding whitespace and read the caption length stripped and lower-cased, "" as "normal"
    (build_request of detect.py, point.py, segment.py, query.py, caption.py); its chat takes the
    text as written. Moondream 2 reads them as given, as its public code does."""
    texts = _encoded_texts(monkeypatch, md3)
    md3.detect(md3_enc, "  cup\n", settings={"max_objects": 1})
    md3.point(md3_enc, "\tdog ", settings={"max_objects": 1})
    md3.batch([Request("point", md3_enc, " cup ", settings={"max_objects": 1})])
    md3.query(md3_enc, "  what is this ?  ", settings=GREEDY)
    md3.segment(md3_enc, " robot ", settings={"max_tokens": 2})
    assert texts == [" cup", " dog", " cup", "what is this ?", "robot"]
    assert md3.caption(md3_enc, " Short ", settings=GREEDY) == md3.caption(md3_enc, "short", settings=GREEDY)
    assert md3.caption(md3_enc, "", settings=GREEDY) == md3.caption(md3_enc, "normal", settings=GREEDY)
    texts.clear()
    turn = {"role": "user", "content": [{"type": "image", "image": md3_enc}, {"type": "text", "text": " what ? "}]}
    md3.chat([turn], settings={**GREEDY, "reasoning": False})
    md3.chat([turn], stream=True, settings={**GREEDY, "reasoning": False})
    assert texts == [" what ? ", " what ? "]
    md2 = mf.model()
    enc = md2.encode_image(ramp_image(120, 160, 1))
    texts = _encoded_texts(monkeypatch, md2)
    md2.detect(enc, "  cup\n", settings={"max_objects": 1})
    md2.query(enc, "  what ? ", settings=GREEDY)
    assert texts == ["   cup\n", "  what ? "]
    with pytest.raises(ValueError, match="caption length"):
        md2.caption(enc, " Short ", settings=GREEDY)


def test_moondream3_object_limits_are_kestrels(md3, md3_enc, monkeypatch):
    """kestrel's point without max_objects is bounded by max_tokens alone (two tokens a point; its
    budget is settings' max_tokens, default 768), and detect and point raise max_objects below 1
    to 1 (skills/point.py, detect.py build_request: max(1, max_objects)); detect keeps 50.
    Moondream 2 keeps 50 and 0 as its public code has them."""
    tk = md3.config.tokenizer
    _script(monkeypatch, md3_text, md3.config.text.vocab_size, [tk.coord_id] * 2000)
    assert len(md3.point(md3_enc, "dog", settings={"max_tokens": 121})["points"]) == 60
    assert len(md3.point(md3_enc, "dog", settings={"max_tokens": 121, "max_objects": 3})["points"]) == 3
    assert len(md3.point(md3_enc, "dog", settings={"max_objects": 0})["points"]) == 1
    assert len(md3.detect(md3_enc, "cup", settings={"max_objects": 0})["objects"]) == 1
    assert len(md3.detect(md3_enc, "cup", settings={"max_tokens": 2})["objects"]) == 50
    assert md3.request_settings(Request("point", md3_enc, "dog", settings={})).max_objects == 384
    # The nodes' requests (fields, no settings dict) keep their max_objects as given.
    assert md3.request_settings(Request("detect", md3_enc, "cup", max_objects=0)).max_objects == 0
    md2 = mf.model()
    assert md2.request_settings(Request("point", None, "dog", settings={})).max_objects == 50
    assert md2.request_settings(Request("detect", None, "dog", settings={"max_objects": 0})).max_objects == 0


def test_moondream3_object_skills_sample_with_given_settings(md3, md3_enc, monkeypatch):
    """kestrel's detect, point and segment decode greedily by default (build_request:
    parse_settings(temperature=0.0, top_p=1.0)) and sample with the temperature and top_p that
    `settings` gives: the continue-or-stop token under its mask, and every coordinate and size drawn
    from the region heads' logits (scheduler/spatial.py compute_spatial_values). A nucleus of one
    bin (a tiny top_p) is the argmax at any temperature. Moondream 2's ignore both (greedy)."""
    hot, narrow = {"temperature": 5.0, "top_p": 1.0}, {"temperature": 5.0, "top_p": 1e-6}

    def seeded(seed: int, call, settings: dict) -> dict:
        torch.manual_seed(seed)
        return call(settings)
    tk = md3.config.tokenizer

    def segment(s: dict) -> dict:   # its box: the region values at a scripted coord, coord, size
        _script(monkeypatch, md3_text, md3.config.text.vocab_size, [tk.coord_id, tk.coord_id, tk.size_id, tk.eos_id])
        return md3.segment(md3_enc, "cup", settings={"max_tokens": 6, **s})["bbox"]
    calls = {"detect": lambda s: md3.detect(md3_enc, "cup", settings={"max_objects": 3, **s}),
             "point": lambda s: md3.point(md3_enc, "dog", settings={"max_objects": 3, **s}),
             "segment": segment}
    for name, call in calls.items():
        greedy = call({})
        assert call({"temperature": 0}) == greedy, name
        assert seeded(0, call, narrow) == greedy, name
        assert seeded(0, call, hot) == seeded(0, call, hot), name   # seeded: reproducible
        assert seeded(0, call, hot) != seeded(1, call, hot), name
    md2 = mf.model()
    enc = md2.encode_image(ramp_image(120, 160, 1))
    want = md2.detect(enc, "cup", settings={"temperature": 0})
    assert seeded(0, lambda s: md2.detect(enc, "cup", settings=s), hot) == want


def test_moondream3_sampled_reasoning_draws_its_coordinates(md3, md3_enc, monkeypatch):
    """A sampled query's coordinates are drawn from the coordinate head's logits with its
    temperature and top_p, as kestrel draws every spatial value (its default query samples at
    0.2 / 0.9); a nucleus of one bin gives the argmax (the greedy query's)."""
    tk = md3.config.tokenizer
    think = [tk.coord_id, tk.coord_id, tk.answer_id]

    def points(settings: dict, seed: int = 0) -> list:
        _script(monkeypatch, md3_text, md3.config.text.vocab_size, think + [tk.eos_id])
        torch.manual_seed(seed)
        out = md3.query(md3_enc, "what ?", reasoning=True, settings={"max_tokens": 10, **settings})
        return out["reasoning"]["grounding"][0]["points"]
    greedy = points({"temperature": 0})
    assert points({"temperature": 5.0, "top_p": 1e-6}) == greedy
    assert points({"temperature": 5.0, "top_p": 1.0}, 0) != points({"temperature": 5.0, "top_p": 1.0}, 1)


def _grounded_reasoning(tok, tk) -> tuple[list[int], list[int], list[int], list[int]]:
    """A reasoning that grounds " the cup" on one point: (words before, the grounded words, words
    after, all its tokens up to and with the answer marker). The test tokenizer joins decoded words
    with spaces, so the text decoded whole is not its chunks' texts joined."""
    look, cup, ok = tok.encode(" a robot is"), tok.encode(" the cup"), tok.encode(" this dog ?")
    think = (look + [tk.start_ground_points_id] + cup + [tk.coord_id, tk.coord_id] + [tk.end_ground_id] + ok
             + [tk.answer_id])
    return look, cup, ok, think


@pytest.mark.parametrize("call", ["query", "query streamed", "query batched", "chat"])
def test_moondream3_reasoning_text_leaves_out_the_grounding_marks(md3, md3_enc, monkeypatch, call):
    """kestrel's query skill keeps a reasoning's start-ground-points and end-ground tokens out of
    its text: they only close the chunk in progress (skills/query.py consume_step), the text is
    all the reasoning's text tokens decoded at once and each grounded span's offsets are the
    lengths of the chunks decoded on their own (finalize). Its chat passes the same text and
    grounding on (models/moondream/skills/chat.py). Moondream 2's public code keeps the marks in
    the text (the next test)."""
    tok, tk = md3.tokenizer, md3.config.tokenizer
    look, cup, ok, think = _grounded_reasoning(tok, tk)
    seen = _script(monkeypatch, md3_text, md3.config.text.vocab_size, think + tok.encode(" a cup") + [tk.eos_id])
    settings = {**GREEDY, "max_tokens": 20}
    if call == "chat":
        turn = {"role": "user", "content": [{"type": "image", "image": md3_enc}, {"type": "text", "text": "what ?"}]}
        msg = md3.chat([turn], settings=settings)["message"]
        reasoning = {"text": msg["reasoning"], "grounding": msg["reasoning_details"]["grounding"]}
    elif call == "query batched":
        reasoning = md3.batch([Request("query", md3_enc, "what ?", settings=settings, reasoning=True)])[0]["reasoning"]
    else:
        reasoning = md3.query(md3_enc, "what ?", reasoning=True, stream=call.endswith("streamed"),
                              settings=settings)["reasoning"]
    at = len(look) + 1 + len(cup)   # the first coord's step
    x, y = (md3.region_impl.decode_coords(seen[j], md3.region_w, md3.ops)[0] for j in (at, at + 1))
    start = len(tok.decode(look))
    assert reasoning == {"text": tok.decode(look + cup + ok),
                         "grounding": [{"start_idx": start, "end_idx": start + len(tok.decode(cup)),
                                        "points": [(x, y)]}]}


def test_moondream2_reasoning_text_keeps_the_grounding_marks(monkeypatch):
    """Moondream 2 keeps its public code's reasoning text: a grounding mark starts a chunk of it,
    decoded with that chunk, and the text is the chunks' texts joined."""
    model = mf.model()
    enc = model.encode_image(ramp_image(120, 160, 1))
    tok, tk = model.tokenizer, model.config.tokenizer
    look, cup, ok, think = _grounded_reasoning(tok, tk)
    _script(monkeypatch, md2_text, model.config.text.vocab_size, think + [mf.EOS_ID])
    out = model.query(enc, "what ?", reasoning=True, settings={**GREEDY, "max_tokens": 20})
    chunks = [look, [tk.start_ground_points_id] + cup + [tk.coord_id, tk.coord_id], [tk.end_ground_id] + ok]
    texts = [tok.decode(c) for c in chunks]
    assert out["reasoning"]["text"] == "".join(texts)
    assert [(g["start_idx"], g["end_idx"]) for g in out["reasoning"]["grounding"]] == \
        [(len(texts[0]), len(texts[0]) + len(texts[1]))]


@pytest.mark.parametrize("stream", [False, True])
def test_moondream3_chat_answers_an_image_only_turn(md3, md3_enc, monkeypatch, stream):
    """kestrel's chat refuses a last user message only when it has neither text nor an image
    (skills/chat.py build_request); its Moondream chat renders an image-only turn as the query
    prefix with no question tokens, then the opener (models/moondream/skills/chat.py), and a
    whitespace text as written. Moondream 2's chat still needs words to ask."""
    tok, tk = md3.tokenizer, md3.config.tokenizer
    answer = tok.encode(" a cup")
    seen = _script(monkeypatch, md3_text, md3.config.text.vocab_size, answer + [tk.eos_id])
    turn = {"role": "user", "content": [{"type": "image", "image": md3_enc}]}
    reply = md3.chat([turn], stream=stream, settings={**GREEDY, "reasoning": False})
    content = "".join(reply["message"]) if stream else reply["message"]["content"]
    assert content == tok.decode(answer)
    if not stream:
        assert reply == {"message": {"role": "assistant", "content": content}, "finish_reason": "stop"}
    prompt = list(tk.templates["query"]["prefix"]) + skills.query_openers(md3)[0]
    full = _one_forward(md3, md3_enc, prompt, md3_text.embed(torch.tensor([answer]), md3.text_w))
    torch.testing.assert_close(torch.cat(seen), full[len(prompt) - 1:], rtol=1e-4, atol=1e-4)
    texts = _encoded_texts(monkeypatch, md3)
    _script(monkeypatch, md3_text, md3.config.text.vocab_size, [tk.eos_id])
    spaced = {"role": "user", "content": [{"type": "image", "image": md3_enc}, {"type": "text", "text": "  "}]}
    md3.chat([spaced], settings={**GREEDY, "reasoning": False})
    assert texts == ["  "]
    with pytest.raises(ValueError, match="text or an image"):
        md3.chat([{"role": "user", "content": [{"type": "text", "text": ""}]}], settings=GREEDY)
    md2 = mf.model()
    enc = md2.encode_image(ramp_image(120, 160, 1))
    with pytest.raises(ValueError, match="needs text"):
        md2.chat([{"role": "user", "content": [{"type": "image", "image": enc}]}], settings=GREEDY)


def test_moondream3_settings_are_checked_as_kestrel_checks_them(md3, md3_enc, monkeypatch):
    """kestrel's parse_settings refuses a max_tokens below 1 in the settings of caption, query,
    chat, point and segment ("max_tokens must be positive", skills/base.py); its detect drops
    settings' max_tokens before parsing (its budget is max_objects'), and detect and point raise
    any max_objects below 1, negative ones too, to 1 (max(1, int(max_objects))). Moondream 2 keeps
    max_tokens 0 (an empty answer) and refuses a negative max_objects."""
    tk = md3.config.tokenizer
    turn = {"role": "user", "content": [{"type": "image", "image": md3_enc}, {"type": "text", "text": "what ?"}]}
    zero = {"temperature": 0, "max_tokens": 0}
    calls = [lambda s: md3.caption(md3_enc, "short", settings=s), lambda s: md3.query(md3_enc, "what ?", settings=s),
             lambda s: md3.query(md3_enc, "what ?", reasoning=True, settings=s),
             lambda s: md3.batch([Request("query", md3_enc, "what ?", settings=s)]),
             lambda s: md3.chat([turn], settings=s), lambda s: md3.point(md3_enc, "dog", settings=s),
             lambda s: md3.point(md3_enc, "dog", settings={**s, "max_objects": 2}),
             lambda s: md3.segment(md3_enc, "cup", settings=s)]
    for call in calls:
        with pytest.raises(ValueError, match="max_tokens must be positive"):
            call(zero)
        with pytest.raises(ValueError, match="max_tokens must be"):
            call({"max_tokens": -1})
    _script(monkeypatch, md3_text, md3.config.text.vocab_size, [tk.coord_id] * 200)
    assert len(md3.detect(md3_enc, "cup", settings={"max_objects": 2, "max_tokens": 0})["objects"]) == 2
    assert len(md3.detect(md3_enc, "cup", settings={"max_objects": 2, "max_tokens": -5})["objects"]) == 2
    assert len(md3.detect(md3_enc, "cup", settings={"max_objects": -3})["objects"]) == 1
    assert len(md3.point(md3_enc, "dog", settings={"max_objects": -3})["points"]) == 1
    md2 = mf.model()
    enc = md2.encode_image(ramp_image(120, 160, 1))
    assert md2.query(enc, "what ?", settings=zero) == {"answer": ""}
    with pytest.raises(ValueError, match="max_objects must be >= 0"):
        md2.detect(enc, "cup", settings={"max_objects": -3})


def test_moondream3_chat_reply_has_reasoning_whenever_it_was_on(md3, md3_enc, monkeypatch):
    """kestrel's Moondream chat puts the reasoning's text on the message whenever reasoning was on,
    "" where the model went straight to the answer marker (models/moondream/skills/chat.py
    finalize: the query result's reasoning is always there then); reasoning off, no key. Moondream
    2's chat keeps the key for a reasoning with text (runtime.chat_messages.assistant_reply)."""
    tok, tk = md3.tokenizer, md3.config.tokenizer
    answer = tok.encode(" a cup")
    turn = {"role": "user", "content": [{"type": "image", "image": md3_enc}, {"type": "text", "text": "what ?"}]}
    _script(monkeypatch, md3_text, md3.config.text.vocab_size, [tk.answer_id] + answer + [tk.eos_id])
    reply = md3.chat([turn], settings={**GREEDY, "max_tokens": 20})
    assert reply == {"message": {"role": "assistant", "content": tok.decode(answer), "reasoning": ""},
                     "finish_reason": "stop"}
    _script(monkeypatch, md3_text, md3.config.text.vocab_size, answer + [tk.eos_id])
    reply = md3.chat([turn], settings={**GREEDY, "max_tokens": 20, "reasoning": False})
    assert reply["message"] == {"role": "assistant", "content": tok.decode(answer)}
    md2 = mf.model()
    enc = md2.encode_image(ramp_image(120, 160, 1))
    _script(monkeypatch, md2_text, md2.config.text.vocab_size, [mf.ANSWER_ID] + answer + [mf.EOS_ID])
    turn = {"role": "user", "content": [{"type": "image", "image": enc}, {"type": "text", "text": "what ?"}]}
    assert "reasoning" not in md2.chat([turn], settings={**GREEDY, "max_tokens": 20})["message"]


@pytest.mark.parametrize("version", [2, 3])
def test_chat_refuses_images_in_assistant_messages(md3, version):
    """kestrel's Moondream chat places images at user turns only and refuses an image part in any
    other message (models/moondream/skills/chat.py build_prompt_tokens), rather than dropping it
    (and handing it to a later user turn's image part, which took the wrong picture). Moondream 2's
    chat, shaped as kestrel's, refuses it too."""
    model = md3 if version == 3 else mf.model()
    messages = [{"role": "user", "content": "what ?"},
                {"role": "assistant", "content": [{"type": "image", "image": ramp_image(200, 300, 4)},
                                                  {"type": "text", "text": "a"}]},
                {"role": "user", "content": [{"type": "image", "image": ramp_image(200, 300, 3)},
                                             {"type": "text", "text": "and this ?"}]}]
    with pytest.raises(ValueError, match="only in user messages"):
        model.chat(messages, settings=GREEDY)
