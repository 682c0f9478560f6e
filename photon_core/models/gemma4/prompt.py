"""Gemma 4 tokenizer and prompts: the checkpoint's tokenizer.json and chat template (rendered with
jinja2 as transformers does); the image placeholder in the rendered text becomes
[begin-of-image] + soft-token placeholders + [end-of-image] ids."""
from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

from tokenizers import Tokenizer

CAPTIONS = {"short": "Describe this image in one sentence.", "normal": "Describe this image.",
            "long": "Describe this image in detail."}
DEFAULT_IMAGE_TOKEN = "<|image|>"
DEFAULT_MAX_SOFT_TOKENS = 280


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"{path} is unreadable: {err}") from err
    return data if isinstance(data, dict) else {}


def _special_text(value) -> str | None:
    if isinstance(value, dict):   # AddedToken as saved: {"content": ...}
        value = value.get("content")
    return value if isinstance(value, str) else None


class Gemma4Prompter:
    """Turns (question, image soft-token count) into token ids, and ids back into text."""

    def __init__(self, folder: Path, image_token_id: int, boi_id: int, eoi_id: int) -> None:
        folder = Path(folder)
        if not (folder / "tokenizer.json").is_file():
            raise FileNotFoundError(f"{folder}: a Gemma 4 checkpoint needs tokenizer.json next to its weights")
        self.tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
        tc = _read_json(folder / "tokenizer_config.json")
        proc = _read_json(folder / "processor_config.json")
        template = None
        if (folder / "chat_template.jinja").is_file():
            template = (folder / "chat_template.jinja").read_text()
        elif isinstance(tc.get("chat_template"), str):
            template = tc["chat_template"]
        elif isinstance(proc.get("chat_template"), str):
            template = proc["chat_template"]
        if template is None:
            raise FileNotFoundError(f"{folder}: no chat template (chat_template.jinja or tokenizer_config.json)")
        self.template = _compile(template)
        extra = tc.get("extra_special_tokens") if isinstance(tc.get("extra_special_tokens"), dict) else {}
        self.bos_token = _special_text(tc.get("bos_token")) or "<bos>"
        self.image_token = (_special_text(tc.get("image_token")) or _special_text(extra.get("image_token"))
                            or DEFAULT_IMAGE_TOKEN)
        # The image processor's settings: in processor_config.json (newer exports) or
        # preprocessor_config.json (older ones).
        image_proc = proc.get("image_processor") or _read_json(folder / "preprocessor_config.json")
        self.max_soft_tokens = int(image_proc.get("max_soft_tokens", DEFAULT_MAX_SOFT_TOKENS))
        self.image_token_id, self.boi_id, self.eoi_id = image_token_id, boi_id, eoi_id

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    def render(self, question: str, with_image: bool) -> str:
        content = ([{"type": "image"}] if with_image else []) + [{"type": "text", "text": question}]
        return self.template.render(messages=[{"role": "user", "content": content}], bos_token=self.bos_token,
                                    add_generation_prompt=True, strftime_now=lambda f: datetime.now().strftime(f))

    def prompt_ids(self, question: str, n_image_tokens: int | None) -> list[int]:
        """The chat prompt for one user turn; with an image, its placeholder expanded to n soft tokens."""
        if not isinstance(question, str) or not question.strip():
            raise ValueError("question must be a non-empty string")
        text = self.render(question, n_image_tokens is not None)
        if n_image_tokens is None:
            return self.encode(text)
        parts = text.split(self.image_token)
        if len(parts) != 2:
            raise ValueError(f"the chat template put {len(parts) - 1} image placeholders "
                             f"({self.image_token!r}) in the prompt, expected 1")
        image = [self.boi_id] + [self.image_token_id] * n_image_tokens + [self.eoi_id]
        return self.encode(parts[0]) + image + self.encode(parts[1])


def _compile(source: str):
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str):
        raise jinja2.exceptions.TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(
        x, indent=indent, ensure_ascii=ensure_ascii)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(source)
