"""The top-level API: photon_core.load picks the model family, and the command line dispatches."""
import json
import subprocess
import sys

import numpy as np

import photon_core
import photon_core.registry
from moondream_fixtures import checkpoint


def test_load_picks_the_family():
    assert photon_core.registry.recognise("whisper-tiny.en").family.name == "whisper"
    assert photon_core.registry.recognise(checkpoint()).family.name == "moondream"
    vision = photon_core.load(checkpoint())
    image = np.random.default_rng(0).integers(0, 256, (64, 80, 3), dtype=np.uint8)
    result = vision.detect(image, "cup", settings={"max_objects": 1})
    assert set(result) == {"objects"} and len(result["objects"]) == 1
    speech = photon_core.load("whisper-tiny.en")
    assert speech.transcribe(np.zeros(16000, np.float32), sample_rate=16000)["text"] == ""


def test_command_line_lists_every_skill():
    out = subprocess.run([sys.executable, "-m", "photon_core", "--help"], capture_output=True, text=True)
    assert out.returncode == 0
    for command in ("transcribe", "detect", "point", "caption", "query"):
        assert command in out.stdout


def test_command_line_detect_prints_json(tmp_path):
    import cv2
    image = tmp_path / "frame.png"
    cv2.imwrite(str(image), np.random.default_rng(1).integers(0, 256, (60, 90, 3), dtype=np.uint8))
    out = subprocess.run([sys.executable, "-m", "photon_core", "point", str(image), "cup", "--model",
                          str(checkpoint()), "--max-objects", "1"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert len(result["points"]) == 1 and 0 <= result["points"][0]["x"] <= 1
