"""Qwen3-ASR's text decoder (a Qwen3 stack) on the ops contract, with a KV cache.

Per layer: RMSNorm; q, k, v projections (no bias); per-head RMSNorm on q and on k; rotary
("rotate half", full head dim); grouped-query causal attention; o_proj + residual; RMSNorm;
SwiGLU MLP (silu(gate) * up, down) + residual. Then the final RMSNorm and the LM head (tied to
the embeddings unless the checkpoint has its own). Rows of the cache are independent
utterances: each is prefilled alone, then the unfinished ones step together, each at its own
position (a finished one leaves the cache).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType

import torch

from .checkpoint import owned
from .config import TextConfig


@dataclass
class _Layer:
    in_norm: torch.Tensor
    qkv: torch.Tensor        # [q; k; v] stacked rows: one projection
    q_norm: torch.Tensor
    k_norm: torch.Tensor
    o: torch.Tensor
    post_norm: torch.Tensor
    gate_up: torch.Tensor    # [gate; up]
    down: torch.Tensor


@dataclass
class KVCache:
    k: list[torch.Tensor]    # per layer [B, Hkv, T_max, D]
    v: list[torch.Tensor]
    lengths: torch.Tensor    # [B] int64: tokens held per row

    @property
    def capacity(self) -> int:
        return self.k[0].shape[2]

    def keep(self, rows: list[int]) -> None:
        """Drop the other rows (finished utterances): a finished row stepping on would run past
        the positions its budget sized the cache for, and would cost every later step."""
        idx = torch.tensor(rows, dtype=torch.long, device=self.lengths.device)
        self.k = [k.index_select(0, idx) for k in self.k]
        self.v = [v.index_select(0, idx) for v in self.v]
        self.lengths = self.lengths.index_select(0, idx)


class TextDecoder:
    def __init__(self, sd: dict[str, torch.Tensor], cfg: TextConfig, ops: ModuleType,
                 device: torch.device, dtype: torch.dtype = torch.float32) -> None:
        self.cfg, self.ops, self.device, self.dtype = cfg, ops, device, dtype

        def t(name: str) -> torch.Tensor:
            return owned(sd[f"language_model.{name}"], device, dtype)

        self.embed = t("embed_tokens.weight")
        self.layers = []
        for i in range(cfg.n_layers):
            p = f"layers.{i}."
            a = p + "self_attn."
            self.layers.append(_Layer(
                t(p + "input_layernorm.weight"),
                torch.cat([t(a + "q_proj.weight"), t(a + "k_proj.weight"), t(a + "v_proj.weight")]),
                t(a + "q_norm.weight"), t(a + "k_norm.weight"), t(a + "o_proj.weight"),
                t(p + "post_attention_layernorm.weight"),
                torch.cat([t(p + "mlp.gate_proj.weight"), t(p + "mlp.up_proj.weight")]),
                t(p + "mlp.down_proj.weight")))
        self.norm = t("norm.weight")
        if "lm_head.weight" in sd and not cfg.tie_embeddings:
            self.lm_head = owned(sd["lm_head.weight"], device, dtype)
        else:
            self.lm_head = self.embed
        d = cfg.head_dim
        self.inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32, device=device) / d))

    # ---------------------------------------------------------------- pieces

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, head_dim / 2] for int positions [T]."""
        angles = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        return angles.cos().to(self.dtype), angles.sin().to(self.dtype)

    def new_cache(self, batch: int, capacity: int) -> KVCache:
        cfg = self.cfg
        shape = (batch, cfg.n_kv_heads, capacity, cfg.head_dim)
        return KVCache([torch.zeros(shape, device=self.device, dtype=self.dtype) for _ in self.layers],
                       [torch.zeros(shape, device=self.device, dtype=self.dtype) for _ in self.layers],
                       torch.zeros(batch, dtype=torch.long, device=self.device))

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed[ids]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.ops.linear(self.ops.rms_norm(hidden, self.norm, self.cfg.rms_eps), self.lm_head)

    def _qkv(self, h: torch.Tensor, layer: _Layer) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[B, T, hidden] -> q [B, Hq, T, D], k, v [B, Hkv, T, D], q and k normed per head."""
        cfg, ops = self.cfg, self.ops
        b, t, _ = h.shape
        qkv = ops.linear(h, layer.qkv)
        nq, nk = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
        q = qkv[..., :nq].reshape(b, t, cfg.n_heads, cfg.head_dim)
        k = qkv[..., nq:nq + nk].reshape(b, t, cfg.n_kv_heads, cfg.head_dim)
        v = qkv[..., nq + nk:].reshape(b, t, cfg.n_kv_heads, cfg.head_dim)
        q = ops.rms_norm(q, layer.q_norm, cfg.rms_eps).transpose(1, 2)
        k = ops.rms_norm(k, layer.k_norm, cfg.rms_eps).transpose(1, 2)
        return q, k, v.transpose(1, 2)

    def _mlp(self, x: torch.Tensor, layer: _Layer) -> torch.Tensor:
        ops = self.ops
        h = ops.rms_norm(x, layer.post_norm, self.cfg.rms_eps)
        gu = ops.linear(h, layer.gate_up)
        f = self.cfg.intermediate
        return ops.linear(ops.glu(gu[..., :f], gu[..., f:], "silu"), layer.down, residual=x)

    # ---------------------------------------------------------------- passes

    def prefill(self, embeds: torch.Tensor, cache: KVCache, row: int) -> torch.Tensor:
        """A prompt's embeddings [T, hidden] into an empty cache row -> hidden states [T, hidden]."""
        ops, cfg = self.ops, self.cfg
        t = embeds.shape[0]
        if t > cache.capacity:
            raise ValueError(f"prompt of {t} tokens exceeds the cache ({cache.capacity})")
        cos, sin = self.rope(torch.arange(t, device=self.device))
        pos = torch.zeros(1, dtype=torch.long, device=self.device)
        x = embeds[None].to(self.dtype)
        for i, layer in enumerate(self.layers):
            q, k, v = self._qkv(ops.rms_norm(x, layer.in_norm, cfg.rms_eps), layer)
            q, k = ops.rotary(q, cos, sin, cfg.head_dim), ops.rotary(k, cos, sin, cfg.head_dim)
            ops.kv_append(cache.k[i][row:row + 1], cache.v[i][row:row + 1], k, v, pos)
            o = ops.attention(q, k, v, causal=True)
            x = ops.linear(o.transpose(1, 2).reshape(1, t, -1), layer.o, residual=x)
            x = self._mlp(x, layer)
        cache.lengths[row] = t
        return x[0]

    def step(self, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """One new token per cache row (int [B]) at that row's next position -> logits [B, vocab]."""
        ops, cfg = self.ops, self.cfg
        b = tokens.shape[0]
        if int(cache.lengths.max()) >= cache.capacity:
            raise ValueError(f"the KV cache ({cache.capacity} positions) is full")
        pos = cache.lengths.clone()
        cos, sin = self.rope(pos)                    # [B, D/2]: one position per row
        lengths = pos + 1
        x = self.embed[tokens][:, None]              # [B, 1, hidden]
        for i, layer in enumerate(self.layers):
            q, k, v = self._qkv(ops.rms_norm(x, layer.in_norm, cfg.rms_eps), layer)
            # rows in the time axis, so each row gets its own position's rotation: [H, B, D]
            q = ops.rotary(q[:, :, 0].transpose(0, 1).contiguous(), cos, sin, cfg.head_dim).transpose(0, 1)[:, :, None]
            k = ops.rotary(k[:, :, 0].transpose(0, 1).contiguous(), cos, sin, cfg.head_dim).transpose(0, 1)[:, :, None]
            ops.kv_append(cache.k[i], cache.v[i], k, v, pos)
            o = ops.decode_attention(q.contiguous(), cache.k[i], cache.v[i], lengths)
            x = ops.linear(o.transpose(1, 2).reshape(b, 1, -1), layer.o, residual=x)
            x = self._mlp(x, layer)
        cache.lengths.copy_(lengths)
        return self.logits(x[:, 0])


class OpsSession:
    """runtime.generate's session on the per-op decoder: each prompt's embeddings [T, hidden]
    prefilled alone into its row of one cache, then the live rows stepped together, each at its own
    position; a finished row leaves the cache (`keep`)."""

    def __init__(self, dec: TextDecoder, prompts: Sequence[torch.Tensor], capacity: int) -> None:
        self.dec, self.cache = dec, dec.new_cache(len(prompts), capacity)
        self.first = torch.cat([dec.logits(dec.prefill(p, self.cache, r)[-1:]) for r, p in enumerate(prompts)])

    def prefill(self) -> tuple[torch.Tensor, None]:
        return self.first, None

    def step(self, tokens: list[int]) -> tuple[torch.Tensor, None]:
        return self.dec.step(torch.tensor(tokens, dtype=torch.long, device=self.dec.device), self.cache), None

    def keep(self, rows: list[int]) -> None:
        self.cache.keep(rows)
