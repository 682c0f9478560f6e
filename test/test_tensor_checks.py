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


@pytest.mark.parametrize("family", ["moondream", "moondream3"])
def test_moondream_loaders_refuse_an_integer_tensor_instead_of_casting_it(tmp_path, family):
    """Their loaders cast every tensor to the model's dtype on the way in: an int8 (quantized)
    tensor, cast, would load as garbage weights; it is refused by name before the cast."""
    import importlib

    from safetensors.torch import save_file
    weights = importlib.import_module(f"photon_core.models.{family}.weights")
    path = tmp_path / "model.safetensors"
    save_file({"vision.patch_emb.weight": torch.ones(4, 3, dtype=torch.int8),
               "text.wte": torch.ones(8, 4, dtype=torch.bfloat16)}, str(path))
    with pytest.raises(ValueError, match=r"not floating point \['vision.patch_emb.weight'\]"):
        weights.load_tensors(path, torch.float32)
