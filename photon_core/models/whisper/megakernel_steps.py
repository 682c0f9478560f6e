"""Whisper's per-token decode step as one megakernel launch (photon_core.megakernel).

The prompt is prefilled by the model's own ops (many tokens at once is not what the megakernel is
for); each following token is one persistent launch that runs every decoder layer, the
cross-attention and the LM head. Greedy windows decode in rounds on the device (`greedy`: the
logit rules as device ops, device_rules.py, and megakernel.decode_loop: on CUDA one CUDA-graph
replay and one read of the device per round of up to 8 tokens); sampling (temperature fallback)
reads each step's logits for the host's rules (`logits`).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .model import DecoderCache, WhisperNet

if TYPE_CHECKING:
    from .decoding import WindowDecoder


class MegakernelSteps:
    def __init__(self, net: WhisperNet, weight_dtype: torch.dtype = torch.float32,
                 tiling=None) -> None:
        """tiling: photon_core.models.whisper.decoder_step.Tiling; None = the GPU default."""
        from photon_core.models.whisper.decoder_step import (Tiling, WhisperDecoderMegakernel,
                                                            WhisperDecoderWeights)
        d = net.dims
        self.n_layers = d.n_text_layer
        # Built once per model: weight re-layout and graph building are load-time work.
        self.mk = WhisperDecoderMegakernel(WhisperDecoderWeights.from_whisper(net.w), batch=1,
                                           max_len=d.n_text_ctx, enc_len=d.n_audio_ctx,
                                           tiling=tiling or Tiling(), weight_dtype=weight_dtype)
        self.rules = self.loop = None

    def prepare(self, decoder: "WindowDecoder") -> None:
        """Build the device rules and the round loop once, before `start` writes a window's caches
        (on CUDA building the loop captures rounds, which runs steps)."""
        if self.loop is None:
            from photon_core.megakernel.decode_loop import DeviceDecode

            from .device_rules import DeviceRules
            self.rules = DeviceRules(decoder, self.mk.logits)
            self.loop = DeviceDecode(self.mk, pick=self.rules)

    def start(self, cache: DecoderCache, length: int) -> None:
        """Continue from a prefilled cache: its cross K/V and its first `length` positions."""
        self.mk.set_cross_kv(cache.cross)
        for i in range(self.n_layers):
            self.mk.view(f"L{i}.kcache")[:, :, :length] = cache.k[i, :, :, :length].float()
            self.mk.view(f"L{i}.vcache")[:, :, :length] = cache.v[i, :, :, :length].float()

    def logits(self, token: int, position: int) -> torch.Tensor:
        """Logits [vocab] after feeding `token` at `position`."""
        self.mk.step([token], [position])
        return self.mk.logits[0].clone()

    def greedy(self, first: int, position: int, timestamps: bool, max_new: int,
               eot: int) -> tuple[list[int], list[float]]:
        """Greedy tokens from `first` (the host's choice, fed at `position`), up to max_new of them
        or EOT (excluded), and the log-probability of each token the steps chose (EOT's too)."""
        self.mk.set_step([first], [position])
        self.rules.reset([[first]], timestamps)
        tokens = self.loop.generate([first], max_new, {eot})[0]
        return tokens, self.loop.scores[0]
