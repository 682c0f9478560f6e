"""runtime.image_input: every accepted form of an image gives the same [H, W, 3] uint8 RGB array,
every refusal is a ValueError saying why, and the four vision families take images through it
with the same `encode_image(image, channel_order)`."""
from __future__ import annotations

import inspect
import warnings

import numpy as np
import pytest
from PIL import Image

from photon_core.runtime.image_input import MAX_PIXELS, to_rgb

RGB = np.random.default_rng(3).integers(0, 256, (5, 7, 3), dtype=np.uint8)
ALPHA = np.full((5, 7, 1), 9, np.uint8)
GREY = RGB[:, :, 1].copy()


def _same_as(expected: np.ndarray, image, channel_order: str = "rgb") -> None:
    out = to_rgb(image, channel_order)
    assert out.dtype == np.uint8 and out.shape == expected.shape and out.flags.c_contiguous
    np.testing.assert_array_equal(out, expected)


@pytest.mark.parametrize("image,order", [
    (RGB, "rgb"),
    (RGB[:, :, ::-1], "bgr"),                                         # OpenCV / ROS bgr8, a strided view
    (np.concatenate([RGB, ALPHA], -1), "rgb"),                        # RGBA: alpha dropped
    (np.concatenate([RGB[:, :, ::-1], ALPHA], -1), "bgr"),            # BGRA
    (RGB.astype(np.uint16) * 257, "rgb"),                             # 16-bit: scaled by 255 / 65535
    ((RGB.astype(np.uint16) * 257)[:, :, ::-1], "bgr"),
    (RGB / 255.0, "rgb"),                                             # float in [0, 1], any width
    ((RGB / 255.0).astype(np.float32), "rgb"),
    ((RGB / 255.0).astype(np.float16), "rgb"),
    (Image.fromarray(RGB), "rgb"),
    (Image.fromarray(np.concatenate([RGB, ALPHA], -1)), "rgb"),
], ids=["rgb", "bgr", "rgba", "bgra", "uint16", "uint16_bgr", "float64", "float32", "float16", "pil", "pil_rgba"])
def test_colour_forms_give_the_canonical_array(image, order):
    _same_as(RGB, image, order)


@pytest.mark.parametrize("image,order", [
    (GREY, "rgb"), (GREY, "bgr"), (GREY[:, :, None], "rgb"), (GREY.astype(np.uint16) * 257, "rgb"),
    (GREY / 255.0, "rgb"), (Image.fromarray(GREY), "rgb"),
    (Image.fromarray(GREY.astype(np.uint16) * 257), "rgb"),          # PIL I;16 is scaled, not clipped
], ids=["grey", "grey_bgr", "grey_hw1", "grey_uint16", "grey_float", "pil_L", "pil_I16"])
def test_grey_forms_give_three_equal_channels(image, order):
    _same_as(np.repeat(GREY[:, :, None], 3, axis=2), image, order)


def test_rounding_of_deep_values():
    np.testing.assert_array_equal(to_rgb(np.array([[0, 128, 65535]], np.uint16))[0, :, 0], [0, 0, 255])
    np.testing.assert_array_equal(to_rgb(np.array([[0.0, 0.5, 1.0]]))[0, :, 0], [0, 128, 255])


@pytest.mark.parametrize("image,order,message", [
    ([[1, 2]], "rgb", "numpy array .* or a PIL image, got list"),
    (np.zeros((0, 10, 3), np.uint8), "rgb", r"zero size \(10x0\)"),
    (Image.new("RGB", (0, 4)), "rgb", r"zero size \(0x4\)"),
    (np.zeros((4, 4, 2), np.uint8), "rgb", r"\[H, W, 3\] \(RGB\).*got shape \(4, 4, 2\)"),
    (np.zeros((2, 4, 4, 3), np.uint8), "rgb", r"got shape \(2, 4, 4, 3\)"),
    (np.zeros((4,), np.uint8), "rgb", r"got shape \(4,\)"),
    (np.zeros((4, 4, 3), np.int32), "rgb", "dtype int32 is not accepted: give uint8"),
    (np.zeros((4, 4, 3), bool), "rgb", "dtype bool is not accepted"),
    (np.full((4, 4, 3), np.nan, np.float32), "rgb", "NaN or infinite"),
    (RGB.astype(np.float32), "rgb", r"values in \[0, 1\], got 0..255; give 0..255 data as uint8"),
    (np.full((4, 4), -0.5), "rgb", r"got -0.5..-0.5"),
    (RGB, "rgba", "channel_order must be 'rgb' or 'bgr', got 'rgba'"),
    (Image.fromarray(RGB), "bgr", "PIL images are RGB"),
    (np.broadcast_to(np.uint8(0), (9000, 10000, 3)), "rgb", "10000x9000 .* over the limit of 89 Mpixel"),
], ids=["list", "empty", "pil_empty", "two_channels", "4d", "1d", "int32", "bool", "nan", "float_0_255",
        "negative", "channel_order", "pil_bgr", "too_large"])
