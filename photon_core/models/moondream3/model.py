"""The loaded Moondream 3 model: Moondream 2's model with Moondream 3's text decoder and region head.

Everything the architectures share is Moondream 2's code: image crops (made and normalised as
kestrel makes them: `resampler`, `normalize_via`), the vision encoder and projection, the prefill
of [BOS][image tokens], the skills (detect, point, caption, query) and the batched decoding
(moondream/batch.py), which reach the decoder and region head through `text_impl` / `region_impl`.
Segment is Moondream 3's own (segment.py).

With the megakernel backend every decode step (detect/point/caption/query through Moondream 2's
megakernel_decode.py, and segment) is one launch of Moondream 3's compiled step (decoder_step.py);
the vision encoder and the prompt prefill run on the per-op Triton kernels.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from photon_core.models.moondream import model as md2_model
from photon_core.models.moondream.model import EncodedImage, MoondreamModel, open_checkpoint
from photon_core.models.moondream.tokenizer import MoondreamTokenizer
from photon_core.runtime.image_input import ImageLike
from photon_core.runtime.requests import Request, Settings, check_spatial_refs
from photon_core.runtime.sampling import Sampling
from photon_core.weights.tensor_checks import listed, tensor_problems

from . import region, segment, text
from . import weights as weights_io
from .config import Moondream3Config

# The megakernel's KV caches are per batch bucket (bf16 on a GPU, fp32 on the CPU): over Moondream
# 3.1's whole 32k context they would take 6.4 GB per row in bf16 (51 GB for the batch-8 bucket); 4096
# positions hold any skill request with the default token limits (730 image positions + prompt + up
# to 768 tokens) in 0.8 GB per row (memory.device_memory: the model fits 16 GB at batch 1).
MEGAKERNEL_MAX_LEN = 4096
# kestrel's sampling defaults for caption, query and chat (kestrel/skills/base.py,
# AR_DEFAULT_TEMPERATURE and AR_DEFAULT_TOP_P; parse_settings fills them in for keys left out).
KESTREL_TEXT_DEFAULTS = {"temperature": 0.2, "top_p": 0.9}
# and for detect and point (their build_request: parse_settings(temperature=0.0, top_p=1.0)): greedy
# unless `settings` says otherwise.
KESTREL_OBJECT_DEFAULTS = {"temperature": 0.0, "top_p": 1.0}


def expected_shapes(cfg: Moondream3Config) -> dict[str, tuple[int, ...]]:
    """Every tensor the config implies, with its shape (reference names after normalize_names)."""
    t, r = cfg.text, cfg.region
    hd = t.dim // t.n_heads
    # Vision, embedding, attention and dense MLP shapes are Moondream 2's; the region head is not.
    s = {k: v for k, v in md2_model.expected_shapes(_as_md2(cfg)).items()
         if not k.startswith("region.") and not (k.startswith("text.blocks.") and ".mlp." in k)}
    for i in range(t.n_layers):
        p = f"text.blocks.{i}."
        if cfg.is_moe_layer(i):
            m = t.moe
            assert m is not None   # is_moe_layer: there is a MoE config
            s[p + "router.weight"], s[p + "router.bias"] = (m.num_experts, t.dim), (m.num_experts,)
            s[p + "experts_gate_up"] = (m.num_experts, 2 * m.expert_inner_dim, t.dim)
            s[p + "experts_down"] = (m.num_experts, t.dim, m.expert_inner_dim)
        else:
            s[p + "mlp.fc1.weight"], s[p + "mlp.fc1.bias"] = (t.ff_dim, t.dim), (t.ff_dim,)
            s[p + "mlp.fc2.weight"], s[p + "mlp.fc2.bias"] = (t.dim, t.ff_dim), (t.dim,)
        if t.tau_attn:
            s[p + "tau_wqwv"] = (2 * t.n_heads, (t.n_heads + 2 * t.n_kv_heads) * hd)
            s[p + "tau_alpha"] = (t.n_heads,)
    s["region.coord_features"] = (1, r.coord_feat_dim // 2)
    s["region.size_features"] = (2, r.size_feat_dim // 2)
    s["region.coord_encoder.weight"], s["region.coord_encoder.bias"] = (r.dim, r.coord_feat_dim), (r.dim,)
    s["region.size_encoder.weight"], s["region.size_encoder.bias"] = (r.dim, r.size_feat_dim), (r.dim,)
    s["region.ln.weight"], s["region.ln.bias"] = (r.dim,), (r.dim,)
    s["region.coord_head.weight"], s["region.coord_head.bias"] = (r.coord_out_dim, r.dim), (r.coord_out_dim,)
    s["region.size_head.weight"], s["region.size_head.bias"] = (r.size_out_dim, r.dim), (r.size_out_dim,)
    return s


def _as_md2(cfg: Moondream3Config):
    """The Moondream 2 config with the same vision tower and attention dimensions (for its shapes)."""
    from photon_core.models.moondream.config import MoondreamConfig, TextConfig
    t = cfg.text
    return MoondreamConfig(text=TextConfig(dim=t.dim, ff_dim=t.ff_dim, n_layers=t.n_layers, vocab_size=t.vocab_size,
                                           max_context=t.max_context, n_heads=t.n_heads, n_kv_heads=t.n_kv_heads,
                                           prefix_attn=t.prefix_attn, rope_theta=t.rope_theta),
                           vision=cfg.vision)


def check_state(sd: dict[str, torch.Tensor], cfg: Moondream3Config, source: str) -> None:
    """Every tensor the config implies is present with its shape, and nothing else (FP8 experts
    kept as FP8 bring their row scales); a clear error otherwise."""
    expected = expected_shapes(cfg)
    for k in [k for k in expected if k.endswith(("experts_gate_up", "experts_down")) and k + "_scale" in sd]:
        expected[k + "_scale"] = expected[k][:2]
    problems = tensor_problems(sd, {k: (v, True) for k, v in expected.items()})
    problems["unexpected"] = sorted(k for k in sd if k not in expected)
    if listed(problems):
        raise ValueError(f"{source} does not match the Moondream 3 config: {listed(problems, shown=5)}")


class Moondream3Model(MoondreamModel):
    """Moondream 3 on one backend: detect, point, caption, query (Moondream 2's skills and batched
    decoding on this decoder) and segment."""

    text_impl = text
    region_impl = region
    # kestrel bars no token while Moondream 3 reasons (its query skill's suppressed_token_ids are
    # Moondream 2's only): eos there ends the request (batch.py).
    reasoning_barred = ()
    # Nor in an answer (caption, query, chat): its query template's answer_suppressed_token_ids are
    # empty and its caption suppresses the answer marker for moondream2 only, so a marker the model
    # picks in an answer is an answer token (skills.answer_mask; Moondream 2 bars it).
    answer_barred: tuple[str, ...] = ()
    # Every coord and size token an answer or reasoning picks is fed back as its region encoding
    # (kestrel's decode types each sampled coord/size id as a CoordToken/SizeToken valued by the
    # spatial heads, runtime.py post_sample, and embeds it with the region encoder,
    # _embed_packed_token_batch) and is no text (its skills decode TextTokens only).
    spatial_tokens_fed = True
    # One max_tokens for reasoning, answer marker and answer together (kestrel's query has one
    # max_new_tokens for the request; at it the request ends, reason "length", no marker forced).
    reasoning_shares_max_tokens = True
    # A sampled request draws its coordinates and sizes with its temperature and top_p, and a
    # detect/point given a temperature samples whether another object follows (kestrel samples
    # every token, a detect's under its coord/eos mask, and every spatial value with the
    # request's settings: scheduler/spatial.py compute_spatial_values; region.sample_coords).
    spatial_values_sampled = True
    # A reasoning's start-ground-points and end-ground tokens are no text: kestrel's query skill
    # keeps them out of the reasoning's tokens and its chunks (skills/query.py consume_step: they
    # only flush the chunk) and decodes the text from all its text tokens at once (finalize).
    grounding_marks_in_text = False
    # A chat's last user message may be an image without text (kestrel's chat refuses only one with
    # neither, skills/chat.py build_request; its Moondream chat renders no question tokens then)
    # or whitespace, encoded as written (chat.layout).
    chat_turn_as_written = True
    # A chat reply with reasoning on has "reasoning" on its message, "" where the reasoning gave no
    # text (kestrel's Moondream chat finalize: its query result always holds the reasoning then).
    chat_reasoning_always = True
    # its MoE layers' prefill dequantises experts per call: a graph's pool would keep the peak
    # (~0.8 GB for a layer) for good, which memory.py counts as a request's transient
    prefill_graphs = False
    # Crops as kestrel makes them (its image_crops.py / vision.py prepare_crops): the reference's
    # two Lanczos-3 resizes from the original (PIL's: kestrel's native resize is unlicensed, see
    # image_crops), normalised in the model's dtype.
    resampler = "pil"
    normalize_via = None

    def __init__(self, config: Moondream3Config, state: dict[str, torch.Tensor], tokenizer: MoondreamTokenizer,
                 ops: Any, device: torch.device, dtype: torch.dtype, model_id: str = "moondream3",
                 tiling: Any = None, max_len: int | None = None) -> None:
        if max_len is None:
            max_len = min(config.text.max_context, MEGAKERNEL_MAX_LEN)
        super().__init__(config, state, tokenizer, ops, device, dtype, model_id=model_id, tiling=tiling,
                         max_len=max_len)
        if self.decode is not None:
            # One copy of the text weights: the per-op prefill reads the compiled step's arena, laid
            # out on `device` from `state` (the CPU copies load_moondream3 reads for this backend).
            from .decoder_step import share_arena
            share_arena(self.decode.decoder(1), self.text_w, self.region_w)
        to_device(device, self.vision_w, self.text_w, self.region_w)

    def decoder_megakernel(self) -> type:
        from .decoder_step import Moondream3DecoderMegakernel
        return Moondream3DecoderMegakernel

    def request_settings(self, r: Request) -> Settings:
        """The settings `r` decodes with, filled in and bounded as kestrel's skills do
        (build_request): caption and query (and chat, a query here) sample with temperature 0.2
        and top_p 0.9 where `settings` leaves them out, detect and point decode greedily unless
        `settings` gives a temperature (spatial_values_sampled); a detect or point finds at least one
        object (max(1, max_objects), a negative one too); a point whose `settings` has no
        max_objects is bounded by max_tokens alone, two tokens a point (detect keeps 50). A
        max_tokens in `settings` must be positive (parse_settings), except a detect's, which is
        not read (its budget is its max_objects'). Requests without a `settings` dict (the nodes',
        field by field) decode with their fields as given, as before."""
        defaults = KESTREL_TEXT_DEFAULTS if r.task in ("caption", "query") else KESTREL_OBJECT_DEFAULTS
        if not isinstance(r.settings, Mapping):
            return r.options(defaults)
        given = dict(r.settings)
        if r.task == "detect":
            given.pop("max_tokens", None)
        objects = given.get("max_objects")
        if r.task in ("detect", "point") and isinstance(objects, int) and not isinstance(objects, bool):
            given["max_objects"] = max(1, objects)
        opts = Settings.of({**defaults, **given})
        check_max_tokens(opts)
        if r.task == "point" and "max_objects" not in given:
            return dataclasses.replace(opts, max_objects=opts.max_tokens // 2)
        return opts

    def as_read(self, r: Request) -> Request:
        """`r` as kestrel's skills read it (build_request): the object and the question stripped of
        surrounding whitespace, the caption length stripped and lower-cased ("" is "normal").
        A chat's text is not (kestrel's chat takes it as written; chat.py decodes without this)."""
        if not isinstance(r.prompt, str):
            return r
        read = r.prompt.strip()
        if r.task == "caption":
            read = read.lower() or "normal"
        return r if read == r.prompt else dataclasses.replace(r, prompt=read)

    def segment(self, image: ImageLike | EncodedImage, object: str, spatial_refs: list | None = None,
                stream: bool = False, settings: dict | None = None, refine: bool = False) -> Any:
        """{"path": SVG path string, "bbox": {"x_min", "y_min", "x_max", "y_max"} or None}: the outline
        of `object`. The path's coordinates are in the bbox's unit square (0..1 across the box),
        as the model emits them; see segment.py. spatial_refs: points (x, y) / boxes the object is
        relative to, in the prompt as kestrel places them. stream=True: an iterator of the
        client's updates ({"bbox"}, {"chunk"}..., {"path", "bbox", "completed": True};
        segment.segment_stream). settings: max_tokens (default segment.DEFAULT_MAX_TOKENS);
        decoded greedily unless settings give a temperature (and top_p), as kestrel's segment
        (parse_settings with temperature 0, top_p 1 by default)."""
        opts = Settings.of({**KESTREL_OBJECT_DEFAULTS, **settings} if isinstance(settings, Mapping) else settings)
        check_max_tokens(opts)
        refs = check_spatial_refs(spatial_refs)
        if opts.variant is not None:
            raise NotImplementedError(f"settings['variant'] ({opts.variant!r}) is not supported by segment yet "
                                      "(its decode does not take an adapter)")
        max_tokens = opts.max_tokens if settings and "max_tokens" in settings else segment.DEFAULT_MAX_TOKENS
        run = segment.segment_stream if stream else segment.segment
        sampling = Sampling(max_tokens, opts.temperature, opts.top_p)
        return run(self, self._encoded(image), object, max_tokens, refine, refs, sampling)


def check_max_tokens(opts: Settings) -> None:
    """ValueError unless max_tokens is positive, as kestrel's parse_settings requires of every
    autoregressive skill's settings (caption, query, chat, point, segment; detect reads none)."""
    if opts.max_tokens < 1:
        raise ValueError(f"settings: max_tokens must be positive, got {opts.max_tokens!r}")


