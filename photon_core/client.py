"""The moondream client's local mode, on Photon: code written against `moondream.vl(local=True,
model=...)` or `moondream.photon(model)` runs after changing its import to

    import photon_core.client as md
    model = md.vl(local=True, model="moondream3.1-9B-A2B")
    model.query(image, "what is this?")   # {"answer": ...}

The methods have the client's names, signatures and result dicts (moondream.types: CaptionOutput,
QueryOutput, ChatOutput, DetectOutput, PointOutput, SegmentOutput / SegmentStreamChunk) and hand
the call to the model photon_core.load gives, in this process: there is no engine thread, no
cloud and nothing leaves the machine. A call the model's family does not have is an
UnsupportedTask (a NotImplementedError, and the client's ValueError) saying so.

Model names: a local folder, a Hugging Face id in the local cache, a package name ("whisper-tiny.en"),
or the client's Moondream names (MOONDREAM_MODELS). "base/finetune_id@step" names a fine-tuned
variant of `base`: every call passes it on as settings["variant"] (a call's settings["adapter"],
the client engine's name, does the same for that call).
"""
from __future__ import annotations

import inspect
import logging
import math
import numbers
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from photon_core.runtime.chat_messages import image_from_url

_log = logging.getLogger(__name__)

# The client's Moondream names and the Hugging Face repositories they stand for.
MOONDREAM_MODELS = {"moondream2": "vikhyatk/moondream2",
                    "moondream3-preview": "moondream/moondream3-preview",
                    "moondream3.1-9B-A2B": "moondream/moondream3.1-9B-A2B"}
RUNTIME_OPTIONS = ("device", "dtype", "backend", "model_path")
# The client's engine (kestrel's RuntimeConfig) knobs that size or tune its scheduler; this client has
# no such engine, so they are accepted (moondream's own docs pass max_batch_size, kv_cache_pages) and
# change nothing. Results do not depend on them there either.
ENGINE_OPTIONS = ("max_batch_size", "page_size", "kv_cache_pages", "enable_cuda_graphs",
                  "enable_prefix_cache", "service_name", "decode_path")
TASKS = ("caption", "query", "chat", "detect", "point", "segment", "transcribe")


def photon_models() -> list[str]:
    """The model names this module knows by name (any local folder or cached Hugging Face id of a
    supported family works too; photon_core.registry.families() lists the families)."""
    return list(MOONDREAM_MODELS)


def photon(model: str, *, api_key: str | None = None, **runtime: Any) -> "PhotonClient":
    """A local model with every call its family offers. runtime: device ("cuda" when there is one,
    else "cpu"), dtype (the family's default), backend ("auto", "reference", "triton",
    "megakernel"), model_path (the checkpoint's file or folder, read instead of the name's; as
    kestrel's RuntimeConfig.model_path); the client's engine knobs (ENGINE_OPTIONS) are accepted and
    change nothing. api_key is accepted for the client's sake and unused: nothing is fetched."""
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
    if slash and base in MOONDREAM_MODELS:
        # the client takes what follows a Moondream name for a variant: said here, not a missing
        # model whose hints name other families' downloads
        raise ValueError(f"model {name!r}: a fine-tuned variant of {base} is named "
                         f"'{base}/<finetune_id>@<step>' (the step: a number)")
    return name, None


def _default_device() -> str:
    import torch
    if torch.cuda.is_available():
        return "cuda"
    # Said, not silent: a GPU machine whose CUDA is broken would otherwise run the model on the
    # CPU at a fraction of the speed with nothing to tell why.
    logging.getLogger(__name__).warning("no CUDA device is available: running on the CPU (pass device='cpu' "
                                        "to choose it and silence this)")
    return "cpu"


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


class UnsupportedTask(NotImplementedError, ValueError):
    """A call the model's family does not have: NotImplementedError as everywhere in photon_core,
    and the ValueError moondream's client raises for it (code catching that keeps working)."""


