"""The moondream client's local mode, on Photon: code written against `moondream.vl(local=True,
model=...)` or `moondream.photon(model)` runs after changing its import to

    import photon_core.client as md
    model = md.vl(local=True, model="moondream3.1-9B-A2B")
    model.query(image, "what is this?")   # {"answer": ...}

The methods have the client's names, signatures and result dicts (moondream.types: CaptionOutput,
QueryOutput, ChatOutput, DetectOutput, PointOutput, SegmentOutput / SegmentStreamChunk) and hand
the call to the model photon_core.load gives, in this process: there is no engine thread, no
cloud and nothing leaves the machine. A call the model's family does not have is a
NotImplementedError saying so.

Model names: a local folder, a Hugging Face id in the local cache, a package name ("whisper-tiny.en"),
or the client's Moondream names (MOONDREAM_MODELS). "base/finetune_id@step" names a fine-tuned
variant of `base`: every call passes it on as settings["variant"].
"""
from __future__ import annotations

import inspect
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from photon_core.runtime.chat_messages import image_from_url

# The client's Moondream names and the Hugging Face repositories they stand for.
MOONDREAM_MODELS = {"moondream2": "vikhyatk/moondream2",
                    "moondream3-preview": "moondream/moondream3-preview",
                    "moondream3.1-9B-A2B": "moondream/moondream3.1-9B-A2B"}
RUNTIME_OPTIONS = ("device", "dtype", "backend")
TASKS = ("caption", "query", "chat", "detect", "point", "segment", "transcribe")


def photon_models() -> list[str]:
    """The model names this module knows by name (any local folder or cached Hugging Face id of a
    supported family works too; photon_core.registry.families() lists the families)."""
    return list(MOONDREAM_MODELS)


def photon(model: str, *, api_key: str | None = None, **runtime: Any) -> "PhotonClient":
    """A local model with every call its family offers. runtime: device ("cuda" when there is one,
    else "cpu"), dtype (the family's default), backend ("auto", "reference", "triton",
    "megakernel"). api_key is accepted for the client's sake and unused: nothing is fetched."""
    return PhotonClient(model=model, api_key=api_key, **runtime)


def vl(api_key: str | None = None, endpoint: str | None = None, local: bool = False,
       model: str | None = None, **runtime: Any) -> "PhotonClient":
    """moondream.vl: only its local mode (local=True) exists here."""
    if not local:
        raise ValueError("Photon runs models locally only: call vl(local=True, model=...); the Moondream "
                         "cloud API (endpoint, api_key) is the moondream package's")
    if model is None:
        raise TypeError("vl(local=True) requires model=<model identifier>")
    return photon(model, api_key=api_key, **runtime)


def parse_model_name(name: str) -> tuple[str, str | None]:
    """(base model, variant or None), the moondream client's rule: "base/finetune_id@step" (step all
    digits) -> (base, "finetune_id@step"); any other name -> (name, None).
    "moondream3-preview/01HXYZ@1000" -> ("moondream3-preview", "01HXYZ@1000"); "vikhyatk/moondream2"
    -> ("vikhyatk/moondream2", None). An existing path is a model, never a variant."""
    if not isinstance(name, str):
        raise TypeError(f"model name must be a str, got {type(name).__name__}")
    if Path(name).expanduser().exists():
        return name, None
    base, slash, last = name.rpartition("/")
    finetune, at, step = last.rpartition("@")
    if slash and at and finetune and step.isdigit():
        return base, last
    return name, None


def _default_device() -> str:
    import torch
    return "cuda" if torch.cuda.is_available() else "cpu"


def client_backend(backend: str, device: str, variant: str | None) -> str:
    """The backend a client loads: `auto` on a GPU is the compiled decode steps, which take no
    variant adapters (yet); a client of a fine-tuned variant gets the per-op kernels there instead."""
    if variant and backend == "auto" and str(device).startswith("cuda"):
        return "triton"
    return backend


