"""Fine-tuned Moondream 2 variants: LoRA adapters on the text decoder, in the public reference's format.

An adapter is a flat state dict (a `final.pt` read with torch.load(weights_only=True), or safetensors)
holding, for every text block i, a pair A [rank, in], B [out, rank] for each of the four linears:
`text.blocks.{i}.attn.qkv`, `.attn.proj`, `.mlp.fc1`, `.mlp.fc2` (`.A` / `.B`). The training code
saves them under the Hugging Face module names (`text_model.transformer.h.{i}.mixer.Wqkv
.parametrizations.weight.0.A`, ...); both namings are read. Each adapted linear adds B(A(x)) to its
output, unscaled, where text.forward says (which input each delta reads follows the reference).

A variant is named by a local file or folder, or by the id Moondream gives a fine-tune
("finetune_id@step"), looked up where the reference caches it (`<hub cache>/md_variants/<id>/final.pt`).
Nothing is downloaded. The moondream client names a variant in the model string: "base/finetune_id@step".

Not supported (each refused with the reason): Moondream 3 (see `variant_for`) and the megakernel backend.
"""
from __future__ import annotations

import os
import pickle
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from photon_core.weights.hf_cache import hub_cache_dirs
from photon_core.weights.tensor_files import read_safetensors, read_torch

from . import text
from .config import TextConfig

LINEARS = ("attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2")
ADAPTER_FILE = "final.pt"
VARIANTS_DIR = "md_variants"
CACHE_SIZE = 4   # variants kept loaded per model (least recently used dropped first)

# The training code's module names -> the reference's, as the reference renames them on load.
_RENAMES = (("text_model.transformer.h.", "text.blocks."), (".mixer.", ".attn."), (".Wqkv.", ".qkv."),
            (".out_proj.", ".proj."), (".parametrizations.weight.0.", "."))


@dataclass(frozen=True)
class LoraPair:
    """One adapted linear: its output gains B @ (A @ x). a [rank, in], b [out, rank]."""
    a: torch.Tensor
    b: torch.Tensor


@dataclass(frozen=True)
class LayerLora:
    qkv: LoraPair
    proj: LoraPair
    fc1: LoraPair
    fc2: LoraPair


@dataclass(frozen=True)
class Variant:
    """A loaded adapter: one LayerLora per text block, in the model's dtype and on its device."""
    name: str
    source: Path
    layers: tuple[LayerLora, ...]

    @property
    def rank(self) -> int:
        return max(p.a.shape[0] for layer in self.layers for p in (layer.qkv, layer.proj, layer.fc1, layer.fc2))


def variant_dirs() -> list[Path]:
    """Where variant ids are looked up, first match wins: `md_variants` under each Hugging Face hub
    cache location (HF_HUB_CACHE, HF_HOME/hub, ~/.cache/huggingface/hub; the reference downloads into
    the first of these that is set)."""
    hubs = hub_cache_dirs() + [Path.home() / ".cache" / "huggingface" / "hub"]
    seen: list[Path] = []
    for hub in hubs:
        d = hub.expanduser() / VARIANTS_DIR
        if d not in seen:
            seen.append(d)
    return seen


def resolve(name: str) -> Path:
    """The adapter file a variant name means: an existing file; a folder holding final.pt or
    *.safetensors; or a variant id found in variant_dirs()."""
    if not isinstance(name, str):
        raise TypeError(f"variant must be a str (a path or a 'finetune_id@step' id), got {type(name).__name__}")
    if not name.strip():
        raise ValueError("variant name is empty")
    path = Path(name).expanduser()
    if path.is_file():
        return path
    if path.is_dir():
        return _adapter_in(path)
    looked = []
    if "/" not in name and "\\" not in name and name not in (".", ".."):
        for d in variant_dirs():
            looked.append(d / name / ADAPTER_FILE)
            # (an empty folder is what an interrupted reference download leaves: keep looking)
            if (d / name / ADAPTER_FILE).is_file() or any((d / name).glob("*.safetensors")):
                return _adapter_in(d / name)
    if not looked:
        raise ValueError(f"variant {name!r} not found: no such file or folder (and not a variant id, "
                         f"'finetune_id@step', which has no '/')")
    raise ValueError(
        f"variant {name!r} not found: no such file or folder, and no adapter at "
        f"{'; '.join(str(p) for p in looked)}. Photon does not download variants: save it as {looked[0]} "
        f"(Moondream serves it at https://api.moondream.ai/v1/variants/{name}/download with your API key "
        f"in the X-Moondream-Auth header; the reference's moondream/torch code downloads it to that place), "
        f"or pass the adapter's file or folder path")


def _adapter_in(folder: Path) -> Path:
    if (folder / ADAPTER_FILE).is_file():
        return folder / ADAPTER_FILE
    shards = sorted(folder.glob("*.safetensors"))
    if len(shards) == 1:
        return shards[0]
    found = "several .safetensors files" if shards else "neither"
    raise ValueError(f"{folder}: a variant folder holds {ADAPTER_FILE} or one .safetensors file; found {found}")


def read_adapter(path: Path) -> dict[str, torch.Tensor]:
    """The adapter's tensors under the reference's names, without running code from the file."""
    if path.suffix == ".safetensors":
        state: Any = read_safetensors(path)
    elif path.suffix in (".pt", ".pth", ".bin"):
        try:
            state = read_torch(path)
        except (pickle.UnpicklingError, RuntimeError, EOFError) as err:
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise ValueError(f"{path}: not a PyTorch file of plain tensors (read with weights_only=True, "
                             f"which runs no code from it): {first}") from None
    else:
        raise ValueError(f"{path}: a variant is a .pt/.pth/.bin (PyTorch) or .safetensors file")
    return reference_names(state, path)


