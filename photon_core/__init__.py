"""photon_core: the inference engine, importable without ROS. Families (photon_core.registry):
Moondream 2 and 3.1, Qwen 3.5, Gemma 4 (vision), Whisper, Parakeet TDT, Qwen3-ASR (speech).

    import photon_core
    speech = photon_core.load("whisper-tiny.en")
    speech.transcribe(samples, sample_rate=16000)   # {"text", "segments", "language", "duration", ...}
    vision = photon_core.load("vikhyatk/moondream2")
    vision.detect(image, "cup")                      # {"objects": [{x_min, y_min, x_max, y_max, score}]}
    vision.point(image, "cup"); vision.caption(image); vision.query(image, "what is this?")
    photon_core.load(PATH_TO_MOONDREAM3).segment(image, "cup")   # {"path": SVG path, "bbox": {...}}
"""
from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from photon_core.contracts import Model


def load(model: str | Path, device: str = "cpu", dtype: Any = None, backend: str = "auto",
         skills: Iterable[str] = ()) -> Model:
    """A loaded model with the skills of its family, the family being recognised from the
    checkpoint's files (photon_core.registry.families(): each declares its skills). model: a local path, a package-provided name ("whisper-tiny.en") or a
    Hugging Face id in the local cache. backend: "reference", "triton", "megakernel" or "auto"
    (reference on CPU, megakernel on CUDA; see photon_core.backends.select). skills: what the
    caller needs; registry.MissingSkills, before any weights are read, if the family lacks one.
    The model meets photon_core.contracts (VisionModel, SpeechModel or TextModel, with the protocol of each
    skill its family declares; contracts.ContractError otherwise, the family's fault)."""
    from photon_core import registry
    from photon_core.backends.select import get_backend

    get_backend(backend, device)   # an unusable backend is reported before any file is read
    skills = tuple(skills)
    found = registry.recognise(model, skills)   # a model not found: hints at families with `skills`
    registry.require_skills(found.family, skills)
    return found.load(device, dtype, backend)


# The moondream client's local mode (photon_core.client): photon_core.vl(local=True, model=...),
# photon_core.photon(model), photon_core.photon_models(); imported on first use.
_CLIENT_NAMES = ("vl", "photon", "photon_models")


def __getattr__(name: str) -> Any:
    if name in _CLIENT_NAMES:
        from photon_core import client
        return getattr(client, name)
    raise AttributeError(f"module 'photon_core' has no attribute {name!r}")
