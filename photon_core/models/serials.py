"""A number for each model object of the process, never given twice: what marks the values a model
made for itself (an encoded image's cache) as its own.

id() does not: a model released and another loaded in its place can get the same id, and an
encoded image the first made would pass as the second's and be decoded against other weights."""
from __future__ import annotations

import itertools

_next = itertools.count(1)


def new_serial() -> int:
    """A number no model of this process had or will have (next() on a count holds the GIL)."""
    return next(_next)
