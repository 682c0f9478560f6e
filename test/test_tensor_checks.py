"""A checkpoint's tensors against what its config implies (photon_core.weights.tensor_checks), as
every family's loader asks: each kind of problem named, a few names shown, nothing for a good one."""
from __future__ import annotations

import pytest
import torch

from photon_core.weights.tensor_checks import listed, tensor_problems


def test_every_kind_of_problem_is_named_and_a_good_checkpoint_has_none():
    expected = {"a": ((2, 3), True), "b": ((4,), True), "c": ((1,), False), "d": ((5,), True)}
    good = {"a": torch.zeros(2, 3), "b": torch.zeros(4), "d": torch.zeros(5)}   # c is optional
    assert tensor_problems(good, expected) == {} and listed({}) == ""
    bad = {"a": torch.zeros(3, 2), "b": torch.zeros(4, dtype=torch.int8), "c": torch.zeros(1)}
    problems = tensor_problems(bad, expected)
    assert problems == {"missing": ["d"], "wrong shapes": ["a (3, 2) != (2, 3)"], "not floating point": ["b"]}
    assert listed(problems) == "missing ['d']; wrong shapes ['a (3, 2) != (2, 3)']; not floating point ['b']"


def test_long_lists_are_cut():
    assert listed({"missing": list("abcdef")}, shown=2) == "missing ['a', 'b']..."
    assert listed({"missing": [], "unexpected": ["x"]}) == "unexpected ['x']"


def test_moondream2_refuses_an_integer_tensor_instead_of_casting_it():
    from photon_core.models.moondream.config import MoondreamConfig
    from photon_core.models.moondream.model import check_state, expected_shapes
    cfg = MoondreamConfig()
    shapes = expected_shapes(cfg)
    sd = {k: torch.empty(v, dtype=torch.bfloat16, device="meta") for k, v in shapes.items()}
    check_state(sd, cfg, "md2")
    name = next(iter(shapes))
    sd[name] = torch.empty(shapes[name], dtype=torch.int8, device="meta")
    with pytest.raises(ValueError, match=rf"md2 does not match the Moondream 2 config: not floating point \['{name}'\]"):
        check_state(sd, cfg, "md2")
