"""Long files in pieces (issue 26, item 8): `open_audio_stream` gives, block by block, the samples
`read_wav` gives whole (any format it reads, files cut short, the same refusals); the streamed
front end (resampler and log-mel, window by window) equals the whole-file one bit for bit; and
`transcribe_stream` gives `transcribe`'s result."""
from __future__ import annotations

import logging
import subprocess

import numpy as np
import pytest
import torch

from photon_core.audio_io import AudioFileError, open_audio_stream, read_wav, write_wav
from photon_core.models.whisper.frontend import log_mel_content, prepare_audio
from photon_core.models.whisper.stream_frontend import StreamedLogMel, StreamResampler, pcm_16k_blocks

from speech_audio import espeak_wav
from test_audio_io import FLOAT, PCM, wav_bytes


def _streamed(path, frames: int) -> np.ndarray:
    stream = open_audio_stream(path)
    blocks = list(stream.blocks(frames))
    assert all(len(b) == frames for b in blocks[:-1]) and sum(map(len, blocks)) == stream.frames
    return np.concatenate(blocks)


@pytest.mark.parametrize("channels, sox_args", [
    (1, ["-e", "signed-integer", "-b", "16"]), (3, ["-e", "signed-integer", "-b", "24"]),
    (2, ["-e", "floating-point", "-b", "32"]), (1, ["-e", "unsigned-integer", "-b", "8"])])
def test_blocks_equal_the_whole_file(tmp_path, channels, sox_args):
    t = np.arange(4000) / 16000
    write_wav(tmp_path / "src.wav", np.stack([0.3 * np.sin(2 * np.pi * 300 * (c + 1) * t)
                                              for c in range(channels)], -1).squeeze(), 16000)
    out = tmp_path / "out.wav"
    subprocess.run(["sox", "-D", str(tmp_path / "src.wav"), *sox_args, str(out)], check=True)
    whole, rate = read_wav(out)
    assert open_audio_stream(out).rate == rate and open_audio_stream(out).channels == channels
    got = _streamed(out, 999)
    assert got.dtype == whole.dtype and np.array_equal(got, whole)


def test_a_file_cut_short_reads_its_whole_frames_with_the_warning(tmp_path, caplog):
    path = tmp_path / "cut.wav"
    data = np.arange(-500, 500, dtype="<i2").tobytes()
    path.write_bytes(wav_bytes(PCM, 2, 16000, 2, data + b"\x01", declared=len(data) + 400))
    with caplog.at_level(logging.WARNING):
        whole, _ = read_wav(path)
        said_whole = caplog.messages
        caplog.clear()
        stream = open_audio_stream(path)
    assert caplog.messages == said_whole and "read 500 whole frames" in said_whole[0]
    assert stream.frames == 500 and np.array_equal(_streamed(path, 64), whole)


def test_a_data_size_left_at_0_reads_to_the_end_with_a_warning(tmp_path, caplog):
    # A writer that never closed the file (a recorder killed mid-take) leaves the size at 0.
    path = tmp_path / "open.wav"
    data = np.arange(-500, 500, dtype="<i2").tobytes()
    path.write_bytes(wav_bytes(PCM, 1, 16000, 2, data, declared=0))
    with caplog.at_level(logging.WARNING):
        whole, _ = read_wav(path)
        stream = open_audio_stream(path)
    said = list(caplog.messages)
    assert len(said) == 2 and all("declares 0 bytes but 2000 follow" in m for m in said)
    assert len(whole) == 1000 and np.array_equal(whole, np.arange(-500, 500, dtype=np.int16))
    assert stream.frames == 1000 and np.array_equal(_streamed(path, 64), whole)
    # a really empty data chunk, a metadata chunk after it: empty, and nothing said
    caplog.clear()
    empty = wav_bytes(PCM, 1, 16000, 2, b"") + b"LIST" + (4).to_bytes(4, "little") + b"INFO"
    for tail in (b"", b"\x00", b"\x00" * 4):     # and a writer's few bytes of padding after it
        (tmp_path / "empty.wav").write_bytes(empty + tail)
        with caplog.at_level(logging.WARNING):
            assert len(read_wav(tmp_path / "empty.wav")[0]) == 0 and open_audio_stream(tmp_path / "empty.wav").frames == 0
    assert caplog.messages == []


@pytest.mark.parametrize("data, said", [
    (wav_bytes(PCM, 1, 0, 2, bytes(8)), "declares a sample rate of 0 Hz"),
    (wav_bytes(PCM, 1, 16000, 2, b"")[:36], "no data chunk"),
    (b"RIFF\x00\x00\x00\x00WAVEdata\x04\x00\x00\x00\x00\x00\x00\x00", "data before the fmt chunk")])
