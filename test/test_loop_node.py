"""The loop node's decisions about what it acts on (a real LoopNode; the action's futures and
handles are stand-ins, to order their callbacks as a network may): only the newest command's
result moves the robot, goals come only from positions in the robot's own frame, and a result
from a frame taken before the last turn ended does not turn it again."""
from __future__ import annotations

import re
import time
from types import SimpleNamespace

import pytest
import rclpy
from action_msgs.msg import GoalStatus
from builtin_interfaces.msg import Time
from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus
from geometry_msgs.msg import Point, Twist, TwistStamped
from rclpy.parameter import Parameter
from rclpy.qos import QoSProfile, ReliabilityPolicy
from std_msgs.msg import Header

from photon_ros.action import Find
from photon_ros.commands import VisionRequest
from photon_ros.loop_node import TWIST, TWIST_STAMPED, LoopNode, cmd_vel_problem
from photon_ros.msg import ImagePoint, Object3D
from ros_harness import RosGraph, wait_for, wait_for_match


@pytest.fixture
def loop():
    ctx = rclpy.Context()
    rclpy.init(context=ctx)
    node = LoopNode(context=ctx, parameter_overrides=[Parameter("publish_goal", value=True),
                                                      Parameter("max_turn_s", value=0.2)])
    said: list[str] = []
    node.say = said.append          # what it would put on status
    node.said = said
    yield node
    node.destroy_node()
    rclpy.shutdown(context=ctx)


class Handle:
    def __init__(self, accepted=True):
        self.accepted, self.canceled = accepted, False

    def cancel_goal_async(self):
        self.canceled = True

    def get_result_async(self):
        return SimpleNamespace(add_done_callback=lambda cb: None)


def done(value):
    return SimpleNamespace(result=lambda: value)


def found(stamp: Time, frame: str = "camera_color_optical_frame", placed_frame: str | None = None) -> SimpleNamespace:
    """A find result: a point right of the image centre, placed in 3D in `placed_frame` if given."""
    r = Find.Result(success=True)
    r.points.header = Header(stamp=stamp, frame_id=frame)
    r.points.image_width, r.points.image_height = 640, 480
    r.points.points = [ImagePoint(x=0.8, y=0.5, x_px=512.0, y_px=240.0)]
    if placed_frame is not None:
        r.objects_3d.header = Header(stamp=stamp, frame_id=placed_frame)
        r.objects_3d.task = "point"
        r.objects_3d.objects = [Object3D(has_position=True)]
        r.objects_3d.objects[0].pose.position = Point(x=2.0, y=-0.5, z=0.0)
    return SimpleNamespace(status=GoalStatus.STATUS_SUCCEEDED, result=r)


def now(node) -> Time:
    return node.get_clock().now().to_msg()


POINT = VisionRequest("point", "red cup")


def test_only_the_newest_commands_result_is_acted_on(loop):
    loop.command = 2                                       # a second command came meanwhile
    late = Handle()
    loop.on_accepted(POINT, done(late), command=1)         # the first one's acceptance, late
    assert late.canceled and loop.goal is None
    loop.on_result(POINT, done(found(now(loop))), late, command=1)   # its result, succeeded anyway
    assert not any("found" in s for s in loop.said) and not loop.turns.active
    loop.on_result(POINT, done(found(now(loop))), Handle(), command=2)
    assert any("found red cup" in s for s in loop.said) and loop.turns.active


@pytest.mark.parametrize("frame, goal", [("base_link", True), ("camera_color_optical_frame", False),
                                         ("map", False), ("", False)])
def test_goals_only_from_positions_in_the_robots_frame(loop, frame, goal):
    loop.command = 1
    sent = []
    loop.pub_goal.publish = sent.append
    loop.on_result(POINT, done(found(now(loop), frame="", placed_frame=frame)), Handle(), command=1)
    assert bool(sent) == goal, loop.said
    assert loop.turns.active != goal        # a goal: the planner drives, no turn of ours fights it
    if not goal:
        assert any("no goal" in s and "not the robot's frame 'base_link'" in s for s in loop.said)


