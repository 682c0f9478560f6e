"""Moondream 2 on the fast path: vision encoder and prefill through the per-op Triton kernels, every
decode step (LM head and region heads included) through the decode megakernel.

    fast = load_moondream_fast("moondream2", device="cuda")      # or FastMoondream(model)
    fast.detect(image, "cup")  /  fast.point(...)  /  fast.caption(...)  /  fast.query(...)

Same skills API and results as MoondreamModel (model.py); the prompt templates, masks and result
shapes come from skills.py. What differs is only where the math runs:
* encode_image: the wrapped MoondreamModel's own encode_image, whose ops module is the Triton backend
  (vision crops through the encoder, projection, bidirectional prefill of [BOS][image tokens]).
* a request: the prompt except its last token is prefilled with the per-op kernels (text.forward
  after the image's K/V), the image and prompt K/V are copied into row 0 of the megakernel's KV
  cache, and the last prompt token is the first megakernel step. Each step yields, in ONE launch, the LM
  argmax under the skill's mask (a -inf logit bias), the coordinate bin and the two size bins, all
  read from the last hidden state before post_ln; coordinates/sizes are encoded (tiny Fourier MLPs,
  per-op) into the next input embedding, exactly the decode protocol of skills.generate_objects.

The decode loops mirror skills.generate_objects / generate_text step for step (same stopping rules,
same context limits, same streaming). They are restated here rather than shared because skills.py
constructs its own `Sequence`; see the hook noted in this project's report (a `sequence` factory
argument) that would let both paths share one loop.

One request at a time per FastMoondream: the megakernel's state (KV cache, activations) is a single
arena per batch bucket. A concurrent second request raises instead of corrupting the first.
"""
from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from photon_core.megakernel.moondream_decoder import MoondreamDecoderMegakernel, StepResult, Tiling
from photon_core.models.moondream import region, skills, text
from photon_core.models.moondream.model import EncodedImage, ImageLike, MoondreamModel, load_moondream


