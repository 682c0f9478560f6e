"""Temperature fallback and window skipping rules, with a scripted decoder (no model needed)."""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from photon_core.backends import reference
from photon_core.models.whisper.decoding import DecodeOptions, DecodeResult, TokenChooser, compression_ratio
from photon_core.models.whisper.longform import LongFormOptions, decode_with_fallback
from photon_core.runtime.sampling import NonFiniteLogits


class ScriptedDecoder:
    """Returns a prepared result per temperature and records the temperatures tried."""

    def __init__(self, results: dict[float, tuple[str, float, float]]):
        self.results = results
        self.tried: list[float] = []

    def decode(self, features, options: DecodeOptions, cross=None) -> DecodeResult:
        self.tried.append(options.temperature)
        text, logprob, no_speech = self.results[options.temperature]
        return DecodeResult([1, 2], text, logprob, no_speech, options.temperature,
                            compression_ratio(text))


LOOP = "the the the the the the the the the the the the the the the the the the the the"


def test_compression_ratio_flags_loops():
    assert compression_ratio(LOOP) > 2.4
    assert compression_ratio("Please move the robot arm to the left side of the table.") < 2.4


def test_repetition_loop_falls_back_to_higher_temperature():
    dec = ScriptedDecoder({0.0: (LOOP, -0.2, 0.1), 0.2: ("turn on the lights", -0.3, 0.1)})
    result = decode_with_fallback(dec, None, DecodeOptions(), LongFormOptions())
    assert dec.tried == [0.0, 0.2] and result.text == "turn on the lights"


def test_low_logprob_falls_back_and_keeps_last_when_all_fail():
    temps = LongFormOptions().temperatures
    dec = ScriptedDecoder({t: ("mumble", -2.0, 0.1) for t in temps})
    result = decode_with_fallback(dec, None, DecodeOptions(), LongFormOptions())
    assert dec.tried == list(temps) and result.temperature == temps[-1]


def test_silence_stops_fallback_immediately():
    dec = ScriptedDecoder({0.0: ("you", -1.5, 0.95)})
    result = decode_with_fallback(dec, None, DecodeOptions(), LongFormOptions())
    assert dec.tried == [0.0] and result.no_speech_prob == 0.95


def test_single_temperature_never_retries():
    dec = ScriptedDecoder({0.0: (LOOP, -3.0, 0.1)})
    decode_with_fallback(dec, None, DecodeOptions(), LongFormOptions(temperatures=(0.0,)))
    assert dec.tried == [0.0]


def _chooser(temperature: float, barred: tuple[int, ...] = ()) -> TokenChooser:
    """A TokenChooser on a stand-in decoder whose only logit rule suppresses `barred`."""
    def rules(logits: torch.Tensor, sampled: list[int], timestamps: bool) -> None:
        logits[list(barred)] = float("-inf")

    dec = SimpleNamespace(_apply_rules=rules, net=SimpleNamespace(ops=reference), tok=SimpleNamespace(eot=9))
    return TokenChooser(dec, 1, False, temperature, torch.Generator().manual_seed(0))


def test_a_temperature_below_greedy_below_takes_the_argmax():
    """1e-40 passes the temperature checks; logits / 1e-40 overflow float32 (NaN softmax), so it is
    the argmax, as Sampling.greedy reads it."""
    c = _chooser(1e-40)
    assert c(0, torch.tensor([1.0, 3.0, 2.0]), None) == 1
    assert c.sampled == [[1]] and math.isfinite(c.sum_logprob[0])


def test_positive_infinite_logits_are_refused_when_sampling():
    with pytest.raises(NonFiniteLogits):
        _chooser(0.5)(0, torch.tensor([1.0, float("inf"), 2.0]), None)


def test_a_suppressed_tokens_infinity_is_never_drawn():
    c = _chooser(0.5, barred=(1,))
    assert c(0, torch.tensor([1.0, float("inf"), 2.0]), None) in (0, 2)
