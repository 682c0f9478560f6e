"""The four skills: prompt templates, decoding loops and result shapes.

Every request continues from an encoded image (the KV cache of [BOS][729 image tokens]) in a cache of
its own. Caption and query stream their text from `generate_text`; detect and point decode with the
region module (the object protocol lives in batch.py, which runs one request or several together).
Moondream 3's captions and queries decode through batch.py too (check_text_loop says why).
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

import dataclasses
from typing import Any

from photon_core.runtime.requests import DEFAULT_MAX_OBJECTS, DEFAULT_MAX_TOKENS, SpatialRef  # noqa: F401
from photon_core.runtime.generate import Choose, Session, generate, room
from photon_core.runtime.sampling import Sampling, pick
from photon_core.runtime.text_stream import text_pieces

if TYPE_CHECKING:
    from .model import EncodedImage, MoondreamModel



class Sequence:
    """One request's decoding state: its KV cache and the next position."""

    def __init__(self, model: "MoondreamModel", enc: "EncodedImage", length: int, lora: Any = None) -> None:
        self.model, self.lora = model, lora
        self.cache = model.text_impl.KVCache(model.config.text, length, model.dtype, model.device)
        self.cache.k[:, :, :, :enc.pos] = enc.k
        self.cache.v[:, :, :, :enc.pos] = enc.v
        self.pos = enc.pos
        self.text_only = enc.pos == 0 or enc.causal   # a text-only query, a chat's text-only history

    @torch.inference_mode()
    def step(self, emb: torch.Tensor) -> torch.Tensor:
        """Feed input embeddings [1, T, dim]; returns the logits [1, vocab] after the last one."""
        m = self.model
        hidden = forward(m, emb, self.pos, self.cache, self.lora, self.text_only)[:, -1]
        self.pos += emb.shape[1]
        return m.text_impl.lm_logits(hidden, m.text_w, m.ops)

    @torch.inference_mode()
    def embed(self, ids: list[int]) -> torch.Tensor:
        return self.model.text_impl.embed(torch.tensor([ids], device=self.model.device), self.model.text_w)


def forward(model: "MoondreamModel", x: torch.Tensor, pos: int | torch.Tensor, cache: Any, lora: Any = None,
            text_only: bool = False, bidirectional_to: int | None = None) -> torch.Tensor:
    """The text decoder on inputs x at `pos`, with the variant's adapter `lora` (None: the base
    model). text_only: a sequence without an image prefix (a text-only query) attends causally
    throughout, as the reference's text-only mask does; otherwise the [BOS][image] prefix is
    bidirectional. bidirectional_to: every position before it sees every other one (an image
    block placed later in a sequence, chat.py: its queries see the whole block and all before)."""
    cfg = model.config.text
    if text_only or bidirectional_to is not None:
        cfg = dataclasses.replace(cfg, prefix_attn=bidirectional_to or 0)
    if lora is None:
        return model.text_impl.forward(x, pos, model.text_w, cfg, cache, model.ops)
    return model.text_impl.forward(x, pos, model.text_w, cfg, cache, model.ops, lora=lora)


def variant(model: "MoondreamModel", name: str | None) -> Any:
    """The adapter of settings["variant"] (None: none). ValueError for an unknown or bad one."""
    if name is None:
        return None
    from .lora import variant_for
    return variant_for(model, name)


def check_prompt(model: "MoondreamModel", enc: "EncodedImage", ids: list[int]) -> None:
    if enc.pos + len(ids) >= model.config.text.max_context:
        raise ValueError(f"prompt of {len(ids)} tokens does not fit the context "
                         f"({model.config.text.max_context} incl. {enc.pos} image tokens)")


def check_text_loop(model: "MoondreamModel") -> None:
    """ValueError for a model whose answers feed coord/size tokens back as region values
    (spatial_tokens_fed: Moondream 3): the text loops feed every token's embedding, so they would
    decode another sequence; its answers decode through batch.py (model._text routes them)."""
    if model.spatial_tokens_fed:
        raise ValueError(f"{model.model_id}: an answer's coord/size tokens are fed back as region values, which "
                         "this text loop cannot do: decode it with model.caption/query/batch")


def answer_mask(model: "MoondreamModel") -> torch.Tensor:
    """Tokens an answer (caption, query) may contain: all but the model's `answer_barred`
    (Moondream 2: the answer marker, which ends its prompt; Moondream 3 bars nothing, as kestrel
    suppresses nothing in its answers)."""
    tk = model.config.tokenizer
    allowed = torch.ones(model.config.text.vocab_size, dtype=torch.bool, device=model.device)
    barred = [getattr(tk, name) for name in model.answer_barred]
    if barred:
        allowed[barred] = False
    return allowed


def boundary_mask(model: "MoondreamModel") -> torch.Tensor:
    """At an object boundary: another object (coord) or the end (eos)."""
    tk = model.config.tokenizer
    return allowed_mask(model.config.text.vocab_size, [tk.coord_id, tk.eos_id], model.device)


