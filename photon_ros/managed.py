"""What the vision and speech nodes share as managed (lifecycle) nodes.

    unconfigured --configure--> inactive --activate--> active
         ^                        |  ^                   |
         +--------cleanup---------+  +----deactivate-----+

configure  reads the model parameters, creates the topics (lifecycle publishers, the input
           subscription) and loads the model through the process's shared engine cache; on
           failure the reason is logged and kept (`model_error`), nothing is held and the node
           stays unconfigured, so a later configure (after fixing the `model` parameter) retries.
activate   input is taken in and processed, results are published.
deactivate input is ignored (counted), no new inference starts, what was waiting is dropped and
           nothing computed from before is published any more; the model stays loaded, so
           activate resumes at once.
cleanup    waits for inference in flight, removes the topics and releases the model: the last
           node to release an engine frees its memory.

The input subscriptions exist from configure to cleanup and are gated by activation rather than
created at activate: a subscription made at activate must first be matched by every publisher
(DDS discovery), and what is sent in that window is lost without a trace, such as the first words
of a command spoken right after activation. The price is that an inactive node still receives
(and drops) its input; cleanup removes even that.

With the `autostart` parameter (default true) a node configures and activates itself from its
worker thread, so it is up at once and reports "loading" while the model loads, as an unmanaged
node did; input that arrives meanwhile waits for the model. With autostart false it waits,
unconfigured, for a lifecycle manager (nav2_lifecycle_manager, `ros2 lifecycle set`), and holds
a bond with it while active (photon_ros.lifecycle_bond: nav2's manager fails a bringup without one).
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rcl_interfaces.msg import ParameterDescriptor
from rclpy.event_handler import SubscriptionEventCallbacks
from rclpy.lifecycle import LifecycleNode, LifecycleState, TransitionCallbackReturn

from photon_core.runtime.shared_models import SharedModel, release
from photon_ros.lifecycle_bond import Heartbeat, status_type

SUCCESS, FAILURE = TransitionCallbackReturn.SUCCESS, TransitionCallbackReturn.FAILURE
# How long cleanup waits for an inference in flight before releasing the model anyway (its
# memory is then freed when that inference ends).
IDLE_TIMEOUT_S = 60.0


class Activity:
    """Which input a node takes in, which work it starts, and which results it publishes, across
    activations. Each activation has its own number (epoch): work carries the epoch it began in,
    and its results are published only while that activation lasts. stop() takes the same lock
    as admitting() and publishing(), so once stop() returns nothing more is admitted or published
    until the next start()."""

    def __init__(self, admitting: bool = False) -> None:
        self._cond = threading.Condition()
        self._admitting = admitting   # autostart: input waits for the model while it loads
        self._running = False
        self._epoch = 0
        self._busy = 0
        self._enders: list[Callable[[], None]] = []   # of the work in flight (work()'s `end`)

    def start(self) -> None:
        with self._cond:
            if not self._running:
                self._epoch += 1
            self._admitting = self._running = True
            self._cond.notify_all()

    def stop(self) -> None:
        with self._cond:
            self._admitting = self._running = False
            self._cond.notify_all()
            enders = list(self._enders)
        for end in enders:   # (outside the lock: an end takes its own)
            end()

    @property
    def running(self) -> bool:
        with self._cond:
            return self._running

    def wait_running(self, timeout: float) -> int | None:
        """The current epoch once running (waiting up to `timeout`), else None."""
        with self._cond:
            return self._epoch if self._cond.wait_for(lambda: self._running, timeout) else None

    @contextmanager
    def admitting(self) -> Iterator[bool]:
        """Whether input is taken in now. stop() waits for the block, so input admitted here is
        in place before the caller of stop() clears what was waiting."""
        with self._cond:
            yield self._admitting

    @contextmanager
    def work(self, epoch: int | None = None, end: Callable[[], None] | None = None) -> Iterator[bool]:
        """Whether work may run: the node is running (in `epoch`, when given). While the block
        lasts the work counts as in flight, and wait_idle() waits for it. `end` tells the work to
        end early, and stop() calls it: work that stops only at an event of its own (a goal's
        decode) would otherwise hold cleanup's wait_idle() until it ran out, for a result that is
        not given."""
        with self._cond:
            admitted = self._running and epoch in (None, self._epoch)
            self._busy += admitted
            if admitted and end is not None:
                self._enders.append(end)
        try:
            yield admitted
        finally:
            if admitted:
                with self._cond:
                    self._busy -= 1
                    if end is not None:
                        self._enders.remove(end)
                    self._cond.notify_all()

    @contextmanager
    def publishing(self, epoch: int) -> Iterator[bool]:
        """Whether results of work begun in `epoch` may be published; stop() waits for the block."""
        with self._cond:
            yield self._running and self._epoch == epoch

    def current(self) -> int | None:
        """The running activation's epoch (None while not running): work begun in it may compare
        later whether it still runs (current() == its epoch)."""
        with self._cond:
            return self._epoch if self._running else None

    def wait_idle(self, timeout: float) -> bool:
        """Wait until no work is in flight; False if some still was after `timeout`."""
        with self._cond:
            return self._cond.wait_for(lambda: self._busy == 0, timeout)


class ManagedNode(LifecycleNode):
    """Base of the vision and speech nodes. Subclasses declare a `model` parameter and provide
    create_interfaces / destroy_interfaces (topics), load_engine (the model, checked and warmed
    up), drop_pending (input waiting at deactivation) and work (the worker's loop), then call
    start_worker() at the end of their __init__."""

    kind = "model"   # "vision" / "speech", for log lines
    # Callbacks that may hold an executor thread for seconds (run_node.make_executor adds a thread
    # for each): a transition served by the lifecycle service (configure loads the model, cleanup
    # waits for inference in flight).
    blocking_callbacks = 1

    def __init__(self, node_name: str, **kwargs) -> None:
        super().__init__(node_name, **kwargs)
        # read once, at start: a live change would be accepted and do nothing
        self.autostart = self.declare_parameter("autostart", True, ParameterDescriptor(
            description="configure and activate at start; false: wait for a lifecycle manager",
            read_only=True)).value
        self.activity = Activity(admitting=self.autostart)
        self.engine: SharedModel | None = None
        self.model_error: str | None = None
        self.loading = self.autostart   # diagnostics and the infer service say "loading" until it ends
        self.stopping = threading.Event()
        self.worker: threading.Thread | None = None
        self.last_input_at: float | None = None   # monotonic arrival of the newest input (frame, chunk)
        self.incompatible_qos = ""   # the last publisher QoS an input subscription could not match, and why
        self.heartbeat: Heartbeat | None = None   # the bond with a lifecycle manager, while active

    def input_arrived(self) -> None:
        self.last_input_at = time.monotonic()

    def input_silence(self) -> float | None:
        """Seconds since the newest input arrived (None: none yet), for health()'s timeout."""
        return None if self.last_input_at is None else time.monotonic() - self.last_input_at

    def qos_events(self, topic: str, lost: str) -> SubscriptionEventCallbacks:
        """Event callbacks for the input subscription on `topic`: a publisher whose QoS it cannot
        match (rclpy logs that once) is logged again and kept in incompatible_qos for /diagnostics,
        saying what is lost ("its images never arrive")."""
        def incompatible(event) -> None:
            policy = getattr(event.last_policy_kind, "name", str(event.last_policy_kind))
            policy = policy.removeprefix("RMW_QOS_POLICY_")   # RELIABILITY, DURABILITY, ...
            self.incompatible_qos = (f"a publisher on {self.resolve_topic_name(topic)} offers QoS this node "
                                     f"cannot match ({policy}); {lost}")
            self.get_logger().warning(self.incompatible_qos, throttle_duration_sec=30.0)
        return SubscriptionEventCallbacks(incompatible_qos=incompatible)

    def start_worker(self) -> None:
        self.worker = threading.Thread(target=self._worker_main, daemon=True)
        self.worker.start()

    def _worker_main(self) -> None:
        if self.autostart and not self._start_itself():
            # nothing will process what arrives: stop taking it in, and forget what came during the
            # load (a manager's later configure would publish speech heard before it, as new)
            self.pause()
        self.work()

    def _start_itself(self) -> bool:
        # The model loads here, not in the constructor: the node is up (and says "loading") at once.
        return (self.trigger_configure() == SUCCESS and not self.stopping.is_set()
                and self.trigger_activate() == SUCCESS)

    def lifecycle_state(self) -> str:
        """The label of the current state ("unconfigured", "configuring", "inactive", "active",
        ...). rclpy keeps it only in its state machine, which has no public getter."""
        return self._state_machine.current_state[1]

    def why_not_running(self) -> str:
        """Why a request cannot be served now (for a node that is not active)."""
        if self.engine is None:
            reason = self.model_error or ("still loading" if self.loading else f"the node is {self.lifecycle_state()}")
            return f"model not loaded: {reason}"
        return "node is not active"

    # --- transitions ----------------------------------------------------------------------------
    def on_configure(self, state: LifecycleState) -> TransitionCallbackReturn:
        self.loading, self.model_error = True, None
        self.model_name = self.get_parameter("model").value
        try:
            self.create_interfaces()
            self.engine = self.load_engine()
        except Exception as err:  # noqa: BLE001 - the node stays up, unconfigured, and says why
            self.model_error = f"{type(err).__name__}: {err}"
            self.get_logger().error(f"cannot load {self.kind} model {self.model_name!r}: {self.model_error}")
            self.destroy_interfaces()
            return FAILURE
        finally:
            self.loading = False
        return SUCCESS

    def on_activate(self, state: LifecycleState) -> TransitionCallbackReturn:
        result = super().on_activate(state)   # the lifecycle publishers publish from here on
        self.activity.start()
        self.start_bond()
        return result

    def on_deactivate(self, state: LifecycleState) -> TransitionCallbackReturn:
        self.pause()
        return super().on_deactivate(state)

    def on_cleanup(self, state: LifecycleState) -> TransitionCallbackReturn:
        self.unload()
        return super().on_cleanup(state)

    def on_shutdown(self, state: LifecycleState) -> TransitionCallbackReturn:
        self.pause()
        self.unload()
        return SUCCESS

    def on_error(self, state: LifecycleState) -> TransitionCallbackReturn:
        # A transition raised: rclpy goes to unconfigured on SUCCESS, so hold nothing there.
        self.pause()
        self.unload()
        return SUCCESS

    def pause(self) -> None:
        self.end_bond()
        self.activity.stop()
        self.drop_pending()

    def start_bond(self) -> None:
        """Heartbeats to a lifecycle manager (photon_ros.lifecycle_bond) while active, as nav2's servers
        send them; not for a node that starts itself, which no manager drives."""
        if self.autostart:
            return
        status = status_type()
        if status is None:
            self.get_logger().info("the bond messages are not installed: no bond with a lifecycle "
                                   "manager (give nav2's lifecycle_manager bond_timeout: 0.0)", once=True)
            return
        self.end_bond()
        self.heartbeat = Heartbeat(self, status, self.get_name())

    def end_bond(self) -> None:
        heartbeat, self.heartbeat = getattr(self, "heartbeat", None), None
        if heartbeat is not None:
            heartbeat.end()

    def unload(self) -> None:
        self.release_engine()
        self.destroy_interfaces()

    def release_engine(self) -> None:
        """Give the model back once no work of this node uses it (an inference begun before
        deactivate may still be running)."""
        if not self.activity.wait_idle(IDLE_TIMEOUT_S):
            self.get_logger().warning(f"an inference still runs after {IDLE_TIMEOUT_S:g} s: releasing "
                                      "the model anyway (its memory is freed when that one ends)")
        engine, self.engine = self.engine, None
        if engine is not None:
            freed = release(engine)
            self.get_logger().info("model released" + ("" if freed else " (other nodes still use it)"))

    def stop_for_shutdown(self) -> None:
        """Tell the worker and every waiting request to end (run_node calls it first at shutdown:
        the executor waits for running callbacks, and a goal waiting for a frame ends only so)."""
        if hasattr(self, "stopping"):   # a constructor that failed made none
            self.stopping.set()
            self.activity.stop()
            self.end_bond()   # a manager watching it learns at once that this node is going

    def destroy_node(self) -> None:
        if not hasattr(self, "stopping"):   # its constructor failed (a bad parameter): nothing of ours
            super().destroy_node()
            return
        # The worker publishes: stop it before the publishers go away, then give the model back.
        # A worker still loading the model (a daemon) is not waited for: Ctrl-C during a long load
        # took a minute, and under ros2 launch ended in SIGKILL.
        self.stop_for_shutdown()
        if self.worker is not None:
            self.worker.join(timeout=2.0 if self.loading else 60)
        self.release_engine()
        super().destroy_node()

    # --- what each managed node provides (the vision and speech nodes do; a node class that
    # leaves one out fails at its first transition, naming the hook) -----------------------------
    def create_interfaces(self) -> None:
        """Create the node's subscriptions, publishers and services (at configure)."""
        raise NotImplementedError(f"{type(self).__name__} must define create_interfaces()")

    def destroy_interfaces(self) -> None:
        """Destroy what create_interfaces made (at cleanup)."""
        raise NotImplementedError(f"{type(self).__name__} must define destroy_interfaces()")

    def load_engine(self) -> SharedModel:
        """Load (hold) the model through the shared engine cache (at configure)."""
        raise NotImplementedError(f"{type(self).__name__} must define load_engine()")

    def drop_pending(self) -> None:
        """Forget queued input at deactivate, so nothing begun before it is published after."""
        raise NotImplementedError(f"{type(self).__name__} must define drop_pending()")

    def work(self) -> None:
        """The worker loop: process input while active (runs on the node's worker thread)."""
        raise NotImplementedError(f"{type(self).__name__} must define work()")


def health(state: str, loading: bool, model_error: str | None, received: int, inputs: str,
           silent_s: float | None = None, timeout_s: float = 0.0) -> tuple[bytes, str]:
    """The /diagnostics level and message of a node in lifecycle `state` that takes `inputs`
    ("images", "audio"). Not processing by a manager's choice (unconfigured, inactive) is OK, not
    a warning. `silent_s`: seconds since the last input arrived (None: none yet); beyond
    `timeout_s` (0: never) a source that stopped is a warning, not "running"."""
    from diagnostic_msgs.msg import DiagnosticStatus

    if model_error:
        return DiagnosticStatus.ERROR, f"model failed to load: {model_error}"
    if loading:
        return DiagnosticStatus.WARN, "loading model"
    if state == "unconfigured":
        return DiagnosticStatus.OK, "unconfigured: no model loaded"
    if state == "inactive":
        return DiagnosticStatus.OK, f"inactive: the model is loaded, {inputs} are not processed"
    if state != "active":
        return DiagnosticStatus.OK, state
    if received == 0:
        return DiagnosticStatus.WARN, f"no {inputs} received"
    if timeout_s > 0 and silent_s is not None and silent_s > timeout_s:
        return DiagnosticStatus.WARN, f"no {inputs} for {silent_s:.0f} s: has the source stopped?"
    return DiagnosticStatus.OK, "running"


def ready_or_released(engine: SharedModel, prepare: Callable[[SharedModel], None]) -> SharedModel:
    """`engine` once `prepare(engine)` (checks, warm-up) has passed; if it raises, the hold on the
    engine is given back first, so a failed configure holds nothing."""
    try:
        prepare(engine)
    except BaseException:
        release(engine)
        raise
    return engine
