"""A checkpoint's tensors against the names, shapes and dtype its config implies, checked at load.

A tensor that is absent fails as a KeyError deep in a loader, one of another shape as a matmul
error mid-inference, an integer (quantized) one is silently cast to floats: each family's loader
asks here instead and raises one ValueError naming its checkpoint and every kind of problem.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

Shape = tuple[int, ...]


def tensor_problems(tensors: Mapping[str, torch.Tensor], expected: Mapping[str, tuple[Shape, bool]]
                    ) -> dict[str, list[str]]:
    """Label -> names for the tensors that do not meet `expected` (name -> (shape, required)):
    "missing" (required and absent), "wrong shapes" ("name (held) != (wanted)") and "not
    floating point". Labels without a problem are left out."""
    found = {
        "missing": [n for n, (_, required) in expected.items() if required and n not in tensors],
        "wrong shapes": [f"{n} {tuple(tensors[n].shape)} != {shape}" for n, (shape, _) in expected.items()
                         if n in tensors and tuple(tensors[n].shape) != shape],
        "not floating point": [n for n in expected if n in tensors and not tensors[n].is_floating_point()],
    }
    return {label: names for label, names in found.items() if names}


def listed(problems: Mapping[str, Iterable[str]], shown: int = 4) -> str:
    """"label [first names]..." for every label with names, joined by "; " ("" for none)."""
    parts = []
    for label, names in problems.items():
        names = list(names)
        if names:
            parts.append(f"{label} {names[:shown]}{'...' if len(names) > shown else ''}")
    return "; ".join(parts)


def refuse_integers(tensors: Mapping[str, torch.Tensor], source: object) -> None:
    """ValueError naming the integer (quantized) tensors, for a loader that casts every tensor to
    its dtype on the way in: cast, they would load as garbage weights without a word."""
    ints = [n for n, t in tensors.items() if not t.is_floating_point()]
    if ints:
        raise ValueError(f"{source}: {listed({'not floating point': ints})} (quantized checkpoints are not "
                         "supported yet)")
