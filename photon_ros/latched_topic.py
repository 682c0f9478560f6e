"""A format topic some drivers latch and others repeat: camera_info, audio_info.

Latched publishers (reliable, transient local) send once and keep the message for late joiners:
newer ros-drivers audio_capture latches its AudioInfo, many camera drivers and bags latch
camera_info. A volatile reader, which every publisher matches, never gets what was published
before it joined, so the node waited for a repeat (5 s for audio_info) or forever. A latched
reader matches only latched publishers, and a volatile publisher logs each one it sees as
incompatible, so the latched reader is created only once a publisher on the topic offers it.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable

from rclpy.clock import Clock, ClockType
from rclpy.event_handler import SubscriptionEventCallbacks
from rclpy.qos import DurabilityPolicy, HistoryPolicy, QoSProfile, ReliabilityPolicy

LATCHED = QoSProfile(depth=1, history=HistoryPolicy.KEEP_LAST, reliability=ReliabilityPolicy.RELIABLE,
                     durability=DurabilityPolicy.TRANSIENT_LOCAL)


def offers_latched(profiles: Iterable[Any]) -> bool:
    """Whether any of these publisher QoS profiles is latched (transient local: a late subscriber
    gets what was published before it)."""
    return any(p.durability == DurabilityPolicy.TRANSIENT_LOCAL for p in profiles)


class LatchedReader:
    """Beside a node's volatile subscription to `topic`: a latched one feeding the same callback,
    created the first time `poll()` (now, then every `period_s` on a timer of the node) sees a
    latched publisher on the topic. Both readers get a latched publisher's live messages: the
    callback must take a repeat as harmless (a format, a stamp-paired message). `destroy()`
    removes the timer and what was created."""

    def __init__(self, node: Any, msg_type: type, topic: str, callback: Callable[..., None],
                 period_s: float = 1.0) -> None:
        self.node, self.msg_type, self.topic, self.callback = node, msg_type, topic, callback
        self.subscription: Any = None
        # on the steady clock: under use_sim_time with no /clock yet (a simulator paused or not
        # started) a timer on the node's clock never fired, and a driver latching its camera_info or
        # AudioInfo after the node was made was never read (every audio chunk refused meanwhile)
        self.timer = node.create_timer(period_s, self.poll, clock=Clock(clock_type=ClockType.STEADY_TIME))
        self.poll()

    def poll(self) -> None:
        if self.subscription is not None:
            return
        publishers = self.node.get_publishers_info_by_topic(self.node.resolve_topic_name(self.topic))
        if not offers_latched(p.qos_profile for p in publishers):
            return
        # Volatile publishers on the same topic cannot match it; the volatile reader serves them.
        self.subscription = self.node.create_subscription(
            self.msg_type, self.topic, self.callback, LATCHED,
            event_callbacks=SubscriptionEventCallbacks(incompatible_qos=lambda event: None))
        self.node.get_logger().info(f"{self.node.resolve_topic_name(self.topic)} is latched: subscribed to it latched")

    def destroy(self) -> None:
        self.node.destroy_timer(self.timer)
        if self.subscription is not None:
            self.node.destroy_subscription(self.subscription)
        self.subscription = None
