"""Persistent ids for detect and point results across frames, and boxes that follow the image
between model results. Plain numpy, SciPy and OpenCV (no ROS): the vision node owns the trackers
and feeds them; tests and bench/tracking.py run them alone.

One tracker per stream, a stream being one (task, prompt) of one camera ("detect" "red cup",
"point" "person"): `BoxTracker` for detect (boxes in pixels, x_min y_min x_max y_max) and
`PointTracker` for point (x y in pixels). `StreamTrackers` holds a camera's trackers by
(task, prompt) and follows all their boxes in one optical-flow call.

Model results (`update`):
- Association: each live track is scored against each detection by overlap, IoU for boxes
  (at least `min_iou`, default 0.3), and for points by the distance normalized by the image size,
  d = sqrt((dx / width)^2 + (dy / height)^2), within `gate` (default 0.05, i.e. 5% of the image;
  the overlap is 1 - d / gate).
  The pairs are chosen by an assignment (scipy.optimize.linear_sum_assignment) that maximizes the
  summed overlap; a pair under the minimum is never matched. A detection left unmatched starts a
  new track.
- Constant-velocity prediction (on by default, `velocity=False` turns it off): a track's centre
  velocity is estimated from its detections (pixels per second of the frames' stamps; each new
  measurement weighs half). A track is scored with the better of two overlaps: with its last
  known box, and with that box moved by velocity x (stamp - stamp of the last known box). The last
  box keeps an object that stopped (or reappears where it vanished) on its id; the prediction keeps
  a moving one on it after an occlusion, and keeps two objects that cross on their own ids: around
  the crossing each one's last box fits both detections about equally, and the predictions tell
  them apart. (Where two equal boxes coincide exactly, the two detections are the same box and
  either pairing is as right; the ids go on correctly after.) Without prediction, objects that
  cross may swap ids where they overlap most.
- Misses and ends: a track not matched by a model result is missed; after `max_missed`
  (default 5) consecutive missed model results it ends. So an object hidden for fewer than
  `max_missed` results that reappears overlapping its last (or predicted) box keeps its id; one
  hidden for `max_missed` results or more comes back with a new id. Optical-flow frames do not
  count as results.
- Ids: positive integers from an `IdSource`, never reused for the source's life (ids are not
  recycled when a track ends, nor on `reset()`). By default each tracker has its own source;
  `StreamTrackers` gives all a camera's streams one source (pass the same `IdSource` to several
  `StreamTrackers` for ids unique across the node), so an id names one object across the detect
  and point topics. 0 is never an id: a message may use it for "not tracked".

Between model results (`follow`, `SparseFlow`): sparse Lucas-Kanade optical flow moves each live
track's box with the image. Good features (Shi-Tomasi corners) inside the inner part of the box
in the previous camera frame are followed to the current frame (cv2.calcOpticalFlowPyrLK,
pyramidal), then back again; features that do not return within `max_fb_error` pixels of where
they started are dropped (forward-backward check), as are those whose motion strays from the
others' median (wrong matches scatter; an object's features move together), and the box moves by
the median motion of the rest (a translation: the size is kept). Points follow the same way in a
square window around them.
Where it cannot (a box too small or off the image, no texture, features lost between the frames)
the box stays where it was last known and is marked HELD with the reason. Every output carries a
status: DETECTED (in this model result), PREDICTED (moved by flow, not seen by the model) or HELD
(not seen, not moved: the last known position). Flow moves missed tracks too: on a robot, most of
the image motion between results is the camera's own.

Stamps are seconds (the frames' header stamps). Model results must come in stamp order; flow
frames may run ahead of a model result still being computed (the result of an older frame is then
associated with boxes that flow has moved since, through the prediction run backwards).

A tracker is not thread-safe: one thread (the node's worker) feeds it. Bad input raises
ValueError naming the problem.
"""
from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import cv2
import numpy as np
from numpy.typing import ArrayLike
from scipy.optimize import linear_sum_assignment

DETECTED = "detected"     # matched to a detection of this model result
PREDICTED = "predicted"   # not in a model result: moved by optical flow
HELD = "held"             # not in a model result and not moved: the last known position, with a reason

