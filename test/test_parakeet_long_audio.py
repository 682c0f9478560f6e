"""Parakeet on audio longer than one chunk: token times stay within their own chunk, a word a
chunk cut splits stays one word, and words, segments and text agree (invariants, on the tiny
random checkpoint with 1.5 s chunks)."""
from __future__ import annotations

import numpy as np
import pytest

import parakeet_fixtures as pf
from photon_core.models.parakeet import load_parakeet
from photon_core.runtime.audio_chunks import chunk_bounds

CHUNK_S = 1.5


@pytest.fixture(scope="module")
def speech_model():
    return load_parakeet(pf.hf_checkpoint(), chunk_seconds=CHUNK_S)


@pytest.fixture(scope="module")
def long_pcm():
    pcm = pf.speech()
    return np.concatenate([pcm, pcm])


def _check_timed(items: list[dict], duration: float, label: str) -> None:
    """Each item within the audio, start <= end, and none starting before the previous one ended."""
    prev_end = 0.0
    for item in items:
        assert 0.0 <= item["start"] <= item["end"] <= duration + 1e-9, (label, item)
        assert item["start"] >= prev_end - 1e-9, (label, "overlaps the one before", prev_end, item)
        prev_end = item["end"]


def test_token_times_stay_within_their_own_chunk(speech_model, long_pcm, monkeypatch):
    """A token's duration can reach past its chunk's end; its time is cut at that end (not the
    audio's), so it never reaches into the next chunk's first token."""
    bounds = chunk_bounds(long_pcm, 16000, CHUNK_S)
    assert len(bounds) >= 4
    seen: list[list[tuple]] = []
    assemble = speech_model._assemble
    monkeypatch.setattr(speech_model, "_assemble", lambda tokens: seen.append(tokens) or assemble(tokens))
    speech_model.transcribe(long_pcm, 16000)
    (tokens,) = seen
    assert len({t[3] for t in tokens}) >= 3   # tokens from several chunks
    for tok, start, end, n in tokens:
        a, b = bounds[n]
        assert a / 16000 <= start <= end <= b / 16000 + 1e-9, (tok, start, end, n, bounds[n])


def test_words_segments_and_text_agree_across_chunks(speech_model, long_pcm):
    result = speech_model.transcribe(long_pcm, 16000)
    assert result["text"]
    assert [w["word"] for w in result["words"]] == result["text"].split()
    assert " ".join(s["text"] for s in result["segments"]) == result["text"]
    _check_timed(result["words"], result["duration"], "words")
    _check_timed(result["segments"], result["duration"], "segments")


def test_a_word_cut_by_a_chunk_boundary_stays_one_word(speech_model):
    """'▁the r o' ends chunk 0 and 'b ▁to' begins chunk 1: the text decodes them as "therob to",
    so the words are "therob" and "to" (not "thero", "b", "to"); a segment still ends where a new
    word starts a new chunk."""
    piece = {p: i for i, p in enumerate(pf.PIECES)}
    timed = [(piece["\u2581the"], 0.0, 0.08, 0), (piece["r"], 0.08, 0.16, 0), (piece["o"], 1.44, 1.5, 0),
             (piece["b"], 1.5, 1.6, 1), (piece["\u2581to"], 1.7, 1.78, 1)]
    out = speech_model._assemble(timed)
    assert out["text"] == "therob to"
    assert out["words"] == [{"start": 0.0, "end": 1.6, "word": "therob"}, {"start": 1.7, "end": 1.78, "word": "to"}]
    assert out["segments"] == [{"start": 0.0, "end": 1.6, "text": "therob"}, {"start": 1.7, "end": 1.78, "text": "to"}]
    assert [w["word"] for w in out["words"]] == out["text"].split()
