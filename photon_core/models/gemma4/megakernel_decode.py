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

import threading
from collections.abc import Collection, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch

from photon_core.megakernel.compiler import Tiling
from photon_core.megakernel.decode_loop import DeviceDecode
from photon_core.megakernel.graph import BATCH_BUCKETS, bucket_for

from . import text
from .decoder_step import Gemma4DecoderStep

if TYPE_CHECKING:
    from .decoding import Row
    from .model import Gemma4Model

DEFAULT_MAX_LEN = 4096   # compiled context: the full layers' caches are [bucket, Hkv, max_len, Dh] (bf16 on a GPU)


class MegakernelDecode:
    """The compiled decode steps of one Gemma4Model, one per batch bucket, sharing one weights arena."""

    max_rows = BATCH_BUCKETS[-1]

    def __init__(self, model: "Gemma4Model", tiling: Tiling = Tiling(), max_len: int | None = None,
                 weight_dtype: torch.dtype | None = None) -> None:
        """max_len: the compiled context (default min(model context, 4096)); weight_dtype: what
        each step streams, None = bfloat16 on CUDA (math stays fp32) and the model's dtype elsewhere."""
        if getattr(model.ops, "NAME", None) not in ("triton", "megakernel"):
            raise ValueError("the Gemma 4 decode megakernel needs a model on the Triton ops "
                             "(load_gemma4(..., backend=get_backend('megakernel', device)))")
        cfg = model.config.text
        self.model, self.tiling = model, tiling
        self.max_len = min(cfg.max_context, max_len or DEFAULT_MAX_LEN)
        if weight_dtype is None:
            weight_dtype = torch.bfloat16 if model.device.type == "cuda" else model.dtype
        if weight_dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"megakernel weights must be float32, bfloat16 or float16, not {weight_dtype}")
        self.weight_dtype = weight_dtype
        self._steps: dict[int, Gemma4DecoderStep] = {}
        self._loops: dict[int, DeviceDecode] = {}
        self._busy = threading.Lock()

    def decoder(self, batch: int) -> Gemma4DecoderStep:
        """The compiled step of one batch bucket, built on first use (every bucket shares the
        first one's weights arena)."""
        if batch not in self._steps:
            m = self.model
            shared = next(iter(self._steps.values())).weights if self._steps else None
            self._steps[batch] = Gemma4DecoderStep(
                m.w, m.config.text, batch, self.max_len, self.tiling, self.weight_dtype, weights=shared,
                barred=m.config.placeholder_ids, model_dtype=m.dtype)
            # With the step, before any row is loaded into its caches: on CUDA it captures (runs) rounds.
            self._loops[batch] = DeviceDecode(self._steps[batch])
        return self._steps[batch]

    def loop(self, batch: int) -> DeviceDecode:
        """The greedy rounds of one batch bucket's compiled step (built with it)."""
        self.decoder(batch)
        return self._loops[batch]

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        if not self._busy.acquire(blocking=False):
            raise RuntimeError("a Gemma 4 model on the megakernel decodes one request or batch at a time (its "
                               "compiled steps' arenas); finish or close the running one (e.g. a stream) first")
        try:
            yield
        finally:
            self._busy.release()

    def fits(self, rows: int, max_len: int) -> bool:
        return rows <= self.max_rows and max_len <= self.max_len


class MegakernelStepper:
    """decoding.BatchDecoder's stepper on the compiled step: rows take slots 0..n-1 of the bucket;
    slots without a row decode the pad token at position 0 of their own caches."""

    def __init__(self, fm: MegakernelDecode, rows: int, max_len: int) -> None:
        if not fm.fits(rows, max_len):
            raise ValueError(f"{rows} rows of up to {max_len} positions do not fit the compiled step "
                             f"({fm.max_rows} rows, {fm.max_len} positions)")
        self.fm, self.rows, self.max_len = fm, rows, max_len
        self.mk = fm.decoder(bucket_for(rows))
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
        self.mk.set_step(list(first) + [self.fm.model.config.text.pad_id] * pad, list(positions) + [0] * pad)
        return self.loop.stream(first, max_new, stop)
