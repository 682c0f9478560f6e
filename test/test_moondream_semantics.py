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


def _script(monkeypatch, module, vocab: int, tokens: list[int]) -> None:
    """Every LM-head call of `module` from now on picks the next of `tokens` (the others at -1e9)."""
    it = iter(tokens)

    def scripted(hidden, w, ops):
        logits = torch.full((hidden.shape[0], vocab), -1e9)
        logits[:, next(it)] = 0.0
        return logits
    monkeypatch.setattr(module, "lm_logits", scripted)


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
