"""Qwen3-ASR on audio longer than its decoding context holds: cut into chunks at quiet points
(runtime.audio_chunks, as Parakeet's), every chunk transcribed as its own prompt, the chunk
length derived from the context (the megakernel's max_len), a clip that fits one chunk decoded
exactly as before, and a prompt that leaves no room for audio refused plainly before any model
work. The megakernel needs a GPU; here a stand-in keeps its context check and refusal and
decodes on the reference path, with a small max_len so short clips need several chunks."""
from __future__ import annotations

import numpy as np
import pytest

from test_qwen3_asr_reference import ours, speech, tiny_checkpoint

from photon_core.models.qwen3_asr import Qwen3ASRSpeech

SR = 16000


def _direct(model: Qwen3ASRSpeech, pcm: np.ndarray, language: str | None, max_new: int | None = None):
    """The whole clip as one prompt, greedy (what transcribe did for every clip before chunking):
    (ids, parsed text)."""
    mel, frames = model.features(pcm)
    audio = model.encode(mel, frames)
    ids = model.prompt_ids(audio.shape[0], language, None)
    budget = max_new or max(32, int(12 * len(pcm) / SR))
    out = model.generate([model.prompt_embeds(ids, audio)], budget)[0]
    return out, model.prompt.parse(out, language)[0]


class _Megakernel:
    """MegakernelDecode's face on the CPU: its context (max_len) and its refusal of a prompt plus
    budget that does not fit (prompt + max(n, 1) - 1 > max_len), then the reference decode."""

    def __init__(self, max_len: int) -> None:
        self.max_len, self.reference, self.positions = max_len, ours(), []

    def generate(self, prompts, max_new_tokens, stop):
        budgets = [max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int) else list(max_new_tokens)
        for p, n in zip(prompts, budgets):
            need = p.shape[0] + max(n, 1) - 1
            if need > self.max_len:
                raise ValueError(f"a prompt of {p.shape[0]} tokens plus {n} new ones exceeds the megakernel's "
                                 f"context of {self.max_len} positions")
            self.positions.append(need)
        return self.reference.generate(prompts, budgets)


def _on_megakernel(max_len: int) -> Qwen3ASRSpeech:
    model = Qwen3ASRSpeech(tiny_checkpoint(False))
    model.megakernel = _Megakernel(max_len)
    return model


def _long(repeats: int) -> np.ndarray:
    return np.concatenate([speech()] * repeats)


def _check_segments(result: dict, bounds: list[tuple[int, int]]) -> None:
    segs = result["segments"]
    assert " ".join(s["text"] for s in segs) == result["text"]
    assert [(s["start"], s["end"]) for s in segs] == [(round(a / SR, 3), round(b / SR, 3)) for a, b in bounds]
    assert all(0 <= s["start"] < s["end"] <= result["duration"] + 1e-9 for s in segs)
    assert all(s0["end"] <= s1["start"] for s0, s1 in zip(segs, segs[1:]))


def test_audio_tokens_count_what_the_encoder_makes():
    model = ours()
    for samples in (1000, 8000, 16000, 2 * SR + 4567, 3 * SR + 40):
        mel, frames = model.features(np.full(samples, 0.01, np.float32))
        assert model.audio_tokens(samples) == model.encode(mel, frames).shape[0], samples


def test_long_audio_on_the_megakernel_context_is_chunked_not_refused():
    """12 s of speech is one prompt of ~175 tokens plus a budget of 144 against a context of 96:
    refused as one prompt; in chunks each fits, and every chunk is transcribed as its own
    prompt would be."""
    model = _on_megakernel(96)
    pcm = _long(4)
    result = model.transcribe(pcm, SR, language="en")
    bounds = model.plan(pcm, "en", None, None)
    assert bounds is not None and len(bounds) >= 3
    assert bounds[0][0] == 0 and bounds[-1][1] == len(pcm) and all(b0[1] == b1[0] for b0, b1 in zip(bounds, bounds[1:]))
    stand_in = model.megakernel
    assert isinstance(stand_in, _Megakernel)
    assert len(stand_in.positions) == len(bounds)                    # every chunk decoded, none refused
    assert max(stand_in.positions) <= 96 and min(stand_in.positions) > 96 // 2   # and the context used well
    assert [s["text"] for s in result["segments"]] == [_direct(ours(), pcm[a:b], "en")[1] for a, b in bounds]
    _check_segments(result, bounds)
    assert result["text"] and result["language"] == "en" and result["no_speech_prob"] == 0.0


def test_chunk_length_is_derived_from_the_context():
    """The longest chunk whose prompt (fixed tokens + audio tokens) plus budget fits the context:
    about 76 s at the default 2048 positions (13 audio tokens + 12 of budget a second), so a clip
    the single prompt refused past ~80 s goes in two chunks; a given max_new_tokens is per chunk."""
    for max_len, max_new in ((2048, None), (96, None), (96, 6), (300, 20)):
        model = _on_megakernel(max_len)
        seconds = model.chunk_seconds_for("en", None, max_new)
        samples = int(seconds * SR)
        fixed = len(model.prompt_ids(0, "en", None))
        budget = max_new or max(32, int(12 * seconds))
        need = fixed + model.audio_tokens(samples) + budget - 1
        assert need <= max_len, (max_len, max_new, seconds, need)
        # ... and not far under it: one more second of audio and its budget would not fit the spare
        assert need + 13 + (0 if max_new else 12) > max_len - max_len // 16, (max_len, max_new, seconds, need)
    assert 70 < _on_megakernel(2048).chunk_seconds_for("en", None, None) < 80
    assert ours().context == 2048 and 70 < ours().chunk_seconds_for("en", None, None) < 80
    # the constructor's chunk_seconds wins when shorter, never when longer
    assert Qwen3ASRSpeech(tiny_checkpoint(False), chunk_seconds=2.0).chunk_seconds_for("en", None, None) == 2.0
    assert Qwen3ASRSpeech(tiny_checkpoint(False), chunk_seconds=500).chunk_seconds_for("en", None, None) < 80


