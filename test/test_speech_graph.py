"""The speech graph over real DDS with real Whisper tiny.en weights: WAV publisher -> speech node
-> subscriber gets the spoken sentence; bad chunks are logged and skipped without losing speech;
partial transcripts arrive while a sentence is spoken and never contradict its final one."""
import time

import numpy as np
import pytest
from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus
from rclpy.parameter import Parameter
from rclpy.qos import QoSProfile, ReliabilityPolicy
from std_msgs.msg import Header, Int16MultiArray

from photon_ros.audio_conversions import pcm_to_audio_chunk, pcm_to_int16_array
from photon_ros.msg import AudioChunk, Transcript
from photon_ros.result_messages import seconds_to_time, time_to_seconds
from photon_ros.speech_node import SpeechNode
from photon_ros.wav_publisher import WavPublisher
from ros_harness import RosGraph, wait_for, wait_for_match
from speech_audio import espeak_pcm, espeak_wav, words

QOS = QoSProfile(depth=10, reliability=ReliabilityPolicy.RELIABLE)



@pytest.fixture
def graph():
    g = RosGraph()
    yield g
    g.close()


def listen(graph, partials=False):
    """Transcripts as they arrive: the final ones only, unless `partials`."""
    received = []

    def keep(msg):
        if partials or msg.is_final:
            received.append(msg)
    graph.node("listener").create_subscription(Transcript, "transcript", keep, QOS)
    return received


def speech_node(graph, **params):
    overrides = [Parameter(k, value=v) for k, v in params.items()]
    node = graph.add(SpeechNode(context=graph.context, parameter_overrides=overrides))
    assert wait_for(lambda: node.model is not None or node.model_error, timeout=60)
    assert node.model is not None, node.model_error
    return node


def test_wav_publisher_to_transcript(graph):
    sentence = "Go to the kitchen and bring me a glass of water."
    received = listen(graph)
    node = speech_node(graph, input_timeout_s=30.0)
    started = time.time()
    player = graph.add(WavPublisher(context=graph.context, parameter_overrides=[
        Parameter("file", value=str(espeak_wav(sentence))), Parameter("speed", value=2.0),
        Parameter("frame_id", value="kitchen_mic")]))
    assert wait_for(lambda: received, timeout=60), "no transcript arrived"
    msg = received[0]
    assert words(msg.text) == words(sentence)
    assert msg.is_final and msg.model_id == "whisper-tiny.en" and msg.language == "en"
    assert msg.audio_complete and msg.audio_note == ""
    assert msg.header.frame_id == "kitchen_mic"
    # Stamped at the utterance's first sample: after playback started, before it ended.
    assert started - 0.5 <= time_to_seconds(msg.header.stamp) <= time.time()
    duration = msg.audio_duration.sec + msg.audio_duration.nanosec * 1e-9
    assert 2.0 < duration < 6.0
    assert msg.segments and words(" ".join(s.text for s in msg.segments)) == words(sentence)
    assert msg.processing_time.sec + msg.processing_time.nanosec > 0
    assert player.done or wait_for(lambda: player.done, timeout=10)
    assert node.skipped_chunks == 0
    # /diagnostics says the same as the node's counters, at level OK.
    statuses = []
    graph.node("monitor").create_subscription(
        DiagnosticArray, "/diagnostics",
        lambda m: statuses.extend(s for s in m.status if s.name.endswith("/speech")), QOS)
    assert wait_for(lambda: any(dict((v.key, v.value) for v in s.values)["transcripts_final"] == "1"
                                for s in statuses), timeout=15), statuses[-1:] if statuses else "none"
    last = dict((v.key, v.value) for v in statuses[-1].values)
    assert statuses[-1].level == DiagnosticStatus.OK and last["model_loaded"] == "True"
    # (chunks published before DDS matched the player may be missed: at most every chunk arrives)
    assert last["lifecycle_state"] == "active" and 0 < int(last["chunks_received"]) <= len(player.chunks)
    assert last["transcripts_incomplete"] == "0" and last["audio_jumps"] == "0"
    # The player has finished: a source that stopped is a warning once input_timeout_s has passed.
    node.set_parameters([Parameter("input_timeout_s", value=1.0)])
    assert wait_for(lambda: statuses[-1].level == DiagnosticStatus.WARN, timeout=10), statuses[-1]
    assert "no audio for" in statuses[-1].message and "stopped" in statuses[-1].message


