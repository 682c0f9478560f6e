"""Pairing a colour frame with the depth image and camera_info of its own stamp
(photon_ros/stamp_pairing.py), without ROS: on a clock the test moves, messages arriving in the
order drivers send them; and on the real clock, a reader waiting while another thread adds."""
from __future__ import annotations

import threading
import time

import pytest

from photon_ros.stamp_pairing import NS, SPACING_STAMPS, Match, NoMatch, StampPairing

MS = NS // 1000
T0 = 1_700_000_000 * NS       # a realistic stamp: float seconds would lose its nanoseconds


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def stream(rate_hz: float, lag_s: float, frames: int, skip=(), tolerance=0.05, depth_offset_ns=0):
    """Colour frames at `rate_hz`, each one's depth arriving `lag_s` after it (stamped as the frame,
    plus depth_offset_ns), none for the frames in `skip`. Returns each frame's outcome as decided
    by its deadline."""
    clock = Clock()
    pairing = StampPairing("depth image", tolerance, clock=clock)
    events = []
    for i in range(frames):
        at = 100.0 + i / rate_hz
        stamp = T0 + round(i * NS / rate_hz)
        events.append((at, 1, "colour", i, stamp))
        if i not in skip:
            events.append((at + lag_s, 0, "depth", i, stamp + depth_offset_ns))
    waits = {}
    for at, _, kind, i, stamp in sorted(events):
        clock.now = at
        if kind == "colour":
            waits[i] = pairing.wait_for(stamp)
        else:
            pairing.add(stamp, f"depth {i}")
    clock.now += 1.0                   # read well after every deadline: what each was decided with
    return [waits[i].poll() for i in range(frames)], pairing


@pytest.mark.parametrize("rate_hz", [15, 30])
@pytest.mark.parametrize("lag_ms", [0, 10, 30, 40])
def test_every_frame_waits_for_its_own_depth(rate_hz, lag_ms):
    """Depth 0-40 ms after its colour frame: each frame pairs with its own stamp, having waited
    the lag (at 30 Hz the previous depth, 33 ms older, is within the 50 ms tolerance: not taken)."""
    outcomes, pairing = stream(rate_hz, lag_ms / 1000, 12)
    assert [o.msg for o in outcomes] == [f"depth {i}" for i in range(12)]
    assert all(o.rule == "exact" and o.offset_s == 0 for o in outcomes)
    assert all(o.waited_s == pytest.approx(lag_ms / 1000, abs=1e-9) for o in outcomes)
    assert pairing.outcomes["exact"] == 12 and pairing.waiting() == 0


def test_depth_that_never_comes_gives_the_reason_never_a_neighbour_outside_the_tolerance():
    """15 Hz: neighbours are 67 ms away, outside 50 ms: frames 3 and 7 have no depth, and why."""
    outcomes, _ = stream(15, 0.03, 10, skip={3, 7})
    for i, outcome in enumerate(outcomes):
        if i in (3, 7):
            assert isinstance(outcome, NoMatch), outcome
            assert outcome.reason == ("no depth image stamped within 0.05 s of this frame arrived within 0.05 s "
                                      "of it (depth_tolerance_s); the nearest was stamped 0.067 s before it")
            assert outcome.waited_s == pytest.approx(0.05)
        else:
            assert isinstance(outcome, Match) and outcome.msg == f"depth {i}"


def test_at_30_hz_a_missing_depth_takes_the_nearest_within_the_tolerance():
    outcomes, pairing = stream(30, 0.03, 6, skip={3})
    assert outcomes[3].msg == "depth 2" and outcomes[3].rule == "nearest"
    assert outcomes[3].offset_s == pytest.approx(-1 / 30, abs=1e-6)
    assert pairing.outcomes == {"exact": 5, "nearest": 1, "newest": 0, "none": 0}


