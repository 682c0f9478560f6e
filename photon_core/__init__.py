"""photon_core: the inference engine (Moondream and Whisper), importable without ROS.

    import photon_core
    speech = photon_core.load("whisper-tiny.en")
    speech.transcribe(samples, sample_rate=16000)   # {"text", "segments", "language", "duration", ...}
    vision = photon_core.load("vikhyatk/moondream2")
    vision.detect(image, "cup")                      # {"objects": [{x_min, y_min, x_max, y_max}]}
    vision.point(image, "cup"); vision.caption(image); vision.query(image, "what is this?")
"""
from __future__ import annotations

from pathlib import Path
from typing import Any


def is_whisper(model: str | Path) -> bool:
    """Whisper ids and folders name themselves (whisper-*, openai/whisper-*, faster-whisper-*);
    a local folder holding a CTranslate2 model.bin or a Whisper config is Whisper too."""
    text = str(model).lower()
    if "whisper" in text:
        return True
    path = Path(model)
    return path.is_dir() and (path / "model.bin").exists()


def load(model: str | Path, device: str = "cpu", dtype: Any = None, backend: str = "auto") -> Any:
    """A loaded model with the skills of its family: Whisper (transcribe) or Moondream
    (detect, point, caption, query). backend: "reference", "triton", "megakernel" or "auto"
    (reference on CPU, megakernel on CUDA; see photon_core.backends.select)."""
    from photon_core.backends.select import get_backend

    ops = get_backend(backend, device)
    if is_whisper(model):
        from photon_core.models.whisper import load_whisper
        return load_whisper(model, device=device, dtype=dtype, backend=backend)
    dtype = dtype if dtype is not None else "float32"
    if getattr(ops, "NAME", "") == "megakernel":
        from photon_core.models.moondream_fast import load_moondream_fast
        return load_moondream_fast(model, device=device, dtype=dtype)
    from photon_core.models.moondream import load_moondream
    return load_moondream(model, device=device, dtype=dtype, backend=ops)
