"""The speech node with a Qwen3-ASR checkpoint as its `model`: loaded through the registry and
the shared engine, warmed up, and spoken audio from the WAV publisher comes back as a final
Transcript with the random model's greedy text and the forced language."""
import pytest
from rclpy.parameter import Parameter
from rclpy.qos import QoSProfile, ReliabilityPolicy

from photon_core.runtime.shared_models import shared_engine
from photon_ros.msg import Transcript
from photon_ros.speech_node import SpeechNode
from photon_ros.wav_publisher import WavPublisher
from ros_harness import RosGraph, wait_for
from speech_audio import espeak_wav
from test_qwen3_asr_reference import tiny_checkpoint

QOS = QoSProfile(depth=10, reliability=ReliabilityPolicy.RELIABLE)


@pytest.fixture
def graph():
    g = RosGraph()
    yield g
    g.close()


def test_speech_node_runs_a_qwen3_asr_checkpoint(graph):
    folder = str(tiny_checkpoint())
    received = []
    graph.node("listener").create_subscription(
        Transcript, "transcript", lambda m: received.append(m) if m.is_final else None, QOS)
    node = graph.add(SpeechNode(context=graph.context, parameter_overrides=[
        Parameter("model", value=folder), Parameter("language", value="en")]))
    assert wait_for(lambda: node.model is not None or node.model_error, timeout=120)
    assert node.model is not None, node.model_error
    engine = shared_engine(folder, skills=["transcribe"])
    assert node.model is engine.model and engine.family.name == "qwen3_asr"
    graph.add(WavPublisher(context=graph.context, parameter_overrides=[
        Parameter("file", value=str(espeak_wav("Turn on the kitchen lights."))),
        Parameter("speed", value=2.0)]))
    assert wait_for(lambda: received, timeout=90), "no transcript arrived"
    msg = received[0]
    assert msg.text and msg.language == "en" and msg.model_id == node.model.model_id
