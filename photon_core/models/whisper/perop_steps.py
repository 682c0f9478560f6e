"""Whisper's per-token decode step from the per-op Triton kernels, replayable as one CUDA graph.

The "triton" backend. The prompt is prefilled by the model's own ops; each following token runs
decoder_step.triton_perop_step (every layer's kernels, cross-attention, LM head) on
static buffers: the token and position are device tensors written in place, the self-attention
caches and the window's cross K/V live in fixed tensors, and the logits land in one output tensor.
Nothing in a step depends on the host, so on CUDA the step is captured once in a CUDA graph and
each token is one replay; elsewhere (the CPU interpreter, in tests) the same function runs eagerly.
"""
from __future__ import annotations

from types import ModuleType

import torch

from .model import DecoderCache, WhisperNet


class PerOpSteps:
    def __init__(self, net: WhisperNet, ops: ModuleType) -> None:
        from photon_core.models.whisper.decoder_step import WhisperDecoderWeights

        d, dev = net.dims, net.w.device
        self.ops = ops
        self.wt = WhisperDecoderWeights.from_whisper(net.w)   # shares the model's tensors
        self.n_layers = d.n_text_layer
        h, dh = d.n_text_head, d.n_text_state // d.n_text_head
        self.tokens = torch.zeros(1, dtype=torch.int32, device=dev)
        self.positions = torch.zeros(1, dtype=torch.int32, device=dev)
        self.self_kv = [(torch.zeros(1, h, d.n_text_ctx, dh, device=dev),
                         torch.zeros(1, h, d.n_text_ctx, dh, device=dev)) for _ in range(d.n_text_layer)]
        self.cross_kv = [(torch.zeros(1, h, d.n_audio_ctx, dh, device=dev),
                          torch.zeros(1, h, d.n_audio_ctx, dh, device=dev)) for _ in range(d.n_text_layer)]
        self.cross_len = torch.full((1,), d.n_audio_ctx, dtype=torch.int32, device=dev)
        self._graph: torch.cuda.CUDAGraph | None = None
        self._logits: torch.Tensor | None = None

    def start(self, cache: DecoderCache, length: int) -> None:
        """Continue from a prefilled cache: its cross K/V and its first `length` positions, copied
        into the static buffers (in place, so a captured graph stays valid)."""
        for (k, v), (ck, cv) in zip(self.cross_kv, cache.cross):
            k.copy_(ck)
            v.copy_(cv)
        for i, (k, v) in enumerate(self.self_kv):
            k[:, :, :length] = cache.k[i, :, :, :length]
            v[:, :, :length] = cache.v[i, :, :, :length]

    def _step(self) -> torch.Tensor:
        from photon_core.models.whisper.decoder_step import triton_perop_step

        logits, _ = triton_perop_step(self.ops, self.wt, self.tokens, self.positions, self.self_kv,
                                      self.cross_kv, self.cross_len)
        return logits

    def logits(self, token: int, position: int) -> torch.Tensor:
        """Logits [vocab] after feeding `token` at `position`."""
        self.tokens.fill_(token)
        self.positions.fill_(position)
        if self.tokens.device.type != "cuda":
            return self._step()[0].clone()
        if self._graph is None:
            from photon_core.runtime.cuda_graph import capture
            # The warm-up runs execute this very step (same token, same position), so running it
            # again on replay rewrites the same cache entries with the same values.
            self._graph, self._logits = capture(self._step)
        self._graph.replay()
        assert self._logits is not None   # captured with the graph
        return self._logits[0].clone()
