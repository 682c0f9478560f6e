"""Whisper transcripts do not depend on the input's sample rate (issue 26, item 4): the same spoken
command at 16, 22.05, 44.1, 48 and 192 kHz reads the same words on the default (fitted encoder
context) path, and every segment lies within the audio. A fitted window whose first decode the
30 s context would not keep (a timestamp past the audio, a loop, a low log-prob) is encoded again
on 30 s rather than sent into temperature fallback on the shortened context."""
from __future__ import annotations

import subprocess

import pytest
import torch

from photon_core.audio_io import read_wav
from photon_core.models.whisper import load_whisper
from photon_core.models.whisper.decoding import DecodeResult
from photon_core.models.whisper.frontend import N_FRAMES
from photon_core.models.whisper.longform import FIT_STEP_FRAMES, LongFormOptions, fit_trusted

from speech_audio import espeak_wav, words

RATES = (16000, 22050, 44100, 48000, 192000)
# (text, espeak-ng words per minute). The second one, a 1.2 s command, is one the fitted context
# used to read differently at each rate ("Go turn the h blind" at 16 kHz, "Go turn the rent up."
# at 48 kHz), with its segment ending at 18-23 s.
COMMANDS = (("Go to the kitchen and bring me a cup.", 175), ("Go to the rent up.", 175))


@pytest.fixture(scope="module")
def model():
    speech = load_whisper("whisper-tiny.en")
    assert speech.audio_context == "fit"   # the CPU default path is the one under test
    return speech


def _at_rate(text: str, speed: int, rate: int, tmp_path) -> tuple:
    """The command as espeak-ng speaks it (22050 Hz), resampled by sox as a user's file would be."""
    src = espeak_wav(text, voice=None, speed=speed)
    if rate == 22050:
        return read_wav(src)
    out = tmp_path / f"{rate}.wav"
    subprocess.run(["sox", str(src), "-r", str(rate), str(out)], check=True)
    return read_wav(out)


@pytest.mark.parametrize("text, speed", COMMANDS)
def test_same_words_at_every_rate_and_segments_within_the_audio(model, tmp_path, text, speed):
    heard = {}
    for rate in RATES:
        pcm, got_rate = _at_rate(text, speed, rate, tmp_path)
        assert got_rate == rate
        result = model.transcribe(pcm, rate)
        heard[rate] = words(result["text"])
        assert result["segments"], f"nothing heard at {rate} Hz"
        for seg in result["segments"]:
            assert 0 <= seg["start"] <= seg["end"] <= result["duration"], (rate, seg, result["duration"])
    assert len({tuple(w) for w in heard.values()}) == 1, heard
    # the words spoken, give or take tiny.en's reading of espeak-ng's voice
    assert len(set(heard[16000]) & set(words(text))) >= len(words(text)) - 2, heard[16000]


def _result(tokens: list[int], avg_logprob: float = -0.2) -> DecodeResult:
    return DecodeResult(tokens, "", avg_logprob, 0.1, 0.0, 1.0)


def test_fit_trusted_rule(model):
    tb = model.tokenizer.timestamp_begin
    text = model.tokenizer.encode(" Stop.")
    opts = LongFormOptions()
    content = 120                        # 1.2 s of audio: timestamps up to 3.2 s are believable
    assert fit_trusted(_result([tb, *text, tb + 160]), opts, content, tb, 2)
    assert not fit_trusted(_result([tb, *text, tb + 161]), opts, content, tb, 2)   # past audio + 2 s
    assert not fit_trusted(_result([tb, *text, tb + 50], avg_logprob=-1.2), opts, content, tb, 2)
    loop = _result([tb, *text * 60, tb + 50])
    loop.compression_ratio = 10.0
    assert not fit_trusted(loop, opts, content, tb, 2)


def test_untrusted_fitted_window_is_decoded_on_30_s_and_clipped(model, monkeypatch):
    """A first decode ending at 18 s for a 1.2 s clip: the window is encoded again on 30 s and
    decoded there (the fallback's decode sees the 30 s features); the segment, whose closing
    timestamp still points past the audio, ends at the audio's end."""
    tb = model.tokenizer.timestamp_begin
    text = model.tokenizer.encode(" Go to the kitchen.")
    seen_frames: list[int] = []
    decoded_on: list[int] = []
    encode = model.net.encode

    def spy_encode(mel: torch.Tensor) -> torch.Tensor:
        seen_frames.append(mel.shape[-1])
        return encode(mel)

    def fake_decode(features, options, cross=None):
        decoded_on.append(cross[0][0].shape[2])   # encoder positions the decode attends to
        return _result([tb, *text, tb + 900])
    monkeypatch.setattr(model.net, "encode", spy_encode)
    monkeypatch.setattr(model.decoder, "decode", fake_decode)
    pcm = torch.randn(19200, generator=torch.Generator().manual_seed(0)).numpy() * 0.1
    result = model.transcribe(pcm, 16000)
    assert seen_frames == [FIT_STEP_FRAMES, N_FRAMES]
    assert decoded_on == [FIT_STEP_FRAMES // 2, N_FRAMES // 2]
    assert result["text"] == "Go to the kitchen."
    assert result["segments"] == [{"start": 0.0, "end": 1.2, "text": "Go to the kitchen."}]
