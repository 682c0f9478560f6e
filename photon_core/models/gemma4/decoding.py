"""Decoding rows of Gemma 4 text together: each row is one request (its prompt, optional image soft
tokens, limits and sampling), prefilled on its own, then joined into one batch cache where every
decode step is one batched forward for all rows still going."""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

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
    pos: int = 0                    # position of the next input token
    tokens: list[int] = field(default_factory=list)
    done: bool = False


def check_sampling(max_tokens: int, temperature: float, top_p: float) -> None:
    if max_tokens < 0 or temperature < 0 or not 0 < top_p <= 1:
        raise ValueError(f"need max_tokens >= 0, temperature >= 0 and 0 < top_p <= 1 "
                         f"(got {max_tokens}, {temperature}, {top_p})")


class BatchDecoder:
    def __init__(self, model: "Gemma4Model", rows: list[Row], seed: int | None = None) -> None:
        cfg = model.config.text
        self.model, self.rows = model, rows
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

    def _choose(self, r: Row, logits: torch.Tensor) -> int:
        ops = self.model.ops
        if r.temperature == 0:
            return int(ops.argmax(logits, self.allowed))
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

    def run(self) -> Iterator[list[int | None]]:
        """Yields, per decode round, each row's new token (None where the row produced nothing)."""
        m = self.model
        cache = text.KVCache(m.config.text, len(self.rows), self.max_len, m.dtype, m.device)
        last = []
        for b, r in enumerate(self.rows):
            one = text.KVCache(m.config.text, 1, self.max_len, m.dtype, m.device)
            last.append(m.prefill(r.prompt, r.image, one)[0])
            cache.copy_row(b, one)
            if r.max_tokens == 0:
                r.done = True
        logits = torch.stack(last)
        while True:
            new: list[int | None] = []
            for b, r in enumerate(self.rows):
                new.append(self._choose(r, logits[b]) if not r.done else None)
                if new[-1] is not None and not self._accept(r, new[-1]):
                    new[-1] = None
            if any(t is not None for t in new):
                yield new
            if all(r.done for r in self.rows):
                return
            ids = torch.tensor([[t if t is not None else m.config.text.pad_id] for t in new], device=m.device)
            pos = torch.tensor([min(r.pos, self.max_len - 1) for r in self.rows], device=m.device)
            logits = m.step(ids, pos, cache)
            for r in self.rows:
                if not r.done:
                    r.pos += 1


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
