"""The Moondream API's skill options on the families that answer in text only (Qwen 3.5, Gemma 4,
language models): `settings` read as Moondream reads it (runtime.requests.Settings: the reference's
defaults, unknown keys a TypeError), and what only Moondream has refused with the reason."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from .requests import Settings
from .sampling import Sampling


def text_sampling(family: str, settings: Mapping[str, Any] | Settings | None, reasoning: bool = False,
                  spatial_refs: Sequence[Any] | None = None) -> Sampling:
    """How a caption or query of `family` decodes. NotImplementedError for a variant, reasoning or
    spatial references (Moondream's adapters, grounded reasoning and region encoder); max_objects
    is accepted and unused, as Moondream's text skills do."""
    opts = Settings.of(settings)
    if opts.variant is not None:
        raise NotImplementedError(f"settings['variant'] ({opts.variant!r}): fine-tuned variants are "
                                  f"Moondream's; {family} has none")
    if reasoning:
        raise NotImplementedError(f"reasoning=True: grounded reasoning is Moondream's; {family} has none "
                                  "(a family with a thinking mode thinks in chat(messages, reasoning=True))")
    if spatial_refs is not None and len(spatial_refs) > 0:   # (an array's truth value is an error)
        raise NotImplementedError(f"spatial_refs: Moondream's region encoder puts them in the prompt; "
                                  f"{family} has none (say where in the question instead)")
    return opts.sampling()
