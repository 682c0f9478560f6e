"""One image's 2D results placed in 3D: Detections / Points -> Objects3D (photon_ros/msg), in the
camera's optical frame or, through a tf2 transform, in the node's target frame.

The depth work is depth_projection's (a DepthView per colour frame, or why the frame has none);
this module turns its answers into messages: every object keeps its place in the 2D result's
order, and one without a position says why (has_position false), never sits at 0 m.
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np
from geometry_msgs.msg import Point, PointStamped, Pose, Quaternion, Vector3
from std_msgs.msg import Header

from photon_ros.depth_projection import DepthView, NoDepth
from photon_ros.frames import Transform, apply
from photon_ros.msg import Object3D, Objects3D

IDENTITY = np.array([0.0, 0.0, 0.0, 1.0])


def objects_3d(task: str, prompt: str, items: Sequence, header, depth: DepthView | NoDepth,
               frame_id: str, transform: Transform | LookupError | None) -> Objects3D:
    """The 3D objects of one 2D result (`items`: its Detection or ImagePoint messages, pixels).
    `header`: the colour image's; `frame_id`: the frame positions end up in (the optical frame's
    name, or the target frame when `transform` moves them there); a LookupError for `transform`
    says why they cannot be (no object gets a position)."""
    # A header of its own: the 2D result keeps the image's frame.
    msg = Objects3D(header=Header(stamp=header.stamp, frame_id=frame_id), task=task, prompt=prompt)
    boxes = task == "detect"
    corners = [((d.x_min_px, d.y_min_px, d.x_max_px, d.y_max_px) if boxes else (d.x_px, d.y_px, d.x_px, d.y_px))
               for d in items]
    note = (depth.reason if isinstance(depth, NoDepth)
            else f"no target frame transform: {transform}" if isinstance(transform, LookupError) else "")
    msg.depth_note = note
    placed: list = [NoDepth(note)] * len(items) if note else (
        depth.boxes_3d(corners) if boxes else depth.points_3d([c[:2] for c in corners]))
    for item, box, found in zip(items, corners, placed):
        obj = Object3D(label=item.label, score=float(item.score) if hasattr(item, "score") else math.nan,
                       track_id=item.track_id, x_min_px=box[0], y_min_px=box[1], x_max_px=box[2], y_max_px=box[3])
        if isinstance(found, NoDepth):
            obj.has_position, obj.reason = False, found.reason
        else:
            position, orientation = np.array([found.x, found.y, found.z]), IDENTITY
            if transform is not None:
                position, orientation = apply(transform, position, orientation)
            obj.has_position = True
            obj.pose = Pose(position=Point(x=float(position[0]), y=float(position[1]), z=float(position[2])),
                            orientation=Quaternion(x=float(orientation[0]), y=float(orientation[1]),
                                                   z=float(orientation[2]), w=float(orientation[3])))
            if boxes:
                obj.size = Vector3(x=float(found.size_x), y=float(found.size_y), z=float(found.size_z))
        msg.objects.append(obj)
    return msg


def point_positions(msg: Objects3D) -> list[PointStamped]:
    """Each placed object's position as a PointStamped (metres, in the message's frame)."""
    return [PointStamped(header=msg.header, point=o.pose.position) for o in msg.objects if o.has_position]


def detection3d_array(msg: Objects3D):
    """Placed boxes as vision_msgs/Detection3DArray, or None where vision_msgs is not installed."""
    try:
        from vision_msgs.msg import Detection3D, Detection3DArray, ObjectHypothesisWithPose
    except ImportError:
        return None
    out = Detection3DArray(header=msg.header)
    for o in msg.objects:
        if not o.has_position:
            continue
        det = Detection3D(header=msg.header, id=str(o.track_id) if o.track_id else "")
        det.bbox.center, det.bbox.size = o.pose, o.size
        hypothesis = ObjectHypothesisWithPose()
        hypothesis.hypothesis.class_id = o.label
        hypothesis.hypothesis.score = 0.0 if math.isnan(o.score) else float(o.score)
        hypothesis.pose.pose = o.pose
        det.results.append(hypothesis)
        out.detections.append(det)
    return out
