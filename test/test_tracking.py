"""Tracking (photon_ros.tracking), no ROS: ids stay on moving, crossing and briefly hidden objects,
end after max_missed missed results and are never handed out again; points are gated by a distance
relative to the image; optical flow moves boxes by a known image shift, and holds them, with the
reason, where the features are lost. Every sequence is shuffled so association cannot lean on
the detections' order."""
import cv2
import numpy as np
import pytest

from photon_ros.tracking import (DETECTED, HELD, PREDICTED, BoxTracker, FlowMove, IdSource, PointTracker,
                                 SparseFlow, StreamTrackers, box_iou)

SIZE = (640, 480)
DT = 0.1   # seconds between model results


def box(cx, cy, w=40, h=40):
    return [cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2]


def feed(tracker, frames, rng, image_size=SIZE):
    """Feeds frames (lists of (name, row)) in shuffled order; returns {name: [id per frame]}."""
    ids = {}
    for k, objects in enumerate(frames):
        order = rng.permutation(len(objects))
        rows = [objects[i][1] for i in order]
        out = tracker.update(rows, k * DT, image_size)
        assert [o.index for o in out] == list(range(len(rows)))
        assert all(o.status == DETECTED and o.coords == pytest.approx(r) for o, r in zip(out, rows))
        for o, i in zip(out, order):
            ids.setdefault(objects[i][0], []).append(o.track_id)
    return ids


@pytest.fixture
def rng():
    return np.random.default_rng()


@pytest.fixture(scope="module")
def texture():
    """A 640x480 smooth random texture (blurred noise: gradients everywhere for Lucas-Kanade),
    cut from a larger one so that it can be translated with fresh content coming in."""
    noise = np.random.default_rng(7).integers(0, 256, size=(560, 760), dtype=np.uint8)
    return cv2.GaussianBlur(noise, (0, 0), 2.0)


def view(texture, dx=0.0, dy=0.0):
    """The 640x480 frame whose content is the base frame's moved by (dx, dy) pixels (bilinear
    between pixels)."""
    moved = cv2.warpAffine(texture, np.array([[1, 0, dx], [0, 1, dy]], dtype=np.float64),
                           texture.shape[::-1], flags=cv2.INTER_LINEAR)
    return np.ascontiguousarray(moved[40:520, 60:700])


def test_ids_stable_as_boxes_move_a_few_pixels(rng):
    velocities = {"a": (3, 0), "b": (-2, 4), "c": (0, -5), "d": (4, 4)}
    starts = {"a": (100, 100), "b": (400, 120), "c": (300, 400), "d": (500, 300)}
    frames = [[(n, box(starts[n][0] + v[0] * k, starts[n][1] + v[1] * k)) for n, v in velocities.items()]
              for k in range(30)]
    ids = feed(BoxTracker(), frames, rng)
    assert all(len(set(seq)) == 1 for seq in ids.values()), ids
    assert len({seq[0] for seq in ids.values()}) == 4


@pytest.mark.parametrize("dy", [0, 8])
def test_crossing_boxes_keep_their_ids(rng, dy):
    """Two equal boxes moving at each other 8 px per result cross: their last boxes overlap both
    detections alike around the crossing, and the constant-velocity prediction tells them apart.
    With dy = 0 they coincide at one frame (IoU 1): two identical detections, which no tracker can
    tell apart, so that frame's pairing is not checked; the ids after it are."""
    frames = [[("left", box(200 + 8 * k, 240)), ("right", box(360 - 8 * k, 240 + dy))] for k in range(21)]
    ids = feed(BoxTracker(), frames, rng)
    if dy == 0:
        assert frames[10][0][1] == frames[10][1][1]
        ids = {name: seq[:10] + seq[11:] for name, seq in ids.items()}
    assert len(set(ids["left"])) == 1 and len(set(ids["right"])) == 1
    assert ids["left"][0] != ids["right"][0]


