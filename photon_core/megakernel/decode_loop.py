"""Greedy decoding that stays on the device: a round of compiled steps per host round trip.

A step graph whose argmax has `advance` writes each row's next token and position itself (and
range-checks the position: a row at the last position of its cache reports -1 in the result column
and stays there), so step n + 1 needs nothing from the host. DeviceDecode runs such steps back to
back. After each launch it records each row's token (the one fed next) and whether the row is now
full in a device history ([chunk, B] int32 each), and folds the launch's control buffer
into two device accumulators, because the next launch zeroes it: the highest error flag (a wait
that gave up, an unknown op) and the fewest tasks claimed. The host reads history, flag and count
in one copy per round (pick's scores, below, in a second): one synchronisation per round of up to `chunk` tokens, where a step that
the host drives costs three per token (the token, the error flag, the claim count).

A family whose next token is not a plain argmax (Whisper's timestamp grammar) passes `pick`: a
function of the step's outputs, made of device ops (no host reads), giving each row's next token
(and optionally a score per row, e.g. its log-probability); the loop then feeds the token and steps
the position itself, with the kernel's range rule; a graph that takes its token as an input vector
(Moondream's embeddings) also passes `feed`, device ops writing that input from the tokens. A full row's token is still valid (it came from
the last position); the host raises only if that row needs another step.

On CUDA each round is CUDA-graph replays and one read: rounds of 1, 2, 4, ... chunk steps are
captured when the loop is built (capture runs the steps, so build the loop before writing a
request's state), the smaller ones also at the offsets where they continue a larger one, so a round
of any n <= chunk steps is the replays of n's binary digits, largest first (7 = 4 + 2 + 1), each
writing its part of the history, then one read. The host learns of a stop token at the end of its
round: a row that stopped decodes on to the round's end and those tokens are dropped. That costs
steps, never tokens: each row's tokens are the per-token loop's. The rows' caches and recurrent
states then hold those extra steps: a request's decode state is spent when its loop ends (as every
family here uses it).

`pick` may record more than the token: a [B, width] int32 record per row and step (column 0 the
token fed on), e.g. Moondream's token, coordinate bin, size bins and its object score (a float32's
bits, so the round stays one read); a family with its own stopping protocol drives `run_round` and
reads the records itself.
"""
from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Collection, Iterator, Sequence
from typing import TYPE_CHECKING, Any, ContextManager

import torch

from photon_core.runtime.sampling import NonFiniteLogits

from .graph import CTRL_CLAIM, CTRL_ERROR

if TYPE_CHECKING:
    from .compiler import CompiledStep

NEVER = 2 ** 31 - 1
# What the advancing argmax writes in a row's result column besides a token (kernel._task_argmax).
FULL, NON_FINITE = -1, -2


