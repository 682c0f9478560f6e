"""SVG path data -> polygons -> a filled mask: what drawing a `segment` result needs.

A segment result (photon_core/models/moondream3/segment.py) is an SVG path whose coordinates are in
the unit square of its bounding box (0..1 across the box), and the box normalised to the image.
Placing it on the image is two affine maps: unit square -> box -> pixels.

    parse("M 0 0 L 1 0 ...")            -> [("M", [0.0, 0.0]), ("L", [1.0, 0.0]), ...]
    polygons(d)                          -> one (N, 2) float array per subpath, absolute coordinates,
                                            curves flattened into `curve_steps` straight pieces
    to_pixels(polys, bbox, w, h)         -> the same polygons in pixels of a w x h image
    fill_mask(polys_px, w, h)            -> (h, w) bool mask: pixel (col, row) is inside when its
                                            centre (col + 0.5, row + 0.5) is, by the nonzero rule
                                            (SVG's default fill-rule)

Every path command is understood, absolute and relative: M L H V C S Q T A Z (arcs are converted
to their centre form as in SVG 1.1 appendix F.6.5, then flattened). Pixel coordinates follow the
detections' convention: x_px = x_norm * width, so pixel column c covers [c, c + 1).
"""
from __future__ import annotations

import math
import re

import numpy as np

COMMANDS = "MmLlHhVvCcSsQqTtAaZz"
_ARITY = {"M": 2, "L": 2, "H": 1, "V": 1, "C": 6, "S": 4, "Q": 4, "T": 2, "A": 7, "Z": 0}
# A command letter, or a number (sign, digits with at most one point, exponent). "0.5.5" reads as
# 0.5 and .5, "1-2" as 1 and -2, as SVG's grammar says.
_TOKEN = re.compile(r"([MmLlHhVvCcSsQqTtAaZz])|([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)|([\s,]+)|(.)")
DEFAULT_CURVE_STEPS = 16


def parse(d: str, strict: bool = True) -> list[tuple[str, list[float]]]:
    """Path data -> (command, arguments) pairs, one per command application: implicit repetitions
    are split out ("L 0 0 1 1" gives two L), and extra pairs after a moveto are linetos (M -> L,
    m -> l), as SVG says. strict: ValueError naming what is not path data; otherwise, as SVG
    renderers do, the commands before the first error (a model's path may end mid-command)."""
    out: list[tuple[str, list[float]]] = []
    try:
        _parse_into(d, out)
    except ValueError:
        if strict:
            raise
    return out


def _parse_into(d: str, out: list[tuple[str, list[float]]]) -> None:
    tokens: list[str | float] = []
    for m in _TOKEN.finditer(d):
        cmd, num, _space, bad = m.groups()
        if bad is not None:
            # tokens before the bad character still count (strict=False keeps what precedes it)
            _commands(tokens, d, out)
            raise ValueError(f"not SVG path data: {bad!r} at {m.start()} in {d[:60]!r}")
        if cmd is not None:
            tokens.append(cmd)
        elif num is not None:
            tokens.append(float(num))
    _commands(tokens, d, out)


def _commands(tokens: list, d: str, out: list[tuple[str, list[float]]]) -> None:
    """Appends each command application to `out` as it is read, so that what precedes an error stays."""
    i = 0
    while i < len(tokens):
        cmd = tokens[i]
        if not isinstance(cmd, str):
            raise ValueError(f"SVG path data must start each segment with a command, got number {cmd} "
                             f"in {d[:60]!r}")
        i += 1
        args: list[float] = []
        while i < len(tokens) and not isinstance(tokens[i], str):
            args.append(float(tokens[i]))
            i += 1
        n = _ARITY[cmd.upper()]
        if n == 0:
            out.append((cmd, []))
            if args:
                raise ValueError(f"{cmd} takes no arguments, got {args} in {d[:60]!r}")
            continue
        for j in range(0, len(args) - n + 1, n):
            c = cmd
            if j and cmd in "Mm":   # pairs after a moveto are linetos
                c = "L" if cmd == "M" else "l"
            out.append((c, args[j:j + n]))
        if not args or len(args) % n:
            raise ValueError(f"{cmd} takes arguments in groups of {n}, got {len(args)} in {d[:60]!r}")


