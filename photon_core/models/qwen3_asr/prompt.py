"""Qwen3-ASR's prompt and output text: its tokenizer, its chat template, its language tags.

The prompt is the checkpoint's chat template rendered as the processor does for a transcription
request: a system turn (the context: `initial_prompt`), a user turn holding the audio
(`<|audio_start|><|audio_pad|><|audio_end|>`, the pad then repeated once per audio token) and
the assistant turn continued from "language <Name><asr_text>" when the language is given, or
from nothing (the model then writes "language <Name><asr_text>" itself: detection). The system
turn is always there, empty without a context, as the original library sends it and the
checkpoints' template renders it. Checkpoints without a template get the ChatML layout the
template produces.
"""
from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer

from photon_core.runtime.chat_template import ChatTemplate

AUDIO_PAD, AUDIO_START, AUDIO_END = "<|audio_pad|>", "<|audio_start|>", "<|audio_end|>"
ASR_TEXT = "<asr_text>"

# The languages Qwen3-ASR was trained to name after "language " (code -> name).
LANGUAGES = {
    "ar": "Arabic", "yue": "Cantonese", "zh": "Chinese", "cs": "Czech", "da": "Danish",
    "nl": "Dutch", "en": "English", "fil": "Filipino", "fi": "Finnish", "fr": "French",
    "de": "German", "el": "Greek", "hi": "Hindi", "hu": "Hungarian", "id": "Indonesian",
    "it": "Italian", "ja": "Japanese", "ko": "Korean", "mk": "Macedonian", "ms": "Malay",
    "fa": "Persian", "pl": "Polish", "pt": "Portuguese", "ro": "Romanian", "ru": "Russian",
    "es": "Spanish", "sv": "Swedish", "th": "Thai", "tr": "Turkish", "vi": "Vietnamese",
}
_BY_NAME = {name.lower(): code for code, name in LANGUAGES.items()}

_FALLBACK_TEMPLATE = (
    "{%- if not messages or messages[0]['role'] != 'system' -%}"
    "{{- '<|im_start|>system\\n<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}{%- else -%}"
    "{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'audio' -%}{{- '<|audio_start|><|audio_pad|><|audio_end|>' -}}"
    "{%- elif part['type'] == 'text' -%}{{- part['text'] -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}")


def language_name(language: str) -> str:
    """A code ("en") or a name ("English", any case) -> the name the model reads; ValueError."""
    key = language.strip().lower()
    if key in LANGUAGES:
        return LANGUAGES[key]
    if key in _BY_NAME:
        return LANGUAGES[_BY_NAME[key]]
    raise ValueError(f"unknown language {language!r} for Qwen3-ASR; use one of "
                     f"{', '.join(sorted(LANGUAGES))} (or their names)")


def language_code(name: str) -> str | None:
    """"English" -> "en"; "None" or an unknown name -> None."""
    return _BY_NAME.get(name.strip().lower())


