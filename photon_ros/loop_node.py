"""The observe -> infer -> act loop: a spoken command becomes a target, placed in 3D where the
vision node has depth, and a bounded turn toward it.

    transcript (photon_ros/Transcript), e.g. "point at the red cup"; only final transcripts of
               complete audio are acted on (half a command must not move the robot)
      -> commands.parse_command -> VisionRequest("point", "red cup")
      -> the vision node's find action on its latest frame (on the next one for a camera that
         leaves its frames unstamped), within search_timeout_s (a newer command cancels a goal
         still decoding: the robot acts on what it was told last)
    "stop" ("halt", "hold on", "don't move", "never mind", ...: commands.is_stop), from a partial
               transcript already: the search in progress is canceled and a turn ends at once (zero
               Twist); a new command ends a turn in progress too
      -> image_target (photon_ros/ImageTarget: where the target is in the image, pixels and
                       normalized, the frame's header): always
         target (geometry_msgs/PointStamped): only a position in metres, in the frame the vision
                  node placed it in (its optical frame or target_frame), when it has one; without
                  depth, status says why there is none and nothing is published here
         goal_pose (geometry_msgs/PoseStamped, with `publish_goal`): a planner goal short of a
                  target placed in the robot's frame, facing it; once one went out, no turn of
                  ours (the planner's controller may still be driving cmd_vel) until publish_goal
                  is set false, which hands turning back
         cmd_vel (geometry_msgs/Twist, or TwistStamped with `stamped_cmd_vel`, when `turn` is
                  on): a bounded turn that faces the target, its angle from the 3D position in the
                  optical frame or robot_frame, or read off the image through `horizontal_fov_deg`, at most
                  `max_turn_s` long, streamed at 10 Hz and always ended by a zero Twist (steering.py)
         status (std_msgs/String, for people: what was understood, what was found, what was not done)
    /diagnostics: WARN while turns on cmd_vel would move nothing: a subscriber takes another type
                  (DDS never matches different types, and nothing else says so), or none is there
"""
from __future__ import annotations

if __name__ == "__main__":   # `python -m`: a Ctrl-C during the imports below (seconds) ends it at once
    from photon_ros.run_node import exit_on_ctrl_c
    exit_on_ctrl_c()

import math
import threading
import time

from action_msgs.msg import GoalStatus
from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus
from geometry_msgs.msg import PointStamped, PoseStamped, Twist, TwistStamped
from rclpy.action import ActionClient
from rclpy.clock import Clock, ClockType
from rclpy.duration import Duration
from rclpy.node import Node
from rclpy.qos import QoSProfile, ReliabilityPolicy
from std_msgs.msg import Header, String

from photon_ros.diagnostics import publish_status
from photon_ros.commands import VisionRequest, is_stop, parse_command
from photon_ros.msg import ImageTarget, Object3D, Transcript
from photon_ros.params import NodeParams, Param
from photon_ros.result_messages import time_to_seconds
from photon_ros.run_node import exit_on_help, run_node
from photon_ros.action import Find
from photon_ros.steering import Turn, TurnCommands, bearing, plan_turn

TICK_S = 0.1   # cmd_vel is streamed at 10 Hz while a turn lasts
STOP_ACK_S = 1.0   # at shutdown, how long the zero Twist may take to reach the base's subscription
TWIST, TWIST_STAMPED = "geometry_msgs/msg/Twist", "geometry_msgs/msg/TwistStamped"

