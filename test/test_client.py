"""photon_core.client: the moondream client's local mode on Photon. A tiny random Moondream 2 checkpoint
and Whisper tiny.en through vl(local=True, model=...): each call's result has the client's shape
(moondream.types) and is the model's own result; streaming gives the same text; model names,
variants and the errors."""
from __future__ import annotations

import base64
import io
import inspect
import types
from dataclasses import dataclass

import numpy as np
import pytest
from PIL import Image

import moondream_fixtures as mdfx
import photon_core
from photon_core import client as md

# moondream.types, as key sets: (required, optional).
CAPTION = ({"caption"}, set())
QUERY = ({"answer"}, {"reasoning"})
REGION = {"x_min", "y_min", "x_max", "y_max"}


@dataclass
class Base64EncodedImage:   # moondream.types.Base64EncodedImage's shape
    image_url: str


def _keys(result: dict, shape: tuple[set, set]) -> None:
    required, optional = shape
    assert required <= set(result) <= required | optional, result


@pytest.fixture(scope="module")
def vision():
    return md.vl(local=True, model=str(mdfx.checkpoint()), device="cpu")


@pytest.fixture(scope="module")
def picture():
    return np.random.default_rng(3).integers(0, 256, (60, 80, 3), dtype=np.uint8)


def test_vision_calls_have_the_client_shapes_and_the_models_results(vision, picture):
    model = vision.model
    assert vision.model_id == model.model_id and vision.family == "moondream"
    assert set(vision.tasks) == {"caption", "query", "chat", "detect", "point"} and vision.supports("point")
    assert not vision.supports("segment") and not vision.supports("transcribe")

    enc = vision.encode_image(picture)   # the model's EncodedImage, reusable for every call below
    cap = vision.caption(enc, length="short", settings={"max_tokens": 6})
    _keys(cap, CAPTION)
    assert isinstance(cap["caption"], str)
    ans = vision.query(picture, "what is this?", settings={"max_tokens": 6})
    _keys(ans, QUERY)
    assert "reasoning" not in ans and isinstance(ans["answer"], str)
    thought = vision.query(enc, "what is this?", reasoning=True, settings={"max_tokens": 4})
    assert set(thought) == {"answer", "reasoning"} and set(thought["reasoning"]) == {"text", "grounding"}

    found = vision.detect(enc, "cup", settings={"max_objects": 2})
    assert set(found) == {"objects"} and 0 < len(found["objects"]) <= 2
    assert all(REGION <= set(o) for o in found["objects"])
    pts = vision.point(enc, "cup", settings={"max_objects": 3})
    assert set(pts) == {"points"} and 0 < len(pts["points"]) <= 3
    assert all({"x", "y"} <= set(p) for p in pts["points"])

    # The client hands the call to the model: the same results as calling it directly.
    direct = inspect.signature(model.detect).parameters
    kw = {"settings": {"max_objects": 2}} if "settings" in direct else {"max_objects": 2}
    assert found == model.detect(enc, "cup", **kw)
    assert vision.query(enc, "what is this?", settings={"max_tokens": 6}) == ans
    # The client's Base64EncodedImage (a data: URL) is read too.
    buf = io.BytesIO()
    Image.fromarray(picture).save(buf, format="PNG")
    b64 = Base64EncodedImage("data:image/png;base64," + base64.b64encode(buf.getvalue()).decode())
    assert vision.detect(b64, "cup", settings={"max_objects": 2}) == found


def test_streaming_gives_the_same_text(vision, picture):
    enc = vision.encode_image(picture)
    for call, key, args in ((vision.caption, "caption", (enc,)),
                            (vision.query, "answer", (enc, "what is this?"))):
        streamed = call(*args, stream=True, settings={"max_tokens": 8})
        assert set(streamed) == {key} and isinstance(streamed[key], types.GeneratorType)
        assert "".join(streamed[key]) == call(*args, settings={"max_tokens": 8})[key]


