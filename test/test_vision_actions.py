"""The vision node's actions over DDS: find (detect / point) and ask (query / caption) with feedback
while the model decodes, results like the topics', a cancel that stops the decode at once and frees
the engine for the next goal, a timeout, and refusals. The tests' small random Moondream checkpoint."""
import time

import numpy as np
import pytest
from action_msgs.msg import GoalStatus
from rclpy.action import ActionClient
from rclpy.node import Node
from rclpy.qos import QoSProfile, ReliabilityPolicy
from sensor_msgs.msg import Image

from moondream_fixtures import checkpoint
from photon_ros.action import Ask, Find
from photon_ros.image_conversions import rgb_to_image
from photon_ros.vision_node import VisionNode
from rclpy.parameter import Parameter
from ros_harness import ExecutorThread, RosGraph, wait_for, wait_for_match

RELIABLE = QoSProfile(depth=10, reliability=ReliabilityPolicy.RELIABLE)


@pytest.fixture
def graph():
    g = RosGraph()
    yield g
    g.close()


def send(client, goal, feedback: list):
    """The goal handle (accepted or not) of `goal`, its feedback collected into `feedback`."""
    future = client.send_goal_async(goal, feedback_callback=lambda f: feedback.append(f.feedback))
    assert wait_for(future.done, timeout=30)
    return future.result()


def bare_actions():
    """VisionActions' logic without its action servers (tests set the node they need)."""
    import threading

    from photon_ros.vision_actions import VisionActions
    actions = VisionActions.__new__(VisionActions)
    actions._cancels, actions._lock, actions._early = {}, threading.Lock(), set()
    actions._workers, actions._open, actions.stopping, actions._canceled = set(), set(), False, set()
    return actions


def outcome(handle, timeout=120):
    future = handle.get_result_async()
    assert wait_for(future.done, timeout=timeout)
    return future.result()


def action_clients(graph) -> tuple[Node, ActionClient, ActionClient]:
    """Clients of find and ask on a node of their own, made before it joins the spinning executor
    (see test_vision_reasoning), once both servers are there."""
    client_node = Node("client", context=graph.context)
    find, ask = ActionClient(client_node, Find, "find"), ActionClient(client_node, Ask, "ask")
    graph.add(client_node)
    assert find.wait_for_server(timeout_sec=30) and ask.wait_for_server(timeout_sec=30)
    return client_node, find, ask