def test_a_search_timeout_no_goal_can_take_is_refused_when_set(loop):
    """A search_timeout_s past threading.TIMEOUT_MAX was taken, and the vision node refused every
    find goal with it ("the vision node refused to point at ..." and no reason)."""
    result = loop.set_parameters([Parameter("search_timeout_s", value=1e12)])[0]
    assert not result.successful and "search_timeout_s must be <=" in result.reason
    assert loop.set_parameters([Parameter("search_timeout_s", value=0.0)])[0].successful   # no limit


def test_publish_goal_off_hands_turning_back_to_the_loop(loop):
    """After a planner goal the loop leaves cmd_vel alone; turning publish_goal off is how the
    operator says the planner is done (nothing here can tell): the next target turns again."""
    loop.pub_goal.publish = lambda msg: None
    loop.command = 1
    loop.on_result(POINT, done(found(now(loop), frame="", placed_frame="base_link")), Handle(), command=1)
    assert loop.goal_sent and not loop.turns.active
    loop.command = 2
    loop.on_result(POINT, done(found(now(loop))), Handle(), command=2)
    assert not loop.turns.active and "set publish_goal false" in loop.said[-1]
    loop.set_parameters([Parameter("publish_goal", value=False)])
    assert not loop.goal_sent and "the loop's again" in loop.said[-1]
    loop.command = 3
    loop.on_result(POINT, done(found(now(loop))), Handle(), command=3)
    assert loop.turns.active, loop.said


def test_a_target_placed_in_the_optical_frame_turns_by_its_3d_bearing(loop):
    """In the camera's optical frame (x right, z forward) the bearing comes from the 3D position,
    atan2(-x, z): an object placed left of the axis turns the robot left (positive yaw), even
    where the image's field of view would have read the point otherwise."""
    twists = []
    loop.publish_velocity = twists.append
    loop.command = 1
    result = found(now(loop), placed_frame="camera_color_optical_frame")   # the image's point: right of centre
    result.result.objects_3d.objects[0].pose.position = Point(x=-1.0, y=0.0, z=2.0)
    loop.on_result(POINT, done(result), Handle(), command=1)
    assert loop.turns.active and twists and twists[0].angular.z > 0, (twists, loop.said)


def test_a_target_placed_in_the_robots_frame_turns_by_its_bearing_there(loop):
    """In the robot's frame (x forward, y left) the bearing is atan2(y, x), exact however the
    camera is mounted (one yawed on its mast sees an object left of the robot right of centre)."""
    twists = []
    loop.publish_velocity = twists.append
    loop.set_parameters([Parameter("publish_goal", value=False)])
    loop.command = 1
    result = found(now(loop), frame="camera_color_optical_frame", placed_frame="base_link")
    result.result.objects_3d.objects[0].pose.position = Point(x=2.0, y=1.0, z=0.0)   # left of the robot
    loop.on_result(POINT, done(result), Handle(), command=1)
    assert loop.turns.active and twists and twists[0].angular.z > 0, (twists, loop.said)


def end_turn(loop) -> None:
    """The turn's ticks until its zero Twist, as the node's 10 Hz timer would send them."""
    while loop.turns.active:
        time.sleep(0.05)
        loop.send_turn()


def test_a_frame_taken_before_the_last_turn_ended_does_not_turn_the_robot_again(loop):
    loop.command = 1
    before = now(loop)
    loop.on_result(POINT, done(found(before)), Handle(), command=1)
    assert loop.turns.active                               # the first result turns
    loop.command = 2
    loop.on_result(POINT, done(found(now(loop))), Handle(), command=2)   # a frame taken while turning
    assert any("still turning" in s for s in loop.said)
    end_turn(loop)
    loop.command = 3
    loop.on_result(POINT, done(found(before)), Handle(), command=3)   # a frame from before that turn
    assert any("before the last turn ended" in s for s in loop.said) and not loop.turns.active
    loop.command = 4
    loop.said.clear()
    loop.on_result(POINT, done(found(now(loop))), Handle(), command=4)
    assert any("found red cup" in s for s in loop.said) and not any("before the last turn" in s for s in loop.said)
    assert loop.turns.active


def test_a_frame_stamped_before_1970_after_a_turn_is_said_not_raised(loop):
    """rclpy's Time refuses a negative stamp: raised in the result's callback, it ended the spin of
    every node of the process (bringup runs vision, speech and the loop in one)."""
    loop.command = 1
    loop.on_result(POINT, done(found(now(loop))), Handle(), command=1)
    end_turn(loop)
    loop.command = 2
    loop.on_result(POINT, done(found(Time(sec=-1, nanosec=500_000_000))), Handle(), command=2)
    assert any("before the last turn ended" in s for s in loop.said) and not loop.turns.active


