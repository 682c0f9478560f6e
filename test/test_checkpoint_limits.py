"""A crafted checkpoint must not make the loader use unbounded memory or time, or fail deep inside
the model: .nemo decompression bombs, sparse members and YAML aliases; config numbers that size
allocations or loops; configs that disagree with their tensors; malformed CTranslate2 files; chat
templates that loop or repeat without end, or that are symlinks out of the checkpoint. Each is
refused at load with a ValueError naming the file and the field.

Files are tiny and built here. Where the unfixed code would allocate gigabytes or loop for hours,
the payload runs in a child process with its address space capped and a timeout."""
from __future__ import annotations

import io
import json
import os
import shutil
import struct
import subprocess
import sys
import tarfile
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import parakeet_fixtures as pf

ROOT = Path(__file__).resolve().parents[1]


def run_capped(code: str, extra_gib: float = 1.0, timeout: float = 120) -> str:
    """Run `code` in a child Python; its `cap()` limits the address space to what is mapped when
    it is called plus `extra_gib`. Returns stdout (the child prints its outcome)."""
    prelude = textwrap.dedent(f"""
        import resource
        def cap():
            mapped = int(open("/proc/self/statm").read().split()[0]) * resource.getpagesize()
            limit = mapped + int({extra_gib} * (1 << 30))
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    """)
    path = os.pathsep.join([str(ROOT), str(ROOT / "test"), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path}
    run = subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code)], capture_output=True, text=True,
                         timeout=timeout, cwd=ROOT, env=env)
    assert run.returncode == 0, run.stderr[-2000:]
    return run.stdout


# ------------------------------------------------------------------ .nemo archives

def _tar(path: Path, members: list[tuple[str, bytes | int]], mode: str = "w", **kw) -> Path:
    """A tar of (name, data) members; an int stands for that many zero bytes (streamed)."""
    class Zeros(io.RawIOBase):
        def __init__(self, n: int) -> None:
            self.n = n

        def readinto(self, b) -> int:  # type: ignore[override]
            k = min(len(b), self.n)
            b[:k] = bytes(k)
            self.n -= k
            return k

    with tarfile.open(path, mode, **kw) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = data if isinstance(data, int) else len(data)
            tar.addfile(info, Zeros(data) if isinstance(data, int) else io.BytesIO(data))
    return path


def _weights() -> bytes:
    buf = io.BytesIO()
    torch.save({"w": torch.ones(2)}, buf)
    return buf.getvalue()


def test_a_gzip_bomb_nemo_is_refused_before_it_is_inflated(tmp_path):
    from photon_core.weights.tensor_files import read_nemo

    # 80 MiB of zeros compress to well under 1 MiB: the archive declares far more than any real
    # (float weights) .nemo could hold in its size
    bomb = _tar(tmp_path / "bomb.nemo", [("model_config.yaml", b"a: 1\n"), ("model_weights.ckpt", 80 << 20)],
                "w:gz", compresslevel=1)
    assert bomb.stat().st_size < 1 << 20
    with pytest.raises(ValueError, match=r"bomb\.nemo.*model_weights\.ckpt.*decompression bomb"):
        read_nemo(bomb)
    # a header declaring 8 GiB with nothing behind it is refused at the header, nothing read
    lie = tmp_path / "lie.nemo"
    with tarfile.open(lie, "w:gz") as tar:
        info = tarfile.TarInfo("model_weights.ckpt")
        info.size = 8 << 30
        tar.addfile(info)   # header only: the data never follows
    with pytest.raises(ValueError, match="decompression bomb"):
        read_nemo(lie)


def test_nemo_members_over_their_limits_or_too_many_are_refused(tmp_path, monkeypatch):
    from photon_core.weights import tensor_files
    from photon_core.weights.tensor_files import read_nemo

    ok = _tar(tmp_path / "ok.nemo", [("./model_config.yaml", b"a: 1\n"), ("./model_weights.ckpt", _weights())])
    config, state = read_nemo(ok)
    assert config == {"a": 1} and torch.equal(state["w"], torch.ones(2))
    monkeypatch.setattr(tensor_files, "NEMO_MAX_WEIGHTS_BYTES", 100)
    with pytest.raises(ValueError, match=r"ok\.nemo: member './model_weights.ckpt' declares \d+ bytes, over"):
        read_nemo(ok)
    monkeypatch.undo()
    many = _tar(tmp_path / "many.nemo", [(f"junk{i}", b"") for i in range(1100)])
    with pytest.raises(ValueError, match=r"many\.nemo: a \.nemo with more than 1024 members"):
        read_nemo(many)


