"""runtime.image_input: every accepted form of an image gives the same [H, W, 3] uint8 RGB array,
every refusal is a ValueError saying why, and the four vision families take images through it
with the same `encode_image(image, channel_order)`."""
from __future__ import annotations

import inspect

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