def test_a_depth_stream_that_skipped_frames_does_not_hand_a_frame_its_neighbours_depth():
    """An aligned-depth driver that lagged (or depth lost on a best-effort queue): depth for every
    other frame, 67 ms apart, then for every frame again, 15 ms after it. The previous frame's
    depth, 33 ms away, is within half the depth's spacing: it ended the wait at once, and the
    frame's own depth, coming in time, was ignored. The frames' spacing (33 ms) keeps it waiting;
    the frames without their own depth still take a neighbour's."""
    outcomes, _ = stream(30, 0.015, 26, skip=set(range(1, 20, 2)))
    assert [o.msg for o in outcomes[20:]] == [f"depth {i}" for i in range(20, 26)]
    assert all(o.rule == "exact" for o in outcomes[20:])
    assert {outcomes[i].msg for i in range(1, 20, 2)} <= {f"depth {i}" for i in range(0, 21, 2)}
    # The same before any frame was seen (the frames' spacing unknown): the first waits too.
    clock = Clock()
    pairing = StampPairing("depth image", 0.05, clock=clock)
    for i in range(0, 21, 2):
        clock.now = 100.0 + i * 0.033 + 0.01
        pairing.add(T0 + i * 33 * MS, f"depth {i}")
    clock.now = 100.0 + 21 * 0.033
    wait = pairing.wait_for(T0 + 21 * 33 * MS)
    clock.now += 0.015
    pairing.add(T0 + 21 * 33 * MS, "depth 21")
    assert wait.poll().msg == "depth 21" and wait.poll().rule == "exact"


def test_just_after_start_a_lost_depth_image_does_not_end_a_wait_early():
    """Depth at 30 Hz free-running (6.8 ms off colour's grid) beside colour at 15 Hz, two depth
    images lost at the start: read from two stamps the depth spacing looked 100 ms, the frames'
    66.7 ms made "within half of it" 33 ms, and frame 133.3 took depth 106.8 (26.5 ms off) while
    depth 140.1 (6.8 ms) arrived 30 ms later, inside its deadline."""
    clock = Clock()
    pairing = StampPairing("depth image", 0.05, clock=clock, wall_clock=clock)

    def at(ms: float) -> float:
        clock.now = 100.0 + ms / 1000
        return clock.now

    pairing.wait_for(T0, at(5.8))
    pairing.add(T0 + round(6.8 * MS), "depth 6.8", at(38.2))
    pairing.wait_for(T0 + round(66.7 * MS), at(72.7))
    pairing.add(T0 + round(106.8 * MS), "depth 106.8", at(138.2))     # 40.1 and 73.4 lost
    wait = pairing.wait_for(T0 + round(133.3 * MS), at(142.0))
    pairing.add(T0 + round(140.1 * MS), "depth 140.1", at(171.6))
    at(300.0)
    assert wait.poll().msg == "depth 140.1"


def test_an_image_sent_with_a_request_does_not_count_in_the_frames_spacing():
    """Depth stamped 10 ms before its 30 Hz frame ends each wait as it arrives. A request's own
    image, stamped 2 ms after a camera frame, is no frame of the stream: counted, it made the
    frames' spacing 2 ms and every frame after it waited for the next depth (~33 ms more)."""
    clock = Clock()
    pairing = StampPairing("depth image", 0.05, clock=clock)
    waits = []
    for i in range(14):
        clock.now = 100.0 + i * 0.033
        if i == 5:
            pairing.wait_for(T0 + 4 * 33 * MS + 2 * MS, stream=False)
        waits.append(pairing.wait_for(T0 + i * 33 * MS))
        clock.now += 0.005
        pairing.add(T0 + i * 33 * MS - 10 * MS, f"depth {i}")
    clock.now += 1.0
    outcomes = [w.poll() for w in waits[5:]]
    assert [o.msg for o in outcomes] == [f"depth {i}" for i in range(5, 14)]
    assert all(o.waited_s == pytest.approx(0.005) for o in outcomes), [o.waited_s for o in outcomes]