def test_damaged_files_are_refused_when_opened_as_read_wav_refuses_them(tmp_path, data, said):
    path = tmp_path / "bad.wav"
    path.write_bytes(data)
    with pytest.raises(AudioFileError) as whole:
        read_wav(path)
    with pytest.raises(AudioFileError) as streamed:
        open_audio_stream(path)
    assert str(streamed.value) == str(whole.value) and said in str(whole.value)
    with pytest.raises(AudioFileError, match="no such file"):
        open_audio_stream(tmp_path / "none.wav")
    with pytest.raises(AudioFileError, match="is a directory"):
        open_audio_stream(tmp_path)


def test_a_bad_sample_is_named_by_its_frame_in_the_file(tmp_path):
    samples = np.zeros(40, "<f4")
    samples[[23, 30]] = np.nan
    path = tmp_path / "nan.wav"
    path.write_bytes(wav_bytes(FLOAT, 1, 16000, 4, samples.tobytes()))
    stream = open_audio_stream(path)   # the header is fine: found when read
    with pytest.raises(AudioFileError, match=r"nan.wav: holds NaN .*\(1 of them, the first in frame 23\)"):
        list(stream.blocks(10))


@pytest.mark.parametrize("rate", [16000, 44100])
def test_a_stream_on_the_int16_scale_is_refused_as_the_whole_file_is(tmp_path, rate):
    # The streamed front end (Whisper's transcribe_stream, the CLI's path for it) took a float file
    # of int16 values as it is, as prepare_audio did with the whole one.
    tone = 0.1 * np.sin(2 * np.pi * 440 * np.arange(rate) / rate)
    path = tmp_path / "int16_scale.wav"
    path.write_bytes(wav_bytes(FLOAT, 2, rate, 4, np.repeat(tone * 32768, 2).astype("<f4").tobytes()))
    with pytest.raises(ValueError, match="int16 values stored as floats; divide them by 32768"):
        prepare_audio(*read_wav(path))
    with pytest.raises(ValueError, match="int16 values stored as floats; divide them by 32768"):
        list(pcm_16k_blocks(open_audio_stream(path)))


@pytest.mark.parametrize("rate", [16000, 22050, 44100, 48000, 192000, 8000])
def test_streamed_front_end_equals_the_whole_one_bit_for_bit(rate):
    """Small pieces (0.2 s resampler hops, 70-frame mel pieces), odd block sizes, a silent stretch
    and signals shorter than the STFT's reflection: the same 16 kHz samples and log-mel frames."""
    rng = np.random.default_rng(rate)
    for n in (150, rate * 3 + 37):
        x = (rng.standard_normal(n) * 0.1).astype(np.float32)
        x[n // 3:n // 2] = 0
        whole = prepare_audio(x, rate)
        resampler = StreamResampler(rate, hop_s=0.2)
        pieces = [resampler.push(x[i:i + 777]) for i in range(0, n, 777)] + [resampler.finish()]
        pcm = np.concatenate(pieces)
        assert np.array_equal(pcm, whole), (rate, n)

        def blocks():
            return (pcm[i:i + 1001] for i in range(0, len(pcm), 1001))
        mel = StreamedLogMel(blocks, 80, piece_frames=70)
        want = log_mel_content(whole)
        assert mel.n_samples == len(whole) and mel.content_frames == want.shape[1]
        got = [mel.frames(s, s + 100).clone() for s in range(0, mel.content_frames, 100)]
        assert torch.equal(torch.cat(got, 1) if got else torch.zeros(80, 0), want)
        if mel.content_frames > 100:
            with pytest.raises(ValueError, match="already released"):
                mel.frames(0, 10)
    with pytest.raises(ValueError, match="audio is empty"):
        StreamedLogMel(lambda: iter([]), 80)


def test_transcribe_stream_equals_transcribe(tmp_path):
    from photon_core.models.whisper import load_whisper
    path = tmp_path / "cmd48.wav"
    subprocess.run(["sox", str(espeak_wav("Go to the kitchen and bring me a cup.", voice=None, speed=175)),
                    "-r", "48000", str(path)], check=True)
    model = load_whisper("whisper-tiny.en")
    samples, rate = read_wav(path)
    want = model.transcribe(samples, rate)
    got = model.transcribe_stream(open_audio_stream(path))
    want.pop("processing_time"), got.pop("processing_time")
    assert got == want and "kitchen" in got["text"].lower()
