"""Speculative end of utterance without ROS: the cut rule, the final a pause will give (known
before the hangover ends, defined by the audio alone), and the bookkeeping that uses a result
decoded ahead only for a final with exactly its samples."""
import numpy as np
import pytest

from photon_ros.speech_segmenter import SegmenterConfig, SpeechSegmenter, Utterance, end_cut
from photon_ros.utterance_queue import Speculations, UtteranceQueue, same_audio
from speech_audio import espeak_pcm

RATE = 16000


def test_end_cut_keeps_the_speech_and_the_tail_of_the_pause():
    assert end_cut(frames=100, silent_run=10, tail_frames=3) == 93
    assert end_cut(frames=100, silent_run=3, tail_frames=3) == 100    # the pause is the tail so far
    assert end_cut(frames=100, silent_run=1, tail_frames=3) == 100
    assert end_cut(frames=100, silent_run=10, tail_frames=0) == 90


def test_tail_longer_than_the_hangover_is_refused():
    with pytest.raises(ValueError, match="tail_s"):
        SpeechSegmenter(RATE, SegmenterConfig(hangover_s=0.3, tail_s=0.4))


def spoken(text):
    """espeak-ng's `text` at 16 kHz, without its leading and trailing silence."""
    speech, rate = espeak_pcm(text)
    speech = np.interp(np.arange(0, speech.size, rate / RATE), np.arange(speech.size), speech)
    loud = np.flatnonzero(np.abs(speech) > 1e-3)
    return speech[loud[0]:loud[-1] + 1].astype(np.float32)


def command(text="Go to the kitchen and bring me a glass of water.", gap_s=0.0, then=None):
    """16 kHz speech with 0.5 s of silence before and 1 s after (and `then` after a `gap_s` pause)."""
    parts = [np.zeros(RATE // 2, np.float32), spoken(text)]
    if then is not None:
        parts += [np.zeros(round(gap_s * RATE), np.float32), spoken(then)]
    return np.concatenate(parts + [np.zeros(RATE, np.float32)])


def feed(audio, chunk, config=None):
    """Push `audio` in chunks; the finals and every new pending final seen after a push."""
    seg = SpeechSegmenter(RATE, config)
    finals, pending = [], []
    for i in range(0, audio.size, chunk):
        finals += seg.push(audio[i:i + chunk], 100.0 + i / RATE)
        p = seg.pending_final()
        if p is not None and not (pending and same_audio(pending[-1], p)):
            pending.append(p)
    return finals, pending, seg


@pytest.mark.parametrize("chunk", [160, 1600, 1601, 4000])
def test_the_pending_final_is_the_final_whatever_the_chunking(chunk):
    audio = command()
    finals, pending, seg = feed(audio, chunk)
    assert len(finals) == 1 and finals[0].complete
    final = finals[0]
    # The last pending final (the pause that lasted) holds exactly the final's audio.
    assert pending and same_audio(pending[-1], final)
    # And the final is the same however the audio was chunked.
    reference, _, _ = feed(audio, 480)
    assert np.array_equal(reference[0].samples, final.samples)
    assert abs(reference[0].start_time - final.start_time) < 1e-6   # stamps summed in floats
    # It ends tail_s after the last speech: the pause's tail, not the whole hangover.
    last = np.flatnonzero(np.abs(audio) > 0.01)[-1] / RATE
    end = final.start_time - 100.0 + final.duration
    tail_s = seg.tail_frames * seg.frame / RATE
    assert last - 0.03 < end <= last + tail_s + 0.03, (last, end)


def test_speech_that_resumes_within_the_hangover_makes_the_speculation_stale():
    """A 0.2 s pause (longer than the tail, shorter than the hangover) mid-command: a pending final
    appears during it, the utterance goes on, and the final (the whole command) does not match it,
    so the result decoded ahead on it is not used."""
    audio = command("Go to the kitchen.", gap_s=0.2, then="Bring me a glass of water.")
    finals, pending, _ = feed(audio, 1600)
    assert len(finals) == 1
    final = finals[0]
    early = [p for p in pending if p.samples.size < final.samples.size]
    assert early, "no pending final during the pause"
    spec = Speculations()
    spec.keep(early[0], {"text": "Go to the kitchen."}, 0.3)
    assert spec.take(final) is None and spec.wasted == 1 and spec.used == 0
    # The pause that lasted gives the final's own audio: that one is used.
    spec.keep(pending[-1], {"text": "whole"}, 0.4)
    assert spec.take(final) == ({"text": "whole"}, 0.4) and spec.used == 1
    assert spec.take(final) is None   # taken once: a final clears what was kept


def utterance(t, seconds=1.0, **kwargs):
    return Utterance(np.arange(int(seconds * RATE), dtype=np.float32) / RATE, RATE, t, **kwargs)


def test_speculations_match_only_identical_audio():
    spec = Speculations()
    a = utterance(1.0)
    spec.keep(a, "A", 0.2)
    shifted = utterance(1.5)                          # same samples, another utterance
    assert spec.take(shifted) is None
    spec.keep(a, "A", 0.2)
    changed = utterance(1.0)
    changed.samples[100] += 1e-6                      # one sample differs
    assert spec.take(changed) is None
    spec.keep(a, "A", 0.2)
    assert spec.take(utterance(1.0, 1.01)) is None    # longer
    spec.keep(a, "A", 0.2)
    assert spec.take(utterance(1.0)) == ("A", 0.2)
    assert spec.used == 1 and spec.wasted == 3


def test_queue_serves_finals_then_the_speculation_then_partials():
    q = UtteranceQueue(30.0)
    q.offer_partial(utterance(5.0, final=False))
    q.offer_speculation(utterance(5.0, 0.9, speculative=True))
    q.offer_speculation(utterance(5.0, 1.0, speculative=True))   # replaces the waiting one
    got = q.get(timeout=0.01, partials=False)                   # a resting worker still gets it
    assert got.speculative and got.duration == 1.0
    assert q.get(0).final is False
    # A final clears a waiting speculation: it is that final, or stale.
    q.offer_speculation(utterance(9.0, speculative=True))
    q.put(utterance(9.0))
    got = q.get(0)
    assert got.final and not got.speculative and q.get(timeout=0.01) is None
    # Finals are served before a speculation.
    q.put(utterance(12.0))
    q.offer_speculation(utterance(14.0, speculative=True))
    assert [q.get(0).speculative for _ in range(2)] == [False, True]
