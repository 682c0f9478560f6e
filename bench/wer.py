"""Word error rate with one text normalisation for references and hypotheses alike.

Whisper writes "Turn 90 degrees" where the reference says "ninety", "25%" for "25 percent" and
"Dr. Patel" for "Doctor Patel": without a shared normalisation those count as errors that no
listener would call one. Both sides are lower-cased, numbers are spelled out in words (digits,
decimals, ordinals, "%"), the "and" inside a spoken number ("two hundred and fourteen") is dropped,
a few abbreviations and units are expanded, and punctuation goes. What remains is compared word by word.
"""
from __future__ import annotations

import re
from typing import Sequence

_ONES = ("zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen "
         "fifteen sixteen seventeen eighteen nineteen").split()
_TENS = "_ _ twenty thirty forty fifty sixty seventy eighty ninety".split()
_SCALES = ((10**9, "billion"), (10**6, "million"), (1000, "thousand"), (100, "hundred"))
_ORDINALS = {"one": "first", "two": "second", "three": "third", "five": "fifth", "eight": "eighth",
             "nine": "ninth", "twelve": "twelfth"}
_NUMBER_WORDS = set(_ONES) | set(_TENS[2:]) | {s for _, s in _SCALES}
_ABBREVIATIONS = {"dr": "doctor", "mr": "mister", "mrs": "missus", "ms": "miss", "st": "saint",
                  "ok": "okay", "vs": "versus", "cm": "centimeters", "mm": "millimeters",
                  "km": "kilometers", "kg": "kilograms"}


def number_words(n: int) -> str:
    """A non-negative integer in words, without "and": 214 -> "two hundred fourteen"."""
    if n < 0:
        raise ValueError(f"negative number {n}")
    if n < 20:
        return _ONES[n]
    if n < 100:
        return _TENS[n // 10] + ("" if n % 10 == 0 else " " + _ONES[n % 10])
    for scale, name in _SCALES:
        if n >= scale:
            head, rest = divmod(n, scale)
            return f"{number_words(head)} {name}" + ("" if rest == 0 else " " + number_words(rest))
    raise AssertionError("unreachable")


def _ordinal(words: str) -> str:
    """"twenty one" -> "twenty first"; the last word carries the ordinal ending."""
    *head, last = words.split()
    if last in _ORDINALS:
        last = _ORDINALS[last]
    elif last.endswith("y"):
        last = last[:-1] + "ieth"
    else:
        last += "th"
    return " ".join(head + [last])


def _spell_number(match: re.Match) -> str:
    whole, fraction, suffix = match.group(1), match.group(2), match.group(3)
    words = number_words(int(whole.replace(",", "")))
    if suffix:
        words = _ordinal(words)
    if fraction:
        words += " point " + " ".join(_ONES[int(d)] for d in fraction)
    return f" {words} "


def normalize(text: str) -> list[str]:
    """The words of `text`, normalised for comparison (see the module doc)."""
    text = text.lower().replace("%", " percent ").replace("&", " and ")
    text = re.sub(r"(\d)[-–](\d)", r"\1 \2", text)   # ranges and phone-style digits
    text = re.sub(r"(\d{1,3}(?:,\d{3})+|\d+)(?:\.(\d+))?(?:(st|nd|rd|th)\b)?", _spell_number, text)
    text = re.sub(r"['’]", "", text)                  # don't -> dont, on both sides alike
    words = [_ABBREVIATIONS.get(w, w) for w in re.sub(r"[^a-z]+", " ", text).split()]
    return [w for i, w in enumerate(words) if not _spoken_number_and(words, i)]


def _spoken_number_and(words: list[str], i: int) -> bool:
    """Is words[i] the "and" of "hundred and fourteen"? British and American speakers differ."""
    return (words[i] == "and" and 0 < i < len(words) - 1 and words[i - 1] in _NUMBER_WORDS
            and words[i + 1] in _NUMBER_WORDS)


def edit_distance(ref: Sequence[str], hyp: Sequence[str]) -> int:
    """Fewest substitutions, deletions and insertions turning `ref` into `hyp` (Levenshtein)."""
    previous = list(range(len(hyp) + 1))
    for i, r in enumerate(ref, 1):
        current = [i]
        for j, h in enumerate(hyp, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (r != h)))
        previous = current
    return previous[-1]


def wer(references: Sequence[str], hypotheses: Sequence[str]) -> float:
    """Pooled word error rate: all edits over all reference words (not a mean of per-utterance
    rates, which would weigh a two-word command like a sixty-second paragraph)."""
    if len(references) != len(hypotheses):
        raise ValueError(f"{len(references)} references but {len(hypotheses)} hypotheses")
    refs = [normalize(r) for r in references]
    total = sum(len(r) for r in refs)
    if total == 0:
        raise ValueError("the references have no words")
    return sum(edit_distance(r, normalize(h)) for r, h in zip(refs, hypotheses)) / total
