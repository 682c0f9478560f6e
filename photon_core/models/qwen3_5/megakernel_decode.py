"""Qwen 3.5's decode on the megakernel: every decode step is one launch of the step graph compiled by
photon_core.megakernel (decoder_step.py); the vision encoder and the prompt prefill run on the
per-op Triton kernels of the model's ops (the megakernel backend module re-exports them).

A Qwen35Model loaded with the "megakernel" backend holds one MegakernelDecode (`model.decode`) and
`model.step(ids, state)` goes through it, so generate.py's loops (streaming, sampling, batches of up
to 8 rows) run unchanged: the host picks each token from the exposed logits as on the per-op path.

A DecodeState is bound to the compiled step of the smallest bucket (1, 2, 4, 8) holding its rows on
its first step: its caches and states are copied into the bucket's arena (the conv state transposed
to the arena's channel-major layout) and its tensors become views of those rows, so later steps copy
nothing. A state whose rows change (DecodeState.keep) is bound again; a bucket's previous state gets
its own copies back before another state takes the rows, so interleaved requests stay correct.
"""
from __future__ import annotations

import threading
import weakref
from typing import TYPE_CHECKING

import torch

from photon_core.megakernel.compiler import Tiling
from photon_core.megakernel.graph import BATCH_BUCKETS, bucket_for

from . import text
from .decoder_step import Qwen35DecoderStep

if TYPE_CHECKING:
    from .model import Qwen35Model

# Compiled caches are fp32 per bucket and layer: the checkpoint's full context (262144 on the
# released models) would not fit; requests beyond this get a clear error (load with max_len=...).
DEFAULT_MAX_LEN = 8192


class MegakernelDecode:
    """The compiled decode steps of one Qwen35Model, one per batch bucket, sharing one weight arena."""

    def __init__(self, model: "Qwen35Model", tiling: Tiling = Tiling(), max_len: int | None = None,
                 weight_dtype: torch.dtype | None = None) -> None:
        """max_len: positions the compiled caches hold (default min(context, DEFAULT_MAX_LEN));
        weight_dtype: what each step streams, None = bfloat16 on CUDA (math stays fp32) and the
        model's dtype elsewhere."""
        if getattr(model.ops, "NAME", None) not in ("triton", "megakernel"):
            raise ValueError("the decode megakernel needs a Qwen35Model on the Triton ops "
                             "(load_qwen3_5(..., backend=get_backend('megakernel', device)))")
        ctx = model.config.text.max_context
        self.max_len = min(ctx, DEFAULT_MAX_LEN) if max_len is None else max_len
        if not 0 < self.max_len <= ctx:
            raise ValueError(f"max_len {self.max_len} must be in (0, {ctx}] (the model's context)")
        if weight_dtype is None:
            weight_dtype = torch.bfloat16 if model.device.type == "cuda" else model.dtype
        if weight_dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"megakernel weights must be float32, bfloat16 or float16, not {weight_dtype}")
        self.model, self.tiling, self.weight_dtype = model, tiling, weight_dtype
        self._steps: dict[int, Qwen35DecoderStep] = {}
        self._owner: dict[int, weakref.ref] = {}
        self._lock = threading.Lock()

    def decoder(self, batch: int = 1) -> Qwen35DecoderStep:
        """The compiled step of one batch bucket, built on first use on the first bucket's weights."""
        if batch not in self._steps:
            shared = next(iter(self._steps.values())).weights if self._steps else None
            self._steps[batch] = Qwen35DecoderStep(self.model.text_w, self.model.config, batch, self.max_len,
                                                   self.tiling, self.weight_dtype, weights=shared)
        return self._steps[batch]

    def step(self, ids: torch.Tensor, state: text.DecodeState) -> torch.Tensor:
        """model.step on the megakernel: ids [B, 1] -> logits [B, V] (fp32); state.length advances."""
        if state.batch > BATCH_BUCKETS[-1]:
            raise ValueError(f"{state.batch} rows exceed the largest megakernel batch ({BATCH_BUCKETS[-1]})")
        if state.max_len > self.max_len:
            raise ValueError(f"a request of {state.max_len} positions exceeds the megakernel's caches "
                             f"({self.max_len}); load the model with a larger max_len")
        bucket = bucket_for(state.batch)
        with self._lock:   # one arena per bucket: steps on it run one at a time
            mk = self.decoder(bucket)
            if not mk.holds(state):
                ref = self._owner.get(bucket)
                owner = ref() if ref is not None else None
                if owner is not None and owner is not state and mk.holds(owner):
                    mk.release(owner)
                with torch.no_grad():
                    mk.load_state(state)
                self._owner[bucket] = weakref.ref(state)
            with torch.no_grad():
                return mk.step(ids, state)
