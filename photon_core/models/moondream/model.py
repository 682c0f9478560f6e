"""The loaded Moondream 2 model: weights laid out once at load time, image encoding, the four skills."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from photon_core.runtime.image_input import ImageLike, to_rgb

from . import batch as batch_decoding
from . import image_crops, region, skills, text, vision
from . import weights as weights_io
from .config import MoondreamConfig
from .tokenizer import MoondreamTokenizer, find_tokenizer


@dataclass(frozen=True)
class EncodedImage:
    """An image after the vision encoder and the prefill of [BOS][image tokens]: the per-layer keys and
    values of those `pos` positions ([layers, 1, kv_heads, pos, head_dim]). Reusable for any number
    of skills on the same image; read-only."""
    k: torch.Tensor
    v: torch.Tensor
    pos: int
    tiling: tuple[int, int]
    owner: int  # id() of the model that made it: another model's cache would be meaningless


def expected_shapes(cfg: MoondreamConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the config implies, with its shape (reference names)."""
    t, v, r = cfg.text, cfg.vision, cfg.region
    hd = t.dim // t.n_heads
    s: dict[str, tuple[int, ...]] = {}

    def lin(name, n_in, n_out):
        s[name + ".weight"], s[name + ".bias"] = (n_out, n_in), (n_out,)

    def ln(name, d):
        s[name + ".weight"], s[name + ".bias"] = (d,), (d,)

    lin("vision.patch_emb", v.in_channels * v.enc_patch_size ** 2, v.enc_dim)
    s["vision.pos_emb"] = (1, v.grid * v.grid, v.enc_dim)
    for i in range(v.enc_n_layers):
        p = f"vision.blocks.{i}."
        ln(p + "ln1", v.enc_dim), ln(p + "ln2", v.enc_dim)
        lin(p + "attn.qkv", v.enc_dim, 3 * v.enc_dim), lin(p + "attn.proj", v.enc_dim, v.enc_dim)
        lin(p + "mlp.fc1", v.enc_dim, v.enc_ff_dim), lin(p + "mlp.fc2", v.enc_ff_dim, v.enc_dim)
    ln("vision.post_ln", v.enc_dim)
    lin("vision.proj_mlp.fc1", 2 * v.enc_dim, v.proj_inner_dim)
    lin("vision.proj_mlp.fc2", v.proj_inner_dim, v.proj_out_dim)
    s["text.wte"] = (t.vocab_size, t.dim)
    for i in range(t.n_layers):
        p = f"text.blocks.{i}."
        ln(p + "ln", t.dim)
        lin(p + "attn.qkv", t.dim, (t.n_heads + 2 * t.n_kv_heads) * hd), lin(p + "attn.proj", t.dim, t.dim)
        lin(p + "mlp.fc1", t.dim, t.ff_dim), lin(p + "mlp.fc2", t.ff_dim, t.dim)
    ln("text.post_ln", t.dim)
    lin("text.lm_head", t.dim, t.vocab_size)
    s["region.coord_features"] = (1, r.coord_feat_dim // 2)
    s["region.size_features"] = (2, r.size_feat_dim // 2)
    lin("region.coord_encoder", r.coord_feat_dim, r.dim)
    lin("region.coord_decoder.fc1", r.dim, r.inner_dim), lin("region.coord_decoder.fc2", r.inner_dim, r.coord_out_dim)
    lin("region.size_encoder", r.size_feat_dim, r.dim)
    lin("region.size_decoder.fc1", r.dim, r.inner_dim), lin("region.size_decoder.fc2", r.inner_dim, r.size_out_dim)
    return s


def check_state(sd: dict[str, torch.Tensor], cfg: MoondreamConfig, source: str) -> None:
    """Every tensor the config implies is present with its shape; a clear error otherwise."""
    expected = expected_shapes(cfg)
    missing = [k for k in expected if k not in sd]
    wrong = [f"{k}: {tuple(sd[k].shape)} != {v}" for k, v in expected.items() if k in sd and tuple(sd[k].shape) != v]
    if missing or wrong:
        raise ValueError(f"{source} does not match the Moondream 2 config: "
                         f"missing {missing[:5]}{'...' if len(missing) > 5 else ''} "
                         f"wrong shapes {wrong[:5]}{'...' if len(wrong) > 5 else ''}")


class MoondreamModel:
    """Moondream 2 on one backend. Skills take an image (numpy RGB / PIL) or an EncodedImage.

    The backend picks the decode stepper: the ops path (batch.py's OpsStepper: every decode step a
    batched forward of `ops`) or, with the megakernel backend, `decode` (megakernel_decode.py: every
    decode step one launch of the compiled step graph). Results are the same.

    `text_impl` and `region_impl` are the modules holding the text decoder and the region head
    (TextWeights/KVCache/embed/forward/lm_logits; RegionWeights/encode_*/decode_*): skills.py and
    batch.py reach them through the model, so a variant with another decoder or region head
    (Moondream 3) reuses the skills and the batched decoding unchanged."""

    text_impl: Any = text
    region_impl: Any = region

    def __init__(self, config: MoondreamConfig, state: dict[str, torch.Tensor], tokenizer: MoondreamTokenizer,
                 ops: Any, device: torch.device, dtype: torch.dtype, model_id: str = "moondream2",
                 tiling: Any = None, max_len: int | None = None) -> None:
        self.config, self.tokenizer, self.ops = config, tokenizer, ops
        self.device, self.dtype, self.model_id = device, dtype, model_id
        self.vision_w = vision.VisionWeights.from_state(state, config.vision)
        self.text_w = self.text_impl.TextWeights.from_state(state, config.text)
        self.region_w = self.region_impl.RegionWeights.from_state(state)
        self.decode = None
        if getattr(ops, "NAME", "") == "megakernel":
            from photon_core.megakernel.compiler import Tiling
            from photon_core.models.moondream.megakernel_decode import MegakernelDecode
            self.decode = MegakernelDecode(self, tiling or Tiling(), max_len)

    # -- image -------------------------------------------------------------------------------
    def preprocess(self, image: ImageLike, channel_order: str = "rgb") -> tuple[np.ndarray, tuple[int, int]]:
        """Image -> (uint8 crops [1 + rows*cols, S, S, 3], tiling). Cheap: one resize per crop set."""
        v = self.config.vision
        rgb = to_rgb(image, channel_order)
        return image_crops.make_crops(rgb, v.crop_size, v.enc_patch_size, v.overlap_margin, v.max_crops)

    def encode_image(self, image: ImageLike | EncodedImage, channel_order: str = "rgb") -> EncodedImage:
        """Image (runtime.image_input: arrays, PIL) -> EncodedImage. BGR arrays (OpenCV, ROS bgr8)
        need channel_order="bgr"."""
        if isinstance(image, EncodedImage):
            self._check_owner(image)
            return image
        return self.encode_images([image], channel_order)[0]

    @torch.inference_mode()
    def encode_images(self, images: list[ImageLike], channel_order: str = "rgb") -> list[EncodedImage]:
        """Several images in one pass, as serving several cameras wants: all their crops go through
        the vision encoder together and their [BOS][image] prefixes are prefilled as one batch."""
        if not images:
            return []
        cfg = self.config
        prepared = [self.preprocess(image, channel_order) for image in images]
        crops = np.concatenate([c for c, _ in prepared])
        feats = vision.encode_crops(vision.normalize(crops, self.dtype, self.device), self.vision_w, cfg.vision, self.ops)
        tokens, start = [], 0
        for own_crops, tiling in prepared:
            end = start + len(own_crops)
            tokens.append(vision.project(feats[start:end], tiling, self.vision_w, cfg.vision, self.ops))
            start = end
        bos = self.text_impl.embed(torch.full((len(images), 1), cfg.tokenizer.bos_id, device=self.device), self.text_w)
        x = torch.cat([bos, torch.stack(tokens)], dim=1)
        cache = self.text_impl.KVCache(cfg.text, x.shape[1], self.dtype, self.device, batch=len(images))
        self.text_impl.forward(x, 0, self.text_w, cfg.text, cache, self.ops)  # bidirectional over BOS + image
        return [EncodedImage(cache.k[:, i:i + 1], cache.v[:, i:i + 1], x.shape[1], tiling, id(self))
                for i, (_, tiling) in enumerate(prepared)]

    def decoder_megakernel(self) -> type:
        """The compiled decode step class of this model's decoder (used by the megakernel backend)."""
        from photon_core.models.moondream.decoder_step import MoondreamDecoderMegakernel
        return MoondreamDecoderMegakernel

    def _check_owner(self, enc: EncodedImage) -> None:
        if enc.owner != id(self):
            raise ValueError("this EncodedImage was made by another model; encode the image again")

    def _encoded(self, image: ImageLike | EncodedImage) -> EncodedImage:
        return self.encode_image(image)

    # -- skills ------------------------------------------------------------------------------
    def detect(self, image: ImageLike | EncodedImage, object: str, max_objects: int = skills.DEFAULT_MAX_OBJECTS) -> dict:
        """Boxes of `object`: {"objects": [{"x_min", "y_min", "x_max", "y_max", "score"}]}, normalised to
        [0, 1]; score: the model's probability of this object (object_score.py), in [0, 1]."""
        return self.batch([batch_decoding.Request("detect", image, object, max_objects)])[0]

    def point(self, image: ImageLike | EncodedImage, object: str, max_objects: int = skills.DEFAULT_MAX_OBJECTS) -> dict:
        """Points on `object`: {"points": [{"x", "y", "score"}]}, normalised to [0, 1]; score as detect's."""
        return self.batch([batch_decoding.Request("point", image, object, max_objects)])[0]

    def caption(self, image: ImageLike | EncodedImage, length: str = "normal", stream: bool = False,
                max_tokens: int = skills.DEFAULT_MAX_TOKENS, temperature: float = 0.0, top_p: float = 1.0) -> dict:
        """{"caption": str}, or a generator of text pieces with stream=True. length: short/normal/long."""
        gen = self._generate_text(image, skills.caption_prompt(self, length), max_tokens, temperature, top_p)
        return {"caption": gen if stream else "".join(gen)}  # str, or Iterator[str] when streaming

    def query(self, image: ImageLike | EncodedImage, question: str, stream: bool = False, max_tokens: int = skills.DEFAULT_MAX_TOKENS,
              temperature: float = 0.0, top_p: float = 1.0) -> dict:
        """{"answer": str}, or a generator of text pieces with stream=True."""
        gen = self._generate_text(image, skills.query_prompt(self, question), max_tokens, temperature, top_p)
        return {"answer": gen if stream else "".join(gen)}

    def _generate_text(self, image: ImageLike | EncodedImage, prompt: list[int], max_tokens: int,
                       temperature: float, top_p: float):
        enc = self._encoded(image)
        if self.decode is not None:
            return self.decode.generate_text(enc, prompt, max_tokens, temperature, top_p)
        return skills.generate_text(self, enc, prompt, max_tokens, temperature, top_p)

    def batch(self, requests: list[batch_decoding.Request]) -> list[dict]:
        """Several requests (any mix of skills, images and prompts) decoded together: each decode
        step is one batched forward (or one megakernel launch) for all of them. Results in order,
        shaped as the single calls return them (caption/query text not streamed). See batch.py."""
        if self.decode is not None:
            return self.decode.batch(requests)
        return batch_decoding.run(self, requests)


@dataclass
class Opened:
    """A checkpoint found and checked, before its tensors are read."""
    backend: Any
    device: torch.device
    dtype: torch.dtype
    ckpt: Any           # weights.Checkpoint: the tensor file, its folder and config.json
    config: Any         # the family's config dataclass, validated
    tokenizer: MoondreamTokenizer


def open_checkpoint(path_or_id: str | Path, device: str | torch.device, dtype: torch.dtype | str, backend: Any,
                    weights_module: Any, config_cls: Any) -> Opened:
    """What both Moondream loaders do first: the default backend, the dtype and device parsed, the
    checkpoint resolved by the family's weights module, its config validated, its tokenizer read."""
    if backend is None:
        from photon_core.backends import reference as backend
    torch_dtype: torch.dtype = weights_module.parse_dtype(dtype)
    device = torch.device(device)
    ckpt = weights_module.resolve(path_or_id)
    config = config_cls.from_dict(ckpt.config)
    return Opened(backend, device, torch_dtype, ckpt, config, MoondreamTokenizer(find_tokenizer(ckpt.folder)))


def load_moondream(path_or_id: str | Path = "moondream2", device: str | torch.device = "cpu",
                   dtype: torch.dtype | str = torch.float32, backend: Any = None, tiling: Any = None,
                   max_len: int | None = None) -> MoondreamModel:
    """Load Moondream 2 from a local file/folder or the Hugging Face cache (`vikhyatk/moondream2`).

    backend: an ops module (photon_core.backends.select.get_backend: reference, the default; triton;
    megakernel, whose decode steps are compiled launches with `tiling`, KV caches of `max_len`)."""
    o = open_checkpoint(path_or_id, device, dtype, backend, weights_io, MoondreamConfig)
    state = weights_io.load_tensors(o.ckpt.weights, o.dtype, o.device)
    check_state(state, o.config, str(o.ckpt.weights))
    return MoondreamModel(o.config, state, o.tokenizer, o.backend, o.device, o.dtype, tiling=tiling, max_len=max_len)
