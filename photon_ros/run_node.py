"""The `main()` every node shares: init, construct, spin until Ctrl-C or shutdown, clean up.

Ctrl-C (SIGINT; SIGTERM alike) ends a node promptly, exit status 0, at any point of its life:
  - while its module is still importing (torch takes seconds) or before init_rclpy: the process
    ends at once (exit_on_ctrl_c, which a node module installs before its own imports when run as
    `python -m`, and the nodes/ scripts before importing it). Installed also over an inherited
    SIG_IGN (a node started in the background by a shell script): init_rclpy installs its
    handlers regardless, so a Ctrl-C 1 s in was ignored and the node ran on, one 2 s in was not;
  - while the node is made or spins: KeyboardInterrupt, the node is stopped and destroyed, rclpy
    shut down;
  - and when a thread is still running then (a model load given up: ManagedNode.destroy_node
    does not wait for it), the process exits without the interpreter's finalization, which
    stops such a daemon thread inside C++ code (torch) with "terminate called without an active
    exception" and SIGABRT (exit 134).
rclpy is imported where it is used, so that importing this module first costs nothing.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import time
from typing import Callable, NoReturn

HELP_FLAGS = ("-h", "--help")


def exit_now(code: int = 0) -> NoReturn:
    """End the process at once with `code`, stdout and stderr flushed, without the interpreter's
    finalization (see the module's docstring: a daemon thread in C++ code aborts it)."""
    try:
        if "logging" in sys.modules:
            sys.modules["logging"].shutdown()
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        import ctypes
        ctypes.CDLL(None).fflush(None)   # C stdio too (rcutils, native libraries)
    except Exception:  # noqa: BLE001 - a closed pipe must not keep the process alive
        pass
    os._exit(code)


def _exit_at_once(signum, frame) -> None:
    exit_now(0)


def exit_on_ctrl_c() -> None:
    """Until init_rclpy: SIGINT and SIGTERM end the process at once with status 0 (nothing is
    running yet that needs stopping). Only in the main thread (signal handlers live there)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, _exit_at_once)
        signal.signal(signal.SIGTERM, _exit_at_once)


def exit_leaving_no_thread(code: int = 0) -> None:
    """Return when only the main thread is left (the interpreter may finalize); else end the
    process now with `code` (exit_now): a thread still running after the nodes were destroyed
    and rclpy shut down is one given up, and nothing more of it is wanted."""
    if any(t is not threading.main_thread() and t.is_alive() for t in threading.enumerate()):
        exit_now(code)


def help_requested(args: list[str] | None) -> bool:
    """Whether -h / --help is among the node's own arguments of `args` (sys.argv when None;
    args[0] is the program), not among its ROS arguments (--ros-args ... [--])."""
    argv = list(sys.argv if args is None else args)[1:]
    in_ros_args = False
    for arg in argv:
        if arg == "--ros-args":
            in_ros_args = True
        elif arg == "--" and in_ros_args:
            in_ros_args = False
        elif not in_ros_args and arg in HELP_FLAGS:
            return True
    return False


def usage(doc: str | None, module: str, node_name: str, options: str = "", more: str = "") -> str:
    """A node's --help: what it is (the first paragraph of its module's docstring), how to start it
    (`options`: its own, described in `more`), where its ROS arguments go and where its parameters
    are documented."""
    script = module.rsplit(".", 1)[-1]
    summary = " ".join((doc or "").strip().split("\n\n")[0].split())   # its first line cut a sentence
    opts = f"{options} " if options else ""
    return "\n".join([
        f"usage: python -m {module} {opts}[--ros-args ARGS...]",
        f"       ros2 run photon_ros {script} {opts}[--ros-args ARGS...]",
        "",
        *([summary, ""] if summary else []),
        *([more.rstrip(), ""] if more else []),
        f"Starts the ROS 2 node '{node_name}'. ROS arguments go after --ros-args, e.g.:",
        "  -p NAME:=VALUE         set a parameter",
        "  --params-file FILE     set parameters from a file (config/photon.yaml: one section per node)",
        "  -r __ns:=/NAMESPACE    run the node in a namespace",
        f"Its parameters are documented in config/photon.yaml (section /**/{node_name}) and, while it",
        f"runs, by `ros2 param list /{node_name}` and `ros2 param describe /{node_name} NAME`.",
        "Ctrl-C stops it (exit status 0).",
    ]) + "\n"


def exit_on_help(args: list[str] | None, doc: str | None, module: str, node_name: str, options: str = "",
                 more: str = "") -> None:
    """Print usage() and exit 0 when -h / --help was given, before rclpy is started."""
    if help_requested(args):
        sys.stdout.write(usage(doc, module, node_name, options, more))
        sys.exit(0)


def init_rclpy(args=None) -> None:
    """rclpy.init without rclpy's own signal handlers: theirs shut the context down as Ctrl-C
    arrives, before a node's destroy_node could publish anything, so a loop node stopped mid-turn
    could not send its zero Twist and a base without a cmd_vel timeout kept turning. Here SIGINT
    (ros2 launch's Ctrl-C) and SIGTERM (its escalation) raise KeyboardInterrupt in the spinning
    thread, and the nodes are destroyed while the context still works."""
    import rclpy
    from rclpy.signals import SignalHandlerOptions

    rclpy.init(args=args, signal_handler_options=SignalHandlerOptions.NO)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.default_int_handler)


def make_executor(nodes: list, context=None):
    """A multi-threaded executor spinning `nodes`: a thread per core, plus one for each callback of
    theirs that may wait for seconds (`blocking_callbacks`: a vision node's infer service waiting on
    the engine, a managed node's transition loading a model or waiting for inference at cleanup).
    With a thread per core only, two robots' infer requests (bringup --namespaces on a 2-core
    computer) held both threads for as long as the model decoded: no lifecycle service, no
    /diagnostics, no goal or cancel and no timer (a loop node's turn and its zero Twist) ran meanwhile."""
    from rclpy.executors import MultiThreadedExecutor

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 2)
    blocking = sum(getattr(node, "blocking_callbacks", 0) for node in nodes)
    executor = MultiThreadedExecutor(num_threads=max(cores, 2) + blocking, context=context)
    for node in nodes:
        executor.add_node(node)
    return executor


def run_node(make_node: Callable[[], object], args=None, until: Callable[[object], bool] | None = None) -> None:
    """Spin the node made by `make_node` on a multi-threaded executor (the vision and speech nodes
    serve callbacks while their workers publish). `until(node)` ends the spin early when true.
    A node that cannot start (missing device, bad parameter) exits non-zero with its reason.
    Ctrl-C at any point (also during init or make_node) ends it with status 0."""
    import rclpy
    from rclpy.executors import ExternalShutdownException

    code, nodes, executor = 0, [], None
    try:
        init_rclpy(args)
        try:
            nodes.append(make_node())
        except Exception as err:  # noqa: BLE001 - report why the node cannot start
            print(f"{getattr(make_node, '__name__', 'node')}: {err}", file=sys.stderr)
            code = 1
        else:
            executor = make_executor(nodes)
            while rclpy.ok() and not (until and until(nodes[0])):
                executor.spin_once(timeout_sec=0.1)
    except (KeyboardInterrupt, ExternalShutdownException):
        pass
    finally:
        finish(executor, nodes)
    exit_leaving_no_thread(code)
    if code:
        sys.exit(code)


def finish(executor, nodes: list) -> None:
    """Stop and destroy `nodes` (stop_and_destroy; without an executor, destroy them) and shut
    rclpy down. A signal meanwhile cuts the destruction short, never the shutdown; after it a
    signal ends the process at once (exit_on_ctrl_c)."""
    import rclpy

    try:
        if executor is not None:
            stop_and_destroy(executor, nodes)
        else:
            for node in nodes:
                node.destroy_node()
    except KeyboardInterrupt:
        pass
    finally:
        exit_on_ctrl_c()
        rclpy.try_shutdown()


# How long the executor keeps spinning at shutdown for the goals the stop ended (their ends run on it).
SETTLE_S = 3.0
RESULT_FLUSH_S = 0.3


def settle(executor, nodes: list, timeout: float = SETTLE_S) -> None:
    """Spin until no node has a goal accepted and not ended (`pending_goals`), `timeout` at most: a
    goal's end (its result to the client) runs on the executor, and one queued when the executor
    stopped never ran: its client, without a timeout of its own, waited for ever."""
    def pending() -> bool:
        return any(getattr(node, "pending_goals", lambda: 0)() for node in nodes)

    if not pending():
        return
    deadline = time.monotonic() + timeout
    try:
        while pending() and time.monotonic() < deadline and executor.context.ok():
            executor.spin_once(timeout_sec=0.05)
        # the result's response to a client waiting for it is a task of its own, resumed once the
        # goal has ended: a few more turns send it
        flushed = min(deadline, time.monotonic() + RESULT_FLUSH_S)
        while time.monotonic() < flushed and executor.context.ok():
            executor.spin_once(timeout_sec=0.02)
    except KeyboardInterrupt:   # a second signal: no more waiting
        pass


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
    settle(executor, nodes)
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
    destroy them and shut rclpy down (several nodes in one process: bring-up, several microphones).
    A thread still running then (a model load given up) ends the process here (exit_leaving_no_thread)."""
    import rclpy
    from rclpy.executors import ExternalShutdownException

    executor = None
    try:
        executor = make_executor(nodes)
        while rclpy.ok():
            # (short waits: without rclpy's signal handler nothing wakes a wait at Ctrl-C; the
            # KeyboardInterrupt comes when the wait returns)
            executor.spin_once(timeout_sec=0.1)
    except (KeyboardInterrupt, ExternalShutdownException):
        pass
    finally:
        finish(executor, nodes)
    exit_leaving_no_thread(0)
    return 0