class FindClient:
    """The find action's client as the loop uses it: the goals it was sent."""
    def __init__(self):
        self.goals = []

    def server_is_ready(self):
        return True

    def send_goal_async(self, goal):
        self.goals.append(goal)
        return SimpleNamespace(add_done_callback=lambda cb: None)


def command(loop, text: str = "point at the red cup"):
    from photon_ros.msg import Transcript
    loop.on_transcript(Transcript(text=text, is_final=True, audio_complete=True))


def test_an_unstamped_frame_after_a_turn_is_not_acted_on_and_later_goals_ask_for_the_next_frame(loop):
    """A zero stamp says nothing of when the frame was taken: the latest frame may predate the last
    turn. Once one is seen the loop asks for the next frame, which arrives after its goal went out."""
    unstamped = Time(sec=0, nanosec=0)
    loop.find = FindClient()
    command(loop)
    assert loop.find.goals[-1].use_latest_frame
    loop.on_result(POINT, done(found(unstamped)), Handle(), command=loop.command)   # no turn yet: acted on
    assert loop.turns.active
    end_turn(loop)
    loop.said.clear()
    command(loop)
    assert not loop.find.goals[-1].use_latest_frame      # learned: the camera does not stamp
    assert loop.find.goals[-1].timeout_s == 30.0         # a camera that stops: the wait ends, said
    loop.on_result(POINT, done(found(unstamped)), Handle(), command=loop.command)
    assert loop.turns.active and not any("unstamped" in s for s in loop.said), loop.said
    end_turn(loop)
    loop.command += 1
    loop.asked = (loop.asked[0], True)                   # a latest frame, asked before the turn ended
    loop.on_result(POINT, done(found(unstamped)), Handle(), command=loop.command)
    assert any("unstamped" in s for s in loop.said) and not loop.turns.active
    loop.said.clear()
    loop.command += 1
    loop.asked = (loop.asked[0], False)                  # the next frame, but asked before the turn ended
    loop.on_result(POINT, done(found(unstamped)), Handle(), command=loop.command)
    assert any("unstamped" in s for s in loop.said) and not loop.turns.active


def test_a_result_the_loop_cannot_read_is_said_not_raised(loop):
    loop.command = 1
    loop.on_result(POINT, done(SimpleNamespace(status=0, result=None)), Handle(), command=1)
    assert not loop.turns.active and any("could not be read" in s for s in loop.said)


def test_the_turns_end_is_taken_on_the_nodes_clock_when_it_ends(loop):
    """Under sim time the clock may run at another rate than the turn's wall seconds: the end is
    read off the node's clock when the zero Twist goes out, not predicted from the duration."""
    loop.command = 1
    loop.on_result(POINT, done(found(now(loop))), Handle(), command=1)
    assert loop.still_since is None and loop.turns.active
    end_turn(loop)
    after = loop.get_clock().now()
    assert loop.still_since is not None and loop.still_since <= after
    assert (after - loop.still_since).nanoseconds < 0.5e9


