"""A skill call as data, the same for every vision family: what the nodes and the batcher pass to a
model's `batch(requests)`, so they never import a family."""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Callable

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
    # Set by another thread (a canceled action goal, a timeout): the decode drops this request at
    # its next step, freeing its batch slot; its result holds what was decoded until then.
    cancel: threading.Event | None = field(default=None, compare=False, repr=False)
    # Called from the decoding thread with the result so far (the result's shape) each time it
    # grows: an object found, the answer's text longer. Must be quick and must not raise.
    progress: Callable[[dict], None] | None = field(default=None, compare=False, repr=False)

    @property
    def canceled(self) -> bool:
        return self.cancel is not None and self.cancel.is_set()
