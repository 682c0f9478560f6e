"""The microphone node over real DDS, with a stand-in for the one part that cannot exist here, the
sound card (PortAudio through `sounddevice`): the stand-in calls the node back as PortAudio does,
block by block, and can stop calling (a microphone unplugged) or flag an overflow.

What the node must do: publish every captured block, stamped on the sample clock; send what was
captured before a shutdown; and when the device stops delivering, reopen it and say so on
/diagnostics instead of leaving the robot deaf while everything looks fine."""
from __future__ import annotations

import sys
import threading
import time
from types import ModuleType, SimpleNamespace

import numpy as np
import pytest
from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus
from rclpy.parameter import Parameter
from rclpy.qos import QoSProfile, ReliabilityPolicy

from photon_ros.msg import AudioChunk
from photon_ros.result_messages import time_to_seconds
from ros_harness import RosGraph, wait_for

RELIABLE = QoSProfile(depth=100, reliability=ReliabilityPolicy.RELIABLE)
RATE, BLOCK = 16000, 1600


class SoundCard:
    """`sounddevice` as the node uses it: InputStream(callback=...) whose blocks the test delivers."""

    def __init__(self) -> None:
        self.streams: list[FakeStream] = []
        self.plugged = False   # True: every open stream delivers by itself, in real time
        self.start_fails = False   # True: a stream opens but will not start (PortAudio's "device unavailable")
        # Devices by name -> card number: as PortAudio listed them when it started (None: any device
        # opens), and as they are attached now. A stale entry does not open.
        self.listed: dict[str, int] | None = None
        self.attached: dict[str, int] = {}
        self.rescans = 0

    def module(self) -> ModuleType:
        mod = ModuleType("sounddevice")
        mod.InputStream = lambda **kw: self._open(**kw)
        mod._initialized = 1
        mod._terminate = lambda: None
        mod._initialize = self._initialize
        mod.query_devices = self._query_devices
        return mod

    def _query_devices(self, index=None):
        listed = [{"name": name, "max_input_channels": 1} for name in (self.listed or {})]
        return listed if index is None else listed[index]

    def _initialize(self) -> None:
        self.rescans += 1
        if self.listed is not None:
            self.listed = dict(self.attached)

    def _open(self, **kw) -> "FakeStream":
        name = kw["device"]
        if isinstance(name, int) and self.listed is not None:   # an index into PortAudio's list
            name = list(self.listed)[name] if name < len(self.listed) else f"#{name}"
        if self.listed is not None and (name not in self.listed or self.attached.get(name) != self.listed[name]):
            raise ValueError(f"No input device matching {name!r}" if name not in self.listed else
                             "Error opening InputStream: Unanticipated host error [PaErrorCode -9999]")
        stream = FakeStream(card=self, **kw)
        self.streams.append(stream)
        return stream


class FakeStream:
    def __init__(self, card, samplerate, channels, dtype, blocksize, device, callback) -> None:
        self.card = card
        self.rate, self.channels, self.block, self.callback = samplerate, channels, blocksize, callback
        self.device, self.started, self.closed = device or "fake card", False, False
        self.device_arg = device   # as the node passed it: None (the default input), an index or a name
        self.sent = 0
        self.buffering: float | None = None   # capture-to-callback delay the stream reports; None: no times
        self.calls: list[tuple[float, float]] = []   # wall clock just before and after each callback

    def start(self) -> None:
        if self.card.start_fails:
            raise RuntimeError("Error starting stream: Device unavailable [PaErrorCode -9985]")
        self.started = True
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while not self.closed:
            if self.card.plugged:
                self.deliver(1)
            else:
                time.sleep(0.01)

    def stop(self) -> None:
        self._not_closed("stop")

    def close(self) -> None:
        self._not_closed("close")
        self.closed = True

    def _not_closed(self, call: str) -> None:
        # older sounddevice releases handed a closed stream's freed pointer to PortAudio
        if self.closed:
            raise RuntimeError(f"{call}() on a closed stream")

    def deliver(self, n: int = 1, overflow: bool = False, zeros: bool = False) -> None:
        """n blocks as PortAudio's thread hands them over, in real time: a ramp, so each sample is
        traceable (or digital silence, a muted device's)."""
        for _ in range(n):
            time.sleep(self.block / self.rate)
            ramp = (np.arange(self.sent, self.sent + self.block) % 30000).astype(np.int16) * (not zeros)
            status = SimpleNamespace(input_overflow=overflow)
            # PortAudio's times are on the stream's own clock (an arbitrary origin); a host API
            # that has none reports 0
            now = time.monotonic() + 1000.0
            adc = 0.0 if self.buffering is None else now - self.block / self.rate - self.buffering
            times = SimpleNamespace(inputBufferAdcTime=adc, currentTime=now if adc else 0.0)
            before = time.time()
            self.callback(ramp.reshape(-1, 1).repeat(self.channels, axis=1), self.block, times, status)
            self.calls.append((before, time.time()))
            self.sent += self.block


