"""The toy family's tokenizer: UTF-8 bytes are ids 0..255, then BOS and EOS (config.json's ids).
Byte-level, like Llama 3's, so one character may span several tokens."""
from __future__ import annotations

from collections.abc import Sequence


class ByteTokenizer:
    def __init__(self, bos: int, eos: int, vocab_size: int) -> None:
        if min(bos, eos) < 256 or max(bos, eos) >= vocab_size:
            raise ValueError(f"BOS {bos} and EOS {eos} must lie past the 256 byte ids, inside the vocabulary "
                             f"({vocab_size})")
        self.bos, self.eos = bos, eos

    def encode(self, text: str) -> list[int]:
        return [self.bos] + list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")
