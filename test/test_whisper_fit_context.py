"""The fitted encoder context (the CPU default): a window with less than 30 s of audio is encoded
with its content + 2 s (in 5 s steps) when decoding with timestamps. The encoder on fewer frames
equals openai-whisper's own modules on them; the exact path (dtype="float32") keeps 30 s windows;
text-only decoding keeps 30 s; real speech still reads right."""
from __future__ import annotations

import pytest
import torch

from photon_core.backends import reference
from photon_core.models.whisper import load_whisper
from photon_core.models.whisper.checkpoint import load_checkpoint_file
from photon_core.models.whisper.config import WhisperDims
from photon_core.models.whisper.frontend import N_FRAMES
from photon_core.models.whisper.longform import FIT_MARGIN_FRAMES, FIT_STEP_FRAMES, encoder_frames
from photon_core.models.whisper.model import WhisperNet, WhisperWeights
from photon_core.models.whisper.transcribe import pick_audio_context

from speech_audio import words
from whisper_fixtures import SENTENCES, espeak, openai_model, tiny_en_path


def test_encoder_frames_rule():
    assert encoder_frames(123, fit=False) == N_FRAMES
    assert encoder_frames(0, fit=True) == FIT_STEP_FRAMES
    assert encoder_frames(FIT_STEP_FRAMES - FIT_MARGIN_FRAMES, fit=True) == FIT_STEP_FRAMES
    assert encoder_frames(FIT_STEP_FRAMES - FIT_MARGIN_FRAMES + 1, fit=True) == 2 * FIT_STEP_FRAMES
    assert encoder_frames(N_FRAMES - FIT_MARGIN_FRAMES + 1, fit=True) == N_FRAMES
    assert encoder_frames(N_FRAMES, fit=True) == N_FRAMES
    sizes = {encoder_frames(n, fit=True) for n in range(0, N_FRAMES + 1, 7)}
    assert sizes == set(range(FIT_STEP_FRAMES, N_FRAMES + 1, FIT_STEP_FRAMES))   # warm-up runs each


def test_which_paths_fit():
    cpu = torch.device("cpu")
    assert pick_audio_context(cpu, None, reference, "auto") == "fit"
    assert pick_audio_context(cpu, "float32", reference, "auto") == "full"   # the exact path
    assert pick_audio_context(cpu, None, reference, "full") == "full"
    assert pick_audio_context(torch.device("cuda"), None, reference, "auto") == "full"
    with pytest.raises(ValueError, match="unknown audio_context"):
        pick_audio_context(cpu, None, reference, "half")
    fake_triton = type("Ops", (), {})()
    with pytest.raises(ValueError, match="reference backend"):
        pick_audio_context(cpu, None, fake_triton, "fit")


def test_encoder_on_fewer_frames_equals_openai_whisper_modules():
    """Our encoder on 1000 mel frames (500 positions) == openai-whisper's conv stem, blocks and
    final norm on the same frames with the first 500 positional embeddings (its forward() accepts
    30 s only, so its modules are called one by one), real tiny.en weights, float32."""
    ckpt = load_checkpoint_file(tiny_en_path())
    dims = WhisperDims.from_state_dict(ckpt.state_dict, ckpt.n_audio_head, ckpt.n_text_head)
    net = WhisperNet(WhisperWeights(ckpt.state_dict, dims))
    enc = openai_model(ckpt.state_dict, dims).encoder
    mel = torch.randn(2, dims.n_mels, 1000, generator=torch.Generator().manual_seed(7))
    with torch.inference_mode():
        x = torch.nn.functional.gelu(enc.conv1(mel))
        x = torch.nn.functional.gelu(enc.conv2(x)).permute(0, 2, 1)
        x = x + enc.positional_embedding[:x.shape[1]]
        for block in enc.blocks:
            x = block(x)
        want = enc.ln_post(x)
        got = net.encode(mel)
    assert got.shape == (2, 500, dims.n_audio_state)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    for bad in (torch.zeros(1, dims.n_mels, 999), torch.zeros(1, dims.n_mels, 3002), torch.zeros(1, 40, 1000)):
        with pytest.raises(ValueError, match="encoder input"):
            net.encode(bad)


@pytest.fixture(scope="module")
def models():
    return {"fit": load_whisper("whisper-tiny.en"), "exact": load_whisper("whisper-tiny.en", dtype="float32")}


def _encoded_frames(model, monkeypatch) -> list[int]:
    frames: list[int] = []
    encode = model.net.encode

    def spy(mel: torch.Tensor) -> torch.Tensor:
        frames.append(mel.shape[-1])
        return encode(mel)
    monkeypatch.setattr(model.net, "encode", spy)
    return frames


def test_real_speech_through_the_fitted_context(models, monkeypatch):
    text, speed = SENTENCES["medium"]
    pcm, rate = espeak(text, speed)
    seconds = len(pcm) / rate
    assert 4 < seconds < 25
    fit, exact = models["fit"], models["exact"]
    assert fit.audio_context == "fit" and exact.audio_context == "full"
    seen = _encoded_frames(fit, monkeypatch)
    got = fit.transcribe(pcm, rate, temperature=0.0)
    want_frames = -(-(round(seconds * 100) + FIT_MARGIN_FRAMES) // FIT_STEP_FRAMES) * FIT_STEP_FRAMES
    assert seen and seen[0] in (want_frames, want_frames + FIT_STEP_FRAMES)   # content frames round up
    assert seen[0] < N_FRAMES
    # the words of the sentence, as the exact 30 s path reads them (espeak-ng speech is clear)
    reference_words = words(exact.transcribe(pcm, rate, temperature=0.0)["text"])
    assert words(got["text"]) == reference_words
    assert got["segments"] and 0 <= got["segments"][0]["start"] < got["segments"][-1]["end"] <= seconds + 0.5
    seen.clear()
    fit.transcribe(pcm, rate, timestamps=False, temperature=0.0)
    assert seen == [N_FRAMES]   # text-only decoding keeps 30 s: cut short, it can loop on noisy clips


def test_exact_path_encodes_30_s_windows(models, monkeypatch):
    pcm, rate = espeak(*SENTENCES["short"])
    seen = _encoded_frames(models["exact"], monkeypatch)
    models["exact"].transcribe(pcm, rate)
    assert seen and set(seen) == {N_FRAMES}


def test_warm_up_runs_every_fitted_shape(models, monkeypatch):
    seen = _encoded_frames(models["fit"], monkeypatch)
    models["fit"].warmup()
    assert set(range(FIT_STEP_FRAMES, N_FRAMES + 1, FIT_STEP_FRAMES)) <= set(seen)


def test_long_audio_fits_only_its_last_window(models, monkeypatch):
    """A 30 s window full of audio is encoded whole; the remainder after it is fitted, and the
    fitted window reads the words the same model reads on a 30 s context. (Compared with the same
    model on "full", not with the spoken text: on an AVX2-only CPU tiny.en hears "Robots are" in
    the first, full window as "Robot some" on every path, the exact float32 one included.)"""
    pcm, rate = espeak(*SENTENCES["long"])
    assert len(pcm) / rate > 32
    seen = _encoded_frames(models["fit"], monkeypatch)
    out = models["fit"].transcribe(pcm, rate, temperature=0.0)
    assert seen[0] == N_FRAMES and min(seen) < N_FRAMES
    full = load_whisper("whisper-tiny.en", audio_context="full")
    assert full.quantize == models["fit"].quantize
    want = full.transcribe(pcm, rate, temperature=0.0)
    assert words(out["text"]) == words(want["text"])
    assert {"library", "navigation", "river"} <= set(words(out["text"]))