def test_depth_later_than_the_tolerance_is_not_waited_for():
    """Depth 60 ms late at 15 Hz: the deadline (50 ms after arrival) passes first; the depth that
    comes afterwards does not change the outcome read later."""
    outcomes, _ = stream(15, 0.06, 4)
    assert all(isinstance(o, NoMatch) and o.waited_s == pytest.approx(0.05) for o in outcomes)


def test_unsynchronised_stamps_end_the_wait_when_nothing_nearer_can_come():
    """A depth stream stamped 2 ms before its colour frame: pairs as soon as that depth arrives
    (the next is a frame's spacing later, farther) once the spacing is known (SPACING_STAMPS
    frames); stamped 10 ms after: as soon as it arrives."""
    for offset_ms in (-2, 10):
        outcomes, _ = stream(30, 0.02, 8, depth_offset_ns=offset_ms * MS)
        assert all(o.rule == "nearest" and o.offset_s == pytest.approx(offset_ms / 1000) for o in outcomes)
        known = outcomes[SPACING_STAMPS - 1:] if offset_ms < 0 else outcomes
        assert all(o.waited_s == pytest.approx(0.02) for o in known), [o.waited_s for o in outcomes]


def test_depth_before_its_colour_frame_pairs_at_once_and_nothing_is_kept_forever():
    clock = Clock()
    pairing = StampPairing("depth image", 0.05, keep=3, clock=clock)
    for i in range(10):
        pairing.add(T0 + i * 66 * MS, f"depth {i}")
        outcome = pairing.wait_for(T0 + i * 66 * MS).poll()
        assert outcome.msg == f"depth {i}" and outcome.waited_s == 0
        clock.now += 0.066
    assert len(pairing._kept) == 3 and pairing.waiting() == 0


@pytest.mark.parametrize("offset_ms", [-3, 3])
def test_depth_before_its_colour_frame_stamped_a_few_ms_off_pairs_at_once(offset_ms):
    """Separate sensors (an OAK-type driver) stamp depth a few ms off the colour and may send it
    first: the frame pairs at once, not after the next depth message (a frame period later), once
    the stream's spacing is known (from SPACING_STAMPS messages: nothing nearer can come then)."""
    clock = Clock()
    pairing = StampPairing("depth image", 0.05, clock=clock)
    for i in range(6):
        pairing.add(T0 + i * 33 * MS + offset_ms * MS, f"depth {i}")
        outcome = pairing.wait_for(T0 + i * 33 * MS).poll()
        if i >= SPACING_STAMPS - 1:
            assert outcome is not None and outcome.msg == f"depth {i}" and outcome.waited_s == 0
        clock.now += 0.033


def test_nothing_received_and_bounded_waiting():
    clock = Clock()
    pairing = StampPairing("depth image", 0.05, max_waiting=2, clock=clock)
    waits = [pairing.wait_for(T0 + i * MS) for i in range(3)]   # three frames within 2 ms
    # the newcomer is given up: the frames already waiting (one of them being read) keep their wait
    assert waits[2].done and not waits[0].done and not waits[1].done and pairing.given_up == 1
    assert waits[2].result().reason == ("gave up waiting for a depth image: more than 2 frames were waiting at "
                                        "once")
    clock.now += 0.15                  # its deadline and the callbacks' grace past it
    assert waits[0].poll().reason == "no depth image received yet"


