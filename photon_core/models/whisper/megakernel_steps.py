"""Whisper's per-token decode step as one megakernel launch (photon_core.megakernel).

The prompt is prefilled by the model's own ops (many tokens at once is not what the megakernel is
for); each following token is one persistent launch that runs every decoder layer, the
cross-attention and the LM head. Greedy windows decode in rounds on the device (`greedy`: the
logit rules as device ops, device_rules.py, and megakernel.decode_loop: on CUDA one CUDA-graph
replay and one read of the device per round of up to 8 tokens); several windows at once take
the rows of a batch bucket (1, 2, 4, 8; every bucket streams one copy of the weights); sampling
(temperature fallback) reads each step's logits for the host's rules (`logits`, one window).
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import torch

from photon_core.runtime.decode import CompiledSteps, bucket_for, copy_prefilled_kv, resolve_weight_dtype

from .model import DecoderCache, WhisperNet

if TYPE_CHECKING:
    from photon_core.megakernel.decode_loop import DeviceDecode

    from .decoder_step import WhisperDecoderMegakernel
    from .decoding import WindowDecoder


class MegakernelSteps(CompiledSteps["WhisperDecoderMegakernel"]):
    """Whisper's compiled steps by bucket (runtime.decode); a bucket's rounds come later, with the
    window decoder's logit rules (`prepare`), so `loop` here is the batch-1 bucket's."""

    family = "A Whisper model"

    def __init__(self, net: WhisperNet, weight_dtype: torch.dtype = torch.float32,
                 tiling=None) -> None:
        """tiling: photon_core.models.whisper.decoder_step.Tiling; None = the GPU default."""
        from photon_core.models.whisper.decoder_step import Tiling, WhisperDecoderWeights
        d = net.dims
        super().__init__(d.n_text_ctx, resolve_weight_dtype(weight_dtype, torch.float32))
        self.n_layers, self.dims = d.n_text_layer, d
        self.tiling = tiling or Tiling()
        # Built once per model: weight re-layout and graph building are load-time work.
        self.wt = WhisperDecoderWeights.from_whisper(net.w)
        self.mk = self.decoder(1)
        self.rows = 1   # the rows (windows) the last `start` loaded
        self._scored: DeviceDecode | None = None   # the loop of the last stream_rows

    def build_step(self, batch: int, weights: torch.Tensor | None) -> "WhisperDecoderMegakernel":
        from photon_core.models.whisper.decoder_step import WhisperDecoderMegakernel
        d = self.dims
        return WhisperDecoderMegakernel(self.wt, batch=batch, max_len=d.n_text_ctx, enc_len=d.n_audio_ctx,
                                        tiling=self.tiling, weight_dtype=self.weight_dtype, shared_weights=weights)

    def build_loop(self, step: "WhisperDecoderMegakernel") -> None:
        """Nothing yet: the rounds pick tokens by the decoder's logit rules, so `prepare` puts a
        bucket's (rules, rounds) in its place."""
        return None

    @property
    def loop(self) -> "DeviceDecode":   # type: ignore[override]
        """The batch-1 bucket's round loop (built by `prepare`)."""
        return self._loops[1][1]

    def prepare(self, decoder: "WindowDecoder", rows: int = 1) -> None:
        """Build the device rules and the round loop of the bucket holding `rows` once, before
        `start` writes a window's caches (on CUDA building the loop captures rounds, which runs
        steps)."""
        bucket = bucket_for(rows)
        mk = self.decoder(bucket)
        if self._loops[bucket] is None:
            from photon_core.megakernel.decode_loop import DeviceDecode

            from .device_rules import DeviceRules
            rules = DeviceRules(decoder, mk.logits)
            self._loops[bucket] = (rules, DeviceDecode(mk, pick=rules))

    def start(self, cache: DecoderCache, length: int) -> None:
        """Continue from a prefilled cache of B windows (its cross K/V and first `length`
        positions) in rows 0..B-1 of the bucket holding them; padding rows repeat the last window."""
        rows = cache.k.shape[1]
        mk = self.for_rows(rows)
        pad = mk.batch - rows
        cross = cache.cross if not pad else [(torch.cat([k, k[-1:].expand(pad, *k.shape[1:])]),
                                               torch.cat([v, v[-1:].expand(pad, *v.shape[1:])]))
                                              for k, v in cache.cross]   # padding only: no extra copy of a full bucket
        mk.set_cross_kv(cross)
        copy_prefilled_kv(mk, lambda i: (f"L{i}.kcache", f"L{i}.vcache"), list(zip(cache.k, cache.v)),
                          slice(0, rows), length)
        self.rows = rows

    def logits(self, token: int, position: int) -> torch.Tensor:
        """Logits [vocab] after feeding `token` at `position` (one window, the batch-1 step)."""
        self.mk.step([token], [position])
        return self.mk.logits[0].clone()

    def greedy_rows(self, first: list[int], position: int, timestamps: bool, max_new: int,
                    eot: int) -> tuple[list[list[int]], list[list[float]]]:
        """Each started window's greedy tokens from its first one (the host's choice, fed at
        `position`; EOT there: no tokens), up to max_new or EOT (excluded), and the log-probability
        of each token the steps chose for it (EOT's too)."""
        out: list[list[int]] = [[] for _ in first]
        for row, token in self.stream_rows(first, position, timestamps, max_new, eot):
            out[row].append(token)
        return out, self.scores

    def stream_rows(self, first: list[int], position: int, timestamps: bool, max_new: int | Sequence[int],
                    eot: int) -> Iterator[tuple[int, int]]:
        """greedy_rows' tokens as (row, token) pairs as the rounds give them (DeviceDecode.stream);
        `scores` holds the log-probabilities once they are all out."""
        bucket = bucket_for(self.rows)
        mk = self.decoder(bucket)
        rules, loop = self._loops[bucket]
        pad = bucket - len(first)
        live = [t if t != eot else 0 for t in first]   # a finished row still needs a token to feed
        mk.set_step(live + live[-1:] * pad, [position] * bucket)
        rules.reset([[t] for t in live + live[-1:] * pad], timestamps)
        self._scored = loop
        return loop.stream(first, max_new, {eot})

    @property
    def scores(self) -> list[list[float]]:
        """The log-probability of each token the last stream_rows' steps chose, per row (EOT's too)."""
        if self._scored is None:
            raise RuntimeError("no rounds have run yet")
        return self._scored.scores
