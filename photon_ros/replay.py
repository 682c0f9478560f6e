"""Publish recorded inputs into a running graph: at the bag's pace, or as fast as it takes them.

At a rate (1.0 = as recorded) every stream keeps the bag's spacing relative to the bag's first
message, and what the graph cannot keep up with it drops, as it would on the robot. At "max" each
stream waits at a gate until the graph has dealt with what came before: frames a bounded window
ahead of the results (one by default: the vision node keeps one waiting frame and drops older
ones, so a deeper window makes it drop frames, and its counters show how many), audio a bounded
window ahead of what the speech node has consumed (its subscription keeps 100 chunks; a longer
backlog would push chunks out unheard). Streams run on threads of their own, so slow vision
never starves the audio (the speech node would take a pause in the audio for the end of the
stream).
"""
from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass
from typing import Any, Sequence

from photon_ros.bag_io import BagMessage, stamp_ns
from photon_ros.graph_probe import GraphError, SpeechProbe, VisionProbe

POLL_S = 0.002


@dataclass
class Stream:
    name: str                   # "image" or "audio"
    topic: str                  # the graph's topic it is published on
    messages: Sequence[BagMessage]
    publisher: Any = None       # rclpy publisher, made by the caller
    gate: "Gate | None" = None  # pacing at max rate
    lead_s: float = 0.0         # at max rate, how far ahead of the bag's order it may go (BagOrder)


@dataclass
class Published:
    stream: str
    index: int                  # position in its stream
    stamp_ns: int | None        # header stamp of the message, as recorded
    log_time_ns: int            # its time in the bag
    at: float                   # time.monotonic() when it was published
    wall_ns: int = 0            # time.time_ns() then: the clock nodes stamp unstamped input with


def replay_offsets(log_times_ns: Sequence[int], first_ns: int, rate: float | None) -> list[float]:
    """Seconds after the replay starts at which each message is due: the bag's spacing from its
    first message (`first_ns`, shared by all streams), divided by `rate`; all zero at max rate
    (rate None), where the gates pace the streams."""
    if rate is None:
        return [0.0] * len(log_times_ns)
    if rate <= 0:
        raise ValueError(f"rate must be positive, got {rate}")
    return [max(0.0, (t - first_ns) / 1e9 / rate) for t in log_times_ns]


class Gate:
    """Lets every message through at once (replay at a rate)."""

    def wait_turn(self, index: int, stop: threading.Event) -> None:
        """Block until message `index` of the stream may be published."""

    def published(self, index: int) -> None:
        """Message `index` was just published."""


class FrameGate(Gate):
    """At most `window` frames in flight: published, and neither answered in full nor dropped.
    A frame is answered when every awaited result of it has arrived (`progress`); without that
    (no detect, point or segment prompt to wait for), when the vision worker has taken it. With window 1
    each frame's delay is its own processing time; 2 keeps a frame waiting in the node's mailbox
    while one is processed (the model never idles); more makes the node drop frames, which its
    counters show. A frame that does not arrive within `transport_s` is presumed lost on the way
    (the count is settled at the end)."""

    def __init__(self, probe: VisionProbe, progress=None, window: int = 1, transport_s: float = 5.0,
                 stall_s: float = 120.0) -> None:
        if window < 1:
            raise ValueError(f"the in-flight window must be at least 1 frame, got {window}")
        self.probe, self.progress, self.window = probe, progress, window
        self.transport_s, self.stall_s = transport_s, stall_s
        self.presumed_lost = 0

    def resolved(self, counters) -> int:
        """Frames out of flight."""
        if self.progress is not None:
            done = self.progress.complete + counters.dropped + counters.bad
        else:
            done = counters.settled
        return done + self.presumed_lost

    def wait_turn(self, index: int, stop: threading.Event) -> None:
        last, changed = None, time.monotonic()
        while not stop.is_set():
            counters = self.probe.counters()
            if index - self.resolved(counters) < self.window:
                return
            now = time.monotonic()
            state = (counters, self.progress and self.progress.complete)
            if state != last:
                last, changed = state, now
            elif counters.received + self.presumed_lost < index and now - changed > self.transport_s:
                self.presumed_lost = index - counters.received
            elif now - changed > self.stall_s:
                raise GraphError(f"the vision node answered no frame for {self.stall_s:g} s "
                                 f"(frame {index} of the replay waits): {counters}")
            time.sleep(POLL_S)


