"""The speech node with a Parakeet TDT checkpoint as its `model`. Parakeet cannot be told a
language and reads no prompt, so the node refuses both, at configure and on a change, with the
reason (as it refuses "de" for an English-only Whisper), rather than ignoring them and publishing
transcripts whose `language` and `prompt` name what the model never used."""
import pytest
from rclpy.parameter import Parameter
from rclpy.qos import QoSProfile, ReliabilityPolicy

import parakeet_fixtures as pf
from photon_ros.msg import Transcript
from photon_ros.speech_node import SpeechNode
from photon_ros.wav_publisher import WavPublisher
from ros_harness import RosGraph, wait_for
from speech_audio import espeak_wav

QOS = QoSProfile(depth=10, reliability=ReliabilityPolicy.RELIABLE)


@pytest.fixture
def graph():
    g = RosGraph()
    yield g
    g.close()


def loaded(graph, **params) -> SpeechNode:
    overrides = [Parameter("model", value=str(pf.hf_checkpoint()))]
    overrides += [Parameter(name, value=value) for name, value in params.items()]
    node = graph.add(SpeechNode(context=graph.context, parameter_overrides=overrides))
    assert wait_for(lambda: node.model is not None or node.model_error, timeout=120)
    return node


@pytest.mark.parametrize("name, value", [("language", "de"), ("language", "en"),
                                         ("initial_prompt", "Photon, kitchen")])
def test_configure_refuses_what_parakeet_cannot_take(graph, name, value):
    node = loaded(graph, **{name: value})
    assert node.model is None
    assert name in node.model_error and "Parakeet" in node.model_error and "leave it empty" in node.model_error


def test_a_change_parakeet_cannot_take_is_refused_and_transcripts_say_no_language(graph):
    received = []
    graph.node("listener").create_subscription(
        Transcript, "transcript", lambda m: received.append(m) if m.is_final else None, QOS)
    node = loaded(graph)
    assert node.model is not None, node.model_error
    for name, value in (("language", "de"), ("initial_prompt", "Photon")):
        result = node.set_parameters([Parameter(name, value=value)])[0]
        assert not result.successful and name in result.reason and "Parakeet" in result.reason
        assert node.params[name] == ""
    graph.add(WavPublisher(context=graph.context, parameter_overrides=[
        Parameter("file", value=str(espeak_wav("Turn on the kitchen lights."))),
        Parameter("speed", value=2.0)]))
    assert wait_for(lambda: received, timeout=90), "no transcript arrived"
    msg = received[0]
    # Parakeet cannot tell which language it heard: it claims none
    assert msg.text and msg.language == "" and msg.prompt == "" and msg.model_id == node.model.model_id
