"""Moondream 2's decode on the megakernel: every decode step (LM head and region heads included) is
one launch of the step graph compiled by photon_core.megakernel (decoder_step.py), while the vision
encoder and the prompt prefill run on the per-op Triton kernels of the model's ops.

A MoondreamModel loaded with the "megakernel" backend holds one MegakernelDecode (`model.decode`);
its skills go through it:
* a request: the prompt except its last token is prefilled with the per-op kernels (text.forward
  after the image's K/V), the image and prompt K/V are copied into the request's row of the
  megakernel's KV cache, and the last prompt token is the first megakernel step. Each step yields, in
  ONE launch, the LM argmax under each row's mask (a -inf logit bias), the coordinate bin and the two
  size bins, all read from the last hidden state before post_ln.
* detect, point and `batch`: batch.py's decode protocol (shared with the ops path) with a
  MegakernelStepper: up to 8 requests share each launch in the smallest batch bucket (1, 2, 4, 8)
  that holds them; every bucket's compiled step reads one shared copy of the weights. Greedy
  batches decode the steps after the prompt's in rounds on the device (object_rounds.py: the
  protocol's next inputs chosen by device ops, the host reading a round of results at once).
* caption/query stream their text from a batch-1 loop (skills.generate_text's rules, step for step;
  not Moondream 3's, whose answers feed coord/size tokens back as region values: batch.py's protocol);
  greedy ones decode in rounds on the device (megakernel.decode_loop: the masked argmax's token is
  embedded into the next step's input by device ops; on CUDA one CUDA-graph replay and one read per
  round of up to 8 tokens). `sequence` gives that loop's one-request decode state to other
  protocols (Moondream 3's segment).

The compiled step class comes from the model (`model.decoder_megakernel()`), and the prefill and
embeddings from its `text_impl`, so Moondream 3 (another decoder on the same skills) runs here too.

One request or batch at a time per model: the compiled steps' state (KV cache, activations) is one
arena per bucket. A concurrent second call raises instead of corrupting the first.
"""
from __future__ import annotations

from collections.abc import Collection, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch

from photon_core.megakernel.compiler import Tiling
from photon_core.megakernel.decode_loop import DeviceDecode
from photon_core.models.moondream import batch as batch_decoding
from photon_core.models.moondream import object_rounds, object_score, skills
from photon_core.models.moondream.batch import Request
from photon_core.models.moondream.decoder_step import MoondreamDecoderMegakernel, StepResult
from photon_core.runtime.decode import (CompiledSteps, copy_prefilled_kv, decode_length, require_triton_ops,
                                       resolve_weight_dtype)
from photon_core.runtime.sampling import Sampling, pick, step_argmax

if TYPE_CHECKING:
    from photon_core.models.moondream.model import EncodedImage, MoondreamModel