def test_under_sim_time_a_turn_lasts_its_duration_in_simulated_seconds():
    """A simulated base turns the commanded rate per simulated second: the turn is timed on the
    simulator's clock (/clock), whatever the wall clock does meanwhile. Timed in wall seconds, a
    world slower than real time under-turned (and here, with simulated time racing ahead, the rate
    went on for every tick of 0.2 wall seconds)."""
    from rosgraph_msgs.msg import Clock

    graph = RosGraph()
    try:
        loop = graph.add(LoopNode(context=graph.context, parameter_overrides=[
            Parameter("use_sim_time", value=True), Parameter("max_turn_s", value=0.2),
            Parameter("refuse_frames_before_turn", value=False)]))
        loop.say = lambda text: None
        clock = graph.node("sim").create_publisher(Clock, "/clock", QoSProfile(
            depth=10, reliability=ReliabilityPolicy.RELIABLE))
        wait_for_match(clock)

        def sim_time(seconds: float) -> None:
            clock.publish(Clock(clock=Time(sec=int(seconds), nanosec=round(seconds % 1 * 1e9))))
            assert wait_for(lambda: abs(loop.get_clock().now().nanoseconds * 1e-9 - seconds) < 1e-6)

        sim_time(100.0)
        sent: list[tuple[float, float]] = []   # (simulated seconds, rate) of each Twist
        loop.publish_velocity = lambda t: sent.append((loop.get_clock().now().nanoseconds * 1e-9, t.angular.z))
        loop.command = 1
        loop.on_result(POINT, done(found(now(loop))), Handle(), command=1)   # 0.2 s at the full rate
        assert loop.turns.active and sent
        for tick in range(1, 6):   # the node's 10 Hz timer ticks on simulated time, 0.1 s apart here
            sim_time(100.0 + 0.1 * tick)
            assert wait_for(lambda: sent[-1][0] > 100.0 + 0.1 * tick - 0.01 or not loop.turns.active)
        assert wait_for(lambda: not loop.turns.active) and sent[-1][1] == 0.0, sent
        # each Twist holds until the next: the plan's angle (0.5 rad/s for 0.2 s) in simulated seconds
        angle = sum(rate * (t1 - t0) for (t0, rate), (t1, _) in zip(sent, sent[1:]))
        assert abs(angle) == pytest.approx(0.1, abs=1e-6), sent
    finally:
        graph.close()


def test_no_turn_of_ours_once_a_planner_goal_went_out(loop):
    loop.command = 1
    sent = []
    loop.pub_goal.publish = sent.append
    loop.on_result(POINT, done(found(now(loop), frame="", placed_frame="base_link")), Handle(), command=1)
    assert sent and not loop.turns.active
    loop.command = 2                                       # a later result without depth: a turn, once
    loop.on_result(POINT, done(found(now(loop))), Handle(), command=2)
    assert not loop.turns.active
    assert any("planner goal sent earlier" in s for s in loop.said)


def test_replays_turn_the_stale_frame_rule_off():
    """In a bag evaluation the frames were captured with the recording robot's motion, on a clock
    the graph does not share (their stamps are all 'before' a turn ended now): the evaluator turns
    the rule off, and every command's result is acted on."""
    from photon_ros.evaluate import Inputs, input_overrides
    assert input_overrides(Inputs(bag=None))["loop"] == {"refuse_frames_before_turn": False, "max_command_age_s": 0.0}
    ctx = rclpy.Context()
    rclpy.init(context=ctx)
    node = LoopNode(context=ctx, parameter_overrides=[Parameter("refuse_frames_before_turn", value=False)])
    try:
        node.say = lambda text: None
        old = Time(sec=1000)                                  # a recording's stamps
        node.command = 1
        node.on_result(POINT, done(found(old)), Handle(), command=1)
        assert node.turns.active
        end_turn(node)
        node.command = 2
        node.on_result(POINT, done(found(old)), Handle(), command=2)
        assert node.turns.active
    finally:
        node.destroy_node()
        rclpy.shutdown(context=ctx)


def test_a_command_said_long_ago_is_not_acted_on(loop):
    """A speech node behind on its backlog (up to max_pending_s, 60 s) may publish a command long
    after it was said: the robot must not move on it."""
    from builtin_interfaces.msg import Duration
    from photon_ros.msg import Transcript
    said_at = loop.get_clock().now() - rclpy.duration.Duration(seconds=32.0)
    old = Transcript(text="Point at the red cup.", is_final=True, audio_complete=True,
                     audio_duration=Duration(sec=2))
    old.header.stamp = said_at.to_msg()
    loop.on_transcript(old)
    # its age: 30 s and however long this took to run (a loaded machine: 30.1 s or more)
    ages = [float(m.group(1)) for s in loop.said if "max_command_age_s" in s
            for m in [re.search(r"said (\d+\.\d) s ago", s)] if m]
    assert ages and 30.0 <= ages[0] < 40.0, loop.said
    loop.said.clear()
    fresh = Transcript(text="Point at the red cup.", is_final=True, audio_complete=True)
    fresh.header.stamp = now(loop)
    loop.on_transcript(fresh)   # (no find server here: it says so, past the age check)
    assert loop.said and not any("ago" in s for s in loop.said) and "not available" in loop.said[-1]


class Sent:
    """send_goal_async's future: its done callback, kept to be called as the acceptance comes."""
    def __init__(self):
        self.callbacks = []

    def add_done_callback(self, cb):
        self.callbacks.append(cb)


