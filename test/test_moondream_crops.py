"""Moondream's crops and their normalisation, as the makers make them (issue 41; image_crops.py's
docstring): no reference checkout needed.

Moondream 2: both resizes (the tiles' canvas and the global crop) are PIL's Lanczos-3 of the original
image, byte for byte; the normalisation is the public reference's, to [-1, 1] in bfloat16 then cast,
checked against a bfloat16 rounding written here in numpy. Moondream 3: kestrel's choices (its native
resize where installed; the normalisation in the model's dtype). The logit-level comparison with the
reference is test_moondream_reference.py's (MOONDREAM_REF_SRC)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

import moondream_fixtures as mf
from photon_core.models.moondream import image_crops, load_moondream, vision
from photon_core.models.moondream.model import MoondreamModel
from photon_core.models.moondream3.model import Moondream3Model

MARGIN, WINDOW = 4 * 14, 378 - 2 * 4 * 14


def frame(h: int, w: int, seed: int) -> np.ndarray:
    """A fixed picture: smooth shapes plus noise (resamplers differ most on detail)."""
    y, x = np.mgrid[0:h, 0:w]
    smooth = np.stack([128 + 100 * np.sin(x / 9 + c) * np.cos(y / 13 - c) for c in range(3)], -1)
    noise = np.random.default_rng(seed).normal(0, 25, smooth.shape)
    return np.clip(smooth + noise, 0, 255).astype(np.uint8)


def lanczos(image: np.ndarray, h: int, w: int) -> np.ndarray:
    return np.asarray(Image.fromarray(image).resize((w, h), Image.Resampling.LANCZOS))


def expected_crops(image: np.ndarray, rows: int, cols: int, resize=lanczos) -> np.ndarray:
    """The global crop and the tiles, each resize from `image` itself (the reference's layout)."""
    canvas = resize(image, rows * WINDOW + 2 * MARGIN, cols * WINDOW + 2 * MARGIN)
    tiles = [canvas[i * WINDOW:i * WINDOW + 378, j * WINDOW:j * WINDOW + 378] for i in range(rows) for j in range(cols)]
    return np.stack([resize(image, 378, 378)] + tiles)


# Smaller than a crop (enlarged), tall and narrow, one side each way, larger than the canvas
# (shrunk; big enough for the two-thread path), and a frame that is enlarged to a 2x4 canvas.
@pytest.mark.parametrize("h,w,tiling", [(200, 250, (1, 1)), (520, 300, (1, 1)), (1080, 1440, (3, 3)),
                                        (480, 640, (2, 4))])
def test_crops_are_pil_lanczos3_of_the_original(h, w, tiling):
    image = frame(h, w, seed=h + w)
    crops, got_tiling = image_crops.make_crops(image)
    assert got_tiling == tiling
    want = expected_crops(image, *tiling)
    assert crops.shape == want.shape and crops.dtype == np.uint8
    for i, (a, b) in enumerate(zip(crops, want)):
        assert np.array_equal(a, b), f"crop {i}: {int(np.abs(a.astype(int) - b).max())} levels from PIL's"
    if tiling != (1, 1):   # the global crop is the original's, not the canvas's resized again
        canvas = lanczos(image, tiling[0] * WINDOW + 2 * MARGIN, tiling[1] * WINDOW + 2 * MARGIN)
        from_canvas = lanczos(canvas, 378, 378)
        assert not np.array_equal(crops[0], from_canvas)


# A frame enlarged to a 2x4 canvas and shrunk to its global crop; one enlarged to a single crop.
@pytest.mark.parametrize("h,w", [(480, 640), (200, 250)])
def test_crops_made_on_a_device_are_pils_bytes(h, w):
    """The GPU's path (runtime/lanczos.py: PIL's arithmetic as torch ops), run here on the CPU,
    gives PIL's bytes crop for crop."""
    image = frame(h, w, seed=7)
    want, tiling = image_crops.make_crops(image)
    got, got_tiling = image_crops.make_crops(image, device="cpu")
    assert isinstance(got, torch.Tensor) and got.dtype == torch.uint8 and got_tiling == tiling
    assert np.array_equal(got.numpy(), want)
    both = image_crops.stacked([want, got], torch.device("cpu"))
    assert isinstance(both, torch.Tensor) and torch.equal(both, torch.cat([torch.from_numpy(want), got]))


def test_lanczos_on_torch_is_pils_resize_at_any_sizes():
    """Shrinking, enlarging, one axis each way, sizes of 1, 3 and odd ratios: the bytes of the
    installed Pillow, whichever pass it runs first for the sizes (lanczos.pil_order finds out;
    Pillow 13 runs the vertical one first for some, e.g. 500x3 -> 10x7)."""
    from photon_core.runtime import lanczos as lz

    rng = np.random.default_rng()
    sizes = [((500, 3), (10, 7)), ((1, 1), (5, 9)), ((64, 64), (64, 33)), ((37, 53), (120, 90)), ((97, 12), (23, 29))]
    sizes += [((int(a), int(b)), (int(c), int(d))) for a, b, c, d in rng.integers(2, 90, (6, 4))]
    for (h, w), (oh, ow) in sizes:
        image = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        order = lz.pil_order(h, w, oh, ow)
        # None: both orders gave PIL's bytes on the probes (a 1-pixel source), and PIL resizes
        for o in [order] if order else lz.ORDERS:
            got = lz.resize_lanczos3(torch.from_numpy(image), oh, ow, o).numpy()
            assert np.array_equal(got, lanczos(image, oh, ow)), ((h, w), (oh, ow), o)


def test_make_crops_takes_any_layout_of_the_pixels():
    image = frame(300, 420, seed=3)
    a, _ = image_crops.make_crops(image)
    b, _ = image_crops.make_crops(np.asfortranarray(image))          # not C-contiguous
    c, _ = image_crops.make_crops(image[:, :, ::-1][:, :, ::-1])     # a negative-stride view
    assert np.array_equal(a, b) and np.array_equal(a, c)
    with pytest.raises(ValueError, match="resampler"):
        image_crops.make_crops(image, resampler="cv2")


def bfloat16(x: np.ndarray) -> np.ndarray:
    """float32 -> the nearest bfloat16 (ties to even), as float32: the top 16 bits, rounded."""
    bits = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.astype(np.uint32).view(np.float32)


def test_normalisation_is_a_bfloat16_round_trip():
    """Every pixel value: x / 255, - 0.5, / 0.5, each step rounded to bfloat16 (the reference's
    prepare_crops), then cast; laid out [N, 3, H, W]."""
    values = np.arange(256, dtype=np.float32)
    want = bfloat16(bfloat16(values / np.float32(255)) - np.float32(0.5)) / np.float32(0.5)
    crops = np.stack([np.arange(256, dtype=np.uint8).reshape(16, 16),
                      np.arange(256, dtype=np.uint8).reshape(16, 16).T,
                      np.full((16, 16), 7, np.uint8)], -1)[None]
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        out = vision.normalize(crops, dtype, "cpu")
        assert out.shape == (1, 3, 16, 16) and out.dtype == dtype
        np.testing.assert_array_equal(out[0, 0].float().numpy().ravel(), want)
        np.testing.assert_array_equal(out[0, 1].float().numpy(), want.reshape(16, 16).T)
        assert torch.all(out[0, 2] == float(want[7]))
    # In float32 throughout (kestrel's way for Moondream 3, in a float32 model) most values differ.
    direct = vision.normalize(crops, torch.float32, "cpu", via=None)[0, 0].numpy().ravel()
    np.testing.assert_array_equal(direct, (values / np.float32(255) - np.float32(0.5)) / np.float32(0.5))
    assert (direct != want).sum() > 200 and np.abs(direct - want).max() < 4e-3


def test_each_family_makes_its_makers_crops():
    assert (MoondreamModel.resampler, MoondreamModel.normalize_via) == ("pil", torch.bfloat16)
    assert (Moondream3Model.resampler, Moondream3Model.normalize_via) == ("pil", None)


@pytest.fixture(scope="module")
def model():
    return load_moondream(mf.checkpoint(), device="cpu", dtype=torch.float32)


def test_crops_made_ahead_answer_as_the_image(model):
    """MoondreamModel.prepare (a camera's thread) -> Crops: any skill takes it as its image, with the
    same result as the image itself; crops made for another recipe are refused."""
    image = frame(480, 640, seed=9)
    made = model.prepare(image)
    assert made.tiling == (2, 4) and np.array_equal(made.crops, image_crops.make_crops(image)[0])
    settings = {"max_objects": 3}
    assert model.detect(made, "cup", settings=settings) == model.detect(image, "cup", settings=settings)
    bgr = model.prepare(np.ascontiguousarray(image[:, :, ::-1]), channel_order="bgr")
    assert np.array_equal(bgr.crops, made.crops)
    other = image_crops.Crops(made.crops, made.tiling, "pil", 364, 14, 4, 12)   # another model's crop size
    with pytest.raises(ValueError, match="another model"):
        model.encode_image(other)
