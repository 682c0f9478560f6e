"""Reading tensors from any checkpoint format this engine takes, without running code from it, and
renaming them with a family's schema. Every family reads through here; each brings only its
name schema (a list of regex rules) and its config.

Formats: safetensors (one file, or shards listed by `model.safetensors.index.json`), PyTorch files
(`.pt`, `.pth`, `pytorch_model.bin`) through `torch.load(weights_only=True)`, NeMo `.nemo` tars
(a YAML config and a weights-only state dict), and CTranslate2 `model.bin` (ctranslate2.py).
"""
from __future__ import annotations

import io
import json
import ntpath
import os
import posixpath
import re
import tarfile
from collections.abc import Iterable, Sequence
from pathlib import Path, PurePosixPath, PureWindowsPath

import torch

# Names a caller may give for the float types the engine computes in.
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16,
          "fp16": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


def default_dtype(device: torch.device | str) -> str:
    """The dtype a model loads in when the caller names none: bfloat16 on a GPU (half the bytes of
    float32, tensor cores; what a 16 GB Jetson needs to hold a vision model with its compiled
    step), float32 on the CPU (the exact path the reference tests run)."""
    return "bfloat16" if torch.device(device).type == "cuda" else "float32"


def parse_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ValueError(f"dtype must be float32, float16 or bfloat16, got {dtype}")
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype]


def shard_name_stays_inside(name: str) -> bool:
    """Whether a shard name from an index stays inside the checkpoint folder, judged on the name
    alone. Not by resolving it: in a Hugging Face cache snapshot every file is a symlink into
    ../../blobs/, so a resolved shard always lies outside the snapshot folder although the index
    names a file right beside it. What an index must not do is name an absolute path, a drive or
    root, or climb out with '..' (read as a POSIX and as a Windows path, so the same index is
    judged alike on either)."""
    if not isinstance(name, str) or not name or os.path.isabs(name):
        return False
    for pure in (PurePosixPath(name), PureWindowsPath(name)):
        if pure.drive or pure.root:
            return False
    for normal in (posixpath.normpath(name), ntpath.normpath(name)):
        first = re.split(r"[\\/]", normal)[0]
        if first == ".." or normal == ".":   # climbs out, or names the folder itself
            return False
    return True


def read_safetensors(path: str | Path) -> dict[str, torch.Tensor]:
    """A .safetensors file, or a folder with model.safetensors or a sharded index (every shard it
    names must be there)."""
    from safetensors.torch import load_file

    path = Path(path)
    if path.is_file():
        return load_file(str(path))
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        outside = [s for s in shards if not shard_name_stays_inside(s)]
        if outside:
            raise ValueError(f"{path}: the shard index names files outside the checkpoint folder ({outside}): refused")
        missing = [s for s in shards if not (path / s).is_file()]
        if missing:
            raise FileNotFoundError(f"{path}: the shard index names {missing}, which are missing")
        tensors: dict[str, torch.Tensor] = {}
        for shard in shards:
            tensors.update(load_file(str(path / shard)))
        return tensors
    if (path / "model.safetensors").is_file():
        return load_file(str(path / "model.safetensors"))
    raise FileNotFoundError(f"{path}: no model.safetensors or model.safetensors.index.json")


def read_torch(path: str | Path) -> dict:
    """A PyTorch file without unpickling code (weights_only); mmap spares a second copy of a large
    file where the format allows it."""
    try:
        return torch.load(str(path), map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError as err:
        if "mmap" not in str(err):
            raise
        return torch.load(str(path), map_location="cpu", weights_only=True)   # legacy, non-zip files


def read_folder(folder: str | Path) -> dict[str, torch.Tensor]:
    """The tensors of a Hugging Face style folder: safetensors (sharded or not), else pytorch_model.bin."""
    folder = Path(folder)
    if (folder / "model.safetensors.index.json").is_file() or (folder / "model.safetensors").is_file():
        return read_safetensors(folder)
    if (folder / "pytorch_model.bin").is_file():
        return read_torch(folder / "pytorch_model.bin")
    raise FileNotFoundError(f"{folder}: no model.safetensors(.index.json) or pytorch_model.bin")


def read_nemo(path: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """A NeMo checkpoint (a tar holding model_config.yaml and model_weights.ckpt, possibly under a
    folder): (config, state dict)."""
    import yaml

    config, state = None, None
    with tarfile.open(path) as tar:
        for member in tar.getmembers():
            name = Path(member.name).name
            data = tar.extractfile(member) if name in ("model_config.yaml", "model_weights.ckpt") else None
            if data is None:   # another member, or one that is not a regular file
                continue
            if name == "model_config.yaml":
                config = yaml.safe_load(data.read())
            else:
                state = torch.load(io.BytesIO(data.read()), map_location="cpu", weights_only=True)
    if config is None or state is None:
        raise ValueError(f"{path}: a .nemo needs model_config.yaml and model_weights.ckpt")
    return config, state


def rename(tensors: dict[str, torch.Tensor], rules: Sequence[tuple[str, str]], keep: Iterable[str] = (),
           drop: Iterable[str] = ()) -> dict[str, torch.Tensor]:
    """A family's name schema: each name is rewritten by the first rule (regex, replacement) that
    matches it whole; names matching a `keep` pattern pass unchanged, `drop` patterns are left out,
    and any other name is an error (a tensor nobody expects means the wrong checkpoint)."""
    compiled = [(re.compile(p), r) for p, r in rules]
    kept = [re.compile(p) for p in keep]
    dropped = [re.compile(p) for p in drop]
    out: dict[str, torch.Tensor] = {}
    for key, t in tensors.items():
        if any(d.fullmatch(key) for d in dropped):
            continue
        for pat, rep in compiled:
            if pat.fullmatch(key):
                out[pat.sub(rep, key)] = t
                break
        else:
            if not any(k.fullmatch(key) for k in kept):
                raise ValueError(f"unexpected tensor {key!r} for this model's schema")
            out[key] = t
    return out
