"""A checkpoint's chat template, rendered the way transformers renders it, and its stop ids.

The template is read from the files transformers reads it from (chat_template.jinja first, then
the "chat_template" of chat_template.json, tokenizer_config.json or processor_config.json) and
rendered in the environment transformers builds for it: jinja2's immutable sandbox with
trim_blocks and lstrip_blocks, the loopcontrols extension, `{% generation %}` blocks (transformers'
marks for its assistant-token mask, which render their body unchanged), a `tojson` filter that does not escape
HTML and keeps non-ASCII text, `raise_exception(message)` and `strftime_now(format)`. The
template sees `messages`, `tools`, `documents`, `add_generation_prompt` and the tokenizer's
special tokens (`bos_token`, `eos_token`, ...), as in `apply_chat_template`. `encode` tokenizes
the prompt with a special token only where the template put one: a special token's string in a
message (a question writing "<|im_end|>", or "<|im_" and "end|>" in two parts the template joins)
is text, where apply_chat_template's tokenization would read it as the token.

A template's `raise_exception` becomes a ValueError ("chat template: ..."), the error this
package gives for input a model refuses. A template comes with a checkpoint, so it is not trusted:
beyond the sandbox, a render is bounded in loop steps, string and list sizes and output length
(TemplateLimit, a ValueError), and its file is read only where it resolves inside the checkpoint.
"""
from __future__ import annotations

import json
import re
from bisect import bisect_left
from contextvars import ContextVar
from datetime import datetime
from functools import lru_cache, wraps
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from jinja2 import Template, nodes
from jinja2.ext import Extension
from jinja2.visitor import NodeTransformer
from jinja2.sandbox import ImmutableSandboxedEnvironment

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


def _inside_checkpoint(folder: Path, path: Path) -> Path:
    """`path` when it resolves inside `folder`, or inside the blobs/ of the Hugging Face cache
    repository the folder is a snapshot of (snapshots/<rev>/file -> ../../blobs/<hash>); a file
    symlinked anywhere else (/etc/passwd, another user's files) is refused: ValueError."""
    real, home = path.resolve(), folder.resolve()
    allowed = [home] + [s.parent / "blobs" for s in (home, *home.parents) if s.name == "snapshots"]
    if not any(real.is_relative_to(a) for a in allowed):
        raise ValueError(f"{path}: a symlink to {real}, outside the checkpoint folder: refused")
    return path


def read_template(folder: Path) -> str | None:
    """The checkpoint's chat template source, or None when it ships none. Each file is read only
    where it resolves inside the checkpoint (_inside_checkpoint)."""
    if (folder / "chat_template.jinja").is_file():
        return _inside_checkpoint(folder, folder / "chat_template.jinja").read_text()
    for name in _TEMPLATE_FILES:
        if not (folder / name).is_file():
            continue
        template = read_json(_inside_checkpoint(folder, folder / name)).get("chat_template")
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


# Bounds on what rendering a checkpoint's template may cost. jinja2's sandbox stops attribute
# escapes and bounds a single range() (100000), but not nested loops, "x" * 4000000000 or a padded
# format: a crafted template could hang the loader's caller or take all memory. The limits are far
# above what real templates reach (the test checkpoints' Qwen 3.5, Gemma 4 and Qwen3-ASR templates
# render a conversation in a few hundred loop steps and a few KB; a model's whole context is < 1M
# tokens, a few MB of text).
MAX_OUTPUT_CHARS = 1 << 24      # the rendered prompt, and any one string or list a template builds
MAX_LOOP_STEPS = 1 << 22        # loop iterations in one render, all loops together (~seconds)
MAX_POW_BITS = 1 << 16          # an integer power's size ("10 ** 10 ** 10" would compute for ever)
_PERCENT_SPEC = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\d*)(?:\.(\d*))?")   # printf width and precision
_BRACE_SPEC = re.compile(r"\{[^{}]*?:([^{}]*)\}")                           # str.format's spec


