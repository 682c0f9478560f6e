"""The observe -> infer -> act loop: a spoken command becomes a target and a turn toward it.

    transcript (photon_ros/Transcript), e.g. "point at the red cup"; only final transcripts of
               complete audio are acted on (half a command must not move the robot)
      -> commands.parse_command -> VisionRequest("point", "red cup")
      -> infer service of the vision node, on its latest frame
      -> target (geometry_msgs/PointStamped, image-normalized or pixel coordinates, the frame's header)
         cmd_vel (geometry_msgs/Twist turning toward the target)
         status (std_msgs/String, for people: what was understood and what was found)
"""
from __future__ import annotations

from geometry_msgs.msg import PointStamped, Twist
from rclpy.node import Node
from rclpy.qos import QoSProfile, ReliabilityPolicy
from std_msgs.msg import String

from photon_ros.params import declarer
from photon_ros.run_node import run_node
from photon_ros.commands import VisionRequest, parse_command
from photon_ros.msg import Transcript
from photon_ros.srv import Infer
from photon_ros.steering import turn_towards


def target_from_response(request: VisionRequest, response: Infer.Response) -> tuple[float, float, float, float] | None:
    """(x, y) normalized and (x, y) in pixels of the first object found, or None."""
    if request.task == "point" and response.points.points:
        p = response.points.points[0]
        return p.x, p.y, p.x_px, p.y_px
    if request.task == "detect" and response.detections.detections:
        d = response.detections.detections[0]
        return ((d.x_min + d.x_max) / 2, (d.y_min + d.y_max) / 2,
                (d.x_min_px + d.x_max_px) / 2, (d.y_min_px + d.y_max_px) / 2)
    return None


def incomplete_reason(msg: Transcript) -> str:
    """Why a final transcript must not be acted on ("" when it may): audio that was cut may hold
    half a command ("go to the kitchen" of "go to the kitchen and wait there")."""
    if msg.audio_complete:
        return ""
    return f"not acting on {msg.text!r}: part of the command was lost ({msg.audio_note or 'no reason given'})"


class LoopNode(Node):
    def __init__(self, **kwargs) -> None:
        super().__init__("loop", **kwargs)
        p = declarer(self)   # a float parameter also takes a whole number
        self.pixels = p("coordinates", "normalized").value == "pixels"
        self.gain = p("turn_gain", 1.5).value
        self.max_rate = p("max_turn_rate", 0.8).value
        reliable = QoSProfile(depth=10, reliability=ReliabilityPolicy.RELIABLE)
        self.pub_target = self.create_publisher(PointStamped, "target", reliable)
        self.pub_cmd = self.create_publisher(Twist, "cmd_vel", reliable)
        self.pub_status = self.create_publisher(String, "status", reliable)
        self.client = self.create_client(Infer, "infer")
        self.create_subscription(Transcript, "transcript", self.on_transcript, reliable)

    def say(self, text: str) -> None:
        self.get_logger().info(text)
        self.pub_status.publish(String(data=text))

    def on_transcript(self, msg: Transcript) -> None:
        if not msg.is_final:
            return   # a partial transcript is for display; the final one replaces it
        refusal = incomplete_reason(msg)
        if refusal:
            self.say(refusal)
            return
        request = parse_command(msg.text)
        if request is None:
            self.say(f"no vision command in {msg.text!r}")
            return
        if not self.client.service_is_ready():
            self.say(f"cannot {request.task} at {request.target!r}: the vision service is not available")
            return
        self.say(f"{request.task}: looking for {request.target!r}")
        future = self.client.call_async(Infer.Request(task=request.task, prompt=request.target,
                                                      use_latest_frame=True))
        future.add_done_callback(lambda f: self.on_result(request, f))

    def on_result(self, request: VisionRequest, future) -> None:
        try:
            response = future.result()
        except Exception as err:  # noqa: BLE001 - a failed call is reported, not raised into the executor
            self.say(f"vision request failed: {err}")
            return
        if not response.success:
            self.say(f"vision request failed: {response.message}")
            return
        found = target_from_response(request, response)
        if found is None:
            self.say(f"no {request.target} in view")
            return
        x, y, x_px, y_px = found
        header = (response.points if request.task == "point" else response.detections).header
        target = PointStamped(header=header)
        target.point.x, target.point.y = (x_px, y_px) if self.pixels else (x, y)
        self.pub_target.publish(target)
        self.pub_cmd.publish(turn_towards(x, self.gain, self.max_rate))
        self.say(f"found {request.target} at ({x:.2f}, {y:.2f}) of the image")


def main(args=None) -> None:
    run_node(LoopNode, args)


if __name__ == "__main__":
    main()
