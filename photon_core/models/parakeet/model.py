"""Parakeet TDT on the ops contract: FastConformer encoder, LSTM prediction network, joint network.

Tensor names are transformers' (checkpoint.py maps NeMo's onto them). Weights are re-laid out once
at load: q/k/v fused into one projection, the conformer's 0.5 feed-forward residual factor folded
into the second linear, eval-mode BatchNorm folded into the depthwise conv, 1x1 convs as linears.

Outside the contract, inline torch: the 3x3 depthwise convs of the 8x subsampling stem (the first
conv runs as im2col + ops.linear), and the position term of the relative-position attention
(Transformer-XL's (q+v)·R(i-j), a small einsum + gather) which ops.attention takes as its `bias`.
"""
from __future__ import annotations

import math
from types import ModuleType

import torch
import torch.nn.functional as F

from .config import ParakeetConfig

Tensor = torch.Tensor


class EncoderLayer:
    def __init__(self, t: dict[str, Tensor], i: int, cfg: ParakeetConfig, dtype: torch.dtype) -> None:
        p = f"encoder.layers.{i}."

        def w(name: str) -> Tensor:
            return t[p + name].to(dtype).contiguous()

        def opt(name: str) -> Tensor | None:
            return w(name) if p + name in t else None

        def ff(n: int) -> tuple:
            w2, b2 = t[p + f"feed_forward{n}.linear2.weight"], t.get(p + f"feed_forward{n}.linear2.bias")
            return (w(f"feed_forward{n}.linear1.weight"), opt(f"feed_forward{n}.linear1.bias"),
                    (0.5 * w2).to(dtype), None if b2 is None else (0.5 * b2).to(dtype))

        self.norms = {n: (w(f"norm_{n}.weight"), w(f"norm_{n}.bias"))
                      for n in ("feed_forward1", "self_att", "conv", "feed_forward2", "out")}
        self.ff1, self.ff2 = ff(1), ff(2)
        q, k, v = (f"self_attn.{x}_proj" for x in "qkv")
        self.w_qkv = torch.cat([w(q + ".weight"), w(k + ".weight"), w(v + ".weight")])
        self.b_qkv = (torch.cat([w(q + ".bias"), w(k + ".bias"), w(v + ".bias")])
                      if p + q + ".bias" in t else None)
        self.w_o, self.b_o = w("self_attn.o_proj.weight"), opt("self_attn.o_proj.bias")
        self.w_pos = w("self_attn.relative_k_proj.weight")
        self.bias_u = t[p + "self_attn.bias_u"].float()
        self.bias_v = t[p + "self_attn.bias_v"].float()
        self.w_pw1 = w("conv.pointwise_conv1.weight")[..., 0].contiguous()
        self.b_pw1 = opt("conv.pointwise_conv1.bias")
        self.w_pw2 = w("conv.pointwise_conv2.weight")[..., 0].contiguous()
        self.b_pw2 = opt("conv.pointwise_conv2.bias")
        # depthwise conv then BatchNorm (running statistics) is one depthwise conv
        dw = t[p + "conv.depthwise_conv.weight"].float()[:, 0]
        dw_b = t.get(p + "conv.depthwise_conv.bias")
        dw_b = torch.zeros(dw.shape[0]) if dw_b is None else dw_b.float()
        scale = t[p + "conv.norm.weight"].float() / torch.sqrt(t[p + "conv.norm.running_var"].float() + 1e-5)
        self.w_dw = (dw * scale[:, None]).to(dtype).contiguous()
        self.b_dw = ((dw_b - t[p + "conv.norm.running_mean"].float()) * scale
                     + t[p + "conv.norm.bias"].float()).to(dtype)


