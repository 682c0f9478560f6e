"""The WAV reader (photon_core.audio_io.read_wav): WAVE_FORMAT_EXTENSIBLE and float files with any
channel count, as sox writes them and as written here byte by byte, read to the same samples as
the 16-bit source; damaged files refused with the file's name and the reason, never an internal
error; the WAV publisher refusing a zero speed or chunk at startup."""
import importlib.util
import logging
import struct
import subprocess
import sys

import numpy as np
import pytest

from photon_core.audio_io import AudioFileError, open_audio_stream, pcm_to_float, read_wav, write_wav
from photon_core.runtime.audio_frontend import prepare_audio

PCM, FLOAT, EXTENSIBLE = 1, 3, 0xFFFE


def wav_bytes(tag, channels, rate, width, data, extensible=False, extra=b"", declared=None):
    """A WAV file written field by field: the fmt chunk (plain, or WAVE_FORMAT_EXTENSIBLE with the
    subformat GUID KSDATAFORMAT_SUBTYPE_PCM / _IEEE_FLOAT), `extra` chunks, then the data chunk
    declaring `declared` bytes (default: its length)."""
    block = width * channels
    fmt = struct.pack("<HHIIHH", EXTENSIBLE if extensible else tag, channels, rate, rate * block, block, 8 * width)
    if extensible:
        guid = struct.pack("<H", tag) + bytes.fromhex("000000001000800000aa00389b71")
        fmt += struct.pack("<HHI", 22, 8 * width, (1 << channels) - 1) + guid
    body = b"WAVE" + b"fmt " + struct.pack("<I", len(fmt)) + fmt + extra
    body += b"data" + struct.pack("<I", len(data) if declared is None else declared) + data
    return b"RIFF" + struct.pack("<I", len(body)) + body


def source(tmp_path, channels):
    """A 16-bit file: a different tone in each channel, so a mixed-up channel order shows."""
    t = np.arange(1600) / 16000
    tones = np.stack([0.5 * np.sin(2 * np.pi * (220 * (c + 1)) * t) for c in range(channels)], -1)
    path = tmp_path / f"src{channels}.wav"
    write_wav(path, tones, 16000)
    return path, pcm_to_float(read_wav(path)[0])


@pytest.mark.parametrize("channels, sox_args, dtype, tag", [
    (4, ["-e", "signed-integer", "-b", "16"], np.int16, EXTENSIBLE),
    (6, ["-e", "signed-integer", "-b", "24"], np.int32, EXTENSIBLE),
    (1, ["-e", "signed-integer", "-b", "24"], np.int32, EXTENSIBLE),
    (3, ["-e", "unsigned-integer", "-b", "8"], np.uint8, EXTENSIBLE),
    (3, ["-e", "signed-integer", "-b", "32"], np.int32, EXTENSIBLE),
    (2, ["-e", "floating-point", "-b", "32"], np.float32, FLOAT),     # sox writes float plainly;
    (5, ["-e", "floating-point", "-b", "64"], np.float32, FLOAT)])    # extensible float: below
def test_reads_what_sox_writes_for_any_channel_count(tmp_path, channels, sox_args, dtype, tag):
    src, expected = source(tmp_path, channels)
    out = tmp_path / "out.wav"
    subprocess.run(["sox", "-D", str(src), *sox_args, str(out)], check=True)   # -D: no dither
    assert struct.unpack("<H", out.read_bytes()[20:22])[0] == tag, "sox writes another header now"
    samples, rate = read_wav(out)
    assert rate == 16000 and samples.dtype == dtype and samples.shape == expected.shape
    step = 1 / 128 if dtype == np.uint8 else 1 / 32768   # the coarser of the two quantizations
    np.testing.assert_allclose(pcm_to_float(samples), expected, atol=step)


