"""Speech nodes over real DDS with real Whisper tiny.en weights, beyond one node: the speculative
end of utterance (a final decoded during the pause) gives the transcript the plain end of
utterance gives, and several microphones in one process (one speech node each, one shared
engine) each get their own transcripts, through the engine's batcher or under its lock."""
import time

import numpy as np
import pytest
from rclpy.parameter import Parameter
from rclpy.qos import QoSProfile, ReliabilityPolicy

from photon_ros.msg import Transcript
from photon_ros.result_messages import time_to_seconds
from photon_ros.speech_node import SpeechNode
from photon_ros.wav_publisher import WavPublisher
from ros_harness import RosGraph, wait_for
from speech_audio import espeak_wav, words

QOS = QoSProfile(depth=10, reliability=ReliabilityPolicy.RELIABLE)
# The publishers share the process with two nodes decoding: on a loaded machine their chunks can
# stall long enough for the default idle flush (0.8 s, a clock-timed cut, marked incomplete) to end
# an utterance early; these tests compare cuts made by the samples alone.
IDLE_FLUSH_S = 5.0



@pytest.fixture
def graph():
    g = RosGraph()
    yield g
    g.close()


def play(graph, wav, namespace="", speed=2.0, frame_id=""):
    return graph.add(WavPublisher(context=graph.context, namespace=namespace, parameter_overrides=[
        Parameter("file", value=str(wav)), Parameter("speed", value=speed), Parameter("frame_id", value=frame_id)]))


def played(players) -> None:
    """Wait for the players to finish their trailing silence: a new player on the same topic
    before that would interleave two streams (two clocks) on one microphone topic."""
    assert wait_for(lambda: all(p.done for p in players), timeout=60)


def listen_on(graph, topic):
    received = []
    graph.node(f"listener_{topic.replace('/', '_')}").create_subscription(
        Transcript, topic, lambda m: received.append(m) if m.is_final else None, QOS)
    return received