class DeviceDecode:
    """Greedy rounds of one compiled step (its whole graph, or the part computing `results`):
    `result` an advancing argmax, or the tokens that `pick` computes after each launch."""

    @torch.inference_mode(False)   # ordinary buffers, whichever mode builds the loop (CompiledStep's)
    def __init__(self, step: "CompiledStep", result: str = "token", chunk: int = 8,
                 cuda_graphs: bool | None = None,
                 pick: Callable[[], torch.Tensor | tuple[torch.Tensor, torch.Tensor]] | None = None,
                 results: Collection[str] | None = None,
                 feed: Callable[[torch.Tensor], None] | None = None, width: int = 1) -> None:
        """chunk: the most steps per round (a power of two); cuda_graphs: replay captured rounds
        (default: on CUDA); pick: () -> next tokens [B] (or [B, width] records whose column 0 is
        the token; or (tokens, scores [B])) from the step's outputs, by device ops only; results:
        run the graph pruned to these result columns (None: all of it); feed: tokens [B] (pick's
        whole records when width > 1) -> None, writing the next step's inputs on the device."""
        if chunk < 1 or chunk & (chunk - 1):
            raise ValueError(f"chunk must be a power of two, got {chunk}")
        gd = step.graph_def
        node = next((n for n in gd.nodes if n.op == "argmax" and n.args["name"] == result), None)
        if pick is None and (node is None or not node.args["advance"]):
            raise ValueError(f"{gd.name}: result {result!r} is not an advancing argmax: the host would have "
                             "to feed every token (or pass `pick`)")
        if pick is not None and any(n.op == "argmax" and n.args["advance"] for n in gd.nodes):
            raise ValueError(f"{gd.name}: its argmax advances the rows itself; with `pick` the loop steps "
                             "them, so it needs the graph without advance")
        if width != 1 and pick is None:
            raise ValueError("records wider than the token need `pick`")
        self.step, self.chunk, self.width, self._pick, self._write = step, chunk, width, pick, feed
        self.kernel = step.kernel_for(results)
        B, dev = step.batch, step.out.device
        if pick is None:
            self._token = step.out.view(B, max(1, len(gd.results)))[:, gd.results.index(result)]
        self.history = torch.zeros(chunk, B, width, dtype=torch.int32, device=dev)
        self.full = torch.zeros(chunk, B, dtype=torch.int32, device=dev)
        self.score_history = torch.zeros(chunk, B, dtype=torch.float64, device=dev)
        self.scores: list[list[float]] = []   # per row, the score of each step it consumed (last generate)
        self._err = torch.zeros(1, dtype=torch.int32, device=dev)
        self._claimed = torch.zeros(1, dtype=torch.int32, device=dev)
        self.rounds = 0   # host round trips so far (each one read of the device)
        self._graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        if cuda_graphs if cuda_graphs is not None else dev.type == "cuda":
            from photon_core.runtime.cuda_graph import capture
            # Capture runs the steps (a warm-up launch each): from a valid state (the step's own,
            # in-range tokens and positions; attention over an unfilled cross cache reads no key
            # and gives zeros), and everything they write is put back after (restoring).
            parts = _parts_to_capture(chunk)
            with restoring(step, sum(n for n, _ in parts)):
                for n, at in parts:
                    self._graphs[n, at], _ = capture(functools.partial(self._round, n, at), warmup=1)

    def _round(self, n: int, at: int = 0) -> None:
        """n launches recorded at history[at:at + n] (capturable: fixed shapes, no host reads); a
        round's first part (at 0) starts the error and claim accumulators afresh."""
        ctrl = self.kernel.ctrl
        if at == 0:
            self._err.zero_()
            self._claimed.fill_(NEVER)
        for i in range(at, at + n):
            self.kernel.launch()
            if self._pick is None:
                # The argmax fed its token to the next step (dyn) even for a full row, whose
                # result column says -1.
                self.history[i, :, 0].copy_(self.step.dyn[:self.step.batch])
                self.full[i].copy_(-self._token.clamp(NON_FINITE, 0))   # 0 / 1 full / 2 non-finite
            else:
                self._feed(i, self._pick)
            torch.maximum(self._err, ctrl[CTRL_ERROR:CTRL_ERROR + 1], out=self._err)
            torch.minimum(self._claimed, ctrl[CTRL_CLAIM:CTRL_CLAIM + 1], out=self._claimed)

    def _feed(self, i: int, pick: Callable[[], Any]) -> None:
        """Record pick's tokens and make them the next step's, stepping positions as the advancing
        argmax does: a row whose next position would pass the caches stays there, marked full; a row
        whose logits hold NaN stays too, marked non-finite (2), as the advancing argmax marks it."""
        picked = pick()
        rec, score = picked if isinstance(picked, tuple) else (picked, None)
        B, dyn = self.step.batch, self.step.dyn
        pos = dyn[B:2 * B]
        full = pos >= self.step.plan.max_position - 1
        mark = full.to(torch.int32)
        if "logits" in self.step.graph_def.exposed:
            nan = torch.isnan(self.step.view("logits")).any(1)
            full, mark = full | nan, torch.where(nan, -NON_FINITE, mark)
        self.history[i].copy_(rec.view(B, self.width))
        self.full[i].copy_(mark)
        if score is not None:
            self.score_history[i].copy_(score)
        dyn[:B].copy_(rec.view(B, self.width)[:, 0])
        pos.copy_(torch.where(full, pos, pos + 1))
        if self._write is not None:
            self._write(rec)

    def run_round(self, n: int) -> tuple[list[list], list[list[int]]]:
        """One round of 1 <= n <= chunk steps from the step's current state, after checking the
        launches' flags (one read): (records [n][B], each a token or a list of `width` ints;
        full [n][B], 1 where that step left the row at the last position of its cache, 2 where the
        row's logits held NaN and it has no token). pick's scores, if any, are in `round_scores`
        [n][B] after it (a second read)."""
        if not 1 <= n <= self.chunk:
            raise ValueError(f"a round is 1..{self.chunk} steps, not {n}")
        if self._graphs:
            at = 0
            for bit in reversed(range(n.bit_length())):
                if n >> bit & 1:
                    self._graphs[1 << bit, at].replay()
                    at += 1 << bit
        else:
            self._round(n)
        B, W = self.step.batch, self.width
        flat = torch.cat([self.history[:n].flatten(), self.full[:n].flatten(), self._err, self._claimed]).tolist()
        self.rounds += 1
        self.kernel.raise_for(flat[-2], flat[-1])
        self.round_scores = self.score_history[:n].tolist() if self._pick is not None else None
        hist = flat[:n * B * W]
        if W == 1:
            records = [hist[i * B:(i + 1) * B] for i in range(n)]
        else:
            records = [[hist[(i * B + r) * W:(i * B + r + 1) * W] for r in range(B)] for i in range(n)]
        full = [flat[n * B * W + i * B:n * B * W + (i + 1) * B] for i in range(n)]
        if any(-NON_FINITE in f for f in full):
            # that row is refused (stream, or the family's own protocol); the next request must
            # not read its NaN (the per-op engine reads every cache slot under a mask)
            self.step.scrub_nonfinite()
        return records, full

    def generate(self, first: Sequence[int], max_new: int | Sequence[int],
                 stop: Collection[int]) -> list[list[int]]:
        """Each row's tokens from its first one (the prefill's; rows past len(first) are padding),
        until a stop token (excluded) or its max_new tokens: the loop that launches one step per
        token and reads each token back gives the same lists. The step's tokens and positions must
        be set (set_step) to the first tokens at the rows' prompt lengths. With `pick` giving
        scores, `scores[r]` then holds the score of each step row r consumed (its stop token's too)."""
        out: list[list[int]] = [[] for _ in first]
        for row, token in self.stream(first, max_new, stop):
            out[row].append(token)
        return out

    def stream(self, first: Sequence[int], max_new: int | Sequence[int], stop: Collection[int],
               each_round: Callable[[list[int], int], ContextManager] | None = None) -> Iterator[tuple[int, int]]:
        """generate's tokens as (row, token) pairs as they come: the first tokens, then a round's
        worth at a time (a row's tokens in order). each_round(tokens, n): a context each round of n
        steps runs in, given the tokens the round starts from (one per row of the step), e.g. to
        hold a lock and to restore a step another request used between rounds."""
        limit = [max_new] * len(first) if isinstance(max_new, int) else list(max_new)
        if len(limit) != len(first):
            raise ValueError(f"need one max_new per row ({len(first)}), got {len(limit)}")
        self.scores = [[] for _ in first]
        count = [0] * len(first)
        full = [False] * len(first)
        live = []
        for r, t in enumerate(first):
            if t not in stop and limit[r] > 0:
                count[r] = 1
                yield r, t
                if limit[r] > 1:
                    live.append(r)
        current = list(first) + [0] * (self.step.batch - len(first))
        while live:
            # The launches the longest live row may still need, up to a chunk.
            n = min(self.chunk, max(limit[r] - count[r] for r in live))
            with each_round(current, n) if each_round is not None else contextlib.nullcontext():
                rounds, round_full = self.run_round(n)
            current = rounds[-1]
            for i, tokens in enumerate(rounds):
                for r in list(live):
                    t = tokens[r]
                    if round_full[i][r] == -NON_FINITE:
                        raise NonFiniteLogits(f"row {r}: the model's logits held NaN at its token {count[r] + 1}: "
                                              "no token can be chosen; the request is refused")
                    if full[r]:   # this step re-ran the row's last position: it had no room left
                        raise RuntimeError(f"row {r} reached the end of the megakernel's context "
                                           f"({self.step.plan.max_position} positions)")
                    full[r] = bool(round_full[i][r])
                    if self.round_scores is not None:
                        self.scores[r].append(self.round_scores[i][r])
                    if t in stop:
                        live.remove(r)
                        continue
                    count[r] += 1
                    yield r, t
                    if count[r] == limit[r]:
                        live.remove(r)


