"""A stream of token ids as text pieces, for every family that decodes text.

Tokenizers spread one character over several tokens (byte-level BPE, byte fallback), so decoding
token by token would show broken characters. The ids so far are decoded again at each token and
only the new text goes out; a piece that ends in an unfinished character (U+FFFD) waits for the
token completing it. Lazy: a token is pulled only when the caller asks for more text.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

REPLACEMENT = "\ufffd"


def text_pieces(decode: Callable[[list[int]], str], tokens: Iterable[int]) -> Iterator[str]:
    """Pieces of `decode(all tokens)`, in order, as the tokens arrive; joined they are that text.
    decode: ids -> text (a tokenizer's decode)."""
    ids: list[int] = []
    shown = ""
    for tok in tokens:
        ids.append(tok)
        txt = decode(ids)
        if txt.startswith(shown) and len(txt) > len(shown) and not txt.endswith(REPLACEMENT):
            yield txt[len(shown):]
            shown = txt
    txt = decode(ids)
    if txt.startswith(shown) and len(txt) > len(shown):   # what was held back (an unfinished character)
        yield txt[len(shown):]


class JoinedPieces:
    """"".join(text_pieces(decode, tokens)) of a token list that grows between calls, one decode
    per new token: a progress report after every token would otherwise decode every prefix again
    (cubic in the answer's length, under the engine's lock)."""

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self.decode = decode
        self.ids: list[int] = []
        self.shown = ""

    def text(self, tokens: list[int], final: bool = True) -> str:
        """The text of `tokens`; final=False (a progress report: more tokens may come) leaves out an
        unfinished character at the end, as the streamed pieces do (a report showed "a cat \ufffd"
        before "a cat 猫")."""
        if tokens[:len(self.ids)] != self.ids:     # not a continuation: start again
            self.ids, self.shown = [], ""
        txt = None
        for tok in tokens[len(self.ids):]:          # text_pieces' rule, token by token
            self.ids.append(tok)
            txt = self.decode(self.ids)
            if txt.startswith(self.shown) and len(txt) > len(self.shown) and not txt.endswith(REPLACEMENT):
                self.shown = txt
        if txt is None:                              # no new token: the text of those there are
            txt = self.decode(self.ids)
        held = not final and txt.endswith(REPLACEMENT)
        return txt if txt.startswith(self.shown) and len(txt) > len(self.shown) and not held else self.shown


__all__ = ["text_pieces", "JoinedPieces"]