def reference_names(state: Any, source: Path | str = "adapter") -> dict[str, torch.Tensor]:
    """A flat state dict of named tensors with the training code's names rewritten to the reference's."""
    if not isinstance(state, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                              for k, v in state.items()):
        raise ValueError(f"{source}: expected a flat dict of named tensors (a LoRA state dict)")
    out = {}
    for key, t in state.items():
        for old, new in _RENAMES:
            key = key.replace(old, new)
        out[key] = t
    return out


def expected_shapes(cfg: TextConfig) -> dict[str, tuple[int | None, int | None]]:
    """Each adapter tensor's shape with the rank left open (None): A [rank, in], B [out, rank]."""
    hd = cfg.dim // cfg.n_heads
    dims = {"attn.qkv": (cfg.dim, (cfg.n_heads + 2 * cfg.n_kv_heads) * hd), "attn.proj": (cfg.dim, cfg.dim),
            "mlp.fc1": (cfg.dim, cfg.ff_dim), "mlp.fc2": (cfg.ff_dim, cfg.dim)}
    shapes: dict[str, tuple[int | None, int | None]] = {}
    for i in range(cfg.n_layers):
        for lin, (n_in, n_out) in dims.items():
            shapes[f"text.blocks.{i}.{lin}.A"] = (None, n_in)
            shapes[f"text.blocks.{i}.{lin}.B"] = (n_out, None)
    return shapes


def build_variant(tensors: dict[str, torch.Tensor], cfg: TextConfig, dtype: torch.dtype,
                  device: torch.device | str, name: str = "", source: Path = Path()) -> Variant:
    """Check an adapter against the text config (every key present, no others, shapes and ranks
    matching; each error names its key) and lay it out in `dtype` on `device`."""
    label = f"variant {name!r} ({source})" if name else f"variant {source}"
    expected = expected_shapes(cfg)
    missing = [k for k in expected if k not in tensors]
    extra = sorted(k for k in tensors if k not in expected)
    if missing or extra:
        raise ValueError(f"{label} does not fit this model's {cfg.n_layers} text blocks: missing "
                         f"{missing[:4]}{'...' if len(missing) > 4 else ''}, unexpected "
                         f"{extra[:4]}{'...' if len(extra) > 4 else ''} (an adapter has .A and .B for "
                         f"text.blocks.<i>.{{{', '.join(LINEARS)}}})")
    for key, want in expected.items():
        got = tuple(tensors[key].shape)
        if len(got) != 2 or any(w is not None and g != w for g, w in zip(got, want)):
            shown = tuple("rank" if w is None else w for w in want)
            raise ValueError(f"{label}: {key} has shape {got}, expected {shown}")
    layers = []
    for i in range(cfg.n_layers):
        pairs = {}
        for lin in LINEARS:
            a, b = (tensors[f"text.blocks.{i}.{lin}.{x}"] for x in "AB")
            if a.shape[0] != b.shape[1]:
                raise ValueError(f"{label}: text.blocks.{i}.{lin}: A has rank {a.shape[0]}, B has rank {b.shape[1]}")
            if not (a.is_floating_point() and b.is_floating_point()):
                raise ValueError(f"{label}: text.blocks.{i}.{lin} holds {a.dtype}/{b.dtype}, not floats")
            pairs[lin.split(".")[1]] = LoraPair(a.to(device, dtype).contiguous(), b.to(device, dtype).contiguous())
        layers.append(LayerLora(**pairs))
    return Variant(name or str(source), source, tuple(layers))


def load_variant(name: str, cfg: TextConfig, dtype: torch.dtype, device: torch.device | str) -> Variant:
    """A variant by file, folder or id (see resolve), checked against `cfg`."""
    path = resolve(name)
    return build_variant(read_adapter(path), cfg, dtype, device, name, path)


# model -> {(adapter file, its mtime): Variant}; weak, so a dropped model frees its variants.
_CACHE: weakref.WeakKeyDictionary[Any, OrderedDict[tuple[str, int], Variant]] = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


def variant_for(model: Any, name: str | None) -> Variant | None:
    """The variant `name` for `model` (None: the base model). Loaded once per model and adapter file:
    requests naming the same variant share one copy; a file rewritten on disk is read again."""
    if name is None:
        return None
    if getattr(model, "text_impl", text) is not text:
        raise NotImplementedError(
            "fine-tuned variants are supported on Moondream 2 only: the reference's adapter format covers "
            "Moondream 2's dense text blocks (attn qkv/proj, mlp fc1/fc2). Moondream 3's makers (kestrel) "
            "adapt its MLPs instead, with per-expert A/B in the MoE layers (the rank split across the "
            "active experts) handed over by an adapter provider, and publish no file format to read")
    if getattr(model, "decode", None) is not None:
        raise NotImplementedError(
            "fine-tuned variants are not supported on the megakernel backend yet: its compiled decode step "
            "has no LoRA inputs. Load the model with the reference or triton backend to use a variant")
    path = resolve(name)
    key = (str(path.resolve()), os.stat(path).st_mtime_ns)
    with _LOCK:
        loaded = _CACHE.setdefault(model, OrderedDict())
        if key in loaded:
            loaded.move_to_end(key)
            return loaded[key]
        variant = build_variant(read_adapter(path), model.config.text, model.dtype, model.device, name, path)
        loaded[key] = variant
        while len(loaded) > CACHE_SIZE:
            loaded.popitem(last=False)
        return variant