class MegakernelDecode(CompiledSteps[MoondreamDecoderMegakernel]):
    """The decode megakernels of one MoondreamModel (whose ops module is the megakernel backend's
    per-op Triton kernels): one compiled step per batch bucket, all sharing one copy of the weights."""

    family = "A Moondream model"

    def __init__(self, model: "MoondreamModel", tiling: Tiling = Tiling(), max_len: int | None = None,
                 weight_dtype: torch.dtype | None = None) -> None:
        """max_len: the KV caches' context (a smaller one fits a smaller GPU: the caches, bf16 on a
        GPU and fp32 on the CPU, are per bucket); weight_dtype: what each step streams, None = bfloat16 on CUDA (half the bytes, math
        still fp32) and the model's dtype elsewhere (the fidelity tests' fp32)."""
        require_triton_ops(model.ops, "Moondream", "load_moondream")
        super().__init__(decode_length(max_len, model.config.text.max_context),
                         resolve_weight_dtype(weight_dtype, model.dtype, model.device))
        self.model, self.config, self.tokenizer = model, model.config, model.tokenizer
        self.device, self.dtype = model.device, model.dtype
        self.tiling = tiling
        self.step_class = model.decoder_megakernel()
        self.device_rounds = True   # greedy batches (detect, point...) in rounds; False: host-driven steps
        # The two masks every skill uses; the megakernel applies them as logit biases.
        self._answer, self._boundary = skills.answer_mask(model), skills.boundary_mask(model)

    # -- the megakernels -------------------------------------------------------------------------
    def build_step(self, batch: int, weights: Any | None) -> MoondreamDecoderMegakernel:
        """Both graphs of one bucket: with and without the region heads."""
        return self.step_class(self.model.text_w, self.model.region_w, self.config, batch=batch,
                               max_len=self.max_len, tiling=self.tiling, weight_dtype=self.weight_dtype,
                               weights=weights, device=self.device)

    def build_loop(self, mk: MoondreamDecoderMegakernel) -> tuple["object_rounds.ObjectRounds", DeviceDecode | None]:
        """Every bucket's object rounds; the batch-1 bucket's caption/query rounds too."""
        rounds = object_rounds.ObjectRounds(self, mk)
        return rounds, self._rounds(mk) if mk.batch == 1 else None

    def object_rounds(self, mk: MoondreamDecoderMegakernel) -> "object_rounds.ObjectRounds":
        """The device side of batch rounds on `mk`'s bucket (object_rounds.py)."""
        return self.loop(mk.batch)[0]

    @property
    def _text_loop(self) -> DeviceDecode:
        """The caption/query rounds, built with the batch-1 bucket (build_loop)."""
        return self.loop(1)[1]

    def _rounds(self, mk: MoondreamDecoderMegakernel) -> DeviceDecode:
        """Greedy caption/query rounds on the batch-1 step's text graph: the masked argmax picks the
        token, and its embedding becomes the next step's input, both on the device."""
        m = self.model
        token = mk.out.view(mk.batch, -1)[:, mk.graph_def.results.index("token")]
        x = mk.view("x")

        def feed(tok: torch.Tensor) -> None:
            x.copy_(m.text_impl.embed(tok.long()[:, None], m.text_w).reshape(x.shape))
        return DeviceDecode(mk, pick=lambda: token, results=("token",), feed=feed)

    def batch(self, requests: list[Request]) -> list[dict]:
        """Up to 8 requests (any skills) decoded together: each step is one megakernel launch of the
        smallest batch bucket that holds them (batch.py's protocol and results)."""
        if len(requests) > self.max_rows:
            return self.batch(requests[:self.max_rows]) + self.batch(requests[self.max_rows:])
        with self.exclusive():
            return batch_decoding.run(self.model, requests, self._decode_rows)

    def _decode_rows(self, rows: list, encoded: list[EncodedImage]) -> None:
        rounds = self.device_rounds and object_rounds.greedy(rows)
        session = (object_rounds.RoundsSession(self, rows, encoded) if rounds
                   else batch_decoding.BatchSession(self.model, rows, encoded, MegakernelStepper(self)))
        for _ in batch_decoding.decode(session, device_rounds=rounds):
            pass

    def stream(self, request: Request) -> dict:
        """batch.stream on megakernel steps (a reasoning query streamed), holding the steps'
        state from the first step to the answer's last piece (or until the caller drops it)."""
        def steps(rows: list, encoded: list[EncodedImage]) -> Iterator[None]:
            with self.exclusive(), torch.no_grad():
                # a greedy answer (Moondream 3's, whose coord/size tokens the text loop cannot feed
                # as region values: model._text) in rounds, as _decode_rows decodes it
                rounds = self.device_rounds and object_rounds.greedy(rows)
                session = (object_rounds.RoundsSession(self, rows, encoded) if rounds
                           else batch_decoding.BatchSession(self.model, rows, encoded, MegakernelStepper(self)))
                yield from batch_decoding.decode(session, device_rounds=rounds)
        return batch_decoding.stream(self.model, request, steps)

    def generate_text(self, enc: EncodedImage, prompt: list[int], s: Sampling,
                      refs: list | None = None) -> Iterator[str]:
        """skills.generate_text with megakernel steps; yields text pieces. Greedy: the tokens after
        the first decode in rounds on the device."""
        skills.check_text_loop(self.model)
        skills.check_prompt(self.model, enc, prompt)
        length = min(self.config.text.max_context, enc.pos + len(prompt) + s.max_tokens)

        def choose(row: int, logits: torch.Tensor, greedy: int | None) -> int:
            # Greedy: the step's own masked argmax.
            if s.greedy and greedy is not None:
                return step_argmax(greedy)
            return pick(logits, s, self.model.ops, self._answer)

        def pieces() -> Iterator[str]:
            with self.sequence(enc, length, region_heads=False) as seq:
                yield from skills.text_tokens(self.model, TextSession(self, seq, prompt, refs), s,
                                              enc.pos + len(prompt), length, choose, device_rounds=True)
        return pieces()

    @contextmanager
    def sequence(self, enc: EncodedImage, length: int, region_heads: bool = True) -> Iterator["Sequence"]:
        """One request's decode state on the batch-1 step (row 0), held exclusively while in use."""
        with self.exclusive(), torch.no_grad():
            yield Sequence(self, enc, length, region_heads)


