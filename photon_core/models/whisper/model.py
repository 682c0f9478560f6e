"""Whisper encoder and decoder on backend ops (linear, layer_norm, attention), with a KV cache.

One definition for every backend: the model calls `ops.linear`, `ops.layer_norm` and
`ops.attention` on a backend module (photon_core.backends.reference by default), so another
backend with the same functions can be swapped in. The convolution stem is written as im2col +
`ops.linear` for the same reason.

Load-time work happens once in `WhisperWeights.__init__`: fp16/bf16 -> compute dtype, fused QKV
(self-attention) and KV (cross-attention) matrices, output projection re-laid out for fast
matrix-vector products (backends get it as a strided [vocab, d] view). The decoder keeps a
preallocated self-attention cache; cross-attention K/V are computed once per audio window.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from types import ModuleType

import torch

from photon_core.backends import reference

from .config import WhisperDims


@dataclass
class _Int8:
    weight_t: torch.Tensor    # [in, out] int8: a transposed view of the [out, in] rows
    scale: torch.Tensor       # [out] float32, one per output channel
    bias: torch.Tensor | None


@dataclass
class _Linear:
    weight: torch.Tensor
    bias: torch.Tensor | None
    int8: object | None = None      # _Int8 (quantize_int8_) or fbgemm-packed (pack_dynamic_int8_)


def quantize_int8_(w: _Linear) -> None:
    """int8 weights for `int8_matmul`, symmetric per output channel. CPU only."""
    weight = w.weight.float()
    scale = (weight.abs().amax(dim=1) / 127.0).clamp_min(1e-12)
    q = torch.round(weight / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    w.int8 = _Int8(q.t(), scale, None if w.bias is None else w.bias.float())


def int8_matmul(x: torch.Tensor, q: _Int8) -> torch.Tensor:
    """x [M, in] float @ int8 weights -> [M, out] float32. Activations are quantized per row
    (symmetric, 127 levels, the row's own max), as CTranslate2 does: unlike one scale for the
    whole call (torch's dynamic linear), a loud frame does not coarsen the others, and a row's
    result does not depend on the other rows. int8 x int8 -> int32 is exact. Used for the
    encoder's large products; for one decoder token its ~8 extra elementwise ops cost more than
    fbgemm's fused dynamic linear (per token: 16 vs 9 ms on a loaded 2-core machine)."""
    x = x.float()
    s = x.abs().amax(dim=1, keepdim=True).clamp_min_(1e-12) / 127.0
    xi = (x / s).round_().to(torch.int8)
    y = torch._int_mm(xi, q.weight_t) * (s * q.scale)
    return y if q.bias is None else y.add_(q.bias)


def cpu_flags() -> set[str]:
    """The CPU's feature flags as Linux names them in /proc/cpuinfo (empty where it is missing)."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="ignore") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def cpu_has_vnni() -> bool:
    """AVX-512 VNNI, the flag fbgemm's 8-bit kernels and torch.cpu._is_vnni_supported look for.
    AVX-VNNI alone (256-bit, e.g. Alder Lake) is not it: fbgemm then runs its AVX2 kernels."""
    return "avx512_vnni" in cpu_flags()


# Activations are quantized to 7 bits where the CPU lacks VNNI (fbgemm's u8 x s8 pair products
# then cannot saturate the 16-bit intermediate of AVX2's vpmaddubsw), to 8 bits with VNNI.
REDUCE_RANGE = not cpu_has_vnni()


def pack_dynamic_int8_(w: _Linear) -> None:
    """Pack w for torch's dynamic-int8 linear (fbgemm/onednn on x86): weights int8 per output
    channel (symmetric), activations quantized per call. CPU only."""
    scale = (w.weight.float().abs().amax(dim=1) / 127.0).clamp_min(1e-12)
    with warnings.catch_warnings():   # quantized tensors are deprecated upstream; pinned torch has them
        warnings.simplefilter("ignore", UserWarning)
        q = torch.quantize_per_channel(w.weight.float(), scale, torch.zeros_like(scale, dtype=torch.long), 0,
                                       torch.qint8)
    w.int8 = torch.ops.quantized.linear_prepack(q, None if w.bias is None else w.bias.float())


def _dynamic_int8(x: torch.Tensor, packed: object) -> torch.Tensor:
    """fbgemm's dynamic linear, one call per sequence of x [B, T, in]: the activation scale is
    per call, so this keeps each sequence's numbers what they are when it runs alone (batching)."""
    if x.dim() == 3 and x.shape[0] > 1:
        return torch.stack([_dynamic_int8(row, packed) for row in x])
    y = torch.ops.quantized.linear_dynamic(x.reshape(-1, x.shape[-1]).float().contiguous(), packed, REDUCE_RANGE)
    return y.view(*x.shape[:-1], y.shape[-1])


def linear(ops: ModuleType, x: torch.Tensor, w: _Linear, activation: str | None = None,
           residual: torch.Tensor | None = None) -> torch.Tensor:
    """ops.linear, or the int8 product where the weights were quantized."""
    q = getattr(w, "int8", None)
    if q is None:
        return ops.linear(x, w.weight, w.bias, activation=activation, residual=residual)
    if isinstance(q, _Int8):
        y = int8_matmul(x.reshape(-1, x.shape[-1]), q).view(*x.shape[:-1], q.scale.shape[0])
    else:
        y = _dynamic_int8(x, q)
    if activation == "gelu":
        y = torch.nn.functional.gelu(y)
    elif activation is not None:
        raise ValueError(f"int8 linear: activation {activation!r}")
    return y if residual is None else y.add_(residual)


@dataclass
class _Norm:
    weight: torch.Tensor
    bias: torch.Tensor


@dataclass
class _Block:
    attn_ln: _Norm
    qkv: _Linear            # fused [query; key; value], key bias zero
    attn_out: _Linear
    mlp_ln: _Norm
    fc1: _Linear
    fc2: _Linear


@dataclass
class _DecoderBlock(_Block):
    cross_ln: _Norm
    cross_q: _Linear
    cross_kv: _Linear   # fused [key; value], key bias zero
    cross_out: _Linear


class WhisperWeights:
    """All tensors of one model, re-laid out for the forward pass."""

    def __init__(self, sd: dict[str, torch.Tensor], dims: WhisperDims,
                 device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32):
        def t(name: str) -> torch.Tensor:
            return sd[name].to(device=device, dtype=dtype).contiguous()

        def lin(name: str, bias: bool = True) -> _Linear:
            return _Linear(t(name + ".weight"), t(name + ".bias") if bias else None)

        def norm(name: str) -> _Norm:
            return _Norm(t(name + ".weight"), t(name + ".bias"))

        def fused(prefix: str, names: tuple[str, ...]) -> _Linear:
            ws = [t(f"{prefix}.{n}.weight") for n in names]
            bs = [t(f"{prefix}.{n}.bias") if f"{prefix}.{n}.bias" in sd
                  else torch.zeros(ws[0].shape[0], device=device, dtype=dtype) for n in names]
            return _Linear(torch.cat(ws).contiguous(), torch.cat(bs).contiguous())

        def block(prefix: str) -> _Block:
            return _Block(norm(f"{prefix}.attn_ln"), fused(f"{prefix}.attn", ("query", "key", "value")),
                          lin(f"{prefix}.attn.out"), norm(f"{prefix}.mlp_ln"),
                          lin(f"{prefix}.mlp.0"), lin(f"{prefix}.mlp.2"))

        def decoder_block(prefix: str) -> _DecoderBlock:
            return _DecoderBlock(**vars(block(prefix)), cross_ln=norm(f"{prefix}.cross_attn_ln"),
                                 cross_q=lin(f"{prefix}.cross_attn.query"),
                                 cross_kv=fused(f"{prefix}.cross_attn", ("key", "value")),
                                 cross_out=lin(f"{prefix}.cross_attn.out"))

        self.dims = dims
        self.device = torch.device(device)
        self.dtype = dtype
        # conv weights [out, in, 3] -> [out, in * 3] so the stem is im2col + linear
        self.conv1 = _Linear(t("encoder.conv1.weight").flatten(1), t("encoder.conv1.bias"))
        self.conv2 = _Linear(t("encoder.conv2.weight").flatten(1), t("encoder.conv2.bias"))
        self.enc_pos = t("encoder.positional_embedding")
        self.enc_blocks = [block(f"encoder.blocks.{i}") for i in range(dims.n_audio_layer)]
        self.enc_ln = norm("encoder.ln_post")
        # Stored [d, vocab] and used through a transposed view: the per-token logits product
        # (a matrix-vector product over the whole vocabulary, the decoder's largest) runs ~2x
        # faster on CPU BLAS with this layout; embedding lookups read the same memory.
        self.tok_emb_t = t("decoder.token_embedding.weight").t().contiguous()
        self.tok_emb = self.tok_emb_t.t()
        self.dec_pos = t("decoder.positional_embedding")
        self.dec_blocks = [decoder_block(f"decoder.blocks.{i}") for i in range(dims.n_text_layer)]
        self.dec_ln = norm("decoder.ln")
        self.lm_head = _Linear(self.tok_emb, None)   # the tied output projection, for int8 packing

    def quantize_int8(self, encoder: bool = True, decoder: bool = True) -> None:
        """int8 products (CPU). Encoder blocks: per-row activation scales (`int8_matmul`); the
        convolution stem stays float32 (in int8 it cost 6 WER points on the broad speech set,
        bench/speech.py 2026-12-01: 0.304 vs 0.241, blocks and decoder per-row int8 in both).
        Decoder linears, the tied LM head included: fbgemm's dynamic linear (faster per token)."""
        names = ("qkv", "attn_out", "fc1", "fc2", "cross_q", "cross_kv", "cross_out")
        for b in self.enc_blocks if encoder else []:
            for f in names[:4]:
                quantize_int8_(getattr(b, f))
        for b in self.dec_blocks if decoder else []:
            for f in names:
                pack_dynamic_int8_(getattr(b, f))
        if decoder:
            pack_dynamic_int8_(self.lm_head)


def _conv_as_linear(ops: ModuleType, x: torch.Tensor, w: _Linear, stride: int) -> torch.Tensor:
    """Conv1d (kernel 3, padding 1) + GELU on time-major [B, T, C] as im2col + linear
    -> [B, T', out]. Time-major input makes each output frame's patch 3 consecutive rows, so the
    patch matrix is copied in memory order (from the channel-major [B, C, T] layout the same copy
    took ~4x longer for conv2: 8 ms of the encoder's ~300 ms, now 2 ms); the values are the same."""
    x = torch.nn.functional.pad(x, (0, 0, 1, 1))       # pad time by one frame on each side
    cols = x.unfold(1, 3, stride).flatten(2)           # [B, T', C*3], matches weight [out, C, 3]
    return linear(ops, cols, w, activation="gelu")


def _heads(x: torch.Tensor, n_head: int) -> torch.Tensor:
    b, t, d = x.shape
    return x.view(b, t, n_head, d // n_head).transpose(1, 2)


def _merge(x: torch.Tensor) -> torch.Tensor:
    b, h, t, dh = x.shape
    return x.transpose(1, 2).reshape(b, t, h * dh)


class WhisperNet:
    """The forward pass: `encode(mel)`, `cross_kv(features)` -> `new_cache(cross)`,
    `decode(tokens, offset, cache)` -> hidden states, `logits(hidden)`."""

    def __init__(self, weights: WhisperWeights, ops: ModuleType = reference):
        self.w = weights
        self.dims = weights.dims
        self.ops = ops

    def encode(self, mel: torch.Tensor) -> torch.Tensor:
        """[B, n_mels, F] log-mel -> [B, F / 2, d] audio features. F is 2 * n_audio_ctx (30 s) as
        the model was trained, or fewer (an even count: a fitted context, longform.encoder_frames)."""
        ops, w, d = self.ops, self.w, self.dims
        frames = mel.shape[-1]
        if mel.dim() != 3 or mel.shape[1] != d.n_mels or frames % 2 or not 0 < frames <= 2 * d.n_audio_ctx:
            raise ValueError(f"encoder input must be [B, {d.n_mels}, F] with F even and at most "
                             f"{2 * d.n_audio_ctx}, got {list(mel.shape)}")
        x = _conv_as_linear(ops, mel.to(w.conv1.weight.dtype).transpose(1, 2), w.conv1, 1)
        x = _conv_as_linear(ops, x, w.conv2, 2)
        x = x + w.enc_pos[:frames // 2]
        for b in w.enc_blocks:
            h = ops.layer_norm(x, b.attn_ln.weight, b.attn_ln.bias)
            q, k, v = linear(ops, h, b.qkv).chunk(3, dim=-1)
            a = ops.attention(_heads(q, d.n_audio_head), _heads(k, d.n_audio_head),
                              _heads(v, d.n_audio_head))
            x = linear(ops, _merge(a), b.attn_out, residual=x)
            h = ops.layer_norm(x, b.mlp_ln.weight, b.mlp_ln.bias)
            h = linear(ops, h, b.fc1, activation="gelu")
            x = linear(ops, h, b.fc2, residual=x)
        return ops.layer_norm(x, w.enc_ln.weight, w.enc_ln.bias)

    def cross_kv(self, features: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Cross-attention K/V [B, H, n_audio_ctx, Dh] of every decoder layer: computed once per
        audio window and shared by every decoding attempt on it."""
        d, w = self.dims, self.w
        features = features.to(w.tok_emb.dtype)
        cross = []
        for b in w.dec_blocks:
            k, v = linear(self.ops, features, b.cross_kv).chunk(2, dim=-1)
            cross.append((_heads(k, d.n_text_head).contiguous(),
                          _heads(v, d.n_text_head).contiguous()))
        return cross

    def new_cache(self, cross: list[tuple[torch.Tensor, torch.Tensor]]) -> DecoderCache:
        """A decoding state: the window's cross K/V and an empty self-attention cache,
        preallocated for n_text_ctx positions."""
        d, w = self.dims, self.w
        bsz = cross[0][0].shape[0]
        shape = (d.n_text_layer, bsz, d.n_text_head, d.n_text_ctx, d.n_text_state // d.n_text_head)
        k_cache = torch.empty(shape, device=w.device, dtype=w.tok_emb.dtype)
        return DecoderCache(cross, k_cache, torch.empty_like(k_cache))

    def decode(self, tokens: torch.Tensor, offset: int, cache: DecoderCache) -> torch.Tensor:
        """Hidden states [B, T, d] (after the final norm) for `tokens` [B, T] at positions
        offset..offset+T-1, attending to cached positions < offset; updates the cache."""
        ops, w, d = self.ops, self.w, self.dims
        n = tokens.shape[1]
        end = offset + n
        if end > d.n_text_ctx:
            raise ValueError(f"decoder context is {d.n_text_ctx} tokens; asked for {end}")
        x = w.tok_emb[tokens] + w.dec_pos[offset:end]
        for i, b in enumerate(w.dec_blocks):
            h = ops.layer_norm(x, b.attn_ln.weight, b.attn_ln.bias)
            q, k, v = linear(ops, h, b.qkv).chunk(3, dim=-1)
            cache.k[i, :, :, offset:end] = _heads(k, d.n_text_head)
            cache.v[i, :, :, offset:end] = _heads(v, d.n_text_head)
            a = ops.attention(_heads(q, d.n_text_head), cache.k[i, :, :, :end],
                              cache.v[i, :, :, :end], causal=n > 1)
            x = linear(ops, _merge(a), b.attn_out, residual=x)
            h = ops.layer_norm(x, b.cross_ln.weight, b.cross_ln.bias)
            q = linear(ops, h, b.cross_q)
            ck, cv = cache.cross[i]
            a = ops.attention(_heads(q, d.n_text_head), ck, cv)
            x = linear(ops, _merge(a), b.cross_out, residual=x)
            h = ops.layer_norm(x, b.mlp_ln.weight, b.mlp_ln.bias)
            h = linear(ops, h, b.fc1, activation="gelu")
            x = linear(ops, h, b.fc2, residual=x)
        return ops.layer_norm(x, w.dec_ln.weight, w.dec_ln.bias)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Vocabulary logits (float32) through the tied token embedding."""
        return linear(self.ops, hidden, self.w.lm_head).float()


@dataclass
class DecoderCache:
    cross: list[tuple[torch.Tensor, torch.Tensor]]   # per layer: K, V [B, H, n_audio_ctx, Dh]
    k: torch.Tensor                                   # [layers, B, H, n_text_ctx, Dh]
    v: torch.Tensor
