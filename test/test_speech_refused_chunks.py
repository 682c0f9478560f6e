"""A malformed audio chunk the speech node skips is audio missing from the stream: the utterance
around it must not pass for a whole command. A hole of one or two short chunks is within the
stamps' jitter, and unstamped chunks show none at all, so only the skip itself can tell. One real,
unspun rclpy node fed through take_audio (the subscription callback's body); nothing is decoded."""
import numpy as np
import pytest
from builtin_interfaces.msg import Time
from std_msgs.msg import Header

from photon_ros.audio_conversions import pcm_to_audio_chunk
from photon_ros.msg import AudioChunk
from photon_ros.speech_node import drain
from speech_audio import espeak_pcm, unspun_speech_node


@pytest.fixture
def node():
    with unspun_speech_node() as n:
        yield n


def chunk(samples, rate, stamp, nan=False):
    header = Header()
    if stamp:
        header.stamp = Time(sec=int(stamp), nanosec=int(round(stamp % 1 * 1e9)))
    msg = pcm_to_audio_chunk(samples, rate, AudioChunk.FORMAT_F32LE, header=header)
    if nan:   # a driver glitch: one NaN sample, refused by the node
        data = np.frombuffer(bytes(msg.data), "<f4").copy()
        data[3] = np.nan
        msg.data = data.tobytes()
    return msg


@pytest.mark.parametrize("stamped", [True, False])
def test_a_skipped_chunk_mid_speech_marks_the_utterance_incomplete(node, stamped):
    speech, rate = espeak_pcm("Go to the kitchen and bring me a glass of water.")
    audio = np.concatenate([np.zeros(rate // 2, np.float32), speech, np.zeros(rate, np.float32)])
    size = rate // 100                              # 10 ms chunks: two lost move the stamps 20 ms
    bad = {audio.size // 2 // size, audio.size // 2 // size + 1}
    for k, i in enumerate(range(0, audio.size, size)):
        node.take_audio(chunk(audio[i:i + size], rate, 1_764_600_000.0 + i / rate if stamped else 0.0,
                              nan=k in bad))
    assert node.skipped_chunks == 2
    finals = [u for u in drain(node.queue) if u.final]
    assert len(finals) == 2, [(u.complete, u.note) for u in finals]
    assert not finals[0].complete and "audio lost after it" in finals[0].note
    assert not finals[1].complete and "audio lost before it" in finals[1].note


def test_a_skipped_chunk_in_silence_leaves_the_next_command_whole(node):
    speech, rate = espeak_pcm("Go to the kitchen.")
    audio = np.concatenate([np.zeros(rate, np.float32), speech, np.zeros(rate, np.float32)])
    size = rate // 100
    for k, i in enumerate(range(0, audio.size, size)):
        node.take_audio(chunk(audio[i:i + size], rate, 1_764_600_000.0 + i / rate, nan=k == 10))
    finals = [u for u in drain(node.queue) if u.final]
    assert node.skipped_chunks == 1 and len(finals) == 1 and finals[0].complete and finals[0].note == ""
    assert node.segmenter.discontinuities == 0


def test_an_empty_chunk_mid_speech_lost_nothing(node):
    """A chunk with no samples is refused (and counted), but no audio went missing with it: the
    utterance around it stays whole."""
    speech, rate = espeak_pcm("Go to the kitchen.")
    audio = np.concatenate([np.zeros(rate // 2, np.float32), speech, np.zeros(rate, np.float32)])
    size = rate // 100
    middle = audio.size // 2 // size
    for k, i in enumerate(range(0, audio.size, size)):
        stamp = 1_764_600_000.0 + i / rate
        if k == middle:
            node.take_audio(AudioChunk(header=chunk(audio[:1], rate, stamp).header, sample_rate=rate, channels=1,
                                       sample_format=AudioChunk.FORMAT_F32LE))
        node.take_audio(chunk(audio[i:i + size], rate, stamp))
    finals = [u for u in drain(node.queue) if u.final]
    assert node.skipped_chunks == 1 and len(finals) == 1 and finals[0].complete, [(u.complete, u.note) for u in finals]
