"""The toy Llama on the ops contract (the same code on every backend), with a KV cache, and its
skill: `query(None, text)` and `batch` through the shared runtime (runtime.generate's loop, sampling,
text streaming). On the megakernel backend each decoded token is one launch of the compiled step
(megakernel_decode.py) and greedy rows decode in rounds on the device.

Per layer: RMSNorm; q, k, v projections (no bias); rotary ("rotate half", whole head);
grouped-query causal attention; o_proj + residual; RMSNorm; SwiGLU MLP + residual. Then the
final RMSNorm and the LM head (the embedding table when tied).
"""
from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from photon_core.backends.select import get_backend
from photon_core.runtime.decode import BATCH_BUCKETS
from photon_core.runtime.generate import generate, room, token_lists
from photon_core.runtime.requests import Request
from photon_core.runtime.sampling import Sampling, pick
from photon_core.runtime.text_settings import text_sampling
from photon_core.runtime.text_stream import text_pieces
from photon_core.weights.tensor_files import default_dtype, parse_dtype

from .config import load_config
from .tokenizer import ByteTokenizer
from .weights import layer_tensors, load_tensors

MAX_ROWS = BATCH_BUCKETS[-1]
TEXT_ONLY = "a toy Llama model reads text only: pass image=None"


@dataclass
class KVCache:
    k: list[torch.Tensor]    # per layer [B, Hkv, T_max, D]
    v: list[torch.Tensor]
    lengths: torch.Tensor    # [B] int64: positions held per row

    def rows(self, keep: list[int]) -> "KVCache":
        return KVCache([k[keep] for k in self.k], [v[keep] for v in self.v], self.lengths[keep])