def stand_in_server(loop) -> list[Sent]:
    sent: list[Sent] = []
    loop.find.server_is_ready = lambda: True
    loop.find.send_goal_async = lambda goal: sent.append(Sent()) or sent[-1]
    return sent


def spoken(loop, seconds_ago: float, text: str = "Point at the red cup."):
    from photon_ros.msg import Transcript
    msg = Transcript(text=text, is_final=True, audio_complete=True)
    msg.header.stamp = (loop.get_clock().now() - rclpy.duration.Duration(seconds=seconds_ago)).to_msg()
    return msg


def test_a_command_stamped_far_ahead_of_the_nodes_clock_is_not_acted_on(loop):
    """Stamps on another clock than the node's (wall-clock audio and a loop on use_sim_time, or a
    simulator's clock not started) read as said in the future: the age rule would never fire, so
    the command is refused and the status says why; a small offset between computers is not."""
    sent = stand_in_server(loop)
    loop.on_transcript(spoken(loop, -60.0))
    assert not sent and any("ahead of this node's clock" in s and "use_sim_time" in s for s in loop.said), loop.said
    loop.on_transcript(spoken(loop, -0.5))
    assert len(sent) == 1


@pytest.mark.parametrize("final", [False, True], ids=["partial", "final"])
def test_a_spoken_stop_ends_the_turn_and_the_search_at_once(loop, final):
    """"Stop" is obeyed from the first partial transcript that says it (stopping is always safe):
    the turn in progress ends with a zero Twist now, not at max_turn_s, the search in progress is
    canceled, and its result, still coming, moves nothing."""
    from photon_ros.msg import Transcript
    twists = []
    loop.publish_velocity = twists.append
    sent = stand_in_server(loop)
    loop.on_transcript(spoken(loop, 0.0, "Find the mug."))
    search = Handle()
    sent[0].callbacks[0](done(search))
    assert loop.goal is search
    # a turn beside the search (a new command ends the turn before it: both at once only by a race)
    loop.on_result(POINT, done(found(now(loop))), Handle(), command=loop.command)
    assert loop.turns.active and loop.goal is search
    twists.clear()
    loop.on_transcript(Transcript(text="No, stop!", is_final=final, audio_complete=final))
    assert not loop.turns.active and twists and twists[-1].angular.z == 0.0
    assert search.canceled and loop.goal is None
    assert any("stopped the search and the turn" in s for s in loop.said), loop.said
    loop.on_result(VisionRequest("detect", "mug"), done(found(now(loop))), search, command=2)
    assert not loop.turns.active                                    # its late result moves nothing
    loop.on_transcript(Transcript(text="Stop.", is_final=True, audio_complete=True))
    assert "nothing to stop" in loop.said[-1]


@pytest.mark.parametrize("text", ["Stop right now.", "Don't move!", "Stop turning left.", "Stop the robot!", "Hold on.",
                                  "Emergency stop!", "Hold it", "Stay still", "Hang on", "I said stop", "Wait a second",
                                  "Don't turn", "No!", "point at the red cup stop right now", "find the mug hold on"])
def test_loosely_phrased_stops_end_the_turn(loop, text):
    """Each of these fell through to the parser, which asked for nothing, and the turn went on for
    up to max_turn_s: taken for a stop, from a partial transcript already."""
    from photon_ros.msg import Transcript
    twists = []
    loop.publish_velocity = twists.append
    sent = stand_in_server(loop)
    loop.command = 1
    loop.on_result(POINT, done(found(now(loop))), Handle(), command=1)
    assert loop.turns.active
    loop.on_transcript(Transcript(text=text, is_final=False))
    assert not loop.turns.active and twists[-1].angular.z == 0.0, loop.said
    assert not sent and "stopped the turn" in loop.said[-1], loop.said


