"""The WAV publisher refuses, where it is built, a file it cannot play (real rclpy, no DDS traffic)."""
import numpy as np
import pytest
from rclpy.parameter import Parameter

from photon_core.audio_io import write_wav
from photon_ros.wav_publisher import WavPublisher


@pytest.mark.parametrize("silence_s", [0.0, 0.5], ids=["no-silence", "silence"])
def test_a_file_without_audio_is_refused_at_startup(context, tmp_path, silence_s):
    """A 0-frame file without silence around it made no chunk at all: the node started, and its
    timer's first tick raised IndexError from the executor. With silence it played nothing but that."""
    wav = tmp_path / "empty.wav"
    write_wav(wav, np.zeros(0, np.int16), 16000)
    overrides = [Parameter("file", value=str(wav)), Parameter("wait_for_subscribers", value=0),
                 Parameter("leading_silence_s", value=silence_s), Parameter("trailing_silence_s", value=silence_s)]
    with pytest.raises(ValueError, match=f"^{wav}: holds no audio"):
        WavPublisher(context=context, parameter_overrides=overrides)
