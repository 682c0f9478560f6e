"""Is a node's input still giving results? Two things /diagnostics must say and a node cannot see
from its counters alone.

Lost in transport: messages a publisher sent that never reached the node's callback (dropped by
DDS, or by a shallow best-effort queue while the node was busy). Each publisher numbers its
messages (the DDS publication sequence number, in rclpy's MessageInfo), so a jump in one
publisher's numbers counts the messages lost between. Messages sent before the first one seen are
not counted: nothing can tell them from messages sent before the node subscribed.

Failing in a row: a node whose every input fails (a camera in an encoding it cannot convert, a
microphone in a format it refuses) must not report "running": after `FAILING_IN_A_ROW` failures
with no success between, its diagnostics turn ERROR with the last reason, until an input succeeds
or the node is configured again (reset).
"""
from __future__ import annotations

from typing import Any

FAILING_IN_A_ROW = 3


class InputHealth:
    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Start afresh, for a node configured again: its failures were those of the model and the
        subscription it had (a fixed one may never see another input to clear them), and a new
        subscription's first message from a publisher is no loss after the old one's last."""
        self.lost_in_transport = 0
        self.failed_in_a_row = 0
        self.last_error = ""
        self._last_sequence: dict[bytes, int] = {}   # publisher gid -> last sequence number seen

    def arrived(self, info: Any) -> int:
        """Note a message with its rclpy MessageInfo; returns how many of its publisher's messages
        were lost since the previous one seen (0 when the middleware gives no sequence numbers)."""
        sequence = info.get("publication_sequence_number") if info else None
        gid = (info.get("publisher_gid") or {}).get("data") if info else None
        if sequence is None or gid is None:
            return 0
        key = bytes(gid)
        previous = self._last_sequence.get(key)
        self._last_sequence[key] = max(sequence, previous or 0)
        lost = sequence - previous - 1 if previous is not None and sequence > previous + 1 else 0
        self.lost_in_transport += lost
        return lost

    def succeeded(self) -> None:
        self.failed_in_a_row = 0

    def failed(self, reason: str) -> None:
        self.failed_in_a_row += 1
        self.last_error = reason

    def failing(self, what: str) -> str:
        """Why the node's results have stopped ("" while they have not): `what` names the input."""
        if self.failed_in_a_row < FAILING_IN_A_ROW:
            return ""
        return f"the last {self.failed_in_a_row} {what} all failed (last: {self.last_error})"
