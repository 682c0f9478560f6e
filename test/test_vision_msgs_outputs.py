"""The vision node's optional vision_msgs outputs over DDS: detections_2d (Detection2DArray) and,
with use_depth, detections_3d (Detection3DArray), as robots with vision_msgs installed get them.

vision_msgs is not on PyPI: the test-only stand-in (test/workspaces/vision_msgs, built once into
~/.cache/photon by interface_workspaces) carries its message definitions, with the upstream type
hashes. The vision node runs as its own process (`python -m photon_ros.vision_node`, the tests'
small random Moondream) with that package importable, and so does a vision_msgs listener
(vision_msgs_peer.py); this process is the camera (colour, aligned depth, camera_info) and
receives the node's own Detections and Objects3D of the same frame, which the vision_msgs
messages must say the same as: one detection each, the pixel box (2D) or the pose and size (3D),
the prompt as class_id, the score (0.0 where ours is NaN), the track id as id."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from diagnostic_msgs.msg import DiagnosticArray
from sensor_msgs.msg import CameraInfo, Image

from interface_workspaces import install_dir, package_dir, workspace_env
from moondream_fixtures import checkpoint
from photon_ros.image_conversions import rgb_to_image
from photon_ros.msg import Detections, Objects3D
from ros_harness import RosGraph, interrupt, wait_for
from test_vision_node import RELIABLE, camera_info, header, image, wall_depth

PEER = Path(__file__).with_name("vision_msgs_peer.py")
# RIHS01 type hashes of ros-perception/vision_msgs's definitions (branch ros2 at e77fa2d9, 4.1.1,
# the rolling / Kilted release), computed with `rosidl hash` from its .msg files. Equal hashes mean
# equal field names, types and order: the stand-in's types are the same on the wire.
UPSTREAM_HASHES = {
    "BoundingBox2D": "RIHS01_008eacbb0cf8f26e83795547bed013eec3675485ef386ec056d80eaaf1c1ce2f",
    "BoundingBox2DArray": "RIHS01_2464e82838009386d371b523211c21c91d74d313fcdd6788223c531d621cf691",
    "BoundingBox3D": "RIHS01_bbb73a65c163d7f9bb29009c7bde9f7faa576bd2d23299c4511d19230dab4698",
    "BoundingBox3DArray": "RIHS01_a81938db9576b10c2eecd7c5a5da3eac496efd00221b25ed051dfbc81fb56da6",
    "Classification": "RIHS01_f74db28d0eaef3afb78f48bf2161cd709a1383a0309d3454383b25be11345143",
    "Detection2D": "RIHS01_0d12b69df5c593b3455b7346fac8205437a7d4bcb09b9e0e0b2dde787ded38ea",
    "Detection2DArray": "RIHS01_214274120007f4a683866481336b70310268cfa107aebe9d594a6acf75bda968",
    "Detection3D": "RIHS01_ddd703be132ab0b69d33121f1bb034132bfbb3b0ac5f9fb1516005ba1c8a265b",
    "Detection3DArray": "RIHS01_793f5eab9595ac1c0da07873cc859db42eae51f0ee76056db8562515d830e018",
    "LabelInfo": "RIHS01_3d37df4015cdf660cc851c51897f2acd957e1ca6205ba0a99aebffb9406b0783",
    "ObjectHypothesis": "RIHS01_51da43cec11c01957a64d1e05a24acd18aae7745ec30b74348ad5f6d634f7f90",
    "ObjectHypothesisWithPose": "RIHS01_41c12344c0396c48b81df12467c192d99b2a0eb1463c5c37194e4223251c80bc",
    "Point2D": "RIHS01_eab0e83f44ab4de92ceaf76dd7d0e7638f2bdd1d16ffbe16c7a136c48e407247",
    "Pose2D": "RIHS01_b0b5d1d7b4c20dd4fcde3ed1d4b289a919290572007d67a97043814db25d3648",
    "VisionClass": "RIHS01_1e4a11f0fed50b5623cb8ff26ca0e37952a48a9c074d16f804b44e9164c2037a",
    "VisionInfo": "RIHS01_95d3116a17484ad91c9a2686e1d54890bbfc3ff6c6a2de137738c4950d45d284",
}
PROMPT = "cup"
NODE_START_S = 120.0   # the node's process: imports, model load and warm-up on a busy 2-core machine


def test_stand_in_has_the_upstream_type_hashes():
    workspace_env("vision_msgs")   # builds it when missing
    share = install_dir("vision_msgs") / "share" / "vision_msgs" / "msg"
    names = sorted(p.stem for p in (package_dir("vision_msgs") / "msg").glob("*.msg"))
    assert names == sorted(UPSTREAM_HASHES)
    for name, want in UPSTREAM_HASHES.items():
        hashes = json.loads((share / f"{name}.json").read_text())["type_hashes"]
        assert hashes[0]["type_name"] == f"vision_msgs/msg/{name}"
        assert hashes[0]["hash_string"] == want, name


def test_conversions_through_the_generated_classes():
    """No score (NaN) is 0.0, no track (0) is an empty id, an object without a position is left
    out of the 3D array (never at 0 m); everything else carried over, through CDR."""
    stamp = {"sec": 5, "nanosec": 6, "frame_id": "camera_color_optical_frame"}
    boxes = [{"label": "red cup", "score": math.nan, "track_id": 0, "box_px": [10.5, 20.25, 30.0, 50.5]},
             {"label": "red cup", "score": 0.25, "track_id": 7, "box_px": [0.0, 0.0, 128.0, 96.0]}]
    objects = [{"label": "red cup", "score": math.nan, "track_id": 0, "has_position": True,
                "position": [0.5, -0.25, 1.2], "size": [0.1, 0.2, 0.05]},
               {"label": "red cup", "score": 0.75, "track_id": 4, "has_position": False,
                "position": [0.0, 0.0, 0.0], "size": [0.0, 0.0, 0.0]},
               {"label": "red cup", "score": 0.5, "track_id": 9, "has_position": True,
                "position": [1.0, 2.0, 2.5], "size": [0.3, 0.4, 0.02]}]
    cases = {"detections": {"header": stamp, "detections": boxes},
             "objects_3d": {"header": dict(stamp, frame_id="base_link"), "objects": objects}}
    done = subprocess.run([sys.executable, str(PEER), "convert"], input=json.dumps(cases), text=True,
                          env=workspace_env("vision_msgs"), capture_output=True, timeout=60)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout)
    [d2], [d3] = got["detections_2d"], got["detections_3d"]
    assert d2["header"] == stamp and len(d2["detections"]) == len(boxes)
    for v, box in zip(d2["detections"], boxes):
        x0, y0, x1, y1 = box["box_px"]
        assert v["header"] == stamp
        assert v["center"] == [(x0 + x1) / 2, (y0 + y1) / 2] and v["size"] == [x1 - x0, y1 - y0]
        assert v["id"] == (str(box["track_id"]) if box["track_id"] else "")
        assert [(r["class_id"], r["score"]) for r in v["results"]] == [
            (box["label"], 0.0 if math.isnan(box["score"]) else box["score"])]
        # The hypothesis' pose is a geometry_msgs pose (metres in the header's frame, to tf2): a
        # 2D result has none, so never the pixel centre there.
        assert [r["pose"] for r in v["results"]] == [{"position": [0.0, 0.0, 0.0],
                                                      "orientation": [0.0, 0.0, 0.0, 1.0]}]
    placed = [o for o in objects if o["has_position"]]
    assert d3["header"] == dict(stamp, frame_id="base_link") and len(d3["detections"]) == len(placed) == 2
    for v, o in zip(d3["detections"], placed):
        pose = {"position": o["position"], "orientation": [0.0, 0.0, 0.0, 1.0]}
        assert v["header"] == d3["header"]
        assert v["center"] == pose and v["size"] == o["size"]
        assert v["id"] == (str(o["track_id"]) if o["track_id"] else "")
        [hypothesis] = v["results"]
        assert hypothesis["class_id"] == o["label"] and hypothesis["pose"] == pose
        assert hypothesis["score"] == (0.0 if math.isnan(o["score"]) else o["score"])


def header_dict(h) -> dict:
    return {"sec": h.stamp.sec, "nanosec": h.stamp.nanosec, "frame_id": h.frame_id}


def same_score(vision_msgs: float, ours: float) -> bool:
    """vision_msgs has no "no score": ours is NaN when the model gives none, and 0.0 there. Ours
    is a float32 on the wire, and vision_msgs' float64 holds the node's value before that rounding."""
    return vision_msgs == 0.0 if math.isnan(ours) else float(np.float32(vision_msgs)) == ours


def pixels(values: list[float]) -> pytest.approx:
    """Pixel values as ours carry them: float32 on the wire, while vision_msgs' float64 holds the
    node's values before that rounding (a float32 is within 1e-5 px of them below 1000 px)."""
    return pytest.approx(values, rel=0, abs=1e-4)