def allowed_mask(vocab: int, ids: list[int], device) -> torch.Tensor:
    mask = torch.zeros(vocab, dtype=torch.bool, device=device)
    mask[ids] = True
    return mask


def generate_text(model: "MoondreamModel", enc: "EncodedImage", prompt: list[int], s: Sampling,
                  refs: list[SpatialRef] | None = None, lora: Any = None) -> Iterator[str]:
    """Yields the answer text in pieces as tokens are decoded (caption and query); `refs` fill the
    prompt's coord/size placeholders (prompt_embeddings)."""
    check_text_loop(model)
    check_prompt(model, enc, prompt)
    length = min(model.config.text.max_context, enc.pos + len(prompt) + s.max_tokens)
    session = TextSession(Sequence(model, enc, length, lora), prompt_embeddings(model, prompt, refs))
    allowed = answer_mask(model)
    return text_tokens(model, session, s, enc.pos + len(prompt), length,
                       lambda _, logits, greedy: pick(logits, s, model.ops, allowed))


class TextSession:
    """runtime.generate's session on one request's Sequence (a caption or query)."""

    def __init__(self, seq: Sequence, prompt: torch.Tensor) -> None:
        self.seq, self.prompt = seq, prompt   # the prompt's input embeddings [1, T, dim]

    def prefill(self) -> tuple[torch.Tensor, None]:
        return self.seq.step(self.prompt), None

    def step(self, tokens: list[int]) -> tuple[torch.Tensor, None]:
        return self.seq.step(self.seq.embed(tokens)), None

    def keep(self, rows: list[int]) -> None:
        pass   # one row: it either goes on or the loop ends


def text_tokens(model: "MoondreamModel", session: Session, s: Sampling, prompt_end: int, length: int,
                choose: Choose, device_rounds: bool = False) -> Iterator[str]:
    """The answer of a one-row session (its prompt ending at `prompt_end`, `length` positions) as
    text pieces, decoded lazily as the caller reads."""
    eos = {model.config.tokenizer.eos_id}
    steps = generate(session, [s], [room(s.max_tokens, prompt_end, length)], eos, choose,
                     device_rounds=device_rounds)
    # One row: every step's list holds its token (generate yields a step only when a row has one).
    return text_pieces(model.tokenizer.decode, (tok for new in steps for tok in new if tok is not None))


def caption_prompt(model: "MoondreamModel", length: str) -> list[int]:
    templates = model.config.tokenizer.templates["caption"]
    if length not in templates:
        raise ValueError(f"caption length must be one of {sorted(templates)}, got {length!r}")
    return list(templates[length])


def _wrap(model: "MoondreamModel", skill: str, words: list[int]) -> list[int]:
    t = model.config.tokenizer.templates[skill]
    return list(t["prefix"]) + words + list(t["suffix"])


def query_prompt(model: "MoondreamModel", question: str, refs: list[SpatialRef] | None = None,
                 reasoning: bool = False, text_only: bool = False, as_written: bool = False) -> list[int]:
    """prefix + refs' placeholders + question + the opener (query_openers). A text-only query
    starts with BOS (no image prefix holds it). as_written: a chat turn's text, which may be empty
    (no question tokens) or whitespace (batch.ChatTurn); a query's question must have words."""
    if not isinstance(question, str) or not (question.strip() or as_written):
        raise ValueError("question must be a non-empty string")
    tk = model.config.tokenizer
    bos = [tk.bos_id] if text_only else []
    answer, think = query_openers(model)
    return bos + list(tk.templates["query"]["prefix"]) + ref_placeholders(model, refs) + \
        (model.tokenizer.encode(question) if question else []) + (think if reasoning else answer)


def query_openers(model: "MoondreamModel") -> tuple[list[int], list[int]]:
    """What follows a question: (to an answer, to reasoning). A template with `answer_prefix` /
    `reasoning_prefix` (Moondream 3's; kestrel's QueryTemplate) says so itself. Moondream 2's
    (prefix/suffix) answers after the suffix twice and reasons after suffix + thinking: the doubled
    answer marker is what the public reference (2025-06 tokenizer/release) sends, Q <answer>
    [<thinking> ... ] <answer> answer, and kestrel's Moondream 2 template ([3, 3] / [3, 4])."""
    tk = model.config.tokenizer
    t = tk.templates["query"]
    if "answer_prefix" in t:
        return list(t["answer_prefix"]), list(t["reasoning_prefix"])
    return list(t["suffix"]) * 2, list(t["suffix"]) + [tk.thinking_id]


def object_prompt(model: "MoondreamModel", skill: str, name: str, refs: list[SpatialRef] | None = None) -> list[int]:
    """prefix + refs' placeholders + " object" + suffix: a point request's spatial references sit
    where a query's do, after the prefix (the public reference's point takes none)."""
    if not isinstance(name, str) or not name.strip():
        raise ValueError("object must be a non-empty string")
    return _wrap(model, skill, ref_placeholders(model, refs) + model.tokenizer.encode(" " + name))


