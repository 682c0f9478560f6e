"""Real rclpy nodes over real DDS for tests: a private context, an executor on a thread."""
from __future__ import annotations

import signal
import subprocess
import threading
import time
from typing import Callable

import rclpy
from rclpy._rclpy_pybind11 import InvalidHandle
from rclpy.executors import ExternalShutdownException, MultiThreadedExecutor
from rclpy.node import Node


class RosGraph:
    """Owns an rclpy context; nodes added here are spun until close()."""

    def __init__(self) -> None:
        self.context = rclpy.Context()
        rclpy.init(context=self.context)
        self.executor = MultiThreadedExecutor(num_threads=4, context=self.context)
        self.nodes: list[Node] = []
        self._closing = False
        self._thread = threading.Thread(target=self._spin, daemon=True)
        self._thread.start()

    def _spin(self) -> None:
        while self.context.ok():
            try:
                self.executor.spin_once(timeout_sec=0.05)
            except (InvalidHandle, ExternalShutdownException):
                if self.context.ok() and not self._closing:   # close() destroys nodes under a spin_once
                    raise
                return
            except Exception:
                if self.context.ok():
                    raise
                return

    def node(self, name: str, **kwargs) -> Node:
        return self.add(Node(name, context=self.context, **kwargs))

    def add(self, node: Node) -> Node:
        self.nodes.append(node)
        self.executor.add_node(node)
        return node

    def close(self) -> None:
        self._closing = True
        for node in self.nodes:
            self.executor.remove_node(node)
            node.destroy_node()
        self.executor.shutdown()
        rclpy.shutdown(context=self.context)
        self._thread.join(timeout=5)


class ExecutorThread:
    """`executor` spun on a thread of its own, as run_node spins a process's nodes, until stop()."""

    def __init__(self, executor, context) -> None:
        self.executor, self.context = executor, context
        self._running = threading.Event()
        self._running.set()
        self._thread = threading.Thread(target=self._spin, daemon=True)
        self._thread.start()

    def _spin(self) -> None:
        while self._running.is_set() and self.context.ok():
            self.executor.spin_once(timeout_sec=0.05)

    def stop(self) -> None:
        self._running.clear()
        self._thread.join(timeout=10)


def wait_for(predicate: Callable[[], bool], timeout: float = 10.0, poll: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(poll)
    return predicate()


def wait_for_match(publisher, subscribers: int = 1, timeout: float = 10.0) -> None:
    """Block until DDS discovery has matched the publisher with its subscribers."""
    if not wait_for(lambda: publisher.get_subscription_count() >= subscribers, timeout):
        raise TimeoutError(f"{publisher.topic_name}: no subscriber matched within {timeout} s")


def interrupt(proc: subprocess.Popen, timeout: float = 15.0) -> None:
    """Stop a node's process as Ctrl-C does (SIGINT), killing it if it has not exited in `timeout`."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
