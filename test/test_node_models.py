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


def test_a_load_holds_up_other_loads_only():
    """The cache's lock was held across a load: another node's cleanup (a release) and a lookup
    of a loaded model waited for a 15 s load of some other model. Loads still go one at a time,
    and one key loads once."""
    import threading
    import time

    from photon_core.runtime.shared_models import release, shared_model

    loaded = shared_model(("test", "loaded"), lambda: object())
    gate, loads = threading.Event(), []

    def slow():
        loads.append(1)
        gate.wait(10)
        return object()
    started = [threading.Thread(target=lambda: shared_model(("test", "slow"), slow)) for _ in range(2)]
    for t in started:
        t.start()
    time.sleep(0.2)
    begun = time.monotonic()
    again = shared_model(("test", "loaded"), lambda: object())   # in the cache: no wait
    assert again is loaded and release(again) is False and release(loaded) is True
    assert time.monotonic() - begun < 1.0
    gate.set()
    for t in started:
        t.join(10)
    assert loads == [1]                                          # two callers, one load
    from photon_core.runtime.shared_models import _models
    engine = _models[("test", "slow")]
    assert engine.holders == 2 and not release(engine) and release(engine)


def test_a_release_serving_its_last_batch_holds_up_loads_only():
    """A node's cleanup (release) serves its engine's last batch, which may decode for seconds:
    it held the cache's lock meanwhile, and every other node's configure waited on it, a model
    already loaded too. Loads still wait for the released engine's memory."""
    import threading
    import time
    from types import SimpleNamespace

    from photon_core.runtime.shared_models import release, shared_model

    gate, ran, order = threading.Event(), threading.Event(), []

    def batch(items):
        ran.set()
        gate.wait(10)
        order.append("last batch served")
        return items

    busy = shared_model(("test", "busy"), lambda: SimpleNamespace(batch=batch))
    other = shared_model(("test", "other"), lambda: object())
    asking = threading.Thread(target=lambda: busy.batcher.submit(["x"]))
    asking.start()
    assert ran.wait(10)
    releasing = threading.Thread(target=lambda: release(busy))
    releasing.start()
    time.sleep(0.2)                                               # retire waits for the batch
    begun = time.monotonic()
    assert shared_model(("test", "other"), lambda: object()) is other   # in the cache: no wait
    assert time.monotonic() - begun < 1.0
    loading = threading.Thread(target=lambda: shared_model(("test", "new"), lambda: order.append("loaded")))
    loading.start()
    time.sleep(0.3)
    assert order == []                                            # a load waits for the memory
    gate.set()
    for t in (asking, releasing, loading):
        t.join(10)
    assert order == ["last batch served", "loaded"]
    from photon_core.runtime.shared_models import _models
    for key in (("test", "other"), ("test", "other"), ("test", "new")):
        release(_models[key])
