"""Per-op Triton backend: the functions of backends.reference, each dispatching to one kernel family.

Semantics (shapes, masks, tie rules) are exactly reference.py's; the extra functions (rms_norm,
add_layer_norm, kv_append, decode_attention, sample) are what a decode loop needs beyond them.
Get it through backends.select.get_backend, which refuses CPU tensors unless TRITON_INTERPRET=1.
"""
from __future__ import annotations

from photon_core.kernels.attention import attention, decode_attention
from photon_core.kernels.kv_cache import append as kv_append
from photon_core.kernels.linear import linear
from photon_core.kernels.norm import add_layer_norm, layer_norm, rms_norm
from photon_core.kernels.rotary import rotary
from photon_core.kernels.sampling import argmax, sample

NAME = "triton"

__all__ = ["NAME", "linear", "layer_norm", "rms_norm", "add_layer_norm", "attention", "decode_attention",
           "rotary", "kv_append", "argmax", "sample"]