def size_values(bins: tuple[int, int]) -> tuple[float, float]:
    """(width bin, height bin) -> sizes, with region.decode_sizes' exact float32 arithmetic."""
    size = torch.pow(2.0, torch.tensor(bins, dtype=torch.int64).float() / 1023.0 * 10.0 - 10.0)
    return size[0].item(), size[1].item()


def _prefill_row(fm: MegakernelDecode, mk: MoondreamDecoderMegakernel, slot: int, enc: EncodedImage,
                 emb: torch.Tensor) -> None:
    """The image prefix and the prompt inputs `emb` [1, T, dim] into row `slot` of mk's KV caches.
    The prompt runs through the per-op kernels on a KV cache of the model's dtype (the per-op
    attention wants q, k, v alike); the image prefix plus the prefilled positions are then copied
    into the arena row (its KV dtype). An empty prefix (a text-only query): causal."""
    m = fm.model
    tx = m.text_impl
    k, v = enc.k, enc.v
    if emb.shape[1]:
        tmp = tx.KVCache(m.config.text, enc.pos + emb.shape[1], m.dtype, m.device)
        tmp.k[:, :, :, :enc.pos] = k
        tmp.v[:, :, :, :enc.pos] = v
        skills.forward(m, emb, enc.pos, tmp, text_only=enc.pos == 0 or enc.causal)
        k, v = tmp.k, tmp.v
    copy_prefilled_kv(mk, ("kcache", "vcache"), list(zip(k, v)), slice(slot, slot + 1))


class MegakernelStepper:
    """batch.py's stepper on the decode megakernel: the requests take rows (slots) of the smallest
    bucket that holds them; each prompt but its last token is prefilled per-op into its slot, and
    every step (the first one feeds the last prompt tokens) is one launch for all slots. The LM
    argmax under each row's mask (a logit-bias row) and the region bins come out of that launch.
    Slots without a live request decode a placeholder at position 0 of their own row."""

    def __init__(self, fm: MegakernelDecode) -> None:
        self.fm = fm
        # coordinate = bin / n_bins: the model's rule (region_impl.coord_divisor)
        self.n_bins = fm.model.region_impl.coord_divisor(fm.config.region.coord_out_dim)

    def start(self, rows: list, encoded: list[EncodedImage]) -> "MegakernelHeads":
        fm = self.fm
        self.mk = fm.for_rows(len(rows))
        longest = max(r.length for r in rows)
        if longest > self.mk.max_len:
            raise ValueError(f"request of {longest} positions exceeds the megakernel's KV cache ({self.mk.max_len})")
        self.slots = list(range(len(rows)))
        idle = [fm._answer] * (self.mk.batch - len(rows))
        self.masks = batch_decoding.row_masks(fm.model, rows) + idle
        self.mk.set_bias(torch.stack(self.masks))
        # region heads: objects' coordinates and sizes, a reasoning's grounding coordinates, and
        # any answer's where its coord/size tokens are fed as region values (spatial_tokens_fed)
        self.region_heads = fm.model.spatial_tokens_fed or any(r.is_object or r.request.reasoning for r in rows)
        last = []
        for slot, (row, enc) in enumerate(zip(rows, encoded)):
            emb = skills.prompt_embeddings(fm.model, row.prompt, row.refs)
            _prefill_row(fm, self.mk, slot, enc, emb[:, :-1])
            last.append(emb[:, -1:])
        return self.step(torch.cat(last), [r.pos + len(r.prompt) - 1 for r in rows])

    def step(self, inputs: torch.Tensor, positions: list[int]) -> "MegakernelHeads":
        emb = torch.zeros(self.mk.batch, self.fm.config.text.dim, device=self.fm.device)
        pos = [0] * self.mk.batch
        emb[self.slots] = inputs.reshape(len(self.slots), -1).to(emb.dtype)
        for slot, p in zip(self.slots, positions):
            pos[slot] = p
        res = self.mk.step(emb, pos, region_heads=self.region_heads)
        return MegakernelHeads(res, list(self.slots), self.mk, self.n_bins, self.fm.config.tokenizer)

    def keep(self, rows: list[int]) -> None:
        self.slots = [self.slots[i] for i in rows]

    def set_mask(self, row: int, allowed: torch.Tensor) -> None:
        self.masks[self.slots[row]] = allowed
        self.mk.set_bias(torch.stack(self.masks))