def test_find_and_ask_with_feedback_cancel_and_timeout(graph):
    node = graph.add(VisionNode(context=graph.context, parameter_overrides=[
        Parameter("model", value=str(checkpoint())), Parameter("max_objects", value=3),
        Parameter("max_frame_age_s", value=600.0)]))
    assert wait_for(lambda: node.engine is not None or node.model_error, timeout=120), node.model_error
    client_node, find, ask = action_clients(graph)
    camera = graph.node("camera").create_publisher(Image, "image", RELIABLE)
    wait_for_match(camera)

    # The next frame: the goal waits for it.
    feedback = []
    future = find.send_goal_async(Find.Goal(task="detect", prompt="cup", use_latest_frame=False, timeout_s=60.0),
                                  feedback_callback=lambda f: feedback.append(f.feedback))
    assert wait_for(future.done, timeout=30) and future.result().accepted
    assert wait_for(lambda: any(f.state == Find.Feedback.STATE_WAITING_FOR_FRAME for f in feedback), timeout=10)
    frame = np.random.default_rng(1).integers(0, 256, (96, 128, 3), dtype=np.uint8)
    camera.publish(rgb_to_image(frame))
    done = outcome(future.result())
    assert done.status == GoalStatus.STATUS_SUCCEEDED and done.result.success, done.result.message
    found = done.result.detections.detections
    assert len(found) == 3 and done.result.detections.prompt == "cup"
    # Feedback as the objects came: 1, 2, 3 found, each with the objects so far.
    counts = [f.objects_found for f in feedback if f.state == Find.Feedback.STATE_DECODING and f.objects_found]
    assert counts == [1, 2, 3]
    last = [f for f in feedback if f.objects_found == 3][-1].detections.detections
    assert [(d.x_min, d.y_max) for d in last] == [(d.x_min, d.y_max) for d in found]
    # Each feedback's Detections is the frame's (its header) and its latency says what the field
    # says, image received -> these objects found: more than 0 s, growing, at most the result's.
    def seconds(d):
        return d.sec + d.nanosec * 1e-9
    so_far = [f.detections for f in feedback if f.state == Find.Feedback.STATE_DECODING and f.objects_found]
    assert all(d.header == done.result.detections.header for d in so_far)
    waited = [seconds(d.latency) for d in so_far] + [seconds(done.result.detections.latency)]
    assert waited[0] > 0 and waited == sorted(waited), waited

    # ask: the answer's text streamed as feedback, each longer, the last one the answer.
    texts = []
    handle = send(ask, Ask.Goal(task="query", prompt="What is this?", use_latest_frame=True, max_tokens=12), texts)
    done = outcome(handle)
    assert done.status == GoalStatus.STATUS_SUCCEEDED and done.result.text.text
    streamed = [f.text for f in texts if f.state == Ask.Feedback.STATE_DECODING and f.text]
    assert streamed and streamed[-1] == done.result.text.text
    assert all(b.startswith(a) for a, b in zip(streamed, streamed[1:]))

    # A caption of the default length says which length that was (as the caption topic does).
    done = outcome(send(ask, Ask.Goal(task="caption", prompt="", use_latest_frame=True, max_tokens=2), []))
    assert done.status == GoalStatus.STATUS_SUCCEEDED and done.result.text.prompt == "short"
    assert done.result.text.task == "caption"

    # A cancel mid-decode stops it within a step; the next goal is served at once after it.
    texts = []
    handle = send(ask, Ask.Goal(task="query", prompt="Describe everything.", use_latest_frame=True,
                                max_tokens=2000), texts)
    assert wait_for(lambda: len([f for f in texts if f.text]) >= 3, timeout=60)
    steps_at_cancel = node.engine.batcher.sizes[:]
    cancel = handle.cancel_goal_async()
    assert wait_for(cancel.done, timeout=10)
    done = outcome(handle, timeout=30)
    assert done.status == GoalStatus.STATUS_CANCELED and not done.result.success
    assert len(done.result.text.text) < len(texts[-1].text) + 200          # not decoded on to 2000 tokens
    handle = send(find, Find.Goal(task="point", prompt="dog", use_latest_frame=True), [])
    done = outcome(handle, timeout=60)
    assert done.status == GoalStatus.STATUS_SUCCEEDED and len(done.result.points.points) == 3
    assert node.engine.batcher.sizes[len(steps_at_cancel):] == [1, 1]      # the canceled goal's batch, then this one

    # A timeout ends the goal aborted, with the reason; bad goals are refused.
    handle = send(find, Find.Goal(task="detect", prompt="cup", use_latest_frame=False, timeout_s=0.3), [])
    done = outcome(handle, timeout=30)
    assert done.status == GoalStatus.STATUS_ABORTED and "no frame arrived" in done.result.message
    # ... and one waiting behind other work on the engine (another camera's batch holds its lock)
    # ends at its timeout, not once the engine is free
    with node.engine.lock:
        handle = send(find, Find.Goal(task="point", prompt="dog", use_latest_frame=True, timeout_s=0.5), [])
        done = outcome(handle, timeout=30)
    assert done.status == GoalStatus.STATUS_ABORTED and "timed out" in done.result.message
    failed = node.requests_failed
    assert not send(find, Find.Goal(task="caption", prompt="x"), []).accepted
    assert not send(find, Find.Goal(task="segment", prompt="cup"), []).accepted   # Moondream 2 has none
    assert "cannot segment" in node.last_request_error
    assert not send(ask, Ask.Goal(task="query", prompt="  "), []).accepted
    # refused goals are counted on /diagnostics as infer's refusals are
    assert node.requests_failed == failed + 3 and node.last_request_error == "ask goal: an empty prompt"

    # A goal waiting for the next frame without a timeout ends with the activation (it held up
    # deactivate's cleanup and the process's shutdown for good); a goal decoding when the node is
    # deactivated gives no result (as the topics give none).
    handle = send(find, Find.Goal(task="detect", prompt="cup", use_latest_frame=False, timeout_s=0.0), [])
    time.sleep(0.3)
    node.trigger_deactivate()
    done = outcome(handle, timeout=30)
    assert done.status == GoalStatus.STATUS_ABORTED and "deactivated" in done.result.message
    from photon_ros.srv import Infer
    infer = client_node.create_client(Infer, "infer")
    assert infer.wait_for_service(timeout_sec=10)

    def deactivated_while(start):
        """start() a request on a fresh frame of a new activation, the model held up, and
        deactivate the node meanwhile; what start() gave."""
        node.trigger_activate()
        camera.publish(rgb_to_image(frame))
        assert wait_for(lambda: node.frames.latest is not None, timeout=10)
        with node.engine.lock:
            started = start()
            time.sleep(0.3)
            node.trigger_deactivate()
        return started
    handle = deactivated_while(lambda: send(find, Find.Goal(task="detect", prompt="cup", use_latest_frame=True), []))
    done = outcome(handle, timeout=60)
    assert done.status == GoalStatus.STATUS_ABORTED and "deactivated while the goal ran" in done.result.message
    assert not done.result.detections.detections and done.result.detections.header.stamp.sec == 0   # none given
    future = deactivated_while(lambda: infer.call_async(Infer.Request(task="detect", prompt="cup", use_latest_frame=True)))
    assert wait_for(future.done, timeout=60)
    assert not future.result().success and "deactivated while the request ran" in future.result().message