@pytest.mark.parametrize("max_missed", [2, 5])
@pytest.mark.parametrize("speed", [0, 12], ids=["still", "moving"])
def test_occlusion_shorter_than_max_missed_keeps_the_id(rng, max_missed, speed):
    """Hidden for max_missed - 1 results, then back: the same id. A moving one comes back where its
    last box no longer overlaps (12 px per result, 40 px box): the prediction carries it."""
    tracker = BoxTracker(max_missed=max_missed)
    position = lambda k: box(100 + speed * k, 200)  # noqa: E731
    hidden = range(3, 3 + max_missed - 1)
    ids = []
    for k in range(3 + max_missed + 3):
        rows = [box(500, 400)] + ([] if k in hidden else [position(k)])
        out = tracker.update(rows, k * DT, SIZE)
        if k in hidden:
            (other,) = out
            held = [t for t in tracker.tracks() if t.track_id != other.track_id]
            assert [(t.status, t.missed) for t in held] == [(HELD, k - 2)]
            assert "not detected" in held[0].reason
        else:
            ids.append(out[1].track_id)
    if speed:
        assert box_iou(np.array([position(2)]), np.array([position(3 + max_missed - 1)]))[0, 0] < 0.3
    assert len(set(ids)) == 1


@pytest.mark.parametrize("max_missed", [1, 2, 5])
def test_occlusion_of_max_missed_results_gives_a_new_id_never_a_reused_one(max_missed):
    ids = IdSource()
    tracker = BoxTracker(max_missed=max_missed, ids=ids)
    seen = set()
    first = tracker.update([box(100, 100), box(300, 300)], 0.0, SIZE)
    seen |= {o.track_id for o in first}
    for k in range(1, max_missed + 1):   # the first box hidden max_missed times
        out = tracker.update([box(300, 300)], k * DT, SIZE)
        assert out[0].track_id == first[1].track_id
    assert [t.track_id for t in tracker.tracks()] == [first[1].track_id]   # the hidden one ended
    back = tracker.update([box(100, 100), box(300, 300)], (max_missed + 1) * DT, SIZE)
    assert back[1].track_id == first[1].track_id
    assert back[0].track_id not in seen and back[0].track_id == ids.last
    # An id ended by reset() is not handed out again either.
    tracker.reset()
    again = tracker.update([box(100, 100)], 0.0, SIZE)
    assert again[0].track_id not in seen | {back[0].track_id}


def test_points_tracked_with_a_gate_relative_to_the_image(rng):
    velocities = {"a": (4, 0), "b": (0, 3), "c": (-3, -3)}
    starts = {"a": (100, 100), "b": (320, 240), "c": (500, 400)}
    frames = [[(n, [starts[n][0] + v[0] * k, starts[n][1] + v[1] * k]) for n, v in velocities.items()]
              for k in range(20)]
    ids = feed(PointTracker(), frames, rng)
    assert all(len(set(seq)) == 1 for seq in ids.values()) and len({s[0] for s in ids.values()}) == 3

    # A 20 px jump is 0.031 of a 640-wide image (inside the 0.05 gate), 0.0625 of a 320-wide one.
    for width, kept in ((640, True), (320, False)):
        tracker = PointTracker(velocity=False)
        a = tracker.update([[100, 100]], 0.0, (width, 480))[0]
        b = tracker.update([[120, 100]], DT, (width, 480))[0]
        assert (a.track_id == b.track_id) is kept


