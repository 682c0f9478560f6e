"""Nodes choose their model by the skills they need, through the registry and one shared engine
per checkpoint: any family with the skills loads; one without them is refused with a reason, and
the node stays up to say so."""
import pytest
import torch
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


def test_dtype_auto_and_the_dtype_it_resolves_to_share_one_engine(monkeypatch):
    """Keyed by the dtype as written, auto (None) and "float32" on the CPU loaded the same weights
    twice: each copy the model's whole memory, and cameras on different copies never batched."""
    from photon_core import registry
    from photon_core.runtime.shared_models import cached_engines, release

    loads = []
    real = registry.Recognised.load
    monkeypatch.setattr(registry.Recognised, "load", lambda self, *a: loads.append(a) or real(self, *a))
    held_before = {id(e) for e in cached_engines()}
    a = shared_engine(str(checkpoint()), "cpu", None, skills=["detect"])
    b = shared_engine(str(checkpoint()), "cpu", "float32", skills=["detect"])
    c = shared_engine(str(checkpoint()), "cpu", torch.float32, skills=["detect"])
    try:
        assert a is b is c
        assert len(loads) == (0 if id(a) in held_before else 1)
    finally:
        for engine in (a, b, c):
            release(engine)


def test_engine_keys_name_the_device_and_dtype_the_load_uses():
    """"cuda" is "cuda:0", and auto there is bfloat16 (tensor_files.default_dtype): one key, found
    without touching CUDA. Whisper's auto also picks its CPU defaults (int8 decoder), so there it
    stays apart from an explicit "float32"."""
    from photon_core.models.moondream import FAMILY as MOONDREAM
    from photon_core.models.whisper import FAMILY as WHISPER
    from photon_core.runtime.shared_models import engine_key

    path = checkpoint()
    cuda = {engine_key(MOONDREAM, path, device, dtype, "auto")
            for device, dtype in (("cuda", None), ("cuda:0", None), ("cuda:0", "bfloat16"),
                                  ("cuda", torch.bfloat16), ("cuda", "bf16"))}
    assert len(cuda) == 1
    assert engine_key(MOONDREAM, path, "cuda:1", None, "auto") not in cuda
    assert engine_key(MOONDREAM, path, "cuda", "float32", "auto") not in cuda
    assert not torch.cuda.is_initialized()
    assert engine_key(MOONDREAM, path, "cpu", None, "auto") == engine_key(MOONDREAM, path, "cpu", "fp32", "auto")
    assert engine_key(WHISPER, path, "cpu", None, "auto") != engine_key(WHISPER, path, "cpu", "float32", "auto")
    # a dtype the load refuses never keys as a valid one
    assert engine_key(MOONDREAM, path, "cpu", "torch.float32", "auto") != engine_key(MOONDREAM, path, "cpu", "float32", "auto")


def meanwhile(call, timeout: float = 60.0):
    """`call()`'s result, made in a thread of its own while the test holds a gate shut (a load, a
    batch): it must return without the gate, which the test opens only afterwards. A call that waited
    for the gate is still waiting at the timeout: the test fails, whatever the machine's speed."""
    import threading
    out: list = []
    t = threading.Thread(target=lambda: out.append(call()), daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive() and out, f"still waiting after {timeout} s (for the gate?)"
    return out[0]


def test_a_load_holds_up_other_loads_only():
    """The cache's lock was held across a load: another node's cleanup (a release) and a lookup
    of a loaded model waited for a 15 s load of some other model. Loads still go one at a time,
    and one key loads once."""
    import threading

    from photon_core.runtime.shared_models import release, shared_model

    loaded = shared_model(("test", "loaded"), lambda: object())
    gate, loading, loads = threading.Event(), threading.Event(), []

    def slow():
        loads.append(1)
        loading.set()
        gate.wait(300)    # until the test opens it: far past meanwhile()'s wait
        return object()
    started = [threading.Thread(target=lambda: shared_model(("test", "slow"), slow)) for _ in range(2)]
    try:
        for t in started:
            t.start()
        assert loading.wait(60)                                  # the load is under way
        # in the cache: no wait for the load, which cannot end before the gate opens
        again = meanwhile(lambda: shared_model(("test", "loaded"), lambda: object()))
        assert meanwhile(lambda: (again is loaded, release(again), release(loaded))) == (True, False, True)
        assert not gate.is_set() and loads == [1]
    finally:
        gate.set()
    for t in started:
        t.join(60)
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

    from photon_core.runtime.shared_models import cached_engines, release, shared_model

    gate, ran, order = threading.Event(), threading.Event(), []

    def batch(items):
        ran.set()
        gate.wait(300)    # until the test opens it: far past meanwhile()'s wait
        order.append("last batch served")
        return items

    busy = shared_model(("test", "busy"), lambda: SimpleNamespace(batch=batch))
    other = shared_model(("test", "other"), lambda: object())
    asking = threading.Thread(target=lambda: busy.batcher.submit(["x"]))
    try:
        asking.start()
        assert ran.wait(60)
        releasing = threading.Thread(target=lambda: release(busy))
        releasing.start()
        # the release is under way (the engine left the cache; retire waits for the batch)
        assert wait_for(lambda: busy not in cached_engines(), timeout=60)
        # in the cache: no wait for the batch, which cannot end before the gate opens
        assert meanwhile(lambda: shared_model(("test", "other"), lambda: object())) is other
        assert order == []
        loading = threading.Thread(target=lambda: shared_model(("test", "new"), lambda: order.append("loaded")))
        loading.start()
        time.sleep(0.3)
        assert order == []                                        # a load waits for the memory
    finally:
        gate.set()
    for t in (asking, releasing, loading):
        t.join(60)
    assert order == ["last batch served", "loaded"]
    from photon_core.runtime.shared_models import _models
    for key in (("test", "other"), ("test", "other"), ("test", "new")):
        release(_models[key])


def test_freeing_memory_waits_for_a_capture_in_another_thread(monkeypatch):
    """A released engine's empty_cache ran while another node of the process captured a CUDA
    graph (a component container): the allocator's assert fails then. It waits for the capture."""
    import threading

    from photon_core.runtime import cuda_graph
    from photon_core.runtime.shared_models import free_memory

    seen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: seen.append(cuda_graph._CAPTURING.locked()))
    with cuda_graph._CAPTURING:            # a capture under way in another thread
        freeing = threading.Thread(target=free_memory)
        freeing.start()
        freeing.join(0.5)
        assert freeing.is_alive() and seen == []   # waits: nothing emptied during the capture
    freeing.join(10)
    assert seen == [True]                  # once it ended, under the lock, so no capture begins meanwhile