def test_moondream_chat(vision, picture):
    """Moondream's chat (moondream/chat.py) through the client: the model's reply, the client's shape."""
    messages = [{"role": "user", "content": [{"type": "image", "image": picture}, {"type": "text", "text": "hi"}]}]
    settings = {"temperature": 0, "max_tokens": 4}
    out = vision.chat(messages, settings=settings)
    assert out == vision.model.chat(messages, settings=settings)
    assert set(out) == {"message", "finish_reason"} and out["message"]["role"] == "assistant"
    assert "".join(vision.chat(messages, stream=True, settings=settings)["message"]) == out["message"]["content"]


def test_moondream3_segment_and_its_stream(monkeypatch):
    import test_moondream3_checkpoints as ck
    from segment_fixtures import DIAMOND_PATH, script_segment

    folder = ck.checkpoint("safetensors")[0]
    md3 = md.vl(local=True, model=str(folder), device="cpu")
    assert md3.family == "moondream3" and md3.supports("segment")
    picture = np.random.default_rng(4).integers(0, 256, (50, 70, 3), dtype=np.uint8)
    enc = md3.encode_image(picture)
    script_segment(monkeypatch, folder)
    out = md3.segment(enc, "cup", settings={"max_tokens": 40})
    assert set(out) == {"path", "bbox"} and out["path"] == DIAMOND_PATH and REGION == set(out["bbox"])
    updates = list(md3.segment(enc, "cup", stream=True, settings={"max_tokens": 40}))
    assert updates[0] == {"bbox": out["bbox"]}
    assert "".join(u["chunk"] for u in updates[1:-1]) == DIAMOND_PATH
    assert updates[-1] == {"path": DIAMOND_PATH, "bbox": out["bbox"], "completed": True}
    # words that are no path: the empty path comes with the reason, streamed or not
    script_segment(monkeypatch, folder, words=["480", "M", "480", "0", "L", "960", "480", "Z"])
    bad = md3.segment(enc, "cup", settings={"max_tokens": 40})
    assert bad["path"] == "" and "expected a command" in bad["error"], bad
    assert list(md3.segment(enc, "cup", stream=True, settings={"max_tokens": 40}))[-1]["error"] == bad["error"]


def test_calls_the_family_lacks_say_so(vision, picture):
    with pytest.raises(NotImplementedError, match="does not segment"):
        vision.segment(picture, "cup")
    with pytest.raises(NotImplementedError, match="does not transcribe"):
        vision.transcribe(audio=np.zeros(1600, np.float32))
    with pytest.raises(ValueError, match="question parameter is required"):
        vision.query(picture)
    with pytest.raises(ValueError, match="data: URL"):
        vision.caption(Base64EncodedImage("https://example.com/cat.jpg"))


def test_model_names_variants_and_factory_errors(vision, picture, monkeypatch):
    assert md.parse_model_name("moondream3.1-9B-A2B/01HXYZ@1000") == ("moondream3.1-9B-A2B", "01HXYZ@1000")
    assert md.parse_model_name("vikhyatk/moondream2") == ("vikhyatk/moondream2", None)
    # after a Moondream name the client reads a variant: one without @step is said to be malformed
    for malformed in ("moondream2/ft@x", "moondream2/ft_abc", "moondream2/ft@latest", "moondream2/@7"):
        with pytest.raises(ValueError, match=r"'moondream2/<finetune_id>@<step>'"):
            md.parse_model_name(malformed)
    assert md.parse_model_name("moondream3-preview") == ("moondream3-preview", None)
    assert md.parse_model_name("moondream3-preview/01HXYZ@1000") == ("moondream3-preview", "01HXYZ@1000")
    assert md.parse_model_name("Qwen/Qwen3.5-4B") == ("Qwen/Qwen3.5-4B", None)
    assert md.parse_model_name("vikhyatk/moondream2/ft@7") == ("vikhyatk/moondream2", "ft@7")
    assert md.parse_model_name("ft@7") == ("ft@7", None)                                  # no base
    folder = str(mdfx.checkpoint())
    assert md.parse_model_name(folder) == (folder, None)
    assert set(md.photon_models()) == {"moondream2", "moondream3-preview", "moondream3.1-9B-A2B"}
    assert photon_core.vl is md.vl and photon_core.photon is md.photon

    # A variant travels to the model as settings["variant"] on every call, with the caller's settings.
    tuned = md.photon(f"{folder}/ft1@5", device="cpu")
    assert tuned.variant == "ft1@5" and tuned.model_id == vision.model_id
    heard = []

    def detect(image, object, settings=None):
        heard.append(settings)
        return {"objects": []}
    monkeypatch.setattr(tuned._model, "detect", detect)
    assert tuned.detect(picture, "cup", settings={"max_objects": 1}) == {"objects": []}
    assert heard == [{"max_objects": 1, "variant": "ft1@5"}]
    # encode_image too: the adapter prefills the image, so the image is the variant's
    monkeypatch.setattr(tuned._model, "encode_image", lambda image, settings=None: heard.append(settings))
    tuned.encode_image(picture)
    assert heard[-1] == {"variant": "ft1@5"}
    # A model without settings cannot take a variant.
    monkeypatch.setattr(tuned._model, "detect", lambda image, object, max_objects=50: {"objects": []})
    with pytest.raises(NotImplementedError, match="variants"):
        tuned.detect(picture, "cup")

    with pytest.raises(ValueError, match="locally only"):
        md.vl(api_key="k", model="moondream2")
    with pytest.raises(TypeError, match="requires model"):
        md.vl(local=True)
    with pytest.raises(TypeError, match="runtime options"):
        md.vl(local=True, model=folder, devcie="cpu")
    with pytest.raises(FileNotFoundError):
        md.vl(local=True, model="/no/such/model/folder")


