"""The model contract: what a loaded model offers the nodes and the command line, and what it returns.

`Family.load` (photon_core.registry) returns a `VisionModel`, a `SpeechModel` or a text-only
`TextModel` (together: `Model`); the nodes (photon_ros) and the command line (photon_core.cli_*)
call nothing else on a model. The protocols
below carry the signatures; their docstrings and the result TypedDicts carry the semantics every
family must reproduce. test/test_model_contract.py loads every family's small test checkpoint and
checks both (`check_model`, `check_result`), as test/test_ops_conformance.py does for backends
(photon_core.backends.contract).

Rules shared by every model:

* `model_id` names the checkpoint (a Hugging Face id, a package name, or the folder's name).
* Skills: a model offers exactly the skills its family declares (`Family.skills`); each skill is a
  method of that name with the signature below, and `batch` takes any mix of them.
* `batch(requests)` runs several calls at once and returns their results in order, each shaped as
  the single call returns it. A bad request raises ValueError (TypeError for an unknown option)
  before any model work. Results never depend on what else is in the batch, except for the last
  bits of float rounding.
* Images are numpy arrays (uint8 HxWx3 or HxW, RGB unless `channel_order="bgr"`), PIL images, or
  what `encode_image` returned (reusable for any number of calls on the same model; another
  model's is refused with ValueError).
* Coordinates are normalised to [0, 1] of the image's width and height; scores are
  probabilities in [0, 1].
* Audio is mono or [samples, channels] int/float PCM at any sample rate; empty, NaN or inf audio
  and a non-positive sample rate are a ValueError.
"""
# Optional keys by a total=False subclass, not NotRequired (Python 3.11): JetPack 6's Ubuntu 22.04
# has 3.10, and this module is imported by every entry point (check_result reads __required_keys__).
from collections.abc import Iterator, Sequence
from typing import Any, Protocol, TypedDict, runtime_checkable

from photon_core.runtime.requests import DEFAULT_MAX_OBJECTS, Request, TranscribeRequest

# ---------------------------------------------------------------------------------- result shapes


class Box(TypedDict):
    """A box in normalised image coordinates, x_min <= x_max and y_min <= y_max."""
    x_min: float
    y_min: float
    x_max: float
    y_max: float


class ScoredBox(Box):
    score: float


class Point(TypedDict):
    x: float
    y: float
    score: float


class Detections(TypedDict):
    """detect(): every box found, at most max_objects, in the order the model found them."""
    objects: list[ScoredBox]


class Points(TypedDict):
    """point(): every point found, at most max_objects."""
    points: list[Point]


class Caption(TypedDict):
    """caption(): the text, or with stream=True an iterator of its pieces (never from batch)."""
    caption: str | Iterator[str]


class Grounding(TypedDict):
    """A span of the reasoning text (character offsets) and the points (x, y), normalised, that it
    is grounded on."""
    start_idx: int
    end_idx: int
    points: list[tuple[float, float]]


class Reasoning(TypedDict):
    """query(reasoning=True)'s reasoning, decoded before the answer."""
    text: str
    grounding: list[Grounding]


class _AnswerText(TypedDict):
    answer: str | Iterator[str]


class Answer(_AnswerText, total=False):
    """query(): the answer, or with stream=True an iterator of its pieces (never from batch); with
    reasoning=True also the reasoning (complete before the answer's first piece)."""
    reasoning: Reasoning


class _OutlinePath(TypedDict):
    path: str
    bbox: Box | None


class Outline(_OutlinePath, total=False):
    """segment(): an SVG path in the box's unit square (0..1 across the box), and the box (None
    when the model found no object; the path is "" then); with `error` when the model's words were
    no path (the path is "" then too, the box kept)."""
    error: str


class TranscriptSegment(TypedDict):
    start: float    # seconds from the audio's start, within the audio
    end: float
    text: str


class _TranscriptText(TypedDict):
    text: str
    segments: list[TranscriptSegment]
    language: str | None
    duration: float
    processing_time: float
    model_id: str


class Transcript(_TranscriptText, total=False):
    """transcribe(): the text and its segments (a family without timestamps gives one segment, the
    whole clip; none when the text is empty), the language code (None when the model could not
    tell; "" when the family cannot tell and none was given), the audio's duration and the call's
    processing time in seconds, and the model's id."""
    no_speech_prob: float   # Whisper, Qwen3-ASR: the chance the clip holds no speech
    words: list[dict[str, Any]]   # Parakeet: {start, end, word}
    tokens: list[int]             # Parakeet: the decoded token ids


# The result of each skill, by the skill's name (registry.SKILLS).
RESULTS: dict[str, type] = {"detect": Detections, "point": Points, "caption": Caption, "query": Answer,
                            "segment": Outline, "transcribe": Transcript}

# ---------------------------------------------------------------------------------- protocols


