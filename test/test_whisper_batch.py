"""`WhisperSpeech.batch`: several clips in one call give what one call each gives (text, tokens,
segments), with the encoder and the first greedy decode really batched; on the CPU default
(int8 decoder linears) and on the exact float32 path, on real espeak-ng speech of tiny.en."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from photon_core.models.whisper import load_whisper
from photon_core.models.whisper.decoding import DecodeOptions
from photon_core.models.whisper.frontend import N_FRAMES, log_mel_content, pad_or_trim, prepare_audio
from photon_core.models.whisper.longform import LongFormOptions

from whisper_fixtures import SENTENCES, espeak


@pytest.fixture(scope="module")
def clips() -> list[tuple[np.ndarray, int]]:
    short = espeak(*SENTENCES["short"])
    medium = espeak(*SENTENCES["medium"])
    assert len(medium[0]) > 2 * len(short[0])
    return [medium, short, (np.zeros(16000 * 2, np.float32), 16000)]


@pytest.fixture(scope="module", params=["default", "float32"])
def model(request):
    return load_whisper("whisper-tiny.en", dtype=None if request.param == "default" else "float32")


def _same(got: dict, want: dict) -> None:
    """Equal results; float32 products of 3 rows may round differently in the last bits than
    those of one row, so the no-speech probability gets a tolerance."""
    got, want = dict(got), dict(want)
    got.pop("processing_time"), want.pop("processing_time")
    assert got.pop("no_speech_prob") == pytest.approx(want.pop("no_speech_prob"), abs=1e-4)
    assert got == want


def _record_encoder_batches(model, monkeypatch) -> list[int]:
    sizes: list[int] = []
    encode = model.net.encode

    def spy(mel: torch.Tensor) -> torch.Tensor:
        sizes.append(mel.shape[0])
        return encode(mel)
    monkeypatch.setattr(model.net, "encode", spy)
    return sizes


def _expected_batches(model, requests: list[dict]) -> list[int]:
    """Encoder batch sizes: clips share one when their first window has the same prompt
    (timestamps or not) and the same encoder shape (30 s, or each clip's fitted context)."""
    groups: dict[tuple, int] = {}
    for r in requests:
        ts = r.get("timestamps", True)
        content = log_mel_content(prepare_audio(r["audio"], r["sample_rate"])).shape[-1]
        frames = LongFormOptions(timestamps=ts, fit_context=model.audio_context == "fit").window_frames(content)
        groups[ts, frames] = groups.get((ts, frames), 0) + 1
    return sorted(groups.values())


def test_batch_of_three_equals_one_at_a_time(model, clips, monkeypatch):
    requests = [{"audio": pcm, "sample_rate": rate, "timestamps": ts}
                for (pcm, rate), ts in zip(clips, (True, False, True))]
    want = [model.transcribe(**r) for r in requests]
    sizes = _record_encoder_batches(model, monkeypatch)
    got = model.batch(requests)
    # timestamps on and off need different prompts: two decode groups, encoded 2 + 1 (30 s
    # windows) or 1 + 1 + 1 (fitted: the medium clip's context is longer than the silence's)
    assert sorted(sizes) == _expected_batches(model, requests) == ([1, 2] if model.audio_context == "full"
                                                                 else [1, 1, 1])
    for g, w in zip(got, want):
        _same(g, w)
    assert "kitchen" in got[1]["text"].lower() and got[2]["text"] == ""
    sizes.clear()
    same_options = [{"audio": pcm, "sample_rate": rate} for pcm, rate in clips]
    got = model.batch(same_options)
    assert sorted(sizes) == _expected_batches(model, same_options) == ([3] if model.audio_context == "full"
                                                                       else [1, 2])
    for g, r in zip(got, same_options):
        _same(g, model.transcribe(**r))


def test_batched_greedy_tokens_equal_single_decode(model, clips):
    """The decoder rows stepping together give each row's tokens, log-prob and no-speech prob."""
    mels = torch.stack([pad_or_trim(log_mel_content(prepare_audio(pcm, rate)), N_FRAMES)   # 30 s windows
                        for pcm, rate in clips])
    cross = model.net.cross_kv(model.encode(mels))
    opts = DecodeOptions(language="en")
    got = model.decoder.decode_greedy_batch(cross, opts)
    assert len(got[0].tokens) > len(got[1].tokens) > 0
    for j, g in enumerate(got):
        want = model.decoder.decode(None, opts, cross=[(k[j:j + 1], v[j:j + 1]) for k, v in cross])
        assert g.tokens == want.tokens and g.text == want.text
        assert g.avg_logprob == pytest.approx(want.avg_logprob, abs=1e-4)
        assert g.no_speech_prob == pytest.approx(want.no_speech_prob, abs=1e-4)


@pytest.mark.parametrize("model", ["default"], indirect=True)   # the routing is path-independent
def test_unbatchable_requests_fall_back_one_by_one(model, clips, monkeypatch):
    """Sampling first (temperature > 0), audio over 30 s and a prompt of its own: same results,
    only the greedy <= 30 s clips share a batch."""
    (medium, rate), (short, _), _ = clips
    # Just over 30 s, two windows, with speech in each but half of it a pause: the routing is what
    # is tested, and four sentences of speech cost four times the decoding of the two here.
    long = np.concatenate([medium, np.zeros(14 * rate, medium.dtype), medium])
    assert len(long) / rate > 30
    requests = [{"audio": short, "sample_rate": rate, "temperature": 0.5},
                {"audio": long, "sample_rate": rate},
                {"audio": short, "sample_rate": rate, "initial_prompt": "Kitchen lights."},
                # Text only over > 30 s keeps little of the audio (the exact path, as openai-whisper
                # decodes it, reads one sentence of this clip), so the long clip keeps timestamps.
                {"audio": medium, "sample_rate": rate, "timestamps": False}]
    want = [model.transcribe(**r) for r in requests]
    sizes = _record_encoder_batches(model, monkeypatch)
    got = model.batch(requests)
    for g, w in zip(got, want):
        _same(g, w)
    assert len(got[1]["text"]) > 3 * len(got[0]["text"])
    assert sizes.count(1) == len(sizes)   # nothing shared a prompt here
    with pytest.raises(TypeError):
        model.batch([{"audio": short, "sample_rate": rate, "no_such_option": 1}])
    with pytest.raises(ValueError):
        model.batch([{"audio": np.zeros(0, np.float32), "sample_rate": rate}])
