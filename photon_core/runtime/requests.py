"""A skill call as data, the same for every family of a kind: what the nodes and the batcher pass to a
model's `batch(requests)`, so they never import a family. `Request` is a vision skill call,
`TranscribeRequest` a speech one (photon_core.contracts says what each model does with them)."""
from __future__ import annotations

import numbers
import threading
from dataclasses import dataclass, field, fields
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from photon_core.runtime.sampling import Sampling

DEFAULT_MAX_OBJECTS = 50
DEFAULT_MAX_TOKENS = 768
# The public Moondream reference's sampling defaults (moondream/torch/moondream.py): a `settings`
# dict that leaves them out samples with these, as the reference and Moondream Cloud do. A family
# whose makers' engine fills in others passes them to Request.options (Moondream 3: kestrel's).
DEFAULT_TEMPERATURE = 0.5
DEFAULT_TOP_P = 0.3

SpatialRef = tuple[float, float] | tuple[float, float, float, float]


@dataclass(frozen=True)
class Settings:
    """A skill call's `settings` dict, checked, with the reference's defaults filled in.
    temperature 0 decodes greedily; max_objects bounds detect/point, max_tokens text (a reasoning
    query spends up to max_tokens on its reasoning and again on its answer, as Moondream 2's public
    reference does; Moondream 3's share one max_tokens, as kestrel's do);
    variant: the fine-tuned adapter (LoRA) to decode with, None for the base model."""
    temperature: float = DEFAULT_TEMPERATURE
    top_p: float = DEFAULT_TOP_P
    max_tokens: int = DEFAULT_MAX_TOKENS
    max_objects: int = DEFAULT_MAX_OBJECTS
    variant: str | None = None

    def sampling(self) -> "Sampling":
        """How a text decode with these settings picks its tokens (runtime.sampling)."""
        from photon_core.runtime.sampling import Sampling   # torch: only where text is decoded
        return Sampling(self.max_tokens, self.temperature, self.top_p)

    @classmethod
    def of(cls, settings: "Mapping[str, Any] | Settings | None") -> "Settings":
        """TypeError naming keys that are not settings (or a value of the wrong type), ValueError
        naming values out of range."""
        if isinstance(settings, Settings):
            # built directly, it was never checked: checked as its dict would be
            settings = {f.name: getattr(settings, f.name) for f in fields(settings)}
        if settings is None:
            return cls()
        if not isinstance(settings, Mapping):
            raise TypeError(f"settings must be a dict, not {type(settings).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(str(k) for k in settings if k not in known)
        if unknown:
            raise TypeError(f"unknown settings {unknown}; known: {sorted(known)}")
        values = dict(settings)
        # numpy's scalars too (np.int64, np.float32: an array's element), as Python's int and float
        for key in ("max_tokens", "max_objects"):
            if key in values:
                if isinstance(values[key], bool) or not isinstance(values[key], numbers.Integral):
                    raise TypeError(f"settings[{key!r}] must be an int, got {values[key]!r}")
                values[key] = int(values[key])
        for key in ("temperature", "top_p"):
            if key in values:
                if isinstance(values[key], bool) or not isinstance(values[key], numbers.Real):
                    raise TypeError(f"settings[{key!r}] must be a number, got {values[key]!r}")
                if not isinstance(values[key], (int, float)):
                    values[key] = float(values[key])
        if values.get("variant") is not None and not isinstance(values["variant"], str):
            raise TypeError(f"settings['variant'] must be a str or None, got {values['variant']!r}")
        s = cls(**values)
        wrong = sampling_problems(s.max_tokens, s.temperature, s.top_p)
        if s.max_objects < 0:
            wrong.append(f"max_objects must be >= 0, got {s.max_objects!r}")
        if wrong:
            raise ValueError("settings: " + "; ".join(wrong))
        return s


def temperature_problem(temperature: float) -> str:
    """Why `temperature` cannot be sampled at ("" if it can): >= 0 and finite (0: greedy)."""
    if not 0 <= temperature < float("inf"):   # (NaN too; infinity samples NaN)
        return f"temperature must be >= 0 and finite (0: greedy), got {temperature!r}"
    return ""


def sampling_problems(max_tokens: int, temperature: float, top_p: float) -> list[str]:
    """Every one of a text decode's sampling settings out of range, as the message that says so."""
    wrong = [] if max_tokens >= 0 else [f"max_tokens must be >= 0, got {max_tokens!r}"]
    wrong += [p for p in [temperature_problem(temperature)] if p]
    if not 0 < top_p <= 1:
        wrong.append(f"top_p must be in (0, 1], got {top_p!r}")
    return wrong


def check_spatial_refs(refs: Any) -> list[SpatialRef]:
    """Points (x, y) and boxes (x_min, y_min, x_max, y_max), normalised to [0, 1] of the image;
    ValueError saying which one is wrong and why."""
    if refs is None:
        return []
    if isinstance(refs, (str, bytes)) or not isinstance(refs, (list, tuple)):
        raise ValueError(f"spatial_refs must be a list of points (x, y) or boxes (x_min, y_min, x_max, y_max), "
                         f"not {type(refs).__name__}")
    out: list[SpatialRef] = []
    for i, ref in enumerate(refs):
        if not isinstance(ref, (list, tuple)) or len(ref) not in (2, 4):
            raise ValueError(f"spatial_refs[{i}] must be a point (x, y) or a box (x_min, y_min, x_max, y_max), "
                             f"got {ref!r}")
        # (numpy's scalars too: a detector's float32 box as a tuple)
        if not all(isinstance(v, numbers.Real) and not isinstance(v, bool) and 0.0 <= float(v) <= 1.0 for v in ref):
            raise ValueError(f"spatial_refs[{i}] = {ref!r}: every value must be a number in [0, 1] (normalised)")
        if len(ref) == 4 and (ref[0] > ref[2] or ref[1] > ref[3]):
            raise ValueError(f"spatial_refs[{i}] = {ref!r}: a box needs x_min <= x_max and y_min <= y_max")
        out.append(tuple(float(v) for v in ref))  # type: ignore[arg-type]
    return out


@dataclass
class Request:
    """One skill call: task (detect, point, caption, query, segment), image (array, PIL or the
    family's encoded image; None: a text-only query) and the task's argument (the object, the
    question, or the caption length).

    Every family reads `options()`: `settings` (the skills' settings dict: Settings.of) or, without
    one, the fields max_objects..top_p (greedy, as the nodes have always asked). Moondream also
    reads `spatial_refs` (query and point: points and boxes the prompt refers to) and `reasoning`
    (query); the other families refuse them."""
    task: str
    image: Any
    prompt: str = ""
    max_objects: int = DEFAULT_MAX_OBJECTS
    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = 0.0
    top_p: float = 1.0
    settings: Mapping[str, Any] | None = None
    spatial_refs: list[SpatialRef] | None = None
    reasoning: bool = False
    # Set by another thread (a canceled action goal, a timeout): the decode drops this request at
    # its next step, freeing its batch slot; its result holds what was decoded until then.
    cancel: threading.Event | None = field(default=None, compare=False, repr=False)
    # Called from the decoding thread with the result so far (the result's shape) each time it
    # grows: an object found, the answer's text longer. Must be quick and must not raise.
    progress: Callable[[dict], None] | None = field(default=None, compare=False, repr=False)

    @property
    def canceled(self) -> bool:
        return self.cancel is not None and self.cancel.is_set()

    def options(self, defaults: Mapping[str, Any] | None = None) -> Settings:
        """The settings this request decodes with: `settings` checked (for keys left out the
        family's `defaults`, else the reference's), or without a dict the fields above (greedy
        unless temperature says not)."""
        if isinstance(self.settings, Mapping) and defaults:
            return Settings.of({**defaults, **self.settings})
        if self.settings is not None:
            return Settings.of(self.settings)
        return Settings.of({"temperature": self.temperature, "top_p": self.top_p, "max_tokens": self.max_tokens,
                            "max_objects": self.max_objects})


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
