"""Image files for the command line (photon_core.image_io): 16-bit and float images scaled to 8
bits, not clipped to white; sizes refused from the header, before any pixel is decoded."""
import struct
import zlib

import cv2
import numpy as np
import pytest
from PIL import Image

from photon_core.image_io import MAX_PIXELS, ImageFileError, check_writable_image, read_image


def header_only_png(path, width, height):
    """A PNG declaring width x height grey pixels whose data holds one row: decoding it would fail,
    so only a refusal from the header can name its size."""
    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0))
                     + chunk(b"IDAT", zlib.compress(b"\0" * (width + 1))) + chunk(b"IEND", b""))
    return path


def ramp16(h=24, w=40):
    return np.linspace(0, 65535, h * w).reshape(h, w).astype(np.uint16)


def test_16_bit_grey_png_and_pgm_are_scaled_not_clipped(tmp_path):
    deep = ramp16()
    expected = np.rint(deep / 257.0).astype(np.uint8)
    for name in ("g.png", "g.pgm", "g.tif"):
        cv2.imwrite(str(tmp_path / name), deep)
        rgb = read_image(tmp_path / name)
        assert rgb.shape == (*deep.shape, 3) and rgb.dtype == np.uint8, name
        np.testing.assert_array_equal(rgb[..., 0], expected, err_msg=name)
        np.testing.assert_array_equal(rgb[..., 0], rgb[..., 2])
        assert (rgb == 255).mean() < 0.01, name    # the old path made 99.5% of it white


def test_16_bit_colour_and_float_images(tmp_path):
    deep = ramp16()
    bgr = np.stack([deep // 4, deep // 2, deep], -1)          # red is the full ramp
    cv2.imwrite(str(tmp_path / "c.png"), bgr)
    rgb = read_image(tmp_path / "c.png")
    np.testing.assert_allclose(rgb[..., 0].astype(int), deep / 257.0, atol=1)
    np.testing.assert_allclose(rgb[..., 2].astype(int), deep / 4 / 257.0, atol=1)

    level = np.linspace(0, 1, 24 * 40, dtype=np.float32).reshape(24, 40)
    level[0, 0], level[0, 1] = 1.5, -0.5                       # out of [0, 1]: clipped
    Image.fromarray(level).save(tmp_path / "f.tif")
    rgb = read_image(tmp_path / "f.tif")
    np.testing.assert_array_equal(rgb[..., 1].ravel()[2:], np.rint(level.ravel()[2:] * 255).astype(np.uint8))
    assert rgb[0, 0, 0] == 255 and rgb[0, 1, 0] == 0


@pytest.mark.parametrize("width, height", [(20000, 20000), (10000, 10000)])
def test_a_huge_image_is_refused_from_its_header_with_the_limit(tmp_path, width, height):
    # 20000^2 is past PIL's own refusal (twice its limit), 10000^2 only past its warning. Had the
    # pixels been decoded, the missing rows would have raised "truncated" instead.
    png = header_only_png(tmp_path / "big.png", width, height)
    with pytest.raises(ImageFileError) as err:
        read_image(png)
    message = str(err.value)
    assert message.startswith(f"{png}: ")
    assert f"{width * height // 10**6} Mpixel, over the limit of {MAX_PIXELS // 10**6} Mpixel: " \
           f"refused before decoding" in message


def test_unreadable_files_and_draw_paths_are_named(tmp_path):
    (tmp_path / "x.png").write_bytes(b"not an image")
    with pytest.raises(ImageFileError, match="x.png: cannot read it as an image"):
        read_image(tmp_path / "x.png")
    with pytest.raises(ImageFileError, match="is a directory, not an image file"):
        read_image(tmp_path)
    with pytest.raises(ImageFileError, match="cannot write an image with extension '.txt'"):
        check_writable_image(tmp_path / "out.txt")
    with pytest.raises(ImageFileError, match="the folder .*missing does not exist"):
        check_writable_image(tmp_path / "missing" / "out.png")
    assert check_writable_image(tmp_path / "out.jpg") == tmp_path / "out.jpg"


def test_transparency_is_kept_for_the_model_when_asked(tmp_path):
    """The CLI keeps a file's alpha for the model (Gemma 4 and Qwen 3.5 composite it onto white as
    their processors do; it was dropped before they saw it); without transparency, RGB as ever."""
    rgba = np.random.default_rng(6).integers(0, 256, (6, 9, 4), dtype=np.uint8)
    Image.fromarray(rgba).save(tmp_path / "a.png")
    np.testing.assert_array_equal(read_image(tmp_path / "a.png", keep_alpha=True), rgba)
    np.testing.assert_array_equal(read_image(tmp_path / "a.png"), rgba[..., :3])
    Image.fromarray(rgba[..., :3]).save(tmp_path / "b.png")
    assert read_image(tmp_path / "b.png", keep_alpha=True).shape == (6, 9, 3)
