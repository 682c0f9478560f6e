"""The microphone's capture stamps: blocks join exactly on the sample clock, the sound card's
drift never builds up, and audio lost in the driver shows as a jump the speech node can see."""
import numpy as np

from photon_ros.sample_clock import SampleClock


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


def test_a_simulators_clock_is_followed_without_jumps():
    """Under use_sim_time the microphone counts real samples against a simulator's clock, which runs
    at its real-time factor (a busy world at 0.8, a light one faster than real time) in steps
    (gazebo_ros publishes /clock at 10 Hz). At the wall clock's 1% slew the count fell 0.2 s behind
    or ahead within seconds and re-anchored: a jump every few seconds, each one an incomplete
    command. At SIM_SLEW the stamps follow the clock and join within half a block (the speech
    node's jitter allowance), for a world at 0.6 real time too (at 0.25 its count re-anchored with
    a jump every few seconds)."""
    from photon_ros.microphone_node import SIM_MAX_SLEW_S, SIM_SLEW
    rng = np.random.default_rng(0)
    for factor in (0.6, 0.8, 1.0, 1.2, 1.4):
        clock, real, stamps = SampleClock(16000, slew=SIM_SLEW, max_slew_s=SIM_MAX_SLEW_S), 0.0, []
        for _ in range(600):                       # a minute of 100 ms blocks
            real += 0.1
            at = real + rng.uniform(0, 0.02)       # the callback, a little late
            sim = 1000.0 + factor * np.floor(at * 10) / 10
            stamps.append(clock.stamp(1600, sim))
        assert np.all(np.abs(np.diff(stamps) - 0.1) <= 0.05), factor
        assert abs(stamps[-1] + 0.1 - sim) < 0.2, factor


def test_a_paused_simulators_clock_does_not_leave_the_stamps_ever_further_ahead():
    """A simulator paused (its /clock standing still, or gone) while the microphone delivers in real
    time: the count was off the clock for no clock time at all, never re-anchored, and ran 0.055 s
    ahead a block: 18 s paused, 10 s ahead (every command refused as stamped in the future), then
    one jump back of the whole drift. Now it re-anchors within a second of audio."""
    from photon_ros.microphone_node import SIM_MAX_SLEW_S, SIM_SLEW
    clock, stamps = SampleClock(16000, slew=SIM_SLEW, max_slew_s=SIM_MAX_SLEW_S), []
    for k in range(300):                            # 30 s of 100 ms blocks, the world paused at 1001 s
        sim = 1000.0 + min(k + 1, 10) * 0.1
        stamps.append(clock.stamp(1600, sim))
    ahead = np.array(stamps) + 0.1 - 1001.0
    assert ahead.max() < 1.5, ahead.max()


def mgonzs13_reads(audio: np.ndarray, rate: int, chunk: int, late: dict[int, float], lost: set[int] = frozenset()):
    """(stamp, samples) of mgonzs13's capturer: `now()` then a blocking read of `chunk` samples; the
    loop held up `late[k]` s before read k (PortAudio keeps the samples meanwhile); chunks in `lost`
    overrun the driver's buffer (their samples never come, the clock goes on)."""
    t_end, out, t0 = 1000.0, [], 1000.0
    for k in range(len(audio) // chunk):
        stamp = t_end + late.get(k, 0.0)
        t_end = max(stamp, t0 + (k + 1) * chunk / rate)   # the read returns once its chunk is captured
        if k not in lost:
            out.append((stamp, audio[k * chunk:(k + 1) * chunk]))
    return out


def segment(reads, rate: int):
    from photon_ros.speech_segmenter import SegmenterConfig, SpeechSegmenter
    from photon_ros.sample_clock import ReadStamps
    seg, stamps = SpeechSegmenter(rate), ReadStamps(SegmenterConfig().jump_tolerance)
    out = []
    for stamp, samples in reads:
        out += seg.push(samples, stamps.stamp(stamp, samples.size, rate))
    return out + [u for u in [seg.flush()] if u], seg


def test_a_driver_that_stamps_its_reads_late_does_not_cut_the_command():
    """mgonzs13's 512-sample chunks (32 ms) read 25-40 ms late once, with no sample lost: one
    complete utterance, where the raw stamps read as audio lost and then out of order, and the
    command was refused in two halves. Audio the driver really lost still shows."""
    from speech_audio import espeak_pcm
    from scipy.signal import resample_poly
    pcm, sr = espeak_pcm("robot, go to the kitchen and bring me the red cup")
    rate = 16000
    speech = resample_poly(pcm, rate, sr).astype(np.float32)
    audio = np.concatenate([np.zeros(rate // 2, np.float32), speech, np.zeros(rate, np.float32)])
    middle = len(audio) // 512 // 2
    for late in (0.025, 0.040):
        utterances, seg = segment(mgonzs13_reads(audio, rate, 512, {middle: late}), rate)
        assert seg.discontinuities == 0
        assert len(utterances) == 1 and utterances[0].complete, [(u.duration, u.note) for u in utterances]
    utterances, seg = segment(mgonzs13_reads(audio, rate, 512, {}, lost={middle, middle + 1}), rate)
    assert seg.discontinuities == 1 and 0.05 < seg.lost_s < 0.08
    assert not all(u.complete for u in utterances)


def test_a_long_held_up_reader_catching_up_is_not_a_loss():
    """Only audio counted ahead of the clock re-anchors after persist_audio_s: counted behind it too,
    a driver loop held up past a second (PortAudio keeping the samples) re-anchored in the middle of
    its catch-up burst, a false jump forward and back that cut the command; so did one 1000 ms
    microphone block 0.3 s late."""
    from speech_audio import espeak_pcm
    from scipy.signal import resample_poly
    pcm, sr = espeak_pcm("robot, go to the kitchen and bring me the red cup")
    rate = 16000
    speech = resample_poly(pcm, rate, sr).astype(np.float32)
    audio = np.concatenate([np.zeros(rate // 2, np.float32), speech, np.zeros(rate, np.float32)])
    for late in (1.1, 1.5):
        utterances, seg = segment(mgonzs13_reads(audio, rate, 512, {len(audio) // 512 // 2: late}), rate)
        assert seg.discontinuities == 0, late
    clock, stamps, now = SampleClock(16000), [], 1000.0
    for k in range(6):                                  # 1000 ms blocks, the third one's callback 0.3 s late
        now += 1.0
        stamps.append(clock.stamp(16000, now + (0.3 if k == 2 else 0.0)))
    assert np.all(np.abs(np.diff(stamps) - 1.0) <= 0.011), np.diff(stamps)


def test_read_stamps_reanchored_take_the_next_stamp_as_it_comes():
    """Chunks lost in transport or refused never reach the count: counted on across them, the next
    chunk was stamped early by their time (the speech node re-anchors at such a hole)."""
    from photon_ros.sample_clock import ReadStamps
    from photon_ros.speech_segmenter import SegmenterConfig
    stamps = ReadStamps(SegmenterConfig().jump_tolerance)
    stamps.reanchor()   # before any chunk: nothing to start afresh
    for k in range(10):
        stamps.stamp(1000.0 + k * 0.032 + 0.001 * (k % 2), 512, 16000)
    after_hole = 1000.0 + 13 * 0.032 + 0.001          # chunks 10-12 never came
    stamps.reanchor()
    assert stamps.stamp(after_hole, 512, 16000) == after_hole
    assert abs(stamps.stamp(after_hole + 0.033, 512, 16000) - (after_hole + 0.032)) < 1e-3   # counted again
