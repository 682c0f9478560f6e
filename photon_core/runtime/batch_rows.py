"""What each request's row of a batched decode keeps to itself, so that no row's result depends on
the rows beside it, for every family that decodes requests together.

`Progress`: a request's progress callback is the caller's code (the ROS vision action publishes
feedback from it, I/O that can raise at shutdown). Left to raise inside the decode loop it would
end the whole batch, every row's result lost (and the runtime Batcher would then run each caller's
group again alone, its callbacks hearing the same progress twice), so its exception is logged once
and that request is not told again; the decode and every result go on.

`row_generator`: a sampled row draws from its own generator. One generator shared by the rows
would hand each row the draws left by the rows before it, so a seeded request's tokens would
change with what else was in its batch.
"""
from __future__ import annotations

import logging
from collections.abc import Callable

import torch

log = logging.getLogger(__name__)


class Progress:
    """One request's `progress` callback (runtime.requests.Request) for one decode."""

    def __init__(self, callback: Callable[[dict], None] | None) -> None:
        self._callback = callback

    @property
    def wanted(self) -> bool:
        """Whether anyone still listens (check before building the result: decoding text costs)."""
        return self._callback is not None

    def __call__(self, result: dict) -> None:
        if self._callback is None:
            return
        try:
            self._callback(result)
        except Exception:
            # Once: a callback that failed (a publisher gone) would fail at every later step too.
            log.exception("a request's progress callback raised; it is not called again for this request, "
                          "whose decode goes on")
            self._callback = None


def row_generator(seed: int | None) -> torch.Generator:
    """A row's own source of sampling draws (runtime.sampling.pick's generator): seeded with
    `seed`, so that the same request seeded alike draws the same alone or in any batch; None:
    fresh entropy. On the CPU, so a seed draws the same on every device (pick moves the draw)."""
    gen = torch.Generator(device="cpu")
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(seed)
    return gen


__all__ = ["Progress", "row_generator"]