def _image(image: Any) -> Any:
    """The client's Base64EncodedImage (any object with a data: URL `image_url`) as a PIL image;
    anything else goes to the model as it is (arrays, PIL images, the model's EncodedImage)."""
    url = getattr(image, "image_url", None)
    return image_from_url(url) if isinstance(url, str) else image


class PhotonClient:
    """moondream's PhotonClient calls on a model photon_core.load gives."""

    def __init__(self, *, model: str, api_key: str | None = None, **runtime: Any) -> None:
        from photon_core import registry
        from photon_core.backends.select import get_backend

        if not isinstance(model, str) or not model:
            raise TypeError(f"model must be a model name or path, got {model!r}")
        unknown = sorted(set(runtime) - set(RUNTIME_OPTIONS))
        if unknown:
            raise TypeError(f"unknown runtime options {unknown}; Photon's are {', '.join(RUNTIME_OPTIONS)}")
        base, self.variant = parse_model_name(model)
        device = runtime.get("device") or _default_device()
        backend = client_backend(runtime.get("backend") or "auto", device, self.variant)
        get_backend(backend, device)   # an unusable backend is reported before any file is read
        # a short name (moondream2) is moondream's, unless a folder of that name is here
        found = registry.recognise(base if Path(base).exists() else MOONDREAM_MODELS.get(base, base))
        self.family = found.family.name
        self._model: Any = found.load(device, runtime.get("dtype"), backend)

    # -- what the model is ----------------------------------------------------------------------
    @property
    def model(self) -> Any:
        """The photon_core model behind the client (for the calls the client does not have)."""
        return self._model

    @property
    def model_id(self) -> str:
        return str(self._model.model_id)

    @property
    def tasks(self) -> tuple[str, ...]:
        return tuple(t for t in TASKS if callable(getattr(self._model, t, None)))

    def supports(self, task: str) -> bool:
        return task in self.tasks

    def close(self) -> None:
        """Nothing to release but the model itself, freed with the client."""

    def __enter__(self) -> "PhotonClient":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- calling the model -----------------------------------------------------------------------
    def _skill(self, task: str) -> Any:
        fn = getattr(self._model, task, None)
        if not callable(fn):
            raise NotImplementedError(f"{self.model_id} ({self.family}) does not {task} (it offers "
                                      f"{', '.join(self.tasks) or 'nothing'})")
        return fn

    def _call(self, task: str, settings: Mapping[str, Any] | None, **args: Any) -> Any:
        """The model's `task` with the client's options: settings (and this client's variant) as
        the model's `settings`; an option it has no use for is refused unless left at the client's
        default (None / False)."""
        fn = self._skill(task)
        params = inspect.signature(fn).parameters
        settings = dict(settings or {})
        if self.variant is not None:
            settings["variant"] = self.variant
        call = {}
        for name, value in args.items():
            if name in params:
                call[name] = value
            elif value is not None and value is not False:
                raise NotImplementedError(f"{self.model_id} ({self.family}): {task} has no {name!r}")
        if "settings" in params:
            call["settings"] = settings or None
        elif "variant" in settings:
            raise NotImplementedError(f"{self.model_id} ({self.family}) has no fine-tuned variants "
                                      f"(asked for {self.variant!r})")
        elif settings:   # every family's skills take `settings` (photon_core.contracts); transcribe none
            raise TypeError(f"{task} on {self.model_id} takes no settings (got {sorted(settings)})")
        return fn(**call)

    # -- the client's calls ------------------------------------------------------------------------
    def encode_image(self, image: Any) -> Any:
        """The image run through the model's vision encoder once, for several calls on it (the
        model's own EncodedImage, not the client's Base64EncodedImage), with this client's variant
        (its adapter prefills the image too, as every call of this client does)."""
        return self._call("encode_image", None, image=_image(image))

    def caption(self, image: Any, length: str = "normal", stream: bool = False,
                settings: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """{"caption": str, or an iterator of its pieces with stream=True}."""
        out = self._call("caption", settings, image=_image(image), length=length, stream=stream)
        return {"caption": out["caption"]}

    def query(self, image: Any = None, question: str | None = None, stream: bool = False,
              settings: Mapping[str, Any] | None = None, reasoning: bool = False,
              spatial_refs: list[list[float]] | None = None) -> dict[str, Any]:
        """{"answer": str or an iterator of pieces, "reasoning" (only when the model gave some)}."""
        if question is None:
            raise ValueError("question parameter is required")
        out = self._call("query", settings, image=None if image is None else _image(image), question=question,
                         stream=stream, reasoning=reasoning, spatial_refs=spatial_refs)
        result = {"answer": out["answer"]}
        if out.get("reasoning") is not None:
            result["reasoning"] = out["reasoning"]
        return result

    def chat(self, messages: list[dict[str, Any]], stream: bool = False,
             settings: Mapping[str, Any] | None = None, reasoning: bool | None = None) -> dict[str, Any]:
        """{"message": {"role": "assistant", "content", "reasoning"?}, "finish_reason"}; with
        stream=True {"message": an iterator of the content's pieces} (runtime.chat_messages). On
        Moondream: "reasoning_details" with the reasoning's grounding, and reasoning on unless
        asked off (moondream/chat.py, as its makers' engine does)."""
        out = self._call("chat", settings, messages=messages, stream=stream, reasoning=reasoning)
        if stream:
            return {"message": out["message"]}
        return {"message": out["message"], "finish_reason": out.get("finish_reason") or "stop"}

    def detect(self, image: Any, object: str, settings: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """{"objects": [{"x_min", "y_min", "x_max", "y_max", "score"}]}, normalised to [0, 1]."""
        return {"objects": self._call("detect", settings, image=_image(image), object=object)["objects"]}

    def point(self, image: Any, object: str, settings: Mapping[str, Any] | None = None,
              spatial_refs: list[list[float]] | None = None) -> dict[str, Any]:
        """{"points": [{"x", "y", "score"}]}, normalised to [0, 1]."""
        out = self._call("point", settings, image=_image(image), object=object, spatial_refs=spatial_refs)
        return {"points": out["points"]}

    def segment(self, image: Any, object: str, spatial_refs: list[list[float]] | None = None,
                stream: bool = False, settings: Mapping[str, Any] | None = None) -> Any:
        """{"path": SVG path, "bbox" (when an object was found)}; with stream=True an iterator of
        {"bbox"}, then {"chunk": path text}..., then {"path", "bbox", "completed": True}."""
        fn = self._skill("segment")
        streams = stream and "stream" in inspect.signature(fn).parameters
        out = self._call("segment", settings, image=_image(image), object=object, spatial_refs=spatial_refs,
                         stream=streams)
        if not stream:
            result = {"path": out["path"]}
            if out.get("bbox"):
                result["bbox"] = out["bbox"]
            return result
        return _segment_updates(out)

    def transcribe(self, **prompt: Any) -> dict[str, Any]:
        """The speech model's transcript of prompt["audio"] (sample_rate, language, ... as the
        model's transcribe takes them): {"text", "segments", "language", "duration", ...}."""
        if prompt.pop("stream", False):
            raise NotImplementedError("streamed transcription is not offered by this client; the "
                                      "photon_ros speech node and WhisperSpeech.transcribe_stream stream")
        if "audio" not in prompt:
            raise TypeError("transcribe needs audio=<PCM samples>")
        if self.variant:
            raise NotImplementedError(f"fine-tuned variants ({self.variant}) are not supported for transcription: "
                                      "load the fine-tuned speech checkpoint itself")
        return dict(self._skill("transcribe")(**prompt))


def _segment_updates(out: Any) -> Iterator[dict[str, Any]]:
    """The client's segment stream: from a model's own stream of updates, or, from a whole result,
    its bbox, its path as one chunk and the final update."""
    if not isinstance(out, Mapping):
        yield from out
        return
    bbox = out.get("bbox")
    yield {"bbox": bbox}
    if out["path"]:
        yield {"chunk": out["path"]}
    yield {"path": out["path"], "bbox": bbox, "completed": True}
