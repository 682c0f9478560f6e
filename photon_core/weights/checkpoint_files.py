"""What a checkpoint on disk holds, read cheaply, for the registry's family probes.

Every fact is read lazily and without loading weights: config.json, the spec name at the start of a
CTranslate2 model.bin, tensor names from safetensors headers, and the state-dict keys of .pt /
pytorch_model.bin files. Those are unpickled with `weights_only=True` (no code runs) and `mmap=True`
(tensor data stays on disk). Nothing here knows about model families.
"""
from __future__ import annotations

import json
import tarfile
from functools import cached_property
from pathlib import Path

from .ctranslate2 import read_spec_name

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".nemo")


def _is_torch_file(path: Path) -> bool:
    # A .bin is either Hugging Face's pickled state dict or a CTranslate2 model; only the former
    # is named pytorch_model*.bin.
    return path.suffix in (".pt", ".pth") or (path.suffix == ".bin" and path.name.startswith("pytorch_model"))


class CheckpointFiles:
    """A resolved checkpoint: a folder, or one weights file (whose folder may hold config.json)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.folder = self.path if self.path.is_dir() else self.path.parent
        self.notes: list[str] = []   # files we could not read, for the "unknown checkpoint" error

    @cached_property
    def files(self) -> list[str]:
        """Names of the files in the folder (or just the one file that was named)."""
        if self.path.is_file():
            return [self.path.name]
        return sorted(p.name for p in self.folder.iterdir() if p.is_file())

    @cached_property
    def weight_files(self) -> list[Path]:
        return [self.folder / name for name in self.files if Path(name).suffix in _WEIGHT_SUFFIXES]

    @cached_property
    def _config_json(self) -> tuple[dict | None, str | None]:
        """config.json's settings and, where it is there but not a JSON object, why (naming it)."""
        cfg = self.folder / "config.json"
        if not cfg.is_file():
            return None, None
        try:
            data = json.loads(cfg.read_text(encoding="utf-8"))
        except (OSError, ValueError) as err:   # UnicodeDecodeError and JSONDecodeError are ValueErrors
            self.notes.append(f"config.json unreadable ({err})")
            return None, f"{cfg}: not valid JSON ({err})"
        if not isinstance(data, dict):
            return None, (f"{cfg}: holds a JSON {type(data).__name__}, where a checkpoint's config "
                          f"is an object of settings ({{\"key\": value, ...}})")
        return data, None

    @property
    def config(self) -> dict | None:
        """config.json's settings; None when there is none or it is not one (`config_error`)."""
        return self._config_json[0]

    @property
    def config_error(self) -> str | None:
        """Why the config.json here is not a config, naming the file; None when it is one or is absent."""
        return self._config_json[1]

    @property
    def model_type(self) -> str | None:
        value = (self.config or {}).get("model_type")
        return value if isinstance(value, str) else None

    @property
    def architectures(self) -> list[str]:
        value = (self.config or {}).get("architectures")
        return [a for a in value if isinstance(a, str)] if isinstance(value, list) else []

    @cached_property
    def ct2_spec(self) -> str | None:
        """Spec name of the CTranslate2 model.bin here ("" for version 1), or None if there is none."""
        bins = [p for p in self.weight_files if p.suffix == ".bin" and not _is_torch_file(p)]
        for path in sorted(bins, key=lambda p: p.name != "model.bin"):   # CTranslate2's name first
            try:
                spec = read_spec_name(path)
            except OSError as err:
                self.notes.append(f"{path.name} unreadable ({err})")
                continue
            if spec is not None:
                return spec
        return None

    @cached_property
    def tensor_names(self) -> frozenset[str]:
        """Tensor names of every safetensors and torch pickle file here (OpenAI .pt files: the keys
        of their model_state_dict)."""
        names: set[str] = set()
        for path in self.weight_files:
            if path.suffix == ".safetensors":
                names |= self._safetensors_keys(path)
            elif _is_torch_file(path):
                names |= self._torch_keys(path)
        return frozenset(names)

    @cached_property
    def nemo_files(self) -> list[Path]:
        """.nemo archives here (NeMo checkpoints are tar files holding model_config.yaml)."""
        found = []
        for path in self.weight_files:
            if path.suffix == ".nemo":
                try:
                    if tarfile.is_tarfile(path):
                        found.append(path)
                except OSError as err:
                    self.notes.append(f"{path.name} unreadable ({err})")
        return found

    def _safetensors_keys(self, path: Path) -> set[str]:
        from safetensors import safe_open
        try:
            with safe_open(str(path), framework="pt") as f:   # reads the JSON header only
                return set(f.keys())
        except Exception as err:  # noqa: BLE001 - any unreadable file is a note, not a crash
            self.notes.append(f"{path.name} is not a readable safetensors file ({err})")
            return set()

    def _torch_keys(self, path: Path) -> set[str]:
        from photon_core.weights.tensor_files import read_torch
        try:
            data = read_torch(path)   # (legacy, non-zip files too, as the loaders read them)
        except Exception as err:  # noqa: BLE001 - refused pickles and legacy formats alike
            self.notes.append(f"{path.name} could not be read as a weights-only torch file "
                              f"({str(err).splitlines()[0] if str(err) else type(err).__name__})")
            return set()
        if isinstance(data, dict) and isinstance(data.get("model_state_dict"), dict):
            data = data["model_state_dict"]
        return {k for k in data if isinstance(k, str)} if isinstance(data, dict) else set()

    def describe(self) -> str:
        """What was found, for errors: files, config model_type, a few tensor names, CT2 spec."""
        shown = self.files[:12] + (["..."] if len(self.files) > 12 else [])
        parts = [f"files {shown}" if shown else "no files"]
        if self.config is not None:
            parts.append(f"config.json model_type {self.model_type!r}"
                         + (f", architectures {self.architectures}" if self.architectures else ""))
        if self.ct2_spec is not None:
            parts.append(f"CTranslate2 spec {self.ct2_spec!r}")
        if self.tensor_names:
            sample = sorted(self.tensor_names)[:3]
            parts.append(f"{len(self.tensor_names)} tensors (e.g. {sample})")
        parts += self.notes
        return "; ".join(parts)