def ref_placeholders(model: "MoondreamModel", refs: list[SpatialRef] | None) -> list[int]:
    """The prompt tokens that stand for spatial references: coord coord for a point (x, y), coord
    coord size for a box (its centre, then its width and height), as the reference lays them out."""
    tk = model.config.tokenizer
    out: list[int] = []
    for ref in refs or []:
        out += [tk.coord_id, tk.coord_id] + ([tk.size_id] if len(ref) == 4 else [])
    return out


@torch.inference_mode()
def prompt_embeddings(model: "MoondreamModel", ids: list[int], refs: list[SpatialRef] | None = None) -> torch.Tensor:
    """The prompt's input embeddings [1, T, dim]: token embeddings, with every coord placeholder
    replaced by the region encoder's embedding of the references' coordinates (x, y of each point,
    the centre of each box) and every size placeholder by that of each box's (width, height), in
    order (the reference's encode_spatial_refs)."""
    emb = model.text_impl.embed(torch.tensor([ids], device=model.device), model.text_w)
    if not refs:
        return emb
    coords: list[float] = []
    sizes: list[tuple[float, float]] = []
    for ref in refs:
        if len(ref) == 2:
            coords += [ref[0], ref[1]]
        else:
            coords += [(ref[0] + ref[2]) / 2, (ref[1] + ref[3]) / 2]
            sizes.append((ref[2] - ref[0], ref[3] - ref[1]))
    tk, rw, ops = model.config.tokenizer, model.region_w, model.ops
    ids_t = torch.tensor(ids, device=model.device)
    coord_at, size_at = (ids_t == tk.coord_id).nonzero()[:, 0], (ids_t == tk.size_id).nonzero()[:, 0]
    if len(coord_at) != len(coords) or len(size_at) != len(sizes):
        raise ValueError(f"the prompt holds {len(coord_at)} coord and {len(size_at)} size placeholders for "
                         f"{len(coords)} coordinates and {len(sizes)} sizes of spatial_refs")
    emb = emb.clone()
    emb[0, coord_at] = model.region_impl.encode_coords(coords, rw, ops).reshape(len(coords), -1).to(emb.dtype)
    if sizes:
        emb[0, size_at] = model.region_impl.encode_sizes(sizes, rw, ops).reshape(len(sizes), -1).to(emb.dtype)
    return emb


def reasoning_mask(model: "MoondreamModel") -> torch.Tensor:
    """Tokens reasoning may contain: all but the model's `reasoning_barred` (Moondream 2: eos and
    size, as the reference bars both while reasoning; the answer marker ends it)."""
    tk = model.config.tokenizer
    allowed = torch.ones(model.config.text.vocab_size, dtype=torch.bool, device=model.device)
    barred = [getattr(tk, name) for name in model.reasoning_barred]
    if barred:
        allowed[barred] = False
    return allowed


def text_ids(model: "MoondreamModel", tokens: list[int]) -> list[int]:
    """An answer's or reasoning's tokens that are text: all, or where coord and size tokens are fed
    as region values (spatial_tokens_fed) all but those (kestrel decodes text tokens only)."""
    if not model.spatial_tokens_fed:
        return tokens
    tk = model.config.tokenizer
    return [t for t in tokens if t not in (tk.coord_id, tk.size_id)]


def grounding(model: "MoondreamModel", tokens: list[int], coords: list[float]) -> dict:
    """The reasoning result from its tokens and the coordinates decoded at its coord tokens:
    {"text", "grounding": [{"start_idx", "end_idx", "points": [(x, y), ...]}]}. The tokens are cut
    into chunks at each start-ground-points and end-ground token; a chunk with at least two
    coordinates grounds its span of the text (from the lengths of the chunks decoded on their own,
    their text_ids) on their (x, y) pairs.

    Where the model keeps the grounding marks in the text (grounding_marks_in_text: Moondream 2,
    as its public code does) each mark starts its chunk and the text is the chunks' texts joined;
    else (Moondream 3, as kestrel's query skill finalizes it) the marks are no text, in no chunk,
    and the text is all the reasoning's text tokens decoded together."""
    tk = model.config.tokenizer
    marks_kept = model.grounding_marks_in_text
    chunks: list[list[int]] = [[]]
    values: list[list[float]] = [[]]
    it = iter(coords)
    for tok in tokens:
        if tok in (tk.start_ground_points_id, tk.end_ground_id):
            chunks.append([])
            values.append([])
            if not marks_kept:
                continue
        chunks[-1].append(tok)
        if tok == tk.coord_id:
            values[-1].append(next(it))
    texts = [model.tokenizer.decode(text_ids(model, c)) for c in chunks]
    out, start = [], 0
    for text, vals in zip(texts, values):
        if len(vals) > 1:
            out.append({"start_idx": start, "end_idx": start + len(text),
                        "points": [(vals[i], vals[i + 1]) for i in range(0, len(vals) - 1, 2)]})
        start += len(text)
    whole = "".join(texts) if marks_kept else model.tokenizer.decode(text_ids(model, [t for c in chunks for t in c]))
    return {"text": whole, "grounding": out}
