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
from collections.abc import Callable, Iterable, Sequence
from functools import lru_cache
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any

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
        shards = _index_shards(index)
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


def _index_shards(index: Path) -> list[str]:
    """The shard names a model.safetensors.index.json maps tensors to; ValueError naming the file
    when it is not {"weight_map": {tensor name: shard file name, ...}} (a truncated or hand-edited
    index would otherwise be a bare KeyError or TypeError)."""
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map")
    except (ValueError, AttributeError) as err:   # invalid JSON or UTF-8; JSON other than an object
        raise ValueError(f"{index}: not a shard index ({type(err).__name__}: {err})") from None
    if not isinstance(weight_map, dict) or not all(isinstance(s, str) for s in weight_map.values()):
        raise ValueError(f"{index}: a shard index maps tensor names to shard file names "
                         f"(\"weight_map\": {{name: file, ...}}); this one does not")
    return sorted(set(weight_map.values()))


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


# Bounds on what a .nemo may hold, so a crafted archive cannot make the loader use unbounded memory
# or time. Real NeMo checkpoints hold a handful of members (model_config.yaml, model_weights.ckpt,
# tokenizer files); the largest weights member of a real Parakeet (TDT 0.6B, float32) is ~2.4 GB,
# its model_config.yaml ~20 KB and its tokenizer files ~250 KB.
NEMO_MAX_MEMBERS = 1024
NEMO_MAX_WEIGHTS_BYTES = 8 << 30
NEMO_MAX_SMALL_BYTES = 64 << 20    # model_config.yaml and tokenizer files
# A compressed (w:gz, older NeMo) archive may expand only this much beyond its size on disk: float
# weights barely compress (~1.1x), while a bomb of zeros expands ~1000x. Up to NEMO_BOMB_FLOOR of
# declared content is accepted whatever the ratio (tiny test archives compress well).
NEMO_MAX_EXPANSION = 16
NEMO_BOMB_FLOOR = 64 << 20
_READ_CHUNK = 16 << 20


@lru_cache(maxsize=1)
def _no_alias_loader() -> type:
    """yaml.SafeLoader without aliases: a few lines of nested aliases ("billion laughs") stand for
    billions of nodes as soon as anything walks or formats the result. NeMo's configs (OmegaConf's
    dumps) never use them. Built on first use: yaml is imported only when a YAML is read."""
    import yaml

    class NoAliasLoader(yaml.SafeLoader):
        def compose_node(self, parent: Any, index: Any) -> Any:
            if self.check_event(yaml.AliasEvent):
                raise yaml.composer.ComposerError(None, None, "YAML aliases (*name) are refused",
                                                  self.peek_event().start_mark)
            return super().compose_node(parent, index)

    return NoAliasLoader


def safe_yaml(data: bytes | str, source: object) -> object:
    """YAML text parsed with safe_load's types and no aliases; ValueError naming `source`."""
    import yaml

    try:
        return yaml.load(data, Loader=_no_alias_loader())   # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as err:
        raise ValueError(f"{source}: {str(err).splitlines()[0] if str(err) else 'not valid YAML'} "
                         f"({type(err).__name__})") from None


def read_nemo_members(path: str | Path, wanted: Callable[[str], int | None]) -> dict[str, bytes]:
    """The bytes of the regular-file members of a .nemo tar whose base name `wanted` accepts
    (`wanted(name)` gives that member's byte limit, None to skip it), keyed by base name (a later
    member of the same name wins, as a dict of the listing would).

    Bounded: at most NEMO_MAX_MEMBERS members; sparse members (GNU sparse files declare any size
    from a few bytes) are refused; each wanted member within its limit; and the content the tar
    declares, up to each header, at most NEMO_MAX_EXPANSION times the file's size on disk (checked
    before reading or skipping a member, so a compressed bomb is refused before it is inflated).
    Members are read in chunks with a running count. ValueError naming the file and the member."""
    path = Path(path)
    on_disk = path.stat().st_size
    declared = 0
    out: dict[str, bytes] = {}
    with tarfile.open(path) as tar:
        for count, member in enumerate(tar, start=1):   # lazily: a header at a time
            if count > NEMO_MAX_MEMBERS:
                raise ValueError(f"{path}: a .nemo with more than {NEMO_MAX_MEMBERS} members is refused")
            if member.issparse():
                raise ValueError(f"{path}: member {member.name!r} is a sparse file: refused")
            declared += max(member.size, 0)
            if declared > max(NEMO_MAX_EXPANSION * on_disk, NEMO_BOMB_FLOOR):
                raise ValueError(f"{path}: the archive declares {declared} bytes by member {member.name!r}, "
                                 f"over {NEMO_MAX_EXPANSION}x its {on_disk} bytes on disk: refused as a "
                                 "decompression bomb")
            name = Path(member.name).name
            limit = wanted(name) if member.isfile() else None   # links and folders are never read
            if limit is None:
                continue
            if member.size > limit:
                raise ValueError(f"{path}: member {member.name!r} declares {member.size} bytes, over the "
                                 f"{limit}-byte limit for it")
            out[name] = _read_member(tar, member, limit, path)
    return out


def _read_member(tar: tarfile.TarFile, member: tarfile.TarInfo, limit: int, path: Path) -> bytes:
    data = tar.extractfile(member)
    if data is None:   # not a regular file (checked by the caller)
        raise ValueError(f"{path}: member {member.name!r} is not a regular file")
    chunks, total = [], 0
    with data:
        while chunk := data.read(min(_READ_CHUNK, limit + 1 - total)):
            total += len(chunk)
            if total > limit:
                raise ValueError(f"{path}: member {member.name!r} holds more than its {limit}-byte limit")
            chunks.append(chunk)
    return b"".join(chunks)


def read_nemo(path: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """A NeMo checkpoint (a tar holding model_config.yaml and model_weights.ckpt, possibly under a
    folder): (config, state dict). Bounded as read_nemo_members says; the YAML has no aliases."""
    limits = {"model_config.yaml": NEMO_MAX_SMALL_BYTES, "model_weights.ckpt": NEMO_MAX_WEIGHTS_BYTES}
    members = read_nemo_members(path, limits.get)
    if "model_config.yaml" not in members or "model_weights.ckpt" not in members:
        raise ValueError(f"{path}: a .nemo needs model_config.yaml and model_weights.ckpt")
    config = safe_yaml(members.pop("model_config.yaml"), f"{path}: model_config.yaml")
    # BytesIO over bytes shares them (no second copy of a multi-GB member)
    state = torch.load(io.BytesIO(members.pop("model_weights.ckpt")), map_location="cpu", weights_only=True)
    if not isinstance(config, dict):
        raise ValueError(f"{path}: model_config.yaml must be a mapping")
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
