"""Capture stamps counted in samples (SampleClock), for the two places that make them from a clock
reading: the microphone node (PortAudio's callback time) and the speech node, for drivers that
stamp each chunk with the time it was read (mgonzs13's audio_capturer_node), whose stamps jitter
with the driver's scheduling while its samples do not.
"""
from __future__ import annotations


class SampleClock:
    """Capture stamps counted in samples, so consecutive blocks join exactly (the speech node reads
    a jump as lost audio), slewed toward the wall clock by at most `slew` of each block so the
    sound card's drift never builds up. Audio lost in the driver re-anchors the count on the wall
    clock, so the loss shows as a jump: at once where the driver says so (an overflow), and where it
    does not (a sound server's overrun), once the wall clock has stayed more than `jump_s` off the
    count for `persist_s` (late callbacks that catch up in a burst come back within that time), or
    for `persist_audio_s` of audio counted ahead of it: a clock that stands still (a simulator
    paused, or its /clock gone) never passes persist_s, and real-time audio ran the stamps ahead of it without limit
    (18 s paused: 10 s ahead, every command refused as stamped in the future, then one jump back)."""

    def __init__(self, rate: int, slew: float = 0.01, jump_s: float = 0.2, persist_s: float = 0.15,
                 max_slew_s: float = float("inf"), persist_audio_s: float = 1.0) -> None:
        self.rate = rate
        self.slew = slew
        self.max_slew_s = max_slew_s   # and at most this much of any block
        self.jump_s, self.persist_s, self.persist_audio_s = jump_s, persist_s, persist_audio_s
        self.next: float | None = None   # stamp of the next block's first sample
        self.off_since: float | None = None   # when the wall clock left the count by > jump_s
        self.off_audio = 0.0                  # seconds of audio counted since then

    def reanchor(self) -> None:
        """The next block starts the count afresh on the clock (a new stream, a clock that has no
        time yet)."""
        self.next = self.off_since = None

    def stamp(self, frames: int, now: float, overflow: bool = False) -> float:
        """Stamp of a block of `frames` samples whose last sample was captured about `now`."""
        duration = frames / self.rate
        wall = now - duration
        if self.next is None or overflow or self._lost(wall, now, duration):
            start = wall
            self.off_since = None
        else:
            limit = min(self.slew * duration, self.max_slew_s)
            start = self.next + min(max(wall - self.next, -limit), limit)
        self.next = start + duration
        return start

    def _lost(self, wall: float, now: float, duration: float) -> bool:
        assert self.next is not None
        if abs(wall - self.next) <= self.jump_s:
            self.off_since = None
            return False
        if self.off_since is None:
            self.off_since, self.off_audio = now, 0.0
        if wall < self.next:   # ahead of the clock (it stands still); behind it, a burst catching up
            self.off_audio += duration
        return now - self.off_since >= self.persist_s or self.off_audio >= self.persist_audio_s


class ReadStamps:
    """First-sample times of a driver that stamps each chunk with its clock when it starts the read
    that returns it (mgonzs13's audio_capturer_node: `now()`, then a blocking Pa_ReadStream): about
    the chunk's first sample, but late by however long the driver's loop was held up (tens of ms on
    a busy robot), while PortAudio keeps the samples. Counted in samples, so a late read is not
    taken for lost audio, and an offset that lasts (audio the driver lost) still becomes a jump
    larger than `tolerance(chunk_s)`, what the reader of the stamps allows between chunks."""

    def __init__(self, tolerance) -> None:
        self.tolerance = tolerance
        self.clock: SampleClock | None = None

    def reanchor(self) -> None:
        """Chunks were lost or refused since the last one: the count would go on without their
        samples and stamp the next chunks early by their time until it re-anchored, a second jump
        after the real one. The next chunk's own stamp starts the count afresh."""
        if self.clock is not None:
            self.clock.reanchor()

    def stamp(self, stamp: float, frames: int, rate: int) -> float:
        chunk_s = frames / rate
        if self.clock is None or self.clock.rate != rate:
            self.clock = SampleClock(rate, jump_s=self.tolerance(chunk_s))
        return self.clock.stamp(frames, stamp + chunk_s)