@pytest.fixture
def card(monkeypatch):
    card = SoundCard()
    monkeypatch.setitem(sys.modules, "sounddevice", card.module())
    return card


@pytest.fixture
def graph():
    g = RosGraph()
    yield g
    g.close()


def microphone(graph, **params):
    from photon_ros.microphone_node import MicrophoneNode
    overrides = [Parameter(k, value=v) for k, v in params.items()]
    return graph.add(MicrophoneNode(context=graph.context, parameter_overrides=overrides))


def listen(graph):
    chunks, statuses = [], []
    node = graph.node("listener")
    node.create_subscription(AudioChunk, "audio", chunks.append, RELIABLE)
    node.create_subscription(DiagnosticArray, "/diagnostics",
                             lambda m: statuses.extend(s for s in m.status if s.name.endswith("/microphone")),
                             RELIABLE)
    return chunks, statuses


def test_blocks_are_published_on_the_sample_clock_and_sent_at_shutdown(graph, card):
    chunks, _ = listen(graph)
    mic = microphone(graph)
    assert wait_for(lambda: mic.publisher.get_subscription_count() > 0, timeout=10)
    card.streams[0].deliver(5)
    assert wait_for(lambda: len(chunks) == 5, timeout=10)
    starts = [time_to_seconds(c.header.stamp) for c in chunks]
    assert np.allclose(np.diff(starts), BLOCK / RATE, atol=0.011 * BLOCK / RATE)   # within the clock's 1% slew
    # Blocks captured just before the shutdown, not yet published by the executor's timer, are sent.
    graph.executor.remove_node(mic)
    card.streams[0].deliver(3)
    mic.destroy_node()
    graph.nodes.remove(mic)
    assert wait_for(lambda: len(chunks) == 8, timeout=10)
    samples = np.concatenate([np.frombuffer(bytes(c.data), "<i2") for c in chunks])
    assert np.array_equal(samples, np.arange(8 * BLOCK) % 30000)   # nothing lost, nothing repeated
    assert card.streams[0].closed


@pytest.mark.parametrize("buffering, expected", [(0.08, 0.08), (None, 0.0), (5.0, 0.0)],
                         ids=["reported", "no-times", "implausible"])
def test_a_chunk_is_stamped_when_its_first_sample_was_captured(graph, card, buffering, expected):
    """USB microphones and sound servers hold audio for tens of ms before PortAudio calls back:
    what the stream reports of it comes off the stamp (a host API without times, or with times
    no sound card could mean, leaves the callback's time)."""
    chunks, _ = listen(graph)
    mic = microphone(graph)
    assert wait_for(lambda: mic.publisher.get_subscription_count() > 0, timeout=10)
    stream = card.streams[0]
    stream.buffering = buffering
    stream.deliver(1)
    assert wait_for(lambda: chunks, timeout=10)
    (before, after), duration = stream.calls[0], BLOCK / RATE
    stamp = time_to_seconds(chunks[0].header.stamp)
    assert before - duration - expected - 0.005 <= stamp <= after - duration - expected + 0.005