@pytest.mark.skipif(shutil.which("tar") is None, reason="GNU tar writes the sparse member")
def test_a_sparse_nemo_member_is_refused(tmp_path):
    from photon_core.weights.tensor_files import read_nemo

    work = tmp_path / "work"
    work.mkdir()
    (work / "model_config.yaml").write_bytes(b"a: 1\n")
    os.truncate(work / "model_config.yaml", 64 << 20)   # a hole: a few bytes on disk, 64 MiB declared
    (work / "model_weights.ckpt").write_bytes(_weights())
    nemo = tmp_path / "sparse.nemo"
    subprocess.run(["tar", "--sparse", "--format=gnu", "-cf", str(nemo), "-C", str(work), "model_config.yaml",
                    "model_weights.ckpt"], check=True)
    with tarfile.open(nemo) as tar:
        if not tar.getmember("model_config.yaml").issparse():
            pytest.skip("this tar wrote no sparse member")
    with pytest.raises(ValueError, match=r"sparse\.nemo: member 'model_config.yaml' is a sparse file"):
        read_nemo(nemo)


def test_yaml_aliases_in_model_config_are_refused(tmp_path):
    """A billion-laughs config: 5 short lines stand for 10^5 leaves (10^9 in the reviewer's)."""
    from photon_core.weights.tensor_files import read_nemo

    laughs = "l0: &l0 [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 10)}]\n" for i in range(1, 5))
    config = laughs + "encoder: {att_context_size: [-1, -1, *l4]}\n"
    nemo = _tar(tmp_path / "laughs.nemo", [("model_config.yaml", config.encode()), ("model_weights.ckpt", _weights())])
    with pytest.raises(ValueError, match=r"laughs\.nemo: model_config\.yaml: YAML aliases"):
        read_nemo(nemo)


def test_the_fixture_nemo_config_reads_alike_without_aliases():
    """NeMo's configs (OmegaConf dumps, as the fixture's) use no aliases: refusing them costs nothing."""
    import yaml

    from photon_core.weights.tensor_files import safe_yaml

    with tarfile.open(pf.nemo_checkpoint()) as tar:
        text = tar.extractfile("./model_config.yaml").read()
    assert safe_yaml(text, "fixture") == yaml.safe_load(text) == pf.nemo_config()


# ------------------------------------------------------------------ Parakeet config numbers

def _parakeet(tmp_path: Path, cfg: dict | None = None, enc: dict | None = None, pre: dict | None = None,
              tensors=None) -> Path:
    folder = tmp_path / "parakeet"
    shutil.copytree(pf.hf_checkpoint(), folder)
    c = json.loads((folder / "config.json").read_text())
    p = json.loads((folder / "preprocessor_config.json").read_text())
    c.update(cfg or {})
    c["encoder_config"].update(enc or {})
    p.update(pre or {})
    (folder / "config.json").write_text(json.dumps(c))
    (folder / "preprocessor_config.json").write_text(json.dumps(p))
    if tensors:
        t = load_file(str(folder / "model.safetensors"))
        tensors(t)
        save_file(t, str(folder / "model.safetensors"))
    return folder


@pytest.mark.parametrize("cfg, enc, pre, file, field", [
    ({"max_symbols_per_step": 10 ** 9}, None, None, "config.json", "max_symbols_per_step"),
    ({"max_symbols_per_step": 0}, None, None, "config.json", "max_symbols_per_step"),
    (None, {"num_mel_bins": 4096}, {"feature_size": 4096}, "config.json", "num_mel_bins"),
    (None, None, {"n_fft": 1 << 16}, "preprocessor_config.json", "n_fft"),
    (None, None, {"hop_length": 0}, "preprocessor_config.json", "hop_length"),
    (None, None, {"sampling_rate": 0}, "preprocessor_config.json", "sampling_rate"),
    (None, {"subsampling_factor": 0}, None, "config.json", "subsampling_factor"),
    (None, {"num_attention_heads": "4"}, None, "config.json", "num_attention_heads"),
    (None, {"num_attention_heads": 3}, None, "config.json", "attention heads"),
])
def test_parakeet_config_numbers_are_bounded_at_load(tmp_path, cfg, enc, pre, file, field):
    from photon_core.models.parakeet.checkpoint import load

    with pytest.raises(ValueError, match=rf"{file}: .*{field}"):
        load(_parakeet(tmp_path, cfg, enc, pre))


