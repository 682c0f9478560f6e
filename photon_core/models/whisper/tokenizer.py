"""Whisper tokenizer from a checkpoint's tokenizer.json (Hugging Face `tokenizers`).

Special token ids are looked up by their text in the file, never hard-coded, because English-only
and multilingual vocabularies place them differently. Encoding follows openai-whisper's tiktoken
behaviour (no implicit leading space: callers add " " themselves), so we disable the byte-level
pre-tokenizer's `add_prefix_space`.
"""
from __future__ import annotations

import json
from functools import cached_property
from pathlib import Path

from tokenizers import Tokenizer


def language_code(language: str | None) -> str | None:
    """A language as the tokenizer names it: 'EN', ' en ' and '<|en|>' are 'en' (openai-whisper and
    transformers take them so); None and '' leave it to be detected."""
    if language is None:
        return None
    if not isinstance(language, str):
        raise TypeError(f"language must be a code such as 'en', got {language!r}")
    code = language.strip().lower()
    if code.startswith("<|") and code.endswith("|>"):
        code = code[2:-2]
    return code or None


class WhisperTokenizer:
    def __init__(self, tokenizer_json: str | Path, n_vocab: int):
        spec = json.loads(Path(tokenizer_json).read_text(encoding="utf-8"))
        pre = spec.get("pre_tokenizer") or {}
        if pre.get("type") == "ByteLevel":
            pre["add_prefix_space"] = False
        self._tok = Tokenizer.from_str(json.dumps(spec))
        self.special: dict[str, int] = {t["content"]: t["id"] for t in spec.get("added_tokens", [])}
        self.n_vocab = n_vocab
        # openai-whisper's rule: English-only vocabularies have 51864 tokens, multilingual more.
        self.multilingual = n_vocab > 51864

        def need(*names: str) -> int:
            for name in names:
                if name in self.special:
                    return self.special[name]
            raise ValueError(f"{tokenizer_json}: special token {names[0]} not found")

        self.eot = need("<|endoftext|>")
        self.sot = need("<|startoftranscript|>")
        self.translate = need("<|translate|>")
        self.transcribe = need("<|transcribe|>")
        self.sot_lm = need("<|startoflm|>")
        self.sot_prev = need("<|startofprev|>")
        self.no_timestamps = need("<|notimestamps|>")
        self.no_speech = self.special.get("<|nospeech|>", self.special.get("<|nocaptions|>"))
        # Older tokenizer.json files stop at <|notimestamps|>: the 1501 timestamp tokens
        # <|0.00|>..<|30.00|> always follow it directly in Whisper vocabularies.
        self.timestamp_begin = self.special.get("<|0.00|>", self.no_timestamps + 1)
        lang_ids = {name[2:-2]: i for name, i in self.special.items()
                    if self.sot < i < self.translate and name.startswith("<|")}
        self.languages: dict[str, int] = lang_ids

    def sot_sequence(self, language: str | None = "en", task: str = "transcribe") -> list[int]:
        """The decoder prompt: [SOT] for English-only models, [SOT, <|lang|>, task] otherwise."""
        if not self.multilingual:
            if language not in (None, "en"):
                raise ValueError(f"this model is English-only; language={language!r} is "
                                 "not possible")
            if task != "transcribe":
                raise ValueError("English-only models can only transcribe")
            return [self.sot]
        if language is None:
            # transcribe() detects the language before building a prompt; a direct caller must say it.
            raise ValueError("a multilingual model's prompt needs a language code (e.g. 'en')")
        if language not in self.languages:
            raise ValueError(f"unknown language {language!r}: a code of {len(self.languages)} such as 'en' or 'de' "
                             "(names such as 'English' are not taken)")
        return [self.sot, self.languages[language],
                self.transcribe if task == "transcribe" else self.translate]

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        """Text of the ordinary tokens in `ids` (special and timestamp tokens are dropped)."""
        return self._tok.decode([i for i in ids if i < self.eot], skip_special_tokens=False)

    @cached_property
    def non_speech_tokens(self) -> tuple[int, ...]:
        """Tokens for symbols that transcribe non-speech (speaker tags, music notes...), which
        Whisper suppresses by default; same rule as openai-whisper: keep basic punctuation, and
        allow hyphens/apostrophes inside words but not at a word's start."""
        symbols = list('"#()*+/:;<=>@[\\]^_`{|}~「」『』')
        symbols += ("<< >> <<< >>> -- --- -( -[ (' (\" (( )) ((( ))) [[ ]] {{ }} "
                    "♪♪ ♪♪♪").split()
        miscellaneous = set("♩♪♫♬♭♮♯")
        result = {self.encode(" -")[0], self.encode(" '")[0]}
        for symbol in symbols + sorted(miscellaneous):
            for tokens in (self.encode(symbol), self.encode(" " + symbol)):
                if len(tokens) == 1 or symbol in miscellaneous:
                    result.add(tokens[0])
        return tuple(sorted(result))