class ChunkGate(Gate):
    """Chunk i waits until the speech node has consumed chunk i - window. Consumption shows as the
    segmenter's stream time reaching the chunk's end (`ends`, computed as the node computes it).
    Unstamped audio (std_msgs arrays) shows none: chunk i then waits until the node has taken
    i - window chunks off its subscription (or learnt they were lost on the way), which bounds the
    backlog in its queue (100 chunks: a longer one pushed chunks out unheard, and nothing counted
    them). (DDS acknowledgements, the earlier rule, bound nothing for a best-effort reader.)"""

    def __init__(self, probe: SpeechProbe, ends: list[float | None], window: int = 50,
                 stall_s: float = 120.0) -> None:
        self.probe, self.ends = probe, ends
        self.window, self.stall_s = window, stall_s
        self.consumed = -1          # index of the newest chunk the node is known to have consumed
        self.sent = 0

    def wait_turn(self, index: int, stop: threading.Event) -> None:
        changed = time.monotonic()
        while not stop.is_set() and self.consumed < index - self.window:
            if self._advance():
                changed = time.monotonic()
            elif time.monotonic() - changed > self.stall_s:
                raise GraphError(f"the speech node consumed no audio for {self.stall_s:g} s "
                                 f"(chunk {index} of the replay waits)")
            time.sleep(POLL_S)

    def published(self, index: int) -> None:
        self.sent = index + 1

    def _advance(self) -> bool:
        taken = min(self.probe.chunks_taken(), self.sent) - 1   # (a subscription's queue is FIFO)
        if taken > self.consumed:
            self.consumed = taken
            return True
        until = self.probe.audio_until()
        for j in range(self.sent - 1, self.consumed, -1):
            if self.ends[j] is not None and self.ends[j] == until:
                self.consumed = j
                return True
        return False


class ReplayStalled(GraphError):
    """A stream's gate gave up on the graph (it stopped taking input): what was published before."""

    def __init__(self, cause: GraphError, published: list[Published]) -> None:
        super().__init__(str(cause))
        self.published = published


class BagOrder:
    """At max rate, the streams in the bag's order: a message goes out once every other stream has
    sent what the bag holds before it. Each stream is still paced by its own gate, so the graph sets
    the speed; without this the image and audio streams drifted apart (a command's audio minutes
    of bag time away from the frames its find was answered on). A stream with a lead goes that much
    ahead: a frame's depth and camera_info reach the node before it, not after it as the bag's few
    microseconds put them (behind a frame the model then took, they came late for its pairing)."""

    def __init__(self, streams: list[Stream]) -> None:
        self._next = {s.name: (s.messages[0].log_time_ns if s.messages else math.inf) for s in streams}
        self._lead = {s.name: int(s.lead_s * 1e9) for s in streams}
        self._cond = threading.Condition()

    def wait_turn(self, name: str, log_time_ns: int, stop: threading.Event) -> None:
        due = log_time_ns - self._lead[name]
        with self._cond:
            while not stop.is_set() and any(t < due for other, t in self._next.items() if other != name):
                self._cond.wait(POLL_S * 10)

    def sent(self, name: str, next_log_time_ns: float) -> None:
        """`name` has sent all before `next_log_time_ns` (math.inf: all of it, or it stopped)."""
        with self._cond:
            self._next[name] = next_log_time_ns
            self._cond.notify_all()


def replay(streams: list[Stream], rate: float | None, stop: threading.Event | None = None) -> list[Published]:
    """Publish every stream (concurrently, one thread each) and return what was published when,
    in publishing order; at max rate in the bag's order across streams (BagOrder). An error in one
    stream stops the others and is raised here (a stall as ReplayStalled, with what was published)."""
    stop = stop or threading.Event()
    first = min((m.log_time_ns for s in streams for m in s.messages), default=0)
    start = time.monotonic()
    log: list[Published] = []
    errors: list[BaseException] = []
    order = BagOrder(streams) if rate is None and len(streams) > 1 else None

    def play(stream: Stream) -> None:
        try:
            offsets = replay_offsets([m.log_time_ns for m in stream.messages], first, rate)
            gate = stream.gate or Gate()
            for index, (message, offset) in enumerate(zip(stream.messages, offsets)):
                _sleep_until(start + offset, stop)
                if order is not None:
                    order.wait_turn(stream.name, message.log_time_ns, stop)
                gate.wait_turn(index, stop)
                if stop.is_set():
                    return
                at, wall_ns = time.monotonic(), time.time_ns()
                stream.publisher.publish(message.msg)
                log.append(Published(stream.name, index, stamp_ns(message.msg), message.log_time_ns, at, wall_ns))
                gate.published(index)
                if order is not None:
                    following = stream.messages[index + 1].log_time_ns if index + 1 < len(stream.messages) else math.inf
                    order.sent(stream.name, following)
        except BaseException as err:  # noqa: BLE001 - handed to the caller's thread
            errors.append(err)
            stop.set()
        finally:
            if order is not None:
                order.sent(stream.name, math.inf)

    threads = [threading.Thread(target=play, args=(s,), name=f"replay-{s.name}", daemon=True) for s in streams]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    published = sorted(log, key=lambda p: p.at)
    if errors:
        if isinstance(errors[0], GraphError):
            raise ReplayStalled(errors[0], published)
        raise errors[0]
    return published


def _sleep_until(deadline: float, stop: threading.Event) -> None:
    remaining = deadline - time.monotonic()
    if remaining > 0:
        stop.wait(remaining)
