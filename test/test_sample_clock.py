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
