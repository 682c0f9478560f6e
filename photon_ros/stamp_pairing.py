"""A colour frame and the depth image (or camera_info) of its own instant, paired by stamp the way
message_filters' ApproximateTime pairs them, inside the node and without ROS.

Depth-aligning drivers (realsense2_camera's aligned_depth_to_color, ...) compute the aligned depth
after the colour image and publish it later, with the colour image's stamp. So a colour frame does
not take whatever depth is there when it arrives; it waits for its own:

- A colour frame asks when it arrives (`StampPairing.wait_for(stamp, arrived_at)`) and may wait
  `tolerance_s`, measured from its arrival (its deadline).
- It pairs with the message whose stamp is nearest its own, among those stamped within
  `tolerance_s` of it that were there when it arrived or came by its deadline. A message with the
  frame's own stamp is always taken over any other.
- The wait ends as soon as nothing nearer can come: at once with the frame's own stamp; when a
  message stamped after the frame arrives (a stream's stamps rise, so nothing nearer follows); or
  when the nearest one is within half the stream's spacing of the frame (the smallest gap between
  the stamps of the last messages: the next one cannot be nearer) and within half the frames'
  spacing (the smallest gap between the stamps of the last frames: nearer this frame than any
  other, it is this frame's own, stamped by another clock, not a neighbour's). A stream that
  skipped frames for a while (an aligned-depth driver lagging, depth lost on a best-effort queue)
  has a spacing of two frames or more: the previous frame's message, a frame away, would end the
  wait on its own, before the frame's own message came. Both spacings are read from
  SPACING_STAMPS stamps at least: until then (a stream's first frames) only the first two rules end
  a wait early.
- At the deadline without a message within the tolerance the frame has none, with the reason; a
  neighbour's message outside the tolerance is never used. A message arriving after the deadline
  does not change an outcome: a frame's pairing is the same whenever it is read.
- Arrival is when a message reached the process (the middleware's reception time, rclpy's
  MessageInfo `received_timestamp`, wall clock, converted to the monotonic clock on arrival), not
  when its callback ran: a busy executor (a model on the CPU of the same process) runs callbacks
  tens of milliseconds late, the colour frame's and the depth's by different amounts. So past its
  deadline a frame still waits for the callbacks of what reached the process by then: until a
  message received later has been seen (all before it have, then), at most `grace_s`
  (CALLBACK_GRACE_S) past its deadline, past its own callback when that ran later still, or past
  the first read of its outcome when that came later (a reader busy past the deadline, a long
  inference, may itself have kept the callbacks waiting).
- A frame's own message that comes after the frame was decided without it is counted: `late`
  when it reached the process after the frame's deadline (the depth_tolerance_s is too short for
  this driver), `seen_late` when it reached it in time but its callback ran after the decision
  (the process was too busy to run callbacks).
- Nothing here blocks a callback: a message's arrival (`add`) and a frame's (`wait_for`) only note
  them. Only a reader of the outcome (`Wait.result()`) waits, and at most until the deadline plus
  the grace; and, whatever its clock says, never more than `tolerance_s + grace_s` of
  time.monotonic() from its first read.
- Deadlines are on the monotonic clock: the system clock steps (NTP, chrony makestep, GPS time),
  and a deadline on it would hold a frame, and the worker reading it, until the clock caught up.
- Bounded: the last `keep` messages are kept, and at most `max_waiting` frames wait at once (by
  default enough for MAX_RATE_HZ over the tolerance and grace). A frame arriving past that is
  decided at once with what it has (counted in `given_up`), never with a neighbour's depth: the
  frames already waiting, one of them the frame being processed, keep their wait.
- A stream's stamps rise. A message stamped more than the tolerance before the newest kept one
  means they started over (a bag looped, a simulation reset, a driver restarted): what is kept is
  forgotten (counted in `restarts`, and `add` returns why). For the same reason a kept message
  stamped more than the tolerance after a frame does not end its wait: it is from before the
  frame's stamps went back, not the one after it; and a frame stamped more than the tolerance
  before the newest kept message (its stamps went back first) has its wait ended by what was kept
  before it arrived only with its own stamp (the previous run's depth lies stamped near its own).

camera_info (`fallback_newest=True`): a driver that publishes it with every frame is paired as
depth is; when none within the tolerance comes, the newest one received is used (a camera's model
does not change from one frame to the next). A latched camera_info (published once: no new one for
`STREAM_GAP_S`) is used at once, whatever its stamp.

Stamps are integer nanoseconds (`stamp_ns(header.stamp)`), so equal stamps compare equal.
"""
from __future__ import annotations

