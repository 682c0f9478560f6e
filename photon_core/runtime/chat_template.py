"""A checkpoint's chat template, rendered the way transformers renders it, and its stop ids.

The template is read from the files transformers reads it from (chat_template.jinja first, then
the "chat_template" of chat_template.json, tokenizer_config.json or processor_config.json) and
rendered in the environment transformers builds for it: jinja2's immutable sandbox with
trim_blocks and lstrip_blocks, the loopcontrols extension, a `tojson` filter that does not escape
HTML and keeps non-ASCII text, `raise_exception(message)` and `strftime_now(format)`. The
template sees `messages`, `tools`, `documents`, `add_generation_prompt` and the tokenizer's
special tokens (`bos_token`, `eos_token`, ...), as in `apply_chat_template`.

A template's `raise_exception` becomes a ValueError ("chat template: ..."), the error this
package gives for input a model refuses.
"""
from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterable

# Where transformers looks for a chat template, in its order (after chat_template.jinja).
_TEMPLATE_FILES = ("chat_template.json", "tokenizer_config.json", "processor_config.json")
# The special tokens a tokenizer hands its template (transformers' special_tokens_map).
_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# What transformers appends to the message it continues, to find where that message ends.
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


def read_json(path: Path) -> dict:
    """A checkpoint's JSON file as a dict ({} when absent or not an object); ValueError naming the
    file when it cannot be parsed."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"{path} is unreadable: {err}") from err
    return data if isinstance(data, dict) else {}


def token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json stores it (a string, or an AddedToken's
    {"content": ...}) -> its text."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def read_template(folder: Path) -> str | None:
    """The checkpoint's chat template source, or None when it ships none."""
    if (folder / "chat_template.jinja").is_file():
        return (folder / "chat_template.jinja").read_text()
    for name in _TEMPLATE_FILES:
        template = read_json(folder / name).get("chat_template")
        if isinstance(template, str):
            return template
    return None


def _raise_exception(message: str) -> None:
    raise ValueError(f"chat template: {message}")


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # jinja's own tojson escapes <, >, & and ' for HTML, which would change what the model reads.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def _compile(source: str):
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


class ChatTemplate:
    """One compiled chat template and the special tokens it is rendered with."""

    def __init__(self, source: str, special_tokens: dict[str, str] | None = None,
                 from_checkpoint: bool = True) -> None:
        self.source = source
        self.template = _compile(source)
        self.special_tokens = dict(special_tokens or {})
        self.from_checkpoint = from_checkpoint

    @classmethod
    def from_folder(cls, folder: str | Path, fallback: str | None = None) -> "ChatTemplate":
        """The template a checkpoint folder ships; `fallback` when it ships none (FileNotFoundError
        when there is no fallback either)."""
        folder = Path(folder)
        source = read_template(folder)
        if source is None and fallback is None:
            raise FileNotFoundError(f"{folder}: no chat template (chat_template.jinja, or 'chat_template' in "
                                    f"{', '.join(_TEMPLATE_FILES)})")
        config = read_json(folder / "tokenizer_config.json")
        special = {k: t for k in _SPECIAL_TOKENS if (t := token_text(config.get(k))) is not None}
        text = source if source is not None else fallback
        assert text is not None   # refused above
        return cls(text, special, source is not None)

    def render(self, messages: list[dict], add_generation_prompt: bool = False,
               continue_final_message: bool = False, **variables: Any) -> str:
        """The conversation as the prompt text. continue_final_message: the last message is left
        open for the model to continue (the text after it cut off, as transformers does);
        `variables` reach the template beside the special tokens (e.g. enable_thinking)."""
        if continue_final_message:
            messages = _tag_final_message(messages)
        text = self.template.render(messages=messages, tools=None, documents=None,
                                    add_generation_prompt=add_generation_prompt,
                                    **{**self.special_tokens, **variables})
        if not continue_final_message:
            return text
        tag = _CONTINUE_TAG.strip()
        if tag not in text:
            raise ValueError("chat template: it dropped the final message, so it cannot be continued")
        at = text.rindex(tag)
        # A template that strips the message's trailing space also strips the tag's.
        return text[:at] if text[at:at + len(_CONTINUE_TAG)] == _CONTINUE_TAG else text[:at].rstrip()


def _tag_final_message(messages: list[dict]) -> list[dict]:
    if not messages:
        raise ValueError("continue_final_message needs a message to continue")
    last = dict(messages[-1])
    content = last.get("content")
    if isinstance(content, str):
        last["content"] = content + _CONTINUE_TAG
    elif isinstance(content, list):
        parts = [dict(p) for p in content]
        texts = [i for i, p in enumerate(parts) if "text" in p]
        if not texts:
            raise ValueError("continue_final_message: the final message has no text to continue")
        parts[texts[-1]]["text"] += _CONTINUE_TAG
        last["content"] = parts
    else:
        raise ValueError("continue_final_message: the final message has no content to continue")
    return [*messages[:-1], last]


def stop_ids(folder: str | Path, config_eos: Any = None, tokenizer: Any = None,
             stop_tokens: Iterable[str] = ()) -> frozenset[int]:
    """The ids that end generation: generation_config.json's eos_token_id, the model config's
    (`config_eos`: an id or a list of ids), and the ids of the named `stop_tokens` the tokenizer has."""
    ids: set[int] = set()
    for source in (read_json(Path(folder) / "generation_config.json").get("eos_token_id"), config_eos):
        if isinstance(source, (list, tuple)):
            ids.update(int(i) for i in source)
        elif source is not None:
            ids.add(int(source))
    for token in stop_tokens:
        tid = tokenizer.token_to_id(token) if tokenizer is not None else None
        if tid is not None:
            ids.add(tid)
    return frozenset(ids)