class _Handle:
    """A goal handle canceled between its acceptance and its execution (rclpy answers the goal,
    then schedules execute: a cancel can land between the two)."""

    def __init__(self, goal):
        self.request, self.is_cancel_requested, self.ended = goal, True, None
        self.goal_id = type("Id", (), {"uuid": bytes(16)})()

    def succeed(self):
        self.ended = "succeeded"

    def canceled(self):
        self.ended = "canceled"

    def abort(self):
        self.ended = "aborted"

    def publish_feedback(self, feedback):
        pass


class _MarkedLate(_Handle):
    """A goal handle as rclpy keeps it: a cancel accepted by on_cancel marks the goal CANCELING
    only after on_cancel returns; here once `accepted` and looked at twice, as if that transition
    landed while the goal's end waited for it."""

    def __init__(self, goal):
        super().__init__(goal)
        self.accepted, self.looks = False, 0

    @property
    def is_cancel_requested(self):
        if self.accepted:
            self.looks += 1
        return self.looks >= 2

    @is_cancel_requested.setter
    def is_cancel_requested(self, value):
        pass


def test_a_cancel_before_execute_stops_the_work_and_ends_the_goal_canceled():
    import contextlib
    import threading
    from types import SimpleNamespace

    from photon_ros.vision_actions import VisionActions

    actions = bare_actions()          # its logic, without action servers
    actions._cancels, actions._lock, actions._early = {}, threading.Lock(), set()
    actions.node = SimpleNamespace(activity=SimpleNamespace(work=lambda epoch=None, end=None: contextlib.nullcontext(True),
                                                            current=lambda: 1,
                                                            publishing=lambda epoch: contextlib.nullcontext(True)))
    seen = {}

    def run(goal_handle, goal, result, cancel, find, epoch=None):
        seen["canceled"] = cancel.is_set()
        result.success = True        # a decode that finished anyway
    actions.run = run
    handle = _Handle(Find.Goal(task="point", prompt="cup", timeout_s=0.0))
    actions.on_cancel(handle)        # before execute registered the goal: nothing to set yet
    result = actions.execute(handle, find=True)
    assert seen["canceled"] and handle.ended == "canceled" and not result.success and result.message == "canceled"
    # rclpy marks the goal CANCELING only after on_cancel returns: execute may not see it yet
    handle = _MarkedLate(Find.Goal(task="point", prompt="cup", timeout_s=0.0))
    actions.on_cancel(handle)
    handle.accepted = True
    seen.clear()
    actions.execute(handle, find=True)
    assert seen["canceled"] and not actions._early and handle.ended == "canceled"


