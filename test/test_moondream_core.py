"""Moondream pieces without a model: config, image crops, weight naming and resolution, stitching."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import moondream_fixtures as mf
from photon_core.models.moondream import config as mdconfig
from photon_core.models.moondream import image_crops, vision, weights


def test_config_defaults_are_moondream2_and_overrides_apply():
    c = mdconfig.MoondreamConfig.from_dict(None)
    assert (c.text.dim, c.text.n_layers, c.text.n_heads, c.vision.enc_dim, c.vision.enc_n_layers) == (2048, 24, 32, 1152, 27)
    assert c.tokenizer.templates["caption"]["normal"] == [1, 32708, 2, 6382, 3]
    small = mdconfig.MoondreamConfig.from_dict(mf.small_config(vision_layers=3, text_layers=4))
    assert (small.text.dim, small.text.n_layers, small.vision.enc_n_layers, small.region.inner_dim) == (128, 4, 3, 64)
    wrapped = mdconfig.MoondreamConfig.from_dict({"model_type": "moondream1", "config": {"text": {"n_layers": 5}}})
    assert wrapped.text.n_layers == 5 and wrapped.text.dim == 2048


def test_config_rejects_unknown_keys_and_md3():
    with pytest.raises(ValueError, match="unknown keys"):
        mdconfig.MoondreamConfig.from_dict({"text": {"dimm": 3}})
    with pytest.raises(ValueError, match="Moondream 3 .*photon_core.models.moondream3"):
        mdconfig.MoondreamConfig.from_dict({"text": {"moe": {"num_experts": 64}}})
    with pytest.raises(ValueError, match="prefix_attn"):
        mdconfig.MoondreamConfig.from_dict({"text": {"prefix_attn": 100}})


@pytest.mark.parametrize("h,w,expected", [(300, 300, (1, 1)), (378, 378, (1, 1)), (480, 640, (2, 4)),
                                          (1080, 1920, (2, 4)), (3000, 4000, (2, 4)), (800, 800, (3, 3)),
                                          (400, 3000, (1, 8)), (3000, 400, (8, 1))])
def test_tiling_and_crop_shapes(h, w, expected):
    img = np.zeros((h, w, 3), np.uint8)
    crops, tiling = image_crops.make_crops(img)
    assert tiling == expected
    assert crops.shape == (1 + expected[0] * expected[1], 378, 378, 3) and crops.dtype == np.uint8


def test_local_crops_overlap_by_the_margin():
    # A smooth image: neighbouring crops must show the same pixels in their 2*56 px overlap.
    y, x = np.mgrid[0:700, 0:900]
    img = np.stack([x % 256, y % 256, (x + y) % 256], -1).astype(np.uint8)
    crops, (rows, cols) = image_crops.make_crops(img)
    assert rows * cols > 1
    step = 378 - 2 * 56
    for i in range(rows):
        for j in range(cols - 1):
            a, b = crops[1 + i * cols + j], crops[1 + i * cols + j + 1]
            np.testing.assert_array_equal(a[:, step:], b[:, :378 - step])
    assert abs(int(crops[0].mean()) - int(img.mean())) < 8  # the global view is the whole image


def test_12_megapixel_preprocessing_tiles_it_and_keeps_flat_regions_flat():
    # (Its speed is the bench's: bench/RESULTS.md, "Moondream crops"; a test on a shared CI machine
    # cannot time it.)
    img = np.random.default_rng(0).integers(0, 256, (3000, 4000, 3), dtype=np.uint8)
    crops, tiling = image_crops.make_crops(img)
    assert tiling == (2, 4)
    assert crops.shape == (1 + 2 * 4, 378, 378, 3) and crops.dtype == np.uint8
    # Lanczos' weights sum to one: a uniform region stays uniform, no ringing.
    flat = np.full((3000, 4000, 3), 77, np.uint8)
    assert np.all(image_crops.make_crops(flat)[0] == 77)


def test_image_inputs_and_errors():
    from PIL import Image
    rgb = np.random.default_rng(1).integers(0, 256, (40, 60, 3), dtype=np.uint8)
    np.testing.assert_array_equal(image_crops.to_rgb_array(rgb[:, :, ::-1].copy(), "bgr"), rgb)
    np.testing.assert_array_equal(image_crops.to_rgb_array(Image.fromarray(rgb)), rgb)
    rgba = np.concatenate([rgb, np.full((40, 60, 1), 9, np.uint8)], -1)
    np.testing.assert_array_equal(image_crops.to_rgb_array(rgba), rgb)
    gray = rgb[:, :, 0].copy()
    assert image_crops.to_rgb_array(gray).shape == (40, 60, 3)
    for bad, msg in [(np.zeros((0, 10, 3), np.uint8), "zero size"), (rgb.astype(np.float32), "uint8"),
                     (np.zeros((4, 4, 2), np.uint8), "shape"), (np.zeros((2, 4, 4, 3), np.uint8), "shape"),
                     ([[1, 2]], "numpy array")]:
        with pytest.raises(ValueError, match=msg):
            image_crops.to_rgb_array(bad)
    with pytest.raises(ValueError, match="channel_order"):
        image_crops.to_rgb_array(rgb, "rgba")


def test_stitch_keeps_centres_and_outer_margins():
    g, m, c = 27, 4, 1
    rows, cols = 2, 3
    local = torch.arange(rows * cols, dtype=torch.float32).view(-1, 1, 1, 1).expand(-1, g, g, c).clone()
    out = vision.stitch(local, (rows, cols), m)
    step = g - 2 * m
    assert out.shape == (rows * step + 2 * m, cols * step + 2 * m, c)
    # Each output cell comes from the crop whose kept window covers it.
    for yy in range(out.shape[0]):
        i = min(max(yy - m, 0) // step, rows - 1)
        for xx in range(out.shape[1]):
            j = min(max(xx - m, 0) // step, cols - 1)
            assert out[yy, xx, 0] == i * cols + j


def test_both_namings_normalize_to_the_same_tensors():
    sd = mf.random_state(mf.small_config(), seed=3)
    new = weights.normalize_names({"model." + k: v for k, v in sd.items()})
    old = weights.normalize_names(mf.to_old_names(sd))
    assert set(new) == set(old) == set(sd)
    for k in sd:
        assert torch.equal(new[k], sd[k]) and torch.equal(old[k], sd[k]), k
    with pytest.raises(ValueError, match="Moondream 3 .*photon_core.models.moondream3"):
        weights.normalize_names({"text_model.transformer.h.4.mlp.experts.weight": torch.zeros(1)})


def test_resolution_errors_say_where_and_how(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    with pytest.raises(FileNotFoundError) as e:
        weights.resolve("moondream2")
    assert "`hf download vikhyatk/moondream2`" in str(e.value)
    assert str(tmp_path / "hf" / "hub" / "models--vikhyatk--moondream2") in str(e.value)
    with pytest.raises(FileNotFoundError, match="`hf download "):
        weights.resolve(tmp_path)  # empty folder
    with pytest.raises(ValueError, match="Moondream 3 .*load_moondream3"):
        weights.resolve("moondream3-preview")
    with pytest.raises(ValueError, match="dtype"):
        weights.parse_dtype("int8")


def test_hf_cache_resolution(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    snap = tmp_path / "models--vikhyatk--moondream2" / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    (snap / "model.safetensors").write_bytes(b"")
    (tmp_path / "models--vikhyatk--moondream2" / "refs").mkdir()
    (tmp_path / "models--vikhyatk--moondream2" / "refs" / "main").write_text("abc123")
    for name in ("moondream2", "vikhyatk/moondream2"):
        ck = weights.resolve(name)
        assert ck.weights == snap / "model.safetensors" and ck.folder == snap