DEFAULT_MAX_MISSED = 5
DEFAULT_MIN_IOU = 0.3
DEFAULT_POINT_GATE = 0.05

# Assignment costs: an allowed pair's is minus its overlap, a pair under the minimum overlap costs
# what leaving both unmatched does (0), and is dropped after the solve. (Forbidden pairs priced
# high made the solver maximise the number of allowed pairs first: two weak pairs beat one
# perfect one, and an unmoved object took its hidden neighbour's id.) _TIE makes an allowed pair
# of overlap 0 still better than none.
_TIE = 1e-9


class IdSource:
    """Ids first, first + 1, ... each handed out once for the life of this object. Safe to share
    between trackers on different threads. `clock_based()`: a first id from the clock, so a node
    that restarts does not hand out again the ids a planner may still hold."""

    def __init__(self, first: int = 1) -> None:
        self._first = self._next = int(first)
        self._lock = threading.Lock()

    @classmethod
    def clock_based(cls) -> "IdSource":
        # milliseconds, modulo 2**31 (24.8 days): a restart starts past the ids of an earlier run
        # that handed out fewer than a thousand a second since it began, and 2**31 ids remain below
        # uint32's end
        return cls(1 + (time.time_ns() // 1_000_000) % 2**31)

    def take(self) -> int:
        with self._lock:
            value = self._next
            self._next += 1
            return value

    @property
    def issued(self) -> int:
        """How many ids have been handed out."""
        return self._next - self._first

    @property
    def last(self) -> int:
        """The id handed out last (first - 1 before any)."""
        return self._next - 1


@dataclass(frozen=True)
class Tracked:
    """One tracked object at one frame.

    coords: (x_min, y_min, x_max, y_max) for a box, (x, y) for a point, in pixels.
    index: its row in the model result passed to `update` (DETECTED), -1 otherwise.
    score: the score of its latest detection (NaN where none was given).
    hits: detections matched to the track so far; missed: consecutive model results without one.
    reason: why it is HELD ("" when DETECTED or PREDICTED)."""
    track_id: int
    coords: tuple[float, ...]
    status: str
    index: int
    score: float
    hits: int
    missed: int
    reason: str = ""


@dataclass(frozen=True)
class FlowMove:
    """What optical flow did to one box: moved by shift (dx, dy) pixels, or not (reason)."""
    shift: tuple[float, float]
    moved: bool
    features: int     # features that passed the forward-backward check
    reason: str = ""


def box_iou(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """IoU of every box of a (T, 4) with every box of b (N, 4): (T, N); 0 where a union is empty."""
    top_left = np.maximum(a[:, None, :2], b[None, :, :2])
    bottom_right = np.minimum(a[:, None, 2:], b[None, :, 2:])
    wh = np.clip(bottom_right - top_left, 0.0, None)
    inter = wh[..., 0] * wh[..., 1]
    area_a = (a[:, 2] - a[:, 0]) * (a[:, 3] - a[:, 1])
    area_b = (b[:, 2] - b[:, 0]) * (b[:, 3] - b[:, 1])
    union = area_a[:, None] + area_b[None, :] - inter
    return np.divide(inter, union, out=np.zeros_like(inter), where=union > 0)


def point_distance(a: np.ndarray, b: np.ndarray, image_size: tuple[int, int]) -> np.ndarray:
    """Distance of every point of a (T, 2) to every point of b (N, 2), each axis divided by the
    image's size on it (width, height): (T, N), 1.0 being the image's width (or height) apart."""
    scale = np.asarray(image_size, dtype=np.float64)
    d = (a[:, None, :] - b[None, :, :]) / scale
    return np.sqrt((d * d).sum(axis=-1))


def to_gray(image: np.ndarray) -> np.ndarray:
    """An 8-bit image (HxW, HxWx1, HxWx3 RGB or HxWx4 RGBA) as HxW gray, what flow runs on. BGR
    input gives a slightly different gray (the channel weights differ), which flow does not mind."""
    if not isinstance(image, np.ndarray) or image.dtype != np.uint8:
        raise ValueError(f"flow needs a uint8 numpy image, got {getattr(image, 'dtype', type(image).__name__)}")
    if image.ndim == 2:
        return image
    if image.ndim == 3 and image.shape[2] == 1:
        return image[:, :, 0]
    if image.ndim == 3 and image.shape[2] in (3, 4):
        code = cv2.COLOR_RGB2GRAY if image.shape[2] == 3 else cv2.COLOR_RGBA2GRAY
        return cv2.cvtColor(image, code)
    raise ValueError(f"flow needs an HxW, HxWx3 or HxWx4 image, got shape {image.shape}")


class SparseFlow:
    """Moves boxes from one camera frame to the next by sparse optical flow (see the module's
    docstring). Stateless between calls: one instance serves any number of trackers.

    max_features: corners sought per box; min_features: fewer agreeing features than this, or
    fewer than `min_kept` of those found, and the box is HELD. inner: the centred fraction of the
    box (per side) searched for features, so that the background at its edges counts less.
    min_size: a box (after clipping to the image and taking its inner part) narrower than this in
    pixels is HELD. window, levels: the Lucas-Kanade window side and pyramid levels above the image
    set the reach: with the defaults, shifts of up to about 40 px between two frames are followed
    on fine texture (blurred noise, as in the tests); past that, most boxes are HELD.
    max_fb_error: pixels. max_spread: how far (pixels, per axis) a feature's motion may be from
    the median of the box's features and still count (an object's features move together between
    two camera frames; wrong matches scatter). The cost grows with the features (max_features x
    boxes) and window^2; the defaults are sized for about 10 boxes at camera rate
    (bench/tracking.py)."""

    def __init__(self, *, max_features: int = 15, min_features: int = 4, min_kept: float = 0.3,
                 inner: float = 0.8, min_size: int = 8, window: int = 15, levels: int = 4,
                 max_fb_error: float = 1.0, max_spread: float = 2.0, quality: float = 0.01,
                 min_distance: float = 4.0, iterations: int = 20) -> None:
        if max_features < 1 or min_features < 1 or min_features > max_features:
            raise ValueError("need 1 <= min_features <= max_features")
        if not 0.0 <= min_kept <= 1.0:
            raise ValueError("min_kept is a fraction in [0, 1]")
        if not 0.0 < inner <= 1.0:
            raise ValueError("inner is a fraction in (0, 1]")
        if window < 3 or window % 2 == 0:
            raise ValueError("window must be odd and at least 3")
        if (levels < 0 or min_size < 2 or max_fb_error <= 0 or max_spread <= 0 or not 0 < quality < 1
                or min_distance < 0 or iterations < 1):
            raise ValueError("levels >= 0, min_size >= 2, max_fb_error > 0, max_spread > 0, "
                             "0 < quality < 1, min_distance >= 0, iterations >= 1")
        self.max_features, self.min_features, self.min_kept = int(max_features), int(min_features), float(min_kept)
        self.inner, self.min_size = float(inner), int(min_size)
        self.window, self.levels = int(window), int(levels)
        self.max_fb_error, self.max_spread = float(max_fb_error), float(max_spread)
        self.quality, self.min_distance = float(quality), float(min_distance)
        # Fewer iterations and a looser stop than OpenCV's default (30, 0.01 px) cost less, and the
        # median of the features stays well under a tenth of a pixel off (tests, bench).
        self._criteria = (cv2.TERM_CRITERIA_EPS | cv2.TERM_CRITERIA_COUNT, int(iterations), 0.03)

    def move(self, prev: np.ndarray, cur: np.ndarray, boxes: ArrayLike) -> list[FlowMove]:
        """How each box (N, 4 pixels) of `prev` moved in `cur`: one FlowMove per box, in order.
        prev and cur: the same size, 8-bit (gray, RGB or RGBA)."""
        prev_gray, cur_gray = to_gray(prev), to_gray(cur)
        if prev_gray.shape != cur_gray.shape:
            raise ValueError(f"frames differ in size: {prev_gray.shape[::-1]} and {cur_gray.shape[::-1]}")
        boxes = _as_rows(boxes, 4, "boxes")
        height, width = prev_gray.shape
        moves: list[FlowMove | None] = [None] * len(boxes)
        starts, owners, found = [], [], {}
        for i, (x0, y0, x1, y1) in enumerate(boxes):
            # The inner part of the box, clipped to the image.
            cx, cy = (x0 + x1) / 2, (y0 + y1) / 2
            hw, hh = (x1 - x0) * self.inner / 2, (y1 - y0) * self.inner / 2
            left, top = max(0, math.ceil(cx - hw)), max(0, math.ceil(cy - hh))
            right, bottom = min(width, math.floor(cx + hw)), min(height, math.floor(cy + hh))
            if right - left < self.min_size or bottom - top < self.min_size:
                off = x1 <= 0 or y1 <= 0 or x0 >= width or y0 >= height
                moves[i] = _held("box outside the image" if off else
                                 f"box too small to follow (inner part {max(0, right - left)}x"
                                 f"{max(0, bottom - top)} px, under {self.min_size})")
                continue
            corners = cv2.goodFeaturesToTrack(prev_gray[top:bottom, left:right], self.max_features,
                                              self.quality, self.min_distance)
            count = 0 if corners is None else len(corners)
            if count < self.min_features:
                moves[i] = _held(f"no texture to follow in the box ({count} features, under {self.min_features})")
                continue
            starts.append(corners.reshape(-1, 2) + np.array([left, top], dtype=np.float32))
            owners.append(np.full(count, i))
            found[i] = count
        if starts:
            p0 = np.concatenate(starts).astype(np.float32).reshape(-1, 1, 2)
            owner = np.concatenate(owners)
            params = dict(winSize=(self.window, self.window), maxLevel=self.levels, criteria=self._criteria)
            p1, status_f, _ = cv2.calcOpticalFlowPyrLK(prev_gray, cur_gray, p0, None, **params)
            back, status_b, _ = cv2.calcOpticalFlowPyrLK(cur_gray, prev_gray, p1, None, **params)
            fb_error = np.linalg.norm((back - p0).reshape(-1, 2), axis=1)
            good = (status_f.ravel() == 1) & (status_b.ravel() == 1) & (fb_error < self.max_fb_error)
            motion = (p1 - p0).reshape(-1, 2)
            for i, count in found.items():
                mine = good & (owner == i)
                kept = int(mine.sum())
                if kept < self.min_features or kept < self.min_kept * count:
                    moves[i] = _held(f"features lost between the frames ({kept} of {count} followed "
                                     f"forward and back within {self.max_fb_error:g} px)", kept)
                    continue
                # A feature can pass the forward-backward check and still be wrong (LK settling on
                # a similar patch both ways, seen past the pyramid's reach): wrong ones scatter, an
                # object's features move together. The box moves only with a group that agrees.
                centre = np.median(motion[mine], axis=0)
                together = mine & (np.abs(motion - centre).max(axis=1) <= self.max_spread)
                agree = int(together.sum())
                if agree < self.min_features or agree < self.min_kept * count:
                    moves[i] = _held(f"features disagree ({agree} of {kept} followed move within "
                                     f"{self.max_spread:g} px of their median)", agree)
                    continue
                dx, dy = np.median(motion[together], axis=0)
                moves[i] = FlowMove(shift=(float(dx), float(dy)), moved=True, features=agree)
        return moves  # type: ignore[return-value]  # every entry was set above


def _held(reason: str, features: int = 0) -> FlowMove:
    return FlowMove(shift=(0.0, 0.0), moved=False, features=features, reason=reason)


def _as_rows(values: ArrayLike, width: int, what: str) -> np.ndarray:
    """values as a finite (N, width) float64 array; [] is (0, width)."""
    try:
        rows = np.asarray(values, dtype=np.float64)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{what} must be numbers: {err}") from None
    if rows.size == 0:
        return np.zeros((0, width))
    if rows.ndim != 2 or rows.shape[1] != width:
        raise ValueError(f"{what} must have shape (N, {width}), got {rows.shape}")
    if not np.isfinite(rows).all():
        raise ValueError(f"{what} must be finite (no NaN or inf)")
    return rows


def _check_stamp(stamp: float) -> float:
    try:
        value = float(stamp)
    except (TypeError, ValueError):
        raise ValueError(f"stamp must be seconds (a number), got {stamp!r}") from None
    if not math.isfinite(value):
        raise ValueError(f"stamp must be finite, got {value}")
    return value


class _Track:
    __slots__ = ("track_id", "coords", "stamp", "detected_centre", "detected_stamp", "velocity",
                 "score", "hits", "missed", "status", "reason")

    def __init__(self, track_id: int, coords: np.ndarray, stamp: float, centre: np.ndarray, score: float) -> None:
        self.track_id = track_id
        self.coords = coords            # last known position (detected, or moved by flow since)
        self.stamp = stamp              # when coords held
        self.detected_centre = centre   # centre at the latest detection, and its stamp: velocity's base
        self.detected_stamp = stamp
        self.velocity: np.ndarray | None = None   # centre, px/s
        self.score = score
        self.hits = 1
        self.missed = 0
        self.status = DETECTED
        self.reason = ""

    def snapshot(self, index: int = -1) -> Tracked:
        return Tracked(track_id=self.track_id, coords=tuple(self.coords.tolist()), status=self.status,
                       index=index, score=self.score, hits=self.hits, missed=self.missed, reason=self.reason)


class _Tracker:
    """What BoxTracker and PointTracker share; they say how coordinates compare and move."""
    dims = 0
    what = ""

    def __init__(self, *, max_missed: int, velocity: bool, ids: IdSource | None, max_age_s: float = math.inf) -> None:
        if isinstance(max_missed, bool) or not isinstance(max_missed, (int, np.integer)) or max_missed < 1:
            raise ValueError(f"max_missed must be a whole number >= 1, got {max_missed!r}")
        if not max_age_s > 0:
            raise ValueError(f"max_age_s must be > 0, got {max_age_s!r}")
        self.max_missed = int(max_missed)
        self.max_age_s = float(max_age_s)
        self.velocity = bool(velocity)
        self.ids = ids if ids is not None else IdSource()
        self.image_size: tuple[int, int] | None = None
        self.frame: str | None = None      # the camera frame (frame_id) the tracks' pixels are in
        self.last_result_stamp: float | None = None
        self._tracks: list[_Track] = []

    # -- what each kind defines --
    def _similarity(self, tracks: np.ndarray, detections: np.ndarray) -> np.ndarray:
        """(T, N) overlap in [0, 1], -1 where a pair is under the minimum."""
        raise NotImplementedError

    def _centres(self, coords: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def _translate(self, coords: np.ndarray, shift: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def _flow_regions(self, coords: np.ndarray) -> np.ndarray:
        """The boxes (T, 4) whose image motion moves each track."""
        raise NotImplementedError

    def _validate(self, rows: np.ndarray) -> None:
        pass

    # -- public --
    def update(self, detections: ArrayLike, stamp: float, image_size: tuple[int, int],
               scores: Sequence[float] | None = None, frame: str | None = None) -> list[Tracked]:
        """One model result: detections (N rows in pixels) of the frame stamped `stamp` (seconds),
        of an image (width, height). Returns one Tracked per detection, in their order, each
        DETECTED with its id. Tracks not matched are missed; those missed `max_missed` times end.
        A new image size ends every track first (their pixels are of another image), and so does
        a new `frame` (the image's frame_id, where given: the pixels are another camera's, such
        as a topic switched between cameras, and an object there is not the one at the same
        pixels here)."""
        stamp = _check_stamp(stamp)
        size = _check_size(image_size)
        rows = _as_rows(detections, self.dims, f"{self.what}s")
        self._validate(rows)
        if scores is None:
            score_list = [math.nan] * len(rows)
        else:
            score_list = [float(s) for s in scores]
            if len(score_list) != len(rows):
                raise ValueError(f"{len(score_list)} scores for {len(rows)} {self.what}s")
        if self.last_result_stamp is not None and stamp < self.last_result_stamp:
            raise ValueError(f"model result stamped {stamp:.6f} s is older than the previous one "
                             f"({self.last_result_stamp:.6f} s): results must come in stamp order "
                             f"(reset() after a jump back in time, such as a bag played again)")
        if (self.image_size is not None and size != self.image_size) or (
                frame is not None and self.frame is not None and frame != self.frame):
            self._tracks = []
        self.image_size, self.last_result_stamp = size, stamp
        if frame is not None:
            self.frame = frame
        self._expire(stamp)

        centres = self._centres(rows)
        matches = self._associate(rows, stamp)
        out: list[Tracked | None] = [None] * len(rows)
        matched_tracks = set()
        for t, d in matches:
            track = self._tracks[t]
            matched_tracks.add(t)
            self._hit(track, rows[d], centres[d], stamp, score_list[d])
            out[d] = track.snapshot(d)
        kept = []
        for t, track in enumerate(self._tracks):
            if t in matched_tracks:
                kept.append(track)
                continue
            track.missed += 1
            if track.missed >= self.max_missed:
                continue   # ended; its id is not handed out again
            track.status = HELD
            track.reason = f"not detected in the latest model result ({track.missed} of {self.max_missed} misses)"
            kept.append(track)
        for d in range(len(rows)):
            if out[d] is None:
                track = _Track(self.ids.take(), rows[d].copy(), stamp, centres[d], score_list[d])
                kept.append(track)
                out[d] = track.snapshot(d)
        self._tracks = kept
        return out  # type: ignore[return-value]  # every entry was set above

    def follow(self, prev: np.ndarray, cur: np.ndarray, stamp: float, flow: SparseFlow | None = None) -> list[Tracked]:
        """Moves every live track by optical flow from camera frame `prev` (the frame its last known
        position is in) to `cur`, stamped `stamp`. Returns every live track: PREDICTED where it
        moved, HELD (with the reason) where it could not."""
        flow = flow or _default_flow()
        prev, cur = to_gray(prev), to_gray(cur)   # once, not per call below
        regions = self.flow_regions()
        moves = flow.move(prev, cur, regions) if len(regions) else []
        return self.apply_flow(moves, stamp, cur.shape)

    def tracks(self) -> list[Tracked]:
        """Every live track as it stands now."""
        return [track.snapshot() for track in self._tracks]

    def reset(self) -> None:
        """Ends every track (their ids are not handed out again) and forgets the stamp order."""
        self._tracks = []
        self.image_size = self.last_result_stamp = self.frame = None

    # -- used by StreamTrackers to follow many trackers with one flow call --
    def flow_regions(self) -> np.ndarray:
        if not self._tracks:
            return np.zeros((0, 4))
        return self._flow_regions(np.stack([track.coords for track in self._tracks]))

    def apply_flow(self, moves: Sequence[FlowMove], stamp: float, frame_shape: tuple[int, ...]) -> list[Tracked]:
        stamp = _check_stamp(stamp)
        if len(moves) != len(self._tracks):
            raise ValueError(f"{len(moves)} flow moves for {len(self._tracks)} tracks")
        if self.image_size is not None and (frame_shape[1], frame_shape[0]) != self.image_size:
            raise ValueError(f"frame is {frame_shape[1]}x{frame_shape[0]}, the model results were "
                             f"{self.image_size[0]}x{self.image_size[1]}")
        if self.last_result_stamp is not None and stamp < self.last_result_stamp:
            raise ValueError(f"frame stamped {stamp:.6f} s is older than the latest model result "
                             f"({self.last_result_stamp:.6f} s)")
        live = [(t, m) for t, m in zip(self._tracks, moves) if stamp - t.detected_stamp <= self.max_age_s]
        self._tracks = [t for t, _ in live]   # (_expire, keeping each track's move)
        for track, move in live:
            if move.moved:
                track.coords = self._translate(track.coords, np.asarray(move.shift))
                track.stamp = stamp
                track.status, track.reason = PREDICTED, ""
            else:
                track.status, track.reason = HELD, move.reason
        return self.tracks()

    # -- internals --
    def _expire(self, stamp: float) -> None:
        """Tracks last detected more than max_age_s before `stamp` end, however few results came
        since (a camera off for minutes, a node inactive meanwhile): an id is not handed to
        whatever is at that place now."""
        self._tracks = [t for t in self._tracks if stamp - t.detected_stamp <= self.max_age_s]

    def _associate(self, rows: np.ndarray, stamp: float) -> list[tuple[int, int]]:
        if not self._tracks or not len(rows):
            return []
        last = np.stack([track.coords for track in self._tracks])
        moved = [i for i, track in enumerate(self._tracks) if track.velocity is not None] if self.velocity else []
        if moved:   # one similarity call for last and predicted positions together
            shifts = np.stack([self._tracks[i].velocity * (stamp - self._tracks[i].stamp) for i in moved])
            both = self._similarity(np.concatenate([last, self._translate(last[moved], shifts)]), rows)
            score = both[:len(last)]
            score[moved] = np.maximum(score[moved], both[len(last):])
        else:
            score = self._similarity(last, rows)
        allowed = score >= 0
        cost = np.where(allowed, -score - _TIE, 0.0)
        track_rows, detection_cols = linear_sum_assignment(cost)
        return [(int(t), int(d)) for t, d in zip(track_rows, detection_cols) if allowed[t, d]]

    def _hit(self, track: _Track, coords: np.ndarray, centre: np.ndarray, stamp: float, score: float) -> None:
        dt = stamp - track.detected_stamp
        if self.velocity and dt > 0:
            measured = (centre - track.detected_centre) / dt
            # Each new measurement weighs half: one jittery box does not throw the prediction off.
            track.velocity = measured if track.velocity is None else (track.velocity + measured) / 2
        track.coords, track.stamp = coords.copy(), stamp
        track.detected_centre, track.detected_stamp = centre, stamp
        track.score = score
        track.hits += 1
        track.missed = 0
        track.status, track.reason = DETECTED, ""


def _check_size(image_size: tuple[int, int]) -> tuple[int, int]:
    try:
        width, height = (int(v) for v in image_size)
    except (TypeError, ValueError):
        raise ValueError(f"image_size must be (width, height), got {image_size!r}") from None
    if width < 1 or height < 1:
        raise ValueError(f"image_size must be positive, got {width}x{height}")
    return width, height


_FLOW: SparseFlow | None = None


def _default_flow() -> SparseFlow:
    global _FLOW
    if _FLOW is None:
        _FLOW = SparseFlow()
    return _FLOW


class BoxTracker(_Tracker):
    """Ids for the boxes of one detect stream: rows (x_min, y_min, x_max, y_max) in pixels."""
    dims = 4
    what = "box"

    def __init__(self, *, max_missed: int = DEFAULT_MAX_MISSED, min_iou: float = DEFAULT_MIN_IOU,
                 velocity: bool = True, ids: IdSource | None = None, max_age_s: float = math.inf) -> None:
        super().__init__(max_missed=max_missed, velocity=velocity, ids=ids, max_age_s=max_age_s)
        if not 0.0 < min_iou <= 1.0:
            raise ValueError(f"min_iou must be in (0, 1], got {min_iou}")
        self.min_iou = float(min_iou)

    def _validate(self, rows: np.ndarray) -> None:
        bad = (rows[:, 2] < rows[:, 0]) | (rows[:, 3] < rows[:, 1])
        if bad.any():
            raise ValueError(f"box {int(np.argmax(bad))} has x_max < x_min or y_max < y_min: {rows[bad][0].tolist()}")

    def _similarity(self, tracks: np.ndarray, detections: np.ndarray) -> np.ndarray:
        iou = box_iou(tracks, detections)
        return np.where(iou >= self.min_iou, iou, -1.0)

    def _centres(self, coords: np.ndarray) -> np.ndarray:
        return (coords[:, :2] + coords[:, 2:]) / 2

    def _translate(self, coords: np.ndarray, shift: np.ndarray) -> np.ndarray:
        return coords + np.concatenate([shift, shift], axis=-1)

    def _flow_regions(self, coords: np.ndarray) -> np.ndarray:
        return coords


class PointTracker(_Tracker):
    """Ids for the points of one point stream: rows (x, y) in pixels. `gate`: the largest
    distance, normalized by the image size, at which a point still continues a track.
    `window`: the side in pixels of the square around a point that optical flow follows."""
    dims = 2
    what = "point"

    def __init__(self, *, max_missed: int = DEFAULT_MAX_MISSED, gate: float = DEFAULT_POINT_GATE,
                 velocity: bool = True, window: float = 40.0, ids: IdSource | None = None,
                 max_age_s: float = math.inf) -> None:
        super().__init__(max_missed=max_missed, velocity=velocity, ids=ids, max_age_s=max_age_s)
        if not 0.0 < gate <= 1.5:
            raise ValueError(f"gate must be in (0, 1.5] (a distance relative to the image), got {gate}")
        if window <= 0:
            raise ValueError(f"window must be positive, got {window}")
        self.gate, self.window = float(gate), float(window)

    def _similarity(self, tracks: np.ndarray, detections: np.ndarray) -> np.ndarray:
        assert self.image_size is not None   # update sets it before associating
        d = point_distance(tracks, detections, self.image_size)
        return np.where(d <= self.gate, 1.0 - d / self.gate, -1.0)

    def _centres(self, coords: np.ndarray) -> np.ndarray:
        return coords

    def _translate(self, coords: np.ndarray, shift: np.ndarray) -> np.ndarray:
        return coords + shift

    def _flow_regions(self, coords: np.ndarray) -> np.ndarray:
        half = self.window / 2
        return np.concatenate([coords - half, coords + half], axis=1)


TRACKERS = {"detect": BoxTracker, "point": PointTracker}


class StreamTrackers:
    """The trackers of one camera, one per (task, prompt), made on first use; all take ids from
    one IdSource (`ids`, or one of its own). Keyword settings go to every tracker of a kind:
    max_missed and velocity to both, min_iou to boxes, gate and window to points."""

    def __init__(self, *, ids: IdSource | None = None, flow: SparseFlow | None = None,
                 max_missed: int = DEFAULT_MAX_MISSED, min_iou: float = DEFAULT_MIN_IOU,
                 gate: float = DEFAULT_POINT_GATE, velocity: bool = True, window: float = 40.0,
                 max_age_s: float = math.inf) -> None:
        self.ids = ids if ids is not None else IdSource()
        self.flow = flow or SparseFlow()
        self._settings = {
            "detect": dict(max_missed=max_missed, min_iou=min_iou, velocity=velocity, max_age_s=max_age_s),
            "point": dict(max_missed=max_missed, gate=gate, velocity=velocity, window=window, max_age_s=max_age_s),
        }
        for task, settings in self._settings.items():   # bad settings fail here, not at first use
            TRACKERS[task](**settings)
        self._trackers: dict[tuple[str, str], _Tracker] = {}
        self._retained: set[tuple[str, str]] | None = None   # the streams retain() listed (None: any)
        self._lock = threading.Lock()   # retain() comes from a parameter change, get() from the worker

    def get(self, task: str, prompt: str) -> BoxTracker | PointTracker:
        """The stream's tracker. A stream retain() did not list (the result of a frame that was in
        the model when its prompt was dropped) gets one of its own that is not kept: kept, its
        tracks would hand their ids on when the prompt is asked again."""
        if task not in TRACKERS:
            raise ValueError(f"no tracking for task {task!r}: only {sorted(TRACKERS)}")
        key = (task, prompt)
        with self._lock:
            if self._retained is not None and key not in self._retained:
                return TRACKERS[task](ids=self.ids, **self._settings[task])  # type: ignore[return-value]
            if key not in self._trackers:
                self._trackers[key] = TRACKERS[task](ids=self.ids, **self._settings[task])
            return self._trackers[key]  # type: ignore[return-value]

    def streams(self) -> list[tuple[str, str]]:
        return list(self._trackers)

    def retain(self, streams: Iterable[tuple[str, str]]) -> None:
        """Drops the trackers of streams not listed (prompts no longer asked for); their ids are
        not reused if the prompt comes back, and get() keeps no tracker for them until a retain()
        lists them again."""
        keep = set(streams)
        with self._lock:
            self._retained = keep
            self._trackers = {key: tracker for key, tracker in self._trackers.items() if key in keep}

    def follow(self, prev: np.ndarray, cur: np.ndarray, stamp: float) -> dict[tuple[str, str], list[Tracked]]:
        """Every tracker's `follow`, with one optical-flow call for all their boxes."""
        prev, cur = to_gray(prev), to_gray(cur)   # once, not per call below
        regions = [(key, tracker.flow_regions()) for key, tracker in self._trackers.items()]
        boxes = [r for _, r in regions if len(r)]
        moves = self.flow.move(prev, cur, np.concatenate(boxes)) if boxes else []
        out, at = {}, 0
        for key, r in regions:
            out[key] = self._trackers[key].apply_flow(moves[at:at + len(r)], stamp, cur.shape)
            at += len(r)
        return out

    def reset(self) -> None:
        for tracker in self._trackers.values():
            tracker.reset()
