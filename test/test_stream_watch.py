"""The speech node's stop detector: a stalled executor (the tick runs first, the queued chunks
after it) never looks like a stopped stream; a stream that really stops is found."""
from photon_ros.stream_watch import StreamWatch


def test_a_late_tick_before_queued_chunks_is_not_a_stop():
    watch = StreamWatch(idle_s=0.8)
    watch.chunk(10.0)
    assert not watch.stopped(10.5)
    # The executor stalls 1.5 s; its first tick afterwards runs before the chunks that waited.
    assert not watch.stopped(11.5)
    watch.chunk(11.51)                   # the queued chunks arrive
    assert not watch.stopped(11.6)
    assert not watch.stopped(11.7)


def test_a_stream_that_stops_is_reported_once():
    watch = StreamWatch(idle_s=0.8)
    assert not watch.stopped(1.0)        # nothing received yet: nothing to stop
    watch.chunk(10.0)
    assert not watch.stopped(10.9)       # idle: armed
    assert watch.stopped(11.0)           # still idle one tick later: stopped
    assert not watch.stopped(11.1) and not watch.stopped(11.2)
    watch.chunk(20.0)
    assert not watch.stopped(20.9) and watch.stopped(21.0)


def test_a_stream_of_long_chunks_is_not_stopped_between_them():
    watch = StreamWatch(idle_s=0.8)
    for t in (10.0, 11.0, 12.02, 12.95):   # a second of audio a message, with jitter
        watch.chunk(t, duration_s=1.0)
        assert not any(watch.stopped(t + dt) for dt in (0.3, 0.6, 0.9, 1.0))
    # two chunks' time with none (past 14.95), for two ticks in a row: stopped
    assert not watch.stopped(14.9) and not watch.stopped(15.0) and watch.stopped(15.1)
