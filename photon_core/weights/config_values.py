"""Numbers read from a checkpoint's config files, checked where they are read.

A config number can size an allocation (a position table, a filterbank, a KV cache) or a loop
(decoding steps) before any tensor is looked at, so a crafted checkpoint could ask for terabytes or
hours. Each family reads such numbers through these helpers, with bounds comfortably above every
real checkpoint's value: the error is a ValueError naming the file and the field, raised at load,
instead of a MemoryError, a hang or a TypeError deep inside the model.
"""
from __future__ import annotations

from typing import Any


def config_int(value: Any, source: object, field: str, low: int = 1, high: int | None = None) -> int:
    """`value` as an int within [low, high]. JSON/YAML integers only (an integral float such as
    16000.0 is accepted; a string, a bool or a fraction is refused, not silently converted)."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        bound = f"an integer >= {low}" if high is None else f"an integer in [{low}, {high}]"
        raise ValueError(f"{source}: {field} must be {bound}, got {_short(value)}")
    return value


def config_float(value: Any, source: object, field: str, low: float | None = None,
                 high: float | None = None, positive: bool = False) -> float:
    """`value` as a finite float within [low, high] (and > 0 when `positive`)."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    number = float(value) if ok else 0.0
    if (not ok or number != number or number in (float("inf"), float("-inf")) or (positive and number <= 0)
            or (low is not None and number < low) or (high is not None and number > high)):
        what = ("a positive number" if positive else "a number") + (f" >= {low}" if low is not None else "") + (
            f"{' and' if low is not None else ''} <= {high}" if high is not None else "")
        raise ValueError(f"{source}: {field} must be {what}, got {_short(value)}")
    return number


def _short(value: Any) -> str:
    """repr of a value cut short: a crafted config may put a huge structure where a number goes."""
    import reprlib

    return reprlib.repr(value)
