"""Gemma 4 tokenizer and prompts: the checkpoint's tokenizer.json and chat template
(runtime.chat_template renders it as transformers does); the image placeholder in the rendered
text becomes [begin-of-image] + soft-token placeholders + [end-of-image] ids."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from photon_core.runtime.chat_template import ChatTemplate, read_json, token_text

from .vision import SOFT_TOKEN_BUDGETS

CAPTIONS = {"short": "Describe this image in one sentence.", "normal": "Describe this image.",
            "long": "Describe this image in detail."}
DEFAULT_IMAGE_TOKEN = "<|image|>"
DEFAULT_MAX_SOFT_TOKENS = 280


class Gemma4Prompter:
    """Turns (question, image soft-token count) into token ids, and ids back into text."""

    def __init__(self, folder: Path, image_token_id: int, boi_id: int, eoi_id: int) -> None:
        folder = Path(folder)
        if not (folder / "tokenizer.json").is_file():
            raise FileNotFoundError(f"{folder}: a Gemma 4 checkpoint needs tokenizer.json next to its weights")
        self.tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
        tc = read_json(folder / "tokenizer_config.json")
        proc = read_json(folder / "processor_config.json")
        self.template = ChatTemplate.from_folder(folder)
        extra = tc.get("extra_special_tokens")
        extra = extra if isinstance(extra, dict) else {}
        # Gemma's tokenizer class names <bos> when tokenizer_config.json does not.
        self.template.special_tokens.setdefault("bos_token", "<bos>")
        self.image_token = (token_text(tc.get("image_token")) or token_text(extra.get("image_token"))
                            or DEFAULT_IMAGE_TOKEN)
        # The image processor's settings: in processor_config.json (newer exports) or
        # preprocessor_config.json (older ones).
        image_proc = proc.get("image_processor") or read_json(folder / "preprocessor_config.json")
        self.max_soft_tokens = int(image_proc.get("max_soft_tokens", DEFAULT_MAX_SOFT_TOKENS))
        if self.max_soft_tokens not in SOFT_TOKEN_BUDGETS:   # refused at load, as transformers does, not
            raise ValueError(f"{folder}: the image processor's max_soft_tokens must be one of "   # at every image
                             f"{SOFT_TOKEN_BUDGETS}, got {self.max_soft_tokens}")
        self.image_token_id, self.boi_id, self.eoi_id = image_token_id, boi_id, eoi_id

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    def render(self, question: str, with_image: bool) -> str:
        return self.template.render(self._turn(question, with_image), add_generation_prompt=True)

    @staticmethod
    def _turn(question: str, with_image: bool) -> list[dict]:
        content = ([{"type": "image"}] if with_image else []) + [{"type": "text", "text": question}]
        return [{"role": "user", "content": content}]

    def prompt_ids(self, question: str, n_image_tokens: int | None) -> list[int]:
        """The chat prompt for one user turn; with an image, its placeholder expanded to n soft tokens."""
        if not isinstance(question, str) or not question.strip():
            raise ValueError("question must be a non-empty string")
        return self.chat_ids(self._turn(question, n_image_tokens is not None),
                             [] if n_image_tokens is None else [n_image_tokens])

    def chat_ids(self, messages: list[dict], n_image_tokens: list[int], **variables: Any) -> list[int]:
        """A conversation's prompt ids, each image placeholder the template put expanded to
        [begin-of-image] + its image's n soft tokens + [end-of-image]. A placeholder's (or any special
        token's) string in a message's text stays text (ChatTemplate.encode)."""
        ids = self.template.encode(self.tok, messages, add_generation_prompt=True, **variables)
        placeholder = self.tok.token_to_id(self.image_token)
        found = ids.count(placeholder) if placeholder is not None else 0
        if found != len(n_image_tokens):
            raise ValueError(f"the chat template put {found} image placeholders ({self.image_token!r}) in the "
                             f"prompt for {len(n_image_tokens)} images")
        out: list[int] = []
        counts = iter(n_image_tokens)
        for t in ids:
            if t == placeholder:
                out += [self.boi_id] + [self.image_token_id] * next(counts) + [self.eoi_id]
            else:
                out.append(t)
        return out

