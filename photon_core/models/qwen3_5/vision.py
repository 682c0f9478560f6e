"""Qwen 3.5 vision: dynamic-resolution preprocessing and the ViT with a 2x2 patch merger.

An image is resized (aspect kept) to multiples of patch*merge pixels within a pixel budget, cut into
patch x patch tiles (each repeated temporal_patch times, as a one-frame video), and the tiles are
ordered merge-block by merge-block so that every merge x merge group is contiguous. The ViT adds a
learned position table resampled (bilinear, corners aligned) to the image's grid and a 2-D rotary
(height and width frequencies side by side over the whole head); attention is bidirectional over the
image. The merger concatenates each group's features and projects them to the text width: one text
token per group.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from photon_core.runtime.image_input import ImageLike, to_rgb
from photon_core.weights.config_values import config_float, config_int

from .config import VisionConfig


# The most pixels an image may be resized to: 4x the real Qwen 3.5 / Qwen3-VL processors' budget
# (size.longest_edge 16777216 = 4096 x 4096; size.shortest_edge 65536).
MAX_PIXELS = 1 << 26

# What the image processor transformers builds for a Qwen 3.5 checkpoint (Qwen2VLImageProcessor)
# takes for a setting its config leaves out: the class's own defaults, the CLIP normalisation and a
# pixel budget of [56 * 56, 28 * 28 * 1280]. They apply only where the checkpoint ships an image
# processor config; without one, the real Qwen 3.5 values (Preprocess' defaults) are used.
CLASS_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLASS_STD = (0.26862954, 0.26130258, 0.27577711)
CLASS_MIN_PIXELS = 56 * 56
CLASS_MAX_PIXELS = 28 * 28 * 1280


@dataclass(frozen=True)
class Preprocess:
    patch: int = 16
    temporal_patch: int = 2
    merge: int = 2
    mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    std: tuple[float, ...] = (0.5, 0.5, 0.5)
    min_pixels: int = 65536
    max_pixels: int = 16777216

    @classmethod
    def from_folder(cls, folder: Path, vcfg: VisionConfig) -> "Preprocess":
        """The image processor's settings where transformers finds them: the "image_processor" of
        processor_config.json first (newer exports nest it there), else preprocessor_config.json;
        the vision config decides patch and merge sizes. Read as its processor reads them: a
        top-level min_pixels / max_pixels overrides size.shortest_edge / size.longest_edge, and a
        setting left out takes the processor class's default (CLASS_*). The pixel budget is
        bounded: every image is resized to at least min_pixels, so a crafted 4e10 would make each
        request allocate terabytes."""
        folder = Path(folder)
        f = folder / "processor_config.json"
        raw = _read_object(f).get("image_processor")
        if raw is None:
            f = folder / "preprocessor_config.json"
            if not f.is_file():
                return cls(patch=vcfg.patch, temporal_patch=vcfg.temporal_patch, merge=vcfg.merge)
            raw = _read_object(f)
        if not isinstance(raw, dict):
            raise ValueError(f"{f}: image_processor must be an object")
        size = raw.get("size") or {}
        if not isinstance(size, dict):
            raise ValueError(f"{f}: size must be an object")

        def pick(raw_key: str, size_key: str, default: int) -> tuple[Any, str]:
            """(value, field name): the top-level key first, then size.<key>, as the processor
            reads them."""
            if raw.get(raw_key) is not None:
                return raw[raw_key], raw_key
            return (size[size_key], f"size.{size_key}") if size_key in size else (default, raw_key)

        value, field = pick("max_pixels", "longest_edge", CLASS_MAX_PIXELS)
        max_pixels = config_int(value, f, field, 1, MAX_PIXELS)
        value, field = pick("min_pixels", "shortest_edge", CLASS_MIN_PIXELS)
        min_pixels = config_int(value, f, field, 1, max_pixels)
        mean, std = raw.get("image_mean", CLASS_MEAN), raw.get("image_std", CLASS_STD)
        if not isinstance(mean, (list, tuple)) or not isinstance(std, (list, tuple)) or len(mean) != 3 or len(std) != 3:
            raise ValueError(f"{f}: image_mean and image_std must hold 3 numbers (RGB)")
        return cls(patch=vcfg.patch, temporal_patch=vcfg.temporal_patch, merge=vcfg.merge,
                   mean=tuple(config_float(m, f, "image_mean") for m in mean),
                   std=tuple(config_float(x, f, "image_std", positive=True) for x in std),
                   min_pixels=min_pixels, max_pixels=max_pixels)


def _read_object(path: Path) -> dict[str, Any]:
    """A JSON file's object ({} when the file is absent); ValueError naming it otherwise."""
    if not path.is_file():
        return {}
    raw = json.loads(path.read_text())
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: must hold a JSON object")
    return raw


