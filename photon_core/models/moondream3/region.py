"""Moondream 3's region head: Moondream 2's Fourier encoders, and linear decoders after a LayerNorm.

    coordinate logits = coord_head(LN(hidden))   [.., 1024 bins]      value = bin / 1024
    size logits       = size_head(LN(hidden))    [.., 2 x 1024 bins]  value = 2 ** (bin / 1023 * 10 - 10)

`hidden` is the decoder's last hidden state before post_ln (the region head has its own LayerNorm).
The encoders (coordinate / size -> next input embedding) are Moondream 2's, reused as they are.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from photon_core.models.moondream.region import encode_coord, encode_coords, encode_size, encode_sizes  # noqa: F401
from photon_core.models.moondream.vision import Linear, take


@dataclass
class RegionWeights:
    coord_features: torch.Tensor  # [1, coord_feat_dim/2]
    coord_encoder: Linear
    size_features: torch.Tensor   # [2, size_feat_dim/2]
    size_encoder: Linear
    ln: Linear
    coord_head: Linear
    size_head: Linear

    @classmethod
    def from_state(cls, sd: dict[str, torch.Tensor]) -> "RegionWeights":
        return cls(sd["region.coord_features"], take(sd, "region.coord_encoder"),
                   sd["region.size_features"], take(sd, "region.size_encoder"),
                   take(sd, "region.ln"), take(sd, "region.coord_head"), take(sd, "region.size_head"))


def decode_coords(hidden: torch.Tensor, w: RegionWeights, ops) -> list[float]:
    """Hidden states [n, dim] (before post_ln) -> n coordinates in [0, 1)."""
    logits = ops.linear(ops.layer_norm(hidden, *w.ln), *w.coord_head)
    return [b / logits.shape[-1] for b in ops.argmax(logits).tolist()]


def decode_sizes(hidden: torch.Tensor, w: RegionWeights, ops) -> list[tuple[float, float]]:
    """Hidden states [n, dim] (before post_ln) -> n (width, height) pairs in (0, 1]."""
    logits = ops.linear(ops.layer_norm(hidden, *w.ln), *w.size_head)
    bins = ops.argmax(logits.view(hidden.shape[0], 2, -1)).float()
    size = torch.pow(2.0, bins / 1023.0 * 10.0 - 10.0)
    return [(wd, ht) for wd, ht in size.tolist()]
