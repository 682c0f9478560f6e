"""Parakeet's SentencePiece vocabulary: ids -> text, and which tokens begin a word.

Decoding a SentencePiece model needs only its pieces: text is their concatenation with "▁" read
as a space, byte pieces (<0xNN>) joined as UTF-8, control pieces dropped. A transformers folder
carries tokenizer.json (read with the `tokenizers` library, which also decodes); a .nemo carries
the SentencePiece model file, whose pieces are read here from its protobuf without the
sentencepiece package, or failing that its `tokenizer.vocab` / `vocab.txt` listings.
"""
from __future__ import annotations

import re
import struct
import unicodedata
from collections.abc import Iterator
from pathlib import Path
from typing import Any

_BYTE = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_SPACE = "\u2581"
# SentencePiece piece types (sentencepiece_model.proto): NORMAL 1, UNKNOWN 2, CONTROL 3,
# USER_DEFINED 4, UNUSED 5, BYTE 6.
_CONTROL, _BYTE_TYPE = 3, 6


# Pieces whose characters are not punctuation marks of the vocabulary (NeMo's
# extract_punctuation_from_vocab): [..], <..>, ##.., word-initial and blank pieces.
_NOT_PUNCTUATION_SOURCE = re.compile(r"^\[.*\]$|^<.*>$|^##|^\u2581|^\s*$")


class Vocabulary:
    def __init__(self, pieces: list[str], types: list[int] | None = None, hf_tokenizer=None) -> None:
        self.pieces = pieces
        self.types = types or [self._guess_type(p) for p in pieces]
        self._hf = hf_tokenizer
        # the punctuation marks of the vocabulary, as NeMo finds them: every character of Unicode
        # category P in a piece that is not special, word-initial or blank
        self.punctuation = frozenset(c for p in pieces if not _NOT_PUNCTUATION_SOURCE.match(p)
                                     for c in p if unicodedata.category(c).startswith("P"))
        self._is_punctuation: dict[int, bool] = {}

    @staticmethod
    def _guess_type(piece: str) -> int:
        if _BYTE.fullmatch(piece):
            return _BYTE_TYPE
        if piece in ("<unk>", "<s>", "</s>", "<pad>"):
            return _CONTROL
        return 1

    def __len__(self) -> int:
        return len(self.pieces)

    def starts_word(self, token: int) -> bool:
        return 0 <= token < len(self.pieces) and self.pieces[token].startswith(_SPACE)

    def is_punctuation(self, token: int) -> bool:
        """Whether the token, decoded alone, is one punctuation mark of the vocabulary (NeMo's test
        for the TDT timestamp refinement and for attaching a mark to the word before it)."""
        known = self._is_punctuation.get(token)
        if known is None:
            known = self._is_punctuation[token] = self.decode([token]) in self.punctuation
        return known

    def decode(self, ids: list[int]) -> str:
        if self._hf is not None:
            return self._hf.decode(list(ids), skip_special_tokens=True)
        out = bytearray()
        for i in ids:
            if not 0 <= i < len(self.pieces) or self.types[i] == _CONTROL:
                continue
            piece = self.pieces[i]
            if self.types[i] == _BYTE_TYPE and (m := _BYTE.fullmatch(piece)):
                out.append(int(m.group(1), 16))
            else:
                out += piece.replace(_SPACE, " ").encode("utf-8")
        return out.decode("utf-8", errors="replace").strip()


def from_tokenizer_json(path: Path) -> Vocabulary:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(path))
    size = tok.get_vocab_size(with_added_tokens=True)
    return Vocabulary([tok.id_to_token(i) or "" for i in range(size)], hf_tokenizer=tok)


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        b = buf[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        shift += 7
        if b < 0x80:
            return value, pos


def _fields(buf: bytes) -> Iterator[tuple[int, int, Any]]:
    """(field number, wire type, value) of a protobuf message; nested messages stay bytes."""
    pos = 0
    value: int | bytes | float
    while pos < len(buf):
        key, pos = _varint(buf, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(buf, pos)
        elif wire == 1:
            value, pos = buf[pos:pos + 8], pos + 8
        elif wire == 2:
            length, pos = _varint(buf, pos)
            value, pos = buf[pos:pos + length], pos + length
        elif wire == 5:
            value, pos = struct.unpack("<f", buf[pos:pos + 4])[0], pos + 4
        else:
            raise ValueError(f"unsupported protobuf wire type {wire}")
        yield number, wire, value


def from_sentencepiece_model(data: bytes) -> Vocabulary:
    """Pieces and types of a SentencePiece ModelProto (field 1: repeated SentencePiece{1: piece,
    2: score, 3: type})."""
    pieces, types = [], []
    for number, wire, value in _fields(data):
        if number != 1 or wire != 2:
            continue
        piece, kind = "", 1
        for n, w, v in _fields(value):
            if n == 1 and w == 2:
                piece = v.decode("utf-8")
            elif n == 3 and w == 0:
                kind = v
        pieces.append(piece)
        types.append(kind)
    if not pieces:
        raise ValueError("the SentencePiece model holds no pieces")
    return Vocabulary(pieces, types)


def from_vocab_listing(text: str, nemo_vocab_txt: bool) -> Vocabulary:
    """`tokenizer.vocab` (piece TAB score per line) or NeMo's vocab.txt (a word-initial piece
    without its "▁", any other prefixed with "##")."""
    pieces = []
    for line in text.splitlines():
        if not line:
            continue
        piece = line.split("\t")[0]
        if nemo_vocab_txt:
            piece = piece[2:] if piece.startswith("##") else _SPACE + piece
        pieces.append(piece)
    return Vocabulary(pieces)
