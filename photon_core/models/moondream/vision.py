"""SigLIP-style vision encoder, crop stitching and projection to the text model's 729 image tokens.

All math goes through `ops` (a backend module: linear, layer_norm, attention) so another backend
with the same function names computes the same thing.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from .config import VisionConfig

Linear = tuple[torch.Tensor, torch.Tensor]  # (weight [out, in], bias [out])


def take(sd: dict[str, torch.Tensor], name: str) -> Linear:
    return sd[name + ".weight"], sd[name + ".bias"]


@dataclass
class VisionBlock:
    ln1: Linear
    qkv: Linear
    proj: Linear
    ln2: Linear
    fc1: Linear
    fc2: Linear


@dataclass
class VisionWeights:
    patch_emb: Linear
    pos_emb: torch.Tensor  # [1, patches, enc_dim]
    blocks: list[VisionBlock]
    post_ln: Linear
    proj_fc1: Linear
    proj_fc2: Linear

    @classmethod
    def from_state(cls, sd: dict[str, torch.Tensor], cfg: VisionConfig) -> "VisionWeights":
        blocks = [VisionBlock(*(take(sd, f"vision.blocks.{i}.{n}") for n in
                                ("ln1", "attn.qkv", "attn.proj", "ln2", "mlp.fc1", "mlp.fc2")))
                  for i in range(cfg.enc_n_layers)]
        return cls(take(sd, "vision.patch_emb"), sd["vision.pos_emb"].reshape(1, -1, cfg.enc_dim), blocks,
                   take(sd, "vision.post_ln"), take(sd, "vision.proj_mlp.fc1"), take(sd, "vision.proj_mlp.fc2"))


def normalize(crops: np.ndarray | torch.Tensor, dtype: torch.dtype, device: torch.device | str,
              via: torch.dtype | None = torch.bfloat16) -> torch.Tensor:
    """uint8 [N, H, W, 3] RGB -> [N, 3, H, W] in [-1, 1] of `dtype`, the encoder's training normalisation.

    x / 255, - 0.5, / 0.5 computed in `via`, then cast to `dtype`: the public reference's
    prepare_crops computes it in bfloat16 whatever the model's dtype (Moondream 2: via=bfloat16, the
    default); kestrel computes it in the model's dtype (Moondream 3: via=None). The two differ by up
    to bfloat16's rounding (~4e-3), which a decoder turns into another word (image_crops.py's
    docstring). Each step on `device`, as both do, so the rounding is the device's."""
    x = (torch.from_numpy(crops) if isinstance(crops, np.ndarray) else crops).to(device).permute(0, 3, 1, 2)
    x = x.to(dtype if via is None else via).div_(255.0).sub_(0.5).div_(0.5)
    return x.to(dtype)


def patchify(x: torch.Tensor, patch: int) -> torch.Tensor:
    """[N, C, H, W] -> [N, (H/p)*(W/p), C*p*p], features ordered (channel, row, col) like the patch_emb weights."""
    n, c, h, w = x.shape
    x = x.reshape(n, c, h // patch, patch, w // patch, patch).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(n, (h // patch) * (w // patch), c * patch * patch)


def encode_crops(x: torch.Tensor, w: VisionWeights, cfg: VisionConfig, ops) -> torch.Tensor:
    """Normalised crops [N, 3, S, S] -> patch features [N, grid*grid, enc_dim] (after post_ln)."""
    x = ops.linear(patchify(x, cfg.enc_patch_size), *w.patch_emb) + w.pos_emb
    n, t, d = x.shape
    heads = cfg.enc_n_heads
    for b in w.blocks:
        h = ops.layer_norm(x, *b.ln1)
        q, k, v = ops.linear(h, *b.qkv).view(n, t, 3, heads, d // heads).permute(2, 0, 3, 1, 4)
        a = ops.attention(q, k, v).transpose(1, 2).reshape(n, t, d)
        x = ops.linear(a, *b.proj, residual=x)
        h = ops.linear(ops.layer_norm(x, *b.ln2), *b.fc1, activation="gelu_tanh")
        x = ops.linear(h, *b.fc2, residual=x)
    return ops.layer_norm(x, *w.post_ln)


def stitch(local: torch.Tensor, tiling: tuple[int, int], margin: int) -> torch.Tensor:
    """Local crop features [rows*cols, g, g, C] -> one feature map, each crop's overlap margins dropped
    except at the outer border (every position then comes from the crop that saw it most centrally)."""
    rows, cols = tiling
    g = local.shape[1]
    step = g - 2 * margin
    out = local.new_empty(step * rows + 2 * margin, step * cols + 2 * margin, local.shape[-1])
    for i in range(rows):
        y0 = 0 if i == 0 else margin
        y1 = g if i == rows - 1 else g - margin
        for j in range(cols):
            x0 = 0 if j == 0 else margin
            x1 = g if j == cols - 1 else g - margin
            out[i * step + y0:i * step + y1, j * step + x0:j * step + x1] = local[i * cols + j, y0:y1, x0:x1]
    return out


def project(features: torch.Tensor, tiling: tuple[int, int], w: VisionWeights, cfg: VisionConfig,
            ops) -> torch.Tensor:
    """Encoder output for [global, locals...] -> image tokens [grid*grid, text dim].

    The stitched local map is average-pooled back to grid x grid so the token count never depends on
    the image size; each token is [global feature, pooled local feature] through the projection MLP.
    """
    g, c = cfg.grid, cfg.enc_dim
    local = stitch(features[1:].view(-1, g, g, c), tiling, cfg.overlap_margin)
    pooled = F.adaptive_avg_pool2d(local.permute(2, 0, 1), (g, g)).permute(1, 2, 0).reshape(g * g, c)
    x = torch.cat([features[0], pooled], dim=-1)
    return ops.linear(ops.linear(x, *w.proj_fc1, activation="gelu_tanh"), *w.proj_fc2)
