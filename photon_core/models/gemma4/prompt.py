"""Gemma 4 tokenizer and prompts: the checkpoint's tokenizer.json and chat template
(runtime.chat_template renders it as transformers does); the image placeholder in the rendered
text becomes [begin-of-image] + soft-token placeholders + [end-of-image] ids."""
from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer

from photon_core.runtime.chat_template import ChatTemplate, read_json, token_text

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
        self.image_token_id, self.boi_id, self.eoi_id = image_token_id, boi_id, eoi_id

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    def render(self, question: str, with_image: bool) -> str:
        content = ([{"type": "image"}] if with_image else []) + [{"type": "text", "text": question}]
        return self.template.render([{"role": "user", "content": content}], add_generation_prompt=True)

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

