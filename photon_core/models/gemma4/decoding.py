"""Decoding rows of Gemma 4 text together: each row is one request (its prompt, optional image soft
tokens, limits and sampling), prefilled on its own, then joined into one batch cache where every
decode step is one batched forward for all rows still going (a stepper: OpsStepper here, or on
the megakernel backend megakernel_decode.MegakernelStepper, one launch of the compiled step).
When every row is greedy on the megakernel, the tokens after each row's first decode in rounds on
the device instead (MegakernelStepper.rounds: up to 8 launches per read, no logits read): the same
tokens, rows and stops; `run()` yields a round's tokens step by step."""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from . import text

if TYPE_CHECKING:
    from .megakernel_decode import MegakernelStepper
    from .model import Gemma4Model


@dataclass
class Row:
    prompt: list[int]
    image: torch.Tensor | None      # [n, dim] soft tokens in text-embedding space, or None
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    limit: int = 0                  # last usable position + 1
    pos: int = 0                    # position of the next input token
    tokens: list[int] = field(default_factory=list)
    done: bool = False


def check_sampling(max_tokens: int, temperature: float, top_p: float) -> None:
    if max_tokens < 0 or temperature < 0 or not 0 < top_p <= 1:
        raise ValueError(f"need max_tokens >= 0, temperature >= 0 and 0 < top_p <= 1 "
                         f"(got {max_tokens}, {temperature}, {top_p})")


class BatchDecoder:
    def __init__(self, model: "Gemma4Model", rows: list[Row], seed: int | None = None,
                 device_rounds: bool = True) -> None:
        """device_rounds: greedy batches on the megakernel decode in rounds on the device (False:
        one launch per token, the host reading each token)."""
        cfg = model.config.text
        self.model, self.rows, self.device_rounds = model, rows, device_rounds
        for r in rows:
            check_sampling(r.max_tokens, r.temperature, r.top_p)
            if len(r.prompt) >= cfg.max_context:
                raise ValueError(f"prompt of {len(r.prompt)} tokens does not fit the context ({cfg.max_context})")
            r.limit = min(cfg.max_context, len(r.prompt) + r.max_tokens)
            r.pos = len(r.prompt)
        self.max_len = max(r.limit for r in rows)
        self.gen = torch.Generator(device="cpu")
        if seed is not None:
            self.gen.manual_seed(seed)
        else:
            self.gen.seed()
        self.allowed = torch.ones(cfg.vocab_size, dtype=torch.bool, device=model.device)
        self.allowed[list(model.config.placeholder_ids)] = False

    def _choose(self, r: Row, logits: torch.Tensor, greedy: int | None = None) -> int:
        """`greedy`: the row's argmax already taken (the megakernel's, under the same bar)."""
        ops = self.model.ops
        if r.temperature == 0:
            return greedy if greedy is not None else int(ops.argmax(logits, self.allowed))
        masked = logits.float().masked_fill(~self.allowed, float("-inf"))
        u = torch.rand(1, generator=self.gen).to(logits.device)
        return int(ops.sample(masked[None], r.temperature, r.top_p, u)[0])

    def _accept(self, r: Row, tok: int) -> bool:
        """Record the token; False once the row is finished."""
        if tok in self.model.eos_ids:
            r.done = True
            return False
        r.tokens.append(tok)
        if len(r.tokens) >= r.max_tokens or r.pos >= r.limit:
            r.done = True
        return True

    def _stepper(self) -> "OpsStepper":
        fm = getattr(self.model, "decode", None)
        if fm is not None and fm.fits(len(self.rows), self.max_len):
            from .megakernel_decode import MegakernelStepper
            return MegakernelStepper(fm, len(self.rows), self.max_len)
        return OpsStepper(self.model, len(self.rows), self.max_len)

    def run(self) -> Iterator[list[int | None]]:
        """Yields, per decode round, each row's new token (None where the row produced nothing)."""
        fm = getattr(self.model, "decode", None)
        with fm.exclusive() if fm is not None else nullcontext():
            yield from self._run(self._stepper())

    def _run(self, stepper: "OpsStepper") -> Iterator[list[int | None]]:
        m = self.model
        last = []
        for b, r in enumerate(self.rows):
            last.append(stepper.prefill(b, r))
            if r.max_tokens == 0:
                r.done = True
        if self.device_rounds and hasattr(stepper, "rounds") and all(r.temperature == 0 for r in self.rows):
            yield from self._run_rounds(stepper, last)
            return
        logits, greedy = torch.stack(last), None
        while True:
            new: list[int | None] = []
            for b, r in enumerate(self.rows):
                new.append(self._choose(r, logits[b], None if greedy is None else greedy[b]) if not r.done else None)
                if new[-1] is not None and not self._accept(r, new[-1]):
                    new[-1] = None
            if any(t is not None for t in new):
                yield new
            if all(r.done for r in self.rows):
                return
            ids = [t if t is not None else m.config.text.pad_id for t in new]
            logits, greedy = stepper.step(ids, [min(r.pos, self.max_len - 1) for r in self.rows])
            for r in self.rows:
                if not r.done:
                    r.pos += 1

    def _run_rounds(self, stepper: "MegakernelStepper", last: list[torch.Tensor]) -> Iterator[list[int | None]]:
        """_run's tokens for greedy rows, decoded in rounds on the device. Each row's first token
        comes from its prefill's logits as in _run; the device then decodes up to max_new tokens
        in all: _accept finishes a row of prompt length P after its k-th token (k >= 1, taken at
        position P + k - 1) once k >= max_tokens or P + k - 1 >= limit, so
        max_new = min(max_tokens, limit - P + 1); a stop token ends it sooner (not recorded).
        The loop yields (row, token) pairs step by step; a step's list goes out once every row
        still going has its token, or once a later step's token (or the end) shows that the rows
        without one stopped."""
        pad = self.model.config.text.pad_id
        max_new = [0 if r.done else min(r.max_tokens, r.limit - r.pos + 1) for r in self.rows]
        first = [self._choose(r, logits) if n else pad for r, logits, n in zip(self.rows, last, max_new)]
        pending: dict[int, int] = {}
        step = 0          # the step (0: the first tokens) of the pending tokens

        def flush() -> list[int | None]:
            for b, r in enumerate(self.rows):
                if b not in pending:
                    r.done = True    # still going before this step and no token: a stop token
            new = [pending.get(b) for b in range(len(self.rows))]
            pending.clear()
            return new

        for b, tok in stepper.rounds(first, [r.pos for r in self.rows], max_new, self.model.eos_ids):
            r = self.rows[b]
            if pending and len(r.tokens) != step:
                yield flush()
            step = len(r.tokens)
            if step:
                r.pos += 1
            r.tokens.append(tok)
            pending[b] = tok
            if len(r.tokens) == max_new[b]:
                r.done = True
            if all(row.done or i in pending for i, row in enumerate(self.rows)):
                yield flush()
        if pending:
            yield flush()
        for r in self.rows:
            r.done = True


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


def text_pieces(decode, tokens: Iterator[int]) -> Iterator[str]:
    """The decoded text of `tokens` piece by piece as they arrive; a piece ending in an incomplete
    UTF-8 sequence waits for the token that completes it."""
    ids: list[int] = []
    shown = ""
    for tok in tokens:
        ids.append(tok)
        txt = decode(ids)
        if txt.startswith(shown) and not txt.endswith("\ufffd") and len(txt) > len(shown):
            yield txt[len(shown):]
            shown = txt
    txt = decode(ids)
    if txt != shown:
        yield txt[len(shown):]