def test_a_deactivate_after_the_goals_work_and_before_its_end_withholds_the_result():
    """The goal's work ends on its own thread and the executor ends the goal later (start): a
    deactivate in between withholds the result as one during the work does (a loop node would
    turn the robot on it). A cancel that came after the work is not kept."""
    import threading
    from types import SimpleNamespace

    from photon_ros.managed import Activity
    from photon_ros.vision_actions import VisionActions

    def goal(activity):
        actions = bare_actions()
        actions._cancels, actions._lock, actions._early, actions._workers = {}, threading.Lock(), set(), set()
        actions.node = SimpleNamespace(activity=activity)

        def run(goal_handle, goal, result, cancel, find, epoch=None):
            result.points.header.frame_id = "camera"
            result.success = True
        actions.run = run
        handle = _Handle(Find.Goal(task="point", prompt="cup", timeout_s=0.0))
        handle.is_cancel_requested = False
        ends = []
        handle.execute = ends.append   # the executor runs the end later
        actions.start(handle, find=True)
        assert wait_for(lambda: ends and not actions._workers, timeout=10)
        return actions, handle, ends[0]

    activity = Activity()
    activity.start()
    actions, handle, finish = goal(activity)
    result = finish(handle)
    assert handle.ended == "succeeded" and result.success and result.points.header.frame_id == "camera"

    actions, handle, finish = goal(activity)
    actions.on_cancel(handle)   # came after the work: nothing to stop
    activity.stop()             # deactivated before the executor ended the goal
    result = finish(handle)
    assert handle.ended == "aborted" and not result.success and "deactivated" in result.message
    assert not result.points.header.frame_id   # none of its results
    assert not actions._early


@pytest.mark.parametrize("timeout_s", [float("inf"), 1e30, float("nan"), -1.0])
def test_a_timeout_no_timer_can_take_is_refused(timeout_s):
    from photon_ros.vision_actions import VisionActions

    actions = bare_actions()
    actions.node = None
    assert "timeout_s" in actions.refusal("point", "cup", ("point",), timeout_s)


def test_goals_beyond_the_limit_are_refused_and_one_without_a_thread_ends_failed(monkeypatch):
    """Each goal at work is a thread holding its frame: a client sending goals in a loop grew them
    without bound. Past MAX_GOALS goals are refused; one whose thread cannot start is ended
    (aborted, with why) instead of staying accepted, and destroy() does not wait for that thread."""
    import contextlib
    import threading
    from types import SimpleNamespace

    from photon_ros import vision_actions
    from photon_ros.vision_actions import MAX_GOALS, VisionActions

    actions = bare_actions()
    actions._cancels, actions._lock, actions._early = {}, threading.Lock(), set()
    actions._workers = {threading.Thread() for _ in range(MAX_GOALS - 1)}
    actions.node = SimpleNamespace(lacks=lambda task: "", refused=lambda what, why: why,
                                   activity=SimpleNamespace(publishing=lambda epoch: contextlib.nullcontext(True)))
    assert actions.refusal("point", "cup", ("point",), 0.0) == ""
    actions._workers.add(threading.Thread())
    assert f"{MAX_GOALS} goals are at work" in actions.refusal("point", "cup", ("point",), 0.0)

    class NoThread(threading.Thread):
        def start(self):
            raise RuntimeError("can't start new thread")
    monkeypatch.setattr(vision_actions.threading, "Thread", NoThread)
    actions._workers = set()
    handle = _Handle(Find.Goal(task="point", prompt="cup", timeout_s=0.0))
    handle.is_cancel_requested = False
    handle.execute = lambda finish: finish(handle)
    actions.start(handle, find=True)
    assert handle.ended == "aborted" and not actions._workers


