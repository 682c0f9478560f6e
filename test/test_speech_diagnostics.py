"""/diagnostics of the speech node when commands are lost: utterances dropped from a backlog the
model could not keep up with, and audio lost at jumps in the stamps, raise the level to WARN with
what was lost, for as long as the loss is recent; failures of one configuration are not reported
after the next, and the audio QoS reported is the subscription's. One real (unspun) rclpy node;
the published status is taken from publish_diagnostics, the function that builds it."""
import time

import numpy as np
import pytest
import rclpy
from diagnostic_msgs.msg import DiagnosticStatus
from rclpy.parameter import Parameter

import photon_ros.speech_node as speech_node
from fake_speech_model import fake_speech_model
from photon_ros.audio_conversions import pcm_to_audio_chunk
from photon_ros.managed import SUCCESS
from photon_ros.msg import AudioChunk
from photon_ros.speech_node import SpeechNode
from photon_ros.speech_segmenter import SpeechSegmenter, Utterance


def level(value) -> int:
    """A status level as an int (rosidl gives the byte fields and constants as bytes)."""
    value = value.level if isinstance(value, DiagnosticStatus) else value
    return value[0] if isinstance(value, bytes) else value


OK, WARN, ERROR = level(DiagnosticStatus.OK), level(DiagnosticStatus.WARN), level(DiagnosticStatus.ERROR)


class Clock:
    """The speech node's time module with a monotonic clock the test moves (only that module's)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    def __getattr__(self, name):
        return getattr(time, name)


@pytest.fixture
def node(monkeypatch):
    ctx = rclpy.Context()
    rclpy.init(context=ctx)
    node = SpeechNode(context=ctx, parameter_overrides=[Parameter("autostart", value=False),
                                                        Parameter("max_pending_s", value=5.0)])
    node.clock = Clock()
    monkeypatch.setattr(speech_node, "time", node.clock)
    node.sent = []
    node.pub_diagnostics.publish = node.sent.append
    node.lifecycle_state = lambda: "active"     # as if active with audio arriving: level OK 'running'
    node.chunks_received = 100
    node.input_arrived()
    try:
        yield node
    finally:
        node.destroy_node()
        rclpy.shutdown(context=ctx)


def status(node) -> DiagnosticStatus:
    node.publish_diagnostics()
    return node.sent[-1].status[0]


def test_utterances_dropped_from_the_backlog_warn_while_recent(node):
    assert level(status(node)) == OK
    for i in range(4):     # 4 x 3 s of speech while the model is busy: 5 s fit, the oldest go
        node.enqueue(Utterance(np.zeros(3 * 16000, np.float32), 16000, 100.0 + 3 * i))
    assert node.queue.dropped > 0
    st = status(node)
    assert level(st) == WARN and "dropped" in st.message and f"{node.queue.dropped} utterance" in st.message
    node.clock.now += 5.0           # still recent, nothing new: still a warning
    assert level(status(node)) == WARN
    node.clock.now += 60.0          # no loss for a minute: the node is fine again
    assert level(status(node)) == OK
    node.enqueue(Utterance(np.zeros(3 * 16000, np.float32), 16000, 200.0))   # another one goes
    assert level(status(node)) == WARN


def test_audio_lost_at_a_jump_in_the_stamps_warns_while_recent(node):
    rate, chunk = 16000, 1600
    node.segmenter = SpeechSegmenter(rate)
    node.segmenter.push(np.zeros(chunk, np.float32), 100.0)
    assert level(status(node)) == OK
    node.segmenter.push(np.zeros(chunk, np.float32), 100.5)      # 0.4 s of audio missing
    st = status(node)
    assert level(st) == WARN and "audio lost" in st.message and "0.40 s" in st.message
    node.clock.now += 60.0
    assert level(status(node)) == OK


@pytest.fixture
def managed(monkeypatch):
    """A speech node a manager drives (autostart false), whose configure loads a fake model."""
    model = fake_speech_model(monkeypatch)
    ctx = rclpy.Context()
    rclpy.init(context=ctx)
    node = SpeechNode(context=ctx, parameter_overrides=[Parameter("autostart", value=False)])
    node.fake = model
    node.sent = []
    node.pub_diagnostics.publish = node.sent.append
    try:
        yield node
    finally:
        node.destroy_node()
        rclpy.shutdown(context=ctx)


def values(st: DiagnosticStatus) -> dict[str, str]:
    return {v.key: v.value for v in st.values}


def test_failures_of_one_configuration_are_not_reported_after_the_next(managed):
    """Transcriptions that failed on the model of one configuration (and chunks refused by its
    subscription) kept /diagnostics ERROR after a manager configured a fixed one, until something
    succeeded: in a quiet room, never. A deactivate and activate change nothing: still ERROR."""
    node = managed
    assert node.trigger_configure() == SUCCESS and node.trigger_activate() == SUCCESS
    node.fake.broken = "CUDA error: out of memory"
    bad = AudioChunk(sample_rate=16000, channels=1, sample_format="bogus", data=bytes(320))
    for i in range(3):
        node.on_audio(bad, None)
        assert node.run_model(Utterance(np.zeros(1600, np.float32), 16000, 100.0 + i))[0] is None
    st = status(node)
    assert level(st) == ERROR and "all failed" in st.message
    assert node.trigger_deactivate() == SUCCESS and node.trigger_activate() == SUCCESS
    assert level(status(node)) == ERROR      # the same model: it still fails
    # and its reader was reliable, where the microphone's driver is best effort
    node.incompatible_qos = "a publisher on /audio offers QoS this node cannot match (RELIABILITY)"

    node.fake.broken = ""
    assert node.trigger_deactivate() == SUCCESS and node.trigger_cleanup() == SUCCESS
    assert node.trigger_configure() == SUCCESS and node.trigger_activate() == SUCCESS
    st = status(node)
    # nothing arrived since: said so, where the old chunk count hid it
    assert (level(st), st.message) == (WARN, "no audio received"), st.message
    assert values(st)["chunks_received"] == "0"
    node.on_audio(pcm_to_audio_chunk(np.zeros(1600, np.float32), 16000, AudioChunk.FORMAT_F32LE), None)
    assert (level(status(node)), status(node).message) == (OK, "running")


def test_audio_qos_is_the_subscriptions_until_the_next_configure(managed):
    """reliability applies at configure: /diagnostics reported the new value at once, while the
    subscription went on with the old one (a driver it could not match looked matched)."""
    node = managed
    assert node.trigger_configure() == SUCCESS
    assert node.set_parameters([Parameter("reliability", value="reliable")])[0].successful
    assert values(status(node))["audio_qos"] == "best_effort"
    assert node.subscription.qos_profile.reliability == speech_node.RELIABILITIES["best_effort"]
    assert node.trigger_cleanup() == SUCCESS and node.trigger_configure() == SUCCESS
    assert values(status(node))["audio_qos"] == "reliable"
    assert node.subscription.qos_profile.reliability == speech_node.RELIABILITIES["reliable"]