def test_a_new_command_ends_the_turn_in_progress(loop):
    """A turn right toward the cup went on while the speaker asked for the mug on the left: the
    search was canceled, but the base turned on the wrong way for up to max_turn_s."""
    twists = []
    loop.publish_velocity = twists.append
    loop.set_parameters([Parameter("max_turn_s", value=3.0)])
    loop.command = 1
    loop.on_result(POINT, done(found(now(loop))), Handle(), command=1)   # right of centre: a turn right
    assert loop.turns.active and twists[-1].angular.z < 0.0
    sent = stand_in_server(loop)
    loop.on_transcript(spoken(loop, 0.0, "Point at the mug on the left."))
    assert len(sent) == 1 and not loop.turns.active and twists[-1].angular.z == 0.0, loop.said
    assert loop.still_since is not None                  # a frame taken while turning moves nothing
    assert any("stopped the turn in progress: a new command came" in s for s in loop.said), loop.said
    twists.clear()
    loop.send_turn()                                      # the timer's next tick: nothing more
    assert not twists


def test_a_stop_said_while_a_result_is_being_handled_starts_no_turn(loop):
    """The action's result callback runs on an executor thread of its own, beside the transcript
    subscription: a "stop" handled after the result passed its command check, and before its
    turn began, found no turn to stop. The turn that began then must not go on after the stop."""
    twists = []
    loop.publish_velocity = twists.append
    loop.command = 1
    checked = loop.taken_before_last_turn

    def stop_meanwhile(stamp):   # runs between act_on_result's command check and the turn's start
        from photon_ros.msg import Transcript
        loop.on_transcript(Transcript(text="Stop!", is_final=False))
        return checked(stamp)
    loop.taken_before_last_turn = stop_meanwhile
    loop.on_result(POINT, done(found(now(loop))), Handle(), command=1)
    assert not loop.turns.active and not any(t.angular.z for t in twists), (twists, loop.said)


def test_a_result_handled_after_the_stop_starts_no_turn(loop):
    """At shutdown the zero Twist goes out first; a result callback still running then (the
    executor waits for it) must not start a turn after it."""
    loop.stop_for_shutdown()
    loop.command = 1
    loop.on_result(POINT, done(found(now(loop))), Handle(), command=1)
    assert not loop.turns.active and any("shutting down" in s for s in loop.said)


RELIABLE = QoSProfile(depth=100, reliability=ReliabilityPolicy.RELIABLE)


@pytest.fixture
def graph():
    """A spun graph: loop nodes added here run their own timers (10 Hz turns, 1 Hz diagnostics)."""
    g = RosGraph()
    yield g
    g.close()


def spun_loop(graph, **params) -> LoopNode:
    loop = graph.add(LoopNode(context=graph.context, parameter_overrides=[
        Parameter(name, value=value) for name, value in params.items()]))
    loop.said = []
    loop.say = loop.said.append
    return loop


@pytest.mark.parametrize("ending", ["its end", "shutdown"])
def test_stamped_cmd_vel_reaches_a_twist_stamped_base(graph, ending):
    """ros2_control's diff_drive_controller (Jazzy on) takes only TwistStamped on cmd_vel: a Twist
    never matches it, and the robot does not move while the loop says it turns."""
    loop = spun_loop(graph, stamped_cmd_vel=True, robot_frame="base_footprint",
                     max_turn_s=0.3 if ending == "its end" else 3.0)
    base = RosGraph()   # the base in a process of its own (a participant of its own)
    try:
        got: list[TwistStamped] = []
        base.node("base").create_subscription(TwistStamped, "cmd_vel", got.append, RELIABLE)
        wait_for_match(loop.pub_cmd)
        assert not loop.set_parameters([Parameter("stamped_cmd_vel", value=False)])[0].successful   # fixed at start
        loop.command = 1
        loop.on_result(POINT, done(found(now(loop))), Handle(), command=1)
        assert loop.turns.active
        if ending == "shutdown":
            assert wait_for(lambda: len(got) >= 2, timeout=5.0)
            loop.stop_for_shutdown()
        assert wait_for(lambda: not loop.turns.active and got and got[-1].twist.angular.z == 0.0, timeout=5.0), got
    finally:
        base.close()
    turning = [m for m in got if m.twist.angular.z != 0.0]
    assert turning and all(m.twist.angular.z < 0 for m in turning)      # the target is right of centre
    assert all(m.header.frame_id == "base_footprint" and m.header.stamp.sec > 0 for m in got)
    assert not any("(but" in s for s in loop.said), loop.said           # the turn reaches the base


