"""photon_core.svg_path against polygons and pixel counts computed by hand: every command, absolute
and relative, implicit repetitions, S/T reflections, arcs in centre form, errors; the nonzero fill
at pixel centres; unit square -> bbox -> pixels; and draw_segment's blend and outline staying inside
the box."""
import math

import numpy as np
import pytest

from photon_core import svg_path
from photon_core.draw import MASK_ALPHA, draw_results, draw_segment


def poly(d, steps=2):
    (p,) = svg_path.polygons(d, curve_steps=steps)
    return p


def test_lines_absolute_relative_and_implicit():
    np.testing.assert_allclose(poly("M 0 0 L 1 0 L 1 1 Z"), [[0, 0], [1, 0], [1, 1], [0, 0]])
    # m, then l's pairs, h, v, z: a 0.5 square at (0.1, 0.2), closed back to its start
    np.testing.assert_allclose(poly("m 0.1 0.2 l 0.5 0 0 0.5 h -0.5 v -0.5 z"),
                               [[0.1, 0.2], [0.6, 0.2], [0.6, 0.7], [0.1, 0.7], [0.1, 0.2], [0.1, 0.2]])
    np.testing.assert_allclose(poly("M 0 0 1 0 1 1"), [[0, 0], [1, 0], [1, 1]])   # pairs after M are L
    np.testing.assert_allclose(poly("M0,0H.5V.25"), [[0, 0], [0.5, 0], [0.5, 0.25]])
    assert svg_path.parse("M.5.5L-1e-1,2") == [("M", [0.5, 0.5]), ("L", [-0.1, 2.0])]
    assert svg_path.parse("m 1 2 3 4") == [("m", [1, 2]), ("l", [3, 4])]


def test_curves_at_their_midpoints():
    # Q: t = 1/2 gives 1/4 p0 + 1/2 c + 1/4 p1
    np.testing.assert_allclose(poly("M 0 0 Q 1 0 1 1"), [[0, 0], [0.75, 0.25], [1, 1]])
    # C: t = 1/2 gives (p0 + 3 c1 + 3 c2 + p1) / 8
    np.testing.assert_allclose(poly("M 0 0 C 0 1 1 1 1 0"), [[0, 0], [0.5, 0.75], [1, 0]])
    np.testing.assert_allclose(poly("M 0.5 0.5 c 0 1 1 1 1 0"), [[0.5, 0.5], [1, 1.25], [1.5, 0.5]])
    # S reflects the last control point (1, 1) about (1, 0): c1 = (1, -1)
    np.testing.assert_allclose(poly("M 0 0 C 0 1 1 1 1 0 S 2 -1 2 0"),
                               [[0, 0], [0.5, 0.75], [1, 0], [1.5, -0.75], [2, 0]])
    # S after a line: its first control point is the current point
    np.testing.assert_allclose(poly("M 0 0 L 1 0 s 1 1 1 0"), [[0, 0], [1, 0], [1.5, 0.375], [2, 0]])
    # T reflects Q's control (1, 0) about (1, 1): c = (1, 2)
    np.testing.assert_allclose(poly("M 0 0 Q 1 0 1 1 T 2 2"),
                               [[0, 0], [0.75, 0.25], [1, 1], [1.25, 1.75], [2, 2]])
    np.testing.assert_allclose(poly("M 0 0 Q 1 0 1 1 t 1 1"), poly("M 0 0 Q 1 0 1 1 T 2 2"))


