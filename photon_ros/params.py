"""Node parameters declared once, each with its descriptor, and checked by one rule at startup and
on every change.

A node lists its parameters as `Param`s: default, description, allowed values or range, and when a
change takes effect (`applies`):
    "now"        the node takes the new value at once (its `apply` callback is told);
    "configure"  read when a managed node configures: a change waits for the next configure
                 (`ros2 lifecycle set /vision cleanup` then `configure`), and the node logs so;
    "restart"    read once at startup: declared read-only, so ROS itself refuses a change.
`NodeParams(node, specs)` declares them all, refuses out-of-range values at startup with one
ValueError naming every parameter at fault (the node does not start, and says why), and refuses
an out-of-range change with the reason in the `set_parameters` result; nothing is accepted and
then ignored. A change the node's `apply` fails on is refused with the error, the old values kept.

A change is checked against the values the others have then. rclpy's `set_parameters` (and so
`ros2 param set`, `ros2 param load` and the set_parameters service) hands the parameters of a list
over one at a time, each checked and taken before the next: only `set_parameters_atomically` (the
node's, or its service) checks a list as a whole and takes all of it or nothing. Two parameters
that a rule ties together and that must move past each other need it, or the right order: the
speech node's vad.tail_s (at most vad.hangover_s), the vision node's depth_min_m and depth_max_m
(min below max). (A language or prompt only a new model takes waits for that model's configure:
set `model`, reconfigure, then the language.)

Scalar parameters are declared with dynamic typing and their type is checked here: rclpy types a
parameter by its default, so one declared 5.0 would refuse `0` (`max_frame_age_s: 0` in a YAML file,
`ros2 param set ... 1`), and its own refusal of a wrong type ("Wrong parameter type, expected '2' got
'4'") names neither the parameter nor the types. Here any whole number is taken as a float, and a
value of another type is refused with the parameter's name and the type it needs.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

from rcl_interfaces.msg import ParameterDescriptor, SetParametersResult
from rclpy.exceptions import InvalidParameterTypeException
from rclpy.node import Node
from rclpy.parameter import Parameter

APPLIES = ("now", "configure", "restart")


def number(value: Any) -> float | None:
    """The value as a float if it is an int or a float (not a bool), else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


@dataclass(frozen=True)
class Param:
    """One node parameter. `default` gives its type (a float also takes whole numbers); a
    Parameter.Type default (STRING_ARRAY) declares an empty list of that type. `low` / `high`
    bound numbers (inclusive; `positive` makes the lower bound exclusive at 0); `choices` lists
    the values a string may take; `check(value)` adds a rule of its own, returning the reason a
    value is refused or "" when it is fine."""
    name: str
    default: Any
    description: str
    applies: str = "now"
    low: float | None = None
    high: float | None = None
    positive: bool = False
    choices: tuple[str, ...] = ()
    check: Callable[[Any], str] | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.applies not in APPLIES:
            raise ValueError(f"{self.name}: applies must be one of {APPLIES}, got {self.applies!r}")

    @property
    def is_float(self) -> bool:
        return isinstance(self.default, float)

    @property
    def is_array(self) -> bool:
        return isinstance(self.default, Parameter.Type)

    def type_refusal(self, value: Any) -> str:
        """Why `value` is not of this parameter's type, or "" (floats: see `refusal`)."""
        if self.is_array or self.is_float:
            return ""   # arrays keep rclpy's static typing; floats take any number
        if isinstance(self.default, bool):
            return "" if isinstance(value, bool) else f"must be true or false, got {value!r}"
        if isinstance(self.default, int):
            ok = isinstance(value, int) and not isinstance(value, bool)
            return "" if ok else f"must be an integer, got {value!r}"
        if isinstance(self.default, str):
            return "" if isinstance(value, str) else f"must be a string, got {value!r}"
        return ""

    def constraints(self) -> str:
        """The rule in words, as `ros2 param describe` shows it."""
        parts = []
        if self.positive:
            parts.append("> 0")
        if self.low is not None:
            parts.append(f">= {self.low:g}")
        if self.high is not None:
            parts.append(f"<= {self.high:g}")
        if self.choices:
            parts.append("one of " + ", ".join(self.choices))
        when = {"now": "", "configure": "takes effect at the next configure",
                "restart": "read at startup only"}[self.applies]
        return "; ".join(p for p in (" and ".join(parts), when) if p)

    def descriptor(self) -> ParameterDescriptor:
        # The range is stated in words, not as a ROS range: rclpy would refuse an out-of-range
        # override at declare time with its own message before this module could name the
        # parameter and its rule, and a ROS range is a closed interval (no "> 0").
        return ParameterDescriptor(name=self.name, description=self.description,
                                   additional_constraints=self.constraints(),
                                   read_only=self.applies == "restart", dynamic_typing=not self.is_array)

    def refusal(self, value: Any) -> tuple[Any, str]:
        """(the value as the node takes it, "") or (None, why it is refused)."""
        if reason := self.type_refusal(value):
            return None, reason
        if self.is_float:
            value = number(value)
            if value is None or math.isnan(value):
                return None, "must be a number"
            # No parameter means "never" by infinity: idle_flush_s=inf would hold an utterance forever.
            if math.isinf(value):
                return None, f"must be finite, got {value:g}"
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if self.positive and not value > 0:
                return None, f"must be > 0, got {value:g}"
            if self.low is not None and not value >= self.low:
                return None, f"must be >= {self.low:g}, got {value:g}"
            if self.high is not None and not value <= self.high:
                return None, f"must be <= {self.high:g}, got {value:g}"
        if self.choices and value not in self.choices:
            return None, f"must be one of {', '.join(self.choices)}, got {value!r}"
        reason = self.check(value) if self.check is not None else ""
        return (None, reason) if reason else (value, "")