def test_goals_at_work_leave_the_executors_threads_free(graph):
    """run_node spins the node on a thread per core (2 on a 2-core robot computer). Goals waiting
    for the next frame, or decoding, must not hold those threads: held, the frame that ends the
    wait is never taken in, a cancel is never heard, and deactivate is never served."""
    import threading

    from rclpy.executors import MultiThreadedExecutor

    node = VisionNode(context=graph.context, parameter_overrides=[
        Parameter("model", value=str(checkpoint())), Parameter("max_objects", value=2),
        Parameter("max_frame_age_s", value=600.0), Parameter("reliability", value="reliable")])
    executor = MultiThreadedExecutor(num_threads=2, context=graph.context)   # as on a 2-core robot
    executor.add_node(node)
    spinner = ExecutorThread(executor, graph.context)
    try:
        assert wait_for(lambda: node.engine is not None or node.model_error, timeout=120), node.model_error
        client_node, find, ask = action_clients(graph)
        camera = graph.node("camera").create_publisher(Image, "image", RELIABLE)
        wait_for_match(camera)

        # Two goals waiting for the next frame (a bounded wait: held threads time them out).
        feedback = [[], []]
        handles = [send(find, Find.Goal(task="point", prompt="cup", use_latest_frame=False, timeout_s=10.0), f)
                   for f in feedback]
        assert all(h.accepted for h in handles)
        assert wait_for(lambda: all(any(x.state == Find.Feedback.STATE_WAITING_FOR_FRAME for x in f)
                                    for f in feedback), timeout=10)
        camera.publish(rgb_to_image(np.random.default_rng(2).integers(0, 256, (96, 128, 3), dtype=np.uint8)))
        for handle in handles:
            done = outcome(handle, timeout=30)
            assert done.status == GoalStatus.STATUS_SUCCEEDED, done.result.message
            assert len(done.result.points.points) == 2

        # A long decode, and a second goal queued behind it: each is canceled mid-decode.
        texts = [[], []]
        handles = [send(ask, Ask.Goal(task="query", prompt="What is this?", use_latest_frame=True,
                                      max_tokens=2000, timeout_s=60.0), t) for t in texts]
        for handle, streamed in zip(handles, texts):
            assert wait_for(lambda: len([f for f in streamed if f.text]) >= 2, timeout=60)
            cancel = handle.cancel_goal_async()
            assert wait_for(cancel.done, timeout=10) and cancel.result().goals_canceling
            done = outcome(handle, timeout=30)
            assert done.status == GoalStatus.STATUS_CANCELED and done.result.message == "canceled"

        # A lifecycle manager's deactivate is served while goals wait with no timeout (it ends them).
        from lifecycle_msgs.msg import Transition
        from lifecycle_msgs.srv import ChangeState
        manager = graph.node("manager").create_client(ChangeState, "/vision/change_state")
        assert manager.wait_for_service(timeout_sec=10)
        waiting = [send(find, Find.Goal(task="detect", prompt="cup", use_latest_frame=False, timeout_s=0.0), [])
                   for _ in range(2)]
        time.sleep(0.3)
        changed = manager.call_async(ChangeState.Request(transition=Transition(id=Transition.TRANSITION_DEACTIVATE)))
        assert wait_for(changed.done, timeout=10) and changed.result().success
        for h in waiting:
            done = outcome(h, timeout=30)
            assert done.status == GoalStatus.STATUS_ABORTED and "deactivated" in done.result.message
    finally:
        spinner.stop()
        executor.remove_node(node)
        node.destroy_node()
        executor.shutdown()


def test_the_latest_frame_is_read_once():
    """A deactivate sets the node's latest frame to None (drop_pending) whenever it comes: a goal
    that read it as there must use the frame it read, not fail on None."""
    from types import SimpleNamespace

    from photon_ros.latest_frame import Frame
    from photon_ros.vision_actions import VisionActions

    frame = Frame(Image(), time.monotonic())

    class Frames:
        reads = 0

        @property
        def latest(self):
            self.reads += 1
            return frame if self.reads == 1 else None   # dropped right after the first read

    actions = bare_actions()
    actions.node = SimpleNamespace(frames=Frames(), max_frame_age=600.0, to_rgb=lambda msg: "rgb")
    import threading
    assert actions.frame(None, True, threading.Event(), Find) == (frame, "rgb")


