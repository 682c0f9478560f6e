"""A one-frame mailbox between a camera callback and the inference worker: the newest frame wins.

A robot acts on what it sees now. Frames that arrive while the model is busy replace the waiting
one and are counted as dropped, so memory stays at one frame however fast the camera is.
"""
from __future__ import annotations

import threading
import time
from typing import Any, NamedTuple


class Frame(NamedTuple):
    msg: Any               # sensor_msgs/Image or CompressedImage, unconverted (conversion is the worker's job)
    received_at: float     # time.monotonic() at arrival: latency is measured from here
    extra: Any = None      # what travels with the frame (the vision node: its depth pairing)
    epoch: int | None = None   # the activation that admitted it: processed and published in that one only


class LatestFrame:
    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._waiting: Frame | None = None
        self.latest: Frame | None = None    # kept after take(), for on-demand requests
        self.received = 0
        self.dropped = 0
        self.taken = 0       # received == taken + dropped, plus one while a frame waits

    def put(self, msg: Any, extra: Any = None, epoch: int | None = None) -> None:
        frame = Frame(msg, time.monotonic(), extra, epoch)
        with self._cond:
            if self._waiting is not None:
                self.dropped += 1
            self._waiting = self.latest = frame
            self.received += 1
            self._cond.notify()

    def take(self, timeout: float | None = None) -> Frame | None:
        """The newest frame not yet taken, waiting up to `timeout` for one."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._waiting is not None, timeout):
                return None
            frame, self._waiting = self._waiting, None
            self.taken += 1
            return frame