class NodeParams:
    """The declared parameters of `node` and their current values (`params["name"]`).

    `apply(changes)` is called with the changed values of "now" parameters once a change has been
    accepted; `check_all(values)` judges rules across parameters (every value, as it would be
    after the change) and returns the reason to refuse, or ""."""

    def __init__(self, node: Node, specs: list[Param], apply: Callable[[dict[str, Any]], None] | None = None,
                 check_all: Callable[[dict[str, Any]], str] | None = None) -> None:
        self.node, self.specs = node, {s.name: s for s in specs}
        self.apply, self.check_all = apply, check_all
        self.values: dict[str, Any] = {}
        problems = []
        for spec in specs:
            value = self._declare(spec)
            value = [] if value is None and isinstance(spec.default, Parameter.Type) else value
            taken, reason = spec.refusal(value)
            if reason:
                problems.append(f"{spec.name} {reason}")
            self.values[spec.name] = taken
        if not problems and check_all is not None and (reason := check_all(dict(self.values))):
            problems.append(reason)
        if problems:
            raise ValueError("invalid parameters: " + "; ".join(problems))
        node.add_pre_set_parameters_callback(self._empty_lists)
        node.add_on_set_parameters_callback(self._on_set)

    def _empty_lists(self, params: list[Parameter]) -> list[Parameter]:
        """An empty list for a list parameter as that parameter's empty list: ros2cli and
        `ros2 param load` type `[]` a bool array, which a string array's static type would refuse
        with rclpy's nameless "Wrong parameter type" (`ros2 param set /vision detect "[]"`, the way
        to stop detecting, failed and the old objects stayed). Runs before rclpy's type check."""
        out = []
        for param in params:
            spec = self.specs.get(param.name)
            empty = isinstance(param.value, (list, tuple, bytes)) and len(param.value) == 0
            if spec is not None and spec.is_array and empty and param.type_ != spec.default:
                param = Parameter(param.name, spec.default, [])
            out.append(param)
        return out

    def _declare(self, spec: "Param") -> Any:
        try:
            return self.node.declare_parameter(spec.name, spec.default, spec.descriptor()).value
        except InvalidParameterTypeException:
            # rclpy types an empty list given as an override (bringup's overrides, the evaluator's
            # --set vision.detect=[]) a byte array, which a string-array parameter refuses; the
            # empty list it means is the parameter's declared default.
            override = getattr(self.node, "_parameter_overrides", {}).get(spec.name)
            empty = override is not None and isinstance(override.value, (list, tuple)) and not override.value
            if not (empty and isinstance(spec.default, Parameter.Type)):
                raise
            return self.node.declare_parameter(spec.name, spec.default, spec.descriptor(), ignore_override=True).value

    def __getitem__(self, name: str) -> Any:
        return self.values[name]

    def _on_set(self, params: list[Parameter]) -> SetParametersResult:
        changes: dict[str, Any] = {}
        for param in params:
            spec = self.specs.get(param.name)
            if spec is None:   # not ours (use_sim_time, autostart, ...): rclpy's rules apply
                continue
            value, reason = spec.refusal(param.value)
            if reason:
                return SetParametersResult(successful=False, reason=f"{param.name} {reason}")
            changes[param.name] = value
        if changes and self.check_all is not None:
            reason = self.check_all({**self.values, **changes})
            if reason:
                return SetParametersResult(successful=False, reason=reason)
        now = {k: v for k, v in changes.items() if self.specs[k].applies == "now"}
        later = sorted(k for k in changes if self.specs[k].applies == "configure")
        if reason := self._take(changes, now):
            return SetParametersResult(successful=False, reason=reason)
        if later:
            note = f"{', '.join(later)} take(s) effect at the next configure"
            self.node.get_logger().info(note)
            return SetParametersResult(successful=True, reason=note)
        return SetParametersResult(successful=True)

    def _take(self, changes: dict[str, Any], now: dict[str, Any]) -> str:
        """Take `changes` and apply `now`: "", or why they are all refused when apply raises. The
        old values are kept then, as rclpy keeps them (`ros2 param get` tells what the node
        uses), and the error is not raised: rclpy's parameter service lets it through to the
        executor's spin, and the node ended."""
        old = {k: self.values[k] for k in changes}
        self.values.update(changes)   # before apply: it may read the others (params["name"])
        if not now or self.apply is None:
            return ""
        try:
            self.apply(now)
        except Exception as err:  # noqa: BLE001 - any failure refuses the change, said to the caller
            self.values.update(old)
            reason = f"{', '.join(sorted(now))} not applied: {type(err).__name__}: {err}"
            self.node.get_logger().error(reason)
            return reason
        return ""