def test_refusals_say_why(image, order, message):
    with pytest.raises(ValueError, match=message):
        to_rgb(image, order)


def test_the_pixel_limit_is_pils_decompression_bomb_threshold():
    assert MAX_PIXELS == Image.MAX_IMAGE_PIXELS


def test_every_vision_family_takes_images_the_same_way():
    from photon_core.models.gemma4.model import Gemma4Model
    from photon_core.models.moondream.model import MoondreamModel
    from photon_core.models.moondream3.model import Moondream3Model
    from photon_core.models.qwen3_5.model import Qwen35Model

    for model in (MoondreamModel, Moondream3Model, Qwen35Model, Gemma4Model):
        # image first; channel_order by keyword everywhere (Moondream's second argument is the
        # reference's `settings`), "rgb" by default
        params = inspect.signature(model.encode_image).parameters
        assert list(params)[:2] == ["self", "image"], model
        assert params["channel_order"].default == "rgb", model
        assert params["channel_order"].kind in (inspect.Parameter.KEYWORD_ONLY,
                                                inspect.Parameter.POSITIONAL_OR_KEYWORD), model


def test_big_endian_uint16_arrays_are_taken():
    """ROS is_bigendian mono16 held as '>u2' was refused, told to pass uint16 (which it was)."""
    from photon_core.runtime.image_input import to_rgb
    big = np.full((4, 4), 32896, dtype=">u2")
    assert (to_rgb(big) == 128).all()


def test_deep_pil_modes_keep_pils_own_scale():
    """Mode I holding 8-bit values (Image.fromarray of an int32 array, convert("I") of an L image)
    is 8-bit data (it came out near black, divided by 257); 16-bit values in I are scaled as I;16;
    mode F holds 0..1 (a float TIFF) or PIL's own 0..255 (convert("F"): it came out white); NaN
    is refused (it came out black)."""
    grey3 = np.repeat(GREY[:, :, None], 3, axis=2)
    _same_as(grey3, Image.fromarray(GREY).convert("I"))
    _same_as(grey3, Image.fromarray(GREY.astype(np.int32) * 257))
    _same_as(grey3, Image.fromarray((GREY / 255.0).astype(np.float32)))
    _same_as(grey3, Image.fromarray(GREY).convert("F"))
    with pytest.raises(ValueError, match="NaN or infinite"):
        to_rgb(Image.fromarray(np.array([[0.5, np.nan]], np.float32)))


def test_transparency_onto_white_as_transformers_does():
    """alpha="white" (Gemma 4, Qwen 3.5) composites as transformers' convert_to_rgb, the
    processors' first step; the default drops alpha (the Moondream reference's convert("RGB"))."""
    from transformers.image_transforms import convert_to_rgb
    rgba = np.concatenate([RGB, np.random.default_rng(4).integers(0, 256, (5, 7, 1), dtype=np.uint8)], -1)
    palette = Image.fromarray(GREY).convert("P")
    palette.info["transparency"] = int(np.asarray(palette)[0, 0])
    for image in (Image.fromarray(rgba), Image.fromarray(rgba).convert("LA"), palette, rgba):
        np.testing.assert_array_equal(to_rgb(image, alpha="white"), convert_to_rgb(image, return_numpy=True))
    np.testing.assert_array_equal(to_rgb(Image.fromarray(rgba)), RGB)
    with pytest.raises(ValueError, match="alpha must be"):
        to_rgb(RGB, alpha="black")


def test_a_truncated_file_opened_lazily_is_a_value_error(tmp_path):
    import io
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(5).integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(buf, "PNG")
    path = tmp_path / "cut.png"
    path.write_bytes(buf.getvalue()[:len(buf.getvalue()) // 2])
    with pytest.raises(ValueError, match="could not be read"):
        to_rgb(Image.open(path))


def test_a_lazily_opened_image_whose_file_was_closed_is_a_value_error(tmp_path):
    """`with Image.open(path) as im:` and `im` used after the block: its pixels were never read and
    its file is closed; PIL failed with a bare AssertionError (no message at all)."""
    path = tmp_path / "frame.png"
    Image.fromarray(RGB).save(path)
    with Image.open(path) as after_with:
        pass
    closed = Image.open(path)
    closed.close()
    for image in (after_with, closed):
        with pytest.raises(ValueError, match="file was closed before its pixels were read"):
            to_rgb(image)
    with Image.open(path) as loaded:   # read inside the block: taken
        loaded.load()
    _same_as(RGB, loaded)


def test_finite_float_values_beyond_float32_are_out_of_range_not_infinite():
    """A float64 image holding 1e300 (finite) overflowed float32 on the way to the range check and
    was refused as "NaN or infinite values" (with numpy's overflow warning): it is out of [0, 1]."""
    image = np.zeros((4, 4, 3))
    image[0, 0, 0] = 1e300
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # no overflow in a cast on the way
        with pytest.raises(ValueError, match=r"values in \[0, 1\], got 0..1e\+300"):
            to_rgb(image)
