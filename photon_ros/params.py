"""Declaring node parameters so that a whole number given for a float parameter is taken.

rclpy types a parameter by its default: one declared 5.0 refuses 0 (`max_frame_age_s: 0` in a
YAML file, `-p caption_period_s:=0`, `ros2 param set ... 1`), and a refused override at declare
time stops the node from starting. Float parameters are declared with dynamic typing instead and
their value checked to be a number here (and, for those changed at runtime, by the node's
parameter callback: `number`).
"""
from __future__ import annotations

from typing import Any, Callable

from rcl_interfaces.msg import ParameterDescriptor
from rclpy.node import Node
from rclpy.parameter import Parameter


def number(value: Any) -> float | None:
    """The value as a float if it is an int or a float (not a bool), else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def declarer(node: Node) -> Callable[..., Parameter]:
    """node.declare_parameter, except that a float default also takes an integer (returned as a
    float); anything else but a number raises ValueError, naming the parameter."""
    def declare(name: str, value: Any = None, *args: Any, **kwargs: Any) -> Parameter:
        if not isinstance(value, float) or args or kwargs:
            return node.declare_parameter(name, value, *args, **kwargs)
        got = node.declare_parameter(name, value, ParameterDescriptor(dynamic_typing=True)).value
        if number(got) is None:
            raise ValueError(f"parameter {name!r} must be a number, got {got!r}")
        return Parameter(name, value=number(got))
    return declare
