"""Tokenizer from tokenizer.json agrees with openai-whisper's tiktoken tokenizer (tiny.en)."""
from __future__ import annotations

import json

import pytest

from photon_core.models.whisper.tokenizer import WhisperTokenizer

from whisper_fixtures import tiny_en_path

whisper = pytest.importorskip("whisper")


@pytest.fixture(scope="module")
def toks():
    ours = WhisperTokenizer(tiny_en_path() / "tokenizer.json", n_vocab=51864)
    return ours, whisper.tokenizer.get_tokenizer(multilingual=False)


def test_special_ids_match_openai(toks):
    ours, ref = toks
    for name in ("eot", "sot", "translate", "transcribe", "sot_lm", "sot_prev", "no_timestamps",
                 "no_speech", "timestamp_begin"):
        assert getattr(ours, name) == getattr(ref, name), name
    assert not ours.multilingual
    assert ours.sot_sequence() == list(ref.sot_sequence) == [ours.sot]


def test_non_speech_tokens_match_openai_and_ct2_config(toks):
    ours, ref = toks
    assert ours.non_speech_tokens == ref.non_speech_tokens
    cfg = json.loads((tiny_en_path() / "config.json").read_text())
    specials = {ours.sot, ours.translate, ours.transcribe, ours.sot_lm, ours.sot_prev,
                ours.no_speech}
    assert set(ours.non_speech_tokens) == set(cfg["suppress_ids"]) - specials
    assert ours.encode(" ") + [ours.eot] == cfg["suppress_ids_begin"]


@pytest.mark.parametrize("text", [" Hello world, it's me.", "Turn on the lights!",
                                  " 3.14 ♪ (laughs)", " naïve café — ünïcödé"])
def test_encode_decode_match_openai(toks, text):
    ours, ref = toks
    assert ours.encode(text) == ref.encode(text)
    # ours drops special and timestamp tokens (as openai's transcribe does before decoding)
    ids = [ours.timestamp_begin] + ref.encode(text) + [ours.timestamp_begin + 5, ours.eot]
    assert ours.decode(ids) == ref.decode([t for t in ids if t < ref.eot]) == text


def test_english_only_rejects_other_language(toks):
    ours, _ = toks
    with pytest.raises(ValueError, match="English-only"):
        ours.sot_sequence("de")


@pytest.mark.parametrize("given, code", [("en", "en"), ("EN", "en"), (" en ", "en"), ("<|en|>", "en"),
                                         ("", None), (None, None), ("DE", "de")])
def test_language_spellings_openai_whisper_takes(given, code):
    """openai-whisper and transformers take a code in any case, and transformers the token's
    form: 'EN' was refused as not English."""
    from photon_core.models.whisper.tokenizer import language_code
    assert language_code(given) == code
