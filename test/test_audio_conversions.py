"""Audio messages <-> float32 mono PCM, both directions, and malformed chunks."""
import numpy as np
import pytest
from std_msgs.msg import Float32MultiArray, Int16MultiArray

from photon_ros.audio_conversions import (FLOAT_PEAK_LIMIT, audio_chunk_to_pcm, float32_array_to_pcm,
                                          int16_array_to_pcm, pcm_to_audio_chunk,
                                          pcm_to_float32_array, pcm_to_int16_array)
from photon_ros.msg import AudioChunk


@pytest.fixture
def pcm():
    rng = np.random.default_rng()
    return (rng.uniform(-0.9, 0.9, size=1601)).astype(np.float32)


@pytest.mark.parametrize("fmt, tol", [("S16LE", 1 / 32768), ("S32LE", 1e-6), ("F32LE", 0), ("U8", 1 / 128)])
def test_audio_chunk_round_trip(pcm, fmt, tol):
    out = audio_chunk_to_pcm(pcm_to_audio_chunk(pcm, 16000, fmt))
    assert out.sample_rate == 16000 and out.samples.dtype == np.float32
    np.testing.assert_allclose(out.samples, pcm, atol=tol)


def test_int16_input_is_sent_exactly():
    ints = np.array([-32768, -1, 0, 1, 32767], dtype=np.int16)
    out = audio_chunk_to_pcm(pcm_to_audio_chunk(ints, 8000, "S16LE"))
    np.testing.assert_array_equal(out.samples, ints / 32768.0)


def test_stereo_is_mixed_to_mono(pcm):
    stereo = np.stack([pcm, -pcm * 0.5], axis=1)
    out = audio_chunk_to_pcm(pcm_to_audio_chunk(stereo, 48000, "F32LE"))
    np.testing.assert_allclose(out.samples, pcm * 0.25, atol=1e-7)
    out = float32_array_to_pcm(pcm_to_float32_array(stereo), 48000)   # layout carries channels
    np.testing.assert_allclose(out.samples, pcm * 0.25, atol=1e-7)


def test_multiarrays_round_trip(pcm):
    out = int16_array_to_pcm(pcm_to_int16_array(pcm), 16000)
    np.testing.assert_allclose(out.samples, pcm, atol=1 / 32768)
    out = float32_array_to_pcm(pcm_to_float32_array(pcm), 22050)
    np.testing.assert_array_equal(out.samples, pcm)
    assert out.sample_rate == 22050


def test_plain_multiarray_without_layout(pcm):
    msg = Float32MultiArray(data=pcm.tolist())
    np.testing.assert_allclose(float32_array_to_pcm(msg, 16000).samples, pcm)
    stereo = Int16MultiArray(data=[100, 300, -100, -300])
    np.testing.assert_allclose(int16_array_to_pcm(stereo, 16000, channels=2).samples,
                               np.array([200, -200]) / 32768.0)


def test_float_overshoot_within_the_limit_is_kept():
    values = np.array([0.5, -1.5, FLOAT_PEAK_LIMIT], np.float32)
    chunk = AudioChunk(sample_rate=16000, channels=1, sample_format="F32LE", data=values.astype("<f4").tobytes())
    np.testing.assert_array_equal(audio_chunk_to_pcm(chunk).samples, values)
    np.testing.assert_array_equal(float32_array_to_pcm(Float32MultiArray(data=values.tolist()), 16000).samples, values)


def nan_chunk():   # another publisher's: ours refuses to write one (test_nan_samples_are_not_published)
    return AudioChunk(sample_rate=16000, channels=1, sample_format="F32LE",
                      data=np.array([0.1, np.nan, 0.2], "<f4").tobytes())


@pytest.mark.parametrize("fmt", ["S16LE", "S32LE", "F32LE", "U8"])
@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_nan_samples_are_not_published(fmt, bad):
    """Cast to an integer format, NaN became a garbage sample with only a RuntimeWarning."""
    with pytest.raises(ValueError, match="NaN or infinite"):
        pcm_to_audio_chunk(np.array([[0.1, bad], [0.2, 0.0]], np.float32), 16000, fmt)
    for write in (pcm_to_int16_array, pcm_to_float32_array):
        with pytest.raises(ValueError, match="NaN or infinite"):
            write(np.array([0.1, bad]))


def test_samples_beyond_float32_are_not_published():
    """Finite as float64, 1e39 became inf in float32: a message every reader refuses."""
    for write in (lambda x: pcm_to_audio_chunk(x, 16000, "F32LE"), pcm_to_float32_array):
        with pytest.raises(ValueError, match="overflow float32"):
            write(np.array([0.1, 1e39]))


@pytest.mark.parametrize("make, message", [
    (nan_chunk, "NaN or infinite"),
    (lambda: AudioChunk(sample_rate=16000, channels=1, sample_format="S16LE"), "empty"),
    (lambda: AudioChunk(sample_rate=0, channels=1, sample_format="S16LE", data=bytes(4)), "sample rate"),
    (lambda: AudioChunk(sample_rate=16000, channels=1, sample_format="MP3", data=bytes(4)), "unsupported sample format"),
    (lambda: AudioChunk(sample_rate=16000, channels=1, sample_format="S16LE", data=bytes(3)), "whole number"),
    (lambda: AudioChunk(sample_rate=16000, channels=2, sample_format="S16LE", data=bytes(6)), "multiple of 2 channels"),
    (lambda: AudioChunk(sample_rate=16000, channels=0, sample_format="S16LE", data=bytes(4)), "0 channels"),
    # int16-scaled values in a float format: the model would see audio 3000x too loud
    (lambda: AudioChunk(sample_rate=16000, channels=1, sample_format="F32LE",
                        data=np.array([0.0, 3276.8, -1200.0], "<f4").tobytes()), "not float PCM"),
])
def test_malformed_chunks_raise(make, message):
    with pytest.raises(ValueError, match=message):
        audio_chunk_to_pcm(make())