class FastMoondream:
    """A MoondreamModel (loaded with the Triton ops module) plus its decode megakernels."""

    def __init__(self, model: MoondreamModel, tiling: Tiling = Tiling(), max_len: int | None = None) -> None:
        if getattr(model.ops, "NAME", None) not in ("triton", "megakernel"):
            raise ValueError("FastMoondream needs a MoondreamModel loaded with the Triton ops "
                             "(load_moondream(..., backend=photon_core.backends.triton)); use load_moondream_fast")
        self.model, self.config, self.tokenizer = model, model.config, model.tokenizer
        self.device, self.dtype = model.device, model.dtype
        self.tiling = tiling
        self.max_len = max_len or model.config.text.max_context
        self._decoder: MoondreamDecoderMegakernel | None = None
        self._busy = threading.Lock()
        vocab, tk = self.config.text.vocab_size, self.config.tokenizer
        # The two masks every skill uses, as additive logit biases (0 allowed, -inf masked).
        self._text_bias = torch.zeros(vocab, device=self.device)
        self._text_bias[tk.answer_id] = float("-inf")
        self._boundary_bias = torch.full((vocab,), float("-inf"), device=self.device)
        self._boundary_bias[[tk.coord_id, tk.eos_id]] = 0.0

    # -- the megakernels -------------------------------------------------------------------------
    def decoder(self) -> MoondreamDecoderMegakernel:
        """The batch-1 decode megakernel (both graphs: with and without the region heads), built
        once on first use: the weights are copied into its arena, the graphs built and checked."""
        if self._decoder is None:
            wd = self.dtype if self.dtype in (torch.float32, torch.bfloat16, torch.float16) else torch.float32
            self._decoder = MoondreamDecoderMegakernel(self.model.text_w, self.model.region_w, self.config,
                                                       batch=1, max_len=self.max_len, tiling=self.tiling,
                                                       weight_dtype=wd)
        return self._decoder

    # -- image -------------------------------------------------------------------------------------
    def encode_image(self, image: ImageLike | EncodedImage, channel_order: str = "rgb") -> EncodedImage:
        """Vision encoder + prefill through the per-op Triton kernels (the wrapped model's ops)."""
        return self.model.encode_image(image, channel_order)

    # -- skills ------------------------------------------------------------------------------------
    def detect(self, image: ImageLike | EncodedImage, object: str,
               max_objects: int = skills.DEFAULT_MAX_OBJECTS) -> dict:
        prompt = skills.object_prompt(self.model, "detect", object)
        return {"objects": self._generate_objects(self.encode_image(image), prompt, True, max_objects)}

    def point(self, image: ImageLike | EncodedImage, object: str,
              max_objects: int = skills.DEFAULT_MAX_OBJECTS) -> dict:
        prompt = skills.object_prompt(self.model, "point", object)
        return {"points": self._generate_objects(self.encode_image(image), prompt, False, max_objects)}

    def caption(self, image: ImageLike | EncodedImage, length: str = "normal", stream: bool = False,
                max_tokens: int = skills.DEFAULT_MAX_TOKENS, temperature: float = 0.0, top_p: float = 1.0) -> dict:
        prompt = skills.caption_prompt(self.model, length)
        gen = self._generate_text(self.encode_image(image), prompt, max_tokens, temperature, top_p)
        return {"caption": gen if stream else "".join(gen)}

    def query(self, image: ImageLike | EncodedImage, question: str, stream: bool = False,
              max_tokens: int = skills.DEFAULT_MAX_TOKENS, temperature: float = 0.0, top_p: float = 1.0) -> dict:
        prompt = skills.query_prompt(self.model, question)
        gen = self._generate_text(self.encode_image(image), prompt, max_tokens, temperature, top_p)
        return {"answer": gen if stream else "".join(gen)}

    # -- decoding ----------------------------------------------------------------------------------
    def _generate_objects(self, enc: EncodedImage, prompt: list[int], with_size: bool,
                          max_objects: int) -> list[dict]:
        """skills.generate_objects with megakernel steps: 3 (detect) or 2 (point) steps per object."""
        if max_objects < 0:
            raise ValueError("max_objects must be >= 0")
        skills.check_prompt(self.model, enc, prompt)
        cfg, ops, rw = self.config, self.model.ops, self.model.region_w
        tk = cfg.tokenizer
        steps = 3 if with_size else 2
        length = min(cfg.text.max_context, enc.pos + len(prompt) + steps * max_objects)
        n_bins = cfg.region.coord_out_dim
        out: list[dict] = []
        with _Request(self, enc, length, region_heads=True) as seq, torch.no_grad():
            res = seq.prompt(prompt, self._boundary_bias)
            while len(out) < max_objects and seq.pos + steps <= length:
                if res.tokens[0] != tk.coord_id:
                    break  # eos
                # Inside an object the next tokens are fixed (coord, then size); only the region
                # heads' bins are used there, as in the reference loop.
                x = res.coord_bins[0] / n_bins
                res = seq.step(region.encode_coord(x, rw, ops))
                y = res.coord_bins[0] / n_bins
                res = seq.step(region.encode_coord(y, rw, ops))
                if not with_size:
                    out.append({"x": min(max(x, 0.0), 1.0), "y": min(max(y, 0.0), 1.0)})
                    continue
                w, h = _size_values(res.size_bins[0])
                res = seq.step(region.encode_size(w, h, rw, ops))
                out.append({"x_min": min(max(x - w / 2, 0.0), 1.0), "y_min": min(max(y - h / 2, 0.0), 1.0),
                            "x_max": min(max(x + w / 2, 0.0), 1.0), "y_max": min(max(y + h / 2, 0.0), 1.0)})
        return out

    def _generate_text(self, enc: EncodedImage, prompt: list[int], max_tokens: int, temperature: float,
                       top_p: float) -> Iterator[str]:
        """skills.generate_text with megakernel steps; yields text pieces."""
        if max_tokens < 0 or temperature < 0 or not 0 < top_p <= 1:
            raise ValueError("need max_tokens >= 0, temperature >= 0 and 0 < top_p <= 1")
        skills.check_prompt(self.model, enc, prompt)
        cfg = self.config
        length = min(cfg.text.max_context, enc.pos + len(prompt) + max_tokens)
        allowed = torch.isfinite(self._text_bias)

        def tokens() -> Iterator[int]:
            with _Request(self, enc, length, region_heads=False) as seq, torch.no_grad():
                res = seq.prompt(prompt, self._text_bias)
                for n in range(1, max_tokens + 1):
                    if temperature == 0:
                        tok = res.tokens[0]  # the in-kernel masked argmax
                    else:
                        tok = skills.sample_token(seq.logits()[0].clone(), allowed, temperature, top_p, self.model.ops)
                    if tok == cfg.tokenizer.eos_id:
                        return
                    yield tok
                    if n == max_tokens or seq.pos >= length:
                        return
                    res = seq.step(seq.embed([tok]))

        return skills.text_pieces(self.tokenizer, tokens())


