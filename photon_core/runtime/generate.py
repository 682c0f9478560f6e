"""One generate loop for every family that decodes text: greedy, sampled, streamed and batched.

A family hands the loop a Session: its rows already prefilled (`prefill` gives the logits after
each prompt), `step` feeding each live row's last token, `keep` dropping finished rows, and,
where the family compiles its steps, `rounds` decoding greedy rows on the device. The loop owns
the rules every family shares: each row's next token (its sampling settings, or the step's own
argmax), stop tokens (ending a row, never shown), max_tokens and the room left in the row's cache,
and a canceled row stopping at its next step.

Room: a row whose prompt ends at position P in a cache of `limit` positions feeds its k-th token
at P + k - 1, so it takes at most min(max_tokens, limit - P + 1) tokens.

The loop yields one list per step: each row's new token, None where the row gave none. On the
device rounds it yields the same lists (a row's tokens arrive a round at a time, and a step's list
goes out once every row still going has its token there, or a later token or the end shows that
the rows without one stopped).
"""
from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from typing import Any, Protocol

import torch

from .sampling import Sampling, pick


class Session(Protocol):
    """A family's decode state for some rows (rows are numbered as prefilled; after `keep` the
    live ones, in order)."""

    def prefill(self) -> tuple[torch.Tensor, list[int] | None]:
        """(logits [rows, V] after each row's prompt, each row's greedy token if the step took it
        already, else None)."""

    def step(self, tokens: list[int]) -> tuple[torch.Tensor, list[int] | None]:
        """Feed each live row its token at its next position: step()'s result for the live rows."""

    def keep(self, rows: list[int]) -> None:
        """Only `rows` (indices into the live rows) decode on."""


class DeviceSession(Session, Protocol):
    def rounds(self, first: list[int], max_new: list[int], stop: Collection[int]) -> Iterator[tuple[int, int]]:
        """Greedy rows decoded on the device: (row, token) pairs, each row's `first` token (fed at
        the end of its prompt) and the next ones until a stop token (excluded) or max_new tokens."""


Choose = Callable[[int, torch.Tensor, "int | None"], int]


def room(max_tokens: int, prompt_end: int, limit: int) -> int:
    """The tokens a row may take: max_tokens, or fewer when its cache of `limit` positions fills
    (its k-th token is fed at prompt_end + k - 1)."""
    return max(0, min(max_tokens, limit - prompt_end + 1))


def generate(session: Session, sampling: Sequence[Sampling], rooms: Sequence[int], stop: Collection[int],
             choose: Choose, canceled: Callable[[int], bool] | None = None,
             device_rounds: bool = True) -> Iterator[list[int | None]]:
    """Each step's new tokens, one entry per row. choose(row, logits [V], greedy | None) picks a
    row's token (runtime.sampling.pick with the family's mask and generator); canceled(row): the
    row stops before its next token. `rooms` are read at each step: a family may shorten a row's
    while it decodes (Moondream: a reasoning's answer gets its own max_tokens once it starts).
    Greedy batches decode on the device when the session has rounds and `device_rounds` (a
    canceled row is then noticed as each round is read: its later tokens are dropped, and the
    rounds end once every row has stopped)."""
    n = len(sampling)
    if len(rooms) != n:
        raise ValueError(f"need one room per row ({n}), got {len(rooms)}")
    logits, greedy = session.prefill()
    if not any(r > 0 for r in rooms):
        return
    if device_rounds and hasattr(session, "rounds") and all(s.greedy for s in sampling):
        yield from _rounds(session, logits, greedy, rooms, stop, choose, canceled)   # type: ignore[arg-type]
        return
    live = list(range(n))            # the session's rows, by request row
    count = [0] * n
    done = [r <= 0 for r in rooms]
    while True:
        new: list[int | None] = [None] * n
        for i, r in enumerate(live):
            if done[r] or (canceled is not None and canceled(r)):
                done[r] = True
                continue
            tok = choose(r, logits[i], None if greedy is None else greedy[i])
            if tok in stop:
                done[r] = True
                continue
            new[r] = tok
            count[r] += 1
            done[r] = count[r] >= rooms[r]
        if any(t is not None for t in new):
            yield new
        keep = [i for i, r in enumerate(live) if not done[r]]
        if not keep:
            return
        if len(keep) < len(live):
            session.keep(keep)
            live = [live[i] for i in keep]
        logits, greedy = session.step([new[r] for r in live])   # type: ignore[misc]


def token_lists(steps: Iterable[list[int | None]], rows: int) -> list[list[int]]:
    """Each row's tokens from generate's steps (stop tokens excluded, as generate gives them)."""
    out: list[list[int]] = [[] for _ in range(rows)]
    for new in steps:
        for r, tok in enumerate(new):
            if tok is not None:
                out[r].append(tok)
    return out


def greedy_tokens(session: Session, rows: int, max_tokens: int | Sequence[int], stop: Collection[int],
                  ops: Any) -> list[list[int]]:
    """Each row's greedy tokens (the ops' argmax; stop tokens excluded, at most max_tokens, or
    each row's own) from a prefilled session, in rounds on the device where the session has them."""
    budgets = [max_tokens] * rows if isinstance(max_tokens, int) else list(max_tokens)
    greedy = [Sampling(n) for n in budgets]
    steps = generate(session, greedy, budgets, stop, lambda r, logits, _: pick(logits, greedy[r], ops))
    return token_lists(steps, rows)


def _rounds(session: DeviceSession, logits: torch.Tensor, greedy: list[int] | None, rooms: Sequence[int],
            stop: Collection[int], choose: Choose, canceled: Callable[[int], bool] | None = None
            ) -> Iterator[list[int | None]]:
    n = len(rooms)
    # A row with no room still needs a first token to feed (it is not shown: max_new 0).
    first = [choose(r, logits[r], None if greedy is None else greedy[r]) for r in range(n)]
    count = [0] * n
    pending: dict[int, int] = {}
    going = [r > 0 for r in rooms]
    at = 0   # the step (0: the first tokens) of the pending tokens

    def flush() -> list[int | None]:
        for r in range(n):
            if r not in pending:
                going[r] = False   # still going before this step and no token: a stop token
        new = [pending.get(r) for r in range(n)]
        pending.clear()
        return new

    stream = session.rounds(first, list(rooms), stop)
    for r, tok in stream:
        if canceled is not None and going[r] and canceled(r):
            going[r] = False   # its tokens from here on are dropped
        if not going[r]:
            if not any(going):
                break   # every row stopped: no more rounds
            continue
        if pending and count[r] != at:
            yield flush()
        at = count[r]
        count[r] += 1
        pending[r] = tok
        if count[r] == rooms[r]:
            going[r] = False
        if all(not g or i in pending for i, g in enumerate(going)):
            yield flush()
    if hasattr(stream, "close"):
        stream.close()   # ends the device loop's rounds where they stand
    if pending:
        yield flush()
