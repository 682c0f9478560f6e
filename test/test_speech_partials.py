"""The pieces behind partial transcripts, without ROS traffic: the segmenter hands out the
utterance in progress, the queue serves finals before any partial and keeps only the newest
partial, and the stable text commits only words two decodes agreed on, never taking one back."""
import threading

import numpy as np

from photon_ros.speech_node import StableText
from photon_ros.speech_segmenter import SpeechSegmenter, Utterance
from photon_ros.utterance_queue import UtteranceQueue
from speech_audio import espeak_pcm


def test_current_is_the_start_of_the_utterance_that_follows():
    speech, rate = espeak_pcm("Please bring me the red cup from the kitchen.")
    audio = np.concatenate([np.zeros(rate // 2, np.float32), speech, np.zeros(rate, np.float32)])
    segmenter, chunk = SpeechSegmenter(rate), rate // 10
    assert segmenter.current() is None and segmenter.utterance_start is None
    snapshots, done = [], []
    for i in range(0, audio.size, chunk):
        done += segmenter.push(audio[i:i + chunk], 100.0 + i / rate)
        now = segmenter.current()
        if now is not None and not done:
            assert not now.final and now.start_time == segmenter.utterance_start
            assert abs(now.duration - segmenter.speech_s) < 1e-9
            snapshots.append(now)
    assert len(done) == 1 and done[0].final and len(snapshots) > 10
    final = done[0]
    for snap in snapshots:
        # The final keeps only the tail of the pause that ended it; a snapshot taken during
        # that pause holds more of it, the final is its start.
        n = min(snap.samples.size, final.samples.size)
        assert snap.start_time == final.start_time
        assert np.array_equal(snap.samples[:n], final.samples[:n])
    assert snapshots[-1].samples.size > final.samples.size
    # Copies: the segmenter going on does not change what it handed out.
    assert snapshots[0].samples.size < snapshots[-1].samples.size
    assert segmenter.current() is None and segmenter.pause_s == 0.0


def utterance(t, seconds=1.0, final=True, rate=16000):
    return Utterance(np.zeros(int(seconds * rate), np.float32), rate, t, final=final)


def test_finals_first_and_only_the_newest_partial_waits():
    q = UtteranceQueue(max_seconds=30.0)
    q.offer_partial(utterance(1.0, final=False))
    q.offer_partial(utterance(1.0, 1.5, final=False))       # replaces the first
    assert len(q) == 0 and q.seconds == 0.0 and q.partials_replaced == 1
    got = q.get(0)
    assert not got.final and got.duration == 1.5
    q.offer_partial(utterance(2.0, final=False))
    q.put(utterance(2.0, 3.0))                               # the final of that utterance
    q.put(utterance(5.0))
    q.offer_partial(utterance(7.0, final=False))
    assert [(u.start_time, u.final) for u in (q.get(0), q.get(0), q.get(0))] == [
        (2.0, True), (5.0, True), (7.0, False)]
    assert q.partials_replaced == 2 and q.get(timeout=0.01) is None and q.seconds == 0.0


def test_a_partial_wakes_a_waiting_worker():
    q = UtteranceQueue(10.0)
    got = []
    worker = threading.Thread(target=lambda: got.append(q.get(timeout=10)))
    worker.start()
    q.offer_partial(utterance(1.0, final=False))
    worker.join(timeout=2)
    assert not worker.is_alive() and got and not got[0].final


def test_stable_text_commits_what_two_decodes_agree_on():
    s = StableText()
    assert s.update(1.0, "Go to the") == ("", "Go to the")
    assert s.update(1.0, "Go to the kitchen.") == ("Go to the", "kitchen.")
    # Case and punctuation do not count as disagreement.
    assert s.update(1.0, "go to the kitchen and") == ("Go to the kitchen", "and")
    # A decode that changes its mind about committed words leaves them committed.
    assert s.update(1.0, "Go through the kitchen and bring") == ("Go to the kitchen", "and bring")
    assert s.update(1.0, "Go to the kitchen and bring me") == ("Go to the kitchen", "and bring me")
    assert s.update(1.0, "Go to the kitchen and bring me water") == (
        "Go to the kitchen and bring me", "water")
    # A new utterance starts from nothing.
    assert s.update(9.0, "Stop") == ("", "Stop")
    assert s.update(9.0, "Stop now") == ("Stop", "now")


def test_a_worker_resting_from_partials_still_gets_finals():
    q = UtteranceQueue(10.0)
    q.offer_partial(utterance(1.0, final=False))
    assert q.get(timeout=0.01, partials=False) is None      # the partial waits...
    q.put(utterance(2.0))
    assert q.get(timeout=0.01, partials=False).final         # ...finals do not
    q.offer_partial(utterance(3.0, final=False))
    assert q.get(timeout=0.01, partials=True).start_time == 3.0
