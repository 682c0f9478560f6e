"""The `main()` every node shares: init, construct, spin until Ctrl-C or shutdown, clean up."""
from __future__ import annotations

import signal
import sys
from typing import Callable

import rclpy
from rclpy.executors import ExternalShutdownException, MultiThreadedExecutor
from rclpy.signals import SignalHandlerOptions


def init_rclpy(args=None) -> None:
    """rclpy.init without rclpy's own signal handlers: theirs shut the context down as Ctrl-C
    arrives, before a node's destroy_node could publish anything, so a loop node stopped mid-turn
    could not send its zero Twist and a base without a cmd_vel timeout kept turning. Here SIGINT
    (ros2 launch's Ctrl-C) and SIGTERM (its escalation) raise KeyboardInterrupt in the spinning
    thread, and the nodes are destroyed while the context still works."""
    rclpy.init(args=args, signal_handler_options=SignalHandlerOptions.NO)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.default_int_handler)


def run_node(make_node: Callable[[], object], args=None, until: Callable[[object], bool] | None = None) -> None:
    """Spin the node made by `make_node` on a multi-threaded executor (the vision and speech nodes
    serve callbacks while their workers publish). `until(node)` ends the spin early when true.
    A node that cannot start (missing device, bad parameter) exits non-zero with its reason."""
    init_rclpy(args)
    try:
        node = make_node()
    except Exception as err:  # noqa: BLE001 - report why the node cannot start
        print(f"{getattr(make_node, '__name__', 'node')}: {err}", file=sys.stderr)
        rclpy.try_shutdown()
        sys.exit(1)
    executor = MultiThreadedExecutor()
    try:
        executor.add_node(node)
        while rclpy.ok() and not (until and until(node)):
            executor.spin_once(timeout_sec=0.1)
    except (KeyboardInterrupt, ExternalShutdownException):
        pass
    finally:
        stop_and_destroy(executor, [node])
        rclpy.try_shutdown()


def stop_and_destroy(executor, nodes: list) -> None:
    """Shut `nodes` down in the order a robot needs: each told to stop first (a loop node mid-turn
    sends its zero Twist now; waiting goals and workers end), then the executor waits for the
    callbacks still running (an inference may take seconds), then the nodes are destroyed. A second
    signal meanwhile (ros2 launch's SIGTERM) cuts the wait short, never the destruction."""
    for node in nodes:
        stop = getattr(node, "stop_for_shutdown", None)
        try:
            if stop is not None:
                stop()
        except Exception as err:  # noqa: BLE001 - one node's failing stop must not skip the others' destruction
            print(f"{node.get_name()}: stopping failed ({type(err).__name__}: {err})", file=sys.stderr)
        except KeyboardInterrupt:
            pass
    try:
        executor.shutdown()
    except KeyboardInterrupt:
        pass
    for node in nodes:
        try:
            node.destroy_node()
        except KeyboardInterrupt:   # a signal mid-way: the other nodes are still destroyed
            pass
def spin_nodes(nodes: list) -> int:
    """Spin already-made `nodes` on one multi-threaded executor until Ctrl-C or shutdown, then
    destroy them and shut rclpy down (several nodes in one process: bring-up, several microphones)."""
    executor = MultiThreadedExecutor()
    try:
        for node in nodes:
            executor.add_node(node)
        while rclpy.ok():
            # (short waits: without rclpy's signal handler nothing wakes a wait at Ctrl-C; the
            # KeyboardInterrupt comes when the wait returns)
            executor.spin_once(timeout_sec=0.1)
    except (KeyboardInterrupt, ExternalShutdownException):
        pass
    finally:
        stop_and_destroy(executor, nodes)
        rclpy.try_shutdown()
    return 0
