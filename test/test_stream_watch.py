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


def test_a_stream_of_short_chunks_sent_seldom_is_not_stopped_between_them():
    """0.1 s of audio a second (a WAV player at a tenth of real time, a slow simulator's
    microphone): idle is two of the stream's usual gaps, not idle_s, so its commands are not cut
    between every two chunks; when it stops, that is found."""
    watch = StreamWatch(idle_s=0.8)
    ticks = [round(10.0 + 0.1 * i, 1) for i in range(101)]   # the node's 10 Hz timer
    arrivals = [10.0 + 1.0 * i for i in range(8)]            # then no more
    stops = []
    for t in ticks:
        if arrivals and t >= arrivals[0]:
            watch.chunk(arrivals.pop(0), duration_s=0.1)
        if watch.stopped(t):
            stops.append(t)
    # until three gaps are seen the pace is unknown (one gap may be a stop and a restart): those
    # are judged by idle_s alone; from then on by the stream's pace, until it stops for good
    assert stops[:-1] == [10.9, 11.9, 12.9] and stops[-1] > 17.0 + 2.0, stops


def test_a_stall_does_not_stretch_the_usual_gap():
    watch = StreamWatch(idle_s=0.8)
    for t in [10.0 + 0.1 * i for i in range(10)] + [12.5] + [12.6 + 0.1 * i for i in range(5)]:
        watch.chunk(t, duration_s=0.1)   # 0.1 s chunks every 0.1 s, one 1.6 s stall among them
    assert watch.limit_s == 0.8
