"""`python -m photon_core` on the files a robot hands it: what a model would misread (a damaged
WAV header's sample rate, more channels than are mixed down, a clip of fewer frames than channels,
a deep image with a transparent key) refused in one line naming the file, or read as it is; and
results written as valid JSON or not at all. In-process main() throughout; the speech cases stop
before a model is loaded or use a stand-in family (photon_core.contracts.SpeechModel) that checks
its audio as every family's prepare_audio does; the vision ones the tests' small Moondream 2."""
import json

import numpy as np
import pytest
from PIL import Image

from moondream_fixtures import checkpoint
from photon_core import cli_checks
from photon_core.__main__ import main
from photon_core.image_io import read_image
from photon_core.runtime.audio_frontend import prepare_audio
from test_audio_io import FLOAT, PCM, wav_bytes
from test_cli_errors import one_line


class StandIn:
    """A transcribing family that is not a streaming one (as Parakeet and Qwen3-ASR): its audio
    goes through the frontend's prepare_audio, as theirs does."""
    model_id = "stand-in"

    def __init__(self, result=None):
        self.result = result
        self.seen = []

    def transcribe(self, audio, sample_rate=16000, *, language=None, initial_prompt=None,
                   timestamps=True, temperature=0.0):
        pcm = prepare_audio(audio, sample_rate)
        self.seen.append(pcm)
        return self.result or {"text": "", "segments": [], "duration": len(pcm) / 16000}

    def batch(self, requests):
        return [self.transcribe(**r.kwargs()) for r in requests]

    def warmup(self, language=None, initial_prompt=None):
        pass


@pytest.fixture
def stand_in(monkeypatch):
    model = StandIn()
    monkeypatch.setattr(cli_checks, "load_model", lambda *a, **k: model)
    return model


@pytest.mark.parametrize("channels, rate, said", [
    (1, 2_000_000_000, "declares a sample rate of 2000000000 Hz, where recordings have 1000 to 768000 Hz"),
    (1, 1, "declares a sample rate of 1 Hz"),
    (100, 16000, "100 channels, where at most 64 are mixed down"),
])
def test_what_a_model_would_misread_in_a_header_is_refused_naming_the_file(tmp_path, capsys, channels,
                                                                         rate, said):
    # Before: a 4 GHz or 1 Hz header was resampled to nonsense without a word (1000 samples at 1 Hz:
    # "1000 s" of audio, 13 s of work); 100 channels were "channel-first ... pass audio.T".
    wav = tmp_path / "mic.wav"
    wav.write_bytes(wav_bytes(PCM, channels, rate, 2, bytes(2 * channels * 1000)))
    assert main(["transcribe", str(wav)]) == 2   # refused before whisper-tiny.en is loaded
    line, out = one_line(capsys)
    assert out == "" and line.startswith(f"python -m photon_core transcribe: error: {wav}: {said}"), line


def test_a_clip_of_fewer_frames_than_channels_is_not_taken_for_channel_first(tmp_path, capsys, stand_in):
    # A 4-channel array of 2 frames, taken for a channel-first one: "pass audio.T" to a file's user.
    wav = tmp_path / "short.wav"
    samples = np.array([[1000, 2000, 3000, 4000], [-1000, -2000, -3000, -4000]], "<i2")
    wav.write_bytes(wav_bytes(PCM, 4, 16000, 2, samples.tobytes()))
    assert main(["transcribe", str(wav), "--model", "stand-in"]) == 0
    assert json.loads(capsys.readouterr().out)["duration"] == 2 / 16000
    np.testing.assert_allclose(stand_in.seen[0], samples.mean(axis=1) / 32768, rtol=1e-6)


def test_stereo_is_mixed_down_not_interleaved(tmp_path, capsys, stand_in):
    # The stand-in gets what every family gets: [frames] at the file's rate, the channels' mean.
    t = np.arange(800) / 8000
    left, right = 0.5 * np.sin(2 * np.pi * 300 * t), 0.25 * np.sin(2 * np.pi * 500 * t)
    stereo = np.round(np.stack([left, right], -1) * 32767).astype("<i2")
    wav = tmp_path / "stereo8k.wav"
    wav.write_bytes(wav_bytes(PCM, 2, 8000, 2, stereo.tobytes()))
    assert main(["transcribe", str(wav), "--model", "stand-in"]) == 0
    assert json.loads(capsys.readouterr().out)["duration"] == pytest.approx(0.1)
    assert len(stand_in.seen[0]) == 1600   # 0.1 s at 16 kHz: not 2 x 800 interleaved samples


