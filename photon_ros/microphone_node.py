"""Captures a microphone with `sounddevice` (PortAudio) and publishes AudioChunk on `audio`.

Optional: needs `pip install sounddevice` and the PortAudio library (`apt install libportaudio2`).
Without them, or without an input device, it says so and exits instead of publishing nothing.
A device that stops delivering later is reopened until it delivers again (after a failed try
PortAudio lists the devices anew: a USB microphone may come back under another card number, and a
device given by index is found again by its name, since its index may now be another device's);
/diagnostics says so, and counts the audio lost in the driver (overflows) and in a stalled
executor. Chunks are stamped with their capture time (PortAudio's, before the driver's buffering) on the node's clock (a
simulator's under use_sim_time), counted in samples (sample_clock); the audio itself is delivered
in real time whatever that clock does.
"""
from __future__ import annotations

if __name__ == "__main__":   # `python -m`: a Ctrl-C during the imports below (seconds) ends it at once
    from photon_ros.run_node import exit_on_ctrl_c
    exit_on_ctrl_c()

import queue
import re
import threading
import time

import numpy as np
from rclpy.clock import Clock, ClockType
from rclpy.node import Node
from rclpy.qos import QoSProfile, ReliabilityPolicy
from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus
from std_msgs.msg import Header

from photon_ros.diagnostics import publish_status
from photon_ros.params import NodeParams, Param
from photon_ros.run_node import exit_on_help, run_node
from photon_ros.audio_conversions import pcm_to_audio_chunk
from photon_ros.msg import AudioChunk
from photon_ros.result_messages import seconds_to_time
from photon_ros.sample_clock import SampleClock


def open_sounddevice():
    try:
        import sounddevice
    except (ImportError, OSError) as err:
        raise RuntimeError(f"sounddevice is not usable ({err}): `pip install sounddevice` and "
                           "`apt install libportaudio2`, or play a file with wav_publisher") from None
    return sounddevice


class DeviceParam(Param):
    """The `device` parameter: a name, or an index written as a number (`device: 2` in YAML,
    `-p device:=2`) as well as a string; a string parameter refused the number at startup."""

    def type_refusal(self, value: object) -> str:
        if isinstance(value, int) and not isinstance(value, bool):
            return "" if value >= 0 else f"must be a device name or an index >= 0, got {value}"
        return super().type_refusal(value)


def portaudio_device(value: str | int) -> str | int | None:
    """The device as sounddevice takes it: None (the default input) for "", an index for 2 or "2",
    else a name."""
    if isinstance(value, int):
        return value
    return int(value) if value.isdigit() else value or None


# Beyond this, a host API's capture times are taken as wrong (some report 0 for the ADC time, or
# times on another clock): no sound card holds a captured sample for half a second.
MAX_ADC_DELAY_S = 0.5


def adc_delay(time_info, duration: float) -> float | None:
    """Seconds between the capture of a block's last sample and its callback, from PortAudio's
    times (the first sample's ADC time against the callback's, on the stream's clock): the
    driver's and the sound card's buffering, tens of ms on USB microphones and sound servers,
    which a stamp taken at the callback put on every chunk as if the robot heard it later. None
    where this block's times are unusable (0, as some host APIs give now and then, or out of
    range): the caller keeps the last usable delay, since falling to 0 for a block moved its
    stamp by the whole delay and the next usable one moved it back."""
    adc = getattr(time_info, "inputBufferAdcTime", 0.0)
    current = getattr(time_info, "currentTime", 0.0)
    if not adc or not current:
        return None
    delay = current - adc - duration
    return delay if 0.0 <= delay <= MAX_ADC_DELAY_S else None


# The streams this process's microphone nodes hold open (bringup and the speech node's
# --microphones run several in one process): PortAudio restarts only while none is.
_OPEN_STREAMS: set = set()
_RESCAN = threading.Lock()


# The card and device numbers PortAudio's ALSA host API puts at the end of a device's name.
_ALSA_CARD = re.compile(r"\s*\(hw:\d+,\d+\)$")


def device_label(sd, index: int) -> str:
    """The name PortAudio gives device `index` ("" if it cannot say)."""
    try:
        return str(sd.query_devices(index)["name"])
    except Exception:  # noqa: BLE001 - a label is a nicety; the index still opens the device
        return ""


