"""The queue between the VAD and the model is bounded in seconds and drops the oldest audio."""
import threading

import numpy as np

from photon_ros.speech_segmenter import Utterance
from photon_ros.utterance_queue import UtteranceQueue


def utterance(seconds, t, rate=16000):
    return Utterance(np.zeros(int(seconds * rate), np.float32), rate, t)


def test_oldest_audio_is_dropped_past_the_budget():
    q = UtteranceQueue(max_seconds=30.0)
    for i in range(10):
        q.put(utterance(10.0, float(i)))
    assert len(q) == 3 and q.seconds <= 30.0
    assert q.dropped == 7 and abs(q.dropped_seconds - 70.0) < 1e-6
    assert [q.get(0).start_time for _ in range(3)] == [7.0, 8.0, 9.0]
    assert q.get(timeout=0.01) is None


def test_a_single_long_utterance_is_kept():
    q = UtteranceQueue(max_seconds=5.0)
    assert q.put(utterance(8.0, 0.0)) == [] and len(q) == 1


def test_close_wakes_a_waiting_consumer():
    q = UtteranceQueue(10.0)
    got = []
    consumer = threading.Thread(target=lambda: got.append(q.get(timeout=10)))
    consumer.start()
    q.close()
    consumer.join(timeout=2)
    assert not consumer.is_alive() and got == [None]
