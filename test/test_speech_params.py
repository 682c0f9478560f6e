"""The speech node's parameters: a bad value stops it at startup with the reason (it used to start,
report healthy, and die in the first audio callback), a bad change is refused with the reason, and
the changes it takes (VAD, language) are used from the next utterance on, not silently ignored."""
import os
import subprocess
import sys

import numpy as np
import pytest
from rclpy.parameter import Parameter

from fake_speech_model import fake_speech_model
from photon_ros.managed import SUCCESS
from photon_ros.msg import AudioChunk
from photon_ros.audio_conversions import pcm_to_audio_chunk
from photon_ros.speech_node import SpeechNode


def unconfigured(context, **params):
    """A speech node that loads no model (a manager would configure it)."""
    overrides = [Parameter("autostart", value=False)] + [Parameter(k, value=v) for k, v in params.items()]
    return SpeechNode(context=context, parameter_overrides=overrides)


@pytest.mark.parametrize("params, reason", [
    ({"vad.hangover_s": -1.0}, "vad.hangover_s must be > 0"),
    ({"vad.tail_s": 0.5}, r"vad.tail_s must be within 0..vad.hangover_s"),
    ({"input_type": "bogus"}, "input_type must be one of audio_chunk, int16, float32"),
    ({"reliability": "bogus"}, "reliability must be one of best_effort, reliable"),
    ({"sample_rate": 0}, "sample_rate must be >= 4000"),
    ({"partial_interval_s": float("nan")}, "partial_interval_s must be a number"),
    ({"input_type": "audio_stamped"}, "needs the audio_common_msgs of mgonzs13/audio_common"),
    ({"input_type": "audio_data"}, "needs the audio_common_msgs of ros-drivers/audio_common"),
    # refused when set, not at configure; an empty model read as the current directory
    ({"device": "gpu"}, r"device must be cpu, cuda or cuda:N, got 'gpu'"), ({"model": ""}, "model must name a checkpoint")])
def test_a_bad_parameter_stops_the_node_at_startup(context, params, reason):
    with pytest.raises(ValueError, match=reason):
        unconfigured(context, **params)


def test_the_node_process_says_why_in_one_line():
    env = dict(os.environ, ROS_AUTOMATIC_DISCOVERY_RANGE="LOCALHOST")
    run = subprocess.run([sys.executable, "-m", "photon_ros.speech_node", "--ros-args", "-p", "vad.tail_s:=0.5"],
                         capture_output=True, text=True, timeout=60, env=env)
    assert run.returncode == 1
    assert "vad.tail_s must be within" in run.stderr
    assert "Traceback" not in run.stderr, run.stderr


def test_changes_are_checked_and_taken_between_utterances(context):
    node = unconfigured(context)
    try:
        refused = node.set_parameters([Parameter("vad.tail_s", value=2.0)])[0]
        assert not refused.successful and "vad.tail_s must be within" in refused.reason
        assert not node.set_parameters([Parameter("vad.hangover_s", value=0.0)])[0].successful
        assert node.set_parameters([Parameter("vad.hangover_s", value=1), Parameter("language", value="de")])[0].successful
        assert node.language == "de" and node.vad_config.hangover_s == 1.0
        # The segmenter already running takes the new rules before the next utterance.
        node.activity.start()
        node.take_audio(pcm_to_audio_chunk(np.zeros(1600, np.float32), 16000, AudioChunk.FORMAT_F32LE))
        assert node.segmenter.config.hangover_s == 1.0
        node.set_parameters([Parameter("vad.hangover_s", value=0.6)])
        node.take_audio(pcm_to_audio_chunk(np.zeros(1600, np.float32), 16000, AudioChunk.FORMAT_F32LE))
        assert node.segmenter.config.hangover_s == 0.6 and node.segmenter.tail_frames == round(0.1 / 0.03)
    finally:
        node.destroy_node()


def test_a_language_the_model_cannot_take_is_refused_and_failing_transcriptions_say_error():
    """whisper-tiny.en refuses language "de" when it is set (every utterance would fail), and
    transcriptions that keep failing turn /diagnostics ERROR with the model's reason."""
    from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus

    from photon_ros.speech_segmenter import Utterance
    from ros_harness import RosGraph, wait_for

    graph = RosGraph()
    try:
        statuses = []
        graph.node("listener").create_subscription(DiagnosticArray, "/diagnostics",
                                                   lambda m: statuses.extend(m.status), 10)
        node = graph.add(SpeechNode(context=graph.context))
        assert wait_for(lambda: node.model is not None or node.model_error, timeout=120), "no model"
        assert node.model is not None, node.model_error
        refused = node.set_parameters([Parameter("language", value="de")])[0]
        assert not refused.successful and "English-only" in refused.reason and node.language is None
        assert node.set_parameters([Parameter("language", value="EN")])[0].successful   # as openai-whisper takes it
        assert node.set_parameters([Parameter("language", value="en")])[0].successful

        def last():
            mine = [s for s in statuses if s.name.endswith(node.get_fully_qualified_name())]
            return mine[-1] if mine else None

        # the real model failing, three utterances in a row (NaN samples: the model's own refusal)
        for i in range(3):
            assert node.run_model(Utterance(np.full(1600, np.nan, np.float32), 16000, 100.0 + i))[0] is None
        node.chunks_received = 1   # audio arrives (else the node says it has none, a warning)
        statuses.clear()
        assert wait_for(lambda: last() is not None and last().level == DiagnosticStatus.ERROR, timeout=10)
        status = last()
        assert "transcriptions all failed" in status.message and "NaN" in status.message
        assert {v.key: v.value for v in status.values}["transcripts_failed"] == "3"
        assert node.run_model(Utterance(np.zeros(16000, np.float32), 16000, 110.0))[0] is not None
        statuses.clear()
        assert wait_for(lambda: last() is not None and last().level == DiagnosticStatus.OK, timeout=10)
        # another model from the next configure: tiny.en transcribes until then, in the language set now
        assert node.set_parameters([Parameter("model", value="openai/whisper-small")])[0].successful
        refused = node.set_parameters([Parameter("language", value="de")])[0]
        assert not refused.successful and "English-only" in refused.reason and node.language == "en"
    finally:
        graph.close()