def target_size(height: int, width: int, pp: Preprocess) -> tuple[int, int]:
    """The resized (height, width): multiples of patch*merge, area within [min_pixels, max_pixels],
    aspect ratio kept as closely as the rounding allows (the Qwen2-VL processor's rule)."""
    f = pp.patch * pp.merge
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"image aspect ratio {max(height, width) / min(height, width):.0f} exceeds 200")
    h, w = round(height / f) * f, round(width / f) * f
    if h * w > pp.max_pixels:
        beta = math.sqrt(height * width / pp.max_pixels)
        h, w = max(f, math.floor(height / beta / f) * f), max(f, math.floor(width / beta / f) * f)
    elif h * w < pp.min_pixels:
        beta = math.sqrt(pp.min_pixels / (height * width))
        h, w = math.ceil(height * beta / f) * f, math.ceil(width * beta / f) * f
    return h, w


def preprocess(image: ImageLike, pp: Preprocess, channel_order: str = "rgb") -> tuple[torch.Tensor, tuple[int, int]]:
    """(patches [gh*gw, 3*temporal*patch*patch] fp32 in merge-block order, (gh, gw) in patches)."""
    from PIL import Image

    arr = to_rgb(image, channel_order, alpha="white")   # as its processor (convert_to_rgb)
    height, width = arr.shape[:2]
    h, w = target_size(height, width, pp)
    if (h, w) != (height, width):
        # Image.Resampling since Pillow 9.1; the constant sat on Image before (Ubuntu 22.04's 9.0).
        arr = np.asarray(Image.fromarray(arr).resize((w, h), getattr(Image, "Resampling", Image).BICUBIC))
    x = torch.from_numpy(arr.astype(np.float32) / 255.0)
    x = (x - torch.tensor(pp.mean)) / torch.tensor(pp.std)                 # [h, w, 3]
    p, m = pp.patch, pp.merge
    gh, gw = h // p, w // p
    x = x.permute(2, 0, 1).reshape(3, gh // m, m, p, gw // m, m, p)
    x = x.permute(1, 4, 2, 5, 0, 3, 6)                                    # [bh, bw, mh, mw, C, p, p]
    x = x[..., None, :, :].expand(*x.shape[:5], pp.temporal_patch, p, p)  # one frame as a video
    return x.reshape(gh * gw, -1).contiguous(), (gh, gw)


class VisionWeights:
    def __init__(self, sd: dict[str, torch.Tensor], cfg: VisionConfig) -> None:
        g = lambda n: sd.get(f"vision.{n}")  # noqa: E731
        w = sd["vision.patch_embed.proj.weight"]
        self.patch_w, self.patch_b = w.reshape(w.shape[0], -1), g("patch_embed.proj.bias")
        self.pos = sd["vision.pos_embed.weight"]
        self.blocks = [{n: g(f"blocks.{i}.{n}") for n in (
            "norm1.weight", "norm1.bias", "norm2.weight", "norm2.bias", "attn.qkv.weight", "attn.qkv.bias",
            "attn.proj.weight", "attn.proj.bias", "mlp.linear_fc1.weight", "mlp.linear_fc1.bias",
            "mlp.linear_fc2.weight", "mlp.linear_fc2.bias")} for i in range(cfg.depth)]
        self.merger = {n: g(f"merger.{n}") for n in ("norm.weight", "norm.bias", "linear_fc1.weight",
                                                     "linear_fc1.bias", "linear_fc2.weight", "linear_fc2.bias")}
        if math.isqrt(cfg.num_pos) ** 2 != cfg.num_pos:
            raise ValueError(f"vision num_position_embeddings {cfg.num_pos} is not a square grid")
        half = cfg.head_dim // 2
        self.inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, half, 2, dtype=torch.float32) / half))


