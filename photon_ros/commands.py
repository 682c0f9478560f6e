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
    (r"face", "point"),   # "face the door", as the README lists it ("face me": no object)
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


# Words a speaker adds after the object that name nothing to look for ("find the keys for me",
# "where's the cup at"): left in, the model was asked for "keys for me". Not "robot", though a
# speaker may end with it: "the other robot", "the toy robot" name one, and the model asked for
# "other" or "toy" looks for something else; "..., robot" with a comma asks for nothing (no guess).
_TRAILING_FILLER = re.compile(r" (?:please|now|right now|thanks|thank you|for me|at|located|again|"
                              r"(?:right |up |down |in |over |out )?(?:there|here)|quickly|real quick|okay|ok)$")


def strip_trailing_filler(target: str) -> str:
    """`target` without the filler words at its end ("keys for me please" -> "keys"); a one-word
    target is kept as it is."""
    while True:
        shorter = _TRAILING_FILLER.sub("", target)
        if shorter == target:
            return target
        target = shorter


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
            target = re.sub(rf"^{_ARTICLE}", "", strip_trailing_filler(m.group(1))).strip()
            if task == "point" and target.startswith("face "):   # "turn to face the door"
                target = re.sub(rf"^{_ARTICLE}", "", target[5:]).strip()
            if target in _NOT_OBJECTS or _CLAUSE.search(target) or _corrected(target):
                return None
            if target and not re.fullmatch(_ARTICLE.replace(r"\s+", ""), target):
                return VisionRequest(task, target)
    return None


# Stop words. Stopping is always safe, so an utterance is taken for a stop loosely (and from
# partial transcripts too, in the loop): a stop not meant costs a command said again, a stop missed
# a turn that goes on.
_STOP_OBJECT = (r"(?:it|that|this|everything|all|now|there|here|the (?:robot|turn|search|motors?)|"
                r"moving|turning|rotating|spinning|looking|searching|pointing|driving|going)")
_HALT = (rf"(?:(?:(?:emergency|e|full) )?stop(?: {_STOP_OBJECT})?|halt|freeze|abort|cancel(?: {_STOP_OBJECT})?|"
         r"never ?mind|forget (?:it|that)|wait|pause|hold (?:on|it|up|still)|hang on|whoa+|woah|(?:stay|stand|keep|be) still|"
         r"stay (?:put|there|here)|(?:don't|dont|do not) (?:move|turn|go|do (?:it|that|this)))")
# Stops only as a whole phrase: ending a longer one they may belong to it ("the cargo hold",
# "close enough", "yes or no").
_HALT_ALONE = (r"(?:no|nope|stay|hold|enough|that's enough|don't|dont|quit it|cut it out|knock it off|"
               r"(?:that's |that is )?(?:not (?:that|this|it)(?: one)?|(?:the )?wrong(?: one| way| direction)?))")
_STOP_LEAD = rf"(?:(?:{_OPENERS}|no|please|now|oh|just|i said) )*"
_STOP_TAIL = (r"(?: (?:please|now|right now|immediately|at once|already|robot|thanks|thank you|okay|ok|again|"
              r"there|right there|here|left|right|around|(?:for )?(?:a|one) (?:second|sec|moment|minute|bit)))*")
_STOP_WHOLE = re.compile(rf"{_STOP_LEAD}(?:{_HALT}|{_HALT_ALONE})(?: (?:{_HALT}|{_HALT_ALONE}))*{_STOP_TAIL}")
# A phrase that begins with a stop word is a stop whatever follows ("stop what you're doing",
# "no stop you're going the wrong way", "wait that's not the cup", "don't look at the mug"): no
# command begins so, and a stop missed is a turn that goes on ("stop at the door" stops too).
_STOP_FIRST = re.compile(rf"{_STOP_LEAD}(?:(?:emergency |e |full )?stop|halt|freeze|abort|cancel|wait|pause|"
                         r"hold on|hang on|whoa+|never ?mind|forget (?:it|that)|"
                         r"(?:don't|dont|do not) (?:move|turn|go|look|point|keep|rotate|spin|drive))\b")
_STOP_END = re.compile(rf"(?:^| ){_HALT}(?: {_HALT})*{_STOP_TAIL}$")
_NEGATIONS = frozenset("don't dont not never can't cant cannot won't wont didn't doesn't shouldn't".split())
# "don't stop": the speaker wants it to go on (and a "no" said with it is for the stop: "No, don't stop").
_NEGATED_STOP = re.compile(r"\b(?:don't|dont|not|never|can't|cannot|won't|wont) (?:stop|halt|freeze|wait)\b")


# A stop said right after the object without punctuation ("point at the cup stop", "... cup wait",
# "find the mug hold on"): the speaker took the command back. "the bus stop" is refused too, and
# is a stop (is_stop): stopping is the safe guess.
_STOP_AFTER = re.compile(rf" {_HALT}(?: {_HALT})*{_STOP_TAIL}$")


def _corrected(target: str) -> bool:
    """Whether an object phrase holds a correction, a negation or a stop after its first word."""
    _, _, rest = target.partition(" ")
    return bool(_CORRECTION.search(rest)) or _STOP_AFTER.search(target) is not None


def is_stop(text: str) -> bool:
    """Whether the utterance asks the robot to stop, in one of its sentences or comma-set phrases:
    one that is nothing but stop words ("stop", "No, stop!", "hold on", "Emergency stop!", "No!",
    "never mind"), begins with one whatever follows ("Stop turning left.", "stop what you're
    doing", "wait that's not the cup", "don't move"), or ends with one ("I said stop", "point at
    the red cup stop right now": no command is taken from those, and a turn in progress went on
    through them). "don't stop" is no stop; neither are stop words inside an object's name in a
    command we take ("point at the stop sign")."""
    text = text.translate(_APOSTROPHES).lower()
    text = re.sub(r"\b(\w{1,3})-(?=\1)", "", text)               # a stutter: "s-stop" is "stop"
    # dashes part phrases as commas do ("Find the cup - stop!"); a hyphen inside a word does not
    parts = [re.sub(r"\s+", " ", re.sub(r"[^\w\s']", " ", part)).strip()
             for part in re.split(r"[.!?;,\u2013\u2014]+|\s-+\s", text)]
    going_on = any(_NEGATED_STOP.search(part) for part in parts)
    return any(_is_stop_phrase(part, going_on) for part in parts if part)


def _is_stop_phrase(words: str, going_on: bool) -> bool:
    if _NEGATED_STOP.search(words):
        return False
    if _STOP_WHOLE.fullmatch(words):
        return not (going_on and set(words.split()) <= {"no", "nope"})
    if _STOP_FIRST.match(words):
        return True
    end = _STOP_END.search(words)
    return end is not None and words[:end.start()].rpartition(" ")[2] not in _NEGATIONS