def test_whisper_transcribes_through_the_client():
    from speech_audio import espeak_pcm
    from whisper_fixtures import tiny_en_path

    pcm, rate = espeak_pcm("the quick brown fox")
    speech = md.vl(local=True, model=str(tiny_en_path()), device="cpu")
    assert speech.tasks == ("transcribe",) and speech.supports("transcribe")
    got = speech.transcribe(audio=pcm, sample_rate=rate)
    assert {"text", "segments", "language", "duration"} <= set(got)
    assert "fox" in got["text"].lower() and speech.model_id == speech.model.model_id
    with pytest.raises(NotImplementedError, match="does not caption"):
        speech.caption(np.zeros((8, 8, 3), np.uint8))
    with pytest.raises(NotImplementedError, match="streamed"):
        speech.transcribe(audio=pcm, sample_rate=rate, stream=True)
    with pytest.raises(TypeError, match="audio"):
        speech.transcribe(sample_rate=rate)
    # a fine-tuned variant it cannot apply is refused, not dropped (the base model's transcript)
    tuned = md.vl(local=True, model=f"{tiny_en_path()}/myfinetune@100", device="cpu")
    with pytest.raises(NotImplementedError, match="myfinetune@100"):
        tuned.transcribe(audio=pcm, sample_rate=rate)


def test_a_local_folder_named_as_a_moondream_model_is_that_folder(tmp_path, monkeypatch):
    """`moondream2` beside the caller is that checkpoint, as photon_core.load takes it; it was mapped
    to vikhyatk/moondream2 (another model, from the cache, or none)."""
    (tmp_path / "moondream2").symlink_to(mdfx.checkpoint(), target_is_directory=True)
    monkeypatch.chdir(tmp_path)
    assert md.vl(local=True, model="moondream2", device="cpu").family == "moondream"


def test_a_variant_on_a_gpu_loads_the_per_op_kernels():
    """The compiled decode steps take no adapters: a variant's client on a GPU failed every call."""
    assert md.client_backend("auto", "cuda", "ft@5") == "triton"
    assert md.client_backend("auto", "cuda:1", None) == "auto"
    assert md.client_backend("auto", "cpu", "ft@5") == "auto"
    assert md.client_backend("megakernel", "cuda", "ft@5") == "megakernel"   # asked for: its own error


def test_the_clients_runtime_options_and_model_path(picture):
    """moondream's docs pass the engine's knobs (max_batch_size, kv_cache_pages) to vl(local=True);
    they were a TypeError. model_path names the weights as kestrel's RuntimeConfig.model_path does."""
    folder = mdfx.checkpoint()
    tuned = md.vl(local=True, model="moondream2", model_path=str(folder / "model.safetensors"),
                  device="cpu", max_batch_size=8, kv_cache_pages=4096, enable_cuda_graphs=False)
    assert tuned.family == "moondream" and tuned.variant is None
    assert set(tuned.detect(picture, "cup", settings={"max_objects": 1})) == {"objects"}
    with pytest.raises(TypeError, match="runtime options"):
        md.vl(local=True, model=str(folder), device="cpu", max_batch=8)


