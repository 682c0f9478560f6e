"""Every family's loaded model meets photon_core.contracts: the protocols of its declared skills, and
results of the documented shapes from the single calls and from batch(), on each family's tiny
test checkpoint loaded through photon_core.load (the path the nodes and the CLI take)."""
from __future__ import annotations

import inspect

from pathlib import Path
from typing import Callable

import numpy as np
import pytest

import photon_core
from photon_core import contracts, registry
from photon_core.runtime.requests import Request, TranscribeRequest


def _moondream(tmp: Path) -> Path:
    from moondream_fixtures import checkpoint
    return checkpoint()


def _moondream3(tmp: Path) -> Path:
    import test_moondream3_checkpoints as ck
    # One MoE layer, not the fixture's two: the image prefill through the reference MoE is most of the time.
    return ck.write_checkpoint(tmp / "moondream3", "safetensors", config=ck.md3_config(text_layers=2))[0]


def _qwen3_5(tmp: Path) -> Path:
    from test_qwen3_5_fixtures import build
    build(tmp / "qwen3_5")
    return tmp / "qwen3_5"


def _gemma4(tmp: Path) -> Path:
    from test_gemma4_fixtures import build_hf, save_checkpoint
    return save_checkpoint(build_hf(), tmp / "gemma4")


def _whisper(tmp: Path) -> Path:
    from whisper_fixtures import tiny_en_path
    return tiny_en_path()


def _parakeet(tmp: Path) -> Path:
    from parakeet_fixtures import hf_checkpoint
    return hf_checkpoint()


def _qwen3_asr(tmp: Path) -> Path:
    from test_qwen3_asr_reference import tiny_checkpoint
    return tiny_checkpoint()


CHECKPOINTS: dict[str, Callable[[Path], Path]] = {
    "moondream": _moondream, "moondream3": _moondream3, "qwen3_5": _qwen3_5, "gemma4": _gemma4,
    "whisper": _whisper, "parakeet": _parakeet, "qwen3_asr": _qwen3_asr}
VISION = ["moondream", "moondream3", "qwen3_5", "gemma4"]
SPEECH = ["whisper", "parakeet", "qwen3_asr"]


def test_every_family_is_checked_here():
    assert {f.name for f in registry.families()} <= set(CHECKPOINTS)
    assert set(VISION) | set(SPEECH) == set(CHECKPOINTS)


def _loaded(name: str, tmp: Path):
    found = registry.recognise(CHECKPOINTS[name](tmp))
    assert found.family.name == name
    return found.family, photon_core.load(found.checkpoint.path)


def _image() -> np.ndarray:
    return np.random.default_rng(0).integers(0, 256, (48, 64, 3), dtype=np.uint8)


@pytest.mark.parametrize("name", VISION)
def test_vision_family_meets_the_contract(name, tmp_path):
    family, model = _loaded(name, tmp_path)
    model = contracts.check_model(model, family.skills)
    assert isinstance(model, contracts.VisionModel) and not isinstance(model, contracts.SpeechModel)
    for skill, protocol in contracts.SKILL_PROTOCOLS.items():   # no more and no fewer skills than declared
        assert isinstance(model, protocol) == (skill in family.skills), skill
    assert isinstance(model.model_id, str) and model.model_id
    enc = model.encode_image(_image())
    assert model.encode_image(enc) is enc
    # caption and query have the contract's signature in every family (names, order, defaults; a
    # family may add keywords after them), so one call runs on any of them.
    for skill in sorted(family.skills & {"caption", "query"}):
        want = list(inspect.signature(getattr(contracts.SKILL_PROTOCOLS[skill], skill)).parameters.values())[1:]
        got = list(inspect.signature(getattr(model, skill)).parameters.values())[:len(want)]
        assert [(p.name, p.default) for p in got] == [(p.name, p.default) for p in want], skill
    # Every family takes the reference's `settings` dicts.
    text = {"max_tokens": 3, "temperature": 0}
    calls = {"caption": lambda: model.caption(enc, length="short", settings=text),
             "query": lambda: model.query(enc, "what is this?", settings=text),
             "detect": lambda: model.detect(enc, "cup", settings={"max_objects": 2}),
             "point": lambda: model.point(enc, "cup", settings={"max_objects": 2}),
             "segment": lambda: model.segment(enc, "cup", settings={"max_tokens": 4})}
    for skill in sorted(family.skills):
        contracts.check_result(skill, calls[skill]())
    # batch: any mix of the family's batchable skills, results in order with the single calls' shapes
    prompts = {"caption": "short", "query": "what is this?", "detect": "cup", "point": "cup"}
    tasks = sorted(family.skills & set(prompts))
    requests = [Request(t, enc, prompts[t], max_objects=2, max_tokens=3) for t in tasks]
    results = model.batch(requests)
    assert len(results) == len(requests)
    for task, result in zip(tasks, results):
        contracts.check_result(task, result)
    assert model.batch([]) == []
    with pytest.raises(ValueError):
        model.caption(enc, length="enormous")