@runtime_checkable
class VisionModel(Protocol):
    """Every vision family: images encoded once for several calls, and `batch`. Its skills come as
    the protocols below (`Captioner`, `Answerer`, `Detector`, `Segmenter`), one per skill pair."""
    model_id: str

    def encode_image(self, image: Any, *, channel_order: str = "rgb") -> Any:
        """The image encoded once, for several skill calls on it (an opaque object of the family).
        channel_order "bgr" for OpenCV / ROS bgr8 arrays (a keyword: Moondream's second argument is
        the reference's settings, {"variant": ...}). An encoded image passes through."""

    def batch(self, requests: list[Request]) -> list[dict[str, Any]]:
        """Results of `requests` (runtime.requests.Request: task, image, prompt, ...) in order.
        prompt is the object for detect/point/segment, the question for query, the length for
        caption ("" = "normal"). A request's `cancel` stops its row at the next step (its result
        holds what was decoded); `progress` is called with the result so far as it grows. A task
        the family does not offer is a ValueError."""


@runtime_checkable
class Captioner(VisionModel, Protocol):
    """The caption skill (every vision family of the package)."""

    def caption(self, image: Any, length: str = "normal", stream: bool = False,
                settings: dict[str, Any] | None = None) -> dict[str, Any]:
        """`Caption`. length: "short", "normal" or "long" (ValueError otherwise). settings (the
        public Moondream API's; runtime.requests.Settings): temperature (0: greedy; default 0.5),
        top_p in (0, 1] (0.3), max_tokens (768), max_objects (50), variant (None); an unknown key
        is a TypeError; a setting the family cannot honour (variant: Moondream's adapters) is a
        NotImplementedError saying so. Every vision family takes this signature and these
        defaults (Moondream 3 fills in kestrel's: temperature 0.2, top_p 0.9); max_objects is
        accepted and unused by text skills."""


@runtime_checkable
class Answerer(VisionModel, Protocol):
    """The query skill."""

    def query(self, image: Any = None, question: str | None = None, reasoning: bool = False,
              spatial_refs: list[Sequence[float]] | None = None, stream: bool = False,
              settings: dict[str, Any] | None = None) -> dict[str, Any]:
        """`Answer` to `question` about the image (image None: text only, where the family allows);
        reasoning: grounded reasoning first (Moondream's; elsewhere NotImplementedError, as for
        spatial_refs, which Moondream's region encoder reads); spatial_refs: points (x, y)
        and boxes (x_min, y_min, x_max, y_max), normalised, that the question refers to; settings
        as caption's."""


@runtime_checkable
class Detector(VisionModel, Protocol):
    """The detect and point skills (Moondream 2 and 3)."""

    def detect(self, image: Any, object: str, settings: dict[str, Any] | None = None) -> dict[str, Any]:
        """`Detections` of `object` (a non-empty description); settings["max_objects"] (default
        DEFAULT_MAX_OBJECTS) bounds them."""

    def point(self, image: Any, object: str, settings: dict[str, Any] | None = None,
              spatial_refs: list[Sequence[float]] | None = None) -> dict[str, Any]:
        """`Points` on `object`, which may refer to `spatial_refs` (as query's)."""


@runtime_checkable
class Segmenter(VisionModel, Protocol):
    """The segment skill (Moondream 3)."""

    def segment(self, image: Any, object: str, spatial_refs: list[Sequence[float]] | None = None,
                settings: dict[str, Any] | None = None) -> dict[str, Any]:
        """`Outline` of `object`; settings["max_tokens"] bounds the path's tokens."""


@runtime_checkable
class SpeechModel(Protocol):
    """Every speech family: transcribe, one clip or a batch."""
    model_id: str

    def transcribe(self, audio: Any, sample_rate: int = 16000, *, language: str | None = None,
                   initial_prompt: str | None = None, timestamps: bool = True,
                   temperature: float | Sequence[float] = ...) -> dict[str, Any]:
        """`Transcript` of the clip. language: a code to force, None to let the model decide.
        initial_prompt: context text (names, terms), ignored by families without prompts.
        timestamps: segment times from the model (False: one segment for the clip, or none);
        temperature: decoding temperature(s), the fallback sequence by default. A family without
        timestamps or sampling accepts both and ignores them. Further keyword options are the
        family's own (Whisper's beam_size, Qwen3-ASR's max_new_tokens); an option no family has
        is a TypeError."""

    def batch(self, requests: Sequence[TranscribeRequest]) -> list[dict[str, Any]]:
        """`Transcript`s of `requests` (runtime.requests.TranscribeRequest), in order: result i is
        transcribe(**requests[i].kwargs())."""

    def warmup(self, language: str | None = None, initial_prompt: str | None = None) -> None:
        """Run every path a first call takes, with the options later calls will use."""

    # Optional: check_language(language) -> None, ValueError naming why the model cannot transcribe
    # in `language` (Whisper, Qwen3-ASR; Parakeet: any language, it cannot be told one); a family
    # without it takes any. Optional: check_prompt(initial_prompt) -> None, ValueError naming why
    # the model cannot take it (Parakeet: any prompt, it reads none). transcribe() still takes and
    # ignores what they refuse; the speech node refuses such parameters with their reason.


