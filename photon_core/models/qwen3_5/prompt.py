"""Tokenizer, chat template and prompt layout from the checkpoint's own files.

tokenizer.json is read with the `tokenizers` library; the chat template is the checkpoint's own
(runtime.chat_template renders it as transformers does). One <|image_pad|> placeholder per image is
expanded to as many tokens as the merger gives, and the 3-D rotary positions of the prompt are laid out as the model was trained:
text tokens advance all three axes together; an image's tokens sit at (start, start + row,
start + col) and the text after it resumes at start + max(rows, cols).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from photon_core.runtime.chat_template import ChatTemplate, stop_ids

CAPTION_PROMPTS = {"short": "Describe this image in one sentence.",
                   "normal": "Describe this image.",
                   "long": "Describe this image in detail."}
_STOP_TOKENS = ("<|im_end|>", "<|endoftext|>")


class Prompts:
    def __init__(self, folder: str | Path, eos_from_config: Any = None) -> None:
        from tokenizers import Tokenizer

        folder = Path(folder)
        if not (folder / "tokenizer.json").is_file():
            raise FileNotFoundError(f"{folder}: no tokenizer.json (the Qwen 3.5 tokenizer is read from it)")
        self.tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        self.template = ChatTemplate.from_folder(folder)
        self.stop_ids = stop_ids(folder, eos_from_config, self.tokenizer, _STOP_TOKENS)

    def chat_ids(self, question: str, with_image: bool) -> list[int]:
        """The user turn (an image first when given, then the question) and the assistant's opening,
        thinking switched off, as token ids with one placeholder per image. The question must have
        words (query and batch alike, as Gemma 4's and Moondream's)."""
        if not isinstance(question, str) or not question.strip():
            raise ValueError("query needs a non-empty question")
        content: Any = ([{"type": "image"}, {"type": "text", "text": question}] if with_image else question)
        # encoded so that a special token's string in the question stays text (ChatTemplate.encode)
        return self.template.encode(self.tokenizer, [{"role": "user", "content": content}],
                                    add_generation_prompt=True, enable_thinking=False)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


def expand_images(ids: list[int], image_token: int, counts: list[int]) -> list[int]:
    """Each image placeholder token repeated to its image's token count, in order."""
    out: list[int] = []
    found = 0
    for t in ids:
        if t == image_token:
            if found >= len(counts):
                raise ValueError("the prompt has more image placeholders than images")
            out += [image_token] * counts[found]
            found += 1
        else:
            out.append(t)
    if found != len(counts):
        raise ValueError(f"the chat template placed {found} image placeholders for {len(counts)} images")
    return out


def positions(ids: list[int], image_token: int | None, grids: list[tuple[int, int]]) -> tuple[torch.Tensor, int]:
    """(3-D rotary positions [3, T], delta): after the prompt, token n sits at n + delta on every axis.
    grids: each image's (rows, cols) of merged tokens, in order."""
    out = []
    pos, i, img = 0, 0, 0
    while i < len(ids):
        if image_token is not None and ids[i] == image_token:
            rows, cols = grids[img]
            r = torch.arange(rows)[:, None].expand(rows, cols).reshape(-1)
            c = torch.arange(cols)[None, :].expand(rows, cols).reshape(-1)
            out.append(torch.stack([torch.zeros_like(r), r, c]) + pos)
            pos += max(rows, cols)
            i += rows * cols
            img += 1
        else:
            j = i
            while j < len(ids) and (image_token is None or ids[j] != image_token):
                j += 1
            out.append(torch.arange(pos, pos + j - i)[None].expand(3, -1))
            pos += j - i
            i = j
    p = torch.cat(out, dim=1) if out else torch.zeros(3, 0, dtype=torch.long)
    return p, pos - len(ids)