import math
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Generic, TypeVar

T = TypeVar("T")
NS = 1_000_000_000
JUMP_BACK_NS = NS          # stamps going back this far: the stream started over (a bag played again)
MAX_RATE_HZ = 120          # the fastest stream max_waiting is sized for by default
WAITING_MARGIN = 8         # ... plus frames whose callbacks ran late, and requests with their own image
STREAM_GAP_S = 0.5         # camera_info with no new stamp for this long is latched (published once)
CALLBACK_GRACE_S = 0.1     # past its deadline, a frame waits this long at most for the callbacks of
                           # messages that reached the process by then (a busy executor runs them late)


def stamp_ns(stamp: Any) -> int:
    """A builtin_interfaces/Time (anything with sec and nanosec) as integer nanoseconds."""
    return int(stamp.sec) * NS + int(stamp.nanosec)


@dataclass(frozen=True)
class Match(Generic[T]):
    """The message a frame paired with."""
    msg: T
    stamp_ns: int
    offset_s: float      # the message's stamp - the frame's
    waited_s: float      # from the frame's arrival to the decision (0: it was there)
    rule: str            # "exact", "nearest" (within the tolerance) or "newest" (camera_info fallback)


@dataclass(frozen=True)
class NoMatch:
    """No message for this frame, and why."""
    reason: str
    waited_s: float = 0.0


def _seconds(ns: int) -> float:
    return ns / NS


# Stamps a spacing is read from at the least: from two, one lost message between made the spacing
# read twice (or three times) what it is, and a frame took an older depth image as "nothing nearer
# can come" while a nearer one was on its way (depth at 30 Hz free-running beside colour at 15,
# just after start-up).
SPACING_STAMPS = 4


def _spacing(stamps: list[int]) -> int | None:
    """The smallest positive gap between consecutive stamps (None with fewer than SPACING_STAMPS)."""
    if len(stamps) < SPACING_STAMPS:
        return None
    gaps = [b - a for a, b in zip(stamps, stamps[1:]) if b > a]
    return min(gaps) if gaps else None


