"""Per-op Triton backend: every op of the contract (backends/contract.py), each dispatching to one
kernel family in photon_core/kernels.

Semantics (shapes, masks, tie rules, memory never read) are exactly backends/reference.py's; some
functions take extra trailing tiling/check keywords (decode_attention's num_splits and block_t,
kv_append's check). Get it through backends.select.get_backend, which refuses CPU tensors unless
TRITON_INTERPRET=1.
"""
from __future__ import annotations

# linear and attention: for many rows, our kernel or torch's by measurement on the GPU (fastest.py)
from photon_core.backends.fastest import attention, linear
from photon_core.kernels.attention import decode_attention
from photon_core.kernels.conv import causal_conv1d
from photon_core.kernels.delta_rule import gated_delta_chunk, gated_delta_step
from photon_core.kernels.glu import glu
from photon_core.kernels.kv_cache import append as kv_append
from photon_core.kernels.lstm import lstm_cell
from photon_core.kernels.moe import moe, moe_route
from photon_core.kernels.norm import add_layer_norm, layer_norm, rms_norm, rms_norm_gated
from photon_core.kernels.rotary import rotary
from photon_core.kernels.sampling import argmax, sample

NAME = "triton"
# contract.CAPABILITIES: kernels launched on device tensors only (positions, lengths), so a step
# of them replays as one CUDA graph; no compiled steps.
CAPTURES_STEPS = True
COMPILES_STEPS = False

__all__ = ["NAME", "CAPTURES_STEPS", "COMPILES_STEPS", "linear", "layer_norm", "rms_norm", "rms_norm_gated",
           "add_layer_norm", "glu", "attention", "decode_attention", "kv_append", "rotary", "argmax", "sample", "moe_route", "moe", "causal_conv1d",
           "gated_delta_step", "gated_delta_chunk", "lstm_cell"]
