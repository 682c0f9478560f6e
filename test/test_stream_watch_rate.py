"""Array audio's rate, which only a parameter states, checked against how fast samples arrive."""
from photon_ros.stream_watch import ArrivalRate


def feed(check: ArrivalRate, rate_stated: int, rate_real: int, seconds: float, chunk_s: float = 0.1,
         start: float = 100.0) -> float:
    now = start
    for _ in range(int(seconds / chunk_s)):
        now += chunk_s
        check.chunk(now, int(rate_real * chunk_s), rate_stated)
    return now


def test_48_khz_audio_stated_as_16_khz_is_found_after_five_seconds():
    check = ArrivalRate()
    feed(check, 16000, 48000, 4.0)
    assert check.mismatch() == ""                        # too little known yet
    feed(check, 16000, 48000, 2.0, start=104.0)
    assert "about 48000 samples/s but sample_rate says 16000 Hz" in check.mismatch()


def test_the_right_rate_with_jitter_and_a_stop_is_not_a_mismatch():
    check = ArrivalRate()
    now = feed(check, 16000, 16000, 6.0)
    assert check.mismatch() == ""
    check.restart()                                       # the stream stopped (StreamWatch), then resumed
    feed(check, 16000, 16000, 6.0, chunk_s=0.02, start=now + 30.0)
    assert check.mismatch() == ""
    feed(check, 8000, 16000, 6.0, start=now + 60.0)       # a new stated rate starts a new stretch
    assert "sample_rate says 8000 Hz" in check.mismatch()
