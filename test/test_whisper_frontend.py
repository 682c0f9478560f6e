"""Front end: log-mel equal to openai-whisper's, our Slaney filterbank, input checks."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from photon_core.models.whisper import frontend as fe

from whisper_fixtures import SENTENCES, espeak, to_16k_float

whisper = pytest.importorskip("whisper")


@pytest.fixture(scope="module")
def speech():
    text, speed = SENTENCES["medium"]
    return espeak(text, speed)


@pytest.mark.parametrize("n_mels", [80, 128])
def test_filterbank_matches_openai(n_mels):
    ours = fe.mel_filterbank(n_mels)
    ref = whisper.audio.mel_filters("cpu", n_mels).numpy()
    assert ours.shape == ref.shape == (n_mels, 201)
    np.testing.assert_allclose(ours, ref, rtol=0, atol=1e-7)


@pytest.mark.parametrize("n_mels", [80, 128])
def test_log_mel_matches_openai_on_speech(speech, n_mels):
    pcm, sr = speech
    x = fe.prepare_audio(pcm, sr)
    ref = whisper.log_mel_spectrogram(whisper.pad_or_trim(x), n_mels=n_mels)
    ours = fe.log_mel_spectrogram(x, n_mels, padding=fe.N_SAMPLES - len(x))
    assert ours.shape == ref.shape == (n_mels, fe.N_FRAMES)
    assert (ours - ref).abs().max().item() < 1e-4
    # the long-form path: whole clip + 30 s of zeros
    ref_long = whisper.log_mel_spectrogram(x, n_mels=n_mels, padding=fe.N_SAMPLES)
    ours_long = fe.log_mel_spectrogram(x, n_mels, padding=fe.N_SAMPLES)
    assert (ours_long - ref_long).abs().max().item() < 1e-4


def test_log_mel_content_equals_padded_version(speech):
    pcm, sr = speech
    rng = np.random.default_rng(0)
    x = fe.prepare_audio(pcm, sr)
    clips = [x, x[:16000 * 2 + 77], np.concatenate([x, 3 * np.ones(5, np.float32)]),
             rng.normal(0, 0.1, 161).astype(np.float32)]
    for clip in clips:
        full = fe.log_mel_spectrogram(clip, 80, padding=fe.N_SAMPLES)
        content = fe.log_mel_content(clip, 80)
        assert content.shape[-1] == len(clip) // fe.HOP_LENGTH == full.shape[-1] - fe.N_FRAMES
        assert (full[:, :content.shape[-1]] - content).abs().max().item() < 1e-6


def test_log_mel_runs_where_the_model_is(speech):
    """A GPU model's features are computed on its device (the meta device stands in for one here:
    every step of the STFT and the filterbank follows the audio there, nothing falls back to the
    CPU's tensors); a CPU model's on the CPU, unchanged."""
    from photon_core.runtime.audio_frontend import feature_device
    x = fe.prepare_audio(*speech)
    here = fe.log_mel_content(x, 128)
    there = fe.log_mel_content(x, 128, device=torch.device("meta"))
    assert there.device.type == "meta" and there.shape == here.shape
    assert feature_device(torch.device("cuda", 1)) == torch.device("cuda", 1)
    assert feature_device(torch.device("cpu")) is None
    assert torch.equal(fe.log_mel_content(x, 128, device=feature_device(torch.device("cpu"))), here)


def test_resample_matches_reference_and_preserves_tone():
    t = np.arange(44100) / 44100
    tone = (0.5 * np.sin(2 * np.pi * 440 * t) * 32767).astype(np.int16)
    y = fe.prepare_audio(tone, 44100)
    assert y.dtype == np.float32 and len(y) == 16000
    spectrum = np.abs(np.fft.rfft(y))
    assert abs(np.argmax(spectrum) - 440) <= 1          # 1 Hz bins over 1 s
    np.testing.assert_allclose(y, to_16k_float(tone, 44100), atol=1e-6)


def test_integral_float_rate_is_accepted():
    assert len(fe.prepare_audio(np.zeros(441, np.int16), 44100.0)) == 160


def test_integer_scaling_and_mixdown():
    assert fe.to_float_mono(np.array([-32768, 16384], np.int16)).tolist() == [-1.0, 0.5]
    assert fe.to_float_mono(np.array([0, 128, 192], np.uint8)).tolist() == [-1.0, 0.0, 0.5]
    assert fe.to_float_mono(np.array([-2 ** 31], np.int32)).tolist() == [-1.0]
    # float samples no audio has: refused by name (1e18 failed in torch's quantization), as read_wav does;
    # a float64 beyond float32's range is one of them, not "infinite"
    for huge in (np.array([0.0, 1e18], np.float32), np.array([1e300, 0.0])):
        with pytest.raises(ValueError, match="float samples up to .*not audio"):
            fe.to_float_mono(huge)
    # int16 values stored as floats: refused, saying so (they shifted every log-mel feature by ~2.3)
    with pytest.raises(ValueError, match="int16 values stored as floats"):
        fe.to_float_mono(np.array([0.0, 32768.0], np.float32))
    assert fe.to_float_mono(np.array([0.0, 3.5], np.float32)).tolist() == [0.0, 3.5]   # hot, but audio
    stereo = np.array([[32767, -32767], [16384, 16384]], np.int16)
    np.testing.assert_allclose(fe.to_float_mono(stereo), [0.0, 0.5], atol=1e-4)


@pytest.mark.parametrize("audio, rate, match", [
    (np.array([0.0, np.nan], np.float32), 16000, "NaN"),
    (np.array([0.0, np.inf], np.float32), 16000, "NaN or infinite"),
    (np.zeros(0, np.float32), 16000, "empty"),
    (np.zeros((0, 2), np.int16), 16000, "empty"),
    (np.zeros(100, np.float32), 0, "sample_rate"),
    (np.zeros(100, np.float32), -8000, "sample_rate"),
    (np.zeros(100, np.float32), 16000.5, "sample_rate"),
    (np.zeros(100, np.float32), float("nan"), "sample_rate"),
    (np.zeros((2, 2, 2), np.float32), 16000, "shape"),
    (np.array(["a"]), 16000, "dtype"),
])
def test_bad_input_raises(audio, rate, match):
    with pytest.raises(ValueError, match=match):
        fe.prepare_audio(audio, rate)


def test_pad_or_trim():
    x = torch.arange(10.0)
    assert fe.pad_or_trim(x, 4).tolist() == [0, 1, 2, 3]
    assert fe.pad_or_trim(x, 12).tolist()[-3:] == [9, 0, 0]
    assert fe.pad_or_trim(torch.ones(80, 5), 8).shape == (80, 8)


@pytest.mark.parametrize("width, dtype", [(1, np.uint8), (2, np.int16), (4, np.int32)])
def test_reads_pcm_wav(tmp_path, width, dtype):
    import wave
    from photon_core.audio_io import read_wav
    info = np.iinfo(dtype)
    samples = np.array([[info.min, info.max], [0, 1]], dtype=dtype)    # 2 frames, stereo
    with wave.open(str(tmp_path / "x.wav"), "wb") as w:
        w.setnchannels(2), w.setsampwidth(width), w.setframerate(8000)
        w.writeframes(samples.astype(np.dtype(dtype).newbyteorder("<")).tobytes())
    data, rate = read_wav(tmp_path / "x.wav")
    assert rate == 8000 and data.dtype == np.dtype(dtype).newbyteorder("<")
    np.testing.assert_array_equal(data, samples)
    assert fe.prepare_audio(data, rate).dtype == np.float32


@pytest.mark.parametrize("shape", [(2, 48000), (1, 16000), (6, 4800), (2, 40)])
def test_channel_first_audio_is_refused_not_misread(shape):
    # torchaudio and librosa give [channels, samples]; read as [samples, channels] a second of
    # stereo would become 2 "samples" of audio without a word of warning.
    planar = np.sin(np.arange(shape[0] * shape[1]) * 0.05).reshape(shape).astype(np.float32)
    with pytest.raises(ValueError, match=r"channel-first.*\[samples, channels\]"):
        fe.prepare_audio(planar, 48000)
    assert len(fe.prepare_audio(planar.T, 48000)) == -(-shape[1] // 3)   # transposed: all of it, at 16 kHz
    if shape[1] > 64:     # any real length: refused by the block-level conversion too
        with pytest.raises(ValueError, match="channel-first"):
            fe.to_float_mono(planar)
    # the last block of a streamed stereo file may hold one frame: still [samples, channels]
    np.testing.assert_allclose(fe.to_float_mono(np.array([[0.5, 0.25]], np.float32)), [0.375])


@pytest.mark.parametrize("dtype", [np.uint16, np.uint32])
def test_unsigned_pcm_wider_than_8_bits_is_refused_by_name(dtype):
    # Scaled as signed it divides by zero: NaN, and an error about NaN that hides the cause.
    with pytest.raises(ValueError, match=rf"unsupported audio dtype {np.dtype(dtype).name}"):
        fe.prepare_audio(np.array([0, 32768, 65535], dtype), 16000)
