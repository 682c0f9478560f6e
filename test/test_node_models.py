"""Nodes choose their model by the skills they need, through the registry and one shared engine
per checkpoint: any family with the skills loads; one without them is refused with a reason, and
the node stays up to say so."""
import pytest
from rclpy.parameter import Parameter

from moondream_fixtures import checkpoint
from photon_core.runtime.shared_models import shared_engine
from photon_ros.speech_node import SpeechNode
from photon_ros.vision_node import VisionNode
from ros_harness import RosGraph, wait_for


@pytest.fixture
def graph():
    g = RosGraph()
    yield g
    g.close()


def vision(graph, **params):
    overrides = [Parameter(k, value=v) for k, v in params.items()]
    node = graph.add(VisionNode(context=graph.context, parameter_overrides=overrides))
    assert wait_for(lambda: node.engine is not None or node.model_error, timeout=120)
    return node


def test_a_speech_model_is_refused_by_the_vision_node_with_the_reason(graph):
    node = vision(graph, model="whisper-tiny.en", detect=["cup"])
    assert node.engine is None and "whisper model cannot detect" in node.model_error
    node = vision(graph, model="whisper-tiny.en")
    assert node.engine is None and "not a vision model" in node.model_error


def test_the_vision_node_takes_a_family_by_its_skills_and_refuses_what_it_lacks(graph):
    node = vision(graph, model=str(checkpoint()), detect=["cup"])
    assert node.engine is not None and node.engine.family.name == "moondream"
    assert node.lacks("transcribe") == "a moondream model cannot transcribe (it offers caption, detect, point, query)"
    assert node.lacks("detect") == ""


def test_the_speech_node_takes_any_transcribing_family_and_refuses_others(graph):
    refused = graph.add(SpeechNode(context=graph.context, parameter_overrides=[
        Parameter("model", value=str(checkpoint()))]))
    assert wait_for(lambda: refused.model is not None or refused.model_error, timeout=120)
    assert refused.model is None and "moondream model cannot transcribe" in refused.model_error
    speech = graph.add(SpeechNode(context=graph.context, parameter_overrides=[
        Parameter("model", value="whisper-tiny.en")], namespace="robot2"))
    assert wait_for(lambda: speech.model is not None or speech.model_error, timeout=120)
    assert speech.model is shared_engine("whisper-tiny.en", skills=["transcribe"]).model


def test_names_of_one_checkpoint_share_one_engine(tmp_path):
    path = checkpoint()
    (tmp_path / "camera_model").symlink_to(path)
    a = shared_engine(str(path), skills=["detect"])
    b = shared_engine(str(tmp_path / "camera_model"), skills=["point"])
    assert a is b and a.family.name == "moondream"