def test_a_block_without_usable_times_keeps_the_last_delay(graph, card):
    """Host APIs give 0 times now and then, and a sound server's latency may cross the bound: such a
    block keeps the stream's last usable delay. Taken as 0, a few such blocks in a row moved the
    stamps by the whole delay (0.3 s here) and the next usable ones moved them back: the speech
    node saw lost audio, then time running back."""
    chunks, _ = listen(graph)
    mic = microphone(graph)
    assert wait_for(lambda: mic.publisher.get_subscription_count() > 0, timeout=10)
    stream = card.streams[0]
    for buffering in (0.3, 0.3, None, None, None, 0.3, 5.0, 5.0, 5.0, 0.3):
        stream.buffering = buffering
        stream.deliver(1)
    assert wait_for(lambda: len(chunks) == 10, timeout=10)
    starts = [time_to_seconds(c.header.stamp) for c in chunks]
    assert np.allclose(np.diff(starts), BLOCK / RATE, atol=0.011 * BLOCK / RATE), np.diff(starts)


def test_a_device_that_stops_is_reopened_and_diagnostics_say_so(graph, card):
    chunks, statuses = listen(graph)
    card.plugged = True
    mic = microphone(graph, stall_s=0.5)
    assert wait_for(lambda: statuses and statuses[-1].level == DiagnosticStatus.OK and chunks, timeout=10)
    # Unplugged: no callback comes any more. The node reopens the device and reports an ERROR.
    card.plugged = False
    assert wait_for(lambda: len(card.streams) >= 2, timeout=10)
    assert card.streams[0].closed and card.streams[-1].started
    assert wait_for(lambda: statuses[-1].level == DiagnosticStatus.ERROR, timeout=10), statuses[-1]
    assert "no audio from" in statuses[-1].message
    # Plugged back: blocks come from the new stream, stamped anew (the stall shows as a jump).
    before = len(chunks)
    card.plugged = True
    assert wait_for(lambda: len(chunks) >= before + 2, timeout=10)
    gap = time_to_seconds(chunks[before].header.stamp) - time_to_seconds(chunks[before - 1].header.stamp)
    assert gap > 0.5
    assert wait_for(lambda: statuses[-1].level == DiagnosticStatus.OK, timeout=10), statuses[-1]
    values = dict((v.key, v.value) for v in statuses[-1].values)
    assert int(values["stream_reopened"]) >= 1


def test_a_microphone_back_under_another_card_number_is_found(graph, card):
    """PortAudio lists the devices once: a USB microphone plugged back in after another sound
    device took its card number is not where that list says. Reopening by name kept failing for
    good (a deaf robot); after a failed try the node has PortAudio list the devices again."""
    chunks, statuses = listen(graph)
    card.listed = card.attached = {"USB mic": 2}
    card.plugged = True
    mic = microphone(graph, device="USB mic", stall_s=0.3)
    assert wait_for(lambda: chunks, timeout=10)
    card.plugged, card.attached = False, {}
    assert wait_for(lambda: statuses and "reopening failed" in statuses[-1].message, timeout=10), [s.message for s in statuses[-3:]]
    card.attached = {"USB mic": 3}
    before = len(chunks)
    card.plugged = True
    assert wait_for(lambda: len(chunks) >= before + 2, timeout=10), statuses[-1]
    assert wait_for(lambda: statuses[-1].level == DiagnosticStatus.OK, timeout=10), statuses[-1]
    assert int(dict((v.key, v.value) for v in statuses[-1].values)["device_list_rescanned"]) >= 1


