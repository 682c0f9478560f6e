"""The options of an on-demand vision request (the infer service's request, a find or ask goal) as
the engine takes them: spatial references checked and turned into the engine's tuples, and each
option checked against the task it was given with. A bad option is a ValueError saying why, which
the node answers with success=false; the engine itself refuses what a model family cannot do."""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from photon_core.runtime.requests import DEFAULT_MAX_TOKENS, Request

TEXT_TASKS = ("caption", "query")
OBJECT_TASKS = ("detect", "point")
SPATIAL_TASKS = ("query", "point")     # the tasks whose prompt may refer to places in the image


def spatial_refs(refs: Sequence[Any]) -> list[tuple[float, ...]]:
    """photon_ros/SpatialRef messages -> the engine's spatial references: (x, y) for a point,
    (x_min, y_min, x_max, y_max) for a box, normalized [0, 1] image coordinates."""
    out: list[tuple[float, ...]] = []
    for i, ref in enumerate(refs):
        where = f"spatial_refs[{i}]"
        if ref.kind == "point":
            if ref.x_max != 0 or ref.y_max != 0:
                raise ValueError(f"{where}: a point has only x and y (x_max and y_max must be 0); "
                                 "for a box set kind to 'box'")
            values: tuple[float, ...] = (float(ref.x), float(ref.y))
        elif ref.kind == "box":
            values = (float(ref.x), float(ref.y), float(ref.x_max), float(ref.y_max))
        else:
            raise ValueError(f"{where}: kind must be 'point' or 'box', got {ref.kind!r}")
        if not all(0.0 <= v <= 1.0 for v in values):   # NaN fails too
            raise ValueError(f"{where}: coordinates are normalized to [0, 1] of the image (not pixels), "
                             f"got {', '.join(f'{v:g}' for v in values)}")
        if len(values) == 4 and (values[0] > values[2] or values[1] > values[3]):
            raise ValueError(f"{where}: a box needs x <= x_max and y <= y_max, got {values}")
        out.append(values)
    return out


def request_options(task: str, msg: Any, max_objects: int) -> dict[str, Any]:
    """The engine Request's keyword arguments for the options in `msg` (an Infer request, an Ask or a
    Find goal: the fields it lacks count as left at their defaults). `max_objects`: the node's, used
    when the message leaves it at 0. Raises ValueError when an option does not fit the task."""
    def given(name: str, default: Any) -> Any:
        return getattr(msg, name, default)

    reasoning, refs = bool(given("reasoning", False)), list(given("spatial_refs", []))
    temperature, top_p = float(given("temperature", 0.0)), float(given("top_p", 0.0))
    max_tokens, objects = int(given("max_tokens", 0)), int(given("max_objects", 0))
    variant = str(given("variant", "")).strip()

    def only(option: str, tasks: tuple[str, ...]) -> None:
        if task not in tasks:
            raise ValueError(f"{option} applies to {', '.join(tasks)}, not to {task}")

    if reasoning:
        only("reasoning", ("query",))
    if refs:
        only("spatial_refs", SPATIAL_TASKS)
    if not (math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"temperature must be >= 0, got {temperature:g}")
    if not (math.isfinite(top_p) and 0 <= top_p <= 1):
        raise ValueError(f"top_p must be in (0, 1] (0: 1, no cut), got {top_p:g}")
    if temperature or top_p:
        only("temperature and top_p", TEXT_TASKS)
    if max_tokens:
        only("max_tokens", TEXT_TASKS)
    if objects:
        only("max_objects", OBJECT_TASKS)
    if variant:   # segment is Moondream 3's, which has no variants
        only("variant", OBJECT_TASKS + TEXT_TASKS)
    options: dict[str, Any] = {"temperature": temperature, "top_p": top_p or 1.0,
                               "max_tokens": max_tokens or DEFAULT_MAX_TOKENS,
                               "max_objects": objects or max_objects}
    if variant:   # only Moondream's settings dict names a variant; it then replaces the fields
        options["settings"] = {**options, "variant": variant}
    if reasoning:
        options["reasoning"] = True
    if refs:
        options["spatial_refs"] = spatial_refs(refs)
    return options


def engine_request(task: str, image: Any, prompt: str, msg: Any, max_objects: int, **runtime: Any) -> Request:
    """The engine Request for an on-demand task with the options of `msg` (see request_options);
    `runtime`: Request's cancel and progress."""
    return Request(task, image, prompt, **request_options(task, msg, max_objects), **runtime)


def missing_reasoning(asked: bool, result: dict) -> None:
    """Refuse the answer of a reasoning request that came without reasoning: the model ignored the
    option, and an answer that looks reasoned must not be handed back as one."""
    if asked and "reasoning" not in result:
        raise ValueError("the model answered without reasoning (it does not offer reasoning)")