def test_scores_carried_and_flow_running_ahead_of_a_result():
    """A result of an older frame than the one flow has moved the boxes to still finds its track:
    the prediction runs backwards from the flow's stamp."""
    tracker = BoxTracker()
    tracker.update([box(100, 200)], 0.0, SIZE, scores=[0.9])
    tracker.update([box(120, 200)], 0.1, SIZE, scores=[0.8])     # 200 px/s
    for k in range(1, 5):   # flow frames at 0.15 .. 0.3 carry it 40 px further
        tracker.apply_flow([FlowMove(shift=(10.0, 0.0), moved=True, features=10)], 0.1 + 0.05 * k, (480, 640))
    (moved,) = tracker.tracks()
    assert moved.status == PREDICTED and moved.coords == pytest.approx(box(160, 200)) and moved.score == 0.8
    # The model's result for the frame at 0.12 (box at 124): 36 px behind the flowed box, IoU 0.05.
    out = tracker.update([box(124, 200), box(400, 400)], 0.12, SIZE, scores=[0.7, 0.6])
    assert out[0].track_id == moved.track_id and out[0].hits == 3 and out[0].score == 0.7
    assert out[1].score == 0.6


@pytest.mark.parametrize("shift, tolerance", [((7, -3), 0.5), ((-4.5, 2.5), 0.25)])
def test_flow_moves_boxes_and_points_by_the_image_shift(texture, shift, tolerance):
    prev, cur = view(texture), view(texture, *shift)
    streams = StreamTrackers()
    boxes = [box(150, 150, 80, 60), box(400, 300, 60, 90), box(560, 100)]
    detected = streams.get("detect", "cup").update(boxes, 0.0, SIZE)
    points = streams.get("point", "person").update([[320, 240], [50, 400]], 0.0, SIZE)
    assert len({o.track_id for o in detected + points}) == 5   # one id source for the camera
    followed = streams.follow(prev, cur, 0.033)
    for before, after in zip(detected, followed[("detect", "cup")]):
        assert after.track_id == before.track_id and after.status == PREDICTED and after.reason == ""
        assert np.abs(np.subtract(after.coords, before.coords) - [*shift, *shift]).max() < tolerance
    for before, after in zip(points, followed[("point", "person")]):
        assert after.status == PREDICTED
        assert np.abs(np.subtract(after.coords, before.coords) - list(shift)).max() < tolerance
    # RGB frames give the same answer as gray ones (one tracker, its own follow).
    tracker = BoxTracker()
    tracker.update(boxes[:1], 0.0, SIZE)
    rgb = lambda g: np.repeat(g[:, :, None], 3, axis=2)  # noqa: E731
    (one,) = tracker.follow(rgb(prev), rgb(cur), 0.033)
    assert np.abs(np.subtract(one.coords, boxes[0]) - [*shift, *shift]).max() < tolerance


def test_flow_that_cannot_follow_holds_the_box_with_a_reason(texture):
    prev = view(texture).copy()
    prev[300:400, 400:500] = 90   # a flat patch: nothing to follow
    rows = [box(150, 150, 80, 60), box(450, 350, 80, 80), box(700, 100), box(100, 100, 6, 6)]
    tracker = BoxTracker()
    tracker.update(rows, 0.0, SIZE)
    lost = tracker.follow(prev, np.full_like(prev, 128), 0.033)   # the scene vanished
    assert [t.status for t in lost] == [HELD] * 4
    assert [t.coords for t in lost] == [pytest.approx(r) for r in rows]   # as last known
    assert "features lost" in lost[0].reason
    assert "no texture" in lost[1].reason
    assert "outside the image" in lost[2].reason
    assert "too small" in lost[3].reason
    # Another scene altogether: features do not come back to where they started.
    other = SparseFlow().move(prev, view(texture)[::-1].copy(), [rows[0]])
    assert not other[0].moved and "features lost" in other[0].reason
    # Held boxes are still live tracks: the next result finds them.
    again = tracker.update(rows[:1], 0.1, SIZE)
    assert again[0].track_id == lost[0].track_id