def test_settings_adapter_is_the_variant(vision, picture, monkeypatch):
    """settings["adapter"] is kestrel's name for a fine-tune id (what moondream's client sends): it
    was refused as an unknown setting; the client's own variant wins, as there."""
    heard = []

    def detect(image, object, settings=None):
        heard.append(settings)
        return {"objects": []}
    monkeypatch.setattr(vision._model, "detect", detect)
    vision.detect(picture, "cup", settings={"adapter": "ft1@5", "max_objects": 2})
    vision.detect(picture, "cup", settings={"adapter": None})
    assert heard == [{"max_objects": 2, "variant": "ft1@5"}, None]
    tuned = md.photon(f"{mdfx.checkpoint()}/ft2@7", device="cpu")
    monkeypatch.setattr(tuned._model, "detect", detect)
    tuned.detect(picture, "cup", settings={"adapter": "ft1@5"})
    assert heard[-1] == {"variant": "ft2@7"}


def test_a_missing_call_is_the_clients_value_error(vision, picture):
    """moondream's client raises ValueError for a task the model lacks; NotImplementedError stays."""
    with pytest.raises(ValueError, match="does not segment"):
        vision.segment(picture, "cup")
    with pytest.raises(md.UnsupportedTask):
        vision.transcribe(audio=np.zeros(1600, np.float32))


@pytest.fixture(scope="module")
def speech():
    from whisper_fixtures import tiny_en_path
    return md.vl(local=True, model=str(tiny_en_path()), device="cpu")


def test_transcribe_reads_audio_files_as_the_client_does(speech, tmp_path):
    """The client's transcribe takes a path, bytes or an open file (moondream's docs:
    audio=Path("meeting.m4a")); they reached the model as samples and failed."""
    from photon_core.audio_io import write_wav
    from speech_audio import espeak_pcm

    pcm, rate = espeak_pcm("the quick brown fox")
    wav = tmp_path / "fox.wav"
    write_wav(wav, pcm, rate)
    want = speech.transcribe(audio=pcm, sample_rate=rate)["text"]
    assert "fox" in want.lower()
    assert speech.transcribe(audio=wav)["text"] == want
    assert speech.transcribe(audio=str(wav))["text"] == want
    assert speech.transcribe(audio=wav.read_bytes())["text"] == want
    with open(wav, "rb") as f:
        assert speech.transcribe(audio=f)["text"] == want
    with pytest.raises(ValueError, match="sample_rate must be omitted"):
        speech.transcribe(audio=wav, sample_rate=rate)
    # bytes that are no audio file: named as what was given (not a temporary file gone by now)
    with pytest.raises(ValueError, match=r"^the audio given as 11 bytes: ") as refused:
        speech.transcribe(audio=b"not a wave!")
    assert "/tmp" not in str(refused.value)