def pauses_seen(text):
    """How many pauses reach the tail in `text` as the WAV publisher plays it (0.5 s of silence,
    then the speech, in 0.1 s chunks): each one is a speculation; the last one is the final's."""
    from photon_ros.speech_segmenter import SpeechSegmenter
    from speech_audio import espeak_pcm

    speech, rate = espeak_pcm(text)
    audio = np.concatenate([np.zeros(rate // 2, np.float32), speech, np.zeros(rate, np.float32)])
    segmenter, seen = SpeechSegmenter(rate), set()
    for i in range(0, audio.size, rate // 10):
        segmenter.push(audio[i:i + rate // 10], 100.0 + i / rate)
        if (p := segmenter.pending_final()) is not None:
            seen.add(p.samples.size)
    return len(seen)


def test_a_final_decoded_ahead_is_the_final_decoded_after_the_pause(graph):
    """Speculative end of utterance: two speech nodes in one process, one decoding the final as
    soon as the speaker's pause reaches the tail, one only when the hangover ends, get the same
    WAVs: the same utterances and transcripts. A command without a pause inside: the speculative
    node published its final from the decode it started during the final pause. A command with
    a pause inside (the speech resumes within the hangover): that speculation is not used, and
    the transcript is still the whole command's."""
    plain = "Please bring me the red cup from the kitchen."
    paused = "Open the window and turn on the fan."
    assert pauses_seen(plain) == 1 and pauses_seen(paused) == 2
    received = {ns: listen_on(graph, f"/{ns}/transcript") for ns in ("ahead", "after")}
    nodes = {}
    for ns, speculate in (("ahead", True), ("after", False)):
        nodes[ns] = graph.add(SpeechNode(context=graph.context, namespace=ns, parameter_overrides=[
            Parameter("speculate", value=speculate), Parameter("partial_interval_s", value=0.0),
            Parameter("idle_flush_s", value=IDLE_FLUSH_S)]))
    assert wait_for(lambda: all(n.model is not None for n in nodes.values()), timeout=60)
    for k, sentence in enumerate((plain, paused)):
        players = [play(graph, espeak_wav(sentence), ns, speed=1.0) for ns in nodes]
        assert wait_for(lambda: all(len(r) > k for r in received.values()), timeout=60), received
        played(players)
        if k == 0:
            assert nodes["ahead"].speculations.used == 1
    time.sleep(0.5)
    ahead, after = received["ahead"], received["after"]
    assert len(ahead) == len(after) == 2
    for a, b, sentence in zip(ahead, after, (plain, paused)):
        assert words(a.text) == words(sentence)
        assert a.text == b.text and a.audio_duration == b.audio_duration and a.audio_complete
        assert [(s.start, s.end, s.text) for s in a.segments] == [(s.start, s.end, s.text) for s in b.segments]
    assert nodes["after"].speculations.used == 0 and nodes["ahead"].speculations.wasted >= 1


def test_two_microphones_two_speech_nodes_one_engine(graph):
    """Two speech nodes in one process (speech_nodes: a namespace per microphone) share one
    engine; two WAV publishers speak different commands at once on mic0/audio and mic1/audio.
    Each transcript arrives on its own node's topic with its own frame_id and stamp and equals
    what the node gave alone. "batch": whisper's `batch` (result i == transcribe(**requests[i]),
    concurrent requests decoded together), through the engine's batcher; then "lock", on the same
    nodes: the same model with its `batch` hidden, as a family without one: each transcription
    runs under the engine's lock (and equals what the batcher gave alone)."""
    from photon_ros.speech_node import speech_nodes

    sentences = {"mic0": "Go to the kitchen and bring me a glass of water.",
                 "mic1": "Pick up the blue box on the table."}
    received = {ns: listen_on(graph, f"/{ns}/transcript") for ns in sentences}
    nodes = dict(zip(sentences, speech_nodes(list(sentences), context=graph.context, parameter_overrides=[
        Parameter("partial_interval_s", value=0.0), Parameter("idle_flush_s", value=IDLE_FLUSH_S)])))
    for node in nodes.values():
        graph.add(node)
    assert wait_for(lambda: all(n.model is not None for n in nodes.values()), timeout=60)
    engine = nodes["mic0"].engine
    assert engine is nodes["mic1"].engine
    # The process's engine may have served other tests (through its batcher) before this one.
    served_before = list(engine._batcher.sizes) if engine._batcher is not None else []

    # Each alone first, then both at once.
    for ns, sentence in sentences.items():
        player = play(graph, espeak_wav(sentence), ns, frame_id=f"{ns}_frame")
        assert wait_for(lambda: received[ns], timeout=60), ns
        played([player])
    try:
        for k, path in enumerate(("batch", "lock"), start=2):
            if path == "lock":
                engine.model.batch = None   # an instance attribute hides the method: no batch here
                served_before = list(engine._batcher.sizes) if engine._batcher is not None else []
            started = time.time()
            players = [play(graph, espeak_wav(sentence), ns, frame_id=f"{ns}_frame")
                       for ns, sentence in sentences.items()]
            assert wait_for(lambda: all(len(r) == k for r in received.values()), timeout=60), (path, received)
            played(players)
            time.sleep(0.5)
            for ns, sentence in sentences.items():
                first, both = received[ns][0], received[ns][-1]
                assert len(received[ns]) == k, path
                # its own microphone's command (tiny.en may mishear a word: "blue marks" for "blue box")
                assert len(set(words(both.text)) & set(words(sentence))) >= len(set(words(sentence))) - 1, \
                    (path, ns, both.text)
                assert both.text == first.text and both.audio_duration == first.audio_duration, path
                assert both.header.frame_id == f"{ns}_frame"
                assert time_to_seconds(both.header.stamp) >= started - 0.5 > time_to_seconds(first.header.stamp)
            assert received["mic0"][-1].header.stamp != received["mic1"][-1].header.stamp
            if path == "batch":
                # Every final of both nodes (and the finals decoded ahead) went through it.
                assert sum(engine.batcher.sizes) - sum(served_before) >= 4
            else:
                served = list(engine._batcher.sizes) if engine._batcher is not None else []
                assert served == served_before   # nothing went through a batcher
    finally:
        engine.model.__dict__.pop("batch", None)


def test_a_node_configured_beside_a_transcribing_one_warms_up_under_the_engines_lock(graph, monkeypatch):
    """A second speech node of the process configures while the first transcribes on their shared
    engine: its warm-up runs the model only once the engine's lock is free (the lock a batch holds:
    two calls at once on an engine's compiled decode step share its buffers)."""
    import threading

    from photon_ros import speech_node

    first = graph.add(SpeechNode(context=graph.context, namespace="first"))
    assert wait_for(lambda: first.model is not None or first.model_error, timeout=60), first.model_error
    engine, checked, warmed = first.engine, threading.Event(), []
    real_refuses, real_warmup = speech_node.model_refuses, engine.model.warmup
    monkeypatch.setattr(speech_node, "model_refuses", lambda *a: (checked.set(), real_refuses(*a))[1])
    monkeypatch.setattr(engine.model, "warmup", lambda **kw: (warmed.append(engine.lock.locked()), real_warmup(**kw))[1])
    with engine.lock:   # as the first node's transcription holds it through the batcher
        second = graph.add(SpeechNode(context=graph.context, namespace="second"))
        assert checked.wait(timeout=60)   # the second node's warm-up has begun
        time.sleep(0.5)
        assert warmed == [] and second.model is None
    assert wait_for(lambda: second.model is not None, timeout=60), second.model_error
    assert second.engine is engine and warmed == [True]   # it ran, holding the lock itself


def test_microphones_option_names_one_node_per_microphone():
    from photon_ros.speech_node import split_microphones

    argv = ["speech_node", "--microphones", "left,right", "--ros-args", "-p", "partial_interval_s:=0.7"]
    assert split_microphones(argv) == (["left", "right"], ["speech_node", "--ros-args", "-p", "partial_interval_s:=0.7"])
    assert split_microphones(["speech_node", "--ros-args", "-r", "__node:=speech"]) == (
        [], ["speech_node", "--ros-args", "-r", "__node:=speech"])
