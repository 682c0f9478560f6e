"""Spoken commands -> vision requests. "point at the red cup" -> ("point", "red cup").

Deliberately a small grammar rather than a language model: a robot should do nothing on a
sentence it did not understand, and say so.
"""
from __future__ import annotations

import re
from typing import NamedTuple


class VisionRequest(NamedTuple):
    task: str      # "point" or "detect"
    target: str    # the object phrase for the model, e.g. "red cup"


# Verb phrases, longest first so "point at" wins over "point".
_PATTERNS: list[tuple[str, str]] = [
    (r"(?:point|pointing) (?:at|to|towards?)", "point"),
    (r"(?:look|turn|face) (?:at|to|towards?)", "point"),
    (r"(?:where is|where's|where are)", "point"),
    (r"(?:find|locate|detect|search for|look for|show me|count)", "detect"),
]
_FILLER = r"(?:(?:hey |ok |okay )?robot,? )?(?:(?:can|could|would) you |please |now |then )*"
_ARTICLE = r"(?:the|a|an|some|any|all|all the|my|that|this)\s+"


def parse_command(text: str) -> VisionRequest | None:
    """The vision request a transcript asks for, or None when it asks for none we know."""
    sentence = re.sub(r"[^\w\s']", " ", text.lower())
    sentence = re.sub(r"\s+", " ", sentence).strip()
    for verb, task in _PATTERNS:
        m = re.match(rf"^{_FILLER}{verb}\s+(?:{_ARTICLE})?(.+?)(?: please)?$", sentence)
        if m:
            target = re.sub(rf"^{_ARTICLE}", "", m.group(1)).strip()
            if target and not re.fullmatch(_ARTICLE.replace(r"\s+", ""), target):
                return VisionRequest(task, target)
    return None