def test_arcs():
    # Half circle about (0.5, 0.5) from the left to the right point; sweep 1 is the positive angle
    # direction, which with y down passes through the top (0.5, 0).
    np.testing.assert_allclose(poly("M 0 0.5 A 0.5 0.5 0 0 1 1 0.5"), [[0, 0.5], [0.5, 0], [1, 0.5]], atol=1e-12)
    np.testing.assert_allclose(poly("M 0 0.5 a 0.5 0.5 0 0 0 1 0"), [[0, 0.5], [0.5, 1], [1, 0.5]], atol=1e-12)
    # Radii too small are scaled up: the same half circle
    np.testing.assert_allclose(poly("M 0 0.5 A 0.1 0.1 0 0 1 1 0.5"), [[0, 0.5], [0.5, 0], [1, 0.5]], atol=1e-12)
    # Quarter of an ellipse rotated by 90 degrees: rx = 2 along y, ry = 1 along x, from (0, -2) to (1, 0)
    p = poly("M 0 -2 A 2 1 90 0 1 1 0", steps=4)
    x, y = p[:, 0], p[:, 1]
    np.testing.assert_allclose(x ** 2 + (y / 2) ** 2, 1.0, atol=1e-12)   # every point on the ellipse
    # Large-arc flag: three quarters of the unit circle about (0, 0) from (1, 0) to (0, 1)
    # centre (0, 0), sweep 0 (negative angles), the long way: angles 0, -pi/2, -pi, -3pi/2
    np.testing.assert_allclose(poly("M 1 0 A 1 1 0 1 0 0 1", steps=3), [[1, 0], [0, -1], [-1, 0], [0, 1]],
                               atol=1e-12)
    # the short way (large 0) with the same sweep: centre (1, 1), a quarter turn
    np.testing.assert_allclose(poly("M 1 0 A 1 1 0 0 0 0 1", steps=1), [[1, 0], [0, 1]], atol=1e-12)
    mid = poly("M 1 0 A 1 1 0 0 0 0 1", steps=2)[1]
    np.testing.assert_allclose(mid, [1 - math.sqrt(0.5), 1 - math.sqrt(0.5)], atol=1e-12)
    np.testing.assert_allclose(poly("M 0 0 A 0 1 0 0 1 1 1"), [[0, 0], [1, 1]])   # zero radius: a line
    # a radius whose square overflows a float (OverflowError before): as straight as a line
    np.testing.assert_allclose(poly("M 0 0 A 1e308 1e308 0 0 0 1 1"), [[0, 0], [1, 1]])


def test_subpaths_and_what_segment_emits():
    polys = svg_path.polygons("M 0 0 L 1 0 L 1 1 Z M 2 2 L 3 2 L 3 3 z l 1 0 0 1")
    assert len(polys) == 3
    np.testing.assert_allclose(polys[1][0], [2, 2])
    np.testing.assert_allclose(polys[2], [[2, 2], [3, 2], [3, 3]])   # after z: from the subpath's start
    # segment.py's output (test_moondream3_skills' scripted path)
    d = "M 0.1 0.2 L -0.05 1 C 0.001 0.002 0.003 0.004 0.005 0.006 z"
    assert [c for c, _ in svg_path.parse(d)] == ["M", "L", "C", "z"]


def test_errors_strict_and_lenient():
    with pytest.raises(ValueError, match="groups of 2"):
        svg_path.parse("M 0 0 L 1")
    assert svg_path.parse("M 0 0 L 1 1 1", strict=False) == [("M", [0, 0]), ("L", [1, 1])]
    with pytest.raises(ValueError, match="start each segment with a command"):
        svg_path.parse("12 M 0 0")
    with pytest.raises(ValueError, match="not SVG path data"):
        svg_path.parse("M 0 0 L 1 1 ?")
    assert svg_path.parse("M 0 0 L 1 1 ?", strict=False) == [("M", [0, 0]), ("L", [1, 1])]
    with pytest.raises(ValueError, match="no arguments"):
        svg_path.parse("M 0 0 Z 1 2")
    assert svg_path.polygons("") == [] and svg_path.polygons("M 1 1") == []


def test_to_pixels():
    (p,) = svg_path.to_pixels([np.array([[0.0, 0.0], [1.0, 0.5]])],
                              {"x_min": 0.25, "y_min": 0.5, "x_max": 0.75, "y_max": 1.0}, 200, 100)
    np.testing.assert_allclose(p, [[50, 50], [150, 75]])


