"""The vision node's actions: `find` (photon_ros/action/Find: detect, point, segment) and `ask`
(photon_ros/action/Ask: query, caption) on one frame, with feedback while the model decodes and a
cancel that stops the decode.

    goal -> the frame: the latest one (refused when older than max_frame_age_s) or the next one
            to arrive (feedback state waiting_for_frame)
         -> one engine request, batched with every other camera's and caller's (state decoding);
            its decode reports each object found and the answer's text as it grows (feedback)
         -> result: the same messages the topics carry (2D, and 3D with use_depth)

A cancel, the goal's timeout, a deactivate or the shutdown sets the request's cancel event: a
request still waiting for its batch (behind other work on the engine) is dropped at once
(Batcher.submit), and in a decode the loop drops the row at its next step, which frees its batch
slot for the next request (Request.cancel). The goal then ends canceled (aborted for the others,
saying which) with what was found so far (nothing, when deactivated). Segment (Moondream 3) runs
its own decode loop outside the batch: a cancel ends it between two path commands.

A goal's work (waiting for its frame, decoding) runs on a thread of its own, not on the executor's:
run_node spins a thread per core (2 on a 2-core computer) and one per callback that may wait (an
infer, a transition: run_node.make_executor), and goals, unbounded in number, that held them would
keep out the frame that ends their wait, their cancels, deactivate and /diagnostics. The executor only ends
the goal (succeed, abort, canceled), so the goal's status stays accepted until then. At most
MAX_GOALS goals are at work at once (each a thread holding its frame): more are refused, as
nothing bounded them once the executor's threads no longer did.
"""
from __future__ import annotations

import functools
import threading
import time
from typing import TYPE_CHECKING, Any

from rclpy.action import ActionServer, CancelResponse, GoalResponse
from rclpy.callback_groups import ReentrantCallbackGroup

from photon_core.runtime.batcher import Canceled
from photon_ros.action import Ask, Find
from photon_ros.result_messages import (detections_message, points_message, segmentation_message,
                                        vision_text_message)
from photon_ros.vision_requests import engine_request, missing_reasoning, request_options

if TYPE_CHECKING:
    from photon_ros.vision_node import VisionNode

FRAME_POLL_S = 0.02
MAX_GOALS = 16   # two batches' worth: beyond it a goal would only wait behind the others
CANCELING_WAIT_S = 1.0   # rclpy marks a goal CANCELING right after on_cancel: microseconds, or one GIL switch
DEACTIVATED = "the node was deactivated while the goal ran: its result is not given"
WAIT_DEACTIVATED = "the node was deactivated (or is shutting down) while the goal waited for a frame"
SHUTTING_DOWN = "the node is shutting down"
CANCELED, TIMED_OUT = "canceled", "timed out"   # (with DEACTIVATED, SHUTTING_DOWN) why a goal was stopped


class GoalStop(threading.Event):
    """A goal's cancel event, which its frame wait and its decode stop at, and why it was set. The
    reason is kept where the event is set: the goal's end is chosen by it, as rclpy marks a goal
    CANCELING only after on_cancel returns, by when its work may have ended."""

    def __init__(self) -> None:
        super().__init__()
        self.reason = ""
        self._reason_lock = threading.Lock()

    def stop(self, reason: str) -> None:
        with self._reason_lock:   # the first reason holds: what stopped the work
            self.reason = self.reason or reason
        self.set()