class Wait(Generic[T]):
    """One frame's pairing in one stream: pending until decided, then fixed."""

    def __init__(self, pairing: "StampPairing[T]", stamp: int, arrived_at: float, now: float) -> None:
        self.stamp, self.arrived_at = stamp, arrived_at
        self.deadline = arrived_at + pairing.tolerance_s
        # Waiting ends then at the latest: the grace past the deadline, or past this frame's own
        # callback when that ran later still (the callbacks behind it have not run either).
        self.last_call = max(self.deadline, now) + pairing.grace_s
        self._pairing = pairing
        self._best: tuple[int, int, Any] | None = None       # (|offset|, stamp, msg) within tolerance
        self._outside: int | None = None                     # nearest offset outside it (for the reason)
        self._newest: tuple[int, Any] | None = None          # the last one offered: camera_info's fallback
        self._outcome: Match[T] | NoMatch | None = None
        self._backstop: float | None = None   # time.monotonic() past which result() waits no more

    @property
    def unstamped(self) -> bool:
        """A frame stamped 0 (a driver that stamps nothing, sim time before /clock): every message
        stamped 0 would be its "exact" pair, whenever it was taken. Only a stream whose newest message
        stands for all (camera_info's fallback) pairs with it."""
        return self.stamp == 0 and not self._pairing.fallback_newest

    def clock(self) -> float:
        """Now, on the pairing's clock (for `result(read_from=...)`)."""
        return self._pairing.clock()

    @property
    def done(self) -> bool:
        return self._outcome is not None

    def result(self, timeout: float | None = None, read_from: float | None = None) -> Match[T] | NoMatch:
        """The outcome, waiting for it: until the deadline, and past it for the callbacks of what
        arrived by then (grace_s at most, from this first read when it came later; less when a message
        received later shows they have run).
        `timeout`, when given, bounds the wait too: then an undecided wait is decided with what it has.
        `read_from`: when the reader began reading (this pairing's clock; now if None), so that a
        frame's reads one after another (depth, then camera_info) share one grace.
        Whatever the pairing's clock does (an injected one that steps back), it never waits more
        than tolerance_s + grace_s of time.monotonic() from its first read."""
        pairing = self._pairing
        with pairing._cond:
            first_read = pairing.clock() if read_from is None else read_from
            give_up_at = None if timeout is None else first_read + timeout
            if self._backstop is None:
                self._backstop = time.monotonic() + pairing.tolerance_s + pairing.grace_s
            if self._outcome is None and first_read > self.last_call:
                # callbacks the busy reader held up get the grace from now (ended early, as ever, by
                # a message received after the deadline)
                self.last_call = first_read + pairing.grace_s
            while self._outcome is None:
                now = pairing.clock()
                end = self.last_call
                if give_up_at is not None:
                    end = min(end, give_up_at)
                # The only inference worker reads this: a clock that never reaches `end` must not
                # stop it for good.
                backstop_in = self._backstop - time.monotonic()
                if now >= end or backstop_in <= 0:
                    pairing._decide(self, min(now, self.deadline))
                    break
                pairing._cond.wait(min(end - now, backstop_in))
            assert self._outcome is not None
            return self._outcome

    def poll(self) -> Match[T] | NoMatch | None:
        """The outcome if decided (past the deadline and its grace it is, now), else None; never waits."""
        with self._pairing._cond:
            if self._outcome is None and self._pairing.clock() >= self.last_call:
                self._pairing._decide(self, self.deadline)
            return self._outcome

    # called under the pairing's lock
    @property
    def _exact(self) -> bool:
        return self._best is not None and self._best[0] == 0

    def _forget(self) -> None:
        """The stream started over after this frame's stamp: what it was offered was the previous
        run's (its own, and its neighbours, come in the new one)."""
        self._best = self._outside = None

    def _offer(self, stamp: int, msg: Any, gap: int | None) -> bool:
        """Note one message, received by the deadline; True when nothing nearer can come."""
        tolerance = self._pairing.tolerance_ns
        offset = stamp - self.stamp
        self._newest = (stamp, msg)          # offered in the order they arrived
        if abs(offset) <= tolerance:
            if self._best is None or abs(offset) < self._best[0]:
                self._best = (abs(offset), stamp, msg)
        elif self._outside is None or abs(offset) < abs(self._outside):
            self._outside = offset           # not a pair, but the reason says how far it was
        if self._best is not None and self._best[0] == 0:
            return True                      # its own stamp
        if 0 < offset <= tolerance:
            # stamped after the frame: none nearer follows. Farther after it, it may be from before
            # the frames' stamps went back (a bag looped: the stream starts over when its own do),
            # or a clock ahead of the camera's: its own may still come.
            return True
        return self._best is not None and gap is not None and 2 * self._best[0] <= gap

    def _outcome_now(self, decided_at: float, given_up: bool) -> Match[T] | NoMatch:
        pairing = self._pairing
        waited = max(decided_at - self.arrived_at, 0.0)
        if self.unstamped:
            return NoMatch(f"the frame has no stamp (0): no {pairing.what} can be paired with it by time "
                           "(stamp the camera's frames)", waited)
        # Cut short, a frame might still have had its own: a neighbour's depth would pass for it.
        if self._best is not None and (self._best[0] == 0 or not given_up or pairing.fallback_newest):
            distance, stamp, msg = self._best
            return Match(msg, stamp, _seconds(stamp - self.stamp), waited, "exact" if distance == 0 else "nearest")
        if pairing.fallback_newest and self._newest is not None:
            stamp, msg = self._newest
            return Match(msg, stamp, _seconds(stamp - self.stamp), waited, "newest")
        if given_up:
            return NoMatch(f"gave up waiting for a {pairing.what}: more than {pairing.max_waiting} frames were "
                           "waiting at once", waited)
        if pairing.received == 0:
            return NoMatch(f"no {pairing.what} received yet", waited)
        nearest = ""
        if self._outside is not None:
            side = "after" if self._outside > 0 else "before"
            nearest = f"; the nearest was stamped {abs(_seconds(self._outside)):.3f} s {side} it"
        return NoMatch(f"no {pairing.what} stamped within {pairing.tolerance_s:g} s of this frame arrived within "
                       f"{pairing.tolerance_s:g} s of it (depth_tolerance_s){nearest}", waited)