@pytest.mark.parametrize("channels", [1, 2])
def test_a_float_file_on_the_int16_scale_is_refused_naming_the_file(tmp_path, capsys, stand_in, channels):
    # Float samples of int16 values reached the model 32768x too loud, without a word.
    tone = 0.1 * np.sin(2 * np.pi * 440 * np.arange(1600) / 16000)
    wav = tmp_path / "loud.wav"
    wav.write_bytes(wav_bytes(FLOAT, channels, 16000, 4, np.repeat(tone * 32768, channels).astype("<f4").tobytes()))
    assert main(["transcribe", str(wav), "--model", "stand-in"]) == 2
    line, out = one_line(capsys)
    assert out == "" and stand_in.seen == []
    assert line.startswith(f"python -m photon_core transcribe: error: transcribe {wav}: float samples up to 3276.8")
    assert line.endswith("looks like int16 values stored as floats; divide them by 32768")


def test_speech_results_are_written_as_json_whole(tmp_path, capsys, monkeypatch):
    # A family's NumPy scalar stopped json.dump halfway: '{"text": "go", "duration": ' on stdout,
    # then an internal error.
    model = StandIn({"text": "go", "duration": np.float32(0.5), "segments": [], "probs": np.arange(2)})
    monkeypatch.setattr(cli_checks, "load_model", lambda *a, **k: model)
    wav = tmp_path / "go.wav"
    wav.write_bytes(wav_bytes(PCM, 1, 16000, 2, bytes(3200)))
    assert main(["transcribe", str(wav)]) == 0
    assert json.loads(capsys.readouterr().out) == {"text": "go", "duration": 0.5, "segments": [],
                                                    "probs": [0, 1]}


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_a_result_json_cannot_hold_is_an_error_not_invalid_json(tmp_path, capsys, monkeypatch, value):
    # json.dump wrote NaN, which no JSON parser takes (a consumer's json.loads in another language,
    # jq), and exited 0.
    from photon_core import cli_vision
    image = tmp_path / "frame.png"
    Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(image)
    box = {"x_min": value, "y_min": 0.1, "x_max": 0.2, "y_max": 0.3}
    monkeypatch.setattr(cli_vision, "_infer", lambda *a: {"objects": [box]})
    assert main(["detect", str(image), "cup", "--model", str(checkpoint())]) == 1
    line, out = one_line(capsys)
    assert out == "" and "internal error: RuntimeError: the result cannot be written as JSON" in line


def test_a_deep_image_with_a_transparent_key_keeps_its_grey(tmp_path, capsys, monkeypatch):
    # The CLI reads with keep_alpha: PIL's convert("RGBA") clipped a 16-bit PNG with a tRNS key to
    # 8 bits, every pixel above 255 white, and kept every pixel opaque.
    depth = np.linspace(0, 65535, 12 * 16).reshape(12, 16).astype(np.uint16)
    path = tmp_path / "depth.png"
    Image.fromarray(depth).save(path, transparency=0)
    rgba = read_image(path, keep_alpha=True)
    np.testing.assert_array_equal(rgba[..., :3], read_image(path))
    assert rgba[0, 0, 3] == 0 and (rgba[..., 3].ravel()[1:] == 255).all()
    # ... and that is what the model gets from the command line
    from photon_core import cli_vision
    seen = []
    monkeypatch.setattr(cli_vision, "_infer", lambda model, args, image: seen.append(image) or {"points": []})
    assert main(["point", str(path), "cup", "--model", str(checkpoint())]) == 0
    np.testing.assert_array_equal(seen[0], rgba)
    assert json.loads(capsys.readouterr().out)["points"] == []


@pytest.mark.parametrize("command", [["detect", "{image}", "cup"], ["transcribe", "{wav}"]])
def test_an_empty_model_name_is_refused_not_the_current_folder(tmp_path, capsys, monkeypatch, command):
    # --model "" (an unset variable in a launch script) was Path(""), the current folder: whatever
    # checkpoint lay there was loaded and served, as model "".
    image, wav = tmp_path / "frame.png", tmp_path / "go.wav"
    Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(image)
    wav.write_bytes(wav_bytes(PCM, 1, 16000, 2, bytes(3200)))
    monkeypatch.chdir(checkpoint())
    with pytest.raises(SystemExit) as code:
        main([a.format(image=image, wav=wav) for a in command] + ["--model", ""])
    line, out = one_line(capsys)
    assert code.value.code == 2 and out == ""
    assert line.startswith(f"python -m photon_core {command[0]}: error: argument --model: must not be empty")