class VisionActions:
    def __init__(self, node: "VisionNode") -> None:
        self.node = node
        self._cancels: dict[bytes, GoalStop] = {}
        self._early: set[bytes] = set()   # canceled before execute registered them
        self._canceled: set[bytes] = set()   # work a cancel stopped, its goal not yet ended
        self._lock = threading.Lock()
        self._workers: set[threading.Thread] = set()   # goals at work (accepted)
        self._open: set[bytes] = set()   # goals accepted and not yet ended (their end runs on the executor)
        self.stopping = False            # the process shuts down: goals end, new ones are refused
        group = ReentrantCallbackGroup()
        self.servers = [
            ActionServer(node, Find, "find", lambda h: self.execute(h, find=True), callback_group=group,
                         goal_callback=self.on_find_goal, cancel_callback=self.on_cancel,
                         handle_accepted_callback=lambda h: self.start(h, find=True)),
            ActionServer(node, Ask, "ask", lambda h: self.execute(h, find=False), callback_group=group,
                         goal_callback=self.on_ask_goal, cancel_callback=self.on_cancel,
                         handle_accepted_callback=lambda h: self.start(h, find=False))]

    def stop(self) -> None:
        """The process shuts down: new goals are refused and those at work end now (their decodes
        within a step, their waits at once), saying why; the executor must still end them (pending),
        or their clients never hear."""
        self.stopping = True
        with self._lock:
            stops = list(self._cancels.values())
        for stop in stops:
            stop.stop(SHUTTING_DOWN)

    def pending(self) -> int:
        """Goals accepted and not yet ended."""
        with self._lock:
            return len(self._open)

    def destroy(self) -> None:
        """Stop the goals at work (their decodes end within a step, their waits at once) and wait
        for them, then remove the servers."""
        self.stop()
        with self._lock:
            workers = list(self._workers)
        for worker in workers:
            worker.join(timeout=30)
        for server in self.servers:
            server.destroy()

    # --- goals ----------------------------------------------------------------------------------
    def refusal(self, task: str, prompt: str, tasks: tuple[str, ...], timeout_s: float) -> str:
        """Why a goal cannot be taken ("" when it can)."""
        if task not in tasks:
            return f"task must be one of {', '.join(tasks)}, got {task!r}"
        if task != "caption" and not prompt.strip():
            return "an empty prompt"
        if self.stopping:
            return SHUTTING_DOWN
        if not 0 <= timeout_s <= threading.TIMEOUT_MAX:   # (NaN and infinity too: a timer cannot take them)
            return f"timeout_s must be >= 0 and at most {threading.TIMEOUT_MAX:g}, got {timeout_s}"
        with self._lock:
            if len(self._workers) >= MAX_GOALS:
                return f"{MAX_GOALS} goals are at work already: try again when one has ended"
        return self.node.lacks(task)

    def on_find_goal(self, goal: Find.Goal) -> GoalResponse:
        reason = self.refusal(goal.task, goal.prompt, ("detect", "point", "segment"), goal.timeout_s)
        return self._answer(reason, "find")

    def on_ask_goal(self, goal: Ask.Goal) -> GoalResponse:
        reason = self.refusal(goal.task, goal.prompt, ("query", "caption"), goal.timeout_s)
        return self._answer(reason, "ask")

    def _answer(self, reason: str, action: str) -> GoalResponse:
        if reason:   # logged and counted on /diagnostics, as infer's refusals are
            self.node.refused(f"{action} goal", reason)
            return GoalResponse.REJECT
        return GoalResponse.ACCEPT

    def on_cancel(self, goal_handle) -> CancelResponse:
        key = bytes(goal_handle.goal_id.uuid)
        with self._lock:
            cancel = self._cancels.get(key)
            if cancel is None:
                self._early.add(key)   # execute has not begun: it sees this when it does
        if cancel is not None:
            cancel.stop(CANCELED)
        return CancelResponse.ACCEPT

    # --- execution ------------------------------------------------------------------------------
    def start(self, goal_handle, find: bool) -> None:
        """An accepted goal: its work on a thread of its own (see the module's docstring); the
        executor then only ends it."""
        def finish(handle) -> Any:
            return self.end(handle, result, epoch)

        def work() -> None:
            nonlocal result, epoch
            try:
                try:
                    result, epoch = self.work(goal_handle, find)
                except Exception as err:  # noqa: BLE001 - a goal left unended would hang its client
                    result.success = False   # (logged and counted on /diagnostics, as work's failures are)
                    result.message = self.node.refused("find" if find else "ask", f"{type(err).__name__}: {err}")
                try:
                    goal_handle.execute(finish)
                except Exception:  # noqa: BLE001 - canceled between execute's check and its transition
                    if not goal_handle.is_cancel_requested:
                        raise
                    goal_handle.execute(finish)   # (canceling now: it ends the goal without that transition)
            finally:
                with self._lock:
                    self._workers.discard(threading.current_thread())

        result, epoch = (Find if find else Ask).Result(), None
        worker = threading.Thread(target=work, daemon=True, name="vision-goal")
        with self._lock:
            self._workers.add(worker)
            self._open.add(bytes(goal_handle.goal_id.uuid))
        try:
            worker.start()
        except RuntimeError as err:   # no thread to be had: the goal is ended at once, failed
            with self._lock:
                self._workers.discard(worker)   # (never started: destroy() must not join it)
            result.message = self.node.refused("find" if find else "ask", f"no thread for the goal: {err}")
            goal_handle.execute(finish)

    def execute(self, goal_handle, find: bool) -> Any:
        """A goal's work and its end, on the calling thread."""
        return self.end(goal_handle, *self.work(goal_handle, find))

    def work(self, goal_handle, find: bool) -> tuple[Any, int | None]:
        """The goal's result (success false, with the reason, when it failed or was stopped), and
        the activation it ran in (None: none)."""
        action = Find if find else Ask
        goal, result = goal_handle.request, action.Result()
        key, cancel = bytes(goal_handle.goal_id.uuid), GoalStop()
        with self._lock:
            self._cancels[key] = cancel
            early = key in self._early
            self._early.discard(key)
        if early or goal_handle.is_cancel_requested:   # canceled between its acceptance and now
            cancel.stop(CANCELED)
        if self.stopping:
            cancel.stop(SHUTTING_DOWN)
        timer = threading.Timer(goal.timeout_s, cancel.stop, (TIMED_OUT,)) if goal.timeout_s > 0 else None
        if timer is not None:
            timer.start()
        started = time.monotonic()
        epoch = self.node.activity.current()
        try:
            # A deactivate stops it as stop() does: none of its results would be given
            with self.node.activity.work(epoch, end=functools.partial(cancel.stop, DEACTIVATED)) as running:
                if not running or epoch is None:   # (None: not active when it came; work(None) admits any)
                    result.message = self.node.why_not_running()
                else:
                    self.run(goal_handle, goal, result, cancel, find, epoch)
                    if ((result.success and self.node.activity.current() != epoch)
                            or (cancel.reason == DEACTIVATED and not result.message)):
                        # as the topics are: results of work begun in an activation that ended
                        # are not given (a loop node would turn the robot on them); none of
                        # them, as infer gives none
                        result = action.Result(success=False, message=DEACTIVATED)
        except ValueError as err:   # an option the task does not take, or the model refused
            result.success, result.message = False, self.node.refused("find" if find else "ask", str(err))
        except Exception as err:  # noqa: BLE001 - a goal that fails is answered, never fatal
            result.success = False
            result.message = self.node.refused("find" if find else "ask", f"{type(err).__name__}: {err}")
        finally:
            if timer is not None:
                timer.cancel()
            with self._lock:
                self._cancels.pop(key, None)
                if cancel.reason == CANCELED:   # (a cancel from now on is end()'s, by is_cancel_requested)
                    self._canceled.add(key)
        if not result.success and cancel.is_set() and not result.message:
            result.message = (f"timed out after {time.monotonic() - started:.1f} s (timeout_s {goal.timeout_s:g})"
                              if cancel.reason == TIMED_OUT else cancel.reason)
        return result, epoch

    def end(self, goal_handle, result: Any, epoch: int | None = None) -> Any:
        """End the goal with `result` (from work, in activation `epoch`). A goal's work ends on its
        own thread and the executor ends the goal later: a deactivate in between withholds the
        result too. succeed() is called while the activation holds (Activity.publishing, as the
        topics publish), so once deactivate has stopped it no result of it is given."""
        key = bytes(goal_handle.goal_id.uuid)
        with self._lock:
            self._early.discard(key)   # a cancel that came after the work
            self._open.discard(key)
            canceled = key in self._canceled
            self._canceled.discard(key)
        if canceled or goal_handle.is_cancel_requested:
            # a canceled goal ends canceled, even where its work finished: its client replaced it
            result.success = False
            result.message = CANCELED
            if canceled and not self._canceling(goal_handle):
                goal_handle.abort()   # (only a goal marked CANCELING can end canceled)
            else:
                goal_handle.canceled()
            return result
        if result.success:
            with self.node.activity.publishing(epoch) as current:
                if current:
                    goal_handle.succeed()
                    return result
            result = type(result)(success=False, message=DEACTIVATED)
        goal_handle.abort()
        return result

    @staticmethod
    def _canceling(goal_handle) -> bool:
        """Whether the goal is marked CANCELING, waiting a moment for it: a cancel's event may end
        the goal's work, and bring it here, before rclpy marks the goal (after on_cancel returns),
        and only a goal so marked can end canceled."""
        deadline = time.monotonic() + CANCELING_WAIT_S
        while not goal_handle.is_cancel_requested:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.001)
        return True

    def run(self, goal_handle, goal, result, cancel: GoalStop, find: bool, epoch: int | None = None) -> None:
        action = Find if find else Ask
        request_options(goal.task, goal, self.node.max_objects)   # refused before waiting for a frame
        got = self.frame(goal_handle, goal.use_latest_frame, cancel, action, epoch)
        if isinstance(got, str):
            result.message = got
            return
        frame, rgb = got
        node = self.node
        header, (height, width) = frame.msg.header, rgb.shape[:2]
        model_id = node.engine.model.model_id
        feedback = action.Feedback(state=action.Feedback.STATE_DECODING)
        goal_handle.publish_feedback(feedback)

        def latency() -> float:
            return time.monotonic() - frame.received_at

        if find and goal.task == "segment":
            from photon_ros.vision_node import segment_frame   # not a batched skill

            # Segment decodes on its own loop, not the batch's: a cancel ends it between two path commands.
            segment = segment_frame(node.engine, rgb, [goal.prompt], node.segment_max_tokens, cancel)[0]
            result.segmentation = segmentation_message(segment, header, prompt=goal.prompt, width=width,
                                                       height=height, latency=latency(), model_id=model_id)
            result.success = not cancel.is_set()
            return
        if find:
            def report(partial: dict) -> None:
                self.find_feedback(feedback, goal, partial, header, width, height, model_id, latency())
                goal_handle.publish_feedback(feedback)
            request = engine_request(goal.task, rgb, goal.prompt, goal, node.max_objects, cancel=cancel,
                                     progress=report)
        else:
            def report(partial: dict) -> None:
                feedback.text = partial.get("answer", partial.get("caption", ""))
                goal_handle.publish_feedback(feedback)
            prompt = goal.prompt or ("short" if goal.task == "caption" else "")
            request = engine_request(goal.task, rgb, prompt, goal, node.max_objects, cancel=cancel,
                                     progress=report)
        try:
            # A cancel (or the timeout) while it waits behind other work ends the goal at once.
            answer = node.engine.batcher.submit([request], cancel=cancel)[0]
        except Canceled:
            return
        # The frame's depth pairing began at its arrival and went on while the model ran.
        space = node.space(header, width, height, frame.extra) if find else None
        if not find:
            missing_reasoning(goal.reasoning, answer)
        if find and goal.task == "detect":
            result.detections = detections_message(answer, header, prompt=goal.prompt, width=width, height=height,
                                                   latency=latency(), model_id=model_id)
            if space is not None:
                result.objects_3d = node.placed("detect", goal.prompt, result.detections, space, model_id,
                                                latency())[0][1]
        elif find:
            result.points = points_message(answer, header, prompt=goal.prompt, width=width, height=height,
                                           latency=latency(), model_id=model_id)
            if space is not None:
                result.objects_3d = node.placed("point", goal.prompt, result.points, space, model_id, latency())[0][1]
        else:
            text = answer.get("answer", answer.get("caption", ""))
            result.text = vision_text_message(text, header, task=goal.task, prompt=prompt,   # the length used
                                              latency=latency(), model_id=model_id,
                                              reasoning=answer.get("reasoning"), width=width, height=height)
        result.success = not cancel.is_set()

    def find_feedback(self, feedback, goal, partial: dict, header, width: int, height: int, model_id: str,
                      latency: float) -> None:
        """The objects found so far; `latency`: image received -> now (they were found), as the
        Detections / Points field says."""
        if goal.task == "detect":
            feedback.detections = detections_message(partial, header, prompt=goal.prompt, width=width,
                                                      height=height, latency=latency, model_id=model_id)
            feedback.objects_found = len(feedback.detections.detections)
        else:
            feedback.points = points_message(partial, header, prompt=goal.prompt, width=width, height=height,
                                             latency=latency, model_id=model_id)
            feedback.objects_found = len(feedback.points.points)

    def frame(self, goal_handle, latest: bool, cancel: GoalStop, action,
              epoch: int | None = None) -> tuple[Any, Any] | str:
        """The frame to use and its RGB image, or why there is none (a string). Waiting for the
        next frame ends with the activation (deactivate, cleanup, shutdown: a goal with no timeout
        held them up for good)."""
        frames, node = self.node.frames, self.node
        if latest:
            newest = frames.latest   # read once: a deactivate meanwhile sets it to None
            if newest is None:
                return "no frame received yet"
            from photon_ros.vision_node import stale_frame

            refusal = stale_frame(time.monotonic() - newest.received_at, node.max_frame_age)
            return refusal or (newest, node.to_rgb(newest.msg))
        after, unreadable = time.monotonic(), ""
        goal_handle.publish_feedback(action.Feedback(state=action.Feedback.STATE_WAITING_FOR_FRAME))
        while not cancel.wait(FRAME_POLL_S):
            current = frames.latest
            if current is not None and current.received_at > after:
                try:
                    return current, node.to_rgb(current.msg)
                except ValueError as err:   # one malformed frame: the next may be good, and the timeout runs
                    after, unreadable = current.received_at, str(err)
            if self.stopping:
                return SHUTTING_DOWN
            if node.stopping.is_set() or node.activity.current() != epoch:
                return WAIT_DEACTIVATED
        if cancel.reason == TIMED_OUT:
            return (f"no frame that could be read arrived before the timeout (the last: {unreadable})"
                    if unreadable else "no frame arrived before the timeout")
        return WAIT_DEACTIVATED if cancel.reason == DEACTIVATED else cancel.reason   # (canceled, shutting down)
