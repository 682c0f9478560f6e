"""The vision_msgs side of test_vision_msgs_outputs.py, run in a subprocess whose environment
(interface_workspaces.workspace_env("vision_msgs")) makes `vision_msgs` importable:

  listen NAMESPACE TIMEOUT_S  subscribes to NAMESPACE/detections_2d (Detection2DArray) and
                              NAMESPACE/detections_3d (Detection3DArray), reliable as the vision
                              node publishes them, until a 2D array and a 3D array that placed
                              something came (or TIMEOUT_S passed); exits 0 then, 1 otherwise.
  convert                     stdin: JSON {"detections": ..., "objects_3d": ...}, our Detections
                              and Objects3D field by field (see `detections` and `objects_3d`);
                              converted with photon_ros's detection2d_array / detection3d_array
                              into the real generated classes, serialized to CDR and back.

Both write what they got as JSON on stdout: {"detections_2d": [...], "detections_3d": [...]},
every vision_msgs message field by field."""
from __future__ import annotations

import json
import sys
import time


def _header(h) -> dict:
    return {"sec": h.stamp.sec, "nanosec": h.stamp.nanosec, "frame_id": h.frame_id}


def _pose(p) -> dict:
    return {"position": [p.position.x, p.position.y, p.position.z],
            "orientation": [p.orientation.x, p.orientation.y, p.orientation.z, p.orientation.w]}


def _results(det) -> list[dict]:
    return [{"class_id": r.hypothesis.class_id, "score": r.hypothesis.score, "pose": _pose(r.pose.pose),
             "covariance": list(r.pose.covariance)} for r in det.results]


def detection2d_array(msg) -> dict:
    return {"header": _header(msg.header), "detections": [
        {"header": _header(d.header), "id": d.id, "results": _results(d),
         "center": [d.bbox.center.position.x, d.bbox.center.position.y], "theta": d.bbox.center.theta,
         "size": [d.bbox.size_x, d.bbox.size_y]} for d in msg.detections]}


def detection3d_array(msg) -> dict:
    return {"header": _header(msg.header), "detections": [
        {"header": _header(d.header), "id": d.id, "results": _results(d), "center": _pose(d.bbox.center),
         "size": [d.bbox.size.x, d.bbox.size.y, d.bbox.size.z]} for d in msg.detections]}


def listen(namespace: str, timeout_s: float) -> int:
    import rclpy
    from rclpy.qos import QoSProfile, ReliabilityPolicy
    from vision_msgs.msg import Detection2DArray, Detection3DArray

    rclpy.init()
    node = rclpy.create_node("vision_msgs_listener", namespace=namespace)
    got: dict[str, list] = {"detections_2d": [], "detections_3d": []}
    qos = QoSProfile(depth=10, reliability=ReliabilityPolicy.RELIABLE)
    node.create_subscription(Detection2DArray, "detections_2d",
                             lambda m: got["detections_2d"].append(detection2d_array(m)), qos)
    node.create_subscription(Detection3DArray, "detections_3d",
                             lambda m: got["detections_3d"].append(detection3d_array(m)), qos)
    deadline = time.monotonic() + timeout_s

    def done() -> bool:   # a 2D array, and a 3D one that placed something (a frame may have no 3D)
        return bool(got["detections_2d"]) and any(a["detections"] for a in got["detections_3d"])
    try:
        while not done() and time.monotonic() < deadline:
            rclpy.spin_once(node, timeout_sec=0.1)
    finally:
        node.destroy_node()
        rclpy.try_shutdown()
    print(json.dumps(got))
    return 0 if done() else 1


def _std_header(fields: dict):
    from builtin_interfaces.msg import Time
    from std_msgs.msg import Header
    return Header(stamp=Time(sec=fields["sec"], nanosec=fields["nanosec"]), frame_id=fields["frame_id"])


def detections(fields: dict):
    """Our Detections from {"header", "detections": [{"label", "score", "track_id", "box_px"}]}."""
    from photon_ros.msg import Detection, Detections
    msg = Detections(header=_std_header(fields["header"]))
    for d in fields["detections"]:
        x0, y0, x1, y1 = d["box_px"]
        msg.detections.append(Detection(label=d["label"], score=d["score"], track_id=d["track_id"],
                                        x_min_px=x0, y_min_px=y0, x_max_px=x1, y_max_px=y1))
    return msg


def objects_3d(fields: dict):
    """Our Objects3D from {"header", "objects": [{"label", "score", "track_id", "has_position",
    "position", "size"}]}."""
    from geometry_msgs.msg import Point, Pose, Vector3
    from photon_ros.msg import Object3D, Objects3D
    msg = Objects3D(header=_std_header(fields["header"]), task="detect")
    for o in fields["objects"]:
        msg.objects.append(Object3D(label=o["label"], score=o["score"], track_id=o["track_id"],
                                    has_position=o["has_position"], pose=Pose(position=Point(
                                        x=o["position"][0], y=o["position"][1], z=o["position"][2])),
                                    size=Vector3(x=o["size"][0], y=o["size"][1], z=o["size"][2])))
    return msg


def convert() -> int:
    from rclpy.serialization import deserialize_message, serialize_message

    from photon_ros.result_messages import detection2d_array as to_2d
    from photon_ros.spatial import detection3d_array as to_3d

    cases = json.loads(sys.stdin.read())

    def through_cdr(msg):
        return deserialize_message(serialize_message(msg), type(msg))

    out = {"detections_2d": [detection2d_array(through_cdr(to_2d(detections(cases["detections"]))))],
           "detections_3d": [detection3d_array(through_cdr(to_3d(objects_3d(cases["objects_3d"]))))]}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["listen"]:
        sys.exit(listen(sys.argv[2], float(sys.argv[3])))
    if sys.argv[1:2] == ["convert"]:
        sys.exit(convert())
    sys.exit(f"usage: {sys.argv[0]} listen NAMESPACE TIMEOUT_S | convert")
