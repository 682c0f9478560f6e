"""The loop node's decisions about what it acts on (a real LoopNode; the action's futures and
handles are stand-ins, to order their callbacks as a network may): only the newest command's
result moves the robot, goals come only from positions in the robot's own frame, and a result
from a frame taken before the last turn ended does not turn it again."""
from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import rclpy
from action_msgs.msg import GoalStatus
from builtin_interfaces.msg import Time
from geometry_msgs.msg import Point
from rclpy.parameter import Parameter
from std_msgs.msg import Header

from photon_ros.action import Find
from photon_ros.commands import VisionRequest
from photon_ros.loop_node import LoopNode
from photon_ros.msg import ImagePoint, Object3D


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
    assert any("said 30.0 s ago" in s and "max_command_age_s" in s for s in loop.said), loop.said
    loop.said.clear()
    fresh = Transcript(text="Point at the red cup.", is_final=True, audio_complete=True)
    fresh.header.stamp = now(loop)
    loop.on_transcript(fresh)   # (no find server here: it says so, past the age check)
    assert loop.said and not any("ago" in s for s in loop.said) and "not available" in loop.said[-1]


def test_a_result_handled_after_the_stop_starts_no_turn(loop):
    """At shutdown the zero Twist goes out first; a result callback still running then (the
    executor waits for it) must not start a turn after it."""
    loop.stop_for_shutdown()
    loop.command = 1
    loop.on_result(POINT, done(found(now(loop))), Handle(), command=1)
    assert not loop.turns.active and any("shutting down" in s for s in loop.said)