def rescan_devices(sd) -> bool:
    """Restarts PortAudio so that it lists the devices again; True if it did. It lists them once,
    when it starts: a USB microphone unplugged and back under another card number (another sound
    device enumerated meanwhile) is not in that list, and reopening it by name found a stale entry
    or none, every try, for good. A restart closes every stream of the process, so it waits until
    no other microphone node here holds one."""
    with _RESCAN:
        if _OPEN_STREAMS or not hasattr(sd, "_initialize"):
            return False
        if getattr(sd, "_initialized", 1):   # 0 after a restart whose start failed: only start it
            sd._terminate()
        sd._initialize()   # raises if PortAudio cannot start: the reopening fails and says why
        return True


# A simulator's clock (use_sim_time) runs at its real-time factor, 0.5-0.8 in a busy world, and in
# steps (gazebo_ros publishes /clock at 10 Hz). Stamps counted in real samples follow it by up to
# this part of each block, and at most SIM_MAX_SLEW_S: inside what the speech node takes as
# jitter, not lost audio (half a block, and vad.max_gap_s, 0.1 s by default). So they keep up with
# a world at 0.55-1.45 real time; one further off leaves the count behind or ahead, and each
# re-anchoring is a jump that cuts a command (at 0.25, a world at 0.6 cut every command). (On the
# wall clock, SampleClock's 1% keeps the joins exact; at 1% a simulator left the count 0.2 s off
# within seconds.)
SIM_SLEW = 0.45
# Blocks of nothing but zeros for this long: /diagnostics warns (muted, or a null source).
DIGITAL_SILENCE_WARN_S = 10.0
SIM_MAX_SLEW_S = 0.09
WALL_SLEW = 0.01


# All read once, when the audio stream opens.
MICROPHONE_PARAMS = [
    DeviceParam("device", "", "PortAudio input device, by name or index; empty: the default input",
                applies="restart"),
    Param("sample_rate", 16000, "Hz to capture at", low=4000, high=384000, applies="restart"),
    Param("channels", 1, "channels to capture (interleaved in each chunk)", low=1, high=64, applies="restart"),
    Param("frame_id", "microphone", "frame id of the audio chunks", applies="restart"),
    Param("chunk_ms", 100.0, "milliseconds of audio per chunk", low=1.0, high=1000.0, applies="restart"),
    Param("stall_s", 2.0, "no audio from the device for this long: the stream is reopened (a USB microphone "
          "unplugged and back, a sound server restarted) and /diagnostics says so", positive=True, applies="restart"),
]