@pytest.mark.parametrize("name, value", [("language", "de"), ("initial_prompt", "Photon, Moondream")])
def test_language_and_prompt_are_checked_against_the_loaded_model_while_another_waits(context, monkeypatch,
                                                                                      name, value):
    """language and initial_prompt apply at once, to the model loaded, while a new `model` waits for
    the next configure: they were accepted unchecked then, and every transcription failed."""
    model = fake_speech_model(monkeypatch)
    node = unconfigured(context)
    try:
        assert node.trigger_configure() == SUCCESS
        assert node.set_parameters([Parameter("model", value="whisper-small")])[0].successful
        refused = node.set_parameters([Parameter(name, value=value)])[0]
        assert not refused.successful and refused.reason.startswith(f"{name}: ")
        assert "at the next configure: set it after that" in refused.reason
        assert node.params[name] == ""
        model.english_only = False   # the new model, once configured, takes them
        assert node.trigger_cleanup() == SUCCESS and node.trigger_configure() == SUCCESS
        assert node.set_parameters([Parameter(name, value=value)])[0].successful
    finally:
        node.destroy_node()


def test_unstamped_audio_before_a_simulators_first_clock_is_not_stamped_negative(context):
    """Under use_sim_time the node's clock reads 0 until the first /clock: an unstamped chunk
    (std_msgs arrays, a zero stamp) "ended now" began before 0, and its transcript carried a
    negative stamp, which rclpy's Time (and so many readers) refuses."""
    node = unconfigured(context, use_sim_time=True)
    try:
        chunk = pcm_to_audio_chunk(np.zeros(1600, np.int16), 16000)
        assert node.get_clock().now().nanoseconds == 0
        _, start, stamped, _ = node.decode(chunk)
        assert start == 0.0 and not stamped
    finally:
        node.destroy_node()


def test_audio_lost_in_transport_is_not_blamed_on_the_sample_rate(context, monkeypatch):
    """Array audio at the right rate over a lossy best-effort link (every 4th message lost, as the
    sequence numbers show): counted over the chunks that came, the samples arrived at 12 kHz and
    /diagnostics told the user to set sample_rate, which would have made the model hear it wrong."""
    import photon_ros.speech_node as speech_node
    from photon_ros.managed import SUCCESS
    from std_msgs.msg import Int16MultiArray

    class Clock:
        now = 1000.0

        def monotonic(self):
            return self.now

        def __getattr__(self, name):
            return getattr(time, name)

    fake_speech_model(monkeypatch)
    clock = Clock()
    monkeypatch.setattr(speech_node, "time", clock)
    node = SpeechNode(context=context, parameter_overrides=[
        Parameter("autostart", value=False), Parameter("input_type", value="int16"), Parameter("sample_rate", value=16000)])
    try:
        assert node.trigger_configure() == SUCCESS and node.trigger_activate() == SUCCESS
        noise = np.random.default_rng(0).normal(0, 30, 1600).astype(np.int16).tolist()
        for seq in range(1, 81):                    # 8 s of 0.1 s chunks at 10 Hz
            clock.now += 0.1
            if seq % 4:
                node.on_audio(Int16MultiArray(data=noise), {"publication_sequence_number": seq,
                                                            "publisher_gid": {"data": [7] * 16}})
        assert node.health.lost_in_transport == 19
        assert node.arrival.mismatch() == ""
        # the same link, the rate stated wrong: still said (the check is not switched off by losses)
        assert node.set_parameters([Parameter("sample_rate", value=48000)])[0].successful
        for seq in range(81, 161):
            clock.now += 0.1
            if seq % 4:
                node.on_audio(Int16MultiArray(data=noise), {"publication_sequence_number": seq,
                                                            "publisher_gid": {"data": [7] * 16}})
        assert "about 16000 samples/s but sample_rate says 48000 Hz" in node.arrival.mismatch()
    finally:
        node.destroy_node()


def test_a_transcript_names_the_prompt_its_audio_was_decoded_with(context, monkeypatch):
    """initial_prompt was read when the transcript was published: a change during the decode was
    named on a transcript the model decoded without it."""
    from photon_ros.speech_segmenter import Utterance

    model = fake_speech_model(monkeypatch)
    model.english_only = False
    node = unconfigured(context, initial_prompt="kitchen words")
    try:
        assert node.trigger_configure() == SUCCESS and node.trigger_activate() == SUCCESS
        seen = []

        def transcribe(audio, sample_rate, language=None, initial_prompt=None, **options):
            seen.append(initial_prompt)
            assert node.set_parameters([Parameter("initial_prompt", value="garage words")])[0].successful
            return {"text": "hello", "language": "en", "segments": []}
        model.transcribe = transcribe
        sent = []
        node.publisher.publish = sent.append
        utterance = Utterance(np.zeros(16000, np.float32), 16000, 100.0)
        result, seconds = node.run_model(utterance)
        node.publish(result, utterance, seconds, node.activity.current())
        assert seen == ["kitchen words"] and sent[-1].prompt == "kitchen words"
    finally:
        node.destroy_node()
