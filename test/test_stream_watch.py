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