class MicrophoneNode(Node):
    def __init__(self, **kwargs) -> None:
        super().__init__("microphone", **kwargs)
        p = NodeParams(self, MICROPHONE_PARAMS)
        self.rate, self.channels, self.frame_id = p["sample_rate"], p["channels"], p["frame_id"]
        self.block = max(1, int(self.rate * p["chunk_ms"] / 1000))
        self.stall_s = max(p["stall_s"], 3 * self.block / self.rate)
        self.sd = open_sounddevice()
        self.device = portaudio_device(p["device"])   # as configured
        self.open_device = self.device   # as PortAudio's list numbers it now (an index moves at a rescan)
        self.device_label = ""           # an index's device name, read when it first opened
        self.blocks: queue.Queue = queue.Queue(maxsize=100)
        self.clock = SampleClock(self.rate, slew=WALL_SLEW)
        self.delay = 0.0   # the last usable capture-to-callback delay (adc_delay)
        self.overflows = self.dropped = self.reopened = self.rescanned = 0
        self.tries = 0   # reopenings in this stall
        self.lost_seen = 0   # overflows + dropped at the last diagnostics
        self.stalled = ""   # why no audio comes now ("" while it does)
        self.zeros_since: float | None = None   # monotonic time since when every block was all 0
        self.publisher = self.create_publisher(AudioChunk, "audio", QoSProfile(
            depth=100, reliability=ReliabilityPolicy.RELIABLE))
        self.pub_diagnostics = self.create_publisher(DiagnosticArray, "/diagnostics", QoSProfile(
            depth=10, reliability=ReliabilityPolicy.RELIABLE))
        self.stream = self.open_stream()   # a device that cannot open now: the node exits with why
        self.last_block = self.last_try = time.monotonic()
        # On the steady clock, not the node's: under use_sim_time a simulator not started yet or
        # paused stopped these timers, and the audio (real time whatever the simulator does) piled
        # up unpublished and was dropped, with no /diagnostics to say so.
        steady = Clock(clock_type=ClockType.STEADY_TIME)
        self.create_timer(self.block / self.rate / 2, self.publish_pending, clock=steady)
        self.create_timer(0.5, self.watch, clock=steady)
        self.create_timer(1.0, self.publish_diagnostics, clock=steady)
        self.get_logger().info(f"capturing {self.stream.device} at {self.rate} Hz")

    def open_stream(self):
        # PortAudio calls back on its own thread; blocks are handed over and published from the executor.
        # Under _RESCAN: another microphone node's rescan_devices (its own executor thread) must not
        # restart PortAudio while this stream is being made and is not yet in _OPEN_STREAMS.
        with _RESCAN:
            stream = self.sd.InputStream(samplerate=self.rate, channels=self.channels, dtype="int16",
                                         blocksize=self.block, device=self.open_device, callback=self.on_block)
            try:
                stream.start()
            except BaseException:
                stream.close()   # opened but not started: its device stays held until closed
                raise
            _OPEN_STREAMS.add(stream)
        if isinstance(self.device, int) and not self.device_label:
            self.device_label = device_label(self.sd, self.open_device)
        return stream

    def reindexed(self) -> str | int | None:
        """The configured device in PortAudio's new list: an index names another device once the
        list changed (a device enumerated meanwhile), so it is found again by the name it had; a
        whole ALSA name as `python -m sounddevice` prints it ("USB mic: Audio (hw:2,0)") by that
        name without its card number (PortAudio matches names by their parts: the old number never
        matched again, and the robot stayed deaf)."""
        if isinstance(self.device, int):
            label = self.device_label
        else:
            label = self.device if isinstance(self.device, str) and _ALSA_CARD.search(self.device) else ""
        if not label:
            return self.device
        inputs = [(index, str(info["name"])) for index, info in enumerate(self.sd.query_devices())
                  if info["max_input_channels"] > 0]
        for index, name in inputs:
            if name == label:
                return index
        # ALSA's names end with the card number ("USB mic: Audio (hw:2,0)"), which is what a device
        # plugged back under another number changed: the same name without it, if only one has it
        same = [index for index, name in inputs if _ALSA_CARD.sub("", name) == _ALSA_CARD.sub("", label)]
        if len(same) == 1:
            return same[0]
        named = repr(label) if label == self.device else f"{label!r} (device {self.device})"
        if same:
            raise RuntimeError(f"{named} is not among the devices listed now, "
                               f"and {len(same)} devices of that name are: set device to the one to use")
        raise RuntimeError(f"{named} is not among the devices listed now")

    def close_stream(self) -> None:
        """Close the stream, once: none is left until a reopening succeeds (a closed one, kept
        after a reopening failed, was stopped and closed again at shutdown, and older
        sounddevice releases called PortAudio on the freed stream)."""
        stream, self.stream = self.stream, None
        if stream is None:
            return
        try:
            stream.close()
        finally:   # counted as open until closed: no PortAudio restart under a closing stream
            _OPEN_STREAMS.discard(stream)

    def on_block(self, data: np.ndarray, frames: int, time_info, status) -> None:
        overflow = bool(status and status.input_overflow)
        self.overflows += overflow
        self.last_block = time.monotonic()
        if data.any():
            self.zeros_since = None
        elif self.zeros_since is None:
            self.zeros_since = self.last_block
        delay = adc_delay(time_info, frames / self.rate)
        if delay is not None:
            self.delay = delay
        captured = self.capture_stamp(frames, overflow, self.delay)
        try:
            self.blocks.put_nowait((data.copy(), captured))
        except queue.Full:
            self.dropped += 1   # the executor is stalled; losing audio beats blocking the audio
            #                     thread (the next blocks' stamps still count these samples: the gap shows)

    def capture_stamp(self, frames: int, overflow: bool, delay: float = 0.0) -> float:
        """Stamp of a block of `frames` samples whose last sample was captured `delay` s before
        this call (adc_delay), on the node's clock: the
        simulator's under use_sim_time, as every other stamp the robot sees (the loop node reads a
        command's age against that clock: wall-clock stamps made every command young). 0, which
        readers take as unstamped, while that clock has no time yet (no /clock so far)."""
        clock = self.get_clock()
        # the delay comes off before the check: a simulator's clock just started (0.15 s) less 80 ms
        # of buffering and the block made a negative stamp, which rclpy's and rclcpp's Time refuse
        captured = clock.now().nanoseconds * 1e-9 - delay
        if captured <= frames / self.rate:
            self.clock.reanchor()   # the first block with a time anchors the count
            return 0.0
        sim = clock.ros_time_is_active
        self.clock.slew, self.clock.max_slew_s = (SIM_SLEW, SIM_MAX_SLEW_S) if sim else (WALL_SLEW, float("inf"))
        return self.clock.stamp(frames, captured, overflow=overflow)

    def publish_pending(self) -> None:
        while not self.blocks.empty():
            data, captured = self.blocks.get_nowait()
            header = Header(stamp=seconds_to_time(captured), frame_id=self.frame_id)
            self.publisher.publish(pcm_to_audio_chunk(data, self.rate, AudioChunk.FORMAT_S16LE, header))

    def watch(self) -> None:
        """A device that stops calling back (unplugged, its server gone, a driver error) is
        reopened every stall_s until it delivers again: a microphone that went quiet for good
        must not leave the robot deaf while everything looks fine."""
        now = time.monotonic()
        if self.stalled and self.last_block > self.last_try:   # a block came since the last reopening
            self.get_logger().info("audio is coming again")
            self.stalled = ""
            self.tries = 0
        silent = now - self.last_block
        if silent < self.stall_s or (self.stalled and now - self.last_try < self.stall_s):
            return
        self.stalled = f"no audio from {self.device_name()} for {silent:.1f} s"
        self.get_logger().error(f"{self.stalled}: reopening the stream", throttle_duration_sec=10.0)
        try:
            self.close_stream()
        except Exception:  # noqa: BLE001 - a dead stream may not close cleanly; a new one is what matters
            pass
        try:
            self.clock.reanchor()   # a new stream: its first block re-anchors (the stall shows as a jump)
            self.delay = 0.0        # and its own buffering
            # the first try opens what PortAudio listed; the next ones list the devices again
            if self.tries and rescan_devices(self.sd):
                self.rescanned += 1
                self.get_logger().info("listed the audio devices again")
                self.open_device = self.reindexed()
            self.tries += 1
            self.stream = self.open_stream()
            self.reopened += 1
        except Exception as err:  # noqa: BLE001 - the device may be absent for now: tried again later
            self.stalled += f" (reopening failed: {err})"
        # the next try after another stall_s; the stall ends only with a block (the reopening's
        # own time once did it, and the status said "capturing" with nothing captured)
        self.last_try = time.monotonic()

    def publish_diagnostics(self) -> None:
        level, message = (DiagnosticStatus.ERROR, self.stalled) if self.stalled else (DiagnosticStatus.OK, "capturing")
        lost = self.overflows + self.dropped
        if lost > self.lost_seen:   # in the last second
            self.get_logger().warning(f"audio lost: {self.overflows} driver overflow(s), {self.dropped} block(s) "
                                      "dropped by a stalled executor so far", throttle_duration_sec=10.0)
            if not self.stalled:
                level, message = DiagnosticStatus.WARN, "capturing; audio was lost in the last second (see the counters)"
        self.lost_seen = lost
        zeros_since = self.zeros_since
        if not self.stalled and zeros_since is not None and time.monotonic() - zeros_since >= DIGITAL_SILENCE_WARN_S:
            # a real microphone's noise is never exactly 0 for long: the robot hears nothing
            level = DiagnosticStatus.WARN
            message = (f"capturing digital silence (every sample 0) for {time.monotonic() - zeros_since:.0f} s: "
                       "the device is muted, or a sound server's null source stands in for it")
        status = DiagnosticStatus(level=level, message=message, hardware_id=self.device_name())
        values = {"sample_rate": str(self.rate), "channels": str(self.channels),
                  "input_overflows": str(self.overflows), "blocks_dropped_queue_full": str(self.dropped),
                  "stream_reopened": str(self.reopened), "device_list_rescanned": str(self.rescanned)}
        publish_status(self, self.pub_diagnostics, status, values)

    def device_name(self) -> str:
        """The device as the log and /diagnostics name it (index 0 is a device, not the default input)."""
        return "default input" if self.device is None else str(self.device)

    def destroy_node(self) -> None:
        if hasattr(self, "stream"):   # absent when the device failed to open in __init__
            if self.stream is not None:   # None: closed for a reopening that failed
                try:
                    self.stream.stop()     # its last callbacks have run when this returns
                finally:
                    self.close_stream()
            self.publish_pending()     # what was captured is sent, not lost at shutdown
        super().destroy_node()


def main(args=None) -> None:
    exit_on_help(args, __doc__, "photon_ros.microphone_node", "microphone")
    run_node(MicrophoneNode, args)


if __name__ == "__main__":
    main()
