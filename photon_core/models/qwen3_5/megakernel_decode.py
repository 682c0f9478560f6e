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
from collections.abc import Collection, Iterator, Sequence
from typing import TYPE_CHECKING

import torch

from photon_core.megakernel.compiler import Tiling
from photon_core.runtime.decode import CompiledSteps, decode_length, require_triton_ops, resolve_weight_dtype

from . import text
from .decoder_step import Qwen35DecoderStep

if TYPE_CHECKING:
    from .model import Qwen35Model

# Compiled caches are per bucket and layer (bf16 on a GPU, fp32 on the CPU): the checkpoint's full context (262144 on the
# released models) would not fit; requests beyond this get a clear error (load with max_len=...).
DEFAULT_MAX_LEN = 8192


class MegakernelDecode(CompiledSteps[Qwen35DecoderStep]):
    """The compiled decode steps of one Qwen35Model, one per batch bucket, sharing one weight arena."""

    family = "A Qwen 3.5 model"

    def __init__(self, model: "Qwen35Model", tiling: Tiling = Tiling(), max_len: int | None = None,
                 weight_dtype: torch.dtype | None = None) -> None:
        """max_len: positions the compiled caches hold (default min(context, DEFAULT_MAX_LEN));
        weight_dtype: what each step streams, None = bfloat16 on CUDA (math stays fp32) and the
        model's dtype elsewhere."""
        require_triton_ops(model.ops, "Qwen 3.5", "load_qwen3_5")
        super().__init__(decode_length(max_len, model.config.text.max_context, DEFAULT_MAX_LEN),
                         resolve_weight_dtype(weight_dtype, model.dtype, model.device))
        self.model, self.tiling = model, tiling

    def build_step(self, batch: int, weights: torch.Tensor | None) -> Qwen35DecoderStep:
        return Qwen35DecoderStep(self.model.text_w, self.model.config, batch, self.max_len,
                                 self.tiling, self.weight_dtype, weights=weights)

    def _bind(self, state: text.DecodeState) -> Qwen35DecoderStep:
        """The bucket's step with `state` bound to its rows (call inside self.turn())."""
        return self.bind(state, state.batch, state.max_len)

    def step(self, ids: torch.Tensor, state: text.DecodeState) -> torch.Tensor:
        """model.step on the megakernel: ids [B, 1] -> logits [B, V] (fp32); state.length advances."""
        with self.turn():   # one arena per bucket: steps on it run one at a time
            mk = self._bind(state)
            with torch.no_grad():
                return mk.step(ids, state)

    def keep(self, state: text.DecodeState, rows: list[int]) -> None:
        """state.keep(rows) in the arena's turn: a bound state's tensors are views of its bucket's
        rows, and another thread's state bound there meanwhile (bind, in its turn) would be copied
        into them while `keep` still reads them: this state's rows would take the other's caches."""
        with self.turn():
            state.keep(rows)

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
        with self.turn():
            loop = self.loop(self._bind(state).batch)

        @contextlib.contextmanager
        def each_round(tokens: list[int], n: int):
            with self.turn(), torch.no_grad():
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
