"""Gemma 4's decode on the megakernel: every decode step of every row is one launch of the step
graph compiled by photon_core.megakernel (decoder_step.py); the vision tower and each prompt's
prefill run on the per-op Triton kernels of the model's ops.

A Gemma4Model loaded with the "megakernel" backend holds one MegakernelDecode (`model.decode`);
BatchDecoder (decoding.py) takes a MegakernelStepper from it: the rows (up to 8) take slots of the
smallest batch bucket (1, 2, 4, 8) that holds them, each prompt is prefilled per op on its own KV
cache and copied into its slot of the compiled step's caches, and every later token is one launch
for all slots. Greedy rows take the in-kernel argmax; sampling rows the exposed logits (softcapped
on the host). A request longer than the compiled context (`max_len`) decodes per op instead.

When every row is greedy, the tokens after each row's first decode in rounds on the device
(`MegakernelStepper.rounds`, megakernel.decode_loop): the step's argmax advances each row's token and
position itself, so up to 8 launches (on CUDA one CUDA-graph replay) run per read of the device, and
no logits are read. Each bucket's DeviceDecode is built with its compiled step, before any request
writes the step's caches (on CUDA building it captures, so runs, the rounds).

One request or batch at a time per model (the compiled steps' arenas): a concurrent second call
raises instead of corrupting the first.
"""
from __future__ import annotations

from collections.abc import Collection, Iterator, Sequence
from typing import TYPE_CHECKING

import torch

from photon_core.megakernel.compiler import Tiling
from photon_core.runtime.decode import CompiledSteps, decode_length, require_triton_ops, resolve_weight_dtype

from . import text
from .decoder_step import Gemma4DecoderStep

if TYPE_CHECKING:
    from .decoding import Row
    from .model import Gemma4Model

DEFAULT_MAX_LEN = 4096   # compiled context: the full layers' caches are [bucket, Hkv, max_len, Dh] (bf16 on a GPU)


class MegakernelDecode(CompiledSteps[Gemma4DecoderStep]):
    """The compiled decode steps of one Gemma4Model, one per batch bucket, sharing one weights arena."""

    family = "A Gemma 4 model"

    def __init__(self, model: "Gemma4Model", tiling: Tiling = Tiling(), max_len: int | None = None,
                 weight_dtype: torch.dtype | None = None) -> None:
        """max_len: the compiled context (default min(model context, 4096)); weight_dtype: what
        each step streams, None = bfloat16 on CUDA (math stays fp32) and the model's dtype elsewhere."""
        require_triton_ops(model.ops, "Gemma 4", "load_gemma4")
        super().__init__(decode_length(max_len, model.config.text.max_context, DEFAULT_MAX_LEN),
                         resolve_weight_dtype(weight_dtype, model.dtype, model.device))
        self.model, self.tiling = model, tiling

    def build_step(self, batch: int, weights: torch.Tensor | None) -> Gemma4DecoderStep:
        m = self.model
        return Gemma4DecoderStep(m.w, m.config.text, batch, self.max_len, self.tiling, self.weight_dtype,
                                 weights=weights, barred=m.config.placeholder_ids, model_dtype=m.dtype)


class MegakernelStepper:
    """decoding.BatchDecoder's stepper on the compiled step: rows take slots 0..n-1 of the bucket;
    slots without a row decode the pad token at position 0 of their own caches."""

    def __init__(self, fm: MegakernelDecode, rows: int, max_len: int) -> None:
        fm.check_fits(rows, max_len)
        self.fm, self.rows, self.max_len = fm, rows, max_len
        self.mk = fm.for_rows(rows)
        self.loop = fm.loop(self.mk.batch)

    def prefill(self, b: int, row: "Row") -> torch.Tensor:
        """Row b's prompt per op on its own cache, copied into slot b: logits [vocab] after it."""
        m = self.fm.model
        one = text.KVCache(m.config.text, 1, self.max_len, m.dtype, m.device)
        logits = m.prefill(row.prompt, row.image, one)[0]
        self.mk.load_row(b, one)
        return logits

    def step(self, ids: list[int], pos: list[int]) -> tuple[torch.Tensor, list[int]]:
        """One launch: (logits [rows, vocab] softcapped, barred ids -inf; greedy tokens)."""
        pad = self.mk.batch - self.rows
        out = self.mk.step(ids + [self.fm.model.config.text.pad_id] * pad, pos + [0] * pad)
        return out.logits[:self.rows], out.tokens[:self.rows]

    def rounds(self, first: Sequence[int], positions: Sequence[int], max_new: Sequence[int],
               stop: Collection[int]) -> Iterator[tuple[int, int]]:
        """Greedy decode of every row in rounds on the device (DeviceDecode.stream): (row, token)
        pairs, each row's first token (the prefill's, fed at its position, the prompt length), then
        its next ones until a stop token (excluded) or its max_new tokens; a round's tokens step by
        step. The same tokens as `step` fed one per launch. Padding slots decode from the pad token
        at position 0 of their own caches. The rows' caches are spent afterwards (they decode on to
        the end of the last round)."""
        if len(first) != self.rows or len(positions) != self.rows or len(max_new) != self.rows:
            raise ValueError(f"need one first token, position and max_new per row ({self.rows})")
        if any(p + n - 1 > self.max_len for p, n in zip(positions, max_new)):
            raise ValueError(f"{max(max_new)} new tokens do not fit the rows' {self.max_len} positions")
        pad = self.mk.batch - self.rows
        # a row with no room (max_new 0) whose prompt fills the context still feeds its (unseen) first
        # token: at the last position, where the step's range check would refuse the one past it
        fed = [min(p, self.max_len - 1) for p in positions]
        self.mk.set_step(list(first) + [self.fm.model.config.text.pad_id] * pad, fed + [0] * pad)
        return self.loop.stream(first, max_new, stop)
