"""Region module: turns decoder hidden states into coordinates/sizes and encodes them back as inputs.

Values are binned: coordinate = argmax bin / n_bins (the public reference's rule), size per axis =
2 ** (bin / 1023 * 10 - 10), i.e. log-spaced from 1/1024 to 1 of the image side.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TypedDict

import torch

from photon_core.runtime.sampling import check_finite

from .vision import Linear, take


@dataclass
class RegionWeights:
    coord_features: torch.Tensor  # [1, coord_feat_dim/2] Fourier frequencies
    coord_encoder: Linear
    coord_fc1: Linear
    coord_fc2: Linear
    size_features: torch.Tensor   # [2, size_feat_dim/2]
    size_encoder: Linear
    size_fc1: Linear
    size_fc2: Linear

    @classmethod
    def from_state(cls, sd: dict[str, torch.Tensor]) -> "RegionWeights":
        return cls(**encoder_weights(sd), coord_fc1=take(sd, "region.coord_decoder.fc1"),
                   coord_fc2=take(sd, "region.coord_decoder.fc2"), size_fc1=take(sd, "region.size_decoder.fc1"),
                   size_fc2=take(sd, "region.size_decoder.fc2"))


class EncoderWeights(TypedDict):
    """The Fourier encoders' fields, shared by Moondream 2's and Moondream 3's RegionWeights."""
    coord_features: torch.Tensor
    coord_encoder: Linear
    size_features: torch.Tensor
    size_encoder: Linear


def encoder_weights(sd: dict[str, torch.Tensor]) -> EncoderWeights:
    """The Fourier encoders' fields of a RegionWeights (Moondream 3's region head has the same)."""
    return EncoderWeights(coord_features=sd["region.coord_features"], coord_encoder=take(sd, "region.coord_encoder"),
                size_features=sd["region.size_features"], size_encoder=take(sd, "region.size_encoder"))


def fourier(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    f = 2 * math.pi * (x @ freqs)
    return torch.cat([f.cos(), f.sin()], dim=-1)


def encode_coord(value: float, w: RegionWeights, ops) -> torch.Tensor:
    """One coordinate in [0, 1] -> an input embedding [1, 1, dim]."""
    return encode_coords([value], w, ops)


def encode_coords(values: list[float], w: RegionWeights, ops) -> torch.Tensor:
    """n coordinates in [0, 1] -> input embeddings [n, 1, dim] (one per request of a batch)."""
    return encode_coord_tensor(torch.tensor(values, dtype=w.coord_features.dtype, device=w.coord_features.device),
                               w, ops)


def encode_coord_tensor(x: torch.Tensor, w: RegionWeights, ops) -> torch.Tensor:
    """encode_coords of a device tensor [n] (no host values: capturable)."""
    return ops.linear(fourier(x[:, None, None], w.coord_features), *w.coord_encoder)


def encode_size(width: float, height: float, w: RegionWeights, ops) -> torch.Tensor:
    """(width, height) in [0, 1] -> an input embedding [1, 1, dim]."""
    return encode_sizes([(width, height)], w, ops)


def encode_sizes(sizes: list[tuple[float, float]], w: RegionWeights, ops) -> torch.Tensor:
    """n (width, height) pairs in [0, 1] -> input embeddings [n, 1, dim]."""
    return encode_size_tensor(torch.tensor(sizes, dtype=w.size_features.dtype, device=w.size_features.device),
                              w, ops)


def encode_size_tensor(x: torch.Tensor, w: RegionWeights, ops) -> torch.Tensor:
    """encode_sizes of a device tensor [n, 2] (no host values: capturable)."""
    return ops.linear(fourier(x[:, None], w.size_features), *w.size_encoder)


def decode_coords(hidden: torch.Tensor, w: RegionWeights, ops) -> list[float]:
    """Hidden states [n, dim] (before post_ln) -> n coordinates in [0, 1)."""
    return coords_from_logits(ops.linear(ops.linear(hidden, *w.coord_fc1, activation="gelu_tanh"), *w.coord_fc2),
                              ops)


def decode_sizes(hidden: torch.Tensor, w: RegionWeights, ops) -> list[tuple[float, float]]:
    """Hidden states [n, dim] (before post_ln) -> n (width, height) pairs in (0, 1]."""
    return sizes_from_logits(ops.linear(ops.linear(hidden, *w.size_fc1, activation="gelu_tanh"), *w.size_fc2),
                             hidden.shape[0], ops)


def coord_divisor(bins: int) -> int:
    """A coordinate bin's divisor, value = bin / coord_divisor(bins): bins, the public reference's
    rule (Moondream 3.1's region module has its own); the device decode paths read it through the
    model's region_impl."""
    return bins


def coords_from_logits(logits: torch.Tensor, ops) -> list[float]:
    """Coordinate logits [n, bins] -> n values argmax bin / bins."""
    check_finite(logits, "coordinate logits")
    return [b / logits.shape[-1] for b in ops.argmax(logits).tolist()]


def sizes_from_logits(logits: torch.Tensor, n: int, ops) -> list[tuple[float, float]]:
    """Size logits [n, 2 * bins] -> n (width, height) pairs, 2 ** (bin / 1023 * 10 - 10) per axis."""
    check_finite(logits, "size logits")
    bins = ops.argmax(logits.view(n, 2, -1)).float()
    size = torch.pow(2.0, bins / 1023.0 * 10.0 - 10.0)
    return [(wd, ht) for wd, ht in size.tolist()]
