"""Whisper's greedy logit rules as device tensor ops, for steps decoded in rounds on the device.

decoding.WindowDecoder._apply_rules masks one row of logits on the host from the tokens sampled so
far, which costs a host read per token. Here the same rules run on [B, V] logits from per-row
history kept on the device (the last two tokens, the last timestamp token, how many were sampled),
without branches on the host, so megakernel.decode_loop can replay a round of steps and read the
tokens once. Only rows that sampled at least one token are decoded this way (the first token, with
its blank and initial-timestamp rules, is chosen on the host from the prompt's logits), so those
first-token rules are absent here.

Per step and row, as the host does it: suppressed tokens to -inf; with timestamps also
<|notimestamps|>, then the pair grammar (after a closed pair text must follow, after an open
timestamp one must close it or end), non-decreasing timestamps (a segment of non-zero length), and
a timestamp forced when their total probability beats every text token. The choice is the argmax
(first of ties) and its score the log-probability under the masked logits, as the host sums them.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .decoding import WindowDecoder


class DeviceRules:
    """Callable: () -> (next tokens [B] int64, their log-probabilities [B] float64) from `logits`."""

    @torch.inference_mode(False)   # ordinary buffers, whichever mode builds them (CompiledStep's)
    def __init__(self, decoder: "WindowDecoder", logits: torch.Tensor) -> None:
        """logits: the step's [B, V] logits (a view the step rewrites each launch)."""
        tok = decoder.tok
        B, V = logits.shape
        dev = logits.device
        self.logits, self.tb, self.eot = logits, tok.timestamp_begin, tok.eot
        text = torch.zeros(V, device=dev)
        text[decoder.suppress.to(dev)] = float("-inf")
        ts = text.clone()
        ts[tok.no_timestamps] = float("-inf")
        self.bias = torch.stack([text, ts])        # row 0: without timestamps, row 1: with
        self.window_bias = torch.zeros(V, device=dev)   # the window's row of `bias` (reset)
        self.col = torch.arange(V, device=dev)
        self.timestamps = torch.zeros(1, dtype=torch.long, device=dev)
        self.last = torch.zeros(B, dtype=torch.long, device=dev)
        self.penult = torch.zeros(B, dtype=torch.long, device=dev)
        self.count = torch.zeros(B, dtype=torch.long, device=dev)
        self.last_ts = torch.zeros(B, dtype=torch.long, device=dev)   # the last timestamp token, -1: none

    def reset(self, sampled: list[list[int]], timestamps: bool) -> None:
        """Each row's tokens sampled so far (at least one) and the window's mode: host -> device,
        once per window."""
        if len(sampled) != self.last.numel() or not all(sampled):
            raise ValueError(f"need the sampled tokens (at least one) of {self.last.numel()} rows")
        dev = self.last.device
        self.last.copy_(torch.tensor([s[-1] for s in sampled], device=dev))
        self.penult.copy_(torch.tensor([s[-2] if len(s) > 1 else -1 for s in sampled], device=dev))
        self.count.copy_(torch.tensor([len(s) for s in sampled], device=dev))
        self.last_ts.copy_(torch.tensor([next((t for t in reversed(s) if t >= self.tb), -1) for s in sampled],
                                        device=dev))
        self.timestamps.fill_(int(timestamps))
        self.window_bias.copy_(self.bias[int(timestamps)])   # once a window, not every step

    def __call__(self) -> tuple[torch.Tensor, torch.Tensor]:
        tb, col, neg = self.tb, self.col, float("-inf")
        x = self.logits + self.window_bias
        on = self.timestamps.bool()
        last_is_ts = self.last >= tb
        penult_is_ts = (self.count < 2) | (self.penult >= tb)
        closed = last_is_ts & penult_is_ts     # a pair just closed: text must follow
        opened = last_is_ts & ~penult_is_ts    # an open timestamp: close it (or end)
        is_ts = col >= tb
        mask = (closed[:, None] & is_ts) | (opened[:, None] & (col < self.eot))
        limit = torch.where(opened, self.last_ts, self.last_ts + 1)
        mask |= (self.last_ts >= 0)[:, None] & is_ts & (col < limit[:, None])
        x = x.masked_fill(mask & on, neg)
        logprobs = torch.log_softmax(x, dim=-1)
        force = logprobs[:, tb:].logsumexp(dim=-1) > logprobs[:, :tb].max(dim=-1).values
        x = x.masked_fill((force & on)[:, None] & ~is_ts, neg)
        nxt = torch.argmax(x, dim=-1)
        score = torch.log_softmax(x, dim=-1).gather(1, nxt[:, None])[:, 0].double()
        self.penult.copy_(self.last)
        self.last.copy_(nxt)
        self.count.add_(1)
        self.last_ts.copy_(torch.where(nxt >= tb, nxt, self.last_ts))
        return nxt, score


__all__ = ["DeviceRules"]