class PhotonClient:
    """moondream's PhotonClient calls on a model photon_core.load gives."""

    def __init__(self, *, model: str, api_key: str | None = None, **runtime: Any) -> None:
        from photon_core import registry
        from photon_core.backends.select import get_backend

        if not isinstance(model, str) or not model:
            raise TypeError(f"model must be a model name or path, got {model!r}")
        unknown = sorted(set(runtime) - set(RUNTIME_OPTIONS) - set(ENGINE_OPTIONS))
        if unknown:
            raise TypeError(f"unknown runtime options {unknown}; Photon's are {', '.join(RUNTIME_OPTIONS)}")
        ignored = sorted(set(runtime) & set(ENGINE_OPTIONS))
        if ignored:
            _log.info("engine options %s have no meaning here (no batching engine): ignored", ignored)
        base, self.variant = parse_model_name(model)
        device = runtime.get("device") or _default_device()
        backend = client_backend(runtime.get("backend") or "auto", device, self.variant)
        get_backend(backend, device)   # an unusable backend is reported before any file is read
        # a short name (moondream2) is moondream's, unless a folder of that name is here
        found = registry.recognise(runtime.get("model_path") or
                                   (base if Path(base).exists() else MOONDREAM_MODELS.get(base, base)))
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
            raise UnsupportedTask(f"{self.model_id} ({self.family}) does not {task} (it offers "
                                  f"{', '.join(self.tasks) or 'nothing'})")
        return fn

    def _variant(self, settings: dict[str, Any]) -> str | None:
        """This call's fine-tuned variant: the client's (from its model name), else
        settings["adapter"], kestrel's name for it, which moondream's client passes through (popped:
        the models call it `variant`)."""
        adapter = settings.pop("adapter", None)
        return self.variant if self.variant is not None else adapter

    def _call(self, task: str, settings: Mapping[str, Any] | None, **args: Any) -> Any:
        """The model's `task` with the client's options: settings (and this client's variant) as
        the model's `settings`; an option it has no use for is refused unless left at the client's
        default (None / False)."""
        fn = self._skill(task)
        params = inspect.signature(fn).parameters
        settings = _settings_dict(settings)
        variant = self._variant(settings)
        if variant is not None:
            settings["variant"] = variant
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
                                      f"(asked for {variant!r})")
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
        """{"path": SVG path, "bbox" (when an object was found), "error" (why the path is empty,
        when the model's words were none)}; with stream=True an iterator of {"bbox"}, then
        {"chunk": path text}..., then {"path", "bbox", "completed": True} ("error" too)."""
        fn = self._skill("segment")
        streams = stream and "stream" in inspect.signature(fn).parameters
        out = self._call("segment", settings, image=_image(image), object=object, spatial_refs=spatial_refs,
                         stream=streams)
        if not stream:
            result = {"path": out["path"]}
            if out.get("bbox"):
                result["bbox"] = out["bbox"]
            if out.get("error"):   # the words were no path: say why it is empty, as the stream does
                result["error"] = out["error"]
            return result
        return _segment_updates(out)

    def transcribe(self, **prompt: Any) -> dict[str, Any]:
        """The speech model's transcript of prompt["audio"], with the client's (kestrel's) prompt:
        audio as PCM samples (with sample_rate) or an audio file (a path, its bytes or an open
        binary file; read by audio_io.read_wav), language, initial_prompt,
        condition_on_previous_text, timestamps ("segment" / "none", or a bool), task="transcribe",
        clip_start_seconds / clip_end_seconds, settings={"temperature"}; other keywords are the
        model's own (photon_core.contracts.SpeechModel.transcribe). Returns the model's
        {"text", "segments", "language", "duration", ...} plus the client's "task",
        "duration_seconds", "source_duration_seconds", "clip_start_seconds", "clip_end_seconds";
        times are seconds of the whole audio, as there."""
        if prompt.pop("stream", False):
            raise NotImplementedError("streamed transcription is not offered by this client; the "
                                      "photon_ros speech node and WhisperSpeech.transcribe_stream stream")
        if "audio" not in prompt:
            raise TypeError("transcribe needs audio=<PCM samples or an audio file>")
        fn = self._skill("transcribe")
        settings = _settings_dict(prompt.pop("settings", None))
        variant = self._variant(settings)
        if variant:
            raise NotImplementedError(f"fine-tuned variants ({variant}) are not supported for transcription: "
                                      "load the fine-tuned speech checkpoint itself")
        prompt.update(_speech_options(prompt, settings))
        audio = _pcm(prompt)
        start = _seconds("clip_start_seconds", prompt.pop("clip_start_seconds", 0.0))
        end = prompt.pop("clip_end_seconds", None)
        end = None if end is None else _seconds("clip_end_seconds", end)
        clip = _clip(audio, start, end, prompt.get("sample_rate", 16000))
        out = dict(fn(audio=clip, **prompt))
        return _with_clip_times(out, start, len(np.asarray(audio)) / max(len(clip), 1))


def _settings_dict(settings: Any) -> dict[str, Any]:
    """A call's settings as a dict of its own (the variant is added to it); TypeError for anything
    but a mapping, as Settings.of says it: dict() of a list or a string failed with "dictionary
    update sequence element #0", and took a list of pairs for settings."""
    if settings is None:
        return {}
    if not isinstance(settings, Mapping):
        raise TypeError(f"settings must be a dict, not {type(settings).__name__}")
    return dict(settings)


