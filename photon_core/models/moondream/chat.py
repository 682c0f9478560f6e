"""Chat on Moondream: a conversation run as a chain of query turns.

Moondream has no trained multi-turn format; its makers' engine (m87-labs/kestrel,
kestrel/models/moondream/skills/chat.py) renders a conversation as one sequence of query blocks,
which is what this module does (facts from there):

    [BOS] then per user turn: [its images] query prefix, its text, answer opener, [the assistant's reply]
    the last user turn ends with the answer opener, or the reasoning opener when reasoning is on

- a leading system message is folded into the first user turn's text ("system\\n\\nuser");
- a message's text is its text parts joined without separator;
- each image is a block of image tokens that sees itself whole (bidirectional) and everything
  before it; BOS joins a first image that follows it directly, as a query's [BOS][image] prefix;
  all text is causal;
- the reply is decoded as a query's (its masks, its grounded reasoning); reasoning is on unless
  asked off (chat(reasoning=False), or settings["reasoning"], which wins as in kestrel);
- the message: {"role": "assistant", "content": answer, "reasoning": its text (when reasoning was
  on and gave some; Moondream 3: whenever it was on, "" included), "reasoning_details":
  {"grounding": ...} (when it grounded points)}.

Images are taken in user messages only, as kestrel's Moondream chat places them (one in an
assistant message is refused). Moondream 3 also takes a last user turn with an image and no text
(no question tokens) or only whitespace, as kestrel renders them (model.chat_turn_as_written,
chat_reasoning_always); Moondream 2's last turn needs words.

So a one-turn chat is exactly query(image, question, reasoning=...). Here everything before the
last user turn's text (earlier turns, then that turn's images) is prefilled into one EncodedImage
and the last turn is a query on it: model.query's decode, streaming and batching unchanged.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from photon_core.runtime import chat_messages
from photon_core.runtime.requests import Request

from . import batch as batch_decoding
from . import skills

if TYPE_CHECKING:
    from .model import EncodedImage, MoondreamModel

Piece = list[int] | Any   # token ids, or one image (array, PIL image, the model's EncodedImage)


def chat(model: "MoondreamModel", messages: Any, stream: bool = False, settings: dict | None = None,
         reasoning: bool | None = None) -> dict:
    """MoondreamModel.chat: the messages checked (runtime.chat_messages), the conversation before
    the last question prefilled, that question decoded as a query."""
    conv = chat_messages.parse(messages)
    settings = dict(settings or {})
    if "reasoning" in settings:
        reasoning = settings.pop("reasoning")
    reasoning = True if reasoning is None else reasoning
    if not isinstance(reasoning, bool):
        raise TypeError(f"reasoning must be True or False, got {reasoning!r}")
    # checked (as the model reads a query's settings) before any image is encoded
    opts = model.request_settings(Request("query", None, "", settings=settings))
    history, question = layout(model, conv)
    prefix = prefill(model, history, skills.variant(model, opts.variant))
    request = batch_decoding.ChatTurn("query", prefix, question, settings=settings, reasoning=reasoning)
    if stream:   # model.query's decode, without its input normalising (kestrel's chat has none)
        return {"message": model._text(request, stream=True)["answer"]}
    result, row = _decode(model, request)
    room = row.sampling.max_tokens if row.sampling is not None else 0
    finish = "length" if batch_decoding.spent(model, row) >= room or row.pos >= row.length else "stop"
    reason = result.get("reasoning") or {}
    reply = chat_messages.assistant_reply(result["answer"], finish, reason.get("text"),
                                          {"grounding": reason["grounding"]} if reason.get("grounding") else None)
    msg = reply["message"]
    if reasoning and model.chat_reasoning_always and "reasoning" not in msg:
        # kestrel's Moondream chat puts the reasoning's text on the message whenever reasoning was
        # on, "" included (its query result always has the reasoning then)
        reply["message"] = {"role": msg["role"], "content": msg["content"], "reasoning": reason.get("text", ""),
                            **{k: v for k, v in msg.items() if k not in ("role", "content")}}
    return reply


def layout(model: "MoondreamModel", conv: chat_messages.Conversation) -> tuple[list[Piece], str]:
    """(everything before the last user turn's text, as token-id lists and images; that text)."""
    tk = model.config.tokenizer
    prefix = list(tk.templates["query"]["prefix"])
    answer = skills.query_openers(model)[0]
    images = iter(conv.images)
    turns = conv.turns
    system = ""
    if turns[0]["role"] == "system":
        system, turns = _text(turns[0]["content"]), turns[1:]
    pieces: list[Piece] = [[tk.bos_id]]
    question = ""
    for i, turn in enumerate(turns):
        text = _text(turn["content"])
        if turn["role"] == "assistant":   # a reply (or a stray assistant turn, kestrel emits it so)
            if any(isinstance(p, dict) and p["type"] == "image" for p in turn["content"]):
                # kestrel's Moondream chat places images at user turns only and refuses others
                # (skipped, a later user turn's image part would take this one's image)
                raise ValueError("Moondream chat takes images only in user messages; found one in an "
                                 "'assistant' message")
            pieces += [answer, model.tokenizer.encode(text) if text else []]
            continue
        pieces += [next(images) for part in turn["content"] if isinstance(part, dict) and part["type"] == "image"]
        if system:
            text, system = (f"{system}\n\n{text}" if text else system), ""
        if i == len(turns) - 1:
            question = text
        else:
            pieces += [prefix, model.tokenizer.encode(text) if text else []]
    if model.chat_turn_as_written:
        # kestrel's chat refuses only a last message with neither text nor an image (before a
        # system message is folded in); an image-only one is a query without question tokens.
        last = turns[-1]["content"]
        if not _text(last) and not any(isinstance(p, dict) and p["type"] == "image" for p in last):
            raise ValueError("the last user message must have text or an image")
    elif not question.strip():
        raise ValueError("the last user message needs text: Moondream answers it as a query's question")
    return pieces, question


def _text(content: str | list[dict]) -> str:
    if isinstance(content, str):
        return content
    return "".join(p["text"] for p in content if p["type"] == "text")


@torch.inference_mode()
def prefill(model: "MoondreamModel", pieces: list[Piece], lora: Any = None) -> "EncodedImage":
    """The KV cache of `pieces` (token ids and images, starting with [BOS]) as an EncodedImage that
    the last turn's query continues."""
    from .model import EncodedImage

    first = pieces[1] if len(pieces) > 1 and pieces[0] == [model.config.tokenizer.bos_id] else []
    if not isinstance(first, list):   # BOS then an image: a query's own prefix
        start = first if isinstance(first, EncodedImage) else model.encode_images([first], lora=lora)[0]
        model._check_owner(start)
        model.check_variant(start, None if lora is None else lora.name)
        rest = pieces[2:]
    else:
        start, rest = model.empty_prefix(), pieces
    if any(isinstance(p, EncodedImage) for p in rest):
        raise ValueError("an EncodedImage holds an image at the start of a sequence: only a conversation's "
                         "first image, first in its first user turn, may be one; pass the others as images")
    rest = [p for p in rest if not isinstance(p, list) or p]
    raw = [p for p in rest if not isinstance(p, list)]
    images = iter(model.image_tokens(raw)[0] if raw else [])
    # (input embeddings [1, T, dim], is an image block)
    inputs = [(next(images)[None], True) if not isinstance(p, list) else (skills.prompt_embeddings(model, p), False)
              for p in rest]
    if not inputs:
        return start
    total = start.pos + sum(x.shape[1] for x, _ in inputs)
    if total >= model.config.text.max_context:
        raise ValueError(f"the conversation ({total} positions with its images) does not fit the context "
                         f"({model.config.text.max_context})")
    cache = model.text_impl.KVCache(model.config.text, total, model.dtype, model.device)
    cache.k[:, :, :, :start.pos] = start.k
    cache.v[:, :, :, :start.pos] = start.v
    pos = start.pos
    for x, image in inputs:
        end = pos + x.shape[1]
        # An image block sees itself whole and all before it; text is causal.
        skills.forward(model, x, pos, cache, lora, text_only=not image, bidirectional_to=end if image else None)
        pos = end
    return EncodedImage(cache.k, cache.v, pos, start.tiling, model.serial, causal=start.pos == 0,
                        variant=None if lora is None else lora.name)


def _decode(model: "MoondreamModel", request: Request) -> tuple[dict, Any]:
    """model.batch([request])'s result and its decoded row (how many tokens it took, where it
    stopped: the reply's finish_reason)."""
    rows: list[Any] = []

    def decode(rs: list, encoded: list) -> None:
        rows.extend(rs)
        if model.decode is not None:
            model.decode._decode_rows(rs, encoded)
            return
        for _ in batch_decoding.ops_steps(model, rs, encoded):
            pass

    if model.decode is not None:
        with model.decode.exclusive():
            result = batch_decoding.run(model, [request], decode)[0]
    else:
        result = batch_decoding.run(model, [request], decode)[0]
    return result, rows[0]

