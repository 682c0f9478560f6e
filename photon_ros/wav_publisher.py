"""Plays a WAV file onto the audio topic in real-time-sized chunks, as a microphone driver would.

For demos, tests and users without a microphone. Chunks are photon_ros/AudioChunk at the file's
own rate and channel count (the speech node resamples), stamped on the audio's own clock: start
time + samples sent / rate, whatever the playback speed, so consecutive chunks join exactly and a
receiver can tell lost audio from late audio. A loop continues that clock (one seamless stream).
Silence before and after lets a VAD see the speech start and end. Playback starts once
`wait_for_subscribers` subscriptions (1 by default; 0: at once) have matched: DDS drops what is
published before a subscriber is discovered, and a file's first words lost that way would be a
command cut short without any gap to show it.
"""
from __future__ import annotations

if __name__ == "__main__":   # `python -m`: a Ctrl-C during the imports below (seconds) ends it at once
    from photon_ros.run_node import exit_on_ctrl_c
    exit_on_ctrl_c()

import time

import numpy as np
from rclpy.node import Node
from rclpy.qos import QoSProfile, ReliabilityPolicy
from std_msgs.msg import Header

from photon_core.audio_io import MAX_FLOAT_PEAK, pcm_to_float, read_wav
from photon_ros.params import NodeParams, Param
from photon_ros.run_node import exit_on_help, run_node
from photon_ros.audio_conversions import pcm_to_audio_chunk
from photon_ros.msg import AudioChunk
from photon_ros.result_messages import seconds_to_time


def chunk_audio(samples: np.ndarray, rate: int, chunk_s: float, leading_s: float = 0.0,
                trailing_s: float = 0.0) -> list[np.ndarray]:
    """The file padded with silence and cut into chunks of chunk_s seconds (the last may be short)."""
    pad = [(round(leading_s * rate), round(trailing_s * rate))] + [(0, 0)] * (samples.ndim - 1)
    padded = np.pad(samples, pad)
    step = max(1, round(chunk_s * rate))
    return [padded[i:i + step] for i in range(0, len(padded), step)]


# All read once: the node plays one file.
WAV_PUBLISHER_PARAMS = [
    Param("file", "", "the WAV file to play (required)", applies="restart"),
    Param("speed", 1.0, "1.0 = real time; 2.0 = twice as fast", positive=True, high=1000.0, applies="restart"),
    Param("loop", False, "play the file again and again", applies="restart"),
    Param("frame_id", "microphone", "frame id of the audio chunks", applies="restart"),
    Param("sample_format", AudioChunk.FORMAT_S16LE, "sample format of the chunks",
          choices=(AudioChunk.FORMAT_S16LE, AudioChunk.FORMAT_S32LE, AudioChunk.FORMAT_F32LE, AudioChunk.FORMAT_U8),
          applies="restart"),
    Param("chunk_ms", 100.0, "milliseconds of audio per chunk", low=1.0, high=10000.0, applies="restart"),
    Param("leading_silence_s", 0.5, "silence played before the file", low=0.0, high=3600.0, applies="restart"),
    Param("trailing_silence_s", 1.0, "silence played after the file", low=0.0, high=3600.0, applies="restart"),
    Param("wait_for_subscribers", 1, "start once this many subscribers are matched (0: at once)", low=0,
          applies="restart"),
]


# Chunks one timer tick publishes at most (an executor held up for seconds catches up in a burst,
# as a driver's buffered audio does).
MAX_CATCH_UP = 100
TICK_JITTER_S = 0.005