@pytest.mark.parametrize("stamped", [False, True])
def test_diagnostics_warn_when_cmd_vel_subscribers_take_the_other_type(graph, stamped):
    """A base that takes the other type matches nothing and nobody logs it: /diagnostics says so,
    naming both types and the parameter, and so does the status of a turn; one of our type is OK."""
    loop = spun_loop(graph, stamped_cmd_vel=stamped, max_turn_s=0.2)
    statuses: list[DiagnosticStatus] = []
    graph.node("watcher").create_subscription(DiagnosticArray, "/diagnostics", lambda a: statuses.extend(
        s for s in a.status if s.name == f"photon_ros: {loop.get_fully_qualified_name()}"), RELIABLE)
    other, ours = (TWIST, TWIST_STAMPED) if stamped else (TWIST_STAMPED, TWIST)
    fix = f"set stamped_cmd_vel {'false' if stamped else 'true'}"
    base = RosGraph()   # a process of its own: one participant refuses two types on one topic
    try:
        base.node("base").create_subscription(Twist if stamped else TwistStamped, "cmd_vel", lambda m: None, RELIABLE)

        def warned() -> bool:
            return any(s.level == DiagnosticStatus.WARN and other in s.message and ours in s.message
                       and fix in s.message and "/base" in s.message for s in statuses)
        assert wait_for(warned, timeout=10.0), [s.message for s in statuses]
        loop.command = 1
        loop.on_result(POINT, done(found(now(loop))), Handle(), command=1)
        assert any("turning" in s and other in s and fix in s for s in loop.said), loop.said
    finally:
        base.close()
    graph.node("mine").create_subscription(TwistStamped if stamped else Twist, "cmd_vel", lambda m: None, RELIABLE)
    seen = len(statuses)
    assert wait_for(lambda: any(s.level == DiagnosticStatus.OK for s in statuses[seen:]), timeout=10.0), \
        [s.message for s in statuses[seen:]]


def test_cmd_vel_problems_in_words():
    assert cmd_vel_problem("/cmd_vel", False, [("/base", TWIST)]) == ("", False)
    assert cmd_vel_problem("/cmd_vel", False, []) == ("nothing subscribes to /cmd_vel: turns move nothing", False)
    mixed, certain = cmd_vel_problem("/cmd_vel", False, [("/rec", TWIST), ("/diff_drive", TWIST_STAMPED)])
    assert certain and "/diff_drive takes geometry_msgs/msg/TwistStamped" in mixed and "/rec" not in mixed
    odd, certain = cmd_vel_problem("/cmd_vel", True, [("/x", "std_msgs/msg/String")])
    assert certain and "std_msgs/msg/String" in odd and "set stamped_cmd_vel" not in odd


def test_turning_switched_off_ends_the_turn_in_progress(loop):
    """`turn` false means no motion at all and applies at once: a turn in progress ends now with a
    zero Twist, not at max_turn_s (a base without a command timeout turned on meanwhile)."""
    twists = []
    loop.publish_velocity = twists.append
    loop.command = 1
    loop.on_result(POINT, done(found(now(loop))), Handle(), command=1)
    assert loop.turns.active and twists[-1].angular.z != 0.0
    assert loop.set_parameters([Parameter("turn", value=False)])[0].successful
    assert not loop.turns.active and twists[-1].angular.z == 0.0, (twists, loop.said)
    assert loop.still_since is not None                  # a frame taken while turning moves nothing
    assert any("turning is off" in s and "stopped the turn" in s for s in loop.said), loop.said
    twists.clear()
    loop.send_turn()                                      # the timer's next tick: nothing more
    assert not twists


def test_turning_switched_off_while_a_result_is_being_handled_starts_no_turn(loop, monkeypatch):
    """The parameter's change runs on an executor thread of its own too: switched off after the
    result passed its `turn` check and before its turn began, no turn begins."""
    import photon_ros.loop_node as loop_node
    twists = []
    loop.publish_velocity = twists.append
    loop.command = 1
    planned = loop_node.plan_turn

    def switch_off_meanwhile(*args):   # runs between act_on_result's `turn` check and the turn's start
        assert loop.set_parameters([Parameter("turn", value=False)])[0].successful
        return planned(*args)
    monkeypatch.setattr(loop_node, "plan_turn", switch_off_meanwhile)
    loop.on_result(POINT, done(found(now(loop))), Handle(), command=1)
    assert not loop.turns.active and not any(t.angular.z for t in twists), (twists, loop.said)
    assert any("turning is off" in s for s in loop.said), loop.said