def _block_order(t: torch.Tensor, gh: int, gw: int, m: int) -> torch.Tensor:
    """[gh, gw, ...] in raster order -> [gh*gw, ...] merge-block by merge-block."""
    rest = t.shape[2:]
    t = t.reshape(gh // m, m, gw // m, m, *rest).transpose(1, 2)
    return t.reshape(gh * gw, *rest)


def _resample_axis(n: int, side: int) -> torch.Tensor:
    """[n, side] linear-interpolation weights, corners aligned (F.interpolate align_corners=True)."""
    src = torch.arange(n, dtype=torch.float32) * (side - 1) / max(n - 1, 1)
    return (1 - (src[:, None] - torch.arange(side, dtype=torch.float32)[None, :]).abs()).clamp(min=0)


def encode(patches: torch.Tensor, grid: tuple[int, int], w: VisionWeights, cfg: VisionConfig, ops) -> torch.Tensor:
    """Patches of one image -> its text-width features [gh*gw / merge^2, out_dim]."""
    return encode_patches(patches.to(w.patch_w.device), *positions(grid, w, cfg), w, cfg, ops)


def positions(grid: tuple[int, int], w: VisionWeights, cfg: VisionConfig
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(position embeddings [gh*gw, dim] in the weights' dtype, rotary cos and sin [gh*gw,
    head_dim / 2]) of a grid, in merge-block order, on the weights' device: what encode_patches
    takes, made from the grid's sizes on the host (an encoder replayed from a CUDA graph reads
    nothing on the host)."""
    gh, gw = grid
    m, d = cfg.merge, cfg.dim
    dtype, device = w.patch_w.dtype, w.patch_w.device
    side = math.isqrt(cfg.num_pos)
    table = w.pos.float().reshape(side, side, d)
    along_h, along_w = _resample_axis(gh, side).to(device), _resample_axis(gw, side).to(device)
    pos = torch.einsum("rs,ct,std->rcd", along_h, along_w, table)             # [gh, gw, dim]
    rows = torch.arange(gh, device=device)[:, None].expand(gh, gw)
    cols = torch.arange(gw, device=device)[None, :].expand(gh, gw)
    rc = _block_order(torch.stack([rows, cols], -1), gh, gw, m).float()           # [N, 2]
    freqs = w.inv_freq.to(device)
    angles = torch.cat([rc[:, :1] * freqs, rc[:, 1:] * freqs], dim=-1)           # [N, head_dim/2]
    return _block_order(pos, gh, gw, m).to(dtype), angles.cos(), angles.sin()


def encode_patches(patches: torch.Tensor, pos: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   w: VisionWeights, cfg: VisionConfig, ops) -> torch.Tensor:
    """encode, its grid's positions made (positions), all on the device."""
    m, d, dtype = cfg.merge, cfg.dim, w.patch_w.dtype
    x = ops.linear(patches.to(dtype), w.patch_w, w.patch_b) + pos
    n, hn, hd = x.shape[0], cfg.n_heads, cfg.head_dim
    for b in w.blocks:
        h = ops.layer_norm(x, b["norm1.weight"], b["norm1.bias"], 1e-6)
        qkv = ops.linear(h, b["attn.qkv.weight"], b["attn.qkv.bias"]).view(n, 3, hn, hd).permute(1, 2, 0, 3)
        q = ops.rotary(qkv[0].float(), cos, sin, hd).to(dtype)[None]            # [1, H, N, hd]
        k = ops.rotary(qkv[1].float(), cos, sin, hd).to(dtype)[None]
        a = ops.attention(q, k, qkv[2][None])
        x = ops.linear(a[0].transpose(0, 1).reshape(n, d), b["attn.proj.weight"], b["attn.proj.bias"], residual=x)
        h = ops.layer_norm(x, b["norm2.weight"], b["norm2.bias"], 1e-6)
        h = ops.linear(h, b["mlp.linear_fc1.weight"], b["mlp.linear_fc1.bias"], activation=cfg.activation)
        x = ops.linear(h, b["mlp.linear_fc2.weight"], b["mlp.linear_fc2.bias"], residual=x)
    mw = w.merger
    h = ops.layer_norm(x, mw["norm.weight"], mw["norm.bias"], 1e-6).reshape(n // (m * m), d * m * m)
    h = ops.linear(h, mw["linear_fc1.weight"], mw["linear_fc1.bias"], activation="gelu")
    return ops.linear(h, mw["linear_fc2.weight"], mw["linear_fc2.bias"])
