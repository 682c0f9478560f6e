"""int8 linears for Whisper on CPU: the product against float32 and against the same integer
math in float64 on fresh random inputs, rows independent of each other,
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
from photon_core.models.whisper.model import (_Linear, cpu_has_vnni, int8_matmul, linear,
                                               pack_dynamic_int8_, quantize_int8_)
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
    # 8-bit weights per output channel and 8-bit activations per row: about 1% of the signal
    assert ((got - want).norm() / want.norm()).item() < 0.03
    w.int8 = None
    assert torch.equal(linear(reference, x, w, activation=activation, residual=res), want)


def test_int8_kernel_equals_integer_math_and_rows_are_independent():
    """torch._int_mm (int8 x int8 -> int32, VNNI on this CPU) against the same quantized values
    multiplied in float64; then a batch of rows against each row alone, bit for bit."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(37, 200, generator=g) * torch.logspace(-2, 2, 37)[:, None]   # rows of very different scale
    x[3] = 0.0
    w = _Linear(torch.randn(72, 200, generator=g) / 10, torch.randn(72, generator=g))
    quantize_int8_(w)
    q = w.int8
    s = x.abs().amax(1, keepdim=True).clamp_min(1e-12) / 127
    xi = (x / s).round()
    assert xi.abs().max() <= 127 and q.weight_t.dtype == torch.int8
    want = (xi.double() @ q.weight_t.double()) * (s.double() * q.scale.double()) + q.bias.double()
    got = int8_matmul(x, q)
    assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-6)
    assert torch.equal(got[3], q.bias)
    for i in (0, 3, 20, 36):
        assert torch.equal(int8_matmul(x[i:i + 1], q)[0], got[i])


def test_dynamic_int8_batch_of_sequences_equals_each_alone():
    """fbgemm's activation scale is per call: sequences of a batch go one call each, so batching
    clips leaves every clip's decoder numbers as they are alone (and near float32)."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(3, 5, 96, generator=g) * torch.tensor([0.1, 1.0, 30.0])[:, None, None]
    w = _Linear(torch.randn(160, 96, generator=g) / 10, torch.randn(160, generator=g))
    want = reference.linear(x, w.weight, w.bias)
    pack_dynamic_int8_(w)
    got = linear(reference, x, w)
    for i in range(3):
        assert torch.equal(got[i], linear(reference, x[i:i + 1], w)[0])
        assert ((got[i] - want[i]).norm() / want[i].norm()).item() < 0.03


def test_our_vnni_reading_agrees_with_torchs():
    """Without AVX-512 VNNI fbgemm quantizes activations to 7 bits and the int8 decoder fails the
    accuracy rule, so model.REDUCE_RANGE and transcribe.CPU_DEFAULT_QUANTIZE follow our reading of
    the CPU's flags: it agrees with torch's own (cpuinfo's) VNNI detection."""
    assert cpu_has_vnni() == torch.cpu._is_vnni_supported()


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


@pytest.mark.parametrize("quantize", ["int8-decoder", "int8"])
def test_int8_transcribes_real_speech_as_well_as_float32(quantize):
    """Either int8 path, asked for by name, on any CPU (the default's is one of them or none)."""
    exact = load_whisper("whisper-tiny.en", dtype="float32")
    fast = load_whisper("whisper-tiny.en", quantize=quantize)
    assert exact.quantize is None and fast.quantize == quantize
    w = fast.net.w
    assert w.lm_head.int8 is not None and w.conv1.int8 is None and w.conv2.int8 is None
    assert (w.enc_blocks[0].qkv.int8 is not None) == (fast.quantize == "int8")
    refs, got, want = [], [], []
    for key in ("short", "medium"):
        text, speed = SENTENCES[key]
        pcm, rate = espeak(text, speed)
        refs.append(text)
        want.append(exact.transcribe(pcm, rate)["text"])
        got.append(fast.transcribe(pcm, rate)["text"])
    assert wer(refs, got) <= wer(refs, want) + 0.05, (got, want)