LOOP_PARAMS = [
    Param("turn", True, "publish a bounded turn toward each target on cmd_vel; false: no motion at all (a turn in "
          "progress ends at once)"),
    Param("horizontal_fov_deg", 60.0, "the camera's horizontal field of view: a turn's angle comes from it",
          positive=True, high=179.0),
    Param("max_turn_rate", 0.5, "rad/s of a turn", positive=True),
    Param("max_turn_s", 3.0, "no turn lasts longer than this many seconds", positive=True),
    Param("deadband_deg", 2.0, "a target this close to the image centre needs no turn", low=0.0),
    Param("publish_goal", False, "publish a planner goal on goal_pose (nav2) for a target placed in 3D in "
          "the robot's frame (the vision node's target_frame); after a goal the loop turns no more until this "
          "is set false (the planner may still be driving)"),
    Param("stamped_cmd_vel", False, "publish cmd_vel as geometry_msgs/TwistStamped (header: now, robot_frame) "
          "instead of Twist: ros2_control's diff_drive_controller takes only TwistStamped since Jazzy, as does nav2 "
          "with enable_stamped_cmd_vel (its Kilted default); DDS never matches different types. The publisher's type "
          "is fixed when the node starts, so a change is refused: restart the node with the new value",
          applies="restart"),
    Param("robot_frame", "base_link", "the robot's own frame: goals are placed only from positions in it (their "
          "origin is the robot); positions in any other frame (the camera's optical frame, map, odom) give none"),
    Param("goal_standoff_m", 0.5, "the goal stops this far short of the object", low=0.0),
    Param("max_command_age_s", 10.0, "a command said longer ago than this (its audio's end, by the transcript's "
          "stamp) when its transcript comes is not acted on: a speech node behind on its backlog must not move "
          "the robot on what was said long before; a stamp this far ahead of the node's clock is refused too "
          "(clocks that differ: use_sim_time on one node and not another); 0: any age (replays, whose stamps "
          "are old)", low=0.0),
    Param("search_timeout_s", 30.0, "a search (waiting for its frame, then decoding) gives up after this long, "
          "said on status: a camera that stopped must not leave a command waiting unanswered; 0: no limit",
          low=0.0, high=threading.TIMEOUT_MAX),   # past it the vision node refuses every goal
    Param("refuse_frames_before_turn", True, "a result from a frame captured before the last turn ended (or "
          "while turning) moves nothing; false only for replays, whose frames are not this robot's (evaluate)"),
]


def target_from_response(request: VisionRequest, response: Find.Result) -> ImageTarget | None:
    """The first object found, as an image target (a point, or a box's centre), or None."""
    if request.task == "point" and response.points.points:
        result, p = response.points, response.points.points[0]
        x, y, x_px, y_px = p.x, p.y, p.x_px, p.y_px
    elif request.task == "detect" and response.detections.detections:
        result, d = response.detections, response.detections.detections[0]
        x, y = (d.x_min + d.x_max) / 2, (d.y_min + d.y_max) / 2
        x_px, y_px = (d.x_min_px + d.x_max_px) / 2, (d.y_min_px + d.y_max_px) / 2
    else:
        return None
    return ImageTarget(header=result.header, task=request.task, label=request.target,
                       image_width=result.image_width, image_height=result.image_height,
                       x_px=x_px, y_px=y_px, x=x, y=y)


def position_from_response(response: Find.Result) -> tuple[Object3D | None, str]:
    """The first object's 3D position, or None and why there is none."""
    placed = response.objects_3d
    if not placed.task:
        return None, "the vision node does not use depth"
    if not placed.objects:
        return None, "no object"
    first = placed.objects[0]
    return (first, "") if first.has_position else (None, first.reason or placed.depth_note)


def approach_goal(x: float, y: float, standoff: float) -> tuple[float, float, float] | None:
    """(x, y, yaw) `standoff` metres short of (x, y) on the line from the origin, facing it; None
    when the object is that close already."""
    distance = math.hypot(x, y)
    if distance <= standoff:
        return None
    yaw = math.atan2(y, x)
    return (x - standoff * math.cos(yaw), y - standoff * math.sin(yaw), yaw)


def incomplete_reason(msg: Transcript) -> str:
    """Why a final transcript must not be acted on ("" when it may): audio that was cut may hold
    half a command ("go to the kitchen" of "go to the kitchen and wait there")."""
    if msg.audio_complete:
        return ""
    return f"not acting on {msg.text!r}: part of the command was lost ({msg.audio_note or 'no reason given'})"


def command_age(msg: Transcript, now_ns: int) -> float | None:
    """Seconds since the command's audio ended, by the transcript's stamp (its first sample's
    capture) and duration; None for an unstamped transcript."""
    said = time_to_seconds(msg.header.stamp)
    if said == 0:
        return None
    return now_ns / 1e9 - said - time_to_seconds(msg.audio_duration)


