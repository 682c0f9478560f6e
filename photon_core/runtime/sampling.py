"""Sampling settings of a text request and the pick of its next token, for every family.

Greedy (temperature 0) is the ops' argmax; otherwise temperature and nucleus (top_p) sampling by
the ops' `sample`, with one uniform drawn from the caller's generator, so a seeded request gives
the same tokens on every backend. `allowed` bars tokens (an answer marker, image placeholders).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from photon_core.runtime.requests import sampling_problems


@dataclass
class Sampling:
    """How many tokens a text request may decode and how each is chosen."""

    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        """ValueError naming every setting out of range."""
        wrong = sampling_problems(self.max_tokens, self.temperature, self.top_p)
        if wrong:
            raise ValueError("; ".join(wrong))

    @property
    def greedy(self) -> bool:
        # below GREEDY_BELOW, logits / temperature overflow float32 (NaN: token 0 drawn every time,
        # and the backends disagreed where): what such a temperature asks for is the argmax
        return self.temperature < GREEDY_BELOW


GREEDY_BELOW = 1e-6   # a temperature this small samples as temperature 0 would


class NonFiniteLogits(RuntimeError):
    """A row's logits hold NaN: it has no next token, and its request is refused with this reason
    rather than decoding on from a token the NaN chose (an index nobody checked)."""


def check_finite(logits: torch.Tensor, what: str = "logits") -> None:
    """NonFiniteLogits when `logits` (any shape: a row, rows, a head's bins) hold NaN, whose
    argmax is an index nobody can trust (torch's picks the NaN, our kernels the best other)."""
    if bool(torch.isnan(logits).any()):
        raise NonFiniteLogits(f"the model's {what} hold NaN ({int(torch.isnan(logits).sum())} of "
                              f"{logits.numel()}): no token can be chosen; the request is refused")


# +inf makes a softmax NaN: a draw would be token 0 (or fail, in torch.multinomial)
POSINF_REFUSAL = "the model's logits hold +inf: no token can be sampled; the request is refused"


def step_argmax(value: int, what: str = "logits") -> int:
    """A compiled step's own argmax (a token, a coordinate or size bin), taken as it is: a negative
    one is the step's mark that its logits held NaN (megakernel.decode_loop.NON_FINITE), never an
    index to decode on."""
    if value < 0:
        raise NonFiniteLogits(f"the model's {what} held NaN at this step (its argmax marked {value}): "
                              "no token can be chosen; the request is refused")
    return value


def pick(logits: torch.Tensor, s: Sampling, ops: Any, allowed: torch.Tensor | None = None,
         generator: torch.Generator | None = None) -> int:
    """The next token of one row from its logits [V]; allowed: bool [V] (None: every token);
    generator: the uniform's source (None: torch's default, seeded by torch.manual_seed).
    Raises NonFiniteLogits for logits with a NaN, for a row whose every allowed token is -inf
    (the ops' argmax and draw return token 0 there, barred or not), and for a sampled row whose
    allowed tokens hold +inf (its softmax is NaN: the draw would return token 0); -inf is a mask,
    and a barred token's +inf is never drawn."""
    masked = logits if allowed is None else logits.masked_fill(~allowed, float("-inf"))
    # one read back from the device for all three checks (a token's pick is on the host's path)
    nan, none_left, posinf = (bool(v) for v in torch.stack(
        [torch.isnan(logits).any(), torch.isneginf(masked).all(), torch.isposinf(masked).any()]).tolist())
    if nan:
        check_finite(logits)
    if none_left:
        raise NonFiniteLogits(f"every token the row may take has logit -inf ({logits.numel()} logits"
                              f"{'' if allowed is None else f', {int(allowed.sum())} allowed'}): no token "
                              "can be chosen; the request is refused")
    if not s.greedy and posinf:
        raise NonFiniteLogits(POSINF_REFUSAL)
    if s.greedy:
        return int(ops.argmax(logits) if allowed is None else ops.argmax(logits, allowed))
    where = generator.device if generator is not None else logits.device
    u = torch.rand(1, generator=generator, device=where).to(logits.device)
    return int(ops.sample((masked if allowed is None else masked.float())[None], s.temperature, s.top_p, u)[0])


__all__ = ["NonFiniteLogits", "POSINF_REFUSAL", "Sampling", "check_finite", "pick", "step_argmax"]
