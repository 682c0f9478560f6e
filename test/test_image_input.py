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
    """16-bit values in mode I are scaled as I;16; 8-bit data put in I (convert("I") of an L image)
    is read as 16-bit too, and is taken as 8-bit once given as L; mode F holds 0..1 (a float TIFF)
    or PIL's own 0..255 (convert("F"): it came out white); NaN is refused (it came out black)."""
    grey3 = np.repeat(GREY[:, :, None], 3, axis=2)
    _same_as(grey3, Image.fromarray(GREY.astype(np.int32) * 257))
    _same_as(np.rint(grey3 / 257.0).astype(np.uint8), Image.fromarray(GREY).convert("I"))
    _same_as(grey3, Image.fromarray(GREY).convert("I").convert("L"))
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


def test_hdr_highlights_do_not_black_out_a_float_image():
    """A float ("F") image was read as 0..255 data when its max passed 2: one HDR highlight at 2.5
    turned every pixel of a 0.5 grey image black. Highlights are clipped; the rest stays put."""
    hdr = np.full((10, 10), 0.5, np.float32)
    hdr[0, 0] = 2.5
    hdr[1, :] = 6.0                                   # a tenth of the image, a lamp or the sky
    out = to_rgb(Image.fromarray(hdr))[..., 0]
    assert out[0, 0] == 255 and (out[1] == 255).all()
    assert (out[2:] == 128).all() and (out[0, 1:] == 128).all()


def test_pils_own_float_images_stay_0_to_255_when_dark():
    """convert("F") of an 8-bit image is on 0..255 however dark the frame (median 0..2 here)."""
    dark = np.zeros((10, 10), np.uint8)
    dark[:4] = 1
    dark[0, :3] = (40, 200, 255)
    _same_as(np.repeat(dark[:, :, None], 3, axis=2), Image.fromarray(dark).convert("F"))


def test_mode_I_scale_does_not_depend_on_the_frames_values():
    """Mode I was read as 8-bit when its values were up to 255 and 16-bit otherwise: a frame of
    200s came out 200 with a max of 255 and 1 with one pixel at 300 (257x flicker in a stream)."""
    frame = np.full((4, 4), 200, np.int32)
    outs = []
    for top in (255, 300, 65535):
        frame[0, 0] = top
        outs.append(to_rgb(Image.fromarray(frame))[1:, 1:])
    for out in outs:
        np.testing.assert_array_equal(out, 1)          # rint(200 / 257): 16-bit data


def test_mode_I_bit_depth_from_the_decoder(tmp_path):
    """A 32-bit TIFF says its depth and is scaled by it, whatever its values (with a max of 300
    it was read as 16-bit); a 16-bit PGM (PIL opens it as I) with dark values is 16-bit data (it
    was read as 8-bit: 257x too bright)."""
    import cv2
    for top in (300, 2**31 - 1):
        Image.fromarray(np.array([[0, 300, top]], np.int32)).save(tmp_path / "i32.tif")
        with Image.open(tmp_path / "i32.tif") as im:
            assert im.mode == "I"
            np.testing.assert_array_equal(to_rgb(im)[0, :, 0], [0, 0, 0 if top == 300 else 127])
            if top > 65535:   # a copy has no file format: its values still say 32 bits (were clipped white)
                np.testing.assert_array_equal(to_rgb(im.crop((0, 0, 3, 1)))[0, :, 0], [0, 0, 127])
    dark = np.full((4, 4), 200, np.uint16)
    cv2.imwrite(str(tmp_path / "dark.pgm"), dark)
    with Image.open(tmp_path / "dark.pgm") as im:
        assert im.mode == "I"
        assert (to_rgb(im) == 1).all()


def test_a_deep_images_transparent_key_composites_onto_white(tmp_path):
    """A 16-bit PNG's transparency key (PIL opens it as I;16, the key in info) stayed black under
    alpha="white", while read_image(keep_alpha=True) marked the pixel transparent."""
    from photon_core.image_io import read_image
    Image.fromarray(np.array([[0, 65535, 257 * 9]], np.uint16)).save(tmp_path / "t16.png", transparency=0)
    with Image.open(tmp_path / "t16.png") as im:
        assert im.mode == "I;16" and im.info["transparency"] == 0
        white = to_rgb(im, alpha="white")
        dropped = to_rgb(im)
    np.testing.assert_array_equal(white[0, :, 0], [255, 255, 9])
    np.testing.assert_array_equal(dropped[0, :, 0], [0, 255, 9])
    rgba = read_image(tmp_path / "t16.png", keep_alpha=True)
    np.testing.assert_array_equal(white, to_rgb(rgba, alpha="white"))
