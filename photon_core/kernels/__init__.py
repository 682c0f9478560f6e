"""Triton kernels, one module per family (norm, linear, rotary, kv_cache, attention, sampling).

Importing this package imports triton; backends.select decides whether that is allowed (CUDA, or the
CPU interpreter under TRITON_INTERPRET=1).
"""
from __future__ import annotations

import os

import torch

# Version differences (the interpreter fix for Triton < 3.7) apply before any kernel is defined.
from photon_core.kernels import triton_versions  # noqa: F401

# Tests set this so that every output buffer starts as NaN (ints: -1): an element a kernel forgets
# to write then fails the comparison instead of passing on leftover memory.
POISON_OUTPUTS: bool = os.environ.get("PHOTON_POISON_OUTPUTS", "0") == "1"


def new_output(shape: tuple[int, ...] | torch.Size, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    if not POISON_OUTPUTS:
        return torch.empty(shape, device=device, dtype=dtype)
    fill = float("nan") if dtype.is_floating_point else -1
    return torch.full(shape, fill, device=device, dtype=dtype)
