"""One node's status on /diagnostics, as every photon_ros node publishes it: named
"photon_ros: <the node's fully qualified name>" (so robots in namespaces stay apart), its counters
as key/value pairs, stamped now."""
from __future__ import annotations

from typing import Any

from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus, KeyValue
from std_msgs.msg import Header


def publish_status(node: Any, publisher: Any, status: DiagnosticStatus, values: dict[str, str]) -> None:
    status.name = f"photon_ros: {node.get_fully_qualified_name()}"
    status.values = [KeyValue(key=k, value=v) for k, v in values.items()]
    publisher.publish(DiagnosticArray(header=Header(stamp=node.get_clock().now().to_msg()), status=[status]))
