"""Checks of the engine parameters both model nodes declare (model, device): a value that cannot
name a checkpoint or a torch device is refused when it is set, at startup or by set_parameters,
not at the next configure (where autostart left the node up, unconfigured, with the load's error),
and an empty model is not read as the current directory (a checkpoint that happened to be there
would load)."""
from __future__ import annotations

import re

DEVICES = "cpu, cuda or cuda:N"


def model_refusal(value: str) -> str:
    """Why `value` cannot name a checkpoint ("" if it can)."""
    return "" if value.strip() else "must name a checkpoint (a known name, a folder or a file), got ''"


def device_refusal(value: str) -> str:
    """Why `value` is not a device the engine runs on ("" if it is; whether it exists here is the
    load's to say)."""
    return "" if re.fullmatch(r"cpu|cuda(:\d+)?", value) else f"must be {DEVICES}, got {value!r}"
