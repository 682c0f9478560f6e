"""The main job, end to end: a spoken command, published as ROS audio, comes back as a transcript.

    espeak-ng speaks a command to a WAV file (or give your own: --wav FILE)
    wav_publisher plays it on `audio` in real-time chunks
    speech node (Whisper tiny.en, real weights) transcribes the utterance
    this process subscribes to `transcript` and prints what arrives.

All three nodes run over real DDS in one process. Run it in the development environment
(scripts/dev_env.sh keeps discovery on this machine).
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import rclpy
from rclpy.executors import MultiThreadedExecutor
from rclpy.parameter import Parameter
from rclpy.qos import QoSProfile, ReliabilityPolicy

from photon_ros.msg import Transcript
from photon_ros.speech_node import SpeechNode
from photon_ros.wav_publisher import WavPublisher

COMMAND = "Go to the kitchen and bring me a glass of water."


def spoken_command(text: str, folder: Path) -> Path:
    path = folder / "command.wav"
    subprocess.run(["espeak-ng", "-v", "en-us", "-s", "150", "-w", str(path), text], check=True)
    return path


def run(wav: Path, model: str, timeout: float) -> Transcript | None:
    rclpy.init()
    executor = MultiThreadedExecutor(num_threads=4)
    speech = SpeechNode(parameter_overrides=[Parameter("model", value=model)])
    listener = rclpy.create_node("demo_listener")
    received: list[Transcript] = []
    arrived = threading.Event()
    listener.create_subscription(Transcript, "transcript",
                                 lambda m: m.is_final and (received.append(m), arrived.set()),
                                 QoSProfile(depth=10, reliability=ReliabilityPolicy.RELIABLE))
    for node in (speech, listener):
        executor.add_node(node)
    spinner = threading.Thread(target=executor.spin, daemon=True)
    spinner.start()
    try:
        deadline = time.monotonic() + timeout
        while speech.model is None and speech.model_error is None and time.monotonic() < deadline:
            time.sleep(0.05)
        if speech.model is None:
            print(f"demo: speech model did not load: {speech.model_error or 'timed out'}", file=sys.stderr)
            return None
        player = WavPublisher(parameter_overrides=[Parameter("file", value=str(wav))])
        executor.add_node(player)
        arrived.wait(max(0.0, deadline - time.monotonic()))
        return received[0] if received else None
    finally:
        executor.shutdown()
        rclpy.try_shutdown()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--wav", type=Path, help="a WAV file to play instead of the spoken command")
    parser.add_argument("--text", default=COMMAND, help="what espeak-ng says")
    parser.add_argument("--model", default="whisper-tiny.en")
    parser.add_argument("--timeout", type=float, default=120.0)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        wav = args.wav or spoken_command(args.text, Path(tmp))
        if not args.wav:
            print(f"[demo] spoken command: {args.text!r}")
        msg = run(wav, args.model, args.timeout)
    if msg is None:
        print("[demo] no transcript arrived", file=sys.stderr)
        return 1
    audio = msg.audio_duration.sec + msg.audio_duration.nanosec * 1e-9
    processing = msg.processing_time.sec + msg.processing_time.nanosec * 1e-9
    latency = msg.latency.sec + msg.latency.nanosec * 1e-9
    print(f"[demo] transcript on /transcript: {msg.text!r}")
    print(f"[demo] {audio:.1f} s of audio transcribed in {processing:.2f} s by {msg.model_id}; "
          f"end of utterance -> transcript published: {latency:.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
