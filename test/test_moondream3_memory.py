"""Moondream 3.1 fits a 16 GB GPU at a 4K context: the device bytes of the megakernel backend at
batch 1 (compiled step with FP8 experts, bf16 weights and KV caches of 4096 positions; the vision
encoder, token embeddings and region encoders held by the per-op paths; the largest transients),
computed from the real config's shapes without allocating anything."""
import math
import os

os.environ["TRITON_INTERPRET"] = "1"  # must precede the first import of triton (the kernels it defines)

import torch  # noqa: E402

from photon_core.megakernel.memory import format_bytes  # noqa: E402
from photon_core.models.moondream3.config import Moondream3Config  # noqa: E402
from photon_core.models.moondream3.memory import device_memory, load_memory  # noqa: E402


def test_moondream3_1_fits_16_gib_at_a_4k_context():
    cfg = Moondream3Config()          # 3.1's real sizes: 24 layers, 4 dense + 20 MoE of 64 experts, top 8
    t, m = cfg.text, cfg.text.moe
    assert (t.n_layers, m.start_layer, m.num_experts, m.experts_per_token, t.dim) == (24, 4, 64, 8, 2048)
    parts = device_memory(cfg, max_len=4096, batch=1)
    print("\nMoondream 3.1, megakernel backend, batch 1, 4096 positions:\n" + format_bytes(parts))
    moe_layers = t.n_layers - m.start_layer
    # experts stay FP8: one byte a weight (rows of 2048 and 1024 bytes need no padding)
    assert parts["step: weights fp8"] == moe_layers * m.num_experts * 3 * m.expert_inner_dim * t.dim
    assert parts["step: weights fp32"] == moe_layers * m.num_experts * (2 * m.expert_inner_dim + t.dim) * 4
    # bf16 K and V of every layer at 4096 positions
    assert parts["step: kv caches"] == 2 * t.n_layers * t.n_kv_heads * 4096 * (t.dim // t.n_heads) * 2
    # the text decoder is held once (the per-op prefill reads the arena); the vision tower is counted
    assert not any(k.startswith("per-op weights: text.blocks") for k in parts)
    assert parts["per-op weights: vision"] > 0.8e9 and parts["per-op weights: text.wte"] == t.vocab_size * t.dim * 2
    total = sum(parts.values())
    assert total < 16 * 2**30, format_bytes(parts)
    # ... where float experts (bf16) alone would not: the FP8 bytes are what makes it fit
    assert total + parts["step: weights fp8"] > 16 * 2**30


def test_moondream3_1_load_peak_at_a_4k_context():
    """The device's peak while loading on the megakernel backend (load_memory: the checkpoint read
    to the CPU, the arena filled on the device tensor by tensor): what stays resident plus one
    tensor in transit, the largest being an FP8 gate|up expert table of a layer; measured on a
    reduced model in test_moondream3_load_memory.py."""
    cfg = Moondream3Config()
    t, m = cfg.text, cfg.text.moe
    load = load_memory(cfg, max_len=4096, batch=1)
    run = device_memory(cfg, max_len=4096, batch=1)
    print("\nMoondream 3.1, megakernel backend, batch 1, 4096 positions, peak while loading:\n" + format_bytes(load))
    assert load["load: one tensor in transit"] == m.num_experts * 2 * m.expert_inner_dim * t.dim   # FP8 bytes
    resident = sum(load.values()) - load["load: one tensor in transit"]
    assert resident == sum(v for k, v in run.items() if not k.startswith(("prefill: ", "vision: ")))
    assert sum(load.values()) < 16 * 2**30