def test_transcribe_takes_the_clients_options_and_gives_its_keys(speech, monkeypatch):
    """timestamps modes, task, settings and clip bounds as the client's engine takes them (a mode
    string reached Whisper as a truthy bool, the rest were TypeErrors); the result carries the
    client's keys, segment times in the whole audio."""
    heard = []

    def transcribe(audio, sample_rate=16000, **options):
        heard.append((len(audio), sample_rate, options))
        return {"text": "hi", "segments": [{"start": 0.5, "end": 1.0, "text": "hi"}], "language": "en",
                "duration": len(audio) / sample_rate}
    monkeypatch.setattr(speech._model, "transcribe", transcribe)
    pcm = np.zeros(16000 * 4, np.float32)
    out = speech.transcribe(audio=pcm, sample_rate=16000, timestamps="none", task="transcribe",
                            settings={"temperature": 0}, clip_start_seconds=1.0, clip_end_seconds=3.0)
    assert heard[-1] == (32000, 16000, {"timestamps": False, "temperature": 0.0})
    assert out["segments"] == [{"start": 1.5, "end": 2.0, "text": "hi"}]
    assert {k: out[k] for k in ("task", "duration_seconds", "source_duration_seconds", "clip_start_seconds",
                                "clip_end_seconds")} == {"task": "transcribe", "duration_seconds": 2.0,
                                                         "source_duration_seconds": 4.0, "clip_start_seconds": 1.0,
                                                         "clip_end_seconds": 3.0}
    speech.transcribe(audio=pcm, sample_rate=16000, timestamps="segment")
    assert heard[-1] == (64000, 16000, {"timestamps": True})
    with pytest.raises(NotImplementedError, match="translate"):
        speech.transcribe(audio=pcm, sample_rate=16000, task="translate")
    with pytest.raises(NotImplementedError, match="word"):
        speech.transcribe(audio=pcm, sample_rate=16000, timestamps="word")
    with pytest.raises(NotImplementedError, match="top_p"):
        speech.transcribe(audio=pcm, sample_rate=16000, settings={"top_p": 0.9})
    with pytest.raises(ValueError, match="clip"):
        speech.transcribe(audio=pcm, sample_rate=16000, clip_start_seconds=2.0, clip_end_seconds=1.0)
    with pytest.raises(NotImplementedError, match="ft@3"):
        speech.transcribe(audio=pcm, sample_rate=16000, settings={"adapter": "ft@3"})


def test_clip_bounds_and_settings_that_are_no_numbers_or_dicts_are_named(speech, vision, picture, monkeypatch):
    """clip_start_seconds / clip_end_seconds NaN or infinite failed as "cannot convert float NaN to
    integer" or an OverflowError, None or a string as a comparison's TypeError; settings that are
    not a dict as "dictionary update sequence element #0" (a list of pairs was taken as settings);
    a transcription temperature that is no number as "could not convert string to float"."""
    monkeypatch.setattr(speech._model, "transcribe", lambda audio, sample_rate=16000, **options: {
        "text": "", "segments": [], "language": "en", "duration": len(audio) / sample_rate})
    pcm = np.zeros(16000 * 2, np.float32)
    for bound in ("clip_start_seconds", "clip_end_seconds"):
        for value in (float("nan"), float("inf"), -1.0):
            with pytest.raises(ValueError, match=f"{bound} must be a finite number of seconds >= 0, got"):
                speech.transcribe(audio=pcm, sample_rate=16000, **{bound: value})
        for value in ("1", None if bound == "clip_start_seconds" else "x", True):
            with pytest.raises(TypeError, match=f"{bound} must be a number of seconds"):
                speech.transcribe(audio=pcm, sample_rate=16000, **{bound: value})
    got = speech.transcribe(audio=pcm, sample_rate=16000, clip_start_seconds=np.float32(0.5), clip_end_seconds=1)
    assert (got["duration"], got["clip_start_seconds"], got["clip_end_seconds"]) == (0.5, 0.5, 1.0)
    for settings in ([("max_objects", 1)], "max_objects", 3):
        with pytest.raises(TypeError, match=f"settings must be a dict, not {type(settings).__name__}"):
            vision.detect(picture, "cup", settings=settings)
        with pytest.raises(TypeError, match=f"settings must be a dict, not {type(settings).__name__}"):
            speech.transcribe(audio=pcm, sample_rate=16000, settings=settings)
    for temperature in ("hot", "0.5", None, False):
        with pytest.raises(TypeError, match=r"settings\['temperature'\] must be a number, got"):
            speech.transcribe(audio=pcm, sample_rate=16000, settings={"temperature": temperature})


def test_a_default_device_without_cuda_is_said(caplog, monkeypatch):
    """No device named and no CUDA: the CPU, with a warning (a GPU machine whose CUDA is broken
    would otherwise run at a fraction of the speed with nothing to tell why)."""
    import logging

    import torch

    from photon_core import client
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with caplog.at_level(logging.WARNING, logger="photon_core.client"):
        assert client._default_device() == "cpu"
    assert any("no CUDA device" in r.getMessage() for r in caplog.records)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    caplog.clear()
    assert client._default_device() == "cuda" and not caplog.records
