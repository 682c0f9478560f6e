"""Moondream 3's region head: Moondream 2's Fourier encoders, and linear decoders after a LayerNorm.

    coordinate logits = coord_head(LN(hidden))   [.., 1024 bins]      value = bin / 1023
    size logits       = size_head(LN(hidden))    [.., 2 x 1024 bins]  value = 2 ** (bin / 1023 * 10 - 10)

The coordinate's divisor is bins - 1 (the last bin is 1.0), as the makers' engine decodes it:
m87-labs/kestrel, kestrel/models/moondream/region.py `build_spatial_decode_tables`, a lookup table
linspace(0, 1, bins). Moondream 2's public code (and so Moondream 2 here) divides by bins. Every
decode path takes the divisor from the model's region module (`coord_divisor`): the host heads
below, and Moondream 2's megakernel heads / device rounds and segment's launches.

`hidden` is the decoder's last hidden state before post_ln (the region head has its own LayerNorm).
The encoders (coordinate / size -> next input embedding) are Moondream 2's, reused as they are.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from photon_core.models.moondream.region import (encode_coord, encode_coord_tensor, encode_coords, encode_size,  # noqa: F401
                                                 encode_size_tensor, encode_sizes)
from photon_core.models.moondream.region import encoder_weights, sizes_from_logits
from photon_core.models.moondream.vision import Linear, take
from photon_core.runtime.sampling import Sampling, check_finite, pick


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
        return cls(**encoder_weights(sd), ln=take(sd, "region.ln"), coord_head=take(sd, "region.coord_head"),
                   size_head=take(sd, "region.size_head"))


def coord_divisor(bins: int) -> int:
    """A coordinate bin's divisor: value = bin / coord_divisor(bins), in [0, 1] (module docstring)."""
    return bins - 1


def coord_logits(hidden: torch.Tensor, w: RegionWeights, ops) -> torch.Tensor:
    """Hidden states [n, dim] (before post_ln) -> coordinate logits [n, bins]."""
    return ops.linear(ops.layer_norm(hidden, *w.ln), *w.coord_head)


def size_logits(hidden: torch.Tensor, w: RegionWeights, ops) -> torch.Tensor:
    """Hidden states [n, dim] (before post_ln) -> size logits [n, 2 * bins] (width's, height's)."""
    return ops.linear(ops.layer_norm(hidden, *w.ln), *w.size_head)


def decode_coords(hidden: torch.Tensor, w: RegionWeights, ops) -> list[float]:
    """Hidden states [n, dim] (before post_ln) -> n coordinates in [0, 1]."""
    logits = coord_logits(hidden, w, ops)
    check_finite(logits, "coordinate logits")
    return [b / coord_divisor(logits.shape[-1]) for b in ops.argmax(logits).tolist()]


def decode_sizes(hidden: torch.Tensor, w: RegionWeights, ops) -> list[tuple[float, float]]:
    """Hidden states [n, dim] (before post_ln) -> n (width, height) pairs in (0, 1]."""
    return sizes_from_logits(size_logits(hidden, w, ops), hidden.shape[0], ops)


# A sampled request's coordinates and sizes: kestrel draws each bin from the region heads' logits
# with the request's temperature and top_p (scheduler/spatial.py compute_spatial_values), its
# argmax only at temperature 0. runtime.sampling.pick draws each here (its greedy rows: argmax).
def sample_coords(hidden: torch.Tensor, w: RegionWeights, ops, sampling: list[Sampling]) -> list[float]:
    """Hidden states [n, dim] (before post_ln) -> n coordinates, row i's bin drawn by sampling[i]."""
    logits = coord_logits(hidden, w, ops)
    return [pick(row, s, ops) / coord_divisor(logits.shape[-1]) for row, s in zip(logits, sampling)]


def sample_sizes(hidden: torch.Tensor, w: RegionWeights, ops, sampling: list[Sampling]) -> list[tuple[float, float]]:
    """Hidden states [n, dim] (before post_ln) -> n (width, height) pairs, row i's two bins drawn by
    sampling[i]; each bin's value by decode_sizes' rule (sizes_from_logits)."""
    logits = size_logits(hidden, w, ops).view(hidden.shape[0], 2, -1)
    bins = torch.tensor([[pick(row[0], s, ops), pick(row[1], s, ops)] for row, s in zip(logits, sampling)]).float()
    size = torch.pow(2.0, bins / 1023.0 * 10.0 - 10.0)
    return [(wd, ht) for wd, ht in size.tolist()]
