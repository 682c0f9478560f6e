"""Moondream 2 on the fast path: vision encoder and prefill through the per-op Triton kernels, every
decode step (LM head and region heads included) through the decode megakernel.

    fast = load_moondream_fast("moondream2", device="cuda")      # or FastMoondream(model)
    fast.detect(image, "cup")  /  fast.point(...)  /  fast.caption(...)  /  fast.query(...)

Same skills API and results as MoondreamModel (model.py); the prompt templates, masks and result
shapes come from skills.py. What differs is only where the math runs:
* encode_image: the wrapped MoondreamModel's own encode_image, whose ops module is the Triton backend
  (vision crops through the encoder, projection, bidirectional prefill of [BOS][image tokens]).
* a request: the prompt except its last token is prefilled with the per-op kernels (text.forward
  after the image's K/V), the image and prompt K/V are copied into the request's row of the
  megakernel's KV cache, and the last prompt token is the first megakernel step. Each step yields, in
  ONE launch, the LM argmax under each row's mask (a -inf logit bias), the coordinate bin and the two
  size bins, all read from the last hidden state before post_ln.
* detect, point and `batch`: batch.py's decode protocol (shared with MoondreamModel) with a
  MegakernelStepper: up to 8 requests share each launch in the smallest batch bucket (1, 2, 4, 8)
  that holds them; every bucket's megakernel reads one shared copy of the weights.
* caption/query stream their text from a batch-1 loop (skills.generate_text's rules, step for step).

One request or batch at a time per FastMoondream: the megakernels' state (KV cache, activations)
is one arena per bucket. A concurrent second call raises instead of corrupting the first.
"""
from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from photon_core.megakernel.graph import BATCH_BUCKETS, bucket_for
from photon_core.megakernel.compiler import Tiling
from photon_core.models.moondream.decoder_step import MoondreamDecoderMegakernel, StepResult
from photon_core.models.moondream import batch as batch_decoding
from photon_core.models.moondream import skills, text
from photon_core.models.moondream.batch import Request
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
        self._decoders: dict[int, MoondreamDecoderMegakernel] = {}
        self._busy = threading.Lock()
        # The two masks every skill uses; the megakernel applies them as logit biases.
        self._answer, self._boundary = skills.answer_mask(model), skills.boundary_mask(model)

    @property
    def model_id(self) -> str:
        return self.model.model_id

    # -- the megakernels -------------------------------------------------------------------------
    def decoder(self, batch: int = 1) -> MoondreamDecoderMegakernel:
        """The decode megakernel of one batch bucket (both graphs: with and without the region
        heads), built on first use; every bucket shares the first one's copy of the weights."""
        if batch not in self._decoders:
            wd = self.dtype if self.dtype in (torch.float32, torch.bfloat16, torch.float16) else torch.float32
            shared = next(iter(self._decoders.values())).weights if self._decoders else None
            self._decoders[batch] = MoondreamDecoderMegakernel(
                self.model.text_w, self.model.region_w, self.config, batch=batch, max_len=self.max_len,
                tiling=self.tiling, weight_dtype=wd, weights=shared)
        return self._decoders[batch]

    @contextmanager
    def _exclusive(self) -> Iterator[None]:
        """The megakernels' arenas hold one request (or one batch) at a time."""
        if not self._busy.acquire(blocking=False):
            raise RuntimeError("FastMoondream runs one request or batch at a time (its megakernel arenas); "
                               "finish or close the running request (e.g. a streaming caption) first")
        try:
            yield
        finally:
            self._busy.release()

    # -- image -------------------------------------------------------------------------------------
    def encode_image(self, image: ImageLike | EncodedImage, channel_order: str = "rgb") -> EncodedImage:
        """Vision encoder + prefill through the per-op Triton kernels (the wrapped model's ops)."""
        return self.model.encode_image(image, channel_order)

    # -- skills ------------------------------------------------------------------------------------
    def detect(self, image: ImageLike | EncodedImage, object: str,
               max_objects: int = skills.DEFAULT_MAX_OBJECTS) -> dict:
        return self.batch([Request("detect", image, object, max_objects)])[0]

    def point(self, image: ImageLike | EncodedImage, object: str,
              max_objects: int = skills.DEFAULT_MAX_OBJECTS) -> dict:
        return self.batch([Request("point", image, object, max_objects)])[0]

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

    def batch(self, requests: list[Request]) -> list[dict]:
        """Up to 8 requests (any skills) decoded together: each step is one megakernel launch of the
        smallest batch bucket that holds them (MoondreamModel.batch's protocol and results)."""
        if len(requests) > BATCH_BUCKETS[-1]:
            return self.batch(requests[:BATCH_BUCKETS[-1]]) + self.batch(requests[BATCH_BUCKETS[-1]:])
        with self._exclusive():
            return batch_decoding.run(self.model, requests, MegakernelStepper(self))

    # -- decoding ----------------------------------------------------------------------------------
    def _generate_text(self, enc: EncodedImage, prompt: list[int], max_tokens: int, temperature: float,
                       top_p: float) -> Iterator[str]:
        """skills.generate_text with megakernel steps; yields text pieces."""
        if max_tokens < 0 or temperature < 0 or not 0 < top_p <= 1:
            raise ValueError("need max_tokens >= 0, temperature >= 0 and 0 < top_p <= 1")
        skills.check_prompt(self.model, enc, prompt)
        cfg = self.config
        length = min(cfg.text.max_context, enc.pos + len(prompt) + max_tokens)

        def tokens() -> Iterator[int]:
            with self._exclusive(), torch.no_grad():
                seq = _Request(self, enc, length, region_heads=False)
                res = seq.prompt(prompt, self._answer)
                for n in range(1, max_tokens + 1):
                    if temperature == 0:
                        tok = res.tokens[0]  # the in-kernel masked argmax
                    else:
                        tok = skills.sample_token(seq.logits()[0].clone(), self._answer, temperature, top_p,
                                                 self.model.ops)
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


