"""Gemma 4 image input: aspect-preserving resize to a patch budget, 16x16 patches with (x, y)
positions, the ViT (q/k/v RMSNorm, axial 2-D rotary, scale-free attention, sandwich norms, gated
GELU MLP), k x k average pooling to soft tokens, and the projection into the text embedding space."""
from __future__ import annotations

import math

import numpy as np
import torch
from PIL import Image

from .config import VisionConfig

Tensor = torch.Tensor
SOFT_TOKEN_BUDGETS = (70, 140, 280, 560, 1120)
MAX_IMAGE_SIDE = 16384


def target_size(height: int, width: int, patch: int, max_patches: int, pool: int) -> tuple[int, int]:
    """The largest (h, w), multiples of pool * patch, keeping the aspect ratio within max_patches."""
    budget = max_patches * patch ** 2
    factor = math.sqrt(budget / (height * width))
    side = pool * patch
    h = int(math.floor(factor * height / side)) * side
    w = int(math.floor(factor * width / side)) * side
    longest = (max_patches // pool ** 2) * side
    if h == 0 and w == 0:
        raise ValueError(f"image {width}x{height} cannot be resized to a multiple of {side} pixels")
    if h == 0:
        h, w = side, min(int(math.floor(width / height)) * side, longest)
    elif w == 0:
        w, h = side, min(int(math.floor(height / width)) * side, longest)
    if h * w > budget:
        raise ValueError(f"image {width}x{height}: resized to {w}x{h} it exceeds {max_patches} patches")
    return h, w


def patchify(rgb: np.ndarray, cfg: VisionConfig, max_soft_tokens: int) -> tuple[Tensor, Tensor]:
    """(pixels [N, 3 * p * p] in [0, 1], positions [N, 2] as (x, y)) of the resized image."""
    if max_soft_tokens not in SOFT_TOKEN_BUDGETS:
        raise ValueError(f"max_soft_tokens must be one of {SOFT_TOKEN_BUDGETS}, got {max_soft_tokens}")
    if max(rgb.shape[:2]) > MAX_IMAGE_SIDE:
        raise ValueError(f"image size {rgb.shape[1]}x{rgb.shape[0]} is over {MAX_IMAGE_SIDE} pixels a side")
    p = cfg.patch_size
    h, w = target_size(rgb.shape[0], rgb.shape[1], p, max_soft_tokens * cfg.pool ** 2, cfg.pool)
    if (h, w) != rgb.shape[:2]:
        rgb = np.asarray(Image.fromarray(rgb).resize((w, h), Image.Resampling.BICUBIC))
    img = torch.from_numpy(rgb.astype(np.float32) / 255.0)                      # [H, W, 3]
    ph, pw = h // p, w // p
    pixels = img.view(ph, p, pw, p, 3).permute(0, 2, 1, 3, 4).reshape(ph * pw, p * p * 3)
    ys, xs = torch.meshgrid(torch.arange(ph), torch.arange(pw), indexing="ij")
    return pixels, torch.stack([xs.reshape(-1), ys.reshape(-1)], dim=-1)


def _axial_tables(pos: Tensor, cfg: VisionConfig, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos, sin [2N, head_dim / 4]: rows 2n and 2n + 1 hold patch n's x and y angles (_rope2d)."""
    half = cfg.head_dim // 2
    f = 1.0 / (cfg.rope_theta ** (torch.arange(0, half, 2, dtype=torch.float, device=pos.device) / half))
    ang = (pos.float()[:, :, None] * f).reshape(-1, f.shape[0])
    return ang.cos().to(dtype), ang.sin().to(dtype)


def _rope2d(x: Tensor, tabs, ops) -> Tensor:
    """First half of each head rotated by the x position, second half by the y position: x [1, H,
    N, D] seen as [1, H, 2N, D/2] (each half a row of its own), so one rotary call does both."""
    cos, sin = tabs
    B, H, N, D = x.shape
    return ops.rotary(x.reshape(B, H, 2 * N, D // 2), cos, sin, D // 2).view(B, H, N, D)


def _linear(x: Tensor, w: dict, name: str, ops, activation: str | None = None) -> Tensor:
    lo, hi = w.get(name + ".input_min"), w.get(name + ".input_max")
    if lo is not None:
        x = torch.clamp(x, lo, hi)
    y = ops.linear(x, w[name + ".linear.weight"])
    lo, hi = w.get(name + ".output_min"), w.get(name + ".output_max")
    if lo is not None:
        y.clamp_(lo, hi)   # in place: y is the linear's own fresh output, and no second big buffer
    return y


def encode(pixels: Tensor, pos: Tensor, w: dict, cfg: VisionConfig, ops) -> Tensor:
    """One image's patches [N, 3p^2] (values in [0, 1]) and positions [N, 2] -> soft tokens
    [N / pool^2, vision dim] in fp32 (pooled, scaled by sqrt(dim), standardized when configured)."""
    return encode_patches(pixels, pos, pool_groups(pos, w, cfg), w, cfg, ops)


def pool_groups(pos: Tensor, w: dict, cfg: VisionConfig) -> Tensor:
    """Each patch's soft token (k x k average pooling, row-major over the pooled grid), the
    positions checked against the position table: the host reads `encode_patches` must not make
    (an encoder replayed from a CUDA graph reads nothing on the host)."""
    side = int(pos.max()) + 1
    table = w["vision.patch_embedder.position_embedding_table"]
    if side > table.shape[1]:
        raise ValueError(f"image is {side} patches on a side; the position table has {table.shape[1]}")
    k, cols = cfg.pool, int(pos[:, 0].max()) + 1
    return (pos[:, 0] // k) + (cols // k) * (pos[:, 1] // k)


def encode_patches(pixels: Tensor, pos: Tensor, groups: Tensor, w: dict, cfg: VisionConfig, ops) -> Tensor:
    """encode, its positions checked and pooling groups made (pool_groups), all on the device."""
    dtype = w["vision.patch_embedder.input_proj.weight"].dtype
    table = w["vision.patch_embedder.position_embedding_table"]
    x = ops.linear((2 * (pixels - 0.5)).to(dtype), w["vision.patch_embedder.input_proj.weight"])
    x = (x + table[0][pos[:, 0]] + table[1][pos[:, 1]])[None]                   # [1, N, dim]
    tabs = _axial_tables(pos, cfg, x.dtype)
    H, Hkv, D = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    for i in range(cfg.n_layers):
        p = f"vision.encoder.layers.{i}."
        h = ops.rms_norm(x, w[p + "input_layernorm.weight"], cfg.eps)
        q = ops.rms_norm(_linear(h, w, p + "self_attn.q_proj", ops).view(1, -1, H, D),
                         w[p + "self_attn.q_norm.weight"], cfg.eps)
        k = ops.rms_norm(_linear(h, w, p + "self_attn.k_proj", ops).view(1, -1, Hkv, D),
                         w[p + "self_attn.k_norm.weight"], cfg.eps)
        v = ops.rms_norm(_linear(h, w, p + "self_attn.v_proj", ops).view(1, -1, Hkv, D), None, cfg.eps)
        q, k = _rope2d(q.transpose(1, 2), tabs, ops), _rope2d(k.transpose(1, 2), tabs, ops)
        a = ops.attention(q, k, v.transpose(1, 2).contiguous(), causal=False, scale=1.0)
        a = _linear(a.transpose(1, 2).reshape(1, -1, H * D), w, p + "self_attn.o_proj", ops)
        x = x + ops.rms_norm(a, w[p + "post_attention_layernorm.weight"], cfg.eps)
        h = ops.rms_norm(x, w[p + "pre_feedforward_layernorm.weight"], cfg.eps)
        m = ops.glu(_linear(h, w, p + "mlp.gate_proj", ops), _linear(h, w, p + "mlp.up_proj", ops), cfg.activation)
        m = _linear(m, w, p + "mlp.down_proj", ops)
        x = x + ops.rms_norm(m, w[p + "post_feedforward_layernorm.weight"], cfg.eps)
    return pool(x[0], groups, w, cfg)


def pool(x: Tensor, groups: Tensor, w: dict, cfg: VisionConfig) -> Tensor:
    """k x k average pooling of the patches' features into their soft tokens (pool_groups)."""
    k = cfg.pool
    n = x.shape[0] // (k * k)
    out = torch.zeros(n, x.shape[1], dtype=torch.float32, device=x.device)
    out.index_add_(0, groups.to(x.device), x.float())
    out = out / (k * k) * (cfg.dim ** 0.5)
    if cfg.standardize:
        out = (out - w["vision.std_bias"].float()) * w["vision.std_scale"].float()
    return out


def project(tokens: Tensor, w: dict, eps: float, ops, dtype: torch.dtype) -> Tensor:
    """Soft tokens -> text embeddings: scale-free RMSNorm then a linear map."""
    return ops.linear(ops.rms_norm(tokens.to(dtype), None, eps), w["embed_vision.embedding_projection.weight"])