def test_one_wav_replayed_5_times_gives_the_same_utterance_every_time(graph):
    """A fresh player per replay (its own start, DDS match and sample clock), each started as the
    last one finishes, into one speech node with partials and speculation on: every replay gives
    one final, complete, with the same words, text and duration (cut by samples, never by the
    clock). Five replays, not twenty: each is one more draw of the same timings, and a cut that
    depends on them shows within five unless it is rare (a coin per cut: 15 in 16 runs)."""
    sentence = "Go to the kitchen and bring me a glass of water."
    replays = 5
    received = listen(graph)
    node = speech_node(graph)
    wav = str(espeak_wav(sentence))
    for k in range(replays):   # one player after another, as fast as they finish: transcripts queue up
        player = graph.add(WavPublisher(context=graph.context, parameter_overrides=[
            Parameter("file", value=wav), Parameter("speed", value=4.0)]))
        assert wait_for(lambda: player.done, timeout=30)
    assert wait_for(lambda: len(received) >= replays, timeout=120), [m.text for m in received]
    time.sleep(0.5)
    assert len(received) == replays
    assert all(words(m.text) == words(sentence) for m in received), [m.text for m in received]
    assert all(m.audio_complete for m in received)
    durations = {(m.audio_duration.sec, m.audio_duration.nanosec) for m in received}
    assert len(durations) == 1, durations
    texts = {m.text for m in received}
    assert len(texts) == 1, texts


def test_a_stalled_executor_does_not_cut_the_command(graph):
    """The speech node's callbacks stall for 1.5 s mid-sentence (as a busy machine can make them):
    the chunks queue up, and the utterance is still the whole sentence."""
    sentence = "Go to the kitchen and bring me a glass of water."
    received = listen(graph)
    node = speech_node(graph)
    stalled = []

    def stall_once():
        if not stalled:
            stalled.append(time.monotonic())
            time.sleep(1.5)   # in the node's own callback group: its audio and timers wait
    stall = node.create_timer(1.4, stall_once)
    graph.add(WavPublisher(context=graph.context, parameter_overrides=[
        Parameter("file", value=str(espeak_wav(sentence)))]))
    assert wait_for(lambda: received, timeout=60), "no transcript arrived"
    stall.cancel()
    assert stalled
    assert [words(m.text) for m in received] == [words(sentence)]
    assert received[0].audio_complete