def test_flow_beyond_its_reach_holds_boxes_and_never_moves_them_wrongly(texture):
    """Shifts from within the pyramid's reach to far past it: every box either moves by the shift
    or is HELD. Past the reach, Lucas-Kanade can settle on a look-alike patch both ways (passing
    the forward-backward check); such features scatter, and the spread check drops them."""
    flow, prev = SparseFlow(), view(texture)
    rows = [[100, 100, 180, 160], [300, 200, 400, 300], [450, 350, 530, 420], [200, 300, 260, 380]]
    outcomes = {"moved": 0, "held": 0}
    for dx in range(20, 80, 4):
        for dy in (-10, 0, 9):
            for move in flow.move(prev, view(texture, dx, dy), rows):
                if move.moved:
                    assert np.abs(np.subtract(move.shift, (dx, dy))).max() < 0.5, (dx, dy, move)
                else:
                    assert move.reason
                outcomes["moved" if move.moved else "held"] += 1
    assert outcomes["moved"] and outcomes["held"]   # the grid spans both sides of the reach


def test_new_image_size_ends_tracks_and_streams_dropped():
    streams = StreamTrackers()
    tracker = streams.get("detect", "cup")
    a = tracker.update([box(100, 100)], 0.0, SIZE)[0]
    b = tracker.update([box(100, 100)], DT, (1280, 960))[0]
    assert b.track_id != a.track_id and len(tracker.tracks()) == 1
    streams.get("point", "person")
    streams.retain([("point", "person")])
    assert streams.streams() == [("point", "person")]
    assert streams.get("detect", "cup") is not tracker   # a fresh tracker, ids go on
    assert streams.get("detect", "cup").update([box(100, 100)], 0.0, SIZE)[0].track_id > b.track_id


def test_another_cameras_frame_ends_tracks():
    """A topic switched between cameras (a mux), or two drivers on one topic, at one image size:
    the object at the same pixels of another camera's frame is another object and must not take
    this camera's id (a planner following id N would follow it). No frame given: as before."""
    tracker = BoxTracker()
    front = tracker.update([box(100, 100)], 0.0, SIZE, frame="front_optical")[0]
    assert tracker.update([box(102, 100)], DT, SIZE, frame="front_optical")[0].track_id == front.track_id
    rear = tracker.update([box(104, 100)], 2 * DT, SIZE, frame="rear_optical")[0]
    assert rear.track_id != front.track_id and len(tracker.tracks()) == 1
    back = tracker.update([box(104, 100)], 3 * DT, SIZE, frame="front_optical")[0]
    assert back.track_id not in (front.track_id, rear.track_id)
    assert tracker.update([box(104, 100)], 4 * DT, SIZE)[0].track_id == back.track_id
    points = PointTracker()
    a = points.update([(100, 100)], 0.0, SIZE, frame="front_optical")[0]
    assert points.update([(100, 100)], DT, SIZE, frame="rear_optical")[0].track_id != a.track_id
    tracker.reset()
    assert tracker.frame is None


def test_bad_input_is_a_clear_error(texture):
    tracker = BoxTracker()
    tracker.update([box(100, 100)], 1.0, SIZE)
    cases = [
        (lambda: tracker.update([[1, 2, 3]], 2.0, SIZE), "shape"),
        (lambda: tracker.update([[0, 0, np.nan, 5]], 2.0, SIZE), "finite"),
        (lambda: tracker.update([[10, 0, 5, 5]], 2.0, SIZE), "x_max < x_min"),
        (lambda: tracker.update([box(1, 1)], 0.5, SIZE), "older than the previous"),
        (lambda: tracker.update([box(1, 1)], float("inf"), SIZE), "finite"),
        (lambda: tracker.update([box(1, 1)], 2.0, SIZE, scores=[0.1, 0.2]), "2 scores for 1"),
        (lambda: tracker.update([box(1, 1)], 2.0, (0, 480)), "positive"),
        (lambda: tracker.follow(texture[:480, :640], texture[:240, :320], 2.0), "differ in size"),
        (lambda: tracker.follow(texture[:240, :320], texture[:240, :320], 2.0), "320x240"),
        (lambda: tracker.follow(texture[:480, :640], texture[:480, :640], 0.5), "older than the latest"),
        (lambda: tracker.follow(texture[:480, :640].astype(np.float32), texture[:480, :640], 2.0), "uint8"),
        (lambda: BoxTracker(max_missed=0), "max_missed"),
        (lambda: BoxTracker(min_iou=0), "min_iou"),
        (lambda: PointTracker(gate=-1), "gate"),
        (lambda: StreamTrackers().get("caption", ""), "no tracking for task"),
    ]
    for call, message in cases:
        with pytest.raises(ValueError, match=message):
            call()
    assert [t.coords for t in tracker.tracks()] == [pytest.approx(box(100, 100))]   # untouched


