"""A skill call as data, the same for every vision family: what the nodes and the batcher pass to a
model's `batch(requests)`, so they never import a family."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

DEFAULT_MAX_OBJECTS = 50
DEFAULT_MAX_TOKENS = 768


@dataclass
class Request:
    """One skill call: task (detect, point, caption, query, segment), image (array, PIL or the
    family's encoded image) and the task's argument (the object, the question, or the caption length)."""
    task: str
    image: Any
    prompt: str = ""
    max_objects: int = DEFAULT_MAX_OBJECTS
    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = 0.0
    top_p: float = 1.0