def polygons(d: str, curve_steps: int = DEFAULT_CURVE_STEPS, strict: bool = True) -> list[np.ndarray]:
    """The subpaths of `d` as (N, 2) arrays of absolute coordinates, curves and arcs flattened into
    `curve_steps` straight pieces each. A subpath is a polygon whether or not it ends with Z (a fill
    closes it); consecutive repeated points are kept. Subpaths of a single point are dropped.
    strict: as parse()."""
    if curve_steps < 1:
        raise ValueError("curve_steps must be >= 1")
    t = np.linspace(0.0, 1.0, curve_steps + 1)[1:, None]
    subpaths: list[list[np.ndarray]] = []
    cur = np.zeros(2)
    start = np.zeros(2)
    last_ctrl: np.ndarray | None = None   # reflected by S (after C/S) and T (after Q/T)
    last_cmd = ""
    current: list[np.ndarray] | None = None

    def begin(p: np.ndarray) -> list[np.ndarray]:
        sub = [p[None]]
        subpaths.append(sub)
        return sub

    for cmd, a in parse(d, strict):
        up, rel = cmd.upper(), cmd.islower()
        base = cur if rel else np.zeros(2)
        if up == "M":
            cur = base + a[:2]
            start = cur.copy()
            current = begin(cur)
            last_ctrl, last_cmd = None, up
            continue
        if current is None or up != "Z" and last_cmd == "Z":
            current = begin(cur)   # drawing without a moveto (or after a closepath) starts at the current point
        if up == "Z":
            cur = start.copy()
            current.append(cur[None])
            last_ctrl, last_cmd = None, up
            continue
        ctrl = None
        if up == "L":
            end = base + a[:2]
            pts = end[None]
        elif up == "H":
            end = np.array([(cur[0] if rel else 0.0) + a[0], cur[1]])
            pts = end[None]
        elif up == "V":
            end = np.array([cur[0], (cur[1] if rel else 0.0) + a[0]])
            pts = end[None]
        elif up in "CS":
            if up == "C":
                c1, c2, end = base + a[0:2], base + a[2:4], base + a[4:6]
            else:
                c1 = 2 * cur - last_ctrl if last_cmd in ("C", "S") and last_ctrl is not None else cur
                c2, end = base + a[0:2], base + a[2:4]
            pts = ((1 - t) ** 3 * cur + 3 * (1 - t) ** 2 * t * c1 + 3 * (1 - t) * t ** 2 * c2 + t ** 3 * end)
            ctrl = c2
        elif up in "QT":
            if up == "Q":
                c, end = base + a[0:2], base + a[2:4]
            else:
                c = 2 * cur - last_ctrl if last_cmd in ("Q", "T") and last_ctrl is not None else cur
                end = base + a[0:2]
            pts = (1 - t) ** 2 * cur + 2 * (1 - t) * t * c + t ** 2 * end
            ctrl = c
        else:   # A rx ry x-axis-rotation large-arc-flag sweep-flag x y
            end = base + a[5:7]
            pts = _arc(cur, a[0], a[1], a[2], a[3] != 0, a[4] != 0, end, t[:, 0])
        current.append(np.asarray(pts, dtype=float))
        cur = np.asarray(end, dtype=float)
        last_ctrl, last_cmd = ctrl, up
    polys = [np.concatenate(sub) for sub in subpaths]
    return [p for p in polys if len(p) > 1]