@runtime_checkable
class StreamingSpeechModel(SpeechModel, Protocol):
    """A speech model that transcribes a file of any length in bounded memory (Whisper)."""

    def transcribe_stream(self, stream: Any, *, language: str | None = None, timestamps: bool = True,
                          initial_prompt: str | None = None) -> dict[str, Any]:
        """`transcribe` of an audio_io.open_audio_stream, with the same result."""


@runtime_checkable
class TextModel(Protocol):
    """A family that reads text only (a language model without a vision encoder): the query skill
    with image None, and `batch` of such query requests. It has no `encode_image`, so it is not a
    VisionModel, and an image is a ValueError saying the model reads text only."""
    model_id: str

    def query(self, image: None = None, question: str | None = None, reasoning: bool = False,
              spatial_refs: list[Sequence[float]] | None = None, stream: bool = False,
              settings: dict[str, Any] | None = None) -> dict[str, Any]:
        """`Answer`: the model's continuation of `question`; Answerer.query's signature and
        settings (reasoning and spatial_refs: NotImplementedError)."""

    def batch(self, requests: list[Request]) -> list[dict[str, Any]]:
        """Results of query `requests` (image None) in order, as VisionModel.batch."""


# The protocol each skill's method belongs to (TEXT_SKILL_PROTOCOLS: for a TextModel).
SKILL_PROTOCOLS: dict[str, type] = {"caption": Captioner, "query": Answerer, "detect": Detector,
                                    "point": Detector, "segment": Segmenter, "transcribe": SpeechModel}
TEXT_SKILL_PROTOCOLS: dict[str, type] = {"query": TextModel}

# What Family.load returns.
Model = VisionModel | SpeechModel | TextModel


class ContractError(TypeError):
    """A model or a result that breaks this contract: a fault of the family, not of the caller."""


def check_model(model: object, skills: frozenset[str] | set[str]) -> Model:
    """`model`, checked to offer `skills` (a family's declared skills) through the protocols above;
    ContractError naming what is missing otherwise."""
    text_only = isinstance(model, TextModel) and not isinstance(model, VisionModel)
    protocols = TEXT_SKILL_PROTOCOLS if text_only else SKILL_PROTOCOLS
    missing = sorted(skill for skill in skills if skill not in protocols or not isinstance(model, protocols[skill]))
    if missing:
        raise ContractError(f"{type(model).__name__} does not meet the contract for {', '.join(missing)}")
    if isinstance(model, (VisionModel, SpeechModel, TextModel)):
        return model
    raise ContractError(f"{type(model).__name__} is neither a VisionModel, a SpeechModel nor a TextModel")


def check_result(skill: str, result: object) -> None:
    """ContractError unless `result` has the shape of `skill`'s result (keys, value types, ranges)."""
    def need(ok: bool, what: str) -> None:
        if not ok:
            raise ContractError(f"{skill} result {what}: {result!r}"[:400])

    need(isinstance(result, dict), "is not a dict")
    assert isinstance(result, dict)
    shape = RESULTS[skill]
    required = set(getattr(shape, "__required_keys__", ()))
    allowed = set(shape.__annotations__)
    need(required <= set(result) <= allowed | required, f"has keys {sorted(result)}, not {sorted(required)} "
                                                        f"(+ optional {sorted(allowed - required)})")

    def unit(value: object) -> bool:
        return isinstance(value, (int, float)) and 0.0 <= value <= 1.0

    def box(b: object, scored: bool) -> bool:
        keys = {"x_min", "y_min", "x_max", "y_max"} | ({"score"} if scored else set())
        return (isinstance(b, dict) and set(b) == keys and all(unit(b[k]) for k in keys)
                and b["x_min"] <= b["x_max"] and b["y_min"] <= b["y_max"])

    if skill == "detect":
        need(isinstance(result["objects"], list) and all(box(b, True) for b in result["objects"]), "objects")
    elif skill == "point":
        need(isinstance(result["points"], list) and all(
            isinstance(p, dict) and set(p) == {"x", "y", "score"} and all(unit(v) for v in p.values())
            for p in result["points"]), "points")
    elif skill in ("caption", "query"):
        need(all(isinstance(v, str) for v in result.values()), "text")
    elif skill == "segment":
        need(isinstance(result["path"], str) and (result["bbox"] is None or box(result["bbox"], False)), "outline")
        need(isinstance(result.get("error", ""), str) and not (result.get("error") and result["path"]), "error")
    elif skill == "transcribe":
        need(isinstance(result["text"], str) and isinstance(result["model_id"], str), "text / model_id")
        need(result["language"] is None or isinstance(result["language"], str), "language")
        need(isinstance(result["duration"], float) and result["duration"] >= 0, "duration")
        need(isinstance(result["processing_time"], float) and result["processing_time"] >= 0, "processing_time")
        need(isinstance(result["segments"], list) and all(
            isinstance(s, dict) and set(s) == {"start", "end", "text"} and isinstance(s["text"], str)
            and 0 <= s["start"] <= s["end"] <= result["duration"] + 1e-6 for s in result["segments"]), "segments")
        if "no_speech_prob" in result:
            need(unit(result["no_speech_prob"]), "no_speech_prob")