def _seconds(name: str, value: Any) -> float:
    """A clip bound as seconds from the audio's start: TypeError for no number, ValueError for NaN,
    infinity or a negative one (NaN and infinity failed converting samples to an index, as
    "cannot convert float NaN to integer" and an OverflowError)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number of seconds, got {value!r}")
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a finite number of seconds >= 0, got {value!r}")
    return float(value)


# kestrel's timestamp modes this client has; "word" / "character" are not offered (refused).
TIMESTAMP_MODES = {"none": False, "segment": True}


def _speech_options(prompt: dict[str, Any], settings: dict[str, Any]) -> dict[str, Any]:
    """The client's transcription options as the speech models' keywords: `timestamps` modes as
    the bool the models take ("none" is truthy: passed on, it gave segment times), `task` (only
    transcription), settings' `temperature` (one temperature: no fallback, as there)."""
    options: dict[str, Any] = {}
    task = prompt.pop("task", "transcribe")
    if task == "translate":
        raise NotImplementedError("task='translate' is not offered: Photon's speech models transcribe only")
    if task != "transcribe":
        raise ValueError(f"task must be 'transcribe' or 'translate', got {task!r}")
    mode = prompt.get("timestamps")
    if isinstance(mode, str):
        if mode in ("word", "character"):
            raise NotImplementedError(f"timestamps={mode!r} is not offered: 'segment' or 'none'")
        if mode not in TIMESTAMP_MODES:
            raise ValueError(f"timestamps must be 'none', 'segment', 'word' or 'character', got {mode!r}")
        options["timestamps"] = TIMESTAMP_MODES[mode]
    if "temperature" in settings:
        # a number, as Settings.of takes it (float() took "0.5" and named no setting for "hot")
        temperature = settings.pop("temperature")
        if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real):
            raise TypeError(f"settings['temperature'] must be a number, got {temperature!r}")
        options["temperature"] = float(temperature)
    if settings:
        raise NotImplementedError(f"transcription settings {sorted(settings)} are not offered (only temperature)")
    return options


def _pcm(prompt: dict[str, Any]) -> Any:
    """prompt's audio as samples, an audio file read with its rate put in prompt["sample_rate"]
    (given too, it is refused, as by the client: a file has its own)."""
    from photon_core.audio_io import AudioFileError, read_wav

    audio = prompt.pop("audio")
    if callable(getattr(audio, "read", None)):
        audio = audio.read()
    if not isinstance(audio, (str, Path, bytes, bytearray)):
        return audio
    if "sample_rate" in prompt:
        raise ValueError("sample_rate must be omitted for an audio file (it has its own)")
    if isinstance(audio, (bytes, bytearray)):
        with tempfile.TemporaryDirectory() as folder:   # read_wav (and soundfile) read paths
            path = Path(folder) / "audio"
            path.write_bytes(audio)
            try:
                samples, prompt["sample_rate"] = read_wav(path)
            except AudioFileError as err:   # named as what was given, not a temporary file gone by now
                said = str(err).replace(f"sox {path}", "sox FILE")
                raise AudioFileError(said.replace(str(path), f"the audio given as {len(audio)} bytes")) from None
        return samples
    samples, prompt["sample_rate"] = read_wav(audio)
    return samples


def _clip(audio: Any, start: float, end: float | None, rate: int) -> Any:
    """audio[start s : end s] (the whole audio when neither is given)."""
    if start == 0.0 and end is None:
        return audio
    if start < 0 or (end is not None and end <= start):
        raise ValueError(f"clip_start_seconds must be >= 0 and below clip_end_seconds, got {start}, {end}")
    clip = np.asarray(audio)[round(start * rate):None if end is None else round(end * rate)]
    if len(clip) == 0:
        raise ValueError("the selected audio clip contains no samples")
    return clip


def _with_clip_times(out: dict[str, Any], start: float, source_per_clip: float) -> dict[str, Any]:
    """The model's transcript of a clip with the client's keys, its times in the whole audio."""
    for key in ("segments", "words"):
        if start and isinstance(out.get(key), list):
            out[key] = [dict(item, start=item["start"] + start, end=item["end"] + start) for item in out[key]]
    duration = out["duration"]
    return {**out, "task": "transcribe", "duration_seconds": duration,
            "source_duration_seconds": duration * source_per_clip,
            "clip_start_seconds": start, "clip_end_seconds": start + duration}


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
    final = {"path": out["path"], "bbox": bbox, "completed": True}
    yield {**final, "error": out["error"]} if out.get("error") else final
