"""Decoding loops: one request streamed token by token, or up to MAX_BATCH requests decoded together
(each step one batched forward over all unfinished rows)."""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from . import text

if TYPE_CHECKING:
    from .model import Qwen35Model

MAX_BATCH = 8


@dataclass
class Sampling:
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0

    def check(self) -> None:
        if self.max_tokens < 0 or self.temperature < 0 or not 0 < self.top_p <= 1:
            raise ValueError(f"need max_tokens >= 0, temperature >= 0 and 0 < top_p <= 1, got {self}")


def choose(model: "Qwen35Model", logits: torch.Tensor, s: Sampling) -> int:
    """The next token of one row from its logits [V]: greedy (ops.argmax) or sampled (ops.sample)."""
    if s.temperature == 0:
        return int(model.ops.argmax(logits))
    u = torch.rand(1, generator=model.generator, device=logits.device)
    return int(model.ops.sample(logits[None], s.temperature, s.top_p, u)[0])


def tokens(model: "Qwen35Model", state: "text.DecodeState", logits: torch.Tensor, s: Sampling) -> Iterator[int]:
    """The answer's token ids after a prefilled prompt (its last logits), decoded lazily as the caller
    iterates (stop tokens not yielded). Greedy on the megakernel: the tokens after the first come in
    rounds decoded on the device (MegakernelDecode.stream_greedy), the same tokens."""
    if s.temperature == 0 and model.decode is not None and s.max_tokens > 0:
        first = choose(model, logits, s)
        limit = min(s.max_tokens, state.max_len - int(state.length[0]) + 1)
        for _, tok in model.decode.stream_greedy(state, [first], [limit], model.prompts.stop_ids):
            yield tok
        return
    for n in range(s.max_tokens):
        tok = choose(model, logits, s)
        if tok in model.prompts.stop_ids:
            return
        yield tok
        if n + 1 == s.max_tokens or int(state.length[0]) >= state.max_len:
            return
        logits = model.step(torch.tensor([[tok]], device=model.device), state)[0]


def text_pieces(model: "Qwen35Model", toks: Iterator[int]) -> Iterator[str]:
    """Decoded text piece by piece; a piece ending inside a multi-byte character waits for the next token."""
    ids: list[int] = []
    shown = ""
    for tok in toks:
        ids.append(tok)
        txt = model.prompts.decode(ids)
        if txt.startswith(shown) and len(txt) > len(shown) and not txt.endswith("\ufffd"):
            yield txt[len(shown):]
            shown = txt
    txt = model.prompts.decode(ids)
    if txt.startswith(shown) and len(txt) > len(shown):   # what was held back (an unfinished character)
        yield txt[len(shown):]


def run_batch(model: "Qwen35Model", jobs: list[tuple[object, str, Sampling]],
              requests: list | None = None) -> list[str]:
    """Texts for (image, question, sampling) jobs, at most MAX_BATCH at a time decoded together.
    `requests` (runtime.requests.Request, one per job): a canceled one stops at its next step,
    and each one's `progress` hears its text as it grows (host-driven decoding; on the
    megakernel's device rounds, greedy batches are decoded whole)."""
    out: list[str] = []
    for i in range(0, len(jobs), MAX_BATCH):
        out += _decode_group(model, jobs[i:i + MAX_BATCH], None if requests is None else requests[i:i + MAX_BATCH])
    return out


def _decode_group(model: "Qwen35Model", jobs: list[tuple[object, str, Sampling]],
                  requests: list | None = None) -> list[str]:
    for _, _, s in jobs:
        s.check()
    states, logits = [], []
    for image, question, s in jobs:   # prompts differ in length and image: prefilled one by one
        st, lg = model.prefill(image, question, extra=s.max_tokens)
        states.append(st)
        logits.append(lg)
    max_len = max(st.max_len for st in states)
    limits = [st.max_len for st in states]
    state = text.DecodeState.merge(states, max_len)
    watched = requests is not None and any(r.cancel is not None or r.progress is not None for r in requests)
    if model.decode is not None and all(s.temperature == 0 for _, _, s in jobs) and not watched:
        # Greedy on the megakernel: rounds decoded on the device, the host reads tokens, no logits.
        first = [choose(model, lg, s) for lg, (_, _, s) in zip(logits, jobs)]
        cap = [min(s.max_tokens, lim - int(st.length[0]) + 1) for (_, _, s), lim, st in zip(jobs, limits, states)]
        out = model.decode.greedy(state, first, cap, model.prompts.stop_ids)
        return [model.prompts.decode(r) for r in out]
    results: list[list[int]] = [[] for _ in jobs]
    active = list(range(len(jobs)))   # job index of each state row
    cur = torch.stack(logits)
    while active:
        next_tokens, keep = [], []
        for row, j in enumerate(active):
            s = jobs[j][2]
            done = len(results[j]) >= s.max_tokens or (requests is not None and requests[j].canceled)
            if not done:
                tok = choose(model, cur[row], s)
                done = tok in model.prompts.stop_ids
                if not done:
                    results[j].append(tok)
                    done = len(results[j]) >= s.max_tokens or int(state.length[row]) >= limits[j]
                    if requests is not None and requests[j].progress is not None:
                        key = "answer" if requests[j].task == "query" else "caption"
                        requests[j].progress({key: model.prompts.decode(results[j])})
            if not done:
                keep.append(row)
                next_tokens.append(results[j][-1])
        if not keep:
            break
        if len(keep) < len(active):
            state.keep(keep)
            active = [active[r] for r in keep]
        ids = torch.tensor(next_tokens, device=model.device)[:, None]
        cur = model.step(ids, state)
    return [model.prompts.decode(r) for r in results]