def test_stamps_going_back_start_over():
    clock = Clock()
    pairing = StampPairing("depth image", 0.05, clock=clock)
    pairing.add(T0 + 10 * NS, "later")
    note = pairing.add(T0, "replayed")
    assert note.startswith("depth image stamps went back 10.000 s")
    assert pairing.wait_for(T0).poll().msg == "replayed"
    assert pairing.add(T0 + NS // 2, "fine") == ""
    # A colour frame of the replay before its depth: what is kept from before does not end its wait.
    pairing.add(T0 + 20 * NS, "before the replay")
    replay = pairing.wait_for(T0 + NS)
    assert not replay.done
    pairing.add(T0 + NS, "replayed depth")
    assert replay.poll().msg == "replayed depth"


def test_a_reader_waits_for_a_depth_another_thread_adds():
    """On the real clock: result() blocks until the depth comes (30 ms), or, when it does not,
    returns the reason at the deadline plus the callbacks' grace (nothing received later showed
    that every callback of what came by the deadline has run). The first pairing's deadline is far
    off (60 s), so that a busy machine's late adder still comes before it: result() returning
    before the deadline is what shows that it ended with the depth."""
    patient = StampPairing("depth image", 60.0)
    wait = patient.wait_for(T0)
    adder = threading.Timer(0.03, patient.add, (T0, "own"))
    started = time.monotonic()
    adder.start()
    outcome = wait.result()
    took = time.monotonic() - started
    adder.join()
    assert isinstance(outcome, Match) and outcome.msg == "own" and 0.02 <= took < 60.0, (outcome, took)
    pairing = StampPairing("depth image", 0.2)
    pairing.add(T0, "own")
    started = time.monotonic()
    lonely = pairing.wait_for(T0 + NS)
    assert isinstance(lonely.result(), NoMatch) and time.monotonic() - started >= 0.29   # + the grace


def test_what_counts_is_when_a_message_reached_the_process_not_when_its_callback_ran():
    """A busy executor runs the depth's callback 80 ms after the colour frame's, but the depth
    reached the process 30 ms after it: paired. A depth received after the deadline is not, even
    when its callback runs first; and a later message shows the callbacks have caught up."""
    clock = Clock()
    pairing = StampPairing("depth image", 0.05, clock=clock)
    wait = pairing.wait_for(T0, arrived_at=100.0)
    clock.now = 100.08
    assert not wait.done                                        # within the callbacks' grace
    pairing.add(T0, "own", received_at=100.03)
    assert wait.poll().msg == "own" and wait.poll().waited_s == pytest.approx(0.03)
    late = pairing.wait_for(T0 + 66 * MS, arrived_at=100.066)
    clock.now = 100.2
    pairing.add(T0 + 66 * MS, "too late", received_at=100.12)
    assert isinstance(late.poll(), NoMatch) and late.poll().waited_s == pytest.approx(0.05)
    # The colour frame's callback ran after its depth's, and after a later message: decided at once.
    pairing.add(T0 + 133 * MS, "own 133", received_at=100.15)
    pairing.add(T0 + 200 * MS, "next", received_at=100.25)
    assert pairing.wait_for(T0 + 133 * MS, arrived_at=100.14).poll().msg == "own 133"
    # A colour frame whose own callback ran 0.3 s late (a starved executor): the depth callbacks
    # queued behind it still count, for the grace after it.
    clock.now = 101.0
    starved = pairing.wait_for(T0 + 4 * NS, arrived_at=100.7)
    clock.now = 101.05
    assert not starved.done and starved.poll() is None
    pairing.add(T0 + 4 * NS, "own 4", received_at=100.72)
    assert starved.poll().msg == "own 4"



def test_a_reader_busy_past_the_deadline_still_sees_the_callbacks_it_held_up():
    """The frame's depth reached the process in time, but its callback runs only after the reader
    (a long inference that held the interpreter) comes for the outcome, well past the deadline and
    its grace: the reader still waits the grace for it. Without it, the reader gets the reason
    after the grace from its first read, not at once.
    First a reader in a thread of its own on a clock the test moves: the depth's callback runs
    after the reader's first read (the test waits for it) and within its grace (the clock stands
    still), whatever the machine's speed; the reader's backstop (tolerance + grace of real time)
    is a minute. Then on the real clock."""
    clock, reader_read = Clock(), threading.Event()

    def read_clock() -> float:
        if threading.current_thread().name == "reader":
            reader_read.set()
        return clock()

    pairing = StampPairing("depth image", 60.0, clock=read_clock)
    wait = pairing.wait_for(T0, arrived_at=100.0)
    clock.now = 100.0 + 60.0 + 0.2                             # the reader is busy past the deadline and grace
    got: list = []
    reader = threading.Thread(target=lambda: got.append(wait.result()), name="reader", daemon=True)
    reader.start()
    assert reader_read.wait(60)                                # it has come for the outcome
    pairing.add(T0, "own", received_at=100.02)                 # (under the lock: after its first read)
    reader.join(60)
    assert not reader.is_alive() and got, "result() still waiting"
    outcome = got[0]
    assert isinstance(outcome, Match) and outcome.msg == "own", outcome
    assert pairing.late == pairing.seen_late == 0
    pairing = StampPairing("depth image", 0.05)
    pairing.add(T0, "own")
    lonely = pairing.wait_for(T0 + NS, arrived_at=time.time())
    time.sleep(0.2)
    started = time.monotonic()
    assert isinstance(lonely.result(), NoMatch) and time.monotonic() - started >= 0.09


def test_own_messages_after_the_decision_are_counted_late_or_seen_late():
    """A frame decided without its own depth: when that depth comes after all, it is counted as
    late (it reached the process after the frame's deadline) or seen late (it reached it in time,
    its callback ran after the decision), once; a frame paired with its own is never counted."""
    clock = Clock()
    pairing = StampPairing("depth image", 0.1, clock=clock)
    first = pairing.wait_for(T0, arrived_at=100.0)
    clock.now = 100.3
    assert isinstance(first.poll(), NoMatch)
    pairing.add(T0, "late", received_at=100.15)
    assert (pairing.late, pairing.seen_late) == (1, 0)
    second = pairing.wait_for(T0 + 66 * MS, arrived_at=100.3)
    clock.now = 100.6
    assert isinstance(second.poll(), Match) and second.poll().rule == "nearest"
    pairing.add(T0 + 66 * MS, "held up", received_at=100.32)
    pairing.add(T0 + 66 * MS, "held up", received_at=100.32)  # the same again: counted once
    assert (pairing.late, pairing.seen_late) == (1, 1)
    third = pairing.wait_for(T0 + 133 * MS, arrived_at=100.6)
    pairing.add(T0 + 133 * MS, "own", received_at=100.61)
    assert third.poll().rule == "exact" and (pairing.late, pairing.seen_late) == (1, 1)
    # past the deadline but inside the callbacks' grace: the frame is decided by it, and it counts
    fourth = pairing.wait_for(T0 + 200 * MS, arrived_at=100.6)
    clock.now = 100.75
    pairing.add(T0 + 200 * MS, "past the deadline", received_at=100.75)
    assert fourth.poll().rule != "exact" and (pairing.late, pairing.seen_late) == (2, 1)
    # already here, received after the deadline, when the frame's own callback runs
    clock.now = 100.96
    pairing.add(T0 + 300 * MS, "before its frame's callback", received_at=100.95)
    clock.now = 101.0
    assert pairing.wait_for(T0 + 300 * MS, arrived_at=100.8).poll().rule != "exact"
    assert (pairing.late, pairing.seen_late) == (3, 1)
    # a bag played again: the stamps start over, and a frame decided before counts nothing
    fifth = pairing.wait_for(T0 + 400 * MS, arrived_at=101.0)
    clock.now = 101.3
    assert fifth.poll().rule != "exact"
    pairing.add(T0 + 2 * NS, "on", received_at=101.3)
    pairing.add(T0 + 400 * MS, "replayed", received_at=101.31)
    assert (pairing.late, pairing.seen_late) == (3, 1)

def camera_info_pairing(clock):
    return StampPairing("camera_info", 0.05, keep=4, fallback_newest=True, clock=clock)


def test_latched_camera_info_is_used_whatever_its_stamp_and_at_once_when_known_latched():
    """Published once, stamped an hour later than the frames: a frame within STREAM_GAP_S of it
    waits the tolerance (another might be on its way), later ones take it at once."""
    clock = Clock()
    info = camera_info_pairing(clock)
    info.add(T0 + 3600 * NS, "latched")
    info.add(T0 + 3600 * NS, "latched")    # delivered again by the second subscription: the same one
    first = info.wait_for(T0)
    clock.now += 0.15
    assert first.poll().msg == "latched" and first.poll().waited_s == pytest.approx(0.05)
    clock.now += 0.5
    for i in range(5):
        clock.now += 1 / 30
        outcome = info.wait_for(T0 + i * 33 * MS).poll()
        assert outcome.msg == "latched" and outcome.rule == "newest" and outcome.waited_s == 0
    assert info.received == 2 and len(info._kept) == 1
    # Frames stamped long before it (a bag played at its own stamps, the camera_info live): still it.
    assert info.wait_for(T0 - 3600 * NS).poll().msg == "latched"


def test_camera_info_with_every_frame_pairs_by_stamp_and_falls_back_to_the_newest():
    """Published with each frame's depth, 30 ms after the colour frame: each frame waits for its
    own (the first one too, with none received before); one that never comes: the newest."""
    clock = Clock()
    info = camera_info_pairing(clock)
    for i in range(6):
        stamp = T0 + i * 66 * MS
        wait = info.wait_for(stamp)
        assert not wait.done
        clock.now += 0.03
        if i != 4:
            info.add(stamp, f"info {i}")
        clock.now += 0.036 if i != 4 else 0.2
        outcome = wait.poll()
        if i == 4:
            assert outcome.msg == "info 3" and outcome.rule == "newest" and outcome.waited_s == pytest.approx(0.05)
        else:
            assert outcome.msg == f"info {i}" and outcome.rule == "exact" and outcome.waited_s == pytest.approx(0.03)


def test_an_unstamped_frame_pairs_with_no_depth_however_old_an_unstamped_depth_is():
    """A driver that stamps nothing: a depth image stamped 0 taken ten seconds ago was the "exact"
    pair of a colour frame stamped 0. Decided at once, with the reason; camera_info, whose newest
    stands for all, still pairs."""
    clock = Clock()
    depth = StampPairing("depth image", 0.05, clock=clock)
    depth.add(0, "depth of ten seconds ago")
    clock.now += 10.0
    wait = depth.wait_for(0)
    assert wait.done
    outcome = wait.poll()
    assert isinstance(outcome, NoMatch) and "no stamp" in outcome.reason
    info = camera_info_pairing(clock)
    info.add(0, "info")
    clock.now += 1.0
    assert info.wait_for(0).poll().msg == "info"


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="tolerance"):
        StampPairing("depth image", float("nan"))
    with pytest.raises(ValueError, match="keep"):
        StampPairing("depth image", 0.05, keep=0)


