"""Qwen3-ASR checkpoints whose tensors do not match their config.json: each is a ValueError at load
naming the checkpoint and the tensor, not a KeyError from inside the encoder, a shape error in the
middle of a transcription, or a model that loads and transcribes with the wrong weights."""
from __future__ import annotations

import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from test_qwen3_asr_reference import tiny_checkpoint


def _variant(tmp_path, change):
    folder = tmp_path / "variant"
    shutil.copytree(tiny_checkpoint(), folder)
    tensors = {k: v.clone() for k, v in load_file(folder / "model.safetensors").items()}
    change(tensors)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def _deeper(tensors):
    """A third decoder layer where the config says two."""
    for name, t in list(tensors.items()):
        if name.startswith("model.language_model.layers.1."):
            tensors[name.replace(".layers.1.", ".layers.2.")] = t.clone()


@pytest.mark.parametrize("change, said", [
    (lambda t: t.pop("model.audio_tower.layers.1.fc1.weight"), r"missing \['audio_tower.layers.1.fc1.weight'\]"),
    (lambda t: t.__setitem__("model.language_model.layers.1.mlp.down_proj.weight", torch.zeros(48, 80)),
     r"wrong shapes \['language_model.layers.1.mlp.down_proj.weight \(48, 80\) != \(48, 96\)'\]"),
    (lambda t: t.__setitem__("model.language_model.layers.0.mlp.up_proj.weight", torch.zeros(96, 48, dtype=torch.int8)),
     r"not floating point \['language_model.layers.0.mlp.up_proj.weight'\]"),
    (lambda t: t.__setitem__("lm_head.weight", torch.zeros(320, 48)), r"lm_head.weight \(320, 48\) != \(330, 48\)"),
    (_deeper, r"layers beyond the config's count \['language_model.layers.2."),
], ids=["missing", "shape", "integer", "lm_head", "deeper"])
def test_tensors_that_do_not_match_the_config_are_refused_at_load(tmp_path, change, said):
    from photon_core.models.qwen3_asr import load_qwen3_asr

    folder = _variant(tmp_path, change)
    with pytest.raises(ValueError, match="the tensors do not match the Qwen3-ASR config") as err:
        load_qwen3_asr(folder)
    assert str(err.value).startswith(str(folder))
    assert re.search(said, str(err.value)), str(err.value)
