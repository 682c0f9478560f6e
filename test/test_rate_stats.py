"""Diagnostics' rates: events per second over the window, or over the time since the start."""
import time

import pytest

from photon_ros.rate_stats import RateStats


def test_a_rate_in_the_first_window_is_over_the_time_since_the_start(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    stats = RateStats(window_s=10.0)
    for _ in range(20):            # 10 Hz for 2 s
        now[0] += 0.1
        stats.tick("received")
    assert stats.rate("received") == pytest.approx(10.0)
    for _ in range(200):           # then 10 Hz for 20 s: the window's
        now[0] += 0.1
        stats.tick("received")
    assert stats.rate("received") == pytest.approx(10.0, rel=0.02)
    assert stats.rate("never") == 0.0