def test_frames_decided_without_their_own_depth_hold_no_depth_image():
    """What counts a late own message keeps only (stamp, deadline): the decided frames it held
    kept their depth images alive past `keep` (85 MB of 720p depth at 30 Hz colour, 15 Hz depth)."""
    import gc
    import weakref

    class Depth:
        pass

    clock = Clock()
    pairing = StampPairing("depth image", 0.05, clock=clock, keep=2)
    alive = []
    for i in range(30):
        stamp = T0 + i * 66 * MS
        wait = pairing.wait_for(stamp)
        depth = Depth()
        alive.append(weakref.ref(depth))
        clock.now += 0.01
        pairing.add(stamp + 20 * MS, depth)   # the nearest within the tolerance, never its own
        clock.now += 0.06
        assert wait.poll().rule == "nearest"
        del wait, depth
    gc.collect()
    assert sum(ref() is not None for ref in alive) <= 2


def test_a_depth_clock_far_ahead_is_named_in_the_reason():
    """Depth stamped 2 s after the colour frames (unsynchronised machines): no pair, and the reason
    says how far the nearest was, as it does at 0.9 s, where it said nothing."""
    clock = Clock()
    pairing = StampPairing("depth image", 0.05, clock=clock)
    wait = pairing.wait_for(T0)
    pairing.add(T0 + 2 * NS, "depth")
    clock.now += 1.0
    outcome = wait.poll()
    assert isinstance(outcome, NoMatch) and "the nearest was stamped 2.000 s after it" in outcome.reason


