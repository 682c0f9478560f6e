"""Edge inputs of the shared runtime (photon_core/runtime): token choice on rows with no token
left, audio sample rates no recording has, and settings that skip or wrongly fail their checks."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from photon_core.backends import reference
from photon_core.runtime import chat_messages
from photon_core.runtime.audio_frontend import MAX_INPUT_RATE, MIN_INPUT_RATE, prepare_audio
from photon_core.runtime.requests import Settings
from photon_core.runtime.sampling import NonFiniteLogits, Sampling, pick

NINF, INF = float("-inf"), float("inf")


# --- sampling.pick -------------------------------------------------------------------------------
@pytest.mark.parametrize("s", [Sampling(1), Sampling(1, 0.7, 1.0), Sampling(1, 0.7, 0.3)],
                         ids=["greedy", "sampled", "nucleus"])
def test_a_row_with_no_token_left_is_refused_not_given_token_0(s):
    """Every logit -inf, or every finite one barred: the ops' argmax and draw return token 0,
    which `allowed` may bar (an image placeholder, an answer marker) and nobody checked."""
    gen = torch.Generator().manual_seed(0)
    with pytest.raises(NonFiniteLogits, match="-inf"):
        pick(torch.full((5,), NINF), s, reference, generator=gen)
    logits = torch.tensor([3.0, NINF, NINF, 2.0])
    with pytest.raises(NonFiniteLogits, match="-inf"):
        pick(logits, s, reference, torch.tensor([False, True, True, False]), gen)
    # one finite allowed token left: that one, however it is chosen
    assert pick(logits, s, reference, torch.tensor([False, True, True, True]), gen) == 3


def test_a_barred_tokens_plus_infinity_does_not_refuse_a_sampled_row():
    logits = torch.tensor([1.0, INF, 0.5, 2.0])
    allowed = torch.tensor([True, False, True, True])
    s = Sampling(1, 0.7, 1.0)
    draws = {pick(logits, s, reference, allowed, torch.Generator().manual_seed(i)) for i in range(50)}
    assert draws <= {0, 2, 3} and 3 in draws
    with pytest.raises(NonFiniteLogits, match=r"\+inf"):   # allowed, it still is refused
        pick(logits, s, reference, None, torch.Generator().manual_seed(0))
    with pytest.raises(NonFiniteLogits, match="NaN"):      # a NaN anywhere, barred or not, as before
        pick(torch.tensor([1.0, float("nan"), 0.5]), s, reference, torch.tensor([True, False, True]))


# --- audio_frontend.prepare_audio ---------------------------------------------------------------
@pytest.mark.parametrize("rate", [MAX_INPUT_RATE + 1, 2_000_003, MIN_INPUT_RATE - 1, 1])
def test_a_sample_rate_no_recording_has_is_refused_before_resampling(rate, monkeypatch):
    """A rate prime to 16 kHz asks resample_poly for a filter of ~20x the rate taps: 2,000,003 Hz
    took 12 s for 1000 samples, 99,999,989 Hz (2e10 taps) had the process killed for its memory.
    Refused before any resampling: a resampler reached here fails the test (not a time limit)."""
    import scipy.signal

    from photon_core.runtime import audio_frontend

    def reached(*args, **kwargs):
        raise AssertionError(f"resampled audio declared at {rate} Hz instead of refusing it")
    monkeypatch.setattr(audio_frontend, "resample", reached)
    monkeypatch.setattr(scipy.signal, "resample_poly", reached)
    with pytest.raises(ValueError, match="sample_rate"):
        prepare_audio(np.zeros(1000, np.float32), rate)


def test_the_input_rate_bounds_themselves_are_taken():
    assert len(prepare_audio(np.zeros(480, np.float32), MAX_INPUT_RATE)) == 10
    assert len(prepare_audio(np.zeros(10, np.float32), MIN_INPUT_RATE)) == 160


# --- chat_messages.sampling ---------------------------------------------------------------------
def test_chat_settings_take_variant_none_and_refuse_a_non_mapping():
    s = chat_messages.sampling({"variant": None, "max_tokens": 7})
    assert (s.max_tokens, s.temperature, s.top_p) == (7, 0.0, 1.0)
    with pytest.raises(NotImplementedError, match="variants"):
        chat_messages.sampling({"variant": "base/ft@3"})
    for bad in ("max_tokens", [("max_tokens", 7)]):
        with pytest.raises(TypeError, match="must be a dict"):
            chat_messages.sampling(bad)  # type: ignore[arg-type]


# --- requests.Settings.of -----------------------------------------------------------------------
def test_a_settings_object_built_directly_is_checked_as_its_dict_is():
    ok = Settings(temperature=0.0, max_tokens=3)
    assert Settings.of(ok) == ok
    with pytest.raises(ValueError, match="max_objects must be >= 0"):
        Settings.of(Settings(max_objects=-1))
    with pytest.raises(ValueError, match="temperature"):
        Settings.of(Settings(temperature=float("nan")))
    with pytest.raises(TypeError, match="max_tokens"):
        Settings.of(Settings(max_tokens=True))


def test_numpy_scalars_are_numbers_and_come_back_as_pythons():
    """np.float64 (a float subclass) was taken and np.float32 / np.int64 (an array's elements)
    refused as "must be a number" / "must be an int"; numpy's booleans stay refused."""
    s = Settings.of({"temperature": np.float32(0.25), "top_p": np.float16(0.5), "max_tokens": np.int64(5),
                     "max_objects": np.uint8(3)})
    assert s == Settings(temperature=0.25, top_p=0.5, max_tokens=5, max_objects=3)
    assert [type(v) for v in (s.temperature, s.top_p, s.max_tokens, s.max_objects)] == [float, float, int, int]
    for bad in ({"max_tokens": np.bool_(True)}, {"temperature": np.bool_(False)}, {"max_tokens": np.float64(5.0)}):
        with pytest.raises(TypeError, match=next(iter(bad))):
            Settings.of(bad)
    with pytest.raises(ValueError, match="max_tokens must be >= 0"):
        Settings.of({"max_tokens": np.int64(-1)})



def test_spatial_refs_of_numpy_scalars_are_numbers():
    """A detector's float32 box passed on as a tuple was refused as "every value must be a number
    in [0, 1]"; numpy's booleans and out-of-range values stay refused."""
    from photon_core.runtime.requests import check_spatial_refs
    box = tuple(np.array([0.25, 0.5, 0.75, 1.0], np.float32))
    assert check_spatial_refs([box, (np.float64(0.5), np.int64(1))]) == [(0.25, 0.5, 0.75, 1.0), (0.5, 1.0)]
    for bad in ([(np.bool_(True), 0.5)], [(np.float32("nan"), 0.5)], [(np.float32(1.5), 0.5)]):
        with pytest.raises(ValueError, match=r"spatial_refs\[0\]"):
            check_spatial_refs(bad)



def test_spatial_refs_as_an_array_are_refused_by_the_text_families_with_the_reason():
    """A detector's boxes as a numpy array, given to Qwen 3.5's or Gemma 4's query: `if spatial_refs`
    failed as numpy's "truth value of an array ... is ambiguous"; an empty array is no refs, as []."""
    from photon_core.runtime.text_settings import text_sampling
    for refs in (np.array([[0.1, 0.2, 0.3, 0.4]], np.float32), np.array([0.5, 0.5])):
        with pytest.raises(NotImplementedError, match="spatial_refs: Moondream's region encoder"):
            text_sampling("qwen3_5", None, spatial_refs=refs)
    assert text_sampling("qwen3_5", None, spatial_refs=np.zeros((0, 4))) == text_sampling("qwen3_5", None)

# --- decode.copy_prefilled_kv -------------------------------------------------------------------
def test_prefilled_kv_shorter_than_the_length_asked_is_refused_not_broadcast():
    """A source of 1 position with length 4: k[:, :, :4] is still 1 position, which torch
    broadcast over all 4 cache positions (the first position's keys copied into 3 others)."""
    from photon_core.runtime import decode
    views = {"kcache": torch.full((1, 2, 1, 8, 3), float("nan")), "vcache": torch.full((1, 2, 1, 8, 3), float("nan"))}
    step = type("Step", (), {"view": lambda self, name: views[name]})()
    kv = [(torch.ones(1, 1, 1, 3), torch.ones(1, 1, 1, 3))]
    with pytest.raises(ValueError, match="hold 1 positions; 4 were asked for"):
        decode.copy_prefilled_kv(step, ("kcache", "vcache"), kv, slice(0, 1), 4)
    assert views["kcache"].isnan().all()
    decode.copy_prefilled_kv(step, ("kcache", "vcache"), kv, slice(0, 1), 1)
    assert (views["kcache"][0, 0, :, :1] == 1).all() and views["kcache"][0, 0, :, 1:].isnan().all()