def _speech() -> np.ndarray:
    t = np.arange(16_000) / 16_000   # a tone in bursts: past every family's speech gate
    return (0.3 * np.sin(2 * np.pi * 180 * t) * (np.sin(2 * np.pi * 3 * t) > 0)).astype(np.float32)


@pytest.mark.parametrize("name", SPEECH)
def test_speech_family_meets_the_contract(name, tmp_path):
    family, model = _loaded(name, tmp_path)
    model = contracts.check_model(model, family.skills)
    assert isinstance(model, contracts.SpeechModel) and not isinstance(model, contracts.VisionModel)
    assert isinstance(model.model_id, str) and model.model_id
    clip = _speech()
    one = model.transcribe(clip, 16_000, language="en", initial_prompt=None)
    contracts.check_result("transcribe", one)
    assert one["duration"] == pytest.approx(1.0)
    # batch takes TranscribeRequest (and the older dicts); result i is transcribe(**requests[i].kwargs())
    asked = [TranscribeRequest(clip, 16_000, "en"), TranscribeRequest(np.zeros(8_000, np.float32), 16_000, "en"),
             {"audio": clip, "sample_rate": 16_000, "language": "en"}]
    results = model.batch(asked)
    for result in results:
        contracts.check_result("transcribe", result)
    assert [r["duration"] for r in results] == pytest.approx([1.0, 0.5, 1.0])
    assert results[0]["text"] == results[2]["text"] == one["text"]
    with pytest.raises(ValueError):
        model.batch([TranscribeRequest(np.zeros(0, np.float32), 16_000)])


def test_check_result_refuses_wrong_shapes():
    good = {"objects": [{"x_min": 0.1, "y_min": 0.2, "x_max": 0.3, "y_max": 0.4, "score": 0.9}]}
    contracts.check_result("detect", good)
    for bad in ({}, {"objects": [{"x_min": 0.5, "y_min": 0.2, "x_max": 0.3, "y_max": 0.4, "score": 0.9}]},
                {"objects": [{"x": 0.1, "y": 0.2, "score": 0.9}]}, {"objects": [], "extra": 1}):
        with pytest.raises(contracts.ContractError):
            contracts.check_result("detect", bad)
    with pytest.raises(contracts.ContractError):
        contracts.check_result("transcribe", {"text": "hi"})
    # segment's error (words that were no path) is part of its contract: an empty path, the box kept
    box = {"x_min": 0.1, "y_min": 0.2, "x_max": 0.3, "y_max": 0.4}
    contracts.check_result("segment", {"path": "", "bbox": box, "error": "unexpected SVG path token"})
    for bad in ({"path": "M 0 0", "bbox": box, "error": "x"}, {"path": "", "bbox": box, "error": 3}):
        with pytest.raises(contracts.ContractError):
            contracts.check_result("segment", bad)


def test_transcribe_request_from_a_dict():
    r = TranscribeRequest.of({"audio": [0.0], "sample_rate": 8000, "timestamps": False})
    assert (r.sample_rate, r.language, r.options) == (8000, None, {"timestamps": False})
    assert r.kwargs() == {"audio": [0.0], "sample_rate": 8000, "language": None, "initial_prompt": None,
                          "timestamps": False}
    with pytest.raises(TypeError, match="audio"):
        TranscribeRequest.of({"sample_rate": 8000})
