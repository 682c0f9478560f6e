"""A target's place in the image -> a bounded turn that faces it, ending in a stop.

The turn is open loop: the angle to the target is read off the image once (through the camera's
horizontal field of view, the camera looking along the base's heading), then the base turns at a
fixed rate for as long as that angle takes and is told to stop. Every turn ends in a zero Twist,
and none lasts longer than `max_turn_s`, so a base without a command timeout never keeps turning.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from geometry_msgs.msg import Twist


def bearing(x_normalized: float, horizontal_fov_rad: float) -> float:
    """Angle (rad) from the camera's optical axis to a point at `x_normalized` of the image width,
    positive to the left (REP 103: a positive yaw turns left), for a pinhole camera."""
    if not 0.0 < horizontal_fov_rad < math.pi:
        raise ValueError(f"horizontal field of view must be within (0, pi) rad, got {horizontal_fov_rad}")
    return math.atan((0.5 - x_normalized) * 2.0 * math.tan(horizontal_fov_rad / 2.0))


@dataclass(frozen=True)
class Turn:
    """Turn at `rate` rad/s (positive: left) for `duration` s, then stop."""
    rate: float
    duration: float

    @property
    def angle(self) -> float:
        return self.rate * self.duration


def plan_turn(angle: float, max_rate: float, max_turn_s: float, deadband: float) -> Turn | None:
    """The turn through `angle` rad at up to `max_rate`, the short way round, cut at `max_turn_s`;
    None within the deadband."""
    if max_rate <= 0.0 or max_turn_s <= 0.0:
        raise ValueError(f"max_rate and max_turn_s must be > 0, got {max_rate}, {max_turn_s}")
    # 270 deg left is 90 deg right: unwrapped, the turn went left (and was cut at max_turn_s, so it
    # ended 86 deg left, facing further away than before)
    angle = math.remainder(angle, 2.0 * math.pi)
    if abs(angle) <= deadband:
        return None
    return Turn(math.copysign(max_rate, angle), min(abs(angle) / max_rate, max_turn_s))


class TurnCommands:
    """The Twists a turn publishes, one per tick of a steady timer of `period` s (and one at once
    when it starts): the turn's rate while what is left of it outlasts the Twist (a Twist holds
    until the timer's next tick; bases with a command timeout need a steady stream), the rate
    scaled to what is left for the last, partial one, then one zero Twist. So the angle commanded
    is the plan's, where a full-rate last tick would overrun it by up to one tick. A new turn
    replaces the one in progress."""

    def __init__(self, period: float) -> None:
        if not period > 0.0:
            raise ValueError(f"the tick period must be > 0 s, got {period}")
        self.period = period
        self._turn: Turn | None = None
        self._started = 0.0
        self._stop_due = False

    def start(self, turn: Turn, now: float) -> None:
        self._turn, self._started, self._stop_due = turn, now, True

    @property
    def active(self) -> bool:
        return self._turn is not None or self._stop_due

    def stop(self) -> bool:
        """End the turn in progress now (the node is shutting down); True when it was moving the
        base, so a zero Twist is due."""
        due = self.active
        self._turn, self._stop_due = None, False
        return due

    def tick(self, now: float, holds: float | None = None) -> Twist | None:
        """What to publish at `now`: the turn's Twist, the final zero Twist, or None (idle).
        `holds`: seconds until the timer's next tick, when this is not one of its ticks (the
        Twist sent at once when a turn starts); a tick's Twist holds `period`."""
        twist = Twist()
        if self._turn is not None:
            # a clock that went back (a simulator reset) ends the turn: counted from its old start,
            # what is left would outlast the plan by however far it went back
            left = self._turn.duration - (now - self._started) if now >= self._started else 0.0
            if left > 1e-9:
                hold = self.period if holds is None else max(holds, 1e-9)
                twist.angular.z = self._turn.rate * min(1.0, left / hold)
                return twist
        self._turn = None
        if self._stop_due:
            self._stop_due = False
            return twist
        return None
