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
# Words that name a direction or nobody in particular, not an object to look for ("turn to the
# left", "look at me"): the model would point at something, and the robot turn toward it.
_NOT_OBJECTS = frozenset("left right around back forward forwards backward backwards up down me it them "
                         "him her us you yourself there here".split())


def parse_command(text: str) -> VisionRequest | None:
    """The vision request a transcript asks for, or None when it asks for none we know. None too
    for more than one sentence or a clause after the object ("point at the red cup. Stop!",
    "point at the cup, no, the mug"): which one the speaker meant is not ours to guess."""
    raw = re.sub(r"\s+", " ", text.lower()).strip()
    raw = re.sub(r"[.!?;:\s]+$", "", raw)                       # the sentence's own end
    raw = re.sub(r",\s*please$", " please", raw)                 # "..., please"
    raw = re.sub(r"^((?:hey |ok |okay )?robot),", r"\1", raw)    # "robot, ..."
    if re.search(r"[.!?;:,]", raw):
        return None
    sentence = re.sub(r"[^\w\s']", " ", text.lower())
    sentence = re.sub(r"\s+", " ", sentence).strip()
    for verb, task in _PATTERNS:
        m = re.match(rf"^{_FILLER}{verb}\s+(?:{_ARTICLE})?(.+?)(?: please)?$", sentence)
        if m:
            target = re.sub(rf"^{_ARTICLE}", "", m.group(1)).strip()
            if task == "point" and target.startswith("face "):   # "turn to face the door"
                target = re.sub(rf"^{_ARTICLE}", "", target[5:]).strip()
            if target in _NOT_OBJECTS:
                return None
            if target and not re.fullmatch(_ARTICLE.replace(r"\s+", ""), target):
                return VisionRequest(task, target)
    return None