def age_refusal(text: str, age: float | None, limit: float) -> str:
    """Why a command of `age` s must not be acted on ("" when it may): said too long ago, or
    stamped so far ahead of this node's clock that the two clocks cannot be the same one (the
    age rule would never fire: a simulator's time against wall-clock stamps)."""
    if limit <= 0 or age is None or abs(age) <= limit:
        return ""
    if age > limit:
        return f"not acting on {text!r}: it was said {age:.1f} s ago (max_command_age_s {limit:g} s)"
    return (f"not acting on {text!r}: its stamp is {-age:.1f} s ahead of this node's clock, so its age cannot be "
            f"told (max_command_age_s {limit:g} s): are the clocks the same (use_sim_time on every node or none)?")


def velocity_message(twist: Twist, stamped: bool, stamp, frame_id: str) -> Twist | TwistStamped:
    """What goes on cmd_vel: `twist` itself, or stamped at `stamp` in `frame_id` (the robot's frame)."""
    if not stamped:
        return twist
    return TwistStamped(header=Header(stamp=stamp, frame_id=frame_id), twist=twist)


def cmd_vel_problem(topic: str, stamped: bool, subscribers: list[tuple[str, str]]) -> tuple[str, bool]:
    """Why turns published on `topic` may move nothing ("" when nothing is wrong), from its
    `subscribers` as (node, type), and whether that is certain: a subscriber of another type never
    receives them (DDS does not match different types, and neither side logs anything), while
    "none at all" may only mean that discovery has not found the base yet."""
    ours = TWIST_STAMPED if stamped else TWIST
    others = sorted({(node, kind) for node, kind in subscribers if kind != ours})
    if others:
        theirs = ", ".join(f"{node} takes {kind}" for node, kind in others)
        fixes = sorted({f"set stamped_cmd_vel {'true' if kind == TWIST_STAMPED else 'false'}"
                        for _, kind in others if kind in (TWIST, TWIST_STAMPED)})
        return (f"{topic}: {theirs}, but this node publishes {ours} (stamped_cmd_vel "
                f"{'true' if stamped else 'false'}): different types never match, so turns do not reach "
                f"{'it' if len(others) == 1 else 'them'}" + (f"; {' / '.join(fixes)}" if fixes else ""), True)
    if not subscribers:
        return f"nothing subscribes to {topic}: turns move nothing", False
    return "", False


def describe_turn(turn: Turn | None, heading: float | None = None) -> str:
    """What the turn does, and, where max_turn_s cut it short of `heading` (rad, the target's
    bearing), how far short it stops: the robot does not face the target then."""
    if turn is None:
        return "already facing it: no turn"
    side = "left" if turn.rate > 0 else "right"
    said = f"turning {math.degrees(abs(turn.angle)):.0f} deg {side} for {turn.duration:.1f} s, then stopping"
    if heading is not None:
        short = abs(math.remainder(heading, 2.0 * math.pi)) - abs(turn.angle)
        if math.degrees(short) >= 1.0:
            said += (f" ({math.degrees(short):.0f} deg short of the target: max_turn_s cuts the turn; "
                     "ask again to go on)")
    return said


