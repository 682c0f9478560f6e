"""From a model name to files on this machine: a local path, a folder an installed package provides,
or a Hugging Face id already in the local cache. Nothing is downloaded.

Which family the files belong to is not decided here (see photon_core.registry): the families only
add candidate places for short names they know ("whisper-tiny.en" -> a package folder,
"moondream2" -> "vikhyatk/moondream2").
"""
from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from . import hf_cache

# Files one of which a cached snapshot must hold to count as a checkpoint (a partial download
# holding only config.json does not).
_WEIGHT_PATTERNS = ("*.safetensors", "model.safetensors.index.json", "model.bin",
                    "pytorch_model*.bin", "*.pt", "*.pth", "*.nemo")


class ModelNotFound(FileNotFoundError):
    pass


@dataclass(frozen=True)
class Resolved:
    path: Path     # a folder or a single weights file
    name: str      # what was asked for
    local: bool    # True when `name` was a path on this machine

    @property
    def model_id(self) -> str:
        """What a model loaded from here is called: the id asked for, or the folder / file name of a
        local path (not the whole path)."""
        return self.path.name if self.local else self.name


def is_hf_id(name: str) -> bool:
    """"org/name" (and nothing that looks like a relative path)."""
    return re.fullmatch(r"[\w.-]+/[\w.-]+", name) is not None and not name.startswith(".")


def _cached_snapshot(repo_id: str) -> Path | None:
    for snap in hf_cache.snapshots(repo_id):
        if any(next(snap.glob(pattern), None) is not None for pattern in _WEIGHT_PATTERNS):
            return snap
    return None


def resolve(name: str | Path, candidates: Iterable[str | Path] = (), hints: Iterable[str] = ()) -> Resolved:
    """The files for `name`. `candidates`: further places for it, in order (folders, or Hugging
    Face ids looked up in the cache). ModelNotFound names every place searched, then `hints`."""
    text = str(name)
    path = Path(text).expanduser()
    if path.exists():
        return Resolved(path, text, True)
    looked = [f"no local file or folder {str(path)!r}"]
    places = ([text] if is_hf_id(text) else []) + list(candidates)
    for place in places:
        if isinstance(place, Path):
            if place.exists():
                return Resolved(place, text, False)
            looked.append(f"{place} does not exist")
        elif is_hf_id(place):
            snap = _cached_snapshot(place)
            if snap is not None:
                return Resolved(snap, text, False)
            looked.append(hf_cache.describe_search(place))
    repo = next((p for p in places if isinstance(p, str) and is_hf_id(p)), "ORG/NAME")
    how = ["pass a local folder or weights file", *hints,
           f"fetch Hugging Face weights once with `hf download {repo}` (huggingface_hub's command; "
           "`huggingface-cli download` in huggingface_hub before 0.34)"]
    raise ModelNotFound(f"model {text!r} not found: " + "; ".join(dict.fromkeys(looked))
                        + ". To get it: " + "; or ".join(how) + ".")