class TemplateLimit(ValueError):
    """A chat template went past one of the render bounds above."""


class _Budget:
    def __init__(self) -> None:
        self.steps = 0


_BUDGET: ContextVar[_Budget | None] = ContextVar("chat_template_budget", default=None)


def _spend(steps: int = 1) -> None:
    budget = _BUDGET.get()
    if budget is not None:
        budget.steps += steps
        if budget.steps > MAX_LOOP_STEPS:
            raise TemplateLimit(f"chat template: more than {MAX_LOOP_STEPS} loop steps in one render: refused")


def _bounded_loop(iterable: Any) -> Iterator[Any]:
    """What every {% for %} iterates: the template's iterable, each item paid for."""
    for item in iterable:
        _spend()
        yield item


def _check_int(value: Any, what: str) -> None:
    """A number given to a call, filter or format: a size (width, count) above the output bound
    would allocate it before anything could stop it."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_OUTPUT_CHARS:
        raise TemplateLimit(f"chat template: {what} {value} is over {MAX_OUTPUT_CHARS}: refused")


def _check_format(fmt: Any) -> None:
    """A format string's widths and precisions ("%9999999999s", "{:>9999999999}", "{:.9999999999f}")."""
    if not isinstance(fmt, str):
        return
    numbers = [d for m in _PERCENT_SPEC.finditer(fmt) for d in m.groups() if d]
    numbers += [d for m in _BRACE_SPEC.finditer(fmt) for d in re.findall(r"\d+", m.group(1))]
    for digits in numbers:
        if len(digits) > 9 or int(digits) > MAX_OUTPUT_CHARS:
            raise TemplateLimit(f"chat template: a format width {digits[:20]} is over {MAX_OUTPUT_CHARS}: refused")


def _check_amplifier(name: str, args: tuple, kwargs: dict) -> None:
    """The size of what join, replace and indent would build, before they build it: each can
    turn inputs within the bounds into one far beyond them ([s] * n | join, replace('x', s))."""
    if name == "join" and args and isinstance(args[0], (list, tuple)):
        sep = args[1] if len(args) > 1 and isinstance(args[1], str) else ""
        _check_len(sum(len(x) if isinstance(x, str) else 1 for x in args[0]) + len(sep) * len(args[0]))
    elif name == "replace" and len(args) >= 3 and all(isinstance(a, str) for a in args[:3]):
        _check_len(len(args[0]) + (args[0].count(args[1]) + 1) * len(args[2]))
    elif name == "indent" and args and isinstance(args[0], str):
        width = args[1] if len(args) > 1 else kwargs.get("width", 4)
        per_line = len(width) if isinstance(width, str) else width if isinstance(width, int) else 0
        _check_len(len(args[0]) + (args[0].count("\n") + 1) * per_line)


def _bounded_filter(f: Callable[..., Any]) -> Callable[..., Any]:
    """A filter whose numeric arguments (center/indent/truncate widths, batch sizes) are bounded,
    the format filter's format string, and join/replace/indent's result (jinja's pass_context and
    such are kept by wraps)."""
    @wraps(f)
    def bounded(*args: Any, **kwargs: Any) -> Any:
        for value in (*args, *kwargs.values()):
            _check_int(value, "a filter argument")
        if f.__name__ == "do_format" and args:
            _check_format(args[0])
        passed = 1 if f.__name__ in ("do_join", "do_replace") else 0   # their eval context comes first
        _check_amplifier(f.__name__.removeprefix("do_"), args[passed:], kwargs)
        return f(*args, **kwargs)
    return bounded


def _check_len(n: int) -> None:
    if n > MAX_OUTPUT_CHARS:
        raise TemplateLimit(f"chat template: a value of {n} items is over {MAX_OUTPUT_CHARS}: refused")


