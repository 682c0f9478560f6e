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
# What a speaker says before the command: "hey robot", "okay", "ok robot" (Whisper writes "Okay,"
# and "Hey, robot," with commas, which are taken out before the one-sentence check), then politeness.
_OPENERS = r"(?:hey|hi|ok|okay|robot)"
_FILLER = rf"(?:{_OPENERS} )*(?:(?:can|could|would) you |please |now |then )*"
_ARTICLE = r"(?:the|a|an|some|any|all|all the|my|that|this)\s+"
# Words that name a direction or nobody in particular, not an object to look for ("turn to the
# left", "look at me"): the model would point at something, and the robot turn toward it.
_NOT_OBJECTS = frozenset("left right around back forward forwards backward backwards up down me it them "
                         "him her us you yourself there here".split())
# A clause after the object without punctuation ("point at the cup and then stop", "find the keys
# but wait"): a second instruction, or a correction. "and" alone joins objects ("salt and
# pepper"), so only "and" before a verb or a subject counts.
_VERBS = ("stop wait come go bring pick grab take put give turn look point find locate detect show tell "
          "say move follow drive return open close stay sit stand leave drop hold check count search get")
_CLAUSE = re.compile(rf"\b(?:then|but|after that|afterwards|and (?:{'|'.join(_VERBS.split())}|i|you|we|they))\b")
# A correction or a negation after the object's first word ("find the cup not the mug", "point at
# the door no wait", "find the keys I mean the wallet"): the model would be asked for both objects.
# Not its first word: "the no entry sign" is one object.
_CORRECTION = re.compile(r"\b(?:no|not|don't|dont|never|instead|i mean|actually|sorry)\b")
# Typographic apostrophes ("Where’s", as transcripts and phones write them) are the plain one.
_APOSTROPHES = str.maketrans({"\u2019": "'", "\u2018": "'", "\u02bc": "'"})


def parse_command(text: str) -> VisionRequest | None:
    """The vision request a transcript asks for, or None when it asks for none we know. None too
    for more than one sentence or a clause after the object ("point at the red cup. Stop!",
    "point at the cup, no, the mug", "point at the cup and then stop", and unpunctuated "point at
    the cup no the mug", "point at the cup stop"): which one the speaker meant is not ours to
    guess. Openers before the command ("Okay, ...", "Hey, robot, ...", "Please, ...") are not a
    clause."""
    text = text.translate(_APOSTROPHES)
    raw = re.sub(r"\s+", " ", text.lower()).strip()
    raw = re.sub(r"[.!?;:\s]+$", "", raw)                       # the sentence's own end
    raw = re.sub(r",\s*please$", " please", raw)                 # "..., please"
    # "okay, ...", "hey, robot, ...", "robot, please, ...": commas after openers, not clauses
    raw = re.sub(rf"^(?:(?:{_OPENERS}|please)\b,?\s*)+", lambda m: m.group(0).replace(",", " "), raw)
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
            if target in _NOT_OBJECTS or _CLAUSE.search(target) or _corrected(target):
                return None
            if target and not re.fullmatch(_ARTICLE.replace(r"\s+", ""), target):
                return VisionRequest(task, target)
    return None


# Stop words: the whole utterance, once or repeated ("stop, stop!"), after openers and "no" ("no,
# stop"). Stopping is always safe, so these are taken from partial transcripts too (the loop).
_STOP = (r"(?:stop(?: (?:it|that|now|moving|turning|looking|searching|there|right there))?|halt|freeze|"
         r"cancel(?: (?:it|that))?|never ?mind|abort|wait)")
_STOP_LEAD = rf"(?:(?:{_OPENERS}|no|please|now) )*"
_STOP_TAIL = r"(?: (?:please|now|robot))*"


# A stop said right after the object without punctuation ("point at the cup stop", "... cup wait"):
# the speaker took the command back. "the bus stop" is refused too: doing nothing is the safe guess.
_STOP_AFTER = re.compile(rf" {_STOP_LEAD}{_STOP}(?: {_STOP})*{_STOP_TAIL}$")


def _corrected(target: str) -> bool:
    """Whether an object phrase holds a correction, a negation or a stop after its first word."""
    _, _, rest = target.partition(" ")
    return bool(_CORRECTION.search(rest)) or _STOP_AFTER.search(target) is not None


def is_stop(text: str) -> bool:
    """Whether the utterance asks the robot to stop ("stop", "no, stop!", "hey robot, halt",
    "never mind", "stop turning please"): one of its sentences or comma-set phrases is nothing but
    that ("Stop! That's the wrong one.", "Point at the cup. Stop!", "Wait, find the mug": none is a
    command we take, and a turn in progress went on through them), while "stop at the door" and
    "don't stop" are no stop words, and no command either."""
    text = text.translate(_APOSTROPHES).lower()
    # dashes part phrases as commas do ("Find the cup - stop!"); a hyphen inside a word does not
    return any(_is_stop_phrase(part) for part in re.split(r"[.!?;,\u2013\u2014]+|\s-+\s", text))


def _is_stop_phrase(part: str) -> bool:
    words = re.sub(r"\s+", " ", re.sub(r"[^\w\s']", " ", part)).strip()
    return bool(words) and re.fullmatch(rf"{_STOP_LEAD}{_STOP}(?: {_STOP})*{_STOP_TAIL}", words) is not None