def _checked_sizes(bins: Any) -> Any:
    for b in bins:
        step_argmax(int(b), "size logits")
    return bins


class MegakernelHeads:
    """One launch's results, by request row: the in-kernel masked argmax, the biased logits (and the
    objects' scores from them), and the coordinate/size bins turned into values with the region
    heads' exact arithmetic."""

    def __init__(self, res: StepResult, slots: list[int], mk: MoondreamDecoderMegakernel, n_bins: int,
                 tokenizer: Any) -> None:
        self.res, self.slots, self.mk, self.n_bins, self.tk = res, slots, mk, n_bins, tokenizer

    def tokens(self, rows: list[int]) -> list[int]:
        return [step_argmax(self.res.tokens[self.slots[i]]) for i in rows]

    def logits(self, row: int) -> torch.Tensor:
        return self.mk.logits[self.slots[row]].clone()

    def boundary_scores(self, rows: list[int]) -> list[float]:
        """P(coord) at the boundaries of `rows` (object_score) from this launch's biased logits
        (read before the next launch overwrites them)."""
        logits = self.mk.logits[[self.slots[i] for i in rows]]
        return object_score.continue_probability(logits, self.tk.coord_id, self.tk.eos_id).tolist()

    def hidden_of(self, rows: list[int]) -> torch.Tensor:
        """The rows' hidden states before post_ln (a sampled row's region values are drawn from them)."""
        return self.res.hidden[[self.slots[i] for i in rows]]

    def coords(self, rows: list[int]) -> list[float]:
        bins = self.res.coord_bins
        if bins is None:
            raise RuntimeError("this step ran without the region heads: it has no coordinates")
        return [step_argmax(bins[self.slots[i]], "coordinate logits") / self.n_bins for i in rows]

    def sizes(self, rows: list[int]) -> list[tuple[float, float]]:
        bins = self.res.size_bins
        if bins is None:
            raise RuntimeError("this step ran without the region heads: it has no sizes")
        return [size_values(_checked_sizes(bins[self.slots[i]])) for i in rows]


class Sequence:
    """One request's decode state on the batch-1 megakernel: row 0 of its KV cache and the
    position. Used inside MegakernelDecode.exclusive() (MegakernelDecode.sequence holds it)."""

    def __init__(self, fm: MegakernelDecode, enc: EncodedImage, length: int, region_heads: bool) -> None:
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
            return self.fm.model.text_impl.embed(torch.tensor([ids], device=self.fm.device), self.fm.model.text_w)

    def prompt(self, ids: list[int], bias: torch.Tensor, refs: list | None = None) -> StepResult:
        """All prompt tokens but the last through the per-op kernels, the last one as the first
        megakernel step; `refs` fill the prompt's spatial placeholders (skills.prompt_embeddings)."""
        if self.pos + len(ids) > self.length:
            raise RuntimeError(f"sequence of {self.pos + len(ids)} tokens exceeds the KV cache ({self.length})")
        with torch.no_grad():
            emb = skills.prompt_embeddings(self.fm.model, ids, refs)
            _prefill_row(self.fm, self.mk, 0, self.enc, emb[:, :-1])
        self.pos += len(ids) - 1
        return self.step(emb[:, -1:], bias)

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


class TextSession:
    """runtime.generate's session on the batch-1 step (a caption or query): the in-kernel masked
    argmax comes with each step; greedy rounds run on the text graph (`_text_loop`)."""

    def __init__(self, fm: MegakernelDecode, seq: Sequence, prompt: list[int], refs: list | None = None) -> None:
        self.fm, self.seq, self.prompt, self.refs = fm, seq, prompt, refs

    def prefill(self) -> tuple[torch.Tensor, list[int]]:
        res = self.seq.prompt(self.prompt, self.fm._answer, self.refs)
        return self.seq.logits(), res.tokens

    def step(self, tokens: list[int]) -> tuple[torch.Tensor, list[int]]:
        res = self.seq.step(self.seq.embed(tokens))
        return self.seq.logits(), res.tokens

    def keep(self, rows: list[int]) -> None:
        pass   # one row: it either goes on or the loop ends

    def rounds(self, first: list[int], max_new: list[int], stop: Collection[int]) -> Iterator[tuple[int, int]]:
        seq = self.seq
        seq.mk.set_step(None, [seq.pos])
        seq.mk.view("x").copy_(seq.embed(first).reshape(1, -1))
        return self.fm._text_loop.stream(first, max_new, stop)

