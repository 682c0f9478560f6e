"""Decoding loops: one request streamed token by token, or up to MAX_BATCH requests decoded together
(each step one batched forward over all unfinished rows), both runtime.generate's loop over a
merged DecodeState; greedy on the megakernel, the tokens after each row's first decode in rounds
on the device (MegakernelDecode.stream_greedy), the same tokens."""
from __future__ import annotations

from collections.abc import Collection, Iterator
from typing import TYPE_CHECKING

import torch

from photon_core.runtime.batch_rows import Progress, row_generator
from photon_core.runtime.generate import generate, room
from photon_core.runtime.sampling import Sampling, pick
from photon_core.runtime.text_stream import JoinedPieces

from . import text

if TYPE_CHECKING:
    from .model import Qwen35Model

MAX_BATCH = 8


class Session:
    """runtime.generate's session on the rows of one prefilled DecodeState."""

    def __init__(self, model: "Qwen35Model", state: "text.DecodeState", logits: list[torch.Tensor]) -> None:
        self.model, self.state, self.logits = model, state, logits

    def prefill(self) -> tuple[torch.Tensor, None]:
        return torch.stack(self.logits), None

    def step(self, tokens: list[int]) -> tuple[torch.Tensor, None]:
        return self.model.step(torch.tensor(tokens, device=self.model.device)[:, None], self.state), None

    def keep(self, rows: list[int]) -> None:
        if self.model.decode is not None:
            self.model.decode.keep(self.state, rows)
        else:
            self.state.keep(rows)

    def rounds(self, first: list[int], max_new: list[int], stop: Collection[int]) -> Iterator[tuple[int, int]]:
        if self.model.decode is None:
            raise RuntimeError("decoding in rounds needs the compiled steps (the megakernel backend)")
        return self.model.decode.stream_greedy(self.state, first, max_new, stop)


def call_seed(model: "Qwen35Model", jobs: list[Sampling]) -> int | None:
    """The seed of one call: one draw from model.generator (its seed makes the call repeatable;
    the next call draws afresh); the call's row i samples from a generator of its own seeded
    seed + i (runtime.batch_rows.row_generator), so what the other rows are changes none of its
    draws. None where no row samples: a greedy call leaves model.generator as it was."""
    if all(s.greedy for s in jobs):
        return None
    g = model.generator
    return int(torch.randint(0, 2**62, (1,), generator=g, device=g.device))


def _decode(model: "Qwen35Model", state: "text.DecodeState", logits: list[torch.Tensor], jobs: list[Sampling],
            limits: list[int], seed: int | None, requests: list | None = None,
            first_row: int = 0) -> Iterator[list[int | None]]:
    """runtime.generate over the prefilled rows (limits: each row's own cache size; seed: call_seed's,
    `first_row`: the first row's place in the call)."""
    rooms = [room(s.max_tokens, int(state.length[r]), lim) for r, (s, lim) in enumerate(zip(jobs, limits))]
    watched = requests is not None and any(r.cancel is not None or r.progress is not None for r in requests)
    canceled = None if requests is None else (lambda r: requests[r].canceled)
    gens = [row_generator(None if seed is None else seed + first_row + r) for r in range(len(jobs))]
    return generate(Session(model, state, logits), jobs, rooms, model.prompts.stop_ids,
                    lambda r, lg, _: pick(lg, jobs[r], model.ops, generator=gens[r]), canceled,
                    device_rounds=model.decode is not None and not watched)


def tokens(model: "Qwen35Model", state: "text.DecodeState", logits: torch.Tensor, s: Sampling) -> Iterator[int]:
    """The answer's token ids after a prefilled prompt (its last logits), decoded lazily as the caller
    iterates (stop tokens not yielded)."""
    for new in _decode(model, state, [logits], [s], [state.max_len], call_seed(model, [s])):
        if new[0] is not None:   # always, with one row: a step's list is yielded for its token
            yield new[0]


def run_batch(model: "Qwen35Model", jobs: list[tuple[object, str, Sampling]],
              requests: list | None = None) -> list[str]:
    """Texts for (image, question, sampling) jobs, at most MAX_BATCH at a time decoded together.
    `requests` (runtime.requests.Request, one per job): a canceled one stops at its next step,
    and each one's `progress` hears its text as it grows (host-driven decoding; on the
    megakernel's device rounds, greedy batches are decoded whole)."""
    out: list[str] = []
    seed = call_seed(model, [s for _, _, s in jobs])   # one for all groups: rows seeded by their place
    for i in range(0, len(jobs), MAX_BATCH):
        out += _decode_group(model, jobs[i:i + MAX_BATCH], seed,
                             None if requests is None else requests[i:i + MAX_BATCH], first_row=i)
    return out


def _decode_group(model: "Qwen35Model", jobs: list[tuple[object, str, Sampling]], seed: int | None,
                  requests: list | None = None, first_row: int = 0) -> list[str]:
    states, logits = [], []
    for image, question, s in jobs:   # prompts differ in length and image: prefilled one by one
        st, lg = model.prefill(image, question, extra=s.max_tokens)
        states.append(st)
        logits.append(lg)
    state = text.DecodeState.merge(states, max(st.max_len for st in states))
    results: list[list[int]] = [[] for _ in jobs]
    asked = requests if requests is not None else []
    told = [(Progress(r.progress), "answer" if r.task == "query" else "caption") for r in asked]
    # a row's text so far, one decode a token and no unfinished character at its end
    texts = [JoinedPieces(model.prompts.decode) for _ in asked]
    for new in _decode(model, state, logits, [s for _, _, s in jobs], [st.max_len for st in states], seed,
                       requests, first_row):
        for j, tok in enumerate(new):
            if tok is not None:
                results[j].append(tok)
                if told and told[j][0].wanted:
                    tell, key = told[j]
                    tell({key: texts[j].text(results[j], final=False)})
    return [model.prompts.decode(r) for r in results]
