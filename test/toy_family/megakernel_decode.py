"""The toy Llama's decode on the megakernel: prompts are prefilled per-op (the megakernel backend's
Triton kernels) into a temporary cache whose K/V are copied into their rows of the bucket's compiled
step; then each token is one launch of decoder_step's graph, greedy rows in rounds on the device."""
from __future__ import annotations

from collections.abc import Collection, Iterator, Sequence
from typing import TYPE_CHECKING

import torch

from photon_core.megakernel.compiler import Tiling
from photon_core.runtime.decode import CompiledSteps, copy_prefilled_kv, decode_length, resolve_weight_dtype

from .decoder_step import ToyStep, gather_weights

if TYPE_CHECKING:
    from .model import ToyLlama

# Few, large tiles: right for a model this small (and the interpreter's cost is per task).
TILING = Tiling(block_n=512, block_k=64, block_t=32, self_splits=1, cross_splits=1)


class MegakernelDecode(CompiledSteps[ToyStep]):
    family = "A toy Llama model"

    def __init__(self, model: "ToyLlama") -> None:
        super().__init__(decode_length(model.max_len, model.config.max_positions),
                         resolve_weight_dtype(None, model.dtype, model.device))
        self.model = model
        self._weights = gather_weights(model, self.max_len)

    def build_step(self, batch: int, weights: torch.Tensor | None) -> ToyStep:
        return ToyStep(self._weights, self.model.config, batch, self.max_len, TILING, self.weight_dtype,
                       shared_weights=weights)

    def session(self, prompts: Sequence[Sequence[int]]) -> "StepSession":
        """The prompts prefilled into the rows of the smallest bucket holding them (call under
        `exclusive()`)."""
        self.check_fits(len(prompts), max(len(p) for p in prompts))
        model, step = self.model, self.for_rows(len(prompts))
        tmp = model.new_cache(len(prompts), self.max_len)
        first = torch.stack([model.prefill(p, tmp, r) for r, p in enumerate(prompts)])
        copy_prefilled_kv(step, ("kcache", "vcache"), list(zip(tmp.k, tmp.v)), slice(0, len(prompts)))
        return StepSession(self, step, first, [len(p) for p in prompts])


class StepSession:
    """runtime.generate's session on a compiled step: `step` launches it once with the host's
    tokens (sampled rows); `rounds` leaves greedy rows to the device. Padding and finished rows
    run at position 0 of their own row, which no live row reads."""

    def __init__(self, decode: MegakernelDecode, step: ToyStep, first: torch.Tensor, lengths: list[int]) -> None:
        self.decode, self.mk, self.first = decode, step, first
        self.pos = lengths + [0] * (step.batch - len(lengths))   # each row's next position
        self.live = list(range(len(lengths)))

    def prefill(self) -> tuple[torch.Tensor, None]:
        return self.first, None

    def step(self, tokens: list[int]) -> tuple[torch.Tensor, None]:
        feed = [0] * self.mk.batch
        for r, tok in zip(self.live, tokens):
            feed[r] = tok
        self.mk.set_step(feed, self.pos)
        self.mk.launch()
        for r in self.live:
            self.pos[r] += 1
        return self.mk.view("logits")[self.live].clone(), None

    def keep(self, rows: list[int]) -> None:
        live = [self.live[i] for i in rows]
        for r in set(self.live) - set(live):
            self.pos[r] = 0   # a finished row's next position may lie past the cache
        self.live = live

    def rounds(self, first: list[int], max_new: list[int], stop: Collection[int]) -> Iterator[tuple[int, int]]:
        self.mk.set_step(first + [0] * (self.mk.batch - len(first)), self.pos)
        return self.decode.loop(self.mk.batch).stream(first, max_new, stop)