class WavPublisher(Node):
    def __init__(self, **kwargs) -> None:
        super().__init__("wav_publisher", **kwargs)
        # Checked before the file is read: a zero speed divides the timer period by zero, a zero
        # chunk makes a timer of period 0 that spins a core.
        p = NodeParams(self, WAV_PUBLISHER_PARAMS)
        path, self.speed, self.loop, self.frame_id = p["file"], p["speed"], p["loop"], p["frame_id"]
        self.sample_format, chunk_ms = p["sample_format"], p["chunk_ms"]
        leading_s, trailing_s = p["leading_silence_s"], p["trailing_silence_s"]
        self.wait_for_subscribers = p["wait_for_subscribers"]
        if not path:
            raise ValueError("parameter 'file' (a WAV file to play) is required")
        chunk_s = chunk_ms / 1000.0
        samples, self.rate = read_wav(path)   # its errors name the file
        if not len(samples):
            # refused here, as a bad path is: without silence around it there is no chunk to send,
            # and the timer's first tick died on it (with silence, it would play nothing but that)
            raise ValueError(f"{path}: holds no audio (0 frames)")
        if samples.dtype != np.int16:   # 8-bit silence is 128, not 0: pad and send floats instead
            samples = pcm_to_float(samples)
            peak = float(np.max(np.abs(samples))) if samples.size else 0.0
            if peak > MAX_FLOAT_PEAK:
                # float samples on the int16 scale (read_wav takes them): sent as they are, every
                # sample past full scale was clipped (S16LE) or the chunk refused (F32LE)
                samples = samples / np.float32(32768.0)
                self.get_logger().info(f"{path}: float samples up to {peak:g}, taken on the int16 scale")
            elif peak > 1.0:
                # a float file a little past full scale (floats do not clip: a gain, a resampler):
                # scaled to full scale, not read as int16 values (which made it silence)
                samples = samples / np.float32(peak)
                self.get_logger().info(f"{path}: float samples up to {peak:g}, scaled to full scale")
        self.chunks = chunk_audio(samples, self.rate, chunk_s, leading_s, trailing_s)
        self.index = 0
        self.sent_samples = 0
        self.done = False
        self.started_at: float | None = None   # node clock when the first chunk was due
        self.sent_at_start = 0                  # samples sent before it (a clock that went back starts again)
        self.last_now = 0.0
        # monotonic time of each chunk of the first play, for latency measurements (not of later loops:
        # a loop left playing for days would hold one entry per chunk)
        self.published_at: list[float] = []
        self.publisher = self.create_publisher(AudioChunk, "audio", QoSProfile(
            depth=100, reliability=ReliabilityPolicy.RELIABLE))
        self.period = chunk_s / self.speed
        self.timer = self.create_timer(self.period, self.publish_next)
        self.get_logger().info(f"playing {path}: {len(samples) / self.rate:.1f} s at {self.rate} Hz")

    def publish_next(self) -> None:
        """Every chunk whose last sample is due by now (the timer ticks once a chunk, but a short
        chunk, a rounded one, a loop's last, must not cost a whole tick: the stamps, counted in
        samples, drifted behind the clock, 1 s in 6 s of a short file looped)."""
        clock = self.get_clock()
        now = clock.now().nanoseconds * 1e-9
        if self.started_at is not None and now < self.last_now - 1.0:
            # a simulator's clock went back (a reset): the file's clock starts again from here
            self.get_logger().info(f"the clock went back {self.last_now - now:.1f} s: stamps start again from it")
            self.started_at = None
        elif self.started_at is not None and clock.ros_time_is_active and now > self.last_now + 1.0:
            # ... or leapt ahead (a bag seek): not a backlog to send in a burst
            self.get_logger().info(f"the clock leapt {now - self.last_now:.1f} s: stamps start again from it")
            self.started_at = None
        self.last_now = now
        if self.started_at is None and not self.start(now):
            return
        for _ in range(MAX_CATCH_UP):
            # due within TICK_JITTER_S: the ticks keep their own schedule, and one that read the clock
            # a few us earlier than the first (or a stepping /clock's rounding) held a chunk a tick
            if self.done or now + TICK_JITTER_S < self.started_at + self.due_after(self.next_chunk()):
                return
            self.publish_chunk()

    def start(self, now: float) -> bool:
        """Anchor the file's clock at `now` with its first chunk due, if it can start."""
        if self.publisher.get_subscription_count() < self.wait_for_subscribers:
            self.get_logger().info(f"waiting for {self.wait_for_subscribers} subscriber(s) on "
                                   f"{self.publisher.topic_name}", once=True)
            return False   # nobody listens yet: the file's clock starts with its first chunk
        first = len(self.next_chunk()) / self.rate
        if now < first:
            return False   # a simulator's clock just started: no chunk can have been captured before 0
        # as a driver stamps it: a chunk goes out once its last sample is captured, so the first
        # sample of the first one was captured a chunk's time ago (stamped t0, it arrived as its
        # audio would only begin). On the node's clock: a simulator's under use_sim_time, which
        # also paces this timer (on the wall clock, the loop node took every command as young)
        self.t0 = now - first
        self.sent_at_start = self.sent_samples
        self.started_at = now - first / self.speed
        return True

    def due_after(self, chunk: np.ndarray) -> float:
        """Seconds after started_at at which `chunk`, the next one, is due (its last sample captured)."""
        return (self.sent_samples - self.sent_at_start + len(chunk)) / self.rate / self.speed

    def next_chunk(self) -> np.ndarray:
        return self.chunks[self.index if self.index < len(self.chunks) else 0]

    def publish_chunk(self) -> None:
        if self.index >= len(self.chunks):
            if not self.loop:
                self.done = True
                self.timer.cancel()
                self.get_logger().info("finished playing")
                return
            self.index = 0
        header = Header(stamp=seconds_to_time(self.t0 + (self.sent_samples - self.sent_at_start) / self.rate),
                        frame_id=self.frame_id)
        chunk = self.chunks[self.index]
        self.publisher.publish(pcm_to_audio_chunk(chunk, self.rate, self.sample_format, header=header))
        self.index += 1
        self.sent_samples += len(chunk)
        if len(self.published_at) < len(self.chunks):
            self.published_at.append(time.monotonic())


def main(args=None) -> None:
    exit_on_help(args, __doc__, "photon_ros.wav_publisher", "wav_publisher")
    run_node(WavPublisher, args, until=lambda node: node.done)


if __name__ == "__main__":
    main()
