"""Dynamic-int8 linears for Whisper on CPU: the product against float32 on fresh random inputs,
which paths may take it, and real tiny.en speech transcribed as well as the exact path does
(the broad-set WER that decides the default is bench/speech.py's)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import types

from photon_core.backends import reference
from photon_core.models.whisper import load_whisper
from photon_core.models.whisper.model import _Linear, linear, quantize_int8_
from photon_core.models.whisper.transcribe import CPU_DEFAULT_QUANTIZE, pick_quantize

from whisper_fixtures import SENTENCES, espeak

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from wer import wer  # noqa: E402


@pytest.mark.parametrize("activation,residual", [(None, False), ("gelu", True)])
def test_int8_product_tracks_float32(activation, residual):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 50, 96, generator=g)
    w = _Linear(torch.randn(160, 96, generator=g) / 10, torch.randn(160, generator=g))
    res = torch.randn(2, 50, 160, generator=g) if residual else None
    want = reference.linear(x, w.weight, w.bias, activation=activation, residual=res)
    quantize_int8_(w)
    got = linear(reference, x, w, activation=activation, residual=res)
    assert got.shape == want.shape
    # 8-bit weights per output channel and 7-8-bit activations per call: about 1% of the signal
    assert ((got - want).norm() / want.norm()).item() < 0.03
    w.int8 = None
    assert torch.equal(linear(reference, x, w, activation=activation, residual=res), want)


def test_who_gets_int8():
    cpu = torch.device("cpu")
    # any other ops module (importing the Triton backend here would fix its interpreter mode for
    # the test modules collected after this one)
    triton_ops = types.ModuleType("photon_core.backends.triton")
    assert pick_quantize(cpu, None, reference, "auto") == CPU_DEFAULT_QUANTIZE
    assert pick_quantize(cpu, "float32", reference, "auto") is None        # the exact path, asked for
    assert pick_quantize(cpu, None, triton_ops, "auto") is None
    assert pick_quantize(cpu, None, reference, "int8") == "int8"
    with pytest.raises(ValueError, match="CPU path of the reference backend"):
        pick_quantize(cpu, None, triton_ops, "int8-decoder")
    with pytest.raises(ValueError, match="unknown quantize"):
        pick_quantize(cpu, None, reference, "int4")


def test_int8_decoder_transcribes_real_speech_as_well_as_float32():
    exact = load_whisper("whisper-tiny.en", dtype="float32")
    fast = load_whisper("whisper-tiny.en", quantize="int8-decoder")
    assert exact.quantize is None and fast.quantize == "int8-decoder"
    assert fast.net.w.lm_head.int8 is not None and fast.net.w.enc_blocks[0].qkv.int8 is None
    refs, got, want = [], [], []
    for key in ("short", "medium"):
        text, speed = SENTENCES[key]
        pcm, rate = espeak(text, speed)
        refs.append(text)
        want.append(exact.transcribe(pcm, rate)["text"])
        got.append(fast.transcribe(pcm, rate)["text"])
    assert wer(refs, got) <= wer(refs, want) + 0.05, (got, want)