def test_extensible_and_float_files_written_byte_by_byte(tmp_path):
    # 24-bit: extremes, zero and one step, in 3 channels; an odd-sized chunk (padded) before data.
    values = np.array([[-2**23, 2**23 - 1, 0], [1, -1, 2**22]], np.int64)
    raw = b"".join(int(v).to_bytes(3, "little", signed=True) for v in values.ravel())
    path = tmp_path / "s24.wav"
    path.write_bytes(wav_bytes(PCM, 3, 48000, 3, raw, extensible=True, extra=b"LIST\x03\x00\x00\x00abc\x00"))
    samples, rate = read_wav(path)
    assert rate == 48000 and samples.dtype == np.int32
    np.testing.assert_array_equal(samples, values * 256)
    np.testing.assert_array_equal(pcm_to_float(samples)[0, :2], [-1.0, (2**23 - 1) / 2**23])

    f64 = np.array([[0.25, -0.5], [1.0, -1.0], [0.0, 0.125]])
    path.write_bytes(wav_bytes(FLOAT, 2, 8000, 8, f64.astype("<f8").tobytes(), extensible=True))
    samples, rate = read_wav(path)
    assert rate == 8000 and samples.dtype == np.float32
    np.testing.assert_array_equal(samples, f64)

    f32 = np.array([0.5, -0.25, 0.75], "<f4")
    path.write_bytes(wav_bytes(FLOAT, 1, 22050, 4, f32.tobytes()))    # plain format tag 3
    samples, rate = read_wav(path)
    assert rate == 22050 and samples.shape == (3,)
    np.testing.assert_array_equal(samples, f32)


def test_a_file_cut_mid_frame_reads_its_whole_frames_and_says_so(tmp_path, caplog):
    pcm = np.arange(-5, 6, dtype="<i2")
    path = tmp_path / "cut.wav"
    path.write_bytes(wav_bytes(PCM, 1, 16000, 2, pcm.tobytes() + b"\x07", declared=2 * len(pcm) + 2))
    with caplog.at_level(logging.WARNING, logger="photon_core.audio_io"):
        samples, rate = read_wav(path)
    np.testing.assert_array_equal(samples, pcm)
    assert str(path) in caplog.text and "1 byte(s) of a partial frame dropped" in caplog.text


@pytest.mark.parametrize("make, message", [
    (lambda: wav_bytes(PCM, 1, 0, 2, bytes(8)), "declares a sample rate of 0 Hz"),
    (lambda: wav_bytes(PCM, 0, 16000, 2, bytes(8)), "declares 0 channels"),
    (lambda: wav_bytes(FLOAT, 1, 16000, 4, np.array([0.1, 1e30], "<f4").tobytes()), "float samples up to 1e+30"),
    (lambda: wav_bytes(FLOAT, 1, 16000, 4, np.array([0.1, np.nan, np.inf], "<f4").tobytes()),
     "holds NaN or infinite samples (2 of them, the first in frame 1)"),
    (lambda: wav_bytes(0x0002, 1, 16000, 1, bytes(8)), "format tag 0x0002 samples of 8 bits are not read here"),
    (lambda: wav_bytes(PCM, 1, 16000, 2, b"")[:36], "no data chunk"),
    (lambda: b"fLaC" + bytes(40), "not a RIFF/WAVE file")])
def test_damaged_or_unreadable_files_are_refused_naming_the_file(tmp_path, make, message):
    path = tmp_path / "bad.wav"
    path.write_bytes(make())
    with pytest.raises(AudioFileError) as err:
        read_wav(path)
    assert str(err.value).startswith(f"{path}: ") and message in str(err.value)
    if message in ("not a RIFF/WAVE file", "format tag 0x0002 samples of 8 bits are not read here"):
        # soundfile, where installed, gets its try first; without it, the way out is said.
        assert _has_soundfile() or f"sox {path} -e signed-integer -b 16 out.wav" in str(err.value)


def test_float_audio_on_the_int16_scale_is_read_but_refused_as_model_input(tmp_path):
    """A float WAV holding int16 values (peak 3276.8) went through read_wav and prepare_audio without
    a word, and Whisper's log-mel of it sat ~2.3 above the real one's in every bin. read_wav still
    reads the file (the WAV player rescales such files); the models' front end refuses it."""
    tone = (0.1 * np.sin(2 * np.pi * 440 * np.arange(16000) / 16000)).astype(np.float32)
    path = tmp_path / "int16_scale.wav"
    path.write_bytes(wav_bytes(FLOAT, 1, 16000, 4, (tone * 32768).astype("<f4").tobytes()))
    samples, rate = read_wav(path)
    assert np.abs(samples).max() == pytest.approx(3276.8)
    said = r"float samples up to 3276\.8.*looks like int16 values stored as floats; divide them by 32768"
    with pytest.raises(ValueError, match=said):
        prepare_audio(samples, rate)
    with pytest.raises(ValueError, match=said):   # an array passed to transcribe, float64, stereo
        prepare_audio(np.stack([tone.astype(np.float64) * 32768] * 2, -1), 16000)
    with pytest.raises(ValueError, match="int16 values stored as floats"):
        prepare_audio(tone / 0.1 * 4.5, 16000)
    for peak in (1.2, 3.0, 4.0):   # hot but real: resampling overshoot, gain before a limiter
        hot = (tone / np.abs(tone).max() * peak).astype(np.float32)
        np.testing.assert_array_equal(prepare_audio(hot, 16000), hot)


