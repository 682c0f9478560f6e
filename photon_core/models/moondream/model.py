"""The loaded Moondream 2 model: weights laid out once at load time, image encoding, the four skills."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from photon_core.models.serials import new_serial
from photon_core.runtime.image_input import ImageLike, to_rgb
from photon_core.runtime.requests import Request, Settings, SpatialRef
from photon_core.runtime.shape_graphs import ShapeGraphs
from photon_core.weights.tensor_checks import listed, tensor_problems

from . import batch as batch_decoding
from . import image_crops, region, skills, text, vision
from . import weights as weights_io
from .config import ModelConfig, MoondreamConfig
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
    owner: int  # serial of the model that made it: another model's cache would be meaningless
    # No image block at its start (a chat's text-only history, chat.py): what continues it attends
    # causally, as a text-only query does, instead of seeing the first prefix_attn positions whole.
    causal: bool = False
    # The fine-tuned variant whose adapter prefilled it (None: the base model): a request of another
    # variant would continue another model's cache (model.check_variant refuses that)
    variant: str | None = None


def _variant_name(variant: str | None) -> str:
    return "the base model" if variant is None else f"variant {variant!r}"


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
    """Every tensor the config implies is present with its shape and a float dtype; a clear error otherwise."""
    problems = tensor_problems(sd, {k: (v, True) for k, v in expected_shapes(cfg).items()})
    if problems:
        raise ValueError(f"{source} does not match the Moondream 2 config: {listed(problems, shown=5)}")


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
    # Tokens a reasoning may not pick from its second token on (TokenizerConfig field names): the
    # public reference's, as kestrel keeps them for Moondream 2 only.
    reasoning_barred: tuple[str, ...] = ("eos_id", "size_id")
    # Tokens an answer (caption, query, chat) may not pick: the answer marker, which ends the
    # prompt, as the public reference sets its logit to -inf.
    answer_barred: tuple[str, ...] = ("answer_id",)
    # Whether every coord or size token an answer (caption, query, chat) or a reasoning picks is fed
    # back as the region encoder's value of what the region heads read from the hidden state that
    # picked it, and kept out of the text (batch.py). Moondream 2: only a reasoning's coord is,
    # as its public code feeds it; an answer's are token embeddings.
    spatial_tokens_fed: bool = False
    # Whether a reasoning query's reasoning, answer marker and answer share one max_tokens. Moondream
    # 2: no, its public code gives the reasoning max_tokens and the answer max_tokens again, and
    # feeds the answer marker when the reasoning's run out.
    reasoning_shares_max_tokens: bool = False
    # Whether a sampled request (temperature > 0) draws its coordinates and sizes from the region
    # heads' logits with its temperature and top_p, and a detect/point samples its continue-or-stop
    # token. Moondream 2: no, its public code decodes them by argmax (its detect and point greedily).
    spatial_values_sampled: bool = False
    # Whether a reasoning's start-ground-points and end-ground tokens are part of its text (and each
    # starts a chunk of it, the chunks' texts joined: skills.grounding). Moondream 2: yes, as its
    # public code decodes them (Moondream 3: no, as kestrel keeps them out of the reasoning's text).
    grounding_marks_in_text: bool = True
    # Whether a chat's last user message may hold an image and no text (its query then has no
    # question words), or text that is only whitespace. Moondream 2: no, its turn needs words to
    # ask (chat.layout; Moondream 3 takes both, as kestrel's chat renders them).
    chat_turn_as_written: bool = False
    # Whether a chat reply with reasoning on always has "reasoning" on its message ("" where the
    # reasoning gave no text). Moondream 2: only when there is some, as runtime.chat_messages
    # shapes replies (Moondream 3: always, as kestrel's Moondream chat does).
    chat_reasoning_always: bool = False
    # How an image becomes the encoder's input (image_crops.py's docstring says why): Moondream 2's
    # as the public reference makes it (PIL's Lanczos-3, normalised through bfloat16).
    resampler: str = "pil"
    normalize_via: torch.dtype | None = torch.bfloat16
    # Replay the image prefill from CUDA graphs (runtime/shape_graphs). Not where its layers make
    # large transients a graph's pool would keep for good (Moondream 3's experts dequantised per call)
    prefill_graphs: bool = True

    def __init__(self, config: ModelConfig, state: dict[str, torch.Tensor], tokenizer: MoondreamTokenizer,
                 ops: Any, device: torch.device, dtype: torch.dtype, model_id: str = "moondream2",
                 tiling: Any = None, max_len: int | None = None) -> None:
        self.config, self.tokenizer, self.ops = config, tokenizer, ops
        self.device, self.dtype, self.model_id = device, dtype, model_id
        self.serial = new_serial()   # marks the images it encodes (EncodedImage.owner)
        self.vision_w = vision.VisionWeights.from_state(state, config.vision)
        self.text_w = self.text_impl.TextWeights.from_state(state, config.text)
        self.region_w = self.region_impl.RegionWeights.from_state(state)
        # a camera's crops have one shape frame after frame: on a GPU, replayed from a graph where faster
        self.encode_crops = ShapeGraphs(f"{model_id} vision encoder", self._encode_crops)
        # and the [BOS][image] prefix's prefill: 730 positions per image, whatever the image. Its
        # graphs keep their caches (Moondream 2: ~144 MB an image in bf16): two image counts at most
        self.prefill_images = (ShapeGraphs(f"{model_id} image prefill", self._prefill_images, max_shapes=2)
                               if self.prefill_graphs else self._prefill_images)
        self.decode = None
        if getattr(ops, "COMPILES_STEPS", False):
            from photon_core.megakernel.compiler import Tiling
            from photon_core.models.moondream.megakernel_decode import MegakernelDecode
            self.decode = MegakernelDecode(self, tiling or Tiling(), max_len)

    # -- image -------------------------------------------------------------------------------
    def prepare(self, image: ImageLike, channel_order: str = "rgb") -> image_crops.Crops:
        """Image -> its crops, made ahead of a request (a few to tens of ms of CPU, see bench/RESULTS.md):
        call it in the caller's own thread (a camera's worker) and pass the Crops as the image of any
        skill, so that the model's batch does not wait on the resizing."""
        v = self.config.vision
        # on a GPU the resizes run there, the same bytes (image_crops.py)
        on = self.device if self.device.type == "cuda" else None
        crops, tiling = image_crops.make_crops(to_rgb(image, channel_order), v.crop_size, v.enc_patch_size,
                                               v.overlap_margin, v.max_crops, self.resampler, on)
        return image_crops.Crops(crops, tiling, self.resampler, v.crop_size, v.enc_patch_size,
                                 v.overlap_margin, v.max_crops)

    def preprocess(self, image: ImageLike | image_crops.Crops, channel_order: str = "rgb"
                   ) -> tuple[np.ndarray | torch.Tensor, tuple[int, int]]:
        """Image -> (uint8 crops [1 + rows*cols, S, S, 3], tiling); a Crops (prepare) as it is."""
        if not isinstance(image, image_crops.Crops):
            image = self.prepare(image, channel_order)
        v = self.config.vision
        made = (image.resampler, image.crop_size, image.patch_size, image.overlap_margin, image.max_crops)
        if made != (self.resampler, v.crop_size, v.enc_patch_size, v.overlap_margin, v.max_crops):
            raise ValueError(f"these crops were made for another model (resampler, crop, patch, margin, "
                             f"max crops {made}); prepare the image with this one")
        return image.crops, image.tiling

    def encode_image(self, image: ImageLike | EncodedImage, settings: dict | None = None,
                     channel_order: str = "rgb") -> EncodedImage:
        """Image (runtime.image_input: arrays, PIL) -> EncodedImage. BGR arrays (OpenCV, ROS bgr8)
        need channel_order="bgr". settings: {"variant": ...} prefills with that adapter (as the
        reference does); an EncodedImage comes back as it is."""
        if isinstance(image, EncodedImage):
            self._check_owner(image)
            return image
        name = Settings.of(settings).variant
        return self.encode_images([image], channel_order, lora=skills.variant(self, name))[0]

    def empty_prefix(self) -> EncodedImage:
        """What a text-only query continues from: no positions (its prompt starts with BOS)."""
        t = self.config.text
        shape = (t.n_layers, 1, t.n_kv_heads, 0, t.dim // t.n_heads)
        empty = torch.empty(shape, dtype=self.dtype, device=self.device)
        return EncodedImage(empty, empty, 0, (0, 0), self.serial, causal=True)

    @torch.inference_mode()
    def encode_images(self, images: list[ImageLike | image_crops.Crops], channel_order: str = "rgb",
                      lora: Any = None) -> list[EncodedImage]:
        """Several images in one pass, as serving several cameras wants: all their crops go through
        the vision encoder together and their [BOS][image] prefixes are prefilled as one batch
        (with the variant adapter `lora`, skills.variant)."""
        if not images:
            return []
        cfg = self.config
        tokens, tilings = self.image_tokens(images, channel_order)
        bos = self.text_impl.embed(torch.full((len(images), 1), cfg.tokenizer.bos_id, device=self.device), self.text_w)
        x = torch.cat([bos, torch.stack(tokens)], dim=1)
        k, v = self.prefill_images(x) if lora is None else self._prefill_images(x, lora)
        variant = None if lora is None else lora.name
        return [EncodedImage(k[:, i:i + 1], v[:, i:i + 1], x.shape[1], tiling, self.serial, variant=variant)
                for i, tiling in enumerate(tilings)]

    def _prefill_images(self, x: torch.Tensor, lora: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The caches of [BOS][image] prefixes x [images, positions, dim], bidirectional over each."""
        cache = self.text_impl.KVCache(self.config.text, x.shape[1], self.dtype, self.device, batch=x.shape[0])
        skills.forward(self, x, 0, cache, lora)
        return cache.k, cache.v

    @torch.inference_mode()
    def image_tokens(self, images: list[ImageLike | image_crops.Crops], channel_order: str = "rgb"
                     ) -> tuple[list[torch.Tensor], list[tuple[int, int]]]:
        """The images' input embeddings for the text decoder ([image tokens, dim] each, all crops
        through the vision encoder together) and their tilings."""
        cfg = self.config
        prepared = [self.preprocess(image, channel_order) for image in images]
        crops = image_crops.stacked([c for c, _ in prepared], self.device)
        x = vision.normalize(crops, self.dtype, self.device, self.normalize_via)
        feats = self.encode_crops(x)
        tokens, start = [], 0
        for own_crops, tiling in prepared:
            end = start + len(own_crops)
            tokens.append(vision.project(feats[start:end], tiling, self.vision_w, cfg.vision, self.ops))
            start = end
        return tokens, [tiling for _, tiling in prepared]

    def _encode_crops(self, x: torch.Tensor) -> torch.Tensor:
        return vision.encode_crops(x, self.vision_w, self.config.vision, self.ops)

    def decoder_megakernel(self) -> type:
        """The compiled decode step class of this model's decoder (used by the megakernel backend)."""
        from photon_core.models.moondream.decoder_step import MoondreamDecoderMegakernel
        return MoondreamDecoderMegakernel

    def _check_owner(self, enc: EncodedImage) -> None:
        if enc.owner != self.serial:
            raise ValueError("this EncodedImage was made by another model; encode the image again")

    def check_variant(self, enc: EncodedImage, variant: str | None) -> None:
        """ValueError unless `enc` was prefilled with `variant`'s adapter (None: the base model's):
        the image's cache is part of what a variant computes."""
        if enc.pos and enc.variant != variant:
            raise ValueError(f"this EncodedImage was encoded with {_variant_name(enc.variant)} but the request asks "
                             f"for {_variant_name(variant)}: encode the image with "
                             f"settings={{'variant': {variant!r}}}, or pass the image itself")

    def _encoded(self, image: ImageLike | EncodedImage) -> EncodedImage:
        return self.encode_image(image)

    def request_settings(self, r: Request) -> Settings:
        """The settings `r` decodes with (Request.options: the public reference's defaults for keys
        `settings` leaves out); a family whose makers' engine fills in or bounds them otherwise
        overrides this (Moondream 3)."""
        return r.options()

    def as_read(self, r: Request) -> Request:
        """`r` with its object, question or caption length as the skills read it: as given here,
        as Moondream 2's public code reads them (Moondream 3 normalises them as kestrel does)."""
        return r

    # -- skills ------------------------------------------------------------------------------
    # The public reference's signatures, defaults and result shapes (moondream/torch/moondream.py);
    # settings: runtime.requests.Settings (temperature 0.5, top_p 0.3, max_tokens 768, max_objects
    # 50, variant None when left out), as request_settings fills them in (Moondream 3: kestrel's).
    def detect(self, image: ImageLike | EncodedImage, object: str, settings: dict | None = None) -> dict:
        """Boxes of `object`: {"objects": [{"x_min", "y_min", "x_max", "y_max", "score"}]}, normalised to
        [0, 1]; score: the model's probability of this object (object_score.py), in [0, 1]. Greedy,
        as the reference's (temperature and top_p are not used; Moondream 3 samples where settings
        give a temperature, as kestrel: spatial_values_sampled)."""
        return self.batch([Request("detect", image, object, settings={} if settings is None else settings)])[0]

    def point(self, image: ImageLike | EncodedImage, object: str, settings: dict | None = None,
              spatial_refs: list[SpatialRef] | None = None) -> dict:
        """Points on `object`: {"points": [{"x", "y", "score"}]}, normalised to [0, 1]; score as
        detect's. spatial_refs: points/boxes the object is relative to, placed after the prompt's
        prefix as a query's are (skills.object_prompt)."""
        return self.batch([Request("point", image, object, settings={} if settings is None else settings,
                                   spatial_refs=spatial_refs)])[0]

    def caption(self, image: ImageLike | EncodedImage, length: str = "normal", stream: bool = False,
                settings: dict | None = None) -> dict:
        """{"caption": str}, or a generator of text pieces with stream=True. length: short/normal/long."""
        r = Request("caption", image, length, settings={} if settings is None else settings)
        return self._text(self.as_read(r), stream)

    def query(self, image: ImageLike | EncodedImage | None = None, question: str | None = None,
              reasoning: bool = False, spatial_refs: list[SpatialRef] | None = None, stream: bool = False,
              settings: dict | None = None) -> dict:
        """{"answer": str} (a generator of text pieces with stream=True); with reasoning, also
        {"reasoning": {"text", "grounding": [{"start_idx", "end_idx", "points": [(x, y), ...]}]}},
        decoded before the answer. image None: a text-only question. spatial_refs: points (x, y) and
        boxes (x_min, y_min, x_max, y_max), normalised, that the question refers to."""
        if question is None:
            raise ValueError("question must be provided")
        return self._text(self.as_read(Request("query", image, question, settings={} if settings is None else settings,
                                               spatial_refs=spatial_refs, reasoning=reasoning)), stream)

    def _text(self, r: Request, stream: bool) -> dict:
        """A caption or query (as_read already): reasoning through the batched protocol (its
        phases), and so every answer of a model that feeds an answer's coord and size tokens back
        as region values (spatial_tokens_fed: the text loops feed token embeddings); the rest on
        the text loop (device rounds on the megakernel)."""
        key = "caption" if r.task == "caption" else "answer"
        if r.reasoning or self.spatial_tokens_fed:
            if stream:
                return self.decode.stream(r) if self.decode is not None else batch_decoding.stream(self, r)
            return self._batch([r])[0]
        opts = self.request_settings(r)
        prompt, refs = batch_decoding._prompt(self, r, opts)
        s = opts.sampling()
        lora = skills.variant(self, opts.variant)
        if r.image is None:
            enc = self.empty_prefix()
        elif isinstance(r.image, EncodedImage):
            enc = self.encode_image(r.image)
            self.check_variant(enc, opts.variant)
        else:
            enc = self.encode_images([r.image], lora=lora)[0]
        if self.decode is not None:
            gen = self.decode.generate_text(enc, prompt, s, refs)
        else:
            gen = skills.generate_text(self, enc, prompt, s, refs, lora)
        return {key: gen if stream else "".join(gen)}

    def chat(self, messages: list[dict], stream: bool = False, settings: dict | None = None,
             reasoning: bool | None = None) -> dict:
        """A conversation (runtime.chat_messages' messages) answered as kestrel's Moondream chat
        does: the turns run as a chain of query prompts, each user turn's images at its start;
        reasoning defaults to on (settings["reasoning"] as kestrel reads it). {"message":
        {"role": "assistant", "content", "reasoning"?, "reasoning_details"?}, "finish_reason"},
        or with stream=True {"message": an iterator of the content's pieces}. See chat.py."""
        from . import chat
        return chat.chat(self, messages, stream, settings, reasoning)

    def batch(self, requests: list[batch_decoding.Request]) -> list[dict]:
        """Several requests (any mix of skills, images and prompts) decoded together: each decode
        step is one batched forward (or one megakernel launch) for all of them. Results in order,
        shaped as the single calls return them (caption/query text not streamed). See batch.py."""
        return self._batch([self.as_read(r) for r in requests])

    def _batch(self, requests: list[batch_decoding.Request]) -> list[dict]:
        """batch() of requests already as_read."""
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
    try:
        config = config_cls.from_dict(ckpt.config)
    except ValueError as err:   # the checks name the field; this names the checkpoint
        raise ValueError(f"{ckpt.folder}: {err}") from None
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