@pytest.mark.parametrize("before, after", [
    # its old index names another device now
    ({"HDMI": 0, "USB mic": 2}, {"HDMI": 0, "webcam mic": 3, "USB mic": 4}),
    # ALSA's names carry the card number ("USB mic: Audio (hw:2,0)"): the name it had is gone
    ({"HDMI 0 (hw:0,3)": 0, "USB mic: Audio (hw:2,0)": 2},
     {"HDMI 0 (hw:0,3)": 0, "webcam mic: Audio (hw:2,0)": 2, "USB mic: Audio (hw:3,0)": 3}),
], ids=["moved", "alsa_card_number"])
@pytest.mark.parametrize("by", ["index", "alsa_name"])
def test_a_microphone_by_index_is_found_again_after_the_list_changed(graph, card, before, after, by):
    """An index numbers PortAudio's list: plugged back after another device was enumerated, the
    microphone moved to another index, and its old one named the other device. Reopened by the
    old index, the robot would have listened through the wrong microphone, saying all was well;
    matched on its whole ALSA name (with the old card number), it was never found again, nor
    when that whole name was the configured device (as `python -m sounddevice` prints it)."""
    chunks, statuses = listen(graph)
    card.listed = card.attached = before
    card.plugged = True
    microphone(graph, device=1 if by == "index" else list(before)[1], stall_s=0.3)
    assert wait_for(lambda: chunks, timeout=10)
    card.plugged, card.attached = False, dict(list(before.items())[:1])
    assert wait_for(lambda: statuses and "reopening failed" in statuses[-1].message, timeout=10), statuses[-1:]
    card.attached = after
    count = len(chunks)
    card.plugged = True
    assert wait_for(lambda: len(chunks) >= count + 2, timeout=10), statuses[-1]
    named = list(before)[1]   # a plain name (no card number) is PortAudio's to match: passed as it is
    expected = named if by == "alsa_name" and "(hw:" not in named else 2
    assert card.streams[-1].device_arg == expected, card.streams[-1].device_arg


def test_the_devices_are_not_listed_again_while_another_microphone_streams(card):
    """Restarting PortAudio closes every stream of the process: with another microphone node's
    stream open here (bringup, the speech node's --microphones), the list is left as it is."""
    import sounddevice

    from photon_ros.microphone_node import _OPEN_STREAMS, rescan_devices
    other = object()
    _OPEN_STREAMS.add(other)
    try:
        assert not rescan_devices(sounddevice) and card.rescans == 0
    finally:
        _OPEN_STREAMS.discard(other)
    assert rescan_devices(sounddevice) and card.rescans == 1


def test_the_devices_are_not_listed_again_while_another_microphone_opens_its_stream(card):
    """Each microphone node reopens on its own executor thread: a restart of PortAudio while
    another node's stream was being opened (made, not yet counted as open) terminated PortAudio
    under it. The restart waits for the opening, and then leaves the list as it is."""
    import sounddevice

    from photon_ros.microphone_node import _OPEN_STREAMS, MicrophoneNode, rescan_devices
    opening, go_on = threading.Event(), threading.Event()
    make = sounddevice.InputStream

    def slow_open(**kw):
        opening.set()
        go_on.wait(5)
        return make(**kw)
    sounddevice.InputStream = slow_open
    other = SimpleNamespace(sd=sounddevice, rate=RATE, channels=1, block=BLOCK, open_device=None, device=None,
                            device_label="", on_block=lambda *args: None, stream=None)
    opener = threading.Thread(target=lambda: setattr(other, "stream", MicrophoneNode.open_stream(other)))
    opener.start()
    rescanned: list[bool] = []
    try:
        assert opening.wait(5)
        rescanner = threading.Thread(target=lambda: rescanned.append(rescan_devices(sounddevice)))
        rescanner.start()
        time.sleep(0.2)
        go_on.set()
        opener.join(5)
        rescanner.join(5)
        assert rescanned == [False] and card.rescans == 0, (rescanned, card.rescans)
    finally:
        go_on.set()
        opener.join(5)
        _OPEN_STREAMS.discard(other.stream)
        if other.stream is not None:
            other.stream.close()