class ToyLlama:
    def __init__(self, folder: str | Path, device: str = "cpu", dtype: Any = None, backend: str = "auto",
                 max_len: int = 64) -> None:
        self.config = cfg = load_config(folder)
        self.device, self.dtype = torch.device(device), parse_dtype(dtype or default_dtype(device))
        self.ops = get_backend(backend, device)
        self.tokenizer = ByteTokenizer(cfg.bos_token_id, cfg.eos_token_id, cfg.vocab_size)
        self.max_len = min(max_len, cfg.max_positions)
        sd = load_tensors(folder, cfg)
        w = {k: t.to(self.device, self.dtype) for k, t in sd.items()}
        self.embed, self.norm = w["model.embed_tokens.weight"], w["model.norm.weight"]
        self.lm_head = self.embed if cfg.tie_embeddings else w["lm_head.weight"]
        self.layers = []
        for i in range(cfg.n_layers):
            n = layer_tensors(i)
            self.layers.append({"in_norm": w[n["in_norm"]], "qkv": torch.cat([w[n["q"]], w[n["k"]], w[n["v"]]]),
                                "o": w[n["o"]], "post_norm": w[n["post_norm"]],
                                "gate_up": torch.cat([w[n["gate"]], w[n["up"]]]), "down": w[n["down"]]})
        d = cfg.head_dim
        self.inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32, device=self.device) / d))
        self.generator = torch.Generator(self.device)
        self.model_id = Path(folder).name
        self.decode = None
        if getattr(self.ops, "COMPILES_STEPS", False):
            from .megakernel_decode import MegakernelDecode
            self.decode = MegakernelDecode(self)

    # ---------------------------------------------------------------- the decoder

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        angles = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        return angles.cos().to(self.dtype), angles.sin().to(self.dtype)

    def new_cache(self, rows: int, capacity: int) -> KVCache:
        cfg = self.config
        shape = (rows, cfg.n_kv_heads, capacity, cfg.head_dim)
        return KVCache([torch.zeros(shape, device=self.device, dtype=self.dtype) for _ in self.layers],
                       [torch.zeros(shape, device=self.device, dtype=self.dtype) for _ in self.layers],
                       torch.zeros(rows, dtype=torch.long, device=self.device))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.ops.linear(self.ops.rms_norm(hidden, self.norm, self.config.rms_eps), self.lm_head)

    def _layer(self, x: torch.Tensor, layer: dict[str, torch.Tensor], cos: torch.Tensor, sin: torch.Tensor,
               attend: Any) -> torch.Tensor:
        """x [B, T, hidden] through one layer; cos/sin [T, D/2] (T > 1) or [B, D/2] (one token per
        row); attend(q, k, v) -> [B, Hq, T, D] appends k, v to the cache and attends."""
        ops, cfg = self.ops, self.config
        b, t, _ = x.shape
        qkv = ops.linear(ops.rms_norm(x, layer["in_norm"], cfg.rms_eps), layer["qkv"])
        nq, nk = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
        q = qkv[..., :nq].reshape(b, t, cfg.n_heads, cfg.head_dim).transpose(1, 2)
        k = qkv[..., nq:nq + nk].reshape(b, t, cfg.n_kv_heads, cfg.head_dim).transpose(1, 2)
        v = qkv[..., nq + nk:].reshape(b, t, cfg.n_kv_heads, cfg.head_dim).transpose(1, 2).contiguous()
        if t == 1 and b > 1:   # rows in the time axis, so each row turns by its own position
            q, k = (ops.rotary(z[:, :, 0].transpose(0, 1).contiguous(), cos, sin, cfg.head_dim)
                    .transpose(0, 1)[:, :, None].contiguous() for z in (q, k))
        else:
            q, k = ops.rotary(q, cos, sin, cfg.head_dim), ops.rotary(k, cos, sin, cfg.head_dim)
        o = attend(q, k, v)
        x = ops.linear(o.transpose(1, 2).reshape(b, t, -1), layer["o"], residual=x)
        gu = ops.linear(ops.rms_norm(x, layer["post_norm"], cfg.rms_eps), layer["gate_up"])
        f = cfg.intermediate
        return ops.linear(ops.glu(gu[..., :f], gu[..., f:], "silu"), layer["down"], residual=x)

    def prefill(self, ids: Sequence[int], cache: KVCache, row: int) -> torch.Tensor:
        """A prompt's ids into an empty cache row -> the logits after it [vocab]."""
        ops, t = self.ops, len(ids)
        if not 1 <= t <= cache.k[0].shape[2]:
            raise ValueError(f"a prompt of {t} tokens does not fit the cache ({cache.k[0].shape[2]} positions)")
        cos, sin = self.rope(torch.arange(t, device=self.device))
        x = self.embed[torch.tensor(ids, device=self.device)][None]
        start = torch.zeros(1, dtype=torch.long, device=self.device)
        for i, layer in enumerate(self.layers):
            def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
                ops.kv_append(cache.k[i][row:row + 1], cache.v[i][row:row + 1], k, v, start)
                return ops.attention(q, k, v, causal=True)
            x = self._layer(x, layer, cos, sin, attend)
        cache.lengths[row] = t
        return self.logits(x[0, -1])

    def step(self, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """One token per cache row (int [B]) at the row's next position -> logits [B, vocab]."""
        ops = self.ops
        pos = cache.lengths.clone()
        cos, sin = self.rope(pos)
        lengths = pos + 1
        x = self.embed[tokens][:, None]
        for i, layer in enumerate(self.layers):
            def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
                ops.kv_append(cache.k[i], cache.v[i], k, v, pos)
                return ops.decode_attention(q, cache.k[i], cache.v[i], lengths)
            x = self._layer(x, layer, cos, sin, attend)
        cache.lengths.copy_(lengths)
        return self.logits(x[:, 0])

    # ---------------------------------------------------------------- the text skill

    def generate_ids(self, prompts: Sequence[Sequence[int]], sampling: Sequence[Sampling],
                     canceled: Callable[[int], bool] | None = None) -> list[list[int]]:
        """Each prompt's new ids (EOS excluded), the prompts decoded together as one batch."""
        return token_lists(self._tokens(prompts, sampling, canceled), len(prompts))

    def query(self, image: Any = None, question: str | None = None, reasoning: bool = False,
              spatial_refs: list[Any] | None = None, stream: bool = False,
              settings: dict[str, Any] | None = None) -> dict[str, Any]:
        """The continuation of `question` (image None: the family reads text only); settings as
        every family's (runtime.text_settings). stream: the answer as text pieces, a character
        split over tokens held back. Seeded sampling: seed `self.generator`."""
        s = text_sampling("the toy Llama", settings, reasoning, spatial_refs)
        if image is not None:
            raise ValueError(TEXT_ONLY)
        if not isinstance(question, str):
            raise ValueError("query needs a question")
        toks = (new[0] for new in self._tokens([self.tokenizer.encode(question)], [s]) if new[0] is not None)
        pieces = text_pieces(self.tokenizer.decode, toks)
        return {"answer": pieces if stream else "".join(pieces)}

    def batch(self, requests: list[Request]) -> list[dict[str, Any]]:
        """query requests (image None) decoded together; a canceled one stops at its next step."""
        for r in requests:
            if r.task != "query" or r.image is not None:
                raise ValueError(f"a toy Llama model answers text-only query requests, not {r.task!r}"
                                 f"{' with an image' if r.image is not None else ''}")
        sampling = [text_sampling("the toy Llama", r.options(), r.reasoning, r.spatial_refs) for r in requests]
        out = []
        for at in range(0, len(requests), MAX_ROWS):   # a compiled step holds at most MAX_ROWS rows
            part = requests[at:at + MAX_ROWS]
            ids = self.generate_ids([self.tokenizer.encode(r.prompt) for r in part],
                                    sampling[at:at + MAX_ROWS],
                                    lambda i: part[i].canceled)
            out += [{"answer": self.tokenizer.decode(t)} for t in ids]
        return out

    def _tokens(self, prompts: Sequence[Sequence[int]], sampling: Sequence[Sampling],
                canceled: Callable[[int], bool] | None = None) -> Iterator[list[int | None]]:
        """runtime.generate's steps; on the megakernel the compiled steps are held meanwhile."""
        if self.decode is not None:
            with self.decode.exclusive():
                yield from self._loop(self.decode.session(prompts), prompts, sampling, canceled)
            return
        yield from self._loop(OpsSession(self, prompts), prompts, sampling, canceled)

    def _loop(self, session: Any, prompts: Sequence[Sequence[int]], sampling: Sequence[Sampling],
              canceled: Callable[[int], bool] | None) -> Iterator[list[int | None]]:
        rooms = [room(s.max_tokens, len(p), self.max_len) for p, s in zip(prompts, sampling)]
        return generate(session, sampling, rooms, {self.tokenizer.eos},
                        lambda r, logits, _: pick(logits, sampling[r], self.ops, generator=self.generator),
                        canceled, device_rounds=self.decode is not None)


class OpsSession:
    """runtime.generate's session on the per-op decoder: the prompts prefilled one by one into
    rows of one cache, then stepped together."""

    def __init__(self, model: ToyLlama, prompts: Sequence[Sequence[int]]) -> None:
        self.model, self.cache = model, model.new_cache(len(prompts), model.max_len)
        self.first = torch.stack([model.prefill(p, self.cache, r) for r, p in enumerate(prompts)])

    def prefill(self) -> tuple[torch.Tensor, None]:
        return self.first, None

    def step(self, tokens: list[int]) -> tuple[torch.Tensor, None]:
        return self.model.step(torch.tensor(tokens, device=self.model.device), self.cache), None

    def keep(self, rows: list[int]) -> None:
        self.cache = self.cache.rows(rows)


def load_toy(path: str | Path, device: str = "cpu", dtype: Any = None, backend: str = "auto") -> ToyLlama:
    return ToyLlama(path, device, dtype, backend)


__all__ = ["ToyLlama", "load_toy", "KVCache", "OpsSession"]
