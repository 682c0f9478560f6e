"""Chat in the moondream client's shape, shared by the families that have a chat template.

Messages are OpenAI-style: {"role": "system" | "user" | "assistant", "content": ...}, content a
string or a list of parts: {"type": "text", "text": ...}, {"type": "image_url", "image_url":
{"url": "data:image/...;base64,..."}} (or the url string itself), and, as Photon's own addition,
{"type": "image", "image": <numpy array, PIL image or the model's EncodedImage>}. A system message
may only come first and holds no image; the last message is the user's.

The reply is {"message": {"role": "assistant", "content": str, "reasoning": str (only when
reasoning was asked for and the model gave some), "reasoning_details" (Moondream: {"grounding"})},
"finish_reason": "stop" | "length"}, or with
stream=True {"message": an iterator of the content's text pieces} (the reasoning is not streamed).
"""
from __future__ import annotations

import base64
import binascii
import io
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .image_input import check_size
from .requests import Settings
from .sampling import Sampling

ROLES = ("system", "user", "assistant")
SETTINGS = ("max_tokens", "temperature", "top_p")


@dataclass
class Conversation:
    """What a chat template renders: turns whose content is a string or parts ({"type": "image"} /
    {"type": "text", "text"}), and the images of those image parts, in order."""
    turns: list[dict[str, Any]] = field(default_factory=list)
    images: list[Any] = field(default_factory=list)


def parse(messages: Any) -> Conversation:
    """The messages checked (ValueError with the reason) and split into turns and images."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise ValueError("messages must be a non-empty list of {'role', 'content'} messages")
    out = Conversation()
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise ValueError(f"message {i} must be a mapping with 'role' and 'content'")
        role = m.get("role")
        if role not in ROLES:
            raise ValueError(f"message {i}: role must be one of {ROLES}, got {role!r}")
        if role == "system" and i != 0:
            raise ValueError("a 'system' message must be the first message")
        out.turns.append({"role": role, "content": _content(m.get("content"), role, i, out.images)})
    last = out.turns[-1]
    if last["role"] != "user":
        raise ValueError("the last message must be from 'user'")
    if last["content"] in ("", []):
        raise ValueError("the last user message must have text or an image")
    return out


def _content(content: Any, role: str, i: int, images: list[Any]) -> str | list[dict[str, Any]]:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, bytes) or not isinstance(content, Sequence):
        raise ValueError(f"message {i}: content must be a string or a list of content parts")
    parts: list[dict[str, Any]] = []
    for part in content:
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind == "text":
            if not isinstance(part.get("text"), str):
                raise ValueError(f"message {i}: a text part needs 'text' (a string)")
            parts.append({"type": "text", "text": part["text"]})
        elif kind in ("image", "image_url"):
            if role == "system":
                raise ValueError("a system message cannot hold images")
            images.append(part.get("image") if kind == "image" else image_from_url(part.get("image_url")))
            if images[-1] is None:
                raise ValueError(f"message {i}: an image part needs 'image'")
            parts.append({"type": "image"})
        else:
            raise ValueError(f"message {i}: content parts are {{'type': 'text' | 'image_url' | 'image', ...}}, "
                             f"got {part!r:.80}")
    return parts


def image_from_url(spec: Any) -> Any:
    """A base64 data: URL (as the client's image_url parts and Base64EncodedImage carry) as a PIL
    image. No other URL: nothing is fetched and no file is read."""
    from PIL import Image

    url = spec.get("url") if isinstance(spec, Mapping) else spec
    if not isinstance(url, str) or not url.strip().startswith("data:") or "," not in url:
        raise ValueError("an image_url must be a base64 data: URL ('data:image/jpeg;base64,...')")
    head, payload = url.strip().split(",", 1)
    if not head.endswith(";base64"):
        raise ValueError(f"an image_url must be a base64 data: URL ('data:image/jpeg;base64,...'), got {head!r}")
    try:
        # line breaks (MIME's 76-column base64) and a trailing newline are no data
        data = base64.b64decode("".join(payload.split()), validate=True)
        with warnings.catch_warnings():
            # the size is refused below, with the limit, before the pixels are decoded
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
            check_size(*image.size)
            image.load()
    except Image.DecompressionBombError as err:    # PIL's own refusal, at twice its threshold
        raise ValueError(f"the image_url's image is too large ({err})") from None
    except (binascii.Error, OSError, ValueError) as err:
        raise ValueError(f"the image_url's data is not a readable image ({err})") from err
    return image


def sampling(settings: Mapping[str, Any] | None) -> Sampling:
    """The client's SamplingSettings for a text reply; a setting chat has no use for is a TypeError."""
    if settings is not None and not isinstance(settings, Mapping):
        raise TypeError(f"settings must be a dict, not {type(settings).__name__}")
    settings = dict(settings or {})
    if settings.get("variant") is not None:
        raise NotImplementedError("fine-tuned variants ('base/finetune@step') run on Moondream models only")
    settings.pop("variant", None)   # None: the base model, the only one there is (as Settings.of reads it)
    unknown = sorted(set(settings) - set(SETTINGS))
    if unknown:
        raise TypeError(f"chat settings are {', '.join(SETTINGS)}; got {', '.join(map(str, unknown))}")
    # Checked as every skill's settings are (types and ranges); chat keeps greedy as its default.
    opts = Settings.of({"temperature": 0.0, "top_p": 1.0, **settings})
    return opts.sampling()


def reply(tokens: Iterable[int], decode: Callable[[list[int]], str], room: int, stream: bool,
          end_of_reasoning: int | str | None) -> dict[str, Any]:
    """The assistant's message from its token ids. end_of_reasoning: None when reasoning is off;
    else the token id (or the text, for a marker the tokenizer keeps in decoded text) that ends the
    reasoning and starts the content. room: the most tokens the row could take (reaching it is
    finish_reason "length")."""
    ids: list[int] = []

    def split() -> tuple[str | None, str | None]:
        """(reasoning, content so far; None while the model is still reasoning)."""
        if end_of_reasoning is None:
            return None, decode(ids)
        if isinstance(end_of_reasoning, int):
            if end_of_reasoning not in ids:
                return decode(ids), None
            at = ids.index(end_of_reasoning)
            return decode(ids[:at]), decode(ids[at + 1:])
        text = decode(ids)
        if end_of_reasoning not in text:
            return text, None
        before, after = text.split(end_of_reasoning, 1)
        return before, after

    def pieces() -> Iterator[str]:
        shown = 0
        for tok in tokens:
            ids.append(tok)
            content = split()[1]
            # A character split across tokens decodes as U+FFFD until its last byte comes.
            if content is not None and len(content) > shown and not content.endswith("\ufffd"):
                yield content[shown:]
                shown = len(content)
        content = split()[1]
        if content is not None and len(content) > shown:
            yield content[shown:]

    if stream:
        return {"message": pieces()}
    ids.extend(tokens)
    reasoning, content = split()
    return assistant_reply(content or "", "length" if len(ids) >= room else "stop",
                           reasoning if end_of_reasoning is not None else None)


def assistant_reply(content: str, finish_reason: str, reasoning: str | None = None,
                    reasoning_details: dict[str, Any] | None = None) -> dict[str, Any]:
    """The reply dict: "reasoning" only when there is some; "reasoning_details" (Moondream's
    grounding, as kestrel passes it on) only when given."""
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if reasoning:
        message["reasoning"] = reasoning
    if reasoning_details:
        message["reasoning_details"] = reasoning_details
    return {"message": message, "finish_reason": finish_reason}