@pytest.mark.parametrize("enc, pre, tensors", [
    ({"num_hidden_layers": 5}, None, None),                           # tensors for 2 layers
    ({"num_mel_bins": 64}, {"feature_size": 64}, None),               # the stem's weight is for 16 bins
    (None, None, lambda t: t.pop("encoder.layers.1.norm_out.bias")),  # a missing tensor
    (None, None, lambda t: t.update({"joint.head.weight": torch.ones(45, 24, dtype=torch.int64)})),
])
def test_parakeet_config_and_tensors_must_agree_at_load(tmp_path, enc, pre, tensors):
    from photon_core.models.parakeet.checkpoint import load

    with pytest.raises(ValueError, match="parakeet: the tensors do not match the config"):
        load(_parakeet(tmp_path, None, enc, pre, tensors))


def test_parakeet_nemo_config_fields_are_named(tmp_path):
    from photon_core.models.parakeet.checkpoint import load_nemo

    config = pf.nemo_config()
    config["encoder"]["n_heads"] = "x"
    config["decoding"]["greedy"]["max_symbols"] = 10 ** 9
    pf.write_nemo(tmp_path / "bad.nemo", config)
    with pytest.raises(ValueError, match=r"bad\.nemo: model_config\.yaml: encoder\.n_heads must be"):
        load_nemo(tmp_path / "bad.nemo")
    config["encoder"]["n_heads"] = 4
    pf.write_nemo(tmp_path / "bad.nemo", config)
    with pytest.raises(ValueError, match=r"model_config\.yaml: decoding\.greedy\.max_symbols must be"):
        load_nemo(tmp_path / "bad.nemo")


def test_greedy_tdt_refuses_an_unbounded_symbol_guard():
    from photon_core.models.parakeet.checkpoint import load as load_checkpoint
    from photon_core.models.parakeet.tdt import greedy_tdt
    from photon_core.models.parakeet.transcribe import ParakeetSpeech

    speech = ParakeetSpeech(load_checkpoint(pf.hf_checkpoint()), "guard")
    for value in (0, 10 ** 9):   # 0 is "no guard" to the loop, 10^9 as good as none
        with pytest.raises(ValueError, match="max_symbols must be"):
            greedy_tdt(speech.model, torch.zeros(3, 24), max_symbols=value)


def test_mel_filterbank_sizes_are_bounded():
    """3e6 mel bins or a 1e9-point FFT asked for gigabytes (capped child process)."""
    out = run_capped("""
        from photon_core.runtime.audio_frontend import mel_filterbank
        cap()
        for args in ((3_000_000, 16000, 512), (128, 16000, 10 ** 9), (0, 16000, 512)):
            try:
                mel_filterbank(*args)
                print("built")
            except ValueError as err:
                print("refused", err)
            except MemoryError:
                print("MemoryError")
        print(mel_filterbank(128, 16000, 512).shape)
    """)
    lines = out.splitlines()
    assert [line.split()[0] for line in lines[:3]] == ["refused"] * 3, out
    assert "n_mels" in lines[0] and "n_fft" in lines[1] and lines[3] == "(128, 257)"


# ------------------------------------------------------------------ other families' config numbers

@pytest.mark.parametrize("section, key, value", [
    ("text", "max_context", 10 ** 8), ("text", "max_context", -5), ("text", "n_heads", 0),
    ("text", "n_layers", "2"), ("text", "rope_theta", "x"), ("vision", "max_crops", 10 ** 9),
])
def test_moondream_config_numbers_are_checked(section, key, value):
    from photon_core.models.moondream.config import MoondreamConfig

    with pytest.raises(ValueError, match=rf"config\.json: {section}\.{key} must be"):
        MoondreamConfig.from_dict({section: {key: value}})


def test_moondream_load_names_the_checkpoint(tmp_path):
    import moondream_fixtures as mf
    import photon_core

    mf.write_checkpoint(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["text"]["max_context"] = 1 << 18   # 8x moondream2's 2048 x 16: a rotary table per position
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=rf"{tmp_path}: config\.json: text\.max_context"):
        photon_core.load(str(tmp_path), backend="reference")


def test_qwen3_asr_audio_positions_are_bounded():
    from photon_core.models.qwen3_asr.config import parse_config

    assert parse_config({"audio_config": {"max_source_positions": 1500}, "text_config": {}}).audio.n_positions == 1500
    with pytest.raises(ValueError, match=r"cfg\.json: audio_config\.max_position_embeddings must be"):
        parse_config({"audio_config": {"max_position_embeddings": 10 ** 9}, "text_config": {}}, "cfg.json")
    with pytest.raises(ValueError, match="encoder_attention_heads"):
        parse_config({"audio_config": {"encoder_attention_heads": 0}, "text_config": {}})