def pose_dict(p) -> dict:
    return {"position": [p.position.x, p.position.y, p.position.z],
            "orientation": [p.orientation.x, p.orientation.y, p.orientation.z, p.orientation.w]}


@pytest.fixture
def graph():
    g = RosGraph()
    yield g
    g.close()


def test_detections_2d_and_3d_say_what_our_messages_say(graph, tmp_path):
    ns = f"/vision_msgs_test_{os.getpid()}"
    env = workspace_env("vision_msgs")
    params = {"model": str(checkpoint()), "detect": f"[{PROMPT}]", "point": "[dog]", "use_depth": "true",
              "reliability": "reliable", "max_objects": "2"}
    cmd = [sys.executable, "-m", "photon_ros.vision_node", "--ros-args", "-r", f"__ns:={ns}"]
    for name, value in params.items():
        cmd += ["-p", f"{name}:={value}"]
    log = tmp_path / "vision_node.log"
    camera, listen = graph.node("camera", namespace=ns), graph.node("photon_side", namespace=ns)
    detections, placed, states = [], [], []
    listen.create_subscription(Detections, "detections", detections.append, RELIABLE)
    listen.create_subscription(DiagnosticArray, "/diagnostics", lambda m: states.extend(
        kv.value for s in m.status if ns in s.name for kv in s.values if kv.key == "lifecycle_state"), 10)
    listen.create_subscription(Objects3D, "objects_3d", placed.append, RELIABLE)
    pubs = {name: camera.create_publisher(t, name, RELIABLE) for name, t in
            (("image", Image), ("depth", Image), ("camera_info", CameraInfo))}
    with open(log, "w") as out:
        node = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    listener = subprocess.Popen([sys.executable, str(PEER), "listen", ns, str(NODE_START_S)], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert wait_for(lambda: node.poll() is not None or all(p.get_subscription_count() >= 1
                                                                for p in pubs.values()), timeout=NODE_START_S)
        assert node.poll() is None, log.read_text()[-3000:]
        # Its subscriptions exist from configure on, but frames before activation are ignored
        # (counted, not queued): the first frame goes to an active node.
        assert wait_for(lambda: "active" in states or node.poll() is not None, timeout=NODE_START_S), \
            log.read_text()[-3000:]
        # The listener's subscriptions are known (its node matches the node's publishers long
        # before the frame's inference ends).
        assert wait_for(lambda: all(listen.count_subscribers(f"{ns}/{t}") >= 1
                                    for t in ("detections_2d", "detections_3d")), timeout=60)
        # A frame at a time until the listener has both arrays: seeing the listener's subscriptions
        # from here does not mean the node's publishers have matched them yet (discovery is per
        # process), and a volatile publisher does not resend; each frame has its own stamp, and
        # what the listener got is compared with our messages of the same stamp.
        for i in range(1, 6):
            optical = header(i, "camera_color_optical_frame")
            # Depth and camera_info go to best-effort subscriptions: sent twice, as a camera keeps sending.
            for _ in range(2):
                pubs["camera_info"].publish(camera_info(optical))
                pubs["depth"].publish(wall_depth(optical))
                time.sleep(0.2)
            pubs["image"].publish(rgb_to_image(image(5), header=optical))
            results = wait_for(lambda: any(m.header.stamp == optical.stamp for m in detections)
                               and any(m.task == "detect" and m.header.stamp == optical.stamp for m in placed),
                               timeout=NODE_START_S)
            assert results, log.read_text()[-3000:]
            if wait_for(lambda: listener.poll() is not None, timeout=10):
                break
        got_out, got_err = listener.communicate(timeout=60)
    finally:
        interrupt(node)
        listener.kill()
        listener.wait()
    assert listener.returncode == 0, got_err[-3000:] + log.read_text()[-3000:]
    got = json.loads(got_out)
    assert node.returncode == 0, log.read_text()[-3000:]

    # 2D: one Detection2D per detection, the pixel box, in the image's header.
    d2 = got["detections_2d"][0]
    [ours] = [m for m in detections if header_dict(m.header) == d2["header"]]
    assert ours.header.frame_id == "camera_color_optical_frame"
    assert len(d2["detections"]) == len(ours.detections) > 0
    for v, d in zip(d2["detections"], ours.detections):
        assert v["header"] == d2["header"]
        assert v["center"] == pixels([(d.x_min_px + d.x_max_px) / 2, (d.y_min_px + d.y_max_px) / 2])
        assert v["theta"] == 0.0
        assert v["size"] == pixels([d.x_max_px - d.x_min_px, d.y_max_px - d.y_min_px])
        assert d.track_id > 0 and v["id"] == str(d.track_id)   # tracking is on by default
        [hypothesis] = v["results"]
        assert hypothesis["class_id"] == d.label == PROMPT
        assert same_score(hypothesis["score"], d.score), (hypothesis["score"], d.score)

    # 3D: the placed boxes of the detect prompt (never the points), their pose and size, in the
    # Objects3D message's frame.
    # (the first frame that had its depth and camera_info: under load a best-effort camera_info can
    # miss a frame, which then has no 3D, by the pairing rules)
    d3 = next(a for a in got["detections_3d"] if a["detections"])
    [o3] = [m for m in placed if m.task == "detect" and header_dict(m.header) == d3["header"]]
    [ours] = [m for m in detections if m.header.stamp == o3.header.stamp]
    boxes = [o for o in o3.objects if o.has_position]
    assert o3.depth_note == "" and len(boxes) == len(o3.objects) == len(ours.detections)
    assert d3["header"] == header_dict(o3.header) and o3.header.frame_id == optical.frame_id
    assert len(d3["detections"]) == len(boxes)
    for v, o, d in zip(d3["detections"], boxes, ours.detections):
        assert v["header"] == header_dict(o3.header)
        assert v["center"] == pose_dict(o.pose)
        assert v["size"] == [o.size.x, o.size.y, o.size.z] and min(v["size"][:2]) > 0
        assert v["id"] == str(o.track_id) == str(d.track_id)
        [hypothesis] = v["results"]
        assert hypothesis["class_id"] == o.label == PROMPT
        assert same_score(hypothesis["score"], o.score), (hypothesis["score"], o.score)
        assert hypothesis["pose"] == pose_dict(o.pose) and hypothesis["covariance"] == [0.0] * 36
