"""The decode megakernel backend.

As an ops module (backends.select.get_backend("megakernel")) it offers the per-op Triton functions
(prefill, encoder and anything outside a decode graph still run per op) plus the decode-step builders:
`WhisperDecoderMegakernel` runs Whisper's whole decoder step as one persistent launch.
"""
from __future__ import annotations

from photon_core.backends.triton import (add_layer_norm, argmax, attention, decode_attention, kv_append, layer_norm,
                                         linear, rms_norm, rotary, sample)
from photon_core.megakernel.checker import GraphError, check
from photon_core.megakernel.graph import BATCH_BUCKETS, Task, TaskGraph, bucket_for
from photon_core.megakernel.whisper_decoder import Tiling, WhisperDecoderMegakernel, WhisperDecoderWeights, build_graph

NAME = "megakernel"

__all__ = ["NAME", "linear", "layer_norm", "rms_norm", "add_layer_norm", "attention", "decode_attention",
           "rotary", "kv_append", "argmax", "sample", "GraphError", "check", "Task", "TaskGraph", "Tiling",
           "WhisperDecoderMegakernel", "WhisperDecoderWeights", "build_graph", "BATCH_BUCKETS", "bucket_for"]
