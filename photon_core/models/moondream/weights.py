"""Finding and reading Moondream 2 checkpoints, without executing any code from them.

Two tensor namings exist for the same md2 tensors; both are normalised to the reference module
names (`text.blocks.0.attn.qkv.weight`, `vision.pos_emb`, `region.coord_features`, ...):
- current `vikhyatk/moondream2` releases: those names with a `model.` prefix;
- older releases: `vision_encoder...`, `text_model...`, `region_model...` (mapped below; the Fourier
  feature matrices are stored transposed there).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from photon_core.weights import hf_cache
from photon_core.weights.tensor_checks import refuse_integers
from photon_core.weights.tensor_files import DTYPES, parse_dtype, read_safetensors, read_torch, rename  # noqa: F401

HF_REPO = "vikhyatk/moondream2"
WEIGHTS_FILE = "model.safetensors"
MD2_IDS = {"moondream2", HF_REPO}
MD3_IDS = {"moondream3-preview", "moondream/moondream3-preview", "moondream3.1-9B-A2B",
           "moondream/moondream3.1-9B-A2B"}

# Older naming -> reference naming, applied in order (first match wins).
_OLD_NAMES = [
    (r"vision_encoder\.encoder\.model\.visual\.patch_embed\.linear\.", "vision.patch_emb."),
    (r"vision_encoder\.encoder\.model\.visual\.pos_embed$", "vision.pos_emb"),
    (r"vision_encoder\.encoder\.model\.visual\.norm\.", "vision.post_ln."),
    (r"vision_encoder\.encoder\.model\.visual\.blocks\.(\d+)\.norm1\.", r"vision.blocks.\1.ln1."),
    (r"vision_encoder\.encoder\.model\.visual\.blocks\.(\d+)\.norm2\.", r"vision.blocks.\1.ln2."),
    (r"vision_encoder\.encoder\.model\.visual\.blocks\.", "vision.blocks."),
    (r"vision_encoder\.projection\.mlp\.", "vision.proj_mlp."),
    (r"text_model\.transformer\.embd\.wte\.weight$", "text.wte"),
    (r"text_model\.transformer\.h\.(\d+)\.mixer\.Wqkv\.", r"text.blocks.\1.attn.qkv."),
    (r"text_model\.transformer\.h\.(\d+)\.mixer\.out_proj\.", r"text.blocks.\1.attn.proj."),
    (r"text_model\.transformer\.h\.", "text.blocks."),
    (r"text_model\.lm_head\.ln\.", "text.post_ln."),
    (r"text_model\.lm_head\.linear\.", "text.lm_head."),
    (r"region_model\.coordinate_encoder\.", "region.coord_encoder."),
    (r"region_model\.coordinate_decoder\.", "region.coord_decoder."),
    (r"region_model\.coordinate_features\.weight$", "region.coord_features"),
    (r"region_model\.size_features\.weight$", "region.size_features"),
    (r"region_model\.", "region."),
]
# Stored transposed under the older names (old name -> reference name).
_OLD_TRANSPOSED = {"region_model.coordinate_features.weight": "region.coord_features",
                   "region_model.size_features.weight": "region.size_features"}
_MD3_MARKERS = ("experts", "tau_", "moe_quant", "coordinate_head", "size_head")


def moondream3_markers(names) -> list[str]:
    """The tensor names (sorted) that only Moondream 3 checkpoints carry (MoE experts, tau
    attention, FP8 expert scales, the linear region heads); empty for Moondream 2."""
    return sorted(n for n in names if any(m in n for m in _MD3_MARKERS))


@dataclass(frozen=True)
class Checkpoint:
    weights: Path          # the tensor file
    folder: Path           # where config.json / tokenizer.json may sit next to it
    config: dict | None    # parsed config.json, if there is one


def _how_to_get() -> str:
    return (f"Download the weights once with `hf download {HF_REPO}` "
            f"(or pass a folder holding {WEIGHTS_FILE} and tokenizer.json).")


def weights_in(folder: Path, names: tuple[str, ...]) -> Path | None:
    """The first of `names` in `folder`, else its only .safetensors (or .pt) file."""
    for name in names:
        if (folder / name).is_file():
            return folder / name
    found = sorted(folder.glob("*.safetensors")) or sorted(folder.glob("*.pt"))
    if len(found) > 1:
        raise ValueError(f"{folder} holds several weight files ({[p.name for p in found]}); pass one of them")
    return found[0] if found else None


def local_weights(path: Path, names: tuple[str, ...], what: str, how_to_get: str) -> tuple[Path, Path] | None:
    """(weights file, folder) for a local file or folder, None when `path` is neither."""
    if path.is_file():
        return path, path.parent
    if path.is_dir():
        weights = weights_in(path, names)
        if weights is None:
            raise FileNotFoundError(f"no {what} in {path}. {how_to_get}")
        return weights, path
    return None


def cached_weights(repo: str, file: str, label: str, name: str, how_to_get: str) -> tuple[Path, Path]:
    """(weights file, snapshot folder) of `repo` in the Hugging Face cache; never downloads."""
    snap = hf_cache.find_snapshot(repo, file)
    if snap is None:
        raise FileNotFoundError(f"{label} weights for {name!r} not found: {hf_cache.describe_search(repo)}. "
                                f"{how_to_get}")
    return snap / file, snap


def unknown_id(name: str, ids: Any, how_to_get: str) -> FileNotFoundError:
    return FileNotFoundError(f"{name!r} is neither a file, a folder, nor a known model id ({sorted(ids)}). "
                             f"{how_to_get}")


def with_config(weights: Path, folder: Path) -> Checkpoint:
    """The checkpoint, with the config.json beside it when there is one."""
    config = None
    if (folder / "config.json").is_file():
        config = json.loads((folder / "config.json").read_text())
    return Checkpoint(weights=weights, folder=folder, config=config)


def resolve(path_or_id: str | Path) -> Checkpoint:
    """A local file or folder, or a model id looked up in the Hugging Face cache (never downloaded)."""
    name = str(path_or_id)
    if name in MD3_IDS or "moondream3" in name.lower() and not Path(name).exists():
        raise ValueError(f"{name}: a Moondream 3 (MoE) model; load it with photon_core.models.moondream3 "
                         "(load_moondream3), not as Moondream 2")
    found = local_weights(Path(name).expanduser(), (WEIGHTS_FILE, "model.pt"),
                          f"{WEIGHTS_FILE} (or other .safetensors/.pt)", _how_to_get())
    if found is not None:
        weights, folder = found
    elif name in MD2_IDS or re.fullmatch(r"[\w.-]+/[\w.-]+", name):
        weights, folder = cached_weights(HF_REPO if name in MD2_IDS else name, WEIGHTS_FILE, "Moondream", name,
                                         _how_to_get())
    else:
        raise unknown_id(name, MD2_IDS, _how_to_get())
    return with_config(weights, folder)


def read(path: Path, torch_suffixes: tuple[str, ...] = (".pt", ".pth", ".bin")) -> Any:
    """The tensors of a .safetensors file, or what torch.load(weights_only=True) reads from a file
    with one of `torch_suffixes`."""
    if path.suffix == ".safetensors":
        return read_safetensors(path)
    if path.suffix in torch_suffixes:
        return read_torch(path)
    raise ValueError(f"unsupported weights format {path.suffix!r} ({path}); expected .safetensors or .pt")


# Either naming -> reference names: the family's schema (first match wins; reference names pass).
SCHEMA = ([(pat[:-1], rep) if pat.endswith("$") else (pat + "(.*)", rep + rf"\{pat.count('(') + 1}")
           for pat, rep in _OLD_NAMES] + [(r"model\.(.*)", r"\1")])


def normalize_names(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Either naming -> reference names, Fourier matrices as [in, features]."""
    md3 = moondream3_markers(tensors)
    if md3:
        raise ValueError(f"this is a Moondream 3 (MoE) checkpoint ({md3[0]}, ...); load it with "
                         "photon_core.models.moondream3 (load_moondream3), not as Moondream 2")
    tensors = {k.replace("._orig_mod", ""): t for k, t in tensors.items()}  # torch.compile'd training
    out = rename(tensors, SCHEMA, keep=(r"(vision|text|region)\..*",))
    for old, new in _OLD_TRANSPOSED.items():
        if old in tensors:
            out[new] = out[new].T
    return out


def load_tensors(path: Path, dtype: torch.dtype, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    raw = read(path)
    refuse_integers(raw, path)
    tensors = normalize_names(raw)
    return {k: v.to(device=device, dtype=dtype).contiguous() for k, v in tensors.items()}