def test_a_stream_that_will_not_start_is_closed_and_tried_again(graph, card):
    """A device that is back but busy opens and then fails to start: each such stream is closed
    at once (left open, it held the device until the garbage collector came by), and the node
    keeps trying until one starts."""
    chunks, statuses = listen(graph)
    card.plugged = True
    mic = microphone(graph, stall_s=0.5)
    assert wait_for(lambda: chunks, timeout=10)
    card.plugged, card.start_fails = False, True
    assert wait_for(lambda: len(card.streams) >= 3, timeout=10)
    assert wait_for(lambda: "reopening failed" in statuses[-1].message, timeout=10), statuses[-1]
    failed = card.streams[1:-1] if not card.streams[-1].closed else card.streams[1:]
    assert failed and all(s.closed and not s.started for s in failed)
    card.plugged, card.start_fails = True, False
    before = len(chunks)
    assert wait_for(lambda: len(chunks) > before and statuses[-1].level == DiagnosticStatus.OK, timeout=10)
    assert card.streams[-1].started and not card.streams[-1].closed


def test_a_stream_closed_for_a_reopening_that_failed_is_not_used_again(graph, card):
    """After a reopening failed, the node held on to the stream it had closed for it, and its
    shutdown stopped and closed that stream again."""
    chunks, statuses = listen(graph)
    card.plugged = True
    mic = microphone(graph, stall_s=0.3)
    assert wait_for(lambda: chunks, timeout=10)
    card.plugged, card.start_fails = False, True
    assert wait_for(lambda: statuses and "reopening failed" in statuses[-1].message, timeout=10), statuses[-1:]
    graph.executor.remove_node(mic)
    graph.nodes.remove(mic)
    mic.destroy_node()
    assert all(s.closed for s in card.streams)


def test_an_overflow_is_counted_and_warned_about(graph, card):
    _, statuses = listen(graph)
    mic = microphone(graph)
    assert wait_for(lambda: mic.publisher.get_subscription_count() > 0, timeout=10)
    card.streams[0].deliver(1)
    card.streams[0].deliver(1, overflow=True)
    assert wait_for(lambda: statuses and statuses[-1].level == DiagnosticStatus.WARN, timeout=10)
    assert "audio was lost" in statuses[-1].message
    assert dict((v.key, v.value) for v in statuses[-1].values)["input_overflows"] == "1"


def test_a_device_that_delivers_only_zeros_is_warned_about(graph, card, monkeypatch):
    """A muted microphone, or a sound server's null source after an unplug, delivers blocks of 0:
    /diagnostics said "capturing", OK, while the robot heard nothing."""
    import photon_ros.microphone_node as microphone_node
    monkeypatch.setattr(microphone_node, "DIGITAL_SILENCE_WARN_S", 0.3)
    _, statuses = listen(graph)
    mic = microphone(graph)
    assert wait_for(lambda: mic.publisher.get_subscription_count() > 0, timeout=10)
    card.streams[0].deliver(5, zeros=True)
    assert wait_for(lambda: statuses and "digital silence" in statuses[-1].message, timeout=10)
    assert statuses[-1].level == DiagnosticStatus.WARN
    card.streams[0].deliver(1)   # sound again
    assert wait_for(lambda: statuses[-1].level == DiagnosticStatus.OK, timeout=10), statuses[-1].message


@pytest.mark.parametrize("device, index", [(2, 2), ("2", 2), ("0", 0)], ids=["number", "string", "zero"])
def test_a_device_index_opens_that_device_and_is_named_on_diagnostics(graph, card, device, index):
    """`device: 2` in the YAML (an index, as config/photon.yaml says it may be) stopped the node at
    startup ("must be a string"); index 0 was opened but named "default input" on /diagnostics."""
    _, statuses = listen(graph)
    microphone(graph, device=device)
    assert card.streams[0].device_arg == index
    assert wait_for(lambda: statuses, timeout=10)
    assert statuses[-1].hardware_id == str(index)


def test_a_negative_device_index_is_refused_at_startup(graph, card):
    with pytest.raises(ValueError, match="device"):
        microphone(graph, device=-1)