@pytest.mark.parametrize("rate_hz, lag_s, tolerance", [(30, 0.6, 0.7), (60, 0.3, 0.35)])
def test_a_raised_tolerance_gives_up_no_frame_still_in_its_wait(rate_hz, lag_s, tolerance):
    """Depth lagging its frame by more than 0.5 s, the tolerance raised above the lag: the frames
    waiting at once outnumber a fixed bound of 16. The default bound grows with the tolerance:
    every frame gets its own depth, none a neighbour's."""
    outcomes, pairing = stream(rate_hz, lag_s, 90, tolerance=tolerance)
    assert all(o.rule == "exact" for o in outcomes), {(o.rule, o.offset_s) for o in outcomes}
    assert pairing.given_up == 0


def test_over_the_bound_the_newcomer_is_given_up_and_never_with_a_neighbours_depth():
    """Frames already waiting (the oldest is the one being read) keep their wait; the one over the
    bound gets no depth, with the reason, not the neighbour's depth that is kept."""
    clock = Clock()
    pairing = StampPairing("depth image", 0.05, max_waiting=2, clock=clock)
    pairing.add(T0 - 33 * MS, "neighbour")
    waits = [pairing.wait_for(T0 + i * MS) for i in range(3)]
    assert not waits[0].done and not waits[1].done and pairing.given_up == 1
    over = waits[2].poll()
    assert isinstance(over, NoMatch) and over.reason.startswith("gave up waiting"), over
    clock.now += 0.01
    pairing.add(T0, "own")
    assert waits[0].poll().msg == "own" and waits[0].poll().rule == "exact"