class LoopNode(Node):
    def __init__(self, **kwargs) -> None:
        super().__init__("loop", **kwargs)
        self.params = NodeParams(self, LOOP_PARAMS, apply=self.apply_params)
        reliable = QoSProfile(depth=10, reliability=ReliabilityPolicy.RELIABLE)
        self.pub_image_target = self.create_publisher(ImageTarget, "image_target", reliable)
        self.pub_target = self.create_publisher(PointStamped, "target", reliable)     # metres only
        self.pub_goal = self.create_publisher(PoseStamped, "goal_pose", reliable)
        # the type is fixed here: stamped_cmd_vel is read once (a change is refused, not ignored)
        self.stamped = self.params["stamped_cmd_vel"]
        self.pub_cmd = self.create_publisher(TwistStamped if self.stamped else Twist, "cmd_vel", reliable)
        self.pub_status = self.create_publisher(String, "status", reliable)
        self.pub_diagnostics = self.create_publisher(DiagnosticArray, "/diagnostics", QoSProfile(
            depth=10, reliability=ReliabilityPolicy.RELIABLE))
        # steady: under use_sim_time with no /clock (a simulator paused) /diagnostics went silent; the
        # turn's timer stays on the node's clock (a turn lasts simulated seconds: turn_clock)
        self.create_timer(1.0, self.publish_diagnostics, clock=Clock(clock_type=ClockType.STEADY_TIME))
        self.turns = TurnCommands(TICK_S)
        self.turn_lock = threading.Lock()   # the timer's Twist and the shutdown's zero Twist: one after the other
        self.halted = False                 # shutting down: no turn starts
        self.turn_timer = self.create_timer(TICK_S, self.send_turn)
        self.find = ActionClient(self, Find, "find")
        self.goal = None   # the find goal in progress
        self.command = 0   # the newest command's number: only its result is acted on
        self.still_since = None   # rclpy Time the last turn ended: a frame taken before then is stale
        # An unstamped camera (zero stamps) cannot show when a frame was taken: once one is seen,
        # goals ask for the next frame, which arrives after the goal went out.
        self.unstamped_frames = False
        self.asked = (0, True)    # the newest goal's (clock ns when sent, use_latest_frame)
        self.goal_sent = False    # a planner goal of ours went out: the planner may be driving since
        self.create_subscription(Transcript, "transcript", self.on_transcript, reliable)

    def say(self, text: str) -> None:
        self.get_logger().info(text)
        self.pub_status.publish(String(data=text))

    def publish_velocity(self, twist: Twist) -> None:
        """Every message on cmd_vel goes out here (a turn's, its zero Twist, the stop at shutdown),
        as the type the publisher was made for."""
        self.pub_cmd.publish(velocity_message(twist, self.stamped, self.get_clock().now().to_msg(),
                                              self.params["robot_frame"]))

    def check_cmd_vel(self, turn_starting: bool = False) -> str:
        """Why turns on cmd_vel would move nothing now ("" when they would; also while turning is
        off). Logged (every 30 s at most) when a turn starts, or at any check
        while a subscriber takes another type; "nothing subscribes" alone is not logged between
        turns, since it may only mean that discovery has not found the base yet."""
        problem, certain = "", False
        if self.params["turn"]:
            topic = self.pub_cmd.topic_name
            subscribers = [(f"{info.node_namespace.rstrip('/')}/{info.node_name}", info.topic_type)
                           for info in self.get_subscriptions_info_by_topic(topic)]
            problem, certain = cmd_vel_problem(topic, self.stamped, subscribers)
        if problem and (turn_starting or certain):
            self.get_logger().warning(problem, throttle_duration_sec=30.0)
        return problem

    def publish_diagnostics(self) -> None:
        problem = self.check_cmd_vel()
        if problem:
            level, message = DiagnosticStatus.WARN, problem
        else:
            level, message = DiagnosticStatus.OK, ("ready" if self.params["turn"] else "ready; turning is off")
        status = DiagnosticStatus(level=level, message=message)
        values = {"cmd_vel_type": TWIST_STAMPED if self.stamped else TWIST,
                  "cmd_vel_matched": str(self.pub_cmd.get_subscription_count()),
                  "turning": str(self.turns.active), "planner_goal_sent": str(self.goal_sent)}
        publish_status(self, self.pub_diagnostics, status, values)

    def turn_clock(self) -> float:
        """Seconds on the clock a turn's duration runs on: a simulator's under use_sim_time (its
        base turns the commanded rate per simulated second, and the timer ticks on it; timed in wall
        seconds, a world at half real time turned half the angle), else the steady clock."""
        clock = self.get_clock()
        return clock.now().nanoseconds * 1e-9 if clock.ros_time_is_active else time.monotonic()

    def send_turn(self, at_start: bool = False) -> None:
        """The turn's Twist now: on the timer's tick, or `at_start` (at once, holding until the
        timer's next tick)."""
        with self.turn_lock:
            was_turning = self.turns.active
            until_tick = self.turn_timer.time_until_next_call() if at_start else None
            twist = self.turns.tick(self.turn_clock(), None if until_tick is None else until_tick * 1e-9)
            if twist is not None:
                self.publish_velocity(twist)
        if was_turning and not self.turns.active:
            # when it really ended, on the clock the camera's stamps are compared with: a turn lasts
            # wall seconds, which under sim time at another rate are not as many ROS seconds
            self.still_since = self.get_clock().now()

    def apply_params(self, changes: dict) -> None:
        """`turn` off means no motion at all, from now: a turn in progress ends with a zero Twist
        at once, not at max_turn_s (a base without a command timeout turned on meanwhile).
        `publish_goal` off hands turning back to the loop: nothing here can tell when a goal sent
        on goal_pose has ended, so the operator's switch is what says the planner is done."""
        if changes.get("publish_goal") is False and self.goal_sent:
            self.goal_sent = False
            self.say("publish_goal is off: turns toward targets are the loop's again")
        if changes.get("turn") is False:
            with self.turn_lock:
                stopped = self.end_turn()
            if stopped:
                self.say("turning is off: stopped the turn")

    def end_turn(self) -> bool:
        """End a turn in progress now with a zero Twist; whether there was one. Under turn_lock."""
        if not self.turns.stop():
            return False
        self.publish_velocity(Twist())
        self.still_since = self.get_clock().now()
        return True

    def on_transcript(self, msg: Transcript) -> None:
        if is_stop(msg.text):   # partial or not, whole or not, however old: stopping is always safe
            self.stop(msg.text)
            return
        if not msg.is_final:
            return   # a partial transcript is for display; the final one replaces it
        refusal = incomplete_reason(msg)
        if refusal:
            self.say(refusal)
            return
        too_old = age_refusal(msg.text, command_age(msg, self.get_clock().now().nanoseconds),
                              self.params["max_command_age_s"])
        if too_old:
            self.say(too_old)
            return
        request = parse_command(msg.text)
        if request is None:
            self.say(f"no vision command in {msg.text!r} (one sentence: 'point at X', 'look at X', "
                     "'where is X', 'find X', 'show me X', ...)")
            return
        if not self.find.server_is_ready():
            self.say(f"cannot {request.task} at {request.target!r}: the vision node's find action is not available")
            return
        with self.turn_lock:   # as in stop(): a result being handled checks the number under it
            self.command += 1
            turned = self.end_turn()
        if turned:   # a turn toward what the speaker no longer wants: it would go on for up to max_turn_s
            self.say("stopped the turn in progress: a new command came")
        if self.goal is not None:
            self.goal.cancel_goal_async()   # what it was looking for is no longer wanted
            self.say("canceled the previous search: a new command came")
        self.say(f"{request.task}: looking for {request.target!r}")
        latest = not self.unstamped_frames
        self.asked = (self.get_clock().now().nanoseconds, latest)
        sent = self.find.send_goal_async(Find.Goal(task=request.task, prompt=request.target, use_latest_frame=latest,
                                                   timeout_s=float(self.params["search_timeout_s"])))
        sent.add_done_callback(lambda f, n=self.command: self.on_accepted(request, f, n))

    def stop(self, text: str) -> None:
        """A spoken stop: the search in progress is canceled (a result still coming is dropped) and
        a turn in progress ends now with a zero Twist. A goal on goal_pose is the planner's."""
        stopped = []
        with self.turn_lock:
            # any result still coming belongs to an older command: dropped (a result being handled
            # now checks the number again under this lock before its turn starts)
            self.command += 1
        if self.goal is not None:
            self.goal.cancel_goal_async()
            self.goal = None
            stopped.append("the search")
        with self.turn_lock:
            if self.end_turn():
                stopped.append("the turn")
        planner = " (a goal sent on goal_pose is the planner's to cancel)" if self.goal_sent else ""
        self.say(f"{text.strip()!r}: stopped {' and '.join(stopped)}{planner}" if stopped
                 else f"{text.strip()!r}: nothing to stop{planner}")

    def on_accepted(self, request: VisionRequest, future, command: int) -> None:
        handle = future.result()
        if not handle.accepted:
            self.say(f"the vision node refused to {request.task} at {request.target!r}")
            return
        if command != self.command:   # a newer command came before this one was accepted
            handle.cancel_goal_async()
            return
        self.goal = handle
        handle.get_result_async().add_done_callback(lambda f: self.on_result(request, f, handle, command))

    def on_result(self, request: VisionRequest, future, handle, command: int) -> None:
        # Raised into the executor, an error here would end the spin of every node in the process
        # (bringup runs vision, speech and the loop in one): the result is not acted on, and said.
        try:
            self.act_on_result(request, future, handle, command)
        except Exception as err:  # noqa: BLE001
            self.get_logger().error(f"result of {request.task} {request.target!r} not acted on: "
                                    f"{type(err).__name__}: {err}")
            self.say(f"found nothing to act on: the result could not be read ({type(err).__name__})")

    def act_on_result(self, request: VisionRequest, future, handle, command: int) -> None:
        if self.goal is handle:
            self.goal = None
        if command != self.command:
            return   # replaced by a newer command (said when it came), whatever this one found
        try:
            outcome = future.result()
        except Exception as err:  # noqa: BLE001 - a failed call is reported, not raised into the executor
            self.say(f"vision request failed: {err}")
            return
        response = outcome.result
        if outcome.status == GoalStatus.STATUS_CANCELED:
            return   # replaced by a newer command (said when it was canceled)
        if not response.success:
            self.say(f"vision request failed: {response.message}")
            return
        target = target_from_response(request, response)
        if target is None:
            self.say(f"no {request.target} in view")
            return
        self.pub_image_target.publish(target)
        stale = self.taken_before_last_turn(target.header.stamp)
        if target.header.stamp.sec == 0 and target.header.stamp.nanosec == 0:
            self.unstamped_frames = True
        if stale:
            self.say(f"found {request.target}, but {stale}: not acting on it (ask again)")
            return
        found = (f"found {request.target} at pixel ({target.x_px:.0f}, {target.y_px:.0f}) of the "
                 f"{target.image_width}x{target.image_height} image")
        placed, why_not = position_from_response(response)
        if placed is None:
            found += f"; no 3D position ({why_not}): image coordinates on image_target only"
            heading = bearing(target.x, math.radians(self.params["horizontal_fov_deg"]))
        else:
            p = placed.pose.position
            frame = response.objects_3d.header.frame_id
            self.pub_target.publish(PointStamped(header=response.objects_3d.header, point=p))
            found += f"; at ({p.x:.2f}, {p.y:.2f}, {p.z:.2f}) m in {frame} on target"
            # In the camera's optical frame (z forward, x right) and in the robot's (REP-103: x
            # forward, y left) the bearing is exact, whatever the camera's mounting; in another
            # frame its axes are not known here, so the image's field of view gives it.
            if frame and frame == target.header.frame_id:
                heading = math.atan2(-p.x, p.z)
            elif frame and frame == self.params["robot_frame"]:
                heading = math.atan2(p.y, p.x)
            else:
                heading = bearing(target.x, math.radians(self.params["horizontal_fov_deg"]))
            if self.params["publish_goal"]:
                sent, said = self.send_goal(response.objects_3d.header, p)
                if sent:   # the planner's controller drives cmd_vel now: a turn of ours would fight it
                    self.say(f"{found}; {said}; no turn of ours")
                    return
                found += "; " + said
        if not self.params["turn"]:
            self.say(f"{found}; turning is off")
            return
        if self.goal_sent:
            # nothing here can cancel a goal published on goal_pose: its controller may still be
            # driving cmd_vel, and a turn of ours would fight it
            self.say(f"{found}; no turn: a planner goal sent earlier may still be driving the robot "
                     "(cancel it in the planner, then set publish_goal false to hand turning back)")
            return
        p = self.params
        turn = plan_turn(heading, p["max_turn_rate"], p["max_turn_s"], math.radians(p["deadband_deg"]))
        unheard = ""
        if turn is not None:
            with self.turn_lock:
                if self.halted:
                    self.say(f"{found}; not turning: the node is shutting down")
                    return
                if not self.params["turn"]:   # switched off while this result was handled
                    self.say(f"{found}; turning is off")
                    return
                if command != self.command:
                    # a stop or a newer command came while this result was handled (the result
                    # callback runs beside the transcript's, on another executor thread)
                    self.say(f"{found}; not turning: a newer command came meanwhile")
                    return
                self.turns.start(turn, self.turn_clock())
            self.send_turn(at_start=True)
            problem = self.check_cmd_vel(turn_starting=True)
            unheard = f" (but {problem})" if problem else ""
        self.say(f"{found}; {describe_turn(turn, heading)}{unheard}")

    def taken_before_last_turn(self, stamp) -> str:
        """Why a result from a frame captured at `stamp` must not move the robot ("" if it may):
        the camera turned since (or was turning), so the bearing it gives is not the robot's now."""
        if not self.params["refuse_frames_before_turn"]:
            return ""
        if self.turns.active:
            return "its frame was captured before the last turn ended (the robot is still turning)"
        captured = stamp.sec * 1_000_000_000 + stamp.nanosec   # integers: rclpy's Time refuses a negative stamp
        if self.still_since is None:
            return ""
        if captured == 0:
            asked_at, latest = self.asked
            if not latest and asked_at >= self.still_since.nanoseconds:
                return ""   # the next frame after a goal sent once the robot was still
            return ("its frame is unstamped (a zero stamp), so it may have been captured before the last "
                    "turn ended; commands from now on ask for the next frame, not the latest")
        if captured >= self.still_since.nanoseconds:
            return ""
        return (f"its frame was captured {(self.still_since.nanoseconds - captured) / 1e9:.1f} s before the "
                "last turn ended")

    def send_goal(self, header, position) -> tuple[bool, str]:
        """A planner goal `goal_standoff_m` short of the object, facing it, on goal_pose; what was
        done (whether a goal went out, and what to say). The goal is placed from the frame's origin, so the frame must be the
        robot's (`robot_frame`, the vision node's target_frame): nav2 transforms it from there."""
        if header.frame_id != self.params["robot_frame"] or not header.frame_id:
            return False, (f"no goal: positions are in {header.frame_id or 'an unnamed frame'!r}, not the robot's "
                           f"frame {self.params['robot_frame']!r} (set the vision node's target_frame to it)")
        goal = approach_goal(position.x, position.y, self.params["goal_standoff_m"])
        if goal is None:
            return False, f"no goal: already within {self.params['goal_standoff_m']:g} m"
        x, y, yaw = goal
        msg = PoseStamped(header=header)
        msg.pose.position.x, msg.pose.position.y = x, y
        msg.pose.orientation.z, msg.pose.orientation.w = math.sin(yaw / 2), math.cos(yaw / 2)
        self.pub_goal.publish(msg)
        self.goal_sent = True
        return True, f"goal ({x:.2f}, {y:.2f}) m in {header.frame_id} on goal_pose"

    def stop_for_shutdown(self) -> None:
        """A turn in progress ends here, not when the base's timeout (if any) fires: called first at
        shutdown, before waiting for callbacks that may run for seconds (run_node)."""
        with self.turn_lock:
            self.halted = True   # a result still being handled starts no turn after this
            stopped = self.turns.stop()
            if stopped:
                self.publish_velocity(Twist())
        if stopped:
            # the process ends next: a stop still queued in DDS went with it, and the base turned on
            # (until its own command timeout, if it has one)
            self.pub_cmd.wait_for_all_acked(Duration(seconds=STOP_ACK_S))

    def destroy_node(self) -> None:
        self.stop_for_shutdown()
        super().destroy_node()


def main(args=None) -> None:
    exit_on_help(args, __doc__, "photon_ros.loop_node", "loop")
    run_node(LoopNode, args)


if __name__ == "__main__":
    main()