def test_an_unmoved_object_keeps_its_id_when_its_neighbour_hides_and_a_new_one_appears():
    """A and B side by side; then A unmoved (overlap 1 with its track), B hidden, a new C at A's
    other side. Maximising the number of pairs matched A to B's track and C to A's: both ids named
    the wrong objects. Maximising the overlap keeps A's id and gives C a new one."""
    tracker = BoxTracker(velocity=False)
    a, b = tracker.update([[100, 100, 200, 200], [150, 100, 250, 200]], 0.0, SIZE)
    a2, c = tracker.update([[100, 100, 200, 200], [50, 100, 150, 200]], DT, SIZE)
    assert a2.track_id == a.track_id and c.track_id not in (a.track_id, b.track_id)
    points = PointTracker(velocity=False)   # (pixels) the new point 20 px from the unmoved one
    p, q = points.update([[100, 100], [120, 100]], 0.0, SIZE)
    p2, r = points.update([[100, 100], [80, 100]], DT, SIZE)
    assert p2.track_id == p.track_id and r.track_id != p.track_id


def test_a_track_last_detected_longer_ago_than_max_age_ends():
    """Misses count model results: a camera off for ten minutes (or a node inactive meanwhile)
    left the cup's track live, and a different cup there now took its id."""
    tracker = BoxTracker(max_age_s=10.0)
    first = tracker.update([box(100, 100)], 0.0, SIZE)
    later = tracker.update([box(110, 100)], 600.0, SIZE)
    assert later[0].track_id != first[0].track_id
    soon = tracker.update([box(112, 100)], 601.0, SIZE)
    assert soon[0].track_id == later[0].track_id


def test_a_restarted_node_does_not_hand_out_the_ids_of_its_last_run():
    """Ids began at 1 in every process: a planner holding id 3 across a respawn of the vision node
    saw another object take it. A clock-based first id starts past the earlier run's."""
    import time
    first = IdSource.clock_based()
    taken = [first.take() for _ in range(3)]
    time.sleep(0.2)
    again = IdSource.clock_based()
    assert again.take() > max(taken) and 0 < again.last < 2**32


def test_a_late_result_of_a_dropped_prompt_leaves_no_tracks_for_when_it_is_asked_again():
    """The node's worker tracks a frame's results after its model ran (seconds on a CPU); a prompt
    dropped meanwhile (retain) had its tracker made again by that frame's result, and kept: asked
    again later, the prompt's objects took the ids of tracks from before, though a prompt asked
    again gets new ids (the camera may show other objects there by then)."""
    streams = StreamTrackers()
    streams.retain([("detect", "cup")])
    before = streams.get("detect", "cup").update([box(100, 100)], 0.0, SIZE)[0]
    streams.retain([("detect", "mug")])                                        # cup dropped ...
    late = streams.get("detect", "cup").update([box(100, 100)], DT, SIZE)[0]   # ... while its frame ran
    assert late.track_id != before.track_id and streams.streams() == []
    streams.retain([("detect", "cup")])                                        # asked again
    again = streams.get("detect", "cup").update([box(100, 100)], 2 * DT, SIZE)[0]
    assert again.track_id not in (before.track_id, late.track_id)
    assert streams.get("detect", "cup").update([box(101, 100)], 3 * DT, SIZE)[0].track_id == again.track_id