def test_malformed_multiarrays_raise():
    with pytest.raises(ValueError, match="NaN or infinite"):
        float32_array_to_pcm(Float32MultiArray(data=[0.0, float("inf")]), 16000)
    with pytest.raises(ValueError, match="not float PCM"):
        float32_array_to_pcm(Float32MultiArray(data=[0.0, 3276.8]), 16000)
    with pytest.raises(ValueError, match="empty"):
        int16_array_to_pcm(Int16MultiArray(), 16000)
    with pytest.raises(ValueError, match="sample rate"):
        int16_array_to_pcm(Int16MultiArray(data=[1, 2]), 0)


def test_full_scale_s32le_keeps_its_sign():
    """float32 rounds 2**31 - 1 up to 2**31, and the cast to int32 wrapped it to -2**31: full-scale
    positive samples became -1.0 (clicks of reversed polarity on clipped or normalised audio)."""
    floats = np.array([1.0, 1.5, -1.0, 0.5], np.float32)
    out = audio_chunk_to_pcm(pcm_to_audio_chunk(floats, 16000, "S32LE")).samples
    assert out[0] > 0.999 and out[1] > 0.999 and out[2] == -1.0 and abs(out[3] - 0.5) < 1e-9
    ints = np.array([2**31 - 1, -2**31, 7], np.int32)
    out = audio_chunk_to_pcm(pcm_to_audio_chunk(ints, 16000, "S32LE")).samples
    np.testing.assert_array_equal(out, (ints / 2**31).astype(np.float32))


def test_a_channel_first_layout_is_read_as_planar_and_a_layout_the_data_does_not_fill_is_refused(pcm):
    """Some microphone arrays send [channels, samples]: taken as [samples, channels] it was two
    mono samples of 1600 values, and the speech node heard nothing, silently."""
    from std_msgs.msg import MultiArrayDimension
    left, right = pcm[:1600], -0.5 * pcm[:1600]
    planar = Int16MultiArray(data=np.round(np.concatenate([left, right]) * 32767).astype(np.int16).tolist())
    planar.layout.dim = [MultiArrayDimension(label="channels", size=2, stride=3200),
                         MultiArrayDimension(label="samples", size=1600, stride=1600)]
    out = int16_array_to_pcm(planar, 16000)
    assert out.samples.size == 1600
    np.testing.assert_allclose(out.samples, 0.25 * pcm[:1600], atol=2 / 32768)
    wrong = Float32MultiArray(data=pcm[:1600].tolist())
    wrong.layout.dim = [MultiArrayDimension(label="samples", size=999, stride=1998),
                        MultiArrayDimension(label="channels", size=2, stride=2)]
    with pytest.raises(ValueError, match="layout says 999 x 2"):
        float32_array_to_pcm(wrong, 16000)


@pytest.mark.parametrize("labels", [("mic", "samples"), ("MIC", "Samples"), ("channels", "samples"),
                                    ("channels", "")])
def test_a_planar_layout_is_told_by_either_label(labels):
    """A 4-mic array's [4, 1600] chunk labelled ("mic", "samples") was read as 1600 channels of 4
    samples: 100 ms of audio became 4 samples, and the speech node heard nothing, silently."""
    from std_msgs.msg import MultiArrayDimension
    mics = np.stack([np.full(1600, k, np.int16) + np.arange(1600, dtype=np.int16) for k in range(4)])
    planar = Int16MultiArray(data=mics.reshape(-1).tolist())
    planar.layout.dim = [MultiArrayDimension(label=labels[0], size=4, stride=6400),
                         MultiArrayDimension(label=labels[1], size=1600, stride=1600)]
    out = int16_array_to_pcm(planar, 16000)
    np.testing.assert_allclose(out.samples, (np.arange(1600) + 1.5) / 32768, rtol=1e-6)


@pytest.mark.parametrize("labels, sizes", [(("", ""), (4, 1600)), (("channels", "samples"), (1600, 4)),
                                           (("samples", "channels"), (4, 1600))])
def test_a_layout_of_more_channels_than_any_array_is_refused(labels, sizes):
    """Read as [samples, channels] an unlabelled [4, 1600] chunk is 1600 channels whose mixdown is
    4 samples: refused, naming the layout, where it was silently averaged away."""
    from std_msgs.msg import MultiArrayDimension
    msg = Float32MultiArray(data=np.zeros(6400, np.float32).tolist())
    msg.layout.dim = [MultiArrayDimension(label=labels[0], size=sizes[0], stride=6400),
                      MultiArrayDimension(label=labels[1], size=sizes[1], stride=sizes[1])]
    with pytest.raises(ValueError, match=f"{sizes[0]} x {sizes[1]} layout .* 1600 channels, more than 64"):
        float32_array_to_pcm(msg, 16000)


def test_the_channel_limit_is_the_frontends():
    from photon_core.runtime.audio_frontend import MAX_CHANNELS as FRONTEND_MAX
    from photon_ros.audio_conversions import MAX_CHANNELS
    assert MAX_CHANNELS == FRONTEND_MAX