def _sized(value: Any) -> Any:
    """A string or list a template built by concatenation ("~"), within the output bound (so
    doubling a string in a loop stops at the bound, not at the machine's memory)."""
    if isinstance(value, (str, list, tuple)):
        _check_len(len(value))
    return value


class _Bound(NodeTransformer):
    """Rewrites a parsed template: every loop iterates through environment.photon_loop (each item
    paid for) and every "~" concatenation passes environment.photon_sized. Reached as environment
    attributes, which a template cannot rebind (a global of the same name it could shadow)."""

    def visit_For(self, node: nodes.For) -> nodes.Node:
        self.generic_visit(node)   # in place: a For's fields are rewritten, the node kept
        node.iter = nodes.Call(nodes.EnvironmentAttribute("photon_loop"), [node.iter], [], None, None)
        return node

    def visit_Concat(self, node: nodes.Concat) -> nodes.Node:
        return nodes.Call(nodes.EnvironmentAttribute("photon_sized"), [self.generic_visit(node)], [], None, None)


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox with the bounds above on repetition, powers, padding and calls."""
    intercepted_binops = frozenset({"*", "**", "%", "+"})
    photon_loop = staticmethod(_bounded_loop)
    photon_sized = staticmethod(_sized)

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "+" and isinstance(left, (str, list, tuple)) and isinstance(right, (str, list, tuple)):
            _check_len(len(left) + len(right))   # before the sum is built
        elif operator == "*":
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and len(seq) * n > MAX_OUTPUT_CHARS:
                    raise TemplateLimit(f"chat template: repeating {len(seq)} items {n} times is over "
                                        f"{MAX_OUTPUT_CHARS}: refused")
        elif operator == "**" and isinstance(left, int) and isinstance(right, int) and abs(left) > 1 \
                and right * abs(left).bit_length() > MAX_POW_BITS:
            raise TemplateLimit(f"chat template: an integer power over {MAX_POW_BITS} bits: refused")
        elif operator == "%" and isinstance(left, str):
            _check_format(left)
            for value in (right if isinstance(right, tuple) else (right,)):
                _check_int(value, "a format argument")
        return super().call_binop(context, operator, left, right)

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        # every call from the template costs a step, and no argument may be a size above the
        # output bound ("x".ljust(4000000000), "x".center(...), "{:{}}".format("x", 4000000000))
        _spend()
        for value in (*args, *kwargs.values()):
            _check_int(value, "a call argument")
        owner, name = getattr(__obj, "__self__", None), getattr(__obj, "__name__", "")
        if isinstance(owner, str) and name == "join" and args:   # "sep".join(items)
            _check_amplifier("join", (args[0], owner), {})
        elif isinstance(owner, str) and name == "replace":
            _check_amplifier("replace", (owner, *args), kwargs)
        return super().call(__context, __obj, *args, **kwargs)

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        wrapped = super().wrap_str_format(value)
        if wrapped is not None:
            _check_format(value.__self__)
        return wrapped


class _GenerationBlocks(Extension):
    """`{% generation %} ... {% endgeneration %}`: where transformers tracks which characters the
    assistant wrote (return_assistant_tokens_mask); a prompt is rendered without that, so the block
    is its body. Templates that mark the assistant turn so (Qwen3-ASR's) failed to load without it."""
    tags = {"generation"}

    def parse(self, parser: Any) -> list[nodes.Node]:
        next(parser.stream)   # the tag's own name
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


@lru_cache(maxsize=16)
def _compile(source: str) -> Template:
    from jinja2.ext import loopcontrols

    env = _BoundedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols, _GenerationBlocks])
    env.filters["tojson"] = _tojson
    env.filters = {name: _bounded_filter(f) for name, f in env.filters.items()}
    env.globals.pop("lipsum", None)   # lipsum(n=...) writes n paragraphs: no chat template uses it
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    # every loop's items are paid from one budget per render (nested loops multiply), every
    # concatenation is sized
    return env.from_string(_Bound().visit(env.parse(source)))


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

    def _render_bounded(self, **variables: Any) -> str:
        """The template's output, within MAX_OUTPUT_CHARS and MAX_LOOP_STEPS (TemplateLimit, a
        ValueError, past either)."""
        token = _BUDGET.set(_Budget())
        try:
            parts, size = [], 0
            for part in self.template.generate(**variables):
                size += len(part)
                if size > MAX_OUTPUT_CHARS:
                    raise TemplateLimit(f"chat template: the prompt is over {MAX_OUTPUT_CHARS} characters: refused")
                parts.append(part)
            return "".join(parts)
        finally:
            _BUDGET.reset(token)

    def encode(self, tokenizer: Any, messages: list[dict], add_generation_prompt: bool = False,
               continue_final_message: bool = False, **variables: Any) -> list[int]:
        """The rendered conversation as token ids (`tokenizer`: a `tokenizers.Tokenizer`), a special
        token only where the template put one: a message's text holding a special token's string
        ("<|im_end|>", an image placeholder) is that text, as the user wrote it. Tokenizing the
        rendered prompt whole would read it as the token: a question could end its turn and write
        the assistant's, or claim an image. Where no message holds one, this is the tokenizer's
        encode of render(...)."""
        kwargs = dict(add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
                      **variables)
        text = self.render(messages, **kwargs)
        specials = special_token_pattern(tokenizer)
        masked = _mask_texts(messages, specials, _token_ends(tokenizer)) if specials is not None else None
        # rendered a second time only where a message holds one (a render may read the clock)
        return encode_literal_texts(tokenizer, text, text if masked is None else self.render(masked, **kwargs))

    def render(self, messages: list[dict], add_generation_prompt: bool = False,
               continue_final_message: bool = False, **variables: Any) -> str:
        """The conversation as the prompt text. continue_final_message: the last message is left
        open for the model to continue (the text after it cut off, as transformers does);
        `variables` reach the template beside the special tokens (e.g. enable_thinking)."""
        if continue_final_message:
            messages = _tag_final_message(messages)
        text = self._render_bounded(messages=messages, tools=None, documents=None,
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


# Stands in for each character of a special token's string inside a message (or of a piece of one at
# a text's start or end), so that the render of the masked messages lines up character for character
# with the real one: a private-use character, which no special token is written with.
_MASK = "\ue000"


@lru_cache(maxsize=8)
def special_token_pattern(tokenizer: Any) -> re.Pattern[str] | None:
    """A regex matching the tokenizer's special tokens' strings (longest first), None when it has none.
    Made once per tokenizer: with Gemma's ~6,200 special tokens it took ~16 ms, every prompt."""
    tokens = sorted({t.content for t in tokenizer.get_added_tokens_decoder().values() if t.special and t.content},
                    key=len, reverse=True)
    return re.compile("|".join(map(re.escape, tokens))) if tokens else None


@lru_cache(maxsize=8)
def _token_ends(tokenizer: Any) -> tuple[list[str], list[str], int]:
    """The tokenizer's special tokens' strings sorted, the same strings reversed and sorted, and the
    longest one's length: what _open_end and _open_start search by bisection (a few steps per text
    even with Gemma's ~6,200 special tokens)."""
    tokens = {t.content for t in tokenizer.get_added_tokens_decoder().values() if t.special and t.content}
    return sorted(tokens), sorted(t[::-1] for t in tokens), max(map(len, tokens), default=0)


def _begins_one(table: list[str], piece: str) -> bool:
    """Whether a string of the sorted `table` starts with `piece`."""
    at = bisect_left(table, piece)
    return at < len(table) and table[at].startswith(piece)


def _open_end(text: str, ends: tuple[list[str], list[str], int]) -> int:
    """How many of `text`'s last characters could begin a special token's string ("hi<|im_" -> 5):
    the longest such piece, 0 when none."""
    heads, _, longest = ends
    return next((n for n in range(min(len(text), longest - 1), 0, -1) if _begins_one(heads, text[-n:])), 0)


def _open_start(text: str, ends: tuple[list[str], list[str], int]) -> int:
    """How many of `text`'s first characters could end a special token's string ("end|>..." -> 5)."""
    _, tails, longest = ends
    return next((n for n in range(min(len(text), longest - 1), 0, -1) if _begins_one(tails, text[n - 1::-1])), 0)


def _mask_texts(messages: list[dict], specials: re.Pattern[str],
                ends: tuple[list[str], list[str], int]) -> list[dict] | None:
    """The messages with every special token's string in their texts masked (same length), and
    each text's first and last characters that could end or begin one (_open_start, _open_end);
    None when no text holds either.

    Masking a text's own matches is not enough: a template joins texts (Qwen's joins a message's
    text parts with nothing between), so "hi<|im_" and "end|>..." make a "<|im_end|>" that neither
    holds, and the masked render would have it as the template's. With the pieces at each text's
    ends masked too, no special token's string in the masked render starts or ends inside a message
    text: it is the template's (unless the template wrote a token's head before a text and its tail
    after it, which would be the template's doing). Only what may be part of a token is masked, not
    the whole text: templates test and cut message text (`'</think>' in content`, `.split(...)`,
    `| trim`), and on a wholly masked text they would render another layout, refused
    (encode_literal_texts) where nothing was wrong."""
    found = False

    def mask(text: Any) -> Any:
        nonlocal found
        if not isinstance(text, str):
            return text
        cut = specials.sub(lambda m: _MASK * len(m.group()), text)
        head, tail = _open_start(text, ends), _open_end(text, ends)
        kept = cut[head:max(head, len(text) - tail)]
        cut = _MASK * head + kept + _MASK * (len(text) - head - len(kept))
        found = found or cut != text
        return cut

    out = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            content = [{**p, "text": mask(p["text"])} if isinstance(p, dict) and "text" in p else p for p in content]
        out.append({**m, "content": mask(content)} if "content" in m else m)   # a template may test for it
    return out if found else None


@lru_cache(maxsize=8)
def _literal(tokenizer: Any) -> Any:
    """A copy of the tokenizer that reads special tokens' strings as text (a copy: the model's own
    is shared by threads, so its setting cannot be switched for one call)."""
    from tokenizers import Tokenizer

    copy = Tokenizer.from_str(tokenizer.to_str())
    copy.encode_special_tokens = True
    return copy


def encode_literal_texts(tokenizer: Any, text: str, masked: str) -> list[int]:
    """`text` as ids with a special token only where `masked` (the same prompt rendered from masked
    messages, _mask_texts) has one; the text between is encoded with special tokens read as text,
    as the tokenizer splits it at its added tokens (with their lstrip / rstrip). ValueError when
    the two renders do not line up (a template whose layout depends on the masked characters)."""
    if text == masked:
        return tokenizer.encode(text, add_special_tokens=False).ids
    if len(text) != len(masked) or any(a != b and b != _MASK for a, b in zip(text, masked)):
        raise ValueError("chat template: a message holds a special token's text, and the template renders it "
                         "in a way that cannot keep it as text: refused")
    specials = special_token_pattern(tokenizer)
    assert specials is not None   # masked differs from text only where a special token's string (or a piece) was
    added = {t.content: t for t in tokenizer.get_added_tokens_decoder().values()}
    literal = _literal(tokenizer)
    ids: list[int] = []
    at, strip_left = 0, False
    for m in specials.finditer(masked):
        token = added[m.group()]
        before = text[at:m.start()]
        before = before.lstrip() if strip_left else before
        ids += literal.encode(before.rstrip() if token.lstrip else before, add_special_tokens=False).ids
        ids.append(tokenizer.token_to_id(m.group()))
        at, strip_left = m.end(), token.rstrip
    rest = text[at:]
    return ids + literal.encode(rest.lstrip() if strip_left else rest, add_special_tokens=False).ids


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