def _prefill_row(fm: FastMoondream, cache: Any, enc: EncodedImage, ids: list[int]) -> None:
    """The image prefix and `ids` into one row of a megakernel KV cache. The prompt runs through the
    per-op kernels on a KV cache of the model's dtype (the per-op attention wants q, k, v alike);
    the image prefix plus the prefilled positions are then copied into the fp32 arena row."""
    m = fm.model
    k, v = enc.k, enc.v
    if ids:
        tmp = text.KVCache(m.config.text, enc.pos + len(ids), m.dtype, m.device)
        tmp.k[:, :, :, :enc.pos] = k
        tmp.v[:, :, :, :enc.pos] = v
        emb = text.embed(torch.tensor([ids], device=fm.device), m.text_w)
        text.forward(emb, enc.pos, m.text_w, m.config.text, tmp, m.ops)
        k, v = tmp.k, tmp.v
    cache.k[:, :, :, :k.shape[3]] = k
    cache.v[:, :, :, :v.shape[3]] = v


class MegakernelStepper:
    """batch.py's stepper on the decode megakernel: the requests take rows (slots) of the smallest
    bucket that holds them; each prompt but its last token is prefilled per-op into its slot, and
    every step (the first one feeds the last prompt tokens) is one launch for all slots. The LM
    argmax under each row's mask (a logit-bias row) and the region bins come out of that launch.
    Slots without a live request decode a placeholder at position 0 of their own row."""

    def __init__(self, fm: FastMoondream) -> None:
        self.fm = fm
        self.n_bins = fm.config.region.coord_out_dim

    def start(self, rows: list, encoded: list[EncodedImage]) -> "MegakernelHeads":
        fm = self.fm
        self.mk = fm.decoder(bucket_for(len(rows)))
        longest = max(r.length for r in rows)
        if longest > self.mk.max_len:
            raise ValueError(f"request of {longest} positions exceeds the megakernel's KV cache ({self.mk.max_len})")
        self.slots = list(range(len(rows)))
        objects = [r.is_object for r in rows]
        idle = [fm._answer] * (self.mk.batch - len(rows))
        self.mk.set_bias(torch.stack([fm._boundary if o else fm._answer for o in objects] + idle))
        self.region_heads = any(objects)
        for slot, (row, enc) in enumerate(zip(rows, encoded)):
            _prefill_row(fm, self.mk.cache(slot), enc, row.prompt[:-1])
        last = torch.tensor([[r.prompt[-1]] for r in rows], device=fm.device)
        return self.step(text.embed(last, fm.model.text_w), [r.pos + len(r.prompt) - 1 for r in rows])

    def step(self, inputs: torch.Tensor, positions: list[int]) -> "MegakernelHeads":
        emb = torch.zeros(self.mk.batch, self.fm.config.text.dim, device=self.fm.device)
        pos = [0] * self.mk.batch
        emb[self.slots] = inputs.reshape(len(self.slots), -1).to(emb.dtype)
        for slot, p in zip(self.slots, positions):
            pos[slot] = p
        res = self.mk.step(emb, pos, region_heads=self.region_heads)
        return MegakernelHeads(res, list(self.slots), self.mk, self.n_bins)

    def keep(self, rows: list[int]) -> None:
        self.slots = [self.slots[i] for i in rows]


class MegakernelHeads:
    """One launch's results, by request row: the in-kernel masked argmax, the biased logits, and the
    coordinate/size bins turned into values with the region heads' exact arithmetic."""

    def __init__(self, res: StepResult, slots: list[int], mk: MoondreamDecoderMegakernel, n_bins: int) -> None:
        self.res, self.slots, self.mk, self.n_bins = res, slots, mk, n_bins

    def tokens(self, rows: list[int]) -> list[int]:
        return [self.res.tokens[self.slots[i]] for i in rows]

    def logits(self, row: int) -> torch.Tensor:
        return self.mk.logits[self.slots[row]].clone()

    def coords(self, rows: list[int]) -> list[float]:
        return [self.res.coord_bins[self.slots[i]] / self.n_bins for i in rows]

    def sizes(self, rows: list[int]) -> list[tuple[float, float]]:
        return [_size_values(self.res.size_bins[self.slots[i]]) for i in rows]


class _Request:
    """One streaming request's decode state on the batch-1 megakernel: row 0 of its KV cache and
    the position. Used inside FastMoondream._exclusive()."""

    def __init__(self, fm: FastMoondream, enc: EncodedImage, length: int, region_heads: bool) -> None:
        fm.model._check_owner(enc)
        self.fm, self.enc, self.length = fm, enc, length
        self.mk = fm.decoder(1)
        self.region_heads = region_heads
        if length > self.mk.max_len:
            raise ValueError(f"request of {length} positions exceeds the megakernel's KV cache ({self.mk.max_len})")
        self.pos = enc.pos
        self._bias: torch.Tensor | None = None

    def embed(self, ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return text.embed(torch.tensor([ids], device=self.fm.device), self.fm.model.text_w)

    def prompt(self, ids: list[int], bias: torch.Tensor) -> StepResult:
        """All prompt tokens but the last through the per-op kernels, the last one as the first
        megakernel step."""
        if self.pos + len(ids) > self.length:
            raise RuntimeError(f"sequence of {self.pos + len(ids)} tokens exceeds the KV cache ({self.length})")
        with torch.no_grad():
            _prefill_row(self.fm, self.mk.cache(0), self.enc, ids[:-1])
        self.pos += len(ids) - 1
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
