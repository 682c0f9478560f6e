"""`python -m photon_core segment` end to end on the tiny random Moondream 3 checkpoint
(test_moondream3_checkpoints), its LM head scripted to say a diamond (segment_fixtures): the JSON
result, and --draw's PNG changing exactly the mask's pixels, all inside the box."""
import json

import cv2
import numpy as np
import pytest

import test_moondream3_checkpoints as ck
from moondream_fixtures import checkpoint as md2_checkpoint
from photon_core import svg_path
from photon_core.__main__ import main
from segment_fixtures import DIAMOND_PATH, script_segment


def gradient(h=200, w=300):
    y, x = np.mgrid[0:h, 0:w]
    return np.stack([x % 256, y % 256, (2 * x + y) % 256], -1).astype(np.uint8)


def test_segment_command_draws_the_mask_inside_the_box(tmp_path, monkeypatch, capsys):
    folder = ck.checkpoint("safetensors")[0]
    rgb = gradient()
    image, drawn = tmp_path / "frame.png", tmp_path / "out.png"
    cv2.imwrite(str(image), cv2.cvtColor(rgb, cv2.COLOR_RGB2BGR))
    script_segment(monkeypatch, folder)
    rc = main(["segment", str(image), "cup", "--model", str(folder), "--max-tokens", "40", "--draw", str(drawn)])
    assert rc == 0
    result = json.loads(capsys.readouterr().out)
    assert result["path"] == DIAMOND_PATH and "error" not in result
    assert result["model"] == "moondream3" and result["infer_s"] >= 0
    box = result["bbox"]
    assert 0 <= box["x_min"] < box["x_max"] <= 1 and 0 <= box["y_min"] < box["y_max"] <= 1
    h, w = rgb.shape[:2]
    out = cv2.cvtColor(cv2.imread(str(drawn)), cv2.COLOR_BGR2RGB)
    changed = (out != rgb).any(-1)
    rows, cols = np.nonzero(changed)
    assert len(rows) > 50, "the random region head gave too small a box for this test to mean anything"
    # every changed pixel lies inside the box (pixel columns floor(x_min * w) .. ceil(x_max * w) - 1)
    assert cols.min() >= np.floor(box["x_min"] * w) and cols.max() <= np.ceil(box["x_max"] * w) - 1
    assert rows.min() >= np.floor(box["y_min"] * h) and rows.max() <= np.ceil(box["y_max"] * h) - 1
    # and they are the diamond's pixels: half the box's area, less its border's share
    mask, _ = svg_path.rasterise(DIAMOND_PATH, box, w, h)
    np.testing.assert_array_equal(changed, mask)
    box_px = (box["x_max"] - box["x_min"]) * w * (box["y_max"] - box["y_min"]) * h
    assert changed.sum() == pytest.approx(box_px / 2, rel=0.2)


def test_segment_command_refuses_a_family_without_the_skill(tmp_path, capsys):
    image = tmp_path / "frame.png"
    cv2.imwrite(str(image), np.zeros((8, 8, 3), np.uint8))
    assert main(["segment", str(image), "cup", "--model", str(md2_checkpoint())]) == 2
    assert "moondream model cannot segment" in capsys.readouterr().err