# Qwen2's pre-tokenizer split (its tokenizer class builds the same from vocab.json + merges.txt).
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def load_tokenizer(folder: Path) -> Tokenizer:
    """tokenizer.json, or else the Qwen2 byte-level BPE from vocab.json + merges.txt with the
    added tokens of tokenizer_config.json (checkpoints that ship only those)."""
    path = folder / "tokenizer.json"
    if path.is_file():
        return Tokenizer.from_file(str(path))
    vocab, merges = folder / "vocab.json", folder / "merges.txt"
    if not (vocab.is_file() and merges.is_file()):
        raise FileNotFoundError(f"{folder}: no tokenizer.json (nor vocab.json + merges.txt) next to the "
                                "weights; put the model's tokenizer files (from its Hugging Face "
                                "repository) there")
    from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers

    tok = Tokenizer(models.BPE.from_file(str(vocab), str(merges), unk_token=None,
                                         continuing_subword_prefix="", end_of_word_suffix="",
                                         fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    config = folder / "tokenizer_config.json"
    added = json.loads(config.read_text()).get("added_tokens_decoder", {}) if config.is_file() else {}
    for index in sorted(added, key=int):
        entry = added[index]
        token = AddedToken(entry["content"], special=bool(entry.get("special", False)),
                           normalized=bool(entry.get("normalized", False)),
                           lstrip=bool(entry.get("lstrip", False)), rstrip=bool(entry.get("rstrip", False)),
                           single_word=bool(entry.get("single_word", False)))
        (tok.add_special_tokens if token.special else tok.add_tokens)([token])
        if tok.token_to_id(entry["content"]) != int(index):
            raise ValueError(f"{config}: added token {entry['content']!r} should have id {index}, "
                             f"got {tok.token_to_id(entry['content'])}")
    return tok


class Qwen3ASRPrompt:
    """Token ids in and text out for one checkpoint folder."""

    def __init__(self, folder: str | Path, audio_token_id: int) -> None:
        folder = Path(folder)
        self.tokenizer = load_tokenizer(folder)
        pad = self.tokenizer.token_to_id(AUDIO_PAD)
        if pad is not None and pad != audio_token_id:
            raise ValueError(f"{folder}: tokenizer's {AUDIO_PAD} is {pad}, config's audio_token_id "
                             f"is {audio_token_id}")
        self.audio_token_id = audio_token_id
        self.template = ChatTemplate.from_folder(folder, fallback=_FALLBACK_TEMPLATE)

    def render(self, language: str | None, context: str | None) -> str:
        """The prompt text, one audio pad, continued from the language prefix (if given)."""
        # the messages transformers' processor builds (a system message only with a context; the
        # checkpoints' template renders an empty system turn without one, as does the fallback)
        messages: list[dict] = []
        if context is not None:
            messages.append({"role": "system", "content": [{"type": "text", "text": context}]})
        messages.append({"role": "user", "content": [{"type": "audio"}]})
        prefill = f"language {language_name(language)}{ASR_TEXT}" if language else ""
        messages.append({"role": "assistant", "content": [{"type": "text", "text": prefill}]})
        # The assistant turn is continued, not closed.
        return self.template.render(messages, continue_final_message=True)

    def prompt_ids(self, n_audio: int, language: str | None, context: str | None) -> list[int]:
        """Token ids of the prompt with the audio pad repeated `n_audio` times."""
        ids = self.tokenizer.encode(self.render(language, context), add_special_tokens=False).ids
        if ids.count(self.audio_token_id) != 1:
            raise ValueError(f"the chat template gave {ids.count(self.audio_token_id)} audio "
                             "placeholders; expected one")
        at = ids.index(self.audio_token_id)
        return ids[:at] + [self.audio_token_id] * n_audio + ids[at + 1:]

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def parse(self, ids: list[int], language: str | None) -> tuple[str, str | None]:
        """Generated ids (stop token excluded) -> (text, language code), as the processor's
        parsed output reads them: special tokens skipped, runaway repetitions collapsed, and
        (when the language was not given) the model's "language <Name><asr_text>" cut off and
        read. "language None" or an unknown name gives None."""
        raw = self.tokenizer.decode(ids, skip_special_tokens=True).strip()
        forced = language_code(language_name(language)) if language else None
        if not raw:
            return "", forced
        if "assistant\n" in raw:
            raw = raw.split("assistant\n", 1)[1]
        raw = collapse_repetitions(raw)
        if ASR_TEXT not in raw:
            return raw.strip(), forced
        prefix, text = raw.split(ASR_TEXT, 1)
        prefix = prefix.strip()
        name = prefix[len("language"):].strip() if prefix.lower().startswith("language") else ""
        return text.strip(), forced or (language_code(name) if name else None)


def collapse_repetitions(text: str, times: int = 20, longest: int = 20) -> str:
    """The original library's guard against a decoder stuck in a loop: a character repeated more
    than `times` times in a row is kept once; from the first place where a pattern of up to
    `longest` characters repeats `times` or more times, it is kept once and the rest of the text
    is checked again."""
    out, i = [], 0
    while i < len(text):   # character runs first
        j = i
        while j < len(text) and text[j] == text[i]:
            j += 1
        out.append(text[i] if j - i > times else text[i:j])
        i = j
    text = "".join(out)
    for start in range(0, len(text) - 2 * times + 1):
        for size in range(1, longest + 1):
            if start + size * times > len(text):
                break
            pattern = text[start:start + size]
            if all(text[start + r * size:start + (r + 1) * size] == pattern for r in range(1, times)):
                end = start + size * times
                while text[end:end + size] == pattern:
                    end += size
                return text[:start] + pattern + collapse_repetitions(text[end:], times, longest)
    return text
