"""Decoding rows of Gemma 4 text together: each row is one request (its prompt, optional image soft
tokens, limits and sampling), prefilled on its own, then joined into one batch cache where every
decode step is one batched forward for all rows still going (a stepper: OpsStepper here, or on
the megakernel backend megakernel_decode.MegakernelStepper, one launch of the compiled step).
When every row is greedy on the megakernel, the tokens after each row's first decode in rounds on
the device instead (MegakernelStepper.rounds: up to 8 launches per read, no logits read): the same
tokens, rows and stops; `run()` yields a round's tokens step by step (runtime.generate's loop)."""
from __future__ import annotations

from collections.abc import Collection, Iterator
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

from photon_core.runtime.batch_rows import row_generator
from photon_core.runtime.generate import generate, room
from photon_core.runtime.sampling import Sampling, pick, step_argmax

from . import text

if TYPE_CHECKING:
    from .model import Gemma4Model


@dataclass
class Row:
    prompt: list[int]
    image: torch.Tensor | None      # [n, dim] soft tokens in text-embedding space, or None
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    limit: int = 0                  # last usable position + 1
    tokens: list[int] = field(default_factory=list)
    done: bool = False


class BatchDecoder:
    def __init__(self, model: "Gemma4Model", rows: list[Row], seed: int | None = None,
                 device_rounds: bool = True, first_row: int = 0) -> None:
        """seed: the call's; row i (counted from `first_row`, its place in the call) draws from a
        generator of its own seeded seed + i (runtime.batch_rows.row_generator: its draws are the
        same whatever rows decode beside it); None: unseeded. device_rounds: greedy
        batches on the megakernel decode in rounds on the device (False: one launch per token, the
        host reading each token)."""
        cfg = model.config.text
        self.model, self.rows, self.device_rounds = model, rows, device_rounds
        self.sampling = [Sampling(r.max_tokens, r.temperature, r.top_p) for r in rows]
        for r in rows:
            if len(r.prompt) >= cfg.max_context:
                raise ValueError(f"prompt of {len(r.prompt)} tokens does not fit the context ({cfg.max_context})")
            r.limit = min(cfg.max_context, len(r.prompt) + r.max_tokens)
        self.max_len = max(r.limit for r in rows)
        self.gens = [row_generator(None if seed is None else seed + first_row + i) for i in range(len(rows))]
        self.allowed = torch.ones(cfg.vocab_size, dtype=torch.bool, device=model.device)
        self.allowed[list(model.config.placeholder_ids)] = False

    def _choose(self, b: int, logits: torch.Tensor, greedy: int | None = None) -> int:
        """Row b's next token; `greedy`: its argmax already taken (the megakernel's, under the same bar)."""
        s = self.sampling[b]
        if s.greedy and greedy is not None:
            return step_argmax(greedy)
        return pick(logits, s, self.model.ops, self.allowed, self.gens[b])

    def _stepper(self) -> "Stepper":
        fm = getattr(self.model, "decode", None)
        if fm is not None and fm.fits(len(self.rows), self.max_len):
            from .megakernel_decode import MegakernelStepper
            return MegakernelStepper(fm, len(self.rows), self.max_len)
        return OpsStepper(self.model, len(self.rows), self.max_len)

    def run(self) -> Iterator[list[int | None]]:
        """Yields, per decode step, each row's new token (None where the row produced nothing),
        recorded in the rows' tokens first. A row marked done between steps stops there."""
        fm = getattr(self.model, "decode", None)
        with fm.exclusive() if fm is not None else nullcontext():
            stepper = self._stepper()
            rooms = [room(r.max_tokens, len(r.prompt), r.limit) for r in self.rows]
            rounds = self.device_rounds and hasattr(stepper, "rounds")
            for new in generate(Session(self, stepper), self.sampling, rooms, self.model.eos_ids, self._choose,
                                canceled=lambda b: self.rows[b].done, device_rounds=rounds):
                for r, tok in zip(self.rows, new):
                    if tok is not None:
                        r.tokens.append(tok)
                yield new
        for r in self.rows:
            r.done = True


class Stepper(Protocol):
    """Rows' decode on one backend: OpsStepper below, megakernel_decode.MegakernelStepper (which
    also decodes greedy rows in rounds on the device)."""

    def prefill(self, b: int, row: Row) -> torch.Tensor: ...
    def step(self, ids: list[int], pos: list[int]) -> tuple[torch.Tensor, list[int] | None]: ...


class Session:
    """runtime.generate's session on a stepper's slots: every step feeds all of them (a slot
    whose row finished decodes the pad token at its last position)."""

    def __init__(self, dec: BatchDecoder, stepper: Stepper) -> None:
        self.dec, self.stepper = dec, stepper
        self.live = list(range(len(dec.rows)))
        self.pos = [len(r.prompt) for r in dec.rows]   # each slot's next input position

    def prefill(self) -> tuple[torch.Tensor, None]:
        return torch.stack([self.stepper.prefill(b, r) for b, r in enumerate(self.dec.rows)]), None

    def step(self, tokens: list[int]) -> tuple[torch.Tensor, list[int] | None]:
        ids = [self.dec.model.config.text.pad_id] * len(self.pos)
        for b, tok in zip(self.live, tokens):
            ids[b] = tok
        logits, greedy = self.stepper.step(ids, [min(p, self.dec.max_len - 1) for p in self.pos])
        for b in self.live:
            self.pos[b] += 1
        return logits[self.live], None if greedy is None else [greedy[b] for b in self.live]

    def keep(self, rows: list[int]) -> None:
        self.live = [self.live[i] for i in rows]

    def rounds(self, first: list[int], max_new: list[int], stop: Collection[int]) -> Iterator[tuple[int, int]]:
        rounds = getattr(self.stepper, "rounds", None)   # run() offers rounds only where it exists
        if rounds is None:
            raise RuntimeError("decoding in rounds needs the compiled steps (the megakernel backend)")
        return rounds(first, self.pos, max_new, stop)


class OpsStepper:
    """The per-op decode: each row prefilled on its own cache, then joined into one batch cache
    where each step is one batched forward of the model's ops."""

    def __init__(self, model: "Gemma4Model", rows: int, max_len: int) -> None:
        self.model, self.max_len = model, max_len
        self.cache = text.KVCache(model.config.text, rows, max_len, model.dtype, model.device)

    def prefill(self, b: int, row: Row) -> torch.Tensor:
        """Row b's prompt: logits [vocab] after it."""
        m = self.model
        one = text.KVCache(m.config.text, 1, self.max_len, m.dtype, m.device)
        logits = m.prefill(row.prompt, row.image, one)[0]
        self.cache.copy_row(b, one)
        return logits

    def step(self, ids: list[int], pos: list[int]) -> tuple[torch.Tensor, None]:
        m = self.model
        return m.step(torch.tensor(ids, device=m.device)[:, None], torch.tensor(pos, device=m.device), self.cache), None