def test_qwen3_5_pixel_budget_is_bounded(tmp_path):
    from types import SimpleNamespace

    from photon_core.models.qwen3_5.vision import Preprocess

    vc = SimpleNamespace(patch=16, temporal_patch=2, merge=2)
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"size": {"shortest_edge": 65536,
                                                                            "longest_edge": 16777216}}))
    assert Preprocess.from_folder(tmp_path, vc).min_pixels == 65536   # the real values
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"size": {"shortest_edge": 4 * 10 ** 10}}))
    with pytest.raises(ValueError, match=r"preprocessor_config\.json: size\.shortest_edge must be"):
        Preprocess.from_folder(tmp_path, vc)


# ------------------------------------------------------------------ Whisper

@pytest.fixture(scope="module")
def whisper_hf_tensors():
    from whisper_fixtures import openai_to_hf, random_openai_model

    model, _ = random_openai_model()
    return openai_to_hf({k: v.detach().clone() for k, v in model.state_dict().items()})


def _last(tensors: dict) -> int:
    return max(int(k.split(".")[3]) for k in tensors if k.startswith("model.decoder.layers."))


@pytest.mark.parametrize("name, change_tensors, change_config, field", [
    ("heads_3", None, {"encoder_attention_heads": 3}, r"encoder_attention_heads \(3\) must divide"),
    ("heads_str", None, {"decoder_attention_heads": "2"}, "decoder_attention_heads must be an integer"),
    ("heads_neg", None, {"decoder_attention_heads": -2}, "decoder_attention_heads must be an integer"),
    ("enc_pos_4000", lambda t: t.update({"model.encoder.embed_positions.weight": torch.randn(4000, 128)}), None,
     "encoder.positional_embedding"),
    ("missing_bias", lambda t: t.pop("model.decoder.layer_norm.bias"), None, r"missing \['decoder.ln.bias'\]"),
    ("fc1_transposed", lambda t: t.update({"model.encoder.layers.0.fc1.weight":
                                           t["model.encoder.layers.0.fc1.weight"].t().contiguous()}), None,
     "encoder.blocks.0.mlp"),
    # a checkpoint cut after a whole layer holds together by its tensors alone: its config says so
    ("last_layer_cut", lambda t: [t.pop(k) for k in [k for k in t if k.startswith(f"model.decoder.layers.{_last(t)}.")]],
     {"decoder_layers": 2}, "decoder_layers is 2 but the tensors hold 1 layers"),
    ("layers_str", None, {"encoder_layers": "2"}, "encoder_layers must be an integer"),
])
def test_whisper_config_and_tensors_must_agree_at_load(tmp_path, whisper_hf_tensors, name, change_tensors,
                                                       change_config, field):
    from photon_core.models.whisper.checkpoint import load_checkpoint_file
    from photon_core.models.whisper.transcribe import WhisperSpeech
    from whisper_fixtures import tiny_en_path

    tensors = dict(whisper_hf_tensors)
    config = {"model_type": "whisper", "encoder_attention_heads": 2, "decoder_attention_heads": 2}
    if change_tensors:
        change_tensors(tensors)
    config.update(change_config or {})
    save_file({k: v.clone().contiguous() for k, v in tensors.items()}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(config))
    shutil.copy(tiny_en_path() / "tokenizer.json", tmp_path)
    with pytest.raises(ValueError, match=rf"{tmp_path}.*{field}"):
        WhisperSpeech(load_checkpoint_file(tmp_path), "crafted")


# ------------------------------------------------------------------ CTranslate2 model.bin

def _s(text: str) -> bytes:
    b = text.encode() + b"\0"
    return struct.pack("<H", len(b)) + b


_HEAD = struct.pack("<I", 6) + _s("WhisperSpec") + struct.pack("<I", 1)


@pytest.mark.parametrize("data, message", [
    (_HEAD + struct.pack("<I", 5), "truncated"),
    (struct.pack("<I", 3) + _s("WhisperSpec") + struct.pack("<II", 1, 1) + _s("w") + struct.pack("<BIBI", 1, 1, 8, 1)
     + b"\0" * 8 + struct.pack("<I", 0), "item size 8"),
    (_HEAD + struct.pack("<I", 1) + _s("w") + struct.pack("<BI", 1, 1) + struct.pack("<BI", 0, 3) + b"abc"
     + struct.pack("<I", 0), "3 bytes"),
    (_HEAD + struct.pack("<I", 1) + _s("w") + struct.pack("<BII", 2, 1000, 1000) + struct.pack("<BI", 0, 4)
     + b"\0" * 4 + struct.pack("<I", 0), r"shape \[1000, 1000\]"),
    (_HEAD + struct.pack("<I", 1) + struct.pack("<H", 3) + b"\xff\xfe\0" + struct.pack("<BI", 1, 1)
     + struct.pack("<BI", 0, 4) + b"\0" * 4 + struct.pack("<I", 0), "not UTF-8"),
], ids=["truncated", "item_size_8", "bytes_not_multiple", "shape_vs_bytes", "bad_utf8_name"])
def test_malformed_ctranslate2_files_are_value_errors_naming_the_file(tmp_path, data, message):
    from photon_core.weights.ctranslate2 import read_ctranslate2

    (tmp_path / "model.bin").write_bytes(data)
    with pytest.raises(ValueError, match=rf"model\.bin: .*{message}"):
        read_ctranslate2(tmp_path)