def test_fill_counts_pixel_centres():
    box = {"x_min": 0.25, "y_min": 0.25, "x_max": 0.75, "y_max": 0.75}
    mask, _ = svg_path.rasterise("M 0 0 H 1 V 1 H 0 Z", box, 8, 8)
    want = np.zeros((8, 8), bool)
    want[2:6, 2:6] = True
    np.testing.assert_array_equal(mask, want)
    # Right triangle over the whole 100 x 100 image: centres (c + .5, r + .5) with c + r + 1 < 100,
    # i.e. c + r <= 98: 99 + 98 + ... + 1 = 4950 pixels (area 5000 less the half-covered diagonal).
    full = {"x_min": 0.0, "y_min": 0.0, "x_max": 1.0, "y_max": 1.0}
    mask, _ = svg_path.rasterise("M 0 0 L 1 0 L 0 1 Z", full, 100, 100)
    assert mask.sum() == 4950
    r, c = np.nonzero(mask)
    assert (c + r <= 98).all()
    # No Z: a fill closes the subpath all the same
    assert svg_path.rasterise("M 0 0 L 1 0 L 0 1", full, 100, 100)[0].sum() == 4950
    # A circle of radius 0.4 (two arcs) in a 200 x 100 box: area pi * 80 * 40 px within 1%
    mask, _ = svg_path.rasterise("M 0.1 0.5 A 0.4 0.4 0 0 1 0.9 0.5 A 0.4 0.4 0 0 1 0.1 0.5 Z",
                                 full, 200, 100, curve_steps=64)
    assert mask.sum() == pytest.approx(math.pi * 80 * 40, rel=0.01)
    assert mask[50, 100] and not mask[5, 5]
    # Nonzero winding: a square inside another, the same way round, stays filled; reversed, a hole.
    outer, same, reverse = "M 0 0 H 1 V 1 H 0 Z", " M .25 .25 H .75 V .75 H .25 Z", " M .25 .25 V .75 H .75 V .25 Z"
    assert svg_path.rasterise(outer + same, full, 8, 8)[0].sum() == 64
    assert svg_path.rasterise(outer + reverse, full, 8, 8)[0].sum() == 64 - 16
    # Off the image: cut, never an error
    mask, _ = svg_path.rasterise("M -1 -1 H 0.5 V 0.5 H -1 Z", full, 10, 10)
    assert mask.sum() == 25 and mask[:5, :5].all()


def test_draw_segment_blends_inside_the_box():
    rgb = np.zeros((60, 80, 3), np.uint8)
    result = {"path": "M 0.5 0 L 1 0.5 L 0.5 1 L 0 0.5 Z",
              "bbox": {"x_min": 0.25, "y_min": 0.2, "x_max": 0.75, "y_max": 0.7}}
    color = (255, 64, 64)
    out = draw_segment(rgb.copy(), result, color)
    changed = np.nonzero(out.any(-1))
    assert len(changed[0])
    # box in pixels: columns 20..59, rows 12..41
    assert changed[1].min() >= 20 and changed[1].max() <= 59 and changed[0].min() >= 12 and changed[0].max() <= 41
    inside = out[27, 40]   # the diamond's centre: blended, not outlined
    np.testing.assert_array_equal(inside, np.rint(np.array(color) * MASK_ALPHA))
    outline = out[12, 40]  # the top vertex: the outline's full colour
    np.testing.assert_array_equal(outline, color)
    # No box or no path: nothing to place, nothing drawn; draw_results takes segments by label
    assert not draw_segment(rgb.copy(), {"path": result["path"], "bbox": None}, color).any()
    assert not draw_segment(rgb.copy(), {"path": "", "bbox": result["bbox"]}, color).any()
    np.testing.assert_array_equal(draw_results(rgb, {}, {}, {"cup": result}), out)