@contextlib.contextmanager
def restoring(step: "CompiledStep", launches: int) -> Iterator[None]:
    """Put back what up to `launches` steps from the current positions write: tokens, positions
    and results, every recurrent state, and each cache's slots at positions p .. p + launches of
    every row (where the steps append; a ring's slots modulo its length, which may hold live
    history). Not the whole arena: a batch's caches can be gigabytes, the slots kilobytes."""
    B = step.batch
    pos = step.dyn[B:2 * B].to(torch.int64).cpu()
    saved: list[tuple[torch.Tensor, Any, torch.Tensor]] = [(step.dyn, slice(None), step.dyn.clone()),
                                                           (step.out, slice(None), step.out.clone())]
    for name in step.graph_def.states:
        view = step.view(name)
        saved.append((view, slice(None), view.clone()))
    for name, spec in step.graph_def.caches.items():
        view = step.view(name)       # [(layers,) B, H, T, Dh]
        for r in range(B):
            slots = torch.arange(int(pos[r]), int(pos[r]) + launches + 1)
            slots = slots % spec.length if spec.ring else slots[slots < spec.length]
            if slots.numel():
                idx = (..., r, slice(None), slots.to(view.device), slice(None))
                saved.append((view, idx, view[idx].clone()))
    try:
        yield
    finally:
        for t, idx, value in saved:
            t[idx] = value


def _parts_to_capture(chunk: int) -> list[tuple[int, int]]:
    """(steps, offset) of every captured part: size m at each offset where it can follow larger
    parts of a round of at most `chunk` steps (the multiples of 2m below chunk)."""
    parts, m = [], chunk
    while m >= 1:
        parts += [(m, at) for at in range(0, chunk - m + 1, 2 * m)]
        m //= 2
    return parts


__all__ = ["DeviceDecode"]
