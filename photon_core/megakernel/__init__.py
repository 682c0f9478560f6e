"""The decode megakernel backend and the compiler that feeds it.

As an ops module (backends.select.get_backend("megakernel")) it offers the per-op Triton functions
(prefill, encoder and anything outside a decode step still run per op). The decode step itself is a
family's step graph (stepgraph.StepGraph), lowered by compiler.py to one persistent launch
(compiler.CompiledStep). Nothing in this package imports model code.
"""
from __future__ import annotations

from photon_core.backends.triton import (add_layer_norm, argmax, attention, causal_conv1d, decode_attention,
                                         gated_delta_chunk, gated_delta_step, glu, kv_append, layer_norm, linear,
                                         lstm_cell, moe, moe_route, rms_norm, rms_norm_gated, rotary, sample)
from photon_core.megakernel.checker import GraphError, check
from photon_core.megakernel.compiler import CompiledStep, Tiling, lower, plan
from photon_core.megakernel.graph import BATCH_BUCKETS, Task, TaskGraph, bucket_for
from photon_core.megakernel.eager import run_reference
from photon_core.megakernel.stepgraph import Rotary, StepGraph

NAME = "megakernel"
# contract.CAPABILITIES: the per-op Triton kernels above, and a family's step graph compiled to one launch.
CAPTURES_STEPS = True
COMPILES_STEPS = True

__all__ = ["NAME", "CAPTURES_STEPS", "COMPILES_STEPS", "linear", "layer_norm", "rms_norm", "rms_norm_gated",
           "add_layer_norm", "attention", "decode_attention", "rotary", "kv_append", "argmax", "sample", "glu", "moe_route", "moe",
           "causal_conv1d", "gated_delta_step", "gated_delta_chunk", "lstm_cell", "GraphError", "check", "Task", "TaskGraph", "Tiling",
           "CompiledStep", "StepGraph", "Rotary", "run_reference", "lower", "plan", "BATCH_BUCKETS",
           "bucket_for"]
