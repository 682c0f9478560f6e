"""A skill call as data, the same for every family of a kind: what the nodes and the batcher pass to a
model's `batch(requests)`, so they never import a family. `Request` is a vision skill call,
`TranscribeRequest` a speech one (photon_core.contracts says what each model does with them)."""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from collections.abc import Mapping
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


# transcribe()'s own arguments; anything else in a request is a family's decoding option.
_TRANSCRIBE_ARGS = ("audio", "sample_rate", "language", "initial_prompt")


@dataclass
class TranscribeRequest:
    """One transcription: mono or [samples, channels] int/float PCM at `sample_rate`, the language to
    force (None: the model decides) and context text. `options` are the family's decoding options
    passed on as keywords (Whisper's timestamps, temperature, ...; see each family's transcribe)."""
    audio: Any
    sample_rate: int = 16000
    language: str | None = None
    initial_prompt: str | None = None
    options: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, item: "TranscribeRequest | Mapping[str, Any]") -> "TranscribeRequest":
        """`item` as a request: a mapping holds transcribe()'s keyword arguments (the older form,
        still accepted from callers that build dicts)."""
        if isinstance(item, TranscribeRequest):
            return item
        if not isinstance(item, Mapping) or "audio" not in item:
            raise TypeError(f"a transcription request is a TranscribeRequest or a mapping with 'audio', "
                            f"not {type(item).__name__}")
        rest = {k: v for k, v in item.items() if k not in _TRANSCRIBE_ARGS}
        return cls(item["audio"], item.get("sample_rate", 16000), item.get("language"),
                   item.get("initial_prompt"), rest)

    def kwargs(self) -> dict[str, Any]:
        """transcribe()'s keyword arguments for this request."""
        return {"audio": self.audio, "sample_rate": self.sample_rate, "language": self.language,
                "initial_prompt": self.initial_prompt, **self.options}