class ParakeetModel:
    def __init__(self, tensors: dict[str, Tensor], cfg: ParakeetConfig, ops: ModuleType,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> None:
        self.cfg, self.ops, self.dtype = cfg, ops, dtype
        self.device = torch.device(device)
        # in memory of its own: a safetensors tensor as loaded is a private file mapping, whose
        # clean pages the kernel drops under memory pressure and re-reads from disk mid-utterance
        t = {k: v.to(self.device) for k, v in tensors.items()}
        t = {k: v.clone() if v.data_ptr() == tensors[k].data_ptr() else v for k, v in t.items()}
        missing = [n for n in ("encoder.subsampling.linear.weight", "joint.head.weight",
                               "decoder.embedding.weight", "encoder_projector.weight")
                   if n not in t]
        if missing:
            raise ValueError(f"Parakeet checkpoint lacks {missing}")
        n_stages = int(math.log2(cfg.subsampling_factor))
        k = cfg.subsampling_kernel
        sub = "encoder.subsampling.layers."
        self.stem_w = t[sub + "0.weight"].reshape(cfg.subsampling_channels, k * k).to(dtype)
        self.stem_b = t[sub + "0.bias"].to(dtype)
        # nn.Sequential indices: conv, relu, then (depthwise, pointwise, relu) per further stage
        self.stages = [(t[sub + f"{3 * s - 1}.weight"].to(dtype), t[sub + f"{3 * s - 1}.bias"].to(dtype),
                        t[sub + f"{3 * s}.weight"][..., 0, 0].to(dtype).contiguous(),
                        t[sub + f"{3 * s}.bias"].to(dtype))
                       for s in range(1, n_stages)]
        self.sub_w = t["encoder.subsampling.linear.weight"].to(dtype)
        self.sub_b = t["encoder.subsampling.linear.bias"].to(dtype)
        self.layers = [EncoderLayer(t, i, cfg, dtype) for i in range(cfg.num_layers)]
        inv = torch.arange(0, cfg.hidden_size, 2, dtype=torch.float32, device=self.device) / cfg.hidden_size
        self.inv_freq = 1.0 / (10000.0 ** inv)
        # transducer heads stay in float32: they are small and decide the tokens
        f32 = {n: v.float().contiguous() for n, v in t.items() if not n.startswith("encoder.")}
        self.enc_proj_w, self.enc_proj_b = t["encoder_projector.weight"].float(), t.get("encoder_projector.bias")
        if self.enc_proj_b is not None:
            self.enc_proj_b = self.enc_proj_b.float()
        self.embed = f32["decoder.embedding.weight"]
        self.lstm = [(f32[f"decoder.lstm.weight_ih_l{i}"], f32[f"decoder.lstm.weight_hh_l{i}"],
                      f32.get(f"decoder.lstm.bias_ih_l{i}"), f32.get(f"decoder.lstm.bias_hh_l{i}"))
                     for i in range(cfg.decoder_layers)]
        self.pred_w, self.pred_b = f32["decoder.decoder_projector.weight"], f32.get("decoder.decoder_projector.bias")
        self.head_w, self.head_b = f32["joint.head.weight"], f32.get("joint.head.bias")
        expected = cfg.vocab_size + len(cfg.durations)
        if self.head_w.shape[0] != expected:
            raise ValueError(f"joint output has {self.head_w.shape[0]} rows; config says {cfg.vocab_size} tokens "
                             f"+ {len(cfg.durations)} durations = {expected}")
        if self.embed.shape[0] < cfg.vocab_size:
            raise ValueError(f"prediction embedding has {self.embed.shape[0]} rows, vocabulary {cfg.vocab_size}")

    # ------------------------------------------------------------------ encoder

    def subsampled_lengths(self, lengths: Tensor) -> Tensor:
        """Encoder frames of utterances of `lengths` mel frames (each stride-2 conv's output size)."""
        cfg = self.cfg
        k, s, pad = cfg.subsampling_kernel, cfg.subsampling_stride, (cfg.subsampling_kernel - 1) // 2
        for _ in range(int(math.log2(cfg.subsampling_factor))):
            lengths = (lengths + 2 * pad - k) // s + 1
        return lengths

    def subsample(self, mel: Tensor, lengths: Tensor | None = None) -> Tensor:
        """[B, T, n_mels] -> [B, ceil(T/8), hidden]: 3x3 stride-2 convs over (time, mel). With
        `lengths` (mel frames per row, rows right-padded), frames past a row's end are zeroed after
        every stage, as the zero padding of that row alone would be."""
        ops, cfg = self.ops, self.cfg
        k, s, pad = cfg.subsampling_kernel, cfg.subsampling_stride, (cfg.subsampling_kernel - 1) // 2
        x = mel.to(self.dtype)[:, None]                                    # [B, 1, T, F]
        B, _, T, Fm = x.shape
        t_out, f_out = (T + 2 * pad - k) // s + 1, (Fm + 2 * pad - k) // s + 1
        cols = F.unfold(x, k, padding=pad, stride=s).transpose(1, 2)       # [B, T'F', k*k]
        x = torch.relu(ops.linear(cols, self.stem_w, self.stem_b))         # [B, T'F', C]
        x = x.reshape(B, t_out, f_out, -1).permute(0, 3, 1, 2)

        def clip(x: Tensor, lengths: Tensor | None) -> tuple[Tensor, Tensor | None]:
            if lengths is None:
                return x, None
            lengths = (lengths + 2 * pad - k) // s + 1
            inside = torch.arange(x.shape[2], device=x.device)[None, :] < lengths[:, None]
            return x * inside[:, None, :, None].to(x.dtype), lengths

        x, lengths = clip(x, lengths)
        for dw_w, dw_b, pw_w, pw_b in self.stages:
            x = F.conv2d(x, dw_w, dw_b, stride=s, padding=pad, groups=x.shape[1])
            x = torch.relu(ops.linear(x.permute(0, 2, 3, 1), pw_w, pw_b)).permute(0, 3, 1, 2)
            x, lengths = clip(x, lengths)
        B, C, T2, F2 = x.shape
        x = x.transpose(1, 2).reshape(B, T2, C * F2)
        x = ops.linear(x, self.sub_w, self.sub_b)
        return x * math.sqrt(cfg.hidden_size) if cfg.scale_input else x

    def positions(self, T: int) -> Tensor:
        """Relative sinusoidal embeddings for distances T-1 .. -(T-1), sin and cos interleaved."""
        rel = torch.arange(T - 1, -T, -1, device=self.device, dtype=torch.float32)
        ang = rel[:, None] * self.inv_freq
        return torch.stack([ang.sin(), ang.cos()], dim=-1).flatten(1).to(self.dtype)   # [2T-1, D]

    def attention(self, layer: EncoderLayer, x: Tensor, pos: Tensor, pad: Tensor | None = None) -> Tensor:
        ops, cfg = self.ops, self.cfg
        B, T, D = x.shape
        H, dh = cfg.num_heads, cfg.head_dim
        qkv = ops.linear(x, layer.w_qkv, layer.b_qkv).float().view(B, T, 3, H, dh)
        q, k, v = qkv.unbind(2)                                            # [B, T, H, dh]
        r = ops.linear(pos, layer.w_pos).float().view(2 * T - 1, H, dh)
        scale = dh ** -0.5
        by_pos = torch.einsum("bihd,mhd->bhim", q + layer.bias_v, r)       # m: distance T-1-m
        # query i, key j sit at distance i - j, which is column m = T-1-i+j
        idx = (T - 1 - torch.arange(T, device=x.device)[:, None] + torch.arange(T, device=x.device))
        by_pos = by_pos.gather(-1, idx.expand(B, H, T, T)) * scale
        if pad is not None:                                                # keys past a row's end
            by_pos = by_pos.masked_fill(pad[:, None, None, :], float("-inf"))
        # softmax(scale * ((q+u)·k + (q+v)·R(i-j))): the content part is ordinary attention of q+u
        out = ops.attention((q + layer.bias_u).transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                            scale=scale, bias=by_pos)                      # [B, H, T, dh]
        return out.transpose(1, 2).reshape(B, T, D).to(x.dtype)

    def conv_module(self, layer: EncoderLayer, x: Tensor, pad: Tensor | None = None) -> Tensor:
        ops = self.ops
        C = x.shape[-1]
        h = ops.linear(x, layer.w_pw1, layer.b_pw1)
        h = ops.glu(h[..., C:], h[..., :C], "sigmoid")
        if pad is not None:        # the conv reads zeros past a row's end, as alone
            h = h.masked_fill(pad[..., None], 0.0)
        half = (layer.w_dw.shape[1] - 1) // 2
        # the centred ("same") depthwise conv as the causal op on input shifted by half a kernel
        h, _ = ops.causal_conv1d(F.pad(h, (0, 0, 0, half)), layer.w_dw, layer.b_dw, activation="silu")
        return h[:, half:]

    def encode(self, mel: Tensor, lengths: Tensor | None = None) -> Tensor:
        """Normalised log-mel [B, T, n_mels] -> encoder output [B, ceil(T/8), hidden]. `lengths`:
        mel frames per row when rows are right-padded to T (None: every row is T long); a row's
        frames up to subsampled_lengths(lengths) are then what it gives alone, the rest is padding."""
        ops = self.ops
        if lengths is not None and bool((lengths == mel.shape[1]).all()):
            lengths = None
        lengths = None if lengths is None else lengths.to(self.device)
        x = self.subsample(mel.to(self.device), lengths)
        pad = None
        if lengths is not None:
            pad = torch.arange(x.shape[1], device=x.device)[None, :] >= self.subsampled_lengths(lengths)[:, None]
        pos = self.positions(x.shape[1])
        for L in self.layers:
            n = L.norms
            h = ops.linear(ops.layer_norm(x, *n["feed_forward1"]), L.ff1[0], L.ff1[1], activation="silu")
            x = ops.linear(h, L.ff1[2], L.ff1[3], residual=x)
            a = self.attention(L, ops.layer_norm(x, *n["self_att"]), pos, pad)
            x = ops.linear(a, L.w_o, L.b_o, residual=x)
            c = self.conv_module(L, ops.layer_norm(x, *n["conv"]), pad)
            x = ops.linear(c, L.w_pw2, L.b_pw2, residual=x)
            h = ops.linear(ops.layer_norm(x, *n["feed_forward2"]), L.ff2[0], L.ff2[1], activation="silu")
            x = ops.linear(h, L.ff2[2], L.ff2[3], residual=x)
            x = ops.layer_norm(x, *n["out"])
        return x

    def project_encoder(self, enc: Tensor) -> Tensor:
        """The joint's encoder half, computed once for every frame: [B, T, joint hidden] float32."""
        return self.ops.linear(enc.float(), self.enc_proj_w, self.enc_proj_b)

    # ------------------------------------------------------------------ transducer heads

    def initial_state(self, batch: int = 1) -> tuple[Tensor, Tensor, Tensor]:
        """(h, c [layers, B, H], prediction output [B, joint hidden]) after the start token."""
        H = self.cfg.decoder_hidden
        h = torch.zeros(len(self.lstm), batch, H, device=self.device)
        c = torch.zeros_like(h)
        start = torch.full((batch,), self.cfg.start_token_id, dtype=torch.long, device=self.device)
        return self.predict(start, h, c)

    def predict(self, tokens: Tensor, h: Tensor, c: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """One prediction-network step on tokens [B]: new (h, c) and its projected output."""
        x = self.embed.index_select(0, tokens)
        hs, cs = [], []
        for i, (w_ih, w_hh, b_ih, b_hh) in enumerate(self.lstm):
            hi, ci = self.ops.lstm_cell(x, h[i], c[i], w_ih, w_hh, b_ih, b_hh)
            hs.append(hi)
            cs.append(ci)
            x = hi
        return torch.stack(hs), torch.stack(cs), self.ops.linear(x, self.pred_w, self.pred_b)

    def joint(self, enc_t: Tensor, pred: Tensor) -> Tensor:
        """Token and duration logits [B, vocab + durations] for one frame and prediction state."""
        z = enc_t + pred
        z = torch.relu(z) if self.cfg.joint_act == "relu" else torch.tanh(z) if self.cfg.joint_act == "tanh" \
            else torch.sigmoid(z)
        return self.ops.linear(z, self.head_w, self.head_b)
