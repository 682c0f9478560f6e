"""The speech node's parameters: a bad value stops it at startup with the reason (it used to start,
report healthy, and die in the first audio callback), a bad change is refused with the reason, and
the changes it takes (VAD, language) are used from the next utterance on, not silently ignored."""
import os
import subprocess
import sys

import numpy as np
import pytest
import rclpy
from rclpy.parameter import Parameter

from photon_ros.msg import AudioChunk
from photon_ros.audio_conversions import pcm_to_audio_chunk
from photon_ros.speech_node import SpeechNode


@pytest.fixture
def context():
    ctx = rclpy.Context()
    rclpy.init(context=ctx)
    yield ctx
    rclpy.shutdown(context=ctx)


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
    ({"input_type": "audio_data"}, "needs the audio_common_msgs of ros-drivers/audio_common")])
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
