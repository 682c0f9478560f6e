"""A microphone driver in another process, publishing as drivers do (sensor-data QoS: best effort),
reaches the speech node with its default settings and gives the spoken command; a node set to
`reliability: reliable` cannot match such a driver, and says so on /diagnostics instead of staying
silent. Run as a script, this file is the microphone: 16 kHz S16LE AudioChunks of a WAV, stamped
on its sample clock, paced at twice real time, on every topic named on its command line (silence
until "go" on its stdin, then the WAV)."""
from __future__ import annotations

import math
import os
import select
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import rclpy
from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus
from rclpy.parameter import Parameter
from rclpy.qos import QoSProfile, ReliabilityPolicy, qos_profile_sensor_data
from scipy.signal import resample_poly
from std_msgs.msg import Header

from photon_core.audio_io import read_wav
from photon_ros.audio_conversions import pcm_to_audio_chunk
from photon_ros.msg import AudioChunk, Transcript
from photon_ros.result_messages import seconds_to_time
from photon_ros.speech_node import SpeechNode
from ros_harness import RosGraph, wait_for
from speech_audio import espeak_wav, words

RATE = 16000
CHUNK_S = 0.1
SENTENCE = "Find the red ball."


def microphone(wav: str, topics: list[str]) -> None:
    """Wait for a subscriber on the first topic, send silence until "go" on stdin, then play the
    WAV (resampled to 16 kHz) once, all on one sample clock."""
    samples, rate = read_wav(wav)
    audio = samples.astype(np.float32) / 32768.0
    audio = resample_poly(audio, RATE, rate)   # espeak-ng speaks at 22050 Hz
    audio = np.concatenate([np.zeros(RATE // 2), audio, np.zeros(RATE)]).astype(np.float32)
    rclpy.init()
    node = rclpy.create_node("microphone")
    pubs = [node.create_publisher(AudioChunk, t, qos_profile_sensor_data) for t in topics]
    deadline = time.monotonic() + 30
    while pubs[0].get_subscription_count() == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    t0, step, k = time.time(), int(RATE * CHUNK_S), 0

    def send(samples: np.ndarray) -> None:
        nonlocal k
        header = Header(stamp=seconds_to_time(t0 + k * CHUNK_S), frame_id="mic")
        chunk = pcm_to_audio_chunk(samples, RATE, "S16LE", header=header)
        for pub in pubs:
            pub.publish(chunk)
        k += 1
        time.sleep(max(0.0, t0 + k * CHUNK_S / 2 - time.time()))

    # Silence, as a driver streams it, until the test has seen the node take enough of it: what
    # reaches the node from a best-effort writer starts once its reader has matched ours, which
    # may come after our writer matched it.
    go_by = time.monotonic() + 60
    while not select.select([sys.stdin], [], [], 0)[0]:
        if time.monotonic() > go_by:
            raise SystemExit("microphone: no 'go' on stdin (the node never took the lead-in)")
        send(np.zeros(step, np.float32))
    if sys.stdin.readline().strip() != "go":
        raise SystemExit("microphone: stdin closed before 'go'")
    for i in range(0, audio.size, step):
        send(audio[i:i + step])
    time.sleep(0.5)
    node.destroy_node()
    rclpy.shutdown()


@pytest.fixture
def graph():
    g = RosGraph()
    yield g
    g.close()


def test_best_effort_microphone_in_another_process(graph):
    reliable = QoSProfile(depth=10, reliability=ReliabilityPolicy.RELIABLE)
    finals, diagnostics = [], []
    listener = graph.node("listener")
    listener.create_subscription(Transcript, "/default/transcript",
                                 lambda m: m.is_final and finals.append(m), reliable)
    listener.create_subscription(DiagnosticArray, "/diagnostics", diagnostics.append, reliable)
    default = graph.add(SpeechNode(context=graph.context, namespace="default"))
    strict = graph.add(SpeechNode(context=graph.context, namespace="strict",
                                  parameter_overrides=[Parameter("reliability", value="reliable")]))
    assert wait_for(lambda: default.model is not None and strict.model is not None, timeout=120), \
        (default.model_error, strict.model_error)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]))
    # The driver waits for the default node's subscription only: the strict one can never match.
    mic = subprocess.Popen([sys.executable, __file__, str(espeak_wav(SENTENCE)), "/default/audio", "/strict/audio"],
                           env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        # Speech is a whole command only after a pause the node heard before it (hangover_s): the
        # command starts once the node has taken twice that much of the driver's silence (its
        # first chunks are lost while its reader has not yet matched the driver's writer).
        lead_chunks = math.ceil(round(2 * default.vad_config.hangover_s / CHUNK_S, 6))
        heard = wait_for(lambda: default.chunks_received >= lead_chunks or mic.poll() is not None, timeout=60)
        assert heard and mic.poll() is None, mic.stdout.read() if mic.poll() is not None else "no lead-in taken"
        mic.stdin.write("go\n")
        mic.stdin.flush()
        assert wait_for(lambda: finals, timeout=90), mic.stdout.read() if mic.poll() is not None else "no transcript"
    finally:
        mic.stdin.close()
        mic.wait(timeout=60)
    assert words(finals[0].text) == words(SENTENCE)
    assert finals[0].audio_complete and finals[0].header.frame_id == "mic"
    assert default.chunks_received > 0 and strict.chunks_received == 0

    def strict_status() -> DiagnosticStatus | None:
        for array in reversed(diagnostics):
            for status in array.status:
                if status.name.endswith("/strict/speech"):
                    return status
        return None
    assert wait_for(lambda: strict_status() is not None and "RELIABILITY" in strict_status().message, timeout=10), \
        strict_status()
    assert strict_status().level == DiagnosticStatus.WARN and "never arrives" in strict_status().message


if __name__ == "__main__":
    microphone(sys.argv[1], sys.argv[2:])
