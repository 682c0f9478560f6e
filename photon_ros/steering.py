"""Target position in the image -> a turn command that centres it (a proportional controller)."""
from __future__ import annotations

from geometry_msgs.msg import Twist


def turn_towards(x_normalized: float, gain: float, max_rate: float, deadband: float = 0.02) -> Twist:
    """Positive angular.z turns left (REP 103), toward a target left of centre (x < 0.5)."""
    error = 0.5 - x_normalized
    twist = Twist()
    if abs(error) > deadband:
        twist.angular.z = max(-max_rate, min(max_rate, gain * error))
    return twist
