"""`python -m photon_core transcribe` checks --language and --initial-prompt against the model it
loaded (the families' optional check_language / check_prompt): what the model would ignore is the
user's error, one line and exit status 2, not a result that claims it. In-process main() with the
tests' tiny random Parakeet TDT checkpoint, which can be told neither."""
import json

import numpy as np
import pytest

from parakeet_fixtures import hf_checkpoint
from photon_core.__main__ import main
from photon_core.audio_io import write_wav
from test_cli_errors import one_line


@pytest.fixture(scope="module")
def model():
    return str(hf_checkpoint())   # built outside capsys: its progress bar is not the CLI's stderr


@pytest.fixture
def wav(tmp_path):
    path = tmp_path / "go.wav"
    write_wav(path, (0.1 * np.sin(np.arange(8000) * 0.2)).astype(np.float32), 16000)
    return path


@pytest.mark.parametrize("option, value, said", [
    ("--language", "fr", "argument --language: Parakeet TDT cannot be told a language"),
    ("--initial-prompt", "Kitchen, cup.", "argument --initial-prompt: Parakeet TDT reads no prompt"),
])
def test_an_option_the_model_would_ignore_is_refused(model, wav, capsys, option, value, said):
    # Parakeet took both and ignored them, echoing "language": "fr" back in its result (exit 0).
    assert main(["transcribe", str(wav), "--model", model, option, value]) == 2
    line, out = one_line(capsys)
    assert out == "" and line.startswith(f"python -m photon_core transcribe: error: {said}"), line


def test_without_them_the_model_transcribes(model, wav, capsys):
    assert main(["transcribe", str(wav), "--model", model]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["language"] == "" and result["duration"] == 0.5