def test_a_request_that_came_while_inactive_is_refused_even_if_activate_follows_at_once():
    """A request read the activation as none (inactive), and the node was activated before its work
    was admitted: it is refused as inactive, not run and then withheld as "deactivated while it ran"."""
    import contextlib
    from types import SimpleNamespace

    from photon_ros.srv import Infer
    from photon_ros.vision_actions import VisionActions

    ran = []
    activity = SimpleNamespace(current=lambda: None,                          # inactive when it came
                               work=lambda epoch=None, end=None: contextlib.nullcontext(True))   # active by now
    node = SimpleNamespace(activity=activity, why_not_running=lambda: "node is not active",
                           infer=lambda *a: ran.append("infer"))
    response = VisionNode.on_infer(node, Infer.Request(task="detect", prompt="cup"), Infer.Response())
    assert not response.success and response.message == "node is not active" and not ran

    actions = bare_actions()
    actions._cancels, actions._lock, actions._early = {}, __import__("threading").Lock(), set()
    actions.node = node
    actions.run = lambda *a, **k: ran.append("run")
    handle = _Handle(Find.Goal(task="point", prompt="cup", timeout_s=0.0))
    handle.is_cancel_requested = False
    result = actions.execute(handle, find=True)
    assert handle.ended == "aborted" and result.message == "node is not active" and not ran


def test_goals_at_work_when_the_process_stops_end_with_why(graph):
    """At shutdown (run_node's stop_and_destroy) a goal waiting for its frame ends at once, aborted
    with the reason, and its client hears it: its end runs on the executor, which stopped before
    running it, so a client without a timeout of its own waited for ever. New goals are refused."""
    import threading

    from photon_ros.run_node import make_executor, stop_and_destroy

    node = VisionNode(context=graph.context, parameter_overrides=[
        Parameter("model", value=str(checkpoint())), Parameter("reliability", value="reliable")])
    executor = make_executor([node], context=graph.context)
    spinner = ExecutorThread(executor, graph.context)
    assert wait_for(lambda: node.engine is not None or node.model_error, timeout=120), node.model_error
    _, find, _ = action_clients(graph)
    handle = send(find, Find.Goal(task="point", prompt="cup", use_latest_frame=False, timeout_s=60.0), [])
    assert handle.accepted
    result = handle.get_result_async()
    assert wait_for(lambda: node.pending_goals() == 1, timeout=10)
    spinner.stop()
    began = time.monotonic()
    stop_and_destroy(executor, [node])
    assert time.monotonic() - began < 10
    assert wait_for(result.done, timeout=10), "the client never heard of its goal"
    assert result.result().status == GoalStatus.STATUS_ABORTED
    assert result.result().result.message == "the node is shutting down"


def goal_node(frames, batcher):
    """A node double for VisionActions.work, active: `frames` its camera, `batcher` its engine's,
    frames converted as VisionNode converts them (each conversion kept in `converted`)."""
    import threading
    from types import SimpleNamespace

    from photon_ros.managed import Activity

    activity = Activity()
    activity.start()
    node = SimpleNamespace(frames=frames, activity=activity, stopping=threading.Event(), max_objects=3,
                           max_pixels=10**8, max_frame_age=600.0, space=lambda *a: None, refusals=[],
                           converted=[], why_not_running=lambda: "node is not active",
                           engine=SimpleNamespace(model=SimpleNamespace(model_id="m"), batcher=batcher))
    node.refused = lambda what, why: node.refusals.append(why) or why
    node.to_rgb = lambda msg: node.converted.append(msg) or VisionNode.to_rgb(node, msg)
    return node


def test_a_next_frame_goal_waits_past_a_frame_it_cannot_read():
    """A malformed frame (a driver's truncated buffer) is not the goal's: it waits on for one it can
    read, converted once, instead of failing with a good frame moments away; at its timeout it says
    why the frames it saw were not used. Neither is a failed request."""
    from photon_ros.latest_frame import Frame

    bad = Image(height=4, width=4, encoding="rgb8", step=12, data=bytes(10))
    good = rgb_to_image(np.zeros((4, 4, 3), np.uint8))

    class Camera:
        """frames.latest: at each read the next of `sent` arrives (None: nothing new)."""
        def __init__(self, *sent):
            self.sent, self.frame = list(sent), None

        @property
        def latest(self):
            msg = self.sent.pop(0) if self.sent else None
            if msg is not None:
                self.frame = Frame(msg, time.monotonic())
            return self.frame

    class Batcher:
        images = []

        def submit(self, requests, cancel=None):
            self.images.append(requests[0].image.shape)
            return [{"points": [{"x": 0.5, "y": 0.5}]}]

    actions = bare_actions()
    actions.node = node = goal_node(Camera(bad, None, good), Batcher())
    handle = _Handle(Find.Goal(task="point", prompt="cup", use_latest_frame=False, timeout_s=30.0))
    handle.is_cancel_requested = False
    result, _ = actions.work(handle, find=True)
    assert result.success and len(result.points.points) == 1, result.message
    assert Batcher.images == [(4, 4, 3)] and node.refusals == []
    assert [m is bad for m in node.converted] == [True, False]   # each frame converted once

    actions.node = node = goal_node(Camera(bad), Batcher())
    handle = _Handle(Find.Goal(task="point", prompt="cup", use_latest_frame=False, timeout_s=0.2))
    handle.is_cancel_requested = False
    result, _ = actions.work(handle, find=True)
    assert not result.success and "no frame that could be read arrived before the timeout" in result.message
    assert "image data has 10 bytes" in result.message and node.refusals == [] and len(node.converted) == 1


