"""Whisper's per-token decode step as one megakernel launch (photon_core.megakernel).

The prompt is prefilled by the model's own ops (many tokens at once is not what the megakernel is
for); each following token is one persistent launch that runs every decoder layer, the
cross-attention and the LM head, leaving the logits for the host's timestamp rules.
"""
from __future__ import annotations

import torch

from .model import DecoderCache, WhisperNet


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