def to_device(device: torch.device, *weights: Any) -> None:
    """Move every tensor of the weight dataclasses `weights` that is not on `device` there, one at a
    time and each once (a tensor held in two places moves once), in place."""
    from .decoder_step import map_tensors
    moved: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}   # id -> (original, kept alive: ids stay unique)

    def move(t: torch.Tensor) -> torch.Tensor:
        if t.device == device or (device.index is None and t.device.type == device.type):
            return t
        if id(t) not in moved:
            moved[id(t)] = (t, t.to(device))
        return moved[id(t)][1]

    for w in weights:
        map_tensors(w, move)


def load_moondream3(path_or_id: str | Path = "moondream3.1-9B-A2B", device: str | torch.device = "cpu",
                    dtype: torch.dtype | str = torch.float32, backend: Any = None, tiling: Any = None,
                    max_len: int | None = None) -> Moondream3Model:
    """Load Moondream 3 (3.1 `model.safetensors`, or 3-preview `model_fp8.pt`) from a local file or
    folder or the Hugging Face cache. FP8 experts are dequantized on the CPU to `dtype` (except for the
    megakernel backend, below).

    backend: an ops module (photon_core.backends.select.get_backend: reference, the default; triton;
    megakernel, whose decode steps are compiled launches with `tiling`, KV caches of `max_len`, default
    min(max_context, MEGAKERNEL_MAX_LEN); FP8 experts stay FP8 there, scaled in the step's epilogue)."""
    o = open_checkpoint(path_or_id, device, dtype, backend, weights_io, Moondream3Config)
    layout = o.config.text.moe.gate_up_layout if o.config.text.moe is not None else "halves"
    # The megakernel's compiled step streams FP8 experts as bytes (half of bf16's, a quarter of
    # fp32's); the per-op paths dequantize them one layer at a time (text.forward).
    keep_fp8 = getattr(o.backend, "COMPILES_STEPS", False)
    # For the megakernel the tensors stay on the CPU here: Moondream3Model fills the compiled step's
    # weights arena on the device from them and then moves the rest there, so no weight is ever on
    # the device twice (the load's device peak is what stays resident plus one tensor in transit,
    # memory.load_memory); on a 16 GB GPU the loaded text weights and the arena did not fit together.
    state = weights_io.load_tensors(o.ckpt.weights, o.dtype, "cpu" if keep_fp8 else o.device, layout, keep_fp8)
    check_state(state, o.config, str(o.ckpt.weights))
    name = str(path_or_id) if str(path_or_id) in weights_io.MODELS else "moondream3"
    return Moondream3Model(o.config, state, o.tokenizer, o.backend, o.device, o.dtype, model_id=name, tiling=tiling,
                           max_len=max_len)