def jumping_stream(jump_s: float, frames: int = 60, at_frame: int = 30):
    """Colour and depth at 30 Hz, depth 10 ms after its frame with its stamp; from `at_frame` on,
    both streams' stamps are `jump_s` earlier (a short bag looped, a simulation reset)."""
    clock = Clock()
    pairing = StampPairing("depth image", 0.05, clock=clock)
    events = []
    for i in range(frames):
        at = 100.0 + i / 30
        stamp = T0 + round(i * NS / 30) - (round(jump_s * NS) if i >= at_frame else 0)
        events += [(at, 1, "colour", i, stamp), (at + 0.010, 0, "depth", i, stamp)]
    waits, notes = {}, {}
    for at, _, kind, i, stamp in sorted(events):
        clock.now = at
        if kind == "colour":
            waits[i] = pairing.wait_for(stamp)
        else:
            notes[i] = pairing.add(stamp, f"depth {i}")
    clock.now += 1.0
    return [waits[i].poll() for i in range(frames)], notes, pairing


@pytest.mark.parametrize("jump_s", [0.8, 0.25])
def test_stamps_going_back_less_than_a_second_start_over(jump_s):
    """Under JUMP_BACK_NS, a step back still started a new run: each frame of it took the previous
    frame's depth (stamped later, within the tolerance) as 'nearest'. Each takes its own, and the
    start over is said once (the note, the counter)."""
    outcomes, notes, pairing = jumping_stream(jump_s)
    assert [(o.rule, o.msg) for o in outcomes] == [("exact", f"depth {i}") for i in range(60)]
    assert pairing.restarts == 1
    assert notes[30].startswith(f"depth image stamps went back {jump_s - 1 / 30:.3f} s")
    assert all(note == "" for i, note in notes.items() if i != 30)


def test_a_kept_message_stamped_well_after_the_frame_does_not_end_its_wait():
    """The first colour frame after the stamps went back, before its depth: the kept depth, from
    before, is stamped after it but is not 'the next one' (nothing nearer would follow)."""
    clock = Clock()
    pairing = StampPairing("depth image", 0.05, clock=clock)
    pairing.add(T0 + 500 * MS, "before the loop")
    wait = pairing.wait_for(T0)
    assert not wait.done
    clock.now += 0.01
    pairing.add(T0, "own")
    assert wait.poll().msg == "own" and wait.poll().rule == "exact"
