"""The speech node's worker between the queue and the topic: a final queued in a new activation is
transcribed whatever the worker was waiting in; an utterance whose partials went out always gets a
final; a result decoded ahead is used only under the settings it was decoded with. One real,
unspun rclpy node; the model is a double (its answers must be chosen: an empty final after partials
that heard words)."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import rclpy
from rclpy.parameter import Parameter

from photon_ros.speech_node import SpeechNode
from photon_ros.speech_segmenter import SpeechSegmenter, Utterance
from photon_ros.utterance_queue import Speculations
from ros_harness import wait_for

RATE = 16000


class Model:
    model_id = "double"

    def __init__(self, final_text: str = "go left") -> None:
        self.calls: list[dict] = []
        self.final_text = final_text

    def transcribe(self, audio, sample_rate, language, initial_prompt, **options):
        self.calls.append(options)
        text = "go" if options else self.final_text   # partials decode with options, finals without
        return {"text": text, "language": "en", "segments": []}


class Engine:
    def __init__(self, model: Model) -> None:
        self.model, self.lock = model, threading.Lock()


@pytest.fixture
def node():
    ctx = rclpy.Context()
    rclpy.init(context=ctx)
    node = SpeechNode(context=ctx, parameter_overrides=[Parameter("autostart", value=False)])
    node.engine = Engine(Model())
    node.sent = []
    node.publisher = type("Pub", (), {"publish": staticmethod(node.sent.append)})()
    try:
        yield node
    finally:
        node.engine = None
        node.destroy_node()
        rclpy.shutdown(context=ctx)


def utterance(start: float, seconds: float = 1.0, **kw) -> Utterance:
    return Utterance(np.full(int(seconds * RATE), 0.1, np.float32), RATE, start, **kw)


def test_a_final_queued_right_after_a_reactivation_is_transcribed(node):
    """The worker read the activation before waiting for the queue: a deactivate and activate
    within that wait (0.1 s) dropped the next final, counted nowhere."""
    for trial in range(5):
        node.activity.start()
        time.sleep(0.03)              # the worker is waiting on the queue in this activation
        node.pause()                  # deactivate ...
        node.activity.start()         # ... and activate again within that wait
        node.enqueue(utterance(100.0 + trial))
        assert wait_for(lambda: len(node.sent) == trial + 1, timeout=10), trial
        node.pause()


def test_partials_are_always_followed_by_a_final(node):
    """Partials are 'results a later message replaces': when the final hears no words, an empty
    final replaces them (they stayed on a display, or with a planner, for ever)."""
    node.engine.model.final_text = ""
    node.activity.start()
    epoch = node.activity.current()
    node.partial_still_wanted = lambda u: True
    node.transcribe_partial(utterance(100.0, 0.6, final=False), epoch)
    node.transcribe_one(utterance(100.0, 1.2), epoch)
    node.transcribe_one(utterance(200.0, 1.2), epoch)     # no partial went out for it: nothing
    assert [m.is_final for m in node.sent] == [False, True] and node.sent[-1].text == ""


def test_a_result_decoded_ahead_is_used_only_under_its_settings():
    """language and initial_prompt change at once: a speculation decoded under the old prompt
    must not become the final's text under the new one."""
    kept = Speculations()
    u = utterance(100.0)
    kept.keep(u, "old", 0.1, ("en", "Kitchen, Bob."))
    assert kept.take(utterance(100.0), ("en", "Garage, Alice.")) is None and kept.wasted == 1
    kept.keep(u, "same", 0.1, ("en", "Kitchen, Bob."))
    assert kept.take(utterance(100.0), ("en", "Kitchen, Bob.")) == ("same", 0.1)


def test_no_pause_offers_no_final_even_with_tail_s_0():
    """With vad.tail_s 0 the final a pause gives was offered on every frame of speech (98
    speculations in 3 s, each a final's decode, and partials starved)."""
    from photon_ros.speech_segmenter import SegmenterConfig
    seg = SpeechSegmenter(RATE, SegmenterConfig(tail_s=0.0))
    t = np.arange(RATE * 2) / RATE
    loud = (0.3 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)
    seg.push(np.zeros(RATE // 2, np.float32), 10.0)
    offered = 0
    for i in range(0, loud.size, 480):
        seg.push(loud[i:i + 480], 10.5 + i / RATE)
        offered += seg.pending_final() is not None
    assert seg.in_speech and offered == 0
    seg.push(np.zeros(960, np.float32), 12.5)
    assert seg.pending_final() is not None          # a pause of a frame: offered