def _has_soundfile():
    return importlib.util.find_spec("soundfile") is not None


def test_a_folder_or_a_missing_file_is_named(tmp_path):
    with pytest.raises(AudioFileError, match=f"^{tmp_path}: is a directory"):
        read_wav(tmp_path)
    with pytest.raises(AudioFileError, match="nope.wav: no such file"):
        read_wav(tmp_path / "nope.wav")


def test_wav_publisher_refuses_a_zero_speed_or_chunk_at_startup(tmp_path):
    wav = tmp_path / "a.wav"
    write_wav(wav, np.zeros(160, np.int16), 16000)
    # Both at once (each start costs a second of imports); a node that spun instead would time out.
    runs = [subprocess.Popen([sys.executable, "-m", "photon_ros.wav_publisher", "--ros-args",
                              "-p", f"file:={wav}", "-p", setting], stderr=subprocess.PIPE, text=True)
            for setting in ("speed:=0", "chunk_ms:=0")]
    results = [(run.wait(timeout=60), run.stderr.read()) for run in runs]
    assert results[0][0] == 1 and "speed must be > 0, got 0" in results[0][1]
    assert results[1][0] == 1 and "chunk_ms must be >= 1, got 0" in results[1][1]
    assert "Traceback" not in results[0][1] + results[1][1]


def test_24_bit_samples_in_32_bit_words_are_read_where_they_sit(tmp_path, caplog):
    """A plain PCM header of 24 bits in 4-byte words: `arecord -f S24_LE` writes the samples
    right-justified, which read as int32 were 48 dB too quiet (under the speech detector's
    floor); left-justified ones (the WAVE rule) are read as they are."""
    tone = np.round(0.5 * 2**23 * np.sin(np.arange(800) / 5)).astype(np.int32)   # -6 dBFS

    def written(samples, name):
        data = bytearray(wav_bytes(PCM, 1, 16000, 4, samples.astype("<i4").tobytes()))
        data[34:36] = struct.pack("<H", 24)   # wBitsPerSample 24, in 4-byte blocks
        path = tmp_path / name
        path.write_bytes(bytes(data))
        return read_wav(path)[0]

    with caplog.at_level(logging.WARNING):
        right = written(tone, "s24_le.wav")
    np.testing.assert_array_equal(right, tone << 8)
    assert "right-justified" in caplog.text
    np.testing.assert_array_equal(written(tone << 8, "left.wav"), tone << 8)
    # streamed (the CLI's transcribe reads files so), block by block, the same samples
    for name in ("s24_le.wav", "left.wav"):
        streamed = np.concatenate(list(open_audio_stream(tmp_path / name).blocks(frames=128)))
        np.testing.assert_array_equal(streamed, read_wav(tmp_path / name)[0])


def test_integer_samples_given_as_a_list_are_refused_not_silenced():
    """A list of int16 values is int64 to numpy; scaled by 2**63 the speech was silence (~1e-15)
    and the transcript empty without a word. No PCM is 64-bit."""
    from photon_core.runtime.audio_frontend import to_float_mono

    speech = [0, 12000, -20000, 32767]
    for given in (speech, np.array(speech)):
        with pytest.raises(ValueError, match=r"int64.*np.asarray\(samples, np.int16\)"):
            pcm_to_float(given)
        with pytest.raises(ValueError, match="int64"):
            to_float_mono(given)
    assert pcm_to_float(np.asarray(speech, np.int16)).max() == pytest.approx(32767 / 32768)


@pytest.mark.parametrize("dtype", [np.uint16, np.uint32, np.uint64])
def test_unsigned_pcm_wider_than_8_bits_is_refused_by_name(dtype):
    # uint8 is WAV's unsigned 8-bit PCM; wider unsigned types have no such convention, and scaled
    # like signed ones they divided by zero into NaN and inf without a word.
    with pytest.raises(ValueError, match=rf"unsupported audio dtype {np.dtype(dtype).name}.*signed"):
        pcm_to_float(np.array([0, 32768, 65535], dtype))
    assert pcm_to_float(np.array([0, 128, 255], np.uint8)).tolist() == [-1.0, 0.0, 127 / 128]
