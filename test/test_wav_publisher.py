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


@pytest.mark.parametrize("peak, played", [(0.95, 0.95), (1.05, 1.0), (3.5, 1.0), (20000.0, 20000.0 / 32768)])
def test_float_files_past_full_scale(context, tmp_path, peak, played):
    """Float WAVs overshoot full scale a little (floats do not clip): one peaking at 1.05 was read as
    int16 values stored as floats and played at 1/32768 (-90 dBFS), and no utterance was ever
    found. Past the model's MAX_FLOAT_PEAK (4) the values are int16's and are scaled as such."""
    from test_audio_io import FLOAT, wav_bytes

    tone = np.sin(np.linspace(0, 200 * np.pi, 16000)) * peak
    wav = tmp_path / "float.wav"
    wav.write_bytes(wav_bytes(FLOAT, 1, 16000, 4, tone.astype("<f4").tobytes()))
    node = WavPublisher(context=context, parameter_overrides=[Parameter("file", value=str(wav)),
                                                              Parameter("wait_for_subscribers", value=0)])
    try:
        sent = np.concatenate(node.chunks)
        assert np.abs(sent).max() == pytest.approx(played, rel=1e-3)
    finally:
        node.destroy_node()
