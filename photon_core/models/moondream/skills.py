"""The four skills: prompt templates, decoding loops and result shapes.

Every request continues from an encoded image (the KV cache of [BOS][729 image tokens]) in a cache of
its own. Caption and query stream their text from `generate_text`; detect and point decode with the
region module (the object protocol lives in batch.py, which runs one request or several together).
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from photon_core.runtime.requests import DEFAULT_MAX_OBJECTS, DEFAULT_MAX_TOKENS  # noqa: F401
from photon_core.runtime.generate import Choose, Session, generate, room
from photon_core.runtime.sampling import Sampling, pick
from photon_core.runtime.text_stream import text_pieces

if TYPE_CHECKING:
    from .model import EncodedImage, MoondreamModel



class Sequence:
    """One request's decoding state: its KV cache and the next position."""

    def __init__(self, model: "MoondreamModel", enc: "EncodedImage", length: int) -> None:
        self.model = model
        self.cache = model.text_impl.KVCache(model.config.text, length, model.dtype, model.device)
        self.cache.k[:, :, :, :enc.pos] = enc.k
        self.cache.v[:, :, :, :enc.pos] = enc.v
        self.pos = enc.pos

    @torch.inference_mode()
    def step(self, emb: torch.Tensor) -> torch.Tensor:
        """Feed input embeddings [1, T, dim]; returns the logits [1, vocab] after the last one."""
        m = self.model
        hidden = m.text_impl.forward(emb, self.pos, m.text_w, m.config.text, self.cache, m.ops)[:, -1]
        self.pos += emb.shape[1]
        return m.text_impl.lm_logits(hidden, m.text_w, m.ops)

    @torch.inference_mode()
    def embed(self, ids: list[int]) -> torch.Tensor:
        return self.model.text_impl.embed(torch.tensor([ids], device=self.model.device), self.model.text_w)


def check_prompt(model: "MoondreamModel", enc: "EncodedImage", ids: list[int]) -> None:
    if enc.pos + len(ids) >= model.config.text.max_context:
        raise ValueError(f"prompt of {len(ids)} tokens does not fit the context "
                         f"({model.config.text.max_context} incl. {enc.pos} image tokens)")


def answer_mask(model: "MoondreamModel") -> torch.Tensor:
    """Tokens an answer may contain: all but the answer marker, which ends the prompt."""
    allowed = torch.ones(model.config.text.vocab_size, dtype=torch.bool, device=model.device)
    allowed[model.config.tokenizer.answer_id] = False
    return allowed


def boundary_mask(model: "MoondreamModel") -> torch.Tensor:
    """At an object boundary: another object (coord) or the end (eos)."""
    tk = model.config.tokenizer
    return allowed_mask(model.config.text.vocab_size, [tk.coord_id, tk.eos_id], model.device)


def allowed_mask(vocab: int, ids: list[int], device) -> torch.Tensor:
    mask = torch.zeros(vocab, dtype=torch.bool, device=device)
    mask[ids] = True
    return mask


def generate_text(model: "MoondreamModel", enc: "EncodedImage", prompt: list[int], max_tokens: int,
                  temperature: float, top_p: float) -> Iterator[str]:
    """Yields the answer text in pieces as tokens are decoded (caption and query)."""
    s = Sampling(max_tokens, temperature, top_p)
    check_prompt(model, enc, prompt)
    length = min(model.config.text.max_context, enc.pos + len(prompt) + max_tokens)
    session = TextSession(Sequence(model, enc, length), prompt)
    allowed = answer_mask(model)
    return text_tokens(model, session, s, enc.pos + len(prompt), length,
                       lambda _, logits, greedy: pick(logits, s, model.ops, allowed))


class TextSession:
    """runtime.generate's session on one request's Sequence (a caption or query)."""

    def __init__(self, seq: Sequence, prompt: list[int]) -> None:
        self.seq, self.prompt = seq, prompt

    def prefill(self) -> tuple[torch.Tensor, None]:
        return self.seq.step(self.seq.embed(self.prompt)), None

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
    return text_pieces(model.tokenizer.decode, (new[0] for new in steps))


def caption_prompt(model: "MoondreamModel", length: str) -> list[int]:
    templates = model.config.tokenizer.templates["caption"]
    if length not in templates:
        raise ValueError(f"caption length must be one of {sorted(templates)}, got {length!r}")
    return list(templates[length])


def _wrap(model: "MoondreamModel", skill: str, words: list[int]) -> list[int]:
    t = model.config.tokenizer.templates[skill]
    return list(t["prefix"]) + words + list(t["suffix"])


def query_prompt(model: "MoondreamModel", question: str) -> list[int]:
    """prefix + question + suffix + suffix. The doubled answer marker is what the public reference
    (2025-06 tokenizer/release) sends without reasoning: Q <answer> [<thinking> ... ] <answer> answer.
    A template with an `answer_prefix` (Moondream 3's layout) is sent as prefix + question +
    answer_prefix instead."""
    if not isinstance(question, str) or not question.strip():
        raise ValueError("question must be a non-empty string")
    t = model.config.tokenizer.templates["query"]
    words = model.tokenizer.encode(question)
    if "answer_prefix" in t:
        return list(t["prefix"]) + words + list(t["answer_prefix"])
    return _wrap(model, "query", words) + list(t["suffix"])


def object_prompt(model: "MoondreamModel", skill: str, name: str) -> list[int]:
    if not isinstance(name, str) or not name.strip():
        raise ValueError("object must be a non-empty string")
    return _wrap(model, skill, model.tokenizer.encode(" " + name))