def _size_values(bins: tuple[int, int]) -> tuple[float, float]:
    """(width bin, height bin) -> sizes, with region.decode_sizes' exact float32 arithmetic."""
    size = torch.pow(2.0, torch.tensor(bins, dtype=torch.int64).float() / 1023.0 * 10.0 - 10.0)
    return size[0].item(), size[1].item()


class _Request:
    """One request's decode state on the batch-1 megakernel: row 0 of its KV cache and the position.

    Entering takes the FastMoondream's lock (held until exit: the arena holds one request at a
    time); `prompt` fills the cache with the image prefix and the prompt."""

    def __init__(self, fm: FastMoondream, enc: EncodedImage, length: int, region_heads: bool) -> None:
        fm.model._check_owner(enc)
        self.fm, self.enc, self.length = fm, enc, length
        self.mk = fm.decoder()
        self.region_heads = region_heads
        if length > self.mk.max_len:
            raise ValueError(f"request of {length} positions exceeds the megakernel's KV cache ({self.mk.max_len})")
        self.pos = enc.pos
        self._bias: torch.Tensor | None = None

    def __enter__(self) -> "_Request":
        if not self.fm._busy.acquire(blocking=False):
            raise RuntimeError("FastMoondream runs one request at a time (a single megakernel arena); "
                               "finish or close the running request (e.g. a streaming caption) first")
        return self

    def __exit__(self, *exc: object) -> None:
        self.fm._busy.release()

    def embed(self, ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return text.embed(torch.tensor([ids], device=self.fm.device), self.fm.model.text_w)

    def prompt(self, ids: list[int], bias: torch.Tensor) -> StepResult:
        """All prompt tokens but the last through the per-op kernels, the last one as the first
        megakernel step. The prefill runs on a KV cache of the model's dtype (the per-op attention
        wants q, k, v alike) and the image prefix plus the prefilled positions are then copied into
        row 0 of the megakernel's fp32 cache."""
        m = self.fm.model
        if self.pos + len(ids) > self.length:
            raise RuntimeError(f"sequence of {self.pos + len(ids)} tokens exceeds the KV cache ({self.length})")
        k, v = self.enc.k, self.enc.v
        n = len(ids) - 1
        with torch.no_grad():
            if n > 0:
                tmp = text.KVCache(m.config.text, self.pos + n, m.dtype, m.device)
                tmp.k[:, :, :, :self.pos] = k
                tmp.v[:, :, :, :self.pos] = v
                text.forward(self.embed(ids[:-1]), self.pos, m.text_w, m.config.text, tmp, m.ops)
                k, v = tmp.k, tmp.v
            cache = self.mk.cache(0)
            cache.k[:, :, :, :k.shape[3]] = k
            cache.v[:, :, :, :v.shape[3]] = v
        self.pos += n
        return self.step(self.embed(ids[-1:]), bias)

    def step(self, emb: torch.Tensor, bias: torch.Tensor | None = None) -> StepResult:
        """One megakernel launch at the current position; emb [1, 1, D] (or [1, D])."""
        if self.pos >= self.length:
            raise RuntimeError(f"sequence of {self.pos + 1} tokens exceeds the KV cache ({self.length})")
        if bias is not None and bias is not self._bias:
            self.mk.set_bias(bias)
            self._bias = bias
        with torch.no_grad():
            res = self.mk.step(emb.reshape(1, -1), [self.pos], region_heads=self.region_heads)
        self.pos += 1
        return res

    def logits(self) -> torch.Tensor:
        return self.mk.logits


def load_moondream_fast(path_or_id: str | Path = "moondream2", device: str | torch.device = "cuda",
                        dtype: torch.dtype | str = torch.float32, tiling: Tiling = Tiling(),
                        max_len: int | None = None) -> FastMoondream:
    """load_moondream with the Triton ops (vision + prefill), wrapped with the decode megakernel.
    On CPU this only works under TRITON_INTERPRET=1 (a test mode; see backends.select)."""
    from photon_core.backends.select import get_backend
    backend: Any = get_backend("triton", device)
    return FastMoondream(load_moondream(path_or_id, device, dtype, backend=backend), tiling, max_len)
