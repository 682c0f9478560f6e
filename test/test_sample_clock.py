"""The microphone's capture stamps: blocks join exactly on the sample clock, the sound card's
drift never builds up, and audio lost in the driver shows as a jump the speech node can see."""
import numpy as np

from photon_ros.microphone_node import SampleClock


def test_blocks_join_exactly_despite_callback_jitter():
    clock, rate, frames = SampleClock(16000), 16000, 1600
    rng = np.random.default_rng()
    now, stamps = 1000.0, []
    for _ in range(50):
        now += frames / rate
        stamps.append(clock.stamp(frames, now + rng.uniform(0, 0.02)))   # callbacks run late, unevenly
    steps = np.diff(stamps)
    assert np.all(np.abs(steps - 0.1) <= 0.001 + 1e-9)                # joined within the 1% slew


def test_drift_of_the_sound_card_does_not_build_up():
    clock, rate, frames = SampleClock(16000), 16000, 1600
    now = 1000.0
    for _ in range(36000):                        # an hour of a card running 0.05% fast
        now += frames / rate * (1 - 0.0005)
        start = clock.stamp(frames, now)
    assert abs(start - (now - 0.1)) < 0.01


def test_an_overflow_reanchors_so_the_loss_is_visible():
    clock = SampleClock(16000)
    first = clock.stamp(1600, 1000.1)
    second = clock.stamp(1600, 1000.7, overflow=True)   # 0.5 s lost inside the driver
    assert abs(second - first - 0.6) < 1e-9


def test_a_loss_the_driver_does_not_flag_reanchors_once_it_lasts():
    """A sound server's overrun loses audio without PortAudio's overflow flag: the wall clock stays
    ahead of the sample count, and once that lasts the count re-anchors, so the loss is a jump."""
    clock, frames = SampleClock(16000), 1600
    now = 1000.0
    stamps = []
    for k in range(10):
        now += 0.1 + (0.5 if k == 5 else 0.0)    # 0.5 s lost before block 5, no flag
        stamps.append(clock.stamp(frames, now))
    steps = np.diff(stamps)
    assert steps.max() > 0.4                     # the loss shows as a jump
    assert abs(stamps[-1] - (now - 0.1)) < 0.02  # and the stamps are back on the wall clock


def test_late_callbacks_that_catch_up_in_a_burst_are_not_a_loss():
    clock, frames = SampleClock(16000), 1600
    now, stamps = 1000.0, []
    for k in range(12):
        now += 0.1
        late = 0.3 if k in (4, 5, 6) else 0.0   # a 0.3 s stall; the three blocks then come at once
        at = max(now + late, 1000.0 + 0.1 * 7 + 0.3) if k in (4, 5, 6) else now
        stamps.append(clock.stamp(frames, at))
    assert np.all(np.abs(np.diff(stamps) - 0.1) <= 0.0011)   # joined: nothing was lost