class StampPairing(Generic[T]):
    """One stream (depth images, or camera_info): its last messages by stamp, and the frames
    waiting for theirs. Thread-safe: subscriptions add while the worker and requests read."""

    def __init__(self, what: str, tolerance_s: float, *, keep: int = 10, max_waiting: int | None = None,
                 fallback_newest: bool = False, clock: Callable[[], float] | None = None,
                 wall_clock: Callable[[], float] | None = None, grace_s: float = CALLBACK_GRACE_S) -> None:
        """`clock`: what deadlines are on (time.monotonic by default). `wall_clock`: the clock of
        the `received_at`/`arrived_at` given (the middleware's reception times: time.time by
        default; the same as `clock` when only `clock` is given). `max_waiting`: None sizes it
        from the tolerance (MAX_RATE_HZ frames over tolerance_s + grace_s)."""
        if not (tolerance_s >= 0 and tolerance_s < float("inf")):
            raise ValueError(f"pairing tolerance {tolerance_s} s must be finite and >= 0")
        if max_waiting is None:
            # A fixed bound gave up the frames still in their wait once the tolerance was raised
            # past what it covers (0.53 s at 30 Hz).
            max_waiting = max(16, math.ceil((tolerance_s + grace_s) * MAX_RATE_HZ) + WAITING_MARGIN)
        if keep < 1 or max_waiting < 1:
            raise ValueError(f"keep ({keep}) and max_waiting ({max_waiting}) must be at least 1")
        self.what, self.tolerance_s = what, float(tolerance_s)
        self.tolerance_ns = round(self.tolerance_s * NS)
        self.keep, self.max_waiting, self.fallback_newest = keep, max_waiting, fallback_newest
        self.clock: Callable[[], float] = time.monotonic if clock is None else clock
        self.wall_clock: Callable[[], float] = (time.time if clock is None else clock) if wall_clock is None \
            else wall_clock
        self.grace_s = grace_s
        self._cond = threading.Condition()
        self._kept: deque[tuple[int, float, Any]] = deque(maxlen=keep)   # (stamp, arrived, msg), in arrival order
        self._frames: deque[int] = deque(maxlen=keep)                    # the last frames' stamps
        self._waiting: list[Wait[T]] = []
        self._last_new: float | None = None                              # when the last new stamp arrived
        self.received = 0
        self.given_up = 0
        self.restarts = 0       # the stream's stamps went back: what was kept was forgotten
        self.outcomes = {"exact": 0, "nearest": 0, "newest": 0, "none": 0}
        self.late = 0           # frames' own messages that reached the process after their deadline
        self.seen_late = 0      # ... in time, but whose callback ran after the frame was decided
        # (stamp, deadline) of frames decided without their own message: only what counts a late
        # one (holding the Waits held their depth images, up to 64 of them, past `keep`)
        self._without_own: deque[tuple[int, float]] = deque(maxlen=4 * max_waiting)
        self.waited_s: deque[float] = deque(maxlen=200)                  # per decided frame

    # --- arrivals ---------------------------------------------------------------------------
    def add(self, stamp: int, msg: T, received_at: float | None = None) -> str:
        """A message arrived (`received_at`: when it reached this process, on `wall_clock`; now
        if None). Returns a warning for the log ("" normally)."""
        stamp, note = int(stamp), ""
        with self._cond:
            now = self.clock()
            received = self._local(received_at, now)
            self._expire(now)
            self.received += 1
            kept = [s for s, _, _ in self._kept]
            newest = max(kept, default=stamp)
            # Within the tolerance a step back only offers a neighbour it would offer anyway; past
            # it, a frame of the new run would take the old run's depth. The same message again
            # (a latched one through a second subscription) is no step back.
            if stamp < newest - self.tolerance_ns and stamp not in kept:
                self.restarts += 1
                note = (f"{self.what} stamps went back {_seconds(newest - stamp):.3f} s (a bag "
                        "played again, a simulation reset, a driver restarted?): the earlier ones are forgotten")
                for wait in self._waiting:
                    if wait.stamp < newest - self.tolerance_ns:
                        wait._forget()
                self._kept.clear()
                self._without_own.clear()
            if self._kept and self._kept[-1][0] == stamp:
                self._kept.pop()     # the same message again (a latched one through two subscriptions)
            else:
                self._last_new = received
            self._kept.append((stamp, received, msg))
            gap = self._gap()
            for wait in list(self._waiting):
                if received > wait.deadline:
                    self._decide(wait, wait.deadline)     # what came by its deadline has all been seen
                elif wait._offer(stamp, msg, gap):
                    self._decide(wait, max(received, wait.arrived_at))
            self._count_late(stamp, received)             # after: its own frame may just have been decided
            self._cond.notify_all()
        return note

    def wait_for(self, stamp: int, arrived_at: float | None = None, stream: bool = True) -> Wait[T]:
        """A frame stamped `stamp` arrived (`arrived_at`: when it reached this process, on
        `wall_clock`; now if None): its pairing, decided now if it can be. `stream`: the frame is
        one of the camera's (its stamp counts in the frames' spacing); False for an image that
        came on its own (a request's), stamped anywhere between the camera's frames."""
        with self._cond:
            now = self.clock()
            arrived = self._local(arrived_at, now)
            self._expire(now)
            wait: Wait[T] = Wait(self, int(stamp), arrived, now)
            if wait.unstamped:   # nothing to pair by: decided at once (_outcome_now says why)
                self._decide(wait, arrived)
                return wait
            if stream:
                self._frames.append(wait.stamp)
            gap, end_at, seen_all = self._gap(), None, False
            # A frame stamped well before the newest kept message: the frames' stamps went back
            # (a bag looped) before this stream's did. What is kept is the previous run's, stamped
            # near the frame by chance; its own (the one that starts the stream over) is yet to
            # come, so what was there before it ends its wait with its own stamp only. Otherwise (a
            # driver whose depth comes first, stamped a few ms off the colour) it ends it at once.
            went_back = bool(self._kept) and stamp < max(s for s, _, _ in self._kept) - self.tolerance_ns
            for kept_stamp, kept_at, msg in self._kept:
                if kept_at > wait.deadline:
                    seen_all = True
                elif (wait._offer(kept_stamp, msg, gap) and end_at is None
                      and (kept_at > arrived or wait._exact or not went_back)):
                    end_at = max(kept_at, arrived)
            if end_at is not None:
                self._decide(wait, end_at)
            elif self.fallback_newest and wait._newest is not None and self._latched(arrived):
                self._decide(wait, arrived)
            elif seen_all:
                self._decide(wait, wait.deadline)
            elif len(self._waiting) >= self.max_waiting:
                # The newcomer, not the oldest: the oldest is the frame most likely being read
                # now, and cutting it short would hand it whatever neighbour is kept.
                self.given_up += 1
                self._decide(wait, arrived, given_up=True)
            else:
                self._waiting.append(wait)
            return wait

    # --- state, under the lock --------------------------------------------------------------
    def _local(self, at: float | None, now: float) -> float:
        """A time on the wall clock (a reception time) on `clock`, measured back from now: a step
        of the wall clock between then and now moves it, never a deadline. Never after now."""
        if at is None:
            return now
        if self.wall_clock is not self.clock:
            at = at - self.wall_clock() + now
        return min(at, now)

    def _gap(self) -> int | None:
        """The smaller of the stream's spacing and the frames' (None until both are known): the
        nearest message ends a frame's wait when within half of it."""
        gaps = [_spacing([s for s, _, _ in self._kept]), _spacing(list(self._frames))]
        return None if None in gaps else min(gaps)

    def _latched(self, now: float) -> bool:
        """No message with a new stamp for STREAM_GAP_S: a latched camera_info, published once
        (one published with every frame would have come meanwhile)."""
        return self._last_new is not None and now - self._last_new > STREAM_GAP_S

    def _expire(self, now: float) -> None:
        for wait in [w for w in self._waiting if w.last_call <= now]:
            self._decide(wait, wait.deadline)

    def _count_late(self, stamp: int, received: float) -> None:
        for entry in self._without_own:
            if entry[0] == stamp:
                self._without_own.remove(entry)
                if received > entry[1]:
                    self.late += 1
                else:
                    self.seen_late += 1
                return

    def _decide(self, wait: Wait[T], at: float, given_up: bool = False) -> None:
        if wait._outcome is not None:
            return
        wait._outcome = wait._outcome_now(at, given_up)
        if not (isinstance(wait._outcome, Match) and wait._outcome.rule == "exact"):
            self._without_own.append((wait.stamp, wait.deadline))
            own = next(((s, at) for s, at, _ in self._kept if s == wait.stamp), None)
            if own is not None:      # already here, received after the deadline (or not seen by then)
                self._count_late(*own)
        if wait in self._waiting:
            self._waiting.remove(wait)
        self.outcomes[wait._outcome.rule if isinstance(wait._outcome, Match) else "none"] += 1
        self.waited_s.append(wait._outcome.waited_s)
        self._cond.notify_all()

    def waiting(self) -> int:
        with self._cond:
            return len(self._waiting)
