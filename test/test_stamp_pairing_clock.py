"""photon_ros/stamp_pairing.py against a system clock that steps (NTP, chrony makestep, GPS
time): deadlines are on the monotonic clock, reception times (wall clock) are converted to it,
and a reader never waits past tolerance + grace of monotonic time however the clock moves."""
from __future__ import annotations

import threading
import time

from photon_ros.stamp_pairing import NS, Match, NoMatch, StampPairing

MS = NS // 1000
T0 = 1_700_000_000 * NS


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float, *others: "Clock") -> None:
        for clock in (self, *others):
            clock.now += seconds


def test_a_wall_clock_step_back_moves_no_deadline():
    """Reception times are wall clock. Stepped back a minute after a frame arrived: a depth that
    reached the process past the frame's deadline is not its pair (on the wall clock it looks a
    minute early), and one that came in time is."""
    mono, wall = Clock(100.0), Clock(1_700_000_000.0)
    pairing = StampPairing("depth image", 0.05, clock=mono, wall_clock=wall)
    first = pairing.wait_for(T0, arrived_at=wall.now)
    wall.now -= 60.0
    mono.advance(0.2, wall)                            # past its deadline and the grace
    pairing.add(T0, "too late", received_at=wall.now)
    assert isinstance(first.poll(), NoMatch) and pairing.late == 1
    second = pairing.wait_for(T0 + 33 * MS, arrived_at=wall.now)
    mono.advance(0.02, wall)
    pairing.add(T0 + 33 * MS, "own", received_at=wall.now)
    assert second.poll().msg == "own" and second.poll().waited_s < 0.05


def test_a_reception_time_from_before_a_step_forward_is_not_in_the_future():
    """Received, then the wall clock stepped forward before the callback ran: the frame's arrival
    is not put after now (its deadline would be too)."""
    mono, wall = Clock(100.0), Clock(1_700_000_000.0)
    pairing = StampPairing("depth image", 0.05, clock=mono, wall_clock=wall)
    received = wall.now
    wall.now -= 30.0                                   # the clock at reception was 30 s ahead
    wait = pairing.wait_for(T0, arrived_at=received)
    assert wait.deadline <= mono.now + 0.05


def test_a_reader_returns_though_the_pairing_clock_steps_back():
    """A pairing on a clock that steps back a minute after a frame arrived whose depth was lost
    (and depth stamped on the stepped clock keeps coming): result() without a timeout, as the
    node's worker calls it, still returns, with the reason, not when the clock catches up."""
    step = [0.0]

    def stepped() -> float:
        return time.time() - step[0]

    pairing = StampPairing("depth image", 0.05, clock=stepped)
    wait = pairing.wait_for(round(stepped() * NS))
    step[0] = 60.0
    for i in range(3):
        pairing.add(round(stepped() * NS) + i * 33 * MS, f"depth {i}")
    got = []
    reader = threading.Thread(target=lambda: got.append(wait.result()), daemon=True)
    reader.start()
    reader.join(5.0)                                   # tolerance + grace is 0.15 s
    assert not reader.is_alive(), "result() still waiting after the clock stepped back"
    assert isinstance(got[0], NoMatch) and pairing.waiting() == 0


def test_default_clocks_pair_wall_clock_reception_times():
    """The node passes rclpy's reception times (wall clock) to a pairing on default clocks; the
    deadline they give is on the monotonic clock, which no clock step moves. (A tolerance of a
    minute: with 0.05 s, a busy machine's pause of 0.15 s between the frame and its depth could
    decide the frame without it.)"""
    pairing = StampPairing("depth image", 60.0)
    wait = pairing.wait_for(T0, arrived_at=time.time())
    assert wait.deadline <= time.monotonic() + 60.0             # not on the wall clock (~1.7e9)
    pairing.add(T0, "own", received_at=time.time())
    outcome = wait.poll()
    assert isinstance(outcome, Match) and outcome.rule == "exact"