def test_a_ctranslate2_whisper_without_its_variables_is_a_value_error(tmp_path):
    from photon_core.models.whisper.checkpoint import load_ctranslate2_whisper

    (tmp_path / "model.bin").write_bytes(_HEAD + struct.pack("<I", 0) + struct.pack("<I", 0))
    with pytest.raises(ValueError, match=r"not a complete CTranslate2 Whisper model: no variable 'encoder/conv1/"):
        load_ctranslate2_whisper(tmp_path)


# ------------------------------------------------------------------ chat templates

def test_a_chat_template_symlinked_out_of_the_checkpoint_is_refused(tmp_path):
    """Refused unless it resolves inside the folder or the Hugging Face cache's blobs/ (where
    snapshots/<rev>/chat_template.jinja -> ../../blobs/<hash> points)."""
    from photon_core.runtime.chat_template import ChatTemplate

    repo = tmp_path / "models--org--model"
    (repo / "blobs").mkdir(parents=True)
    (repo / "blobs" / "abc123").write_text("{{ messages[0].content }}!")
    folder = repo / "snapshots" / "rev1"
    folder.mkdir(parents=True)
    (folder / "chat_template.jinja").symlink_to(Path("..") / ".." / "blobs" / "abc123")
    assert ChatTemplate.from_folder(folder).render([{"role": "user", "content": "hi"}]) == "hi!"

    secret = tmp_path / "secret.txt"
    secret.write_text("root:x:0:0")
    (folder / "chat_template.jinja").unlink()
    (folder / "chat_template.jinja").symlink_to(secret)
    with pytest.raises(ValueError, match=r"chat_template\.jinja: a symlink to .*secret\.txt, outside"):
        ChatTemplate.from_folder(folder)
    (folder / "chat_template.jinja").unlink()
    (folder / "tokenizer_config.json").symlink_to(tmp_path / "other.json")
    (tmp_path / "other.json").write_text(json.dumps({"chat_template": "{{ 'leaked' }}"}))
    with pytest.raises(ValueError, match="outside the checkpoint folder"):
        ChatTemplate.from_folder(folder)


def test_the_reviewers_template_payloads_are_bounded():
    """Nested loops that would run ~10^10 steps, a 4 GB repetition, a 10^10-character output, a
    padded format: refused within seconds and a 1 GiB address-space cap (child process)."""
    out = run_capped("""
        from photon_core.runtime.chat_template import ChatTemplate
        cap()
        for src in ["{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
                    "{{ 'x' * 4000000000 }}{{ messages[0].content }}",
                    "{% set s = 'x' * 100000 %}{% for i in range(99999) %}{{ s }}{% endfor %}",
                    "{{ '%4000000000s' % 'x' }}", "{{ 'x'.ljust(4000000000) }}",
                    "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}"]:
            try:
                ChatTemplate(src).render([{"role": "user", "content": "hi"}])
                print("rendered")
            except ValueError as err:
                print("refused", type(err).__name__)
            except MemoryError:
                print("MemoryError")
    """, timeout=60)
    assert out.splitlines() == ["refused TemplateLimit"] * 6, out


def test_real_templates_stay_far_from_the_bounds(monkeypatch):
    """The test checkpoints' templates render a 200-turn conversation with every bound cut to a
    64th: the real limits leave that much room."""
    from photon_core.runtime import chat_template
    from test_gemma4_fixtures import TEMPLATE as GEMMA4
    from test_qwen3_5_fixtures import CHAT_TEMPLATE as QWEN3_5

    for name in ("MAX_OUTPUT_CHARS", "MAX_LOOP_STEPS"):
        monkeypatch.setattr(chat_template, name, getattr(chat_template, name) // 64)
    chat = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i} " + "word " * 50}
            for i in range(200)]
    for source in (QWEN3_5, GEMMA4):
        text = chat_template.ChatTemplate(source, {"bos_token": "<bos>"}).render(chat, add_generation_prompt=True)
        assert "turn 199" in text