def test_a_clip_that_fits_one_chunk_is_one_prompt_as_before_and_a_longer_one_is_chunked():
    from photon_core.models.qwen3_asr import load_qwen3_asr

    model = load_qwen3_asr(tiny_checkpoint(False), backend="reference", chunk_seconds=2.0)
    short = speech("Stop.")
    assert len(short) < 2 * SR and model.plan(short, "en", None, None) == [(0, len(short))]
    got = model.transcribe(short, SR, language="en")
    assert got["text"] == _direct(model, short, "en")[1] and got["text"]
    assert got["segments"] == [{"start": 0.0, "end": round(len(short) / SR, 3), "text": got["text"]}]
    # the default chunk (~76 s) holds the usual test clip: the same text as the one prompt
    ids, text = _direct(ours(), speech(), "en")
    assert ours().transcribe(speech(), SR, language="en")["text"] == text and len(set(ids)) > 3
    # longer than a chunk: every chunk transcribed alone, joined, one segment each
    pcm = _long(2)
    bounds = model.plan(pcm, "en", None, 8)
    assert bounds is not None and len(bounds) >= 3 and all(b - a <= 2 * SR for a, b in bounds)
    result = model.transcribe(pcm, SR, language="en", max_new_tokens=8)
    assert [s["text"] for s in result["segments"]] == [_direct(model, pcm[a:b], "en", 8)[1] for a, b in bounds]
    _check_segments(result, bounds)
    # a batch with a long and a short clip: each as alone
    both = model.transcribe_batch([(pcm, SR), (short, SR)], language="en", max_new_tokens=8)
    assert [r["text"] for r in both] == [result["text"], model.transcribe(short, SR, language="en",
                                                                          max_new_tokens=8)["text"]]


def test_silent_chunks_of_long_audio_are_skipped():
    model = Qwen3ASRSpeech(tiny_checkpoint(False), chunk_seconds=2.0)
    pcm = np.concatenate([speech(), np.zeros(5 * SR, np.float32), speech()])
    bounds = model.plan(pcm, "en", None, 4)
    gap = (len(speech()) / SR, len(speech()) / SR + 5)
    assert bounds and not [(a, b) for a, b in bounds if gap[0] + 0.5 <= a / SR and b / SR <= gap[1] - 0.5]
    result = model.transcribe(pcm, SR, language="en", max_new_tokens=4)
    assert result["text"] and not [s for s in result["segments"] if gap[0] + 0.5 <= s["start"] and s["end"] <= gap[1]]
    assert any(s["end"] <= gap[0] + 0.5 for s in result["segments"]) and result["segments"][-1]["start"] >= gap[1] - 2


@pytest.mark.parametrize("kwargs", [{"initial_prompt": "turn on the kitchen lights please " * 12},
                                    {"max_new_tokens": 90}])
def test_a_prompt_that_leaves_no_room_for_audio_is_a_clear_error(kwargs):
    """Chunking cannot help when the prompt (initial_prompt) or each chunk's budget alone nearly
    fills the context: refused with what to change, before any model work."""
    model = _on_megakernel(96)
    stand_in = model.megakernel
    with pytest.raises(ValueError, match=r"cannot fit even 1 s of audio in its decoding context of 96"):
        model.transcribe(speech(), SR, language="en", **kwargs)
    with pytest.raises(ValueError, match="cannot fit even"):   # a batch: before any model work
        model.batch([{"audio": speech(), "language": "en"}, {"audio": speech(), "language": "en", **kwargs}])
    assert isinstance(stand_in, _Megakernel) and stand_in.positions == []


def test_registry_loaded_model_chunks_to_the_megakernel_default():
    """The registry loads with the default max_len: the derived chunk fits that context."""
    import photon_core
    from photon_core.models.qwen3_asr.megakernel_decode import DEFAULT_MAX_LEN

    model = photon_core.load(tiny_checkpoint(False), backend="reference", skills=("transcribe",))
    assert model.context == DEFAULT_MAX_LEN == 2048
    seconds = model.chunk_seconds_for(None, None, None)
    need = len(model.prompt_ids(0, None, None)) + model.audio_tokens(int(seconds * SR)) + int(12 * seconds) - 1
    assert need <= DEFAULT_MAX_LEN


def test_a_clip_that_needs_no_chunking_takes_any_budget_its_backend_can():
    """Chunk sizing (the decode context less its spare) applies only where a clip must be cut: a
    short clip with a budget over the chunking context, on a backend whose positions allow it,
    decodes as one prompt, as before chunking existed (it was refused)."""
    model = Qwen3ASRSpeech(tiny_checkpoint(False))
    assert model.position_limit > model.context
    budget = model.context + 100
    result = model.transcribe(speech(), SR, language="en", max_new_tokens=budget)
    assert result["text"] == _direct(model, speech(), "en", budget)[1]
