"""Concurrent utterances (several microphones on one engine) batched by Parakeet TDT and Qwen3-ASR:
`model.batch(requests)` gives, row for row, what `model.transcribe(**request)` gives alone, with the
heavy work done together (padded encoder with masks / one encoder pass, decoder rows stepping
together). Reference backend, tiny random checkpoints, real espeak-ng speech."""
from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

import parakeet_fixtures as pf
import test_qwen3_asr_reference as q3
from speech_audio import espeak_pcm

from photon_core.models.parakeet import load_parakeet
from photon_core.models.parakeet.tdt import greedy_tdt, greedy_tdt_many
from photon_core.runtime.batcher import Batcher


def _same(a: dict, b: dict) -> None:
    """Equal results but for the wall time each took."""
    a, b = dict(a), dict(b)
    a.pop("processing_time"), b.pop("processing_time")
    assert a == b


@pytest.fixture(scope="module")
def parakeet():
    return load_parakeet(pf.hf_checkpoint())


def _requests(short: np.ndarray, long: np.ndarray, rate: int) -> list[dict]:
    """What speech nodes send: a final, a partial (timestamps off, temperature 0) and silence."""
    return [{"audio": long, "sample_rate": rate, "language": "en", "initial_prompt": None},
            {"audio": short, "sample_rate": 16000, "language": None, "initial_prompt": "kitchen robot",
             "timestamps": False, "temperature": 0.0},
            {"audio": np.zeros(24000, np.float32), "sample_rate": 16000, "language": "en", "initial_prompt": None}]


def test_parakeet_batch_equals_one_at_a_time(parakeet):
    long, rate = espeak_pcm("Turn on the kitchen lights and move the robot arm to the left.")
    requests = _requests(pf.speech("stop it."), long, rate)
    together = parakeet.batch(requests)
    alone = [parakeet.transcribe(**r) for r in requests]
    for a, b in zip(together, alone):
        _same(a, b)
    assert together[0]["tokens"] and together[1]["tokens"] and len(together[0]["tokens"]) != len(together[1]["tokens"])
    assert together[2]["text"] == "" and together[2]["segments"] == []


def test_parakeet_padded_encoder_rows_equal_each_alone(parakeet):
    """The masks are what makes a padded row its own: without them the short row changes."""
    pcms = [pf.speech(), pf.speech("is it a test?")]
    mels = [parakeet.mel(p) for p in pcms]
    lengths = torch.tensor([m.shape[0] for m in mels])
    padded = torch.nn.utils.rnn.pad_sequence(mels, batch_first=True)
    with torch.inference_mode():
        together = parakeet.model.encode(padded, lengths)
        unmasked = parakeet.model.encode(padded)
        alone = [parakeet.model.encode(m[None])[0] for m in mels]
    frames = parakeet.model.subsampled_lengths(lengths).tolist()
    assert frames == [a.shape[0] for a in alone] and frames[0] > frames[1]
    for row, (a, n) in enumerate(zip(alone, frames)):
        torch.testing.assert_close(together[row, :n], a, rtol=1e-4, atol=1e-4)
    assert (unmasked[1, :frames[1]] - alone[1]).abs().max() > 1e-2


def test_parakeet_tdt_rows_step_together(parakeet):
    """greedy_tdt_many over rows of different lengths and states = greedy_tdt of each row."""
    pcms = [pf.speech(), pf.speech("the quick fox"), pf.speech("a")]
    with torch.inference_mode():
        projs = [parakeet.model.project_encoder(parakeet.model.encode(parakeet.mel(p)[None]))[0] for p in pcms]
        _, carried = greedy_tdt(parakeet.model, projs[2], max_symbols=3)
        states = [None, carried, None]
        alone = [greedy_tdt(parakeet.model, p, s, max_symbols=3, block=8) for p, s in zip(projs, states)]
        padded = torch.nn.utils.rnn.pad_sequence(projs, batch_first=True)
        together = greedy_tdt_many(parakeet.model, padded, [p.shape[0] for p in projs], states,
                                   max_symbols=3, block=8)
    for (s1, st1), (s2, st2) in zip(together, alone):
        assert (s1.tokens, s1.durations, s1.frames) == (s2.tokens, s2.durations, s2.frames)
        torch.testing.assert_close(st1.h, st2.h)
        torch.testing.assert_close(st1.pred, st2.pred)
    assert len({len(s.tokens) for s, _ in together}) == 3


def test_parakeet_long_audio_rows_carry_their_own_state():
    """Chunked long audio batched with a short clip: chunk r of each long row decodes in round r."""
    speech = load_parakeet(pf.hf_checkpoint(), chunk_seconds=1.5)
    pcm = pf.speech()
    noise = np.random.default_rng(3).normal(0, 0.05, 2 * 16000).astype(np.float32)
    requests = [{"audio": np.concatenate([pcm, noise, pcm]), "sample_rate": 16000},
                {"audio": pf.speech("is it"), "sample_rate": 16000},
                {"audio": np.concatenate([pcm[:20000], pcm]), "sample_rate": 16000}]
    for a, b in zip(speech.batch(requests), [speech.transcribe(**r) for r in requests]):
        _same(a, b)


def test_parakeet_batch_checks_every_request_first(parakeet):
    with pytest.raises(TypeError, match="tempreature"):
        parakeet.batch([{"audio": pf.speech(), "sample_rate": 16000},
                        {"audio": pf.speech(), "sample_rate": 16000, "tempreature": 0.0}])
    with pytest.raises(ValueError, match="sample_rate"):
        parakeet.batch([{"audio": pf.speech(), "sample_rate": 0}])


def test_engine_batcher_serves_concurrent_microphones(parakeet):
    """Three callers at once through runtime.Batcher over model.batch (as speech nodes sharing an
    engine do): one batch, each caller its own result."""
    requests = _requests(pf.speech("stop it."), pf.speech(), 16000)
    batcher = Batcher(parakeet.batch, threading.Lock(), window_s=0.5)
    results: list = [None] * 3
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, batcher.submit([requests[i]])[0]))
               for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    batcher.close()
    assert batcher.sizes == [3]
    for got, r in zip(results, requests):
        _same(got, parakeet.transcribe(**r))


def test_qwen3_asr_batch_equals_one_at_a_time():
    model = q3.ours()
    long, rate = espeak_pcm("Turn on the kitchen lights and move the robot arm to the left.")
    requests = _requests(q3.speech("Stop."), long, rate)
    requests[0]["max_new_tokens"] = 12
    requests[1]["max_new_tokens"] = 6
    together = model.batch(requests)
    alone = [model.transcribe(**r) for r in requests]
    for a, b in zip(together, alone):
        _same(a, b)
    assert together[0]["text"] and together[1]["text"]
    assert together[2]["text"] == "" and together[2]["no_speech_prob"] == 1.0


def test_qwen3_asr_encoder_pass_over_clips_equals_each_alone():
    model = q3.ours()
    clips = [model.features(q3.speech()), model.features(q3.speech("Stop.")), model.features(q3.speech("Go left."))]
    with torch.inference_mode():
        together = model.encoder.encode_many(clips)
        alone = [model.encode(mel, frames) for mel, frames in clips]
    assert [t.shape for t in together] == [a.shape for a in alone] and len({a.shape[0] for a in alone}) == 3
    for t, a in zip(together, alone):
        torch.testing.assert_close(t, a, rtol=1e-4, atol=1e-4)
