"""The speech node fed audio_common messages: mgonzs13's read stamps across audio lost in transport
or refused, and ros-drivers' empty chunks. One real, unspun rclpy node fed through take_audio (the
subscription callback's body) with plain objects that have the generated classes' attributes: the
classes are importable only in a process started in their test workspace, so `input_type` is set
on the node as its subscription would set it. Nothing is decoded."""
from types import SimpleNamespace

import numpy as np
import pytest

from photon_ros.speech_node import drain
from speech_audio import unspun_speech_node

RATE, CHUNK = 16000, 512             # mgonzs13's audio_capturer_node: 512 frames (32 ms)
T0 = 1_764_600_000.0
GAP = int(1.4 * RATE) // CHUNK       # the first chunk that goes missing, mid-speech


@pytest.fixture
def node():
    with unspun_speech_node() as n:
        yield n


def speech_like() -> np.ndarray:
    """5 s: noise, 3 s of 250 ms syllables from 1 s, noise."""
    rng = np.random.default_rng(0)
    audio = rng.normal(0, 0.001, 5 * RATE).astype(np.float32)
    t = np.arange(3 * RATE) / RATE
    audio[RATE:4 * RATE] += (0.3 * np.sin(2 * np.pi * 500 * t) * (t % 0.4 < 0.25)).astype(np.float32)
    return audio


def stamp_of(seconds: float) -> SimpleNamespace:
    sec = int(seconds)
    return SimpleNamespace(sec=sec, nanosec=int(round((seconds - sec) * 1e9)))


def audio_stamped(samples: np.ndarray, stamp: float) -> SimpleNamespace:
    """An mgonzs13 AudioStamped of paInt16 samples."""
    ints = np.round(samples * 32767).astype(np.int16)
    data = SimpleNamespace(float32_data=[], int32_data=[], int16_data=ints, int8_data=[], uint8_data=[])
    info = SimpleNamespace(format=8, channels=1, rate=RATE, chunk=samples.size)
    return SimpleNamespace(header=SimpleNamespace(stamp=stamp_of(stamp), frame_id="mic"),
                           audio=SimpleNamespace(audio_data=data, info=info))


def refused(stamp: float) -> SimpleNamespace:
    """An AudioStamped the node refuses: its format names int16_data, its audio is in float32_data."""
    msg = audio_stamped(np.zeros(CHUNK, np.float32), stamp)
    msg.audio.audio_data.float32_data = [0.0] * CHUNK
    return msg


@pytest.mark.parametrize("hole", ["lost", "refused"])
def test_read_stamps_start_afresh_after_a_hole(node, hole):
    """mgonzs13's capturer stamps each read as it starts, a little late; the node counts its stamps
    in samples. Counted on across 3 chunks lost in transport (or one refused) the chunks after
    the hole were stamped early by its length, until the count re-anchored 0.15 s later: a second
    jump, whose stream restart dropped the speech after the hole (the command after it began
    0.16 s late, and lost audio was counted twice)."""
    node.input_type = "audio_stamped"
    audio, rng = speech_like(), np.random.default_rng(1)
    missing = range(GAP, GAP + (3 if hole == "lost" else 1))
    lost = 0
    for k in range(audio.size // CHUNK):
        stamp = T0 + k * CHUNK / RATE + rng.uniform(0, 0.002)   # read stamps: late by up to 2 ms
        if k in missing and hole == "lost":
            lost += 1
            continue
        node.take_audio(refused(stamp) if k in missing else audio_stamped(audio[k * CHUNK:(k + 1) * CHUNK], stamp),
                        lost)
        lost = 0
    finals = [u for u in drain(node.queue) if u.final] + [u for u in [node.segmenter.flush()] if u]
    assert node.segmenter.discontinuities == 1
    assert abs(node.segmenter.lost_s - len(missing) * CHUNK / RATE) < 0.005
    after = (GAP + len(missing)) * CHUNK / RATE   # the first chunk after the hole
    assert len(finals) == 2, [(u.start_time - T0, u.note) for u in finals]
    assert abs(finals[1].start_time - T0 - after) < 0.005, finals[1].start_time - T0
    first = round(after * RATE)
    np.testing.assert_allclose(finals[1].samples, audio[first:first + finals[1].samples.size], atol=1 / 32767)


def test_an_empty_ros_drivers_chunk_mid_speech_lost_nothing(node):
    """An AudioData without bytes is refused, but no audio went missing with it: the utterance
    around it stays whole (it was cut, incomplete, as at lost audio)."""
    from photon_ros.audio_common_conversions import AudioInfoFormat
    node.input_type = "audio_data_stamped"
    node.audio_info = AudioInfoFormat()
    node.audio_info.update(SimpleNamespace(channels=1, sample_rate=RATE, sample_format="S16LE", bitrate=0,
                                           coding_format="wave"))
    audio, size = speech_like(), RATE // 100

    def chunk(samples: np.ndarray, stamp: float) -> SimpleNamespace:
        data = np.round(samples * 32767).astype("<i2").tobytes()
        return SimpleNamespace(header=SimpleNamespace(stamp=stamp_of(stamp), frame_id="mic"),
                               audio=SimpleNamespace(data=data))

    for k, i in enumerate(range(0, audio.size, size)):
        if k == 200:   # 2 s: mid-speech
            node.take_audio(chunk(audio[:0], T0 + i / RATE))
        node.take_audio(chunk(audio[i:i + size], T0 + i / RATE))
    finals = [u for u in drain(node.queue) if u.final]
    assert node.skipped_chunks == 1
    assert len(finals) == 1 and finals[0].complete, [(u.complete, u.note) for u in finals]
    assert node.segmenter.discontinuities == 0