def test_a_deactivate_stops_a_goal_that_is_decoding():
    """A deactivate tells a goal's decode to stop, as a cancel does: it freed its batch slot only at
    its end, for a result that is not given, and cleanup's wait for work in flight waited for it
    (up to a minute). It ends aborted, deactivated, with nothing of what it found."""
    import threading

    from photon_ros.latest_frame import LatestFrame
    from photon_ros.vision_actions import DEACTIVATED

    decoding = threading.Event()

    class Batcher:
        cancel = None

        def submit(self, requests, cancel=None):
            self.cancel = cancel
            decoding.set()
            cancel.wait(60)   # a long decode: its cancel ends it
            return [{"answer": "half an ans"}]

    frames = LatestFrame()
    frames.put(rgb_to_image(np.zeros((4, 4, 3), np.uint8)))
    actions, batcher = bare_actions(), Batcher()
    actions.node = node = goal_node(frames, batcher)
    handle = _Handle(Ask.Goal(task="query", prompt="What is this?", use_latest_frame=True, timeout_s=0.0))
    handle.is_cancel_requested = False
    worked = []
    worker = threading.Thread(target=lambda: worked.extend(actions.work(handle, find=False)))
    worker.start()
    try:
        assert decoding.wait(10)
        node.activity.stop()   # deactivate (ManagedNode.pause)
        assert batcher.cancel.is_set()   # told as the activation ended
    finally:
        if batcher.cancel is not None:
            batcher.cancel.set()   # (release the decode, told or not)
        worker.join(10)
    assert node.activity.wait_idle(0)
    result, epoch = worked
    assert not result.success and result.message == DEACTIVATED and not result.text.text
    assert actions.end(handle, result, epoch).message == DEACTIVATED and handle.ended == "aborted"


@pytest.mark.parametrize("latest", [False, True], ids=["waiting for its frame", "decoding"])
def test_a_cancel_ends_the_goal_canceled_before_rclpy_marks_it(latest):
    """on_cancel sets the goal's event and its work ends at once, before rclpy marks the goal
    CANCELING: the work told cancel from its timeout by that mark, so a cancel was reported as a
    timeout and ended aborted. What set the event decides, and the goal ends canceled."""
    import threading

    from photon_ros.latest_frame import LatestFrame

    waiting = threading.Event()

    class Batcher:
        def submit(self, requests, cancel=None):
            waiting.set()
            cancel.wait(60)
            return [{"points": []}]

    frames = LatestFrame()
    frames.put(rgb_to_image(np.zeros((4, 4, 3), np.uint8)))
    actions = bare_actions()
    actions.node = goal_node(frames, Batcher())
    handle = _MarkedLate(Find.Goal(task="point", prompt="cup", use_latest_frame=latest, timeout_s=60.0))
    handle.publish_feedback = lambda f: f.state == Find.Feedback.STATE_WAITING_FOR_FRAME and waiting.set()
    worked = []
    worker = threading.Thread(target=lambda: worked.extend(actions.work(handle, find=True)))
    worker.start()
    try:
        assert waiting.wait(10)
        actions.on_cancel(handle)
    finally:
        worker.join(10)
    result, epoch = worked
    assert not result.success and result.message == "canceled"
    handle.accepted = True   # rclpy's CANCEL_GOAL, after the work ended
    assert actions.end(handle, result, epoch).message == "canceled" and handle.ended == "canceled"
