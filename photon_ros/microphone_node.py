"""Captures a microphone with `sounddevice` (PortAudio) and publishes AudioChunk on `audio`.

Optional: needs `pip install sounddevice` and the PortAudio library (`apt install libportaudio2`).
Without them, or without an input device, it says so and exits instead of publishing nothing.
"""
from __future__ import annotations

import queue
import time

import numpy as np
from rclpy.node import Node
from rclpy.qos import QoSProfile, ReliabilityPolicy
from std_msgs.msg import Header

from photon_ros.params import NodeParams, Param
from photon_ros.run_node import run_node
from photon_ros.audio_conversions import pcm_to_audio_chunk
from photon_ros.msg import AudioChunk
from photon_ros.result_messages import seconds_to_time


def open_sounddevice():
    try:
        import sounddevice
    except (ImportError, OSError) as err:
        raise RuntimeError(f"sounddevice is not usable ({err}): `pip install sounddevice` and "
                           "`apt install libportaudio2`, or play a file with wav_publisher") from None
    return sounddevice


class SampleClock:
    """Capture stamps counted in samples, so consecutive blocks join exactly (the speech node reads
    a jump as lost audio), slewed toward the wall clock by at most `slew` of each block so the
    sound card's drift never builds up; a driver overflow (samples lost) re-anchors at once."""

    def __init__(self, rate: int, slew: float = 0.01) -> None:
        self.rate = rate
        self.slew = slew
        self.next: float | None = None   # stamp of the next block's first sample

    def stamp(self, frames: int, now: float, overflow: bool = False) -> float:
        """Stamp of a block of `frames` samples whose last sample was captured about `now`."""
        duration = frames / self.rate
        wall = now - duration
        if self.next is None or overflow:
            start = wall
        else:
            limit = self.slew * duration
            start = self.next + min(max(wall - self.next, -limit), limit)
        self.next = start + duration
        return start


# All read once, when the audio stream opens.
MICROPHONE_PARAMS = [
    Param("device", "", "PortAudio input device, by name or index; empty: the default input", applies="restart"),
    Param("sample_rate", 16000, "Hz to capture at", low=4000, high=384000, applies="restart"),
    Param("channels", 1, "channels to capture (interleaved in each chunk)", low=1, high=64, applies="restart"),
    Param("frame_id", "microphone", "frame id of the audio chunks", applies="restart"),
    Param("chunk_ms", 100.0, "milliseconds of audio per chunk", low=1.0, high=1000.0, applies="restart"),
]


class MicrophoneNode(Node):
    def __init__(self, **kwargs) -> None:
        super().__init__("microphone", **kwargs)
        p = NodeParams(self, MICROPHONE_PARAMS)
        device = p["device"] or None         # name or index; default input when empty
        self.rate, channels, self.frame_id = p["sample_rate"], p["channels"], p["frame_id"]
        block = max(1, int(self.rate * p["chunk_ms"] / 1000))
        sd = open_sounddevice()
        if device is not None and str(device).isdigit():
            device = int(device)
        self.blocks: queue.Queue = queue.Queue(maxsize=100)
        self.clock = SampleClock(self.rate)
        self.publisher = self.create_publisher(AudioChunk, "audio", QoSProfile(
            depth=100, reliability=ReliabilityPolicy.RELIABLE))
        # PortAudio calls back on its own thread; hand blocks over, publish from the executor.
        self.stream = sd.InputStream(samplerate=self.rate, channels=channels, dtype="int16",
                                     blocksize=block, device=device, callback=self.on_block)
        self.stream.start()
        self.create_timer(block / self.rate / 2, self.publish_pending)
        self.get_logger().info(f"capturing {self.stream.device} at {self.rate} Hz")

    def on_block(self, data: np.ndarray, frames: int, time_info, status) -> None:
        captured = self.clock.stamp(frames, time.time(), overflow=bool(status and status.input_overflow))
        try:
            self.blocks.put_nowait((data.copy(), captured))
        except queue.Full:
            pass  # the executor is stalled; losing audio beats blocking the audio thread (the
            #       stamps of the next blocks still count these samples: the gap shows downstream)

    def publish_pending(self) -> None:
        while not self.blocks.empty():
            data, captured = self.blocks.get_nowait()
            header = Header(stamp=seconds_to_time(captured), frame_id=self.frame_id)
            self.publisher.publish(pcm_to_audio_chunk(data, self.rate, AudioChunk.FORMAT_S16LE, header))

    def destroy_node(self) -> None:
        if hasattr(self, "stream"):   # absent when the device failed to open in __init__
            self.stream.close()
        super().destroy_node()


def main(args=None) -> None:
    run_node(MicrophoneNode, args)


if __name__ == "__main__":
    main()