def test_lost_audio_is_marked_on_the_transcript(graph):
    """Chunks that never arrive (a gap in the capture stamps) end the utterance as incomplete."""
    received = listen(graph)
    node = speech_node(graph)
    pub = graph.node("mic").create_publisher(AudioChunk, "audio", QOS)
    wait_for_match(pub)
    speech, rate = espeak_pcm("Go to the kitchen and bring me a glass of water.")
    audio = np.concatenate([np.zeros(rate // 2, np.float32), speech, np.zeros(rate, np.float32)])
    chunk, t0 = rate // 10, time.time()
    lost = range(audio.size // 2 // chunk, audio.size // 2 // chunk + 5)   # 0.5 s mid-sentence
    for k, i in enumerate(range(0, audio.size, chunk)):
        if k not in lost:
            header = Header(stamp=seconds_to_time(t0 + i / rate), frame_id="mic")
            pub.publish(pcm_to_audio_chunk(audio[i:i + chunk], rate, "S16LE", header=header))
    assert wait_for(lambda: len(received) >= 1, timeout=60)
    assert wait_for(lambda: node.queue.seconds == 0 and len(node.queue) == 0, timeout=30)
    time.sleep(0.5)
    assert received and all(not m.audio_complete for m in received), [(m.text, m.audio_note) for m in received]
    assert "0.50 s of audio lost" in received[0].audio_note


def test_bad_chunks_are_skipped_and_speech_still_arrives(graph):
    received = listen(graph)
    node = speech_node(graph)
    pub = graph.node("mic").create_publisher(AudioChunk, "audio", QOS)
    wait_for_match(pub)
    pub.publish(AudioChunk(sample_rate=16000, channels=1, sample_format="F32LE",   # (ours refuses to write it)
                           data=np.array([0.1, np.nan, 0.2], "<f4").tobytes()))
    pub.publish(AudioChunk(sample_rate=16000, channels=1, sample_format="S16LE"))            # empty
    pub.publish(AudioChunk(sample_rate=0, channels=1, sample_format="S16LE", data=bytes(320)))
    pub.publish(AudioChunk(sample_rate=16000, channels=1, sample_format="OPUS", data=bytes(320)))
    pub.publish(pcm_to_audio_chunk(np.zeros(100, np.float32), 50, "F32LE"))                   # 50 Hz
    assert wait_for(lambda: node.skipped_chunks == 5, timeout=10)

    speech, rate = espeak_pcm("Stop right there.")
    audio = np.concatenate([np.zeros(rate // 2, np.float32), speech, np.zeros(rate, np.float32)])
    t0 = time.time()
    for i in range(0, audio.size, rate // 10):
        pub.publish(pcm_to_audio_chunk(audio[i:i + rate // 10], rate, "S16LE"))
    assert wait_for(lambda: received, timeout=60)
    assert words(received[0].text) == ["stop", "right", "there"]
    assert time_to_seconds(received[0].header.stamp) >= t0 - 1.0


def test_int16_multiarray_input(graph):
    received = listen(graph)
    speech, rate = espeak_pcm("Turn on the lights.")
    node = speech_node(graph, input_type="int16", sample_rate=rate)
    # input_type changes at the next configure: the subscription's type is decoded meanwhile (the
    # new value was used at once, and crashed the node on the old type's messages)
    assert node.set_parameters([Parameter("input_type", value="float32")])[0].successful
    assert node.input_type == "int16"
    # and a chunk whose decoding fails in a way nothing foresaw is skipped, not the executor's end
    decode = node.decode

    def fails_once(msg):
        node.decode = decode
        raise AttributeError("'AudioDataStamped' object has no attribute 'data'")
    node.decode = fails_once
    pub = graph.node("mic").create_publisher(Int16MultiArray, "audio", QOS)
    wait_for_match(pub)
    audio = np.concatenate([np.zeros(rate // 2, np.float32), speech, np.zeros(rate, np.float32)])
    for i in range(0, audio.size, rate // 10):
        pub.publish(pcm_to_int16_array(audio[i:i + rate // 10]))
    assert wait_for(lambda: received, timeout=60)
    assert words(received[0].text) == ["turn", "on", "the", "lights"]
    assert node.skipped_chunks == 1


def test_partials_arrive_while_speaking_and_their_stable_text_leads_to_the_final(graph):
    """A 5.6 s sentence played in real time: partial transcripts come before the final one, carry
    the utterance's stamp, their stable text only grows and is the start of the final text (the
    tentative rest is in their one segment), and the final is the whole sentence."""
    sentence = "Please move the robot arm to the left and then pick up the red cup from the kitchen table."
    received = listen(graph, partials=True)
    speech_node(graph)
    graph.add(WavPublisher(context=graph.context, parameter_overrides=[
        Parameter("file", value=str(espeak_wav(sentence)))]))
    assert wait_for(lambda: any(m.is_final for m in received), timeout=60), "no final transcript"
    time.sleep(0.5)
    finals = [m for m in received if m.is_final]
    assert len(finals) == 1 and words(finals[0].text) == words(sentence), [m.text for m in finals]
    final = finals[0]
    partials = received[:received.index(final)]
    assert partials, "no partial transcript before the final one"
    assert all(not m.is_final for m in received if m is not final)
    assert received[-1] is final, "a partial came after the final"
    previous = []
    for m in partials:
        assert m.header.stamp == final.header.stamp
        stable = words(m.text)
        assert stable[:len(previous)] == previous, (previous, m.text)   # stable text only grows
        assert words(final.text)[:len(stable)] == stable, (m.text, final.text)
        assert len(m.segments) == 1 and words(m.segments[0].text)[:len(stable)] == stable
        assert 0 < m.audio_duration.sec + m.audio_duration.nanosec * 1e-9 < 8.0
        previous = stable
    assert any(m.segments[0].text for m in partials)


def test_no_partials_when_disabled(graph):
    received = listen(graph, partials=True)
    speech_node(graph, partial_interval_s=0.0)
    # At twice real time: partials are due by the audio's samples (every partial_interval_s of
    # speech), not by the clock, so an enabled node would still send them.
    graph.add(WavPublisher(context=graph.context, parameter_overrides=[
        Parameter("file", value=str(espeak_wav("Go to the kitchen and bring me a glass of water."))),
        Parameter("speed", value=2.0)]))
    assert wait_for(lambda: received, timeout=60)
    time.sleep(0.5)
    assert [m.is_final for m in received] == [True]


def test_pauses_between_words_do_not_split_the_command(graph):
    """Pauses of 0.15-0.19 s after every word (espeak-ng -g 12 at 160 words/min), at the default
    0.3 s end of utterance: one transcript with the whole command."""
    sentence = "Bring the green bottle to the office."
    received = listen(graph)
    speech_node(graph)
    graph.add(WavPublisher(context=graph.context, parameter_overrides=[
        Parameter("file", value=str(espeak_wav(sentence, word_gap=12))), Parameter("speed", value=2.0)]))
    assert wait_for(lambda: received, timeout=60)
    time.sleep(1.0)
    assert [words(m.text) for m in received] == [words(sentence)]
    assert received[0].audio_complete


class TickedWavPublisher(WavPublisher):
    """The player, noting at each tick of its timer its clock as the tick began and the end (stamp
    plus duration) of the last chunk it has published by the tick's end, from the messages it sent.
    Once started, a tick leaves no chunk due unsent: that end is less than a chunk (chunk_ms, 100 ms)
    before the tick's clock, however late the tick ran (it catches up in a burst, MAX_CATCH_UP
    chunks at most). Arrival times over DDS could not show it: a busy machine delays them."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.ticks: list[tuple[float, float, int]] = []   # (clock at the tick, end sent, chunks in the tick)
        self.sent_end: float | None = None
        publish = self.publisher.publish

        def noting(msg) -> None:
            publish(msg)
            self.sent_end = time_to_seconds(msg.header.stamp) + len(msg.data) / 2 / msg.sample_rate
        self.publisher.publish = noting

    def publish_next(self) -> None:
        now, sent = self.get_clock().now().nanoseconds * 1e-9, self.index
        super().publish_next()
        if self.sent_end is not None and not self.done:
            self.ticks.append((now, self.sent_end, self.index - sent))


def assert_caught_up(player: TickedWavPublisher, chunk_s: float = 0.1) -> None:
    from photon_ros.wav_publisher import MAX_CATCH_UP
    behind = [(now, end) for now, end, n in player.ticks if n < MAX_CATCH_UP and end <= now - chunk_s - 1e-6]
    assert player.ticks and not behind, behind[:5]


def test_wav_publisher_stamps_each_chunk_as_a_driver_does(graph):
    """A driver publishes a chunk once its last sample is captured: the chunk's stamp plus its
    duration is when it goes out, never after it arrives (the player's chunks arrived as their
    audio would only begin: a chunk ahead of any microphone), and no chunk due is held back."""
    arrivals = []
    graph.node("ears").create_subscription(AudioChunk, "audio", lambda m: arrivals.append((m, time.time())), QOS)
    player = graph.add(TickedWavPublisher(context=graph.context, parameter_overrides=[
        Parameter("file", value=str(espeak_wav("Stop."))), Parameter("leading_silence_s", value=0.0)]))
    assert wait_for(lambda: len(arrivals) >= 5, timeout=30)
    for msg, arrived in arrivals[:5]:
        end = time_to_seconds(msg.header.stamp) + len(msg.data) / 2 / msg.sample_rate
        assert end <= arrived + 0.02, (end, arrived)
    assert_caught_up(player)


def test_a_looped_wav_keeps_its_stamps_on_the_clock(graph, tmp_path):
    """Each chunk went out one timer period after the last, the short last chunk of every loop
    too: a 0.15 s file in 100 ms chunks played at three quarters of real time, its stamps (counted
    in samples) a second behind the clock after 4 s, and the loop node soon refused every command
    as too old. Chunks now go out as their audio is due."""
    import wave
    path = tmp_path / "short.wav"
    with wave.open(str(path), "wb") as f:
        f.setnchannels(1)
        f.setsampwidth(2)
        f.setframerate(16000)
        f.writeframes((np.sin(np.arange(2400) * 0.2) * 8000).astype("<i2").tobytes())
    arrivals = []
    graph.node("ears").create_subscription(AudioChunk, "audio", arrivals.append, QOS)
    player = graph.add(TickedWavPublisher(context=graph.context, parameter_overrides=[
        Parameter("file", value=str(path)), Parameter("loop", value=True),
        Parameter("leading_silence_s", value=0.0), Parameter("trailing_silence_s", value=0.0)]))
    assert wait_for(lambda: arrivals, timeout=30)
    # 4 s of the player's ticks (each loop behind by a tick's 50 ms shows within a second), however
    # many ticks a busy machine gives it meanwhile
    assert wait_for(lambda: player.ticks and player.ticks[-1][0] - player.ticks[0][0] >= 4.0, timeout=60)
    assert_caught_up(player)
    starts = [time_to_seconds(m.header.stamp) for m in arrivals]
    sizes = [len(m.data) // 2 for m in arrivals]
    assert np.allclose(np.diff(starts), np.array(sizes[:-1]) / 16000, atol=1e-6)   # joined exactly


def test_a_float_wav_on_the_int16_scale_is_played_unclipped(graph, tmp_path):
    """read_wav takes float samples up to 32768 (files written on the int16 scale exist); the
    player sent them as if within [-1, 1]: S16LE chunks clipped 80% of the samples to full scale."""
    tone = (np.sin(np.arange(1600) * 0.2) * 20000).astype("<f4")
    path = tmp_path / "float.wav"
    with open(path, "wb") as f:   # WAVE_FORMAT_IEEE_FLOAT, mono, 16 kHz, 32-bit
        data = tone.tobytes()
        f.write(b"RIFF" + (36 + len(data)).to_bytes(4, "little") + b"WAVEfmt " + (16).to_bytes(4, "little")
                + (3).to_bytes(2, "little") + (1).to_bytes(2, "little") + (16000).to_bytes(4, "little")
                + (64000).to_bytes(4, "little") + (4).to_bytes(2, "little") + (32).to_bytes(2, "little")
                + b"data" + len(data).to_bytes(4, "little") + data)
    arrivals = []
    graph.node("ears").create_subscription(AudioChunk, "audio", arrivals.append, QOS)
    player = graph.add(WavPublisher(context=graph.context, parameter_overrides=[
        Parameter("file", value=str(path)), Parameter("speed", value=10.0),
        Parameter("leading_silence_s", value=0.0), Parameter("trailing_silence_s", value=0.0)]))
    assert wait_for(lambda: player.done, timeout=30) and wait_for(lambda: len(arrivals) == 1, timeout=10)
    played = np.frombuffer(bytes(arrivals[0].data), "<i2")
    assert np.abs(played.astype(int) - np.round(tone)).max() <= 1   # not clipped at 32767
