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


def presses(watch: StreamWatch, starts: list[float], chunks: int, chunk_s: float, end: float) -> list[float]:
    """Each press sends `chunks` chunks of chunk_s back to back; the node's 10 Hz ticks until `end`.
    How long after each press's last chunk its stop was found."""
    arrivals = sorted(p + chunk_s * i for p in starts for i in range(chunks))
    found, last, t = [], None, 0.0
    while t < end:
        while arrivals and arrivals[0] <= t + 1e-9:
            last = arrivals.pop(0)
            watch.chunk(last, duration_s=chunk_s)
        if watch.stopped(t):
            found.append(round(t - last, 1))
        t = round(t + 0.1, 1)
    return found


def test_push_to_talk_presses_each_end_after_idle_s():
    """Gaps that are no steady pace (short within a press, long between presses) do not stretch
    the limit: every press's utterance ends idle_s (and a tick) after its audio, as before."""
    starts = [8.0 * i for i in range(1, 12)]
    assert presses(StreamWatch(idle_s=0.8), starts, 2, 0.5, 100.0) == [1.2] * 11    # two chunks' time
    found = presses(StreamWatch(idle_s=0.8), starts, 10, 0.1, 100.0)
    assert len(found) == 11 and all(0.8 < f <= 1.0 for f in found), found


def test_a_steady_pace_stretches_idle_s_a_bounded_number_of_times():
    """One message per utterance at regular times is a steady pace too: the stop it finds comes
    at most PACE_MAX_FACTOR x idle_s after the audio, never a whole gap later."""
    from photon_ros.stream_watch import PACE_MAX_FACTOR
    found = presses(StreamWatch(idle_s=0.8), [8.0 * i for i in range(1, 12)], 1, 1.0, 100.0)
    # the first three by two chunks' time (the pace not known yet), then by the capped pace
    assert len(found) == 11 and all(2.0 < f <= PACE_MAX_FACTOR * 0.8 + 0.2 for f in found), found


def test_a_stall_does_not_stretch_the_usual_gap():
    watch = StreamWatch(idle_s=0.8)
    for t in [10.0 + 0.1 * i for i in range(10)] + [12.5] + [12.6 + 0.1 * i for i in range(5)]:
        watch.chunk(t, duration_s=0.1)   # 0.1 s chunks every 0.1 s, one 1.6 s stall among them
    assert watch.limit_s == 0.8


def test_the_flush_note_names_the_limit_the_watch_used(monkeypatch):
    """The incomplete utterance's note says how long the stream was without audio by the limit
    that found it stopped (two of a slow stream's gaps), not idle_flush_s alone."""
    import threading
    import types

    import photon_ros.speech_node as speech_node

    watch = StreamWatch(idle_s=0.8)
    for t in (10.0, 11.0, 12.0, 13.0):   # 0.1 s of audio a second: idle after 2 s
        watch.chunk(t, duration_s=0.1)
    notes = []
    node = types.SimpleNamespace(lock=threading.Lock(), watch=watch, stream_ended=notes.append)
    for now in (14.9, 15.1, 15.2):
        monkeypatch.setattr(speech_node, "time", types.SimpleNamespace(monotonic=lambda: now))
        speech_node.SpeechNode.flush_if_idle(node)
    assert notes == ["the audio stream stopped mid-utterance (no audio for 2 s)"]