def _arc(p0: np.ndarray, rx: float, ry: float, phi_deg: float, large: bool, sweep: bool,
         p1: np.ndarray, t: np.ndarray) -> np.ndarray:
    """Points of an SVG elliptical arc at parameters t in (0, 1] (SVG 1.1 appendix F.6.5/F.6.6)."""
    rx, ry = abs(rx), abs(ry)
    if max(rx, ry) > 1e12:   # as straight as a line (and its squares would overflow)
        return np.asarray(p1, dtype=float)[None]
    if rx == 0 or ry == 0 or np.allclose(p0, p1):
        return np.asarray(p1, dtype=float)[None] if rx == 0 or ry == 0 else np.empty((0, 2))
    phi = math.radians(phi_deg % 360)
    cos, sin = math.cos(phi), math.sin(phi)
    dx, dy = (p0 - p1) / 2
    x1p, y1p = cos * dx + sin * dy, -sin * dx + cos * dy
    lam = x1p ** 2 / rx ** 2 + y1p ** 2 / ry ** 2
    if lam > 1:   # radii too small for the endpoints: scaled up just enough
        rx, ry = rx * math.sqrt(lam), ry * math.sqrt(lam)
    num = rx ** 2 * ry ** 2 - rx ** 2 * y1p ** 2 - ry ** 2 * x1p ** 2
    den = rx ** 2 * y1p ** 2 + ry ** 2 * x1p ** 2
    coef = math.sqrt(max(0.0, num / den)) * (-1 if large == sweep else 1)
    cxp, cyp = coef * rx * y1p / ry, -coef * ry * x1p / rx
    cx = cos * cxp - sin * cyp + (p0[0] + p1[0]) / 2
    cy = sin * cxp + cos * cyp + (p0[1] + p1[1]) / 2

    def angle(ux: float, uy: float, vx: float, vy: float) -> float:
        return math.atan2(ux * vy - uy * vx, ux * vx + uy * vy)

    ux, uy = (x1p - cxp) / rx, (y1p - cyp) / ry
    vx, vy = (-x1p - cxp) / rx, (-y1p - cyp) / ry
    theta = angle(1.0, 0.0, ux, uy)
    delta = angle(ux, uy, vx, vy)
    if not sweep and delta > 0:
        delta -= 2 * math.pi
    elif sweep and delta < 0:
        delta += 2 * math.pi
    ang = theta + delta * t
    ex, ey = rx * np.cos(ang), ry * np.sin(ang)
    pts = np.stack([cos * ex - sin * ey + cx, sin * ex + cos * ey + cy], -1)
    pts[-1] = p1   # exactly the endpoint, not a rounding of it
    return pts


def to_pixels(polys: list[np.ndarray], bbox: dict, width: int, height: int) -> list[np.ndarray]:
    """Polygons in the box's unit square -> pixels: x_px = (x_min + u * (x_max - x_min)) * width."""
    x0, y0 = bbox["x_min"], bbox["y_min"]
    sx, sy = bbox["x_max"] - x0, bbox["y_max"] - y0
    scale = np.array([sx * width, sy * height])
    offset = np.array([x0 * width, y0 * height])
    return [p * scale + offset for p in polys]


def fill_mask(polys: list[np.ndarray], width: int, height: int) -> np.ndarray:
    """(height, width) bool mask of the pixels whose centres lie inside the polygons (each closed),
    by the nonzero winding rule; parts outside the image are cut off."""
    mask = np.zeros((height, width), bool)
    edges = [np.stack([p, np.roll(p, -1, axis=0)], 1) for p in polys if len(p) > 2]
    if not edges or width <= 0 or height <= 0:
        return mask
    e = np.concatenate(edges)                     # (E, 2 ends, 2 coords)
    e = e[np.isfinite(e).all(axis=(1, 2))]        # an overflowing number ("1e999") draws nothing
    x0, y0, x1, y1 = e[:, 0, 0], e[:, 0, 1], e[:, 1, 0], e[:, 1, 1]
    keep = y0 != y1                               # horizontal edges cross no row centre
    x0, y0, x1, y1 = x0[keep], y0[keep], x1[keep], y1[keep]
    if not len(x0):
        return mask
    direction = np.where(y1 > y0, 1, -1)
    lo, hi = np.minimum(y0, y1), np.maximum(y0, y1)
    rows = np.arange(max(0, math.floor(lo.min() - 0.5)), min(height, math.ceil(hi.max() + 0.5)))
    cols = np.arange(width) + 0.5
    for r in rows:
        yc = r + 0.5
        hit = (lo <= yc) & (yc < hi)              # half-open: a vertex shared by two edges counts once
        if not hit.any():
            continue
        xs = x0[hit] + (yc - y0[hit]) * (x1[hit] - x0[hit]) / (y1[hit] - y0[hit])
        order = np.argsort(xs, kind="stable")
        xs, winding = xs[order], np.cumsum(direction[hit][order])
        # Pixel centres right of crossing k and left of k + 1 have winding number winding[k].
        k = np.searchsorted(xs, cols, side="right") - 1
        inside = (k >= 0) & (winding[np.clip(k, 0, None)] != 0)
        mask[r] = inside
    return mask


def rasterise(d: str, bbox: dict, width: int, height: int, curve_steps: int = DEFAULT_CURVE_STEPS,
              strict: bool = False) -> tuple[np.ndarray, list[np.ndarray]]:
    """A segment result's path placed on a width x height image: (mask, polygons in pixels). Not
    strict by default: a path the model ended mid-command is drawn up to its last whole command."""
    polys = to_pixels(polygons(d, curve_steps, strict), bbox, width, height)
    return fill_mask(polys, width, height), polys
