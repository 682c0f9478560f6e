"""The VAD segmenter on real speech: utterances found where the speech is, none in silence or
steady noise, bounded length, and chunk size does not matter."""
import numpy as np
import pytest

from photon_ros.speech_segmenter import SegmenterConfig, SpeechSegmenter
from speech_audio import espeak_pcm


def run(segmenter, samples, chunk, t0=100.0):
    out = []
    for i in range(0, len(samples), chunk):
        out += segmenter.push(samples[i:i + chunk], t0 + i / segmenter.sample_rate)
    tail = segmenter.flush()
    return out + ([tail] if tail else [])


def speech_bounds(samples, rate, level=0.01):
    loud = np.flatnonzero(np.abs(samples) > level)
    return loud[0] / rate, loud[-1] / rate


@pytest.mark.parametrize("chunk_ms", [10, 100, 333])
def test_one_sentence_is_one_utterance(chunk_ms):
    speech, rate = espeak_pcm("Please bring me the red cup from the kitchen.")
    silence = np.zeros(rate, np.float32)
    audio = np.concatenate([silence, speech, silence])
    utterances = run(SpeechSegmenter(rate), audio, rate * chunk_ms // 1000)
    assert len(utterances) == 1
    u = utterances[0]
    first, last = speech_bounds(audio, rate)
    # The utterance covers the speech, starting a little before it (preroll), stamped on the stream clock.
    assert 100.0 + first - 0.5 <= u.start_time <= 100.0 + first
    assert u.start_time + u.duration >= 100.0 + last
    assert u.duration < (last - first) + 1.5


def test_two_sentences_with_a_pause_are_two_utterances():
    a, rate = espeak_pcm("Turn left.")
    b, _ = espeak_pcm("Now stop here.")
    gap = np.zeros(int(1.5 * rate), np.float32)
    utterances = run(SpeechSegmenter(rate), np.concatenate([gap, a, gap, b, gap]), 1600)
    assert len(utterances) == 2
    assert utterances[0].start_time + utterances[0].duration < utterances[1].start_time


def test_silence_and_steady_noise_give_nothing():
    rate = 16000
    rng = np.random.default_rng()
    assert run(SpeechSegmenter(rate), np.zeros(5 * rate, np.float32), 1600) == []
    noise = (0.05 * rng.standard_normal(5 * rate)).astype(np.float32)
    assert run(SpeechSegmenter(rate), noise, 1600) == []


def test_speech_over_background_noise():
    speech, rate = espeak_pcm("Find the person near the door.")
    rng = np.random.default_rng()
    audio = np.concatenate([np.zeros(rate, np.float32), speech, np.zeros(rate, np.float32)])
    audio = audio + (0.003 * rng.standard_normal(audio.size)).astype(np.float32)
    assert len(run(SpeechSegmenter(rate), audio, 2205)) == 1


def test_long_speech_is_cut_at_the_limit():
    speech, rate = espeak_pcm("one two three four five six seven eight nine ten " * 3)
    config = SegmenterConfig(max_utterance_s=3.0, hangover_s=2.0)
    utterances = run(SpeechSegmenter(rate, config), speech, 4410)
    assert len(utterances) >= 2
    assert all(u.duration <= 3.0 + 0.05 for u in utterances)
