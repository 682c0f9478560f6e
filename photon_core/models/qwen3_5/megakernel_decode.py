"""Qwen 3.5's decode on the megakernel: every decode step is one launch of the step graph compiled by
photon_core.megakernel (decoder_step.py); the vision encoder and the prompt prefill run on the
per-op Triton kernels of the model's ops (the megakernel backend module re-exports them).

A Qwen35Model loaded with the "megakernel" backend holds one MegakernelDecode (`model.decode`) and
`model.step(ids, state)` goes through it, so generate.py's loops (streaming, sampling, batches of up
to 8 rows) run unchanged: the host picks each token from the exposed logits as on the per-op path.

Greedy requests (`greedy`, `stream_greedy`) decode in rounds on the device instead
(megakernel.decode_loop): the step's argmax feeds each row's next token and position itself, and the
host reads the tokens once per round of up to 8 (on CUDA one CUDA-graph replay), no logits.

A DecodeState is bound to the compiled step of the smallest bucket (1, 2, 4, 8) holding its rows on
its first step: its caches and states are copied into the bucket's arena (the conv state transposed
to the arena's channel-major layout) and its tensors become views of those rows, so later steps copy
nothing. A state whose rows change (DecodeState.keep) is bound again; a bucket's previous state gets
its own copies back before another state takes the rows, so interleaved requests stay correct.
"""
from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Collection, Iterator, Sequence
from typing import TYPE_CHECKING

import torch

from photon_core.megakernel.compiler import Tiling
from photon_core.megakernel.decode_loop import DeviceDecode
from photon_core.megakernel.graph import BATCH_BUCKETS, bucket_for

from . import text
from .decoder_step import Qwen35DecoderStep

if TYPE_CHECKING:
    from .model import Qwen35Model

# Compiled caches are per bucket and layer (bf16 on a GPU, fp32 on the CPU): the checkpoint's full context (262144 on the
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
        self._loops: dict[int, DeviceDecode] = {}
        self._owner: dict[int, weakref.ref] = {}
        self._lock = threading.Lock()

    def decoder(self, batch: int = 1) -> Qwen35DecoderStep:
        """The compiled step of one batch bucket, built on first use on the first bucket's weights."""
        if batch not in self._steps:
            shared = next(iter(self._steps.values())).weights if self._steps else None
            self._steps[batch] = Qwen35DecoderStep(self.model.text_w, self.model.config, batch, self.max_len,
                                                   self.tiling, self.weight_dtype, weights=shared)
            # With the step, before any state is bound to its rows: on CUDA it captures (runs) rounds.
            self._loops[batch] = DeviceDecode(self._steps[batch])
        return self._steps[batch]

    def _bind(self, state: text.DecodeState) -> Qwen35DecoderStep:
        """The bucket's step with `state` bound to its rows (call under self._lock)."""
        if state.batch > BATCH_BUCKETS[-1]:
            raise ValueError(f"{state.batch} rows exceed the largest megakernel batch ({BATCH_BUCKETS[-1]})")
        if state.max_len > self.max_len:
            raise ValueError(f"a request of {state.max_len} positions exceeds the megakernel's caches "
                             f"({self.max_len}); load the model with a larger max_len")
        bucket = bucket_for(state.batch)
        mk = self.decoder(bucket)
        if not mk.holds(state):
            ref = self._owner.get(bucket)
            owner = ref() if ref is not None else None
            if owner is not None and owner is not state and mk.holds(owner):
                mk.release(owner)
            with torch.no_grad():
                mk.load_state(state)
            self._owner[bucket] = weakref.ref(state)
        return mk

    def step(self, ids: torch.Tensor, state: text.DecodeState) -> torch.Tensor:
        """model.step on the megakernel: ids [B, 1] -> logits [B, V] (fp32); state.length advances."""
        with self._lock:   # one arena per bucket: steps on it run one at a time
            mk = self._bind(state)
            with torch.no_grad():
                return mk.step(ids, state)

    def stream_greedy(self, state: text.DecodeState, first: Sequence[int], max_new: Sequence[int],
                      stop: Collection[int]) -> Iterator[tuple[int, int]]:
        """Greedy tokens of every row of a prefilled state as (row, token) pairs, from each row's
        first token (chosen from the prefill's logits) until a stop token (excluded) or its max_new
        tokens; the same tokens as model.step fed one at a time. Each round holds the bucket; a
        request that used it in between is moved out and this state moved back. The state is spent
        afterwards (its rows decode on to the end of the last round)."""
        if state.batch != len(first) or state.batch != len(max_new):
            raise ValueError(f"need one first token and one max_new per row ({state.batch})")
        V = self.model.config.text.vocab_size
        if any(not 0 <= t < V for t in first):
            raise ValueError(f"token ids must be in [0, {V})")
        if any(n > 0 and length + n - 1 > state.max_len for length, n in zip(state.length.tolist(), max_new)):
            raise ValueError(f"new tokens {list(max_new)} do not fit the state's {state.max_len} positions "
                             f"after {state.length.tolist()}")
        with self._lock:
            loop = self._loops[self._bind(state).batch]

        @contextlib.contextmanager
        def each_round(tokens: list[int], n: int):
            with self._lock, torch.no_grad():
                mk = self._bind(state)
                pad = mk.batch - state.batch
                # Tokens and positions as this state left them (another request's steps may have
                # set others since); both are in range (prefill, and the kernel's own check).
                # (A row that stopped at the end of the caches has no valid position left; it is
                # done, so it decodes on from the last one.)
                last = mk.plan.max_position - 1
                mk.set_step(tokens, [min(p, last) for p in state.length.tolist()] + [0] * pad)
                mk.set_rotary_offsets(state.rope_delta.tolist() + [0] * pad)
                yield
                state.length += n
        yield from loop.stream(first, max_new, stop, each_round)

    def greedy(self, state: text.DecodeState, first: Sequence[int], max_new: Sequence[int],
               stop: Collection[int]) -> list[list[int]]:
        """stream_greedy's tokens as one list per row."""
        out: list[list[int]] = [[] for _ in first]
        for row, token in self.stream_greedy(state, first, max_new, stop):
            out[row].append(token)
        return out
