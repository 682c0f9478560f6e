"""Moondream's tokenizer (`moondream/starmie-v1`, Hugging Face `tokenizers` format), found locally."""
from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer

from photon_core.weights import hf_cache

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_REPOS = ("vikhyatk/moondream2", "moondream/starmie-v1")


def find_tokenizer(folder: Path | None) -> Path:
    """tokenizer.json next to the weights, else in the Hugging Face cache; never downloads."""
    if folder is not None and (folder / TOKENIZER_FILE).is_file():
        return folder / TOKENIZER_FILE
    for repo in TOKENIZER_REPOS:
        snap = hf_cache.find_snapshot(repo, TOKENIZER_FILE)
        if snap is not None:
            return snap / TOKENIZER_FILE
    where = f"{folder / TOKENIZER_FILE}, " if folder is not None else ""
    raise FileNotFoundError(
        f"Moondream tokenizer not found: looked at {where}"
        + "; ".join(hf_cache.describe_search(r) for r in TOKENIZER_REPOS)
        + ". Get it with `hf download moondream/starmie-v1 tokenizer.json` "
          "(or `hf download vikhyatk/moondream2`).")


class MoondreamTokenizer:
    def __init__(self, path: Path) -> None:
        self.path = path
        self._tok = Tokenizer.from_file(str(path))

    def encode(self, text: str) -> list[int]:
        # Same call as the reference (special tokens per the tokenizer.json post-processor).
        return self._tok.encode(text).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids)
