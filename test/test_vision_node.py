"""The vision node over real DDS with the small random Moondream checkpoint: headers copied,
compressed input, newest-frame-wins under a burst, bad frames survived, runtime parameters, the
on-demand service, diagnostics, and the transcript -> loop -> vision -> target loop."""

import math
import time

import numpy as np
import pytest
import torch
from builtin_interfaces.msg import Time
from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus
from geometry_msgs.msg import PointStamped, PoseStamped, Twist
from rclpy.parameter import Parameter
from rclpy.qos import QoSProfile, ReliabilityPolicy
from sensor_msgs.msg import CameraInfo, CompressedImage, Image
from std_msgs.msg import Header, String

from moondream_fixtures import checkpoint
from photon_core.runtime.shared_models import release
from test_image_conversions import _png
from photon_ros.image_conversions import rgb_to_compressed, rgb_to_image
from photon_ros.loop_node import LoopNode
from photon_ros.msg import Detections, ImageTarget, Objects3D, Points, Transcript
from photon_ros.srv import Infer
from photon_ros.stamp_pairing import stamp_ns
from photon_ros.vision_node import VisionNode, load_vision_model, stale_frame, warm_up
from ros_harness import RosGraph, wait_for, wait_for_match

RELIABLE = QoSProfile(depth=10, reliability=ReliabilityPolicy.RELIABLE)


@pytest.fixture
def graph():
    g = RosGraph()
    yield g
    g.close()


def image(seed=0, size=(96, 128)):
    return np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8)


def header(i, frame="camera"):
    return Header(stamp=Time(sec=1000 + i, nanosec=i), frame_id=frame)


def vision_node(graph, **params):
    params.setdefault("model", str(checkpoint()))
    params.setdefault("max_objects", 2)
    params.setdefault("reliability", "reliable")
    # One frame answers several requests here, after inference that a slow machine takes seconds
    # for: its age is test_stale_latest_frame_is_refused's subject, not these tests'.
    params.setdefault("max_frame_age_s", 600.0)
    node = graph.add(VisionNode(context=graph.context,
                                parameter_overrides=[Parameter(k, value=v) for k, v in params.items()]))
    assert wait_for(lambda: node.engine is not None or node.model_error, timeout=120)
    assert node.engine is not None, node.model_error
    return node


def collect(graph, msg_type, topic):
    got = []
    graph.node(f"listen_{topic.strip('/').replace('/', '_')}").create_subscription(msg_type, topic, got.append, RELIABLE)
    return got


def test_detections_carry_the_image_header(graph):
    node = vision_node(graph, detect=["cup"], point=["dog"])
    detections, points = collect(graph, Detections, "detections"), collect(graph, Points, "points")
    pub = graph.node("camera").create_publisher(Image, "image", RELIABLE)
    wait_for_match(pub)
    pub.publish(rgb_to_image(image(), "bgr8", header=header(7)))
    assert wait_for(lambda: detections and points, timeout=60)
    d = detections[0]
    assert d.header == header(7) and d.prompt == "cup" and (d.image_width, d.image_height) == (128, 96)
    assert node.engine.model.dtype == torch.float32       # dtype auto, on the CPU
    assert len(d.detections) == 2   # the test checkpoint is biased to emit objects up to max_objects
    for box in d.detections:
        assert 0 <= box.x_min <= box.x_max <= 1 and 0 <= box.y_min <= box.y_max <= 1
        assert box.x_max_px == pytest.approx(box.x_max * 128, rel=1e-5)
        assert 0.5 <= box.score <= 1     # the model's probability of the object (greedy: >= 0.5), not NaN
    assert points[0].header == header(7) and points[0].prompt == "dog"
    assert all(0.5 <= p.score <= 1 for p in points[0].points)
    assert d.latency.sec + d.latency.nanosec > 0
    # Tracked: the same objects in the next frame keep their ids; ids are never shared between
    # objects or prompts, and 0 (not tracked) is never one.
    pub.publish(rgb_to_image(image(), "bgr8", header=header(8)))
    assert wait_for(lambda: len(detections) == 2 and len(points) == 2, timeout=60)
    first = [b.track_id for b in detections[0].detections] + [p.track_id for p in points[0].points]
    assert 0 not in first and len(set(first)) == len(first)
    assert [b.track_id for b in detections[1].detections] == first[:2]
    assert [p.track_id for p in points[1].points] == first[2:]
    # A frame a little older than the last result (two publishers, reordered delivery): its
    # results are untracked (0), and the tracks go on; only a jump back over 1 s restarts them.
    older = Header(stamp=Time(sec=1008, nanosec=0), frame_id="camera")
    pub.publish(rgb_to_image(image(), "bgr8", header=older))
    assert wait_for(lambda: len(detections) == 3, timeout=60)
    assert all(b.track_id == 0 for b in detections[2].detections)
    pub.publish(rgb_to_image(image(), "bgr8", header=header(9)))
    assert wait_for(lambda: len(detections) == 4, timeout=60)
    assert [b.track_id for b in detections[3].detections] == first[:2]


def test_a_frame_in_the_model_at_deactivate_leaves_no_tracks_to_the_next_activation(graph):
    """The frame being processed when the node is deactivated ends after it (its results are not
    published): the tracks it made must not hand their ids to what the camera shows after the next
    activate. The worker's own call is made here on the test thread, once deactivated."""
    from photon_ros.latest_frame import Frame
    node = vision_node(graph, detect=["cup"])
    detections = collect(graph, Detections, "detections")
    pub = graph.node("camera").create_publisher(Image, "image", RELIABLE)
    wait_for_match(pub)
    pub.publish(rgb_to_image(image(), "bgr8", header=header(1)))
    assert wait_for(lambda: detections, timeout=60)
    first = {b.track_id for b in detections[0].detections}
    epoch = node.activity.current()
    node.trigger_deactivate()
    assert node.activity.current() is None
    node.process(Frame(rgb_to_image(image(), "bgr8", header=header(2)), time.monotonic()), epoch)   # in flight
    first |= {t.track_id for t in node.trackers.get("detect", "cup").tracks()}   # its own, unpublished
    node.trigger_activate()
    assert node.activity.current() not in (None, epoch)
    pub.publish(rgb_to_image(image(), "bgr8", header=header(3)))
    assert wait_for(lambda: len(detections) == 2, timeout=60)
    again = {b.track_id for b in detections[1].detections}
    assert again and not again & first and 0 not in again


def test_tracks_do_not_carry_onto_another_cameras_frame():
    """The node's tracking passes each image's frame_id: an image topic switched between two
    cameras of one size does not give the rear camera's cup the front camera's cup's id."""
    from types import SimpleNamespace
    from photon_ros.msg import Detection
    from photon_ros.tracking import StreamTrackers
    stub = SimpleNamespace(params={"tracking": True}, trackers=StreamTrackers())

    def ids(i, frame):
        items = [Detection(x_min_px=10.0, y_min_px=10.0, x_max_px=50.0, y_max_px=50.0)]
        VisionNode.track(stub, "detect", "cup", items, header(i, frame), 128, 96)
        return items[0].track_id

    front = ids(1, "front_optical")
    assert front and ids(2, "front_optical") == front
    assert ids(3, "rear_optical") not in (0, front)


def test_an_unstamped_cameras_tracks_age_by_the_frames_arrival():
    """Frames stamped 0 (a driver that stamps nothing) never aged a track: an object seen minutes
    ago gave its id to whatever was at its place now. Their arrival times age them instead."""
    from types import SimpleNamespace
    from photon_ros.msg import Detection
    from photon_ros.tracking import StreamTrackers
    from std_msgs.msg import Header
    stub = SimpleNamespace(params={"tracking": True}, trackers=StreamTrackers(max_missed=5, max_age_s=0.5))

    def ids(received_at):
        items = [Detection(x_min_px=10.0, y_min_px=10.0, x_max_px=50.0, y_max_px=50.0)]
        VisionNode.track(stub, "detect", "cup", items, Header(frame_id="cam"), 128, 96, received_at)
        return items[0].track_id

    first = ids(100.0)
    assert first and ids(100.2) == first          # a frame 0.2 s later: the same object
    assert ids(101.5) not in (0, first)           # 1.3 s since it was seen, past track_max_age_s


def test_a_prompt_dropped_while_its_frame_ran_gets_new_ids_when_asked_again():
    """A frame's results are tracked after its model ran: a prompt dropped meanwhile (a parameter
    change) had its tracks made again by that frame and kept, and the prompt asked again took those
    ids (the node's promise: a prompt asked again later gets new ids)."""
    from types import SimpleNamespace
    from photon_ros.msg import Detection
    from photon_ros.tracking import IdSource
    stub = SimpleNamespace(params={"tracking": True, "track_max_missed": 5, "track_max_age_s": 10.0},
                           track_ids=IdSource(), detect_targets=[], point_targets=[])
    VisionNode.apply_params(stub, {"tracking": True, "detect": ["cup"], "point": []})

    def ids(i):
        items = [Detection(x_min_px=10.0, y_min_px=10.0, x_max_px=50.0, y_max_px=50.0)]
        VisionNode.track(stub, "detect", "cup", items, header(i), 128, 96)
        return items[0].track_id

    before = ids(1)
    VisionNode.apply_params(stub, {"detect": ["mug"]})
    late = ids(2)                               # the frame in the model when cup was dropped
    VisionNode.apply_params(stub, {"detect": ["cup"]})
    assert ids(3) not in (0, before, late)


def test_warm_up_runs_a_frame_of_the_standing_tasks_as_one_batch():
    """Startup decodes one batch the size of a frame's requests, so the compiled step of that batch
    size (built on first use, seconds at real sizes on a GPU) is not built on the first frame."""
    engine = load_vision_model(str(checkpoint()), "cpu", None, "reference")
    try:
        warm_up(engine, 3)
        warm_up(engine, 0)                              # no standing task: one request still
        assert engine.batcher.sizes[-2:] == [3, 1]
    finally:
        release(engine)


def test_compressed_input(graph):
    node = vision_node(graph, input="compressed", detect=["cup"])
    detections = collect(graph, Detections, "detections")
    pub = graph.node("camera").create_publisher(CompressedImage, "image/compressed", RELIABLE)
    wait_for_match(pub)
    # A PNG whose header claims 400 MP (Pillow refuses it with its own error, not an OSError), then
    # a frame whose decoding fails in a way nothing foresaw: both skipped, the worker lives on.
    pub.publish(CompressedImage(header=header(1), format="png", data=_png(20_000, 20_000)))
    assert wait_for(lambda: node.bad_frames == 1, timeout=30)
    to_rgb = node.to_rgb

    def fails_once(msg):
        node.to_rgb = to_rgb
        raise RuntimeError("decoder crashed")
    node.to_rgb = fails_once
    pub.publish(rgb_to_compressed(image(1), "jpeg", header=header(2)))
    assert wait_for(lambda: node.bad_frames == 2, timeout=30)
    pub.publish(rgb_to_compressed(image(1), "jpeg", header=header(3)))
    assert wait_for(lambda: detections, timeout=60)
    assert [d.header for d in detections] == [header(3)]
    # The annotated picture fails to draw (someone watches image_annotated): the results go out.
    graph.node("viewer").create_subscription(Image, "image_annotated", lambda m: None, RELIABLE)
    assert wait_for(lambda: node.pub_annotated.get_subscription_count() > 0, timeout=10)
    import photon_ros.vision_node as vision_module
    drawn = vision_module.draw_results

    def broken(*args, **kwargs):
        vision_module.draw_results = drawn
        raise OverflowError("Numerical result out of range")
    vision_module.draw_results = broken
    pub.publish(rgb_to_compressed(image(1), "jpeg", header=header(4)))
    assert wait_for(lambda: len(detections) == 2, timeout=60)
    assert detections[1].header == header(4) and node.bad_frames == 2


def test_burst_drops_frames_and_bad_frames_do_not_stop_the_node(graph):
    # A deep subscription queue, so every frame reaches the node and the drops are its own.
    node = vision_node(graph, detect=["cup"], depth=100)
    detections = collect(graph, Detections, "detections")
    diagnostics = collect(graph, DiagnosticArray, "/diagnostics")
    pub = graph.node("camera").create_publisher(Image, "image", QoSProfile(depth=100, reliability=ReliabilityPolicy.RELIABLE))
    wait_for_match(pub)
    # Bad frames first: zero size, short data, unknown encoding, then a 12-megapixel frame.
    bad = [Image(header=header(0), encoding="rgb8", width=0, height=0, step=0),
           Image(header=header(1), encoding="rgb8", width=64, height=64, step=192, data=bytes(100)),
           Image(header=header(2), encoding="yuv420p", width=4, height=4, step=8, data=bytes(32))]
    for i, msg in enumerate(bad):   # one at a time: a newer frame would replace a waiting one
        pub.publish(msg)
        assert wait_for(lambda: node.bad_frames == i + 1, timeout=30)
    big = np.zeros((3000, 4000, 3), np.uint8)
    big[1000:2000, 1500:2500] = 200
    pub.publish(rgb_to_image(big, "rgb8", header=header(3)))
    assert wait_for(lambda: any(d.header == header(3) for d in detections), timeout=120)
    # A burst of 100 frames while inference is held up (the engine's lock, as a slow model would):
    # whatever this machine's speed, at most one frame is in inference and one waits, so the node
    # must drop the rest, then process the newest.
    frame = rgb_to_image(image(2), "rgb8")
    with node.engine.lock:
        for i in range(100):
            frame.header = header(100 + i)
            pub.publish(frame)
        assert wait_for(lambda: node.frames.received == 104, timeout=30)
    assert wait_for(lambda: any(d.header == header(199) for d in detections), timeout=120)
    # Reliable and in order: once the newest frame's detections are here, all earlier ones are.
    processed = [d.header.stamp.sec - 1100 for d in detections if d.header.stamp.sec >= 1100]
    assert processed[-1] == 99 and processed == sorted(set(processed))
    assert len(processed) <= 2                                   # the mailbox holds one frame
    assert len(processed) + node.frames.dropped == 100           # processed or counted dropped
    assert node.frames.taken + node.frames.dropped == node.frames.received == 104
    assert node.bad_frames == 3
    own = lambda: [a for a in diagnostics if a.status[0].name.endswith(node.get_fully_qualified_name())]  # noqa: E731
    assert wait_for(lambda: any(diagnostic_values(a)["frames_dropped"] == str(node.frames.dropped)
                                and diagnostic_values(a)["frames_received"] == "104" for a in own()),
                    timeout=10)
    assert own()[-1].status[0].level == DiagnosticStatus.OK


def diagnostic_values(array: DiagnosticArray) -> dict[str, str]:
    return {v.key: v.value for v in array.status[0].values}


def test_runtime_parameter_changes_the_prompt(graph):
    node = vision_node(graph, detect=["cup"])
    detections = collect(graph, Detections, "detections")
    pub = graph.node("camera").create_publisher(Image, "image", RELIABLE)
    wait_for_match(pub)
    pub.publish(rgb_to_image(image(), header=header(1)))
    assert wait_for(lambda: detections, timeout=60)
    node.set_parameters([Parameter("detect", value=["red dog"])])
    pub.publish(rgb_to_image(image(), header=header(2)))
    assert wait_for(lambda: any(d.prompt == "red dog" for d in detections), timeout=60)
    assert [d.prompt for d in detections if d.header == header(2)] == ["red dog"]


def test_stale_latest_frame_is_refused(graph):
    """A camera that stopped leaves its last frame: infer on the latest frame refuses one older than
    max_frame_age_s (the robot would act on where things were), and answers again once frames come."""
    # Whole numbers for float parameters (YAML `0`, `ros2 param set ... 1`) are taken, at start
    # and at runtime; rclpy alone would refuse them (and the node would not start).
    node = vision_node(graph, caption_period_s=0, max_frame_age_s=600)
    assert node.caption_period == 0.0 and node.max_frame_age == 600.0
    assert node.set_parameters([Parameter("caption_period_s", value=0)])[0].successful
    assert not node.set_parameters([Parameter("max_frame_age_s", value="soon")])[0].successful
    camera = graph.node("camera").create_publisher(Image, "image", RELIABLE)
    wait_for_match(camera)
    camera.publish(rgb_to_image(image(5), header=header(5)))
    assert wait_for(lambda: node.frames.latest is not None, timeout=10)
    node.set_parameters([Parameter("max_frame_age_s", value=0.2)])
    time.sleep(0.3)                                    # older than the limit, whatever the machine
    client = graph.node("client").create_client(Infer, "infer")
    assert client.wait_for_service(timeout_sec=10)
    ask = Infer.Request(task="point", prompt="cup", use_latest_frame=True)
    future = client.call_async(ask)
    assert wait_for(future.done, timeout=30)
    assert not future.result().success and "max_frame_age_s" in future.result().message
    assert "is the camera still publishing" in future.result().message
    assert node.set_parameters([Parameter("max_frame_age_s", value=0)])[0].successful   # 0: any age
    frame_age = time.monotonic() - node.frames.latest.received_at
    future = client.call_async(ask)
    assert wait_for(future.done, timeout=60)
    assert future.result().success and future.result().points.header == header(5)
    # latency is "image received -> result ready", as on the topics: from the frame, not the request
    latency = future.result().points.latency
    assert latency.sec + latency.nanosec * 1e-9 >= frame_age
    assert stale_frame(1.0, 2.0) == "" and stale_frame(2.5, 2.0) and stale_frame(1e6, 0.0) == ""


def test_missing_model_reports_error_and_stays_up(graph, tmp_path):
    node = graph.add(VisionNode(context=graph.context, parameter_overrides=[
        Parameter("model", value=str(tmp_path / "no-such-model"))]))
    diagnostics = collect(graph, DiagnosticArray, "/diagnostics")
    assert wait_for(lambda: node.model_error is not None, timeout=30)
    assert wait_for(lambda: any(a.status[0].level == DiagnosticStatus.ERROR for a in diagnostics), timeout=5)
    error = [a for a in diagnostics if a.status[0].level == DiagnosticStatus.ERROR][0].status[0]
    assert "no-such-model" in error.message
    client = graph.node("client").create_client(Infer, "infer")
    assert client.wait_for_service(timeout_sec=10)
    future = client.call_async(Infer.Request(task="detect", prompt="cup", use_latest_frame=True))
    assert wait_for(future.done, timeout=10)
    assert not future.result().success and "not loaded" in future.result().message
    # autostart is read at start: a live change was accepted and did nothing
    assert not node.set_parameters([Parameter("autostart", value=False)])[0].successful


@pytest.mark.parametrize("backend,reason", [("megakernel", "TRITON_INTERPRET")])
def test_unusable_backend_reports_why(graph, monkeypatch, backend, reason):
    """The compiled kernels need a GPU (or the test interpreter): on this CPU the node must say so
    and stay up, not crash or silently fall back. (A backend that does not exist is refused at
    startup: test_node_params.)"""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)   # other test modules turn it on
    node = graph.add(VisionNode(context=graph.context, parameter_overrides=[
        Parameter("model", value=str(checkpoint())), Parameter("backend", value=backend)]))
    assert wait_for(lambda: node.model_error is not None, timeout=30)
    assert reason in node.model_error and node.engine is None


def test_transcript_to_target(graph):
    """The loop's target is image coordinates on a topic whose type says so; nothing is published
    as a position (no depth: no metres), and its turn is bounded and ends in a zero Twist."""
    vision = vision_node(graph)        # no standing tasks: the loop asks on demand
    loop = graph.add(LoopNode(context=graph.context, parameter_overrides=[
        Parameter("max_turn_s", value=0.3), Parameter("deadband_deg", value=0.0)]))
    targets, turns, status = collect(graph, ImageTarget, "image_target"), collect(graph, Twist, "cmd_vel"), collect(graph, String, "status")
    positions = collect(graph, PointStamped, "target")
    camera = graph.node("camera").create_publisher(Image, "image", RELIABLE)
    speaker = graph.node("speaker").create_publisher(Transcript, "transcript", RELIABLE)
    wait_for_match(camera), wait_for_match(speaker)
    camera.publish(rgb_to_image(image(4), header=header(42, "head_camera")))
    assert wait_for(lambda: vision.frames.latest is not None, timeout=10)
    # A command whose audio was cut is not acted on: no request, no target, and it says why.
    speaker.publish(Transcript(text="Point at the red", is_final=True, audio_complete=False,
                               audio_note="0.40 s of audio lost after it"))
    assert wait_for(lambda: any("part of the command was lost" in s.data for s in status), timeout=10)
    speaker.publish(Transcript(text="Point at the red cup.", is_final=True, audio_complete=True))
    assert wait_for(lambda: targets, timeout=60), [s.data for s in status]
    assert len(targets) == 1
    t = targets[0]
    assert t.header == header(42, "head_camera") and (t.task, t.label) == ("point", "red cup")
    assert (t.image_width, t.image_height) == (128, 96)
    assert 0 <= t.x_px <= 128 and 0 <= t.y_px <= 96
    assert t.x_px == pytest.approx(t.x * 128, abs=1e-3) and t.y_px == pytest.approx(t.y * 96, abs=1e-3)
    # The turn: max_turn_rate until at most max_turn_s has passed, then one zero Twist, then nothing.
    assert wait_for(lambda: turns and turns[-1].angular.z == 0.0, timeout=10), [m.angular.z for m in turns]
    moving = [m.angular.z for m in turns[:-1]]
    # the last one scaled to what was left of the turn (steering.TurnCommands)
    assert moving and all(abs(z) == 0.5 for z in moving[:-1]) and 0 < abs(moving[-1]) <= 0.5
    assert len({z > 0 for z in moving}) == 1
    assert len(moving) <= 0.3 / 0.1 + 2
    assert (moving[0] > 0) == (t.x < 0.5)       # REP 103: a target left of centre turns left
    assert wait_for(lambda: any("red cup" in s.data and "no 3D position (the vision node does not use depth)" in s.data
                                for s in status),
                    timeout=10), [s.data for s in status]
    count = len(turns)
    time.sleep(0.5)
    assert len(turns) == count                  # the stop is the last command
    speaker.publish(Transcript(text="What a lovely day.", is_final=True, audio_complete=True))
    assert wait_for(lambda: any("no vision command" in s.data and "point at X" in s.data for s in status), timeout=10)
    assert positions == []                      # no depth: nothing on target
    # A newer command while the first is still being decoded (the engine held up): the first goal
    # is canceled, and only the newer one's target comes.
    with vision.engine.lock:
        speaker.publish(Transcript(text="Point at the blue box.", is_final=True, audio_complete=True))
        assert wait_for(lambda: loop.goal is not None, timeout=10)
        speaker.publish(Transcript(text="Point at the green ball.", is_final=True, audio_complete=True))
        assert wait_for(lambda: any("canceled the previous search" in s.data for s in status), timeout=10)
    assert wait_for(lambda: len(targets) == 2, timeout=60)
    time.sleep(0.5)
    assert [t.label for t in targets] == ["red cup", "green ball"]


def test_two_cameras_share_one_engine(graph):
    params = [Parameter("model", value=str(checkpoint())), Parameter("detect", value=["cup"]),
              Parameter("max_objects", value=1), Parameter("reliability", value="reliable")]
    nodes = [graph.add(VisionNode(context=graph.context, namespace=ns, parameter_overrides=params))
             for ns in ("left", "right")]
    assert wait_for(lambda: all(n.engine is not None for n in nodes), timeout=120)
    assert nodes[0].engine is nodes[1].engine          # one model, one batcher
    got = {ns: collect(graph, Detections, f"/{ns}/detections") for ns in ("left", "right")}
    cams = {ns: graph.node(f"cam_{ns}").create_publisher(Image, f"/{ns}/image", RELIABLE) for ns in got}
    for pub in cams.values():
        wait_for_match(pub)
    for i in range(3):
        for k, (ns, pub) in enumerate(cams.items()):
            pub.publish(rgb_to_image(image(10 + k), header=header(i, ns)))
        assert wait_for(lambda: all(any(d.header == header(i, ns) for d in got[ns]) for ns in got), timeout=60)
    for ns in got:
        assert all(d.header.frame_id == ns for d in got[ns])
    assert sum(nodes[0].engine.batcher.sizes) >= 6


def test_diagnostics_count_frames_lost_on_the_way_and_say_when_every_frame_fails(graph):
    """A best-effort, depth-1 subscription (the default) loses frames a busy node cannot take: each
    is counted from the publisher's sequence numbers. A camera whose every frame fails turns the
    node's diagnostics ERROR with the reason, and a good frame brings them back to OK."""
    node = vision_node(graph, detect=["cup"], reliability="best_effort")
    detections = collect(graph, Detections, "detections")
    diagnostics = collect(graph, DiagnosticArray, "/diagnostics")
    own = lambda: [a.status[0] for a in diagnostics if a.status[0].name.endswith(node.get_fully_qualified_name())]  # noqa: E731
    pub = graph.node("camera").create_publisher(Image, "image", QoSProfile(depth=100, reliability=ReliabilityPolicy.RELIABLE))
    wait_for_match(pub)
    frame = rgb_to_image(image(3, size=(24, 32)), "rgb8", header=header(0))
    pub.publish(frame)
    assert wait_for(lambda: node.frames.received == 1, timeout=30)
    with node.engine.lock:   # inference held up: the node's callbacks fall behind the burst
        for i in range(1, 201):
            frame.header = header(i)
            pub.publish(frame)
        assert wait_for(lambda: any(d.header == header(200) for d in detections) or node.frames.received > 1, timeout=30)
    assert wait_for(lambda: any(d.header == header(200) for d in detections), timeout=60)
    assert node.frames.received + node.health.lost_in_transport == 201
    assert wait_for(lambda: any(dict((v.key, v.value) for v in s.values)["frames_lost_in_transport"]
                                == str(node.health.lost_in_transport) for s in own()), timeout=10)
    for i in range(4):    # frames it cannot convert, one at a time
        pub.publish(Image(header=header(300 + i), encoding="yuv420p", width=4, height=4, step=8, data=bytes(32)))
        assert wait_for(lambda: node.bad_frames == i + 1, timeout=30)
    assert wait_for(lambda: own() and own()[-1].level == DiagnosticStatus.ERROR, timeout=10), own()[-1]
    assert "the last 4 frames all failed" in own()[-1].message and "yuv420p" in own()[-1].message
    pub.publish(rgb_to_image(image(3, size=(24, 32)), "rgb8", header=header(400)))
    assert wait_for(lambda: any(d.header == header(400) for d in detections), timeout=60)
    assert wait_for(lambda: own()[-1].level == DiagnosticStatus.OK, timeout=10), own()[-1]
    # The camera stops: once input_timeout_s has passed without a frame, a warning says so.
    node.set_parameters([Parameter("input_timeout_s", value=1.0)])
    assert wait_for(lambda: own()[-1].level == DiagnosticStatus.WARN, timeout=10), own()[-1]
    assert "no images for" in own()[-1].message
    pub.publish(rgb_to_image(image(3, size=(24, 32)), "rgb8", header=header(401)))
    assert wait_for(lambda: own()[-1].level == DiagnosticStatus.OK, timeout=10), own()[-1]


def camera_info(stamp_header, fx=100.0, width=128, height=96):
    return CameraInfo(header=stamp_header, width=width, height=height, distortion_model="plumb_bob",
                      d=[0.0] * 5, k=[fx, 0.0, 64.0, 0.0, fx, 48.0, 0.0, 0.0, 1.0],
                      r=[1.0, 0, 0, 0, 1.0, 0, 0, 0, 1.0], p=[fx, 0.0, 64.0, 0.0, 0.0, fx, 48.0, 0.0, 0.0, 0.0, 1.0, 0.0])


def wall_depth(stamp_header, metres=2.0, seed=0):
    """A flat wall `metres` away as 16UC1 millimetres, with 1% noise and 10% holes (zeros)."""
    rng = np.random.default_rng(seed)
    mm = metres * 1000 * (1 + 0.01 * rng.standard_normal((96, 128)))
    mm[rng.random((96, 128)) < 0.1] = 0
    return Image(header=stamp_header, height=96, width=128, encoding="16UC1", step=256,
                 data=mm.astype("<u2").tobytes())


def test_results_in_metres_from_an_aligned_depth_image(graph):
    """use_depth: each detection and point is placed in the camera's optical frame from the depth
    image paired by stamp (within 2% of the truth for a wall with noise and holes); a frame whose
    depth is stale, or a camera_info that cannot be used, gives results without positions and the
    reason, never 0 m; a target_frame without tf2_ros is a configure error."""
    node = vision_node(graph, detect=["cup"], point=["dog"], use_depth=True, tracking=False)
    placed, positions = collect(graph, Objects3D, "objects_3d"), collect(graph, PointStamped, "point_positions")
    detections, points = collect(graph, Detections, "detections"), collect(graph, Points, "points")
    camera = graph.node("camera")
    pubs = {name: camera.create_publisher(t, name, RELIABLE) for name, t in
            (("image", Image), ("depth", Image), ("camera_info", CameraInfo))}
    for pub in pubs.values():
        wait_for_match(pub)
    optical = header(1, "camera_color_optical_frame")
    pubs["camera_info"].publish(camera_info(optical))
    pubs["depth"].publish(wall_depth(optical))
    pubs["image"].publish(rgb_to_image(image(5), header=optical))
    assert wait_for(lambda: len(placed) == 2 and detections and points, timeout=60)
    for o3, flat in ((next(m for m in placed if m.task == "detect"), detections[0].detections),
                     (next(m for m in placed if m.task == "point"), points[0].points)):
        assert o3.header == optical and o3.depth_note == "" and len(o3.objects) == len(flat) > 0
        for obj, item in zip(o3.objects, flat):
            assert obj.has_position, obj.reason
            u = (obj.x_min_px + obj.x_max_px) / 2 - 0.5     # pixel centres sit at integers
            v = (obj.y_min_px + obj.y_max_px) / 2 - 0.5
            truth = np.array([(u - 64) / 100 * 2.0, (v - 48) / 100 * 2.0, 2.0])
            got = np.array([obj.pose.position.x, obj.pose.position.y, obj.pose.position.z])
            assert np.abs(got - truth).max() <= 0.02 * 2.0, (got, truth)
            assert obj.label == item.label
    assert wait_for(lambda: len(positions) == len(points[0].points), timeout=10)
    assert all(p.header == optical for p in positions)
    # Depth 1 s older than the colour frame, outside the 0.05 s tolerance, and none of its own comes.
    pubs["image"].publish(rgb_to_image(image(5), header=header(2, "camera_color_optical_frame")))
    assert wait_for(lambda: len(placed) == 4, timeout=60)
    stale = placed[2:]
    why = "the nearest was stamped 1.000 s before it"
    assert all(why in m.depth_note for m in stale)
    assert all(not o.has_position and why in o.reason and o.pose.position.z == 0 for m in stale for o in m.objects)
    # A camera_info with no focal length: reasons, still no 0 m, and the node goes on.
    pubs["camera_info"].publish(camera_info(header(3, "camera_color_optical_frame"), fx=0.0))
    pubs["depth"].publish(wall_depth(header(3, "camera_color_optical_frame")))
    pubs["image"].publish(rgb_to_image(image(5), header=header(3, "camera_color_optical_frame")))
    assert wait_for(lambda: len(placed) == 6, timeout=60)
    assert all(m.depth_note and not any(o.has_position for o in m.objects) for m in placed[4:]), placed[4].depth_note
    assert node.frames_without_depth == 2
    # Neither the image nor camera_info names a frame: metres in no frame are not published.
    unnamed = header(4, "")
    pubs["camera_info"].publish(camera_info(unnamed))
    pubs["depth"].publish(wall_depth(unnamed))
    pubs["image"].publish(rgb_to_image(image(5), header=unnamed))
    assert wait_for(lambda: len(placed) == 8, timeout=60)
    assert all("names a frame" in m.depth_note and not any(o.has_position for o in m.objects) for m in placed[6:])
    # infer with an image of its own: its depth pairing begins when the request arrives, not after
    # the model ran (meanwhile ten later depth images would push its own out of the kept ones).
    client = graph.node("client").create_client(Infer, "infer")
    assert client.wait_for_service(timeout_sec=10)
    own = header(10, "camera_color_optical_frame")
    received = node.depth_stream.received
    pubs["camera_info"].publish(camera_info(own))
    pubs["depth"].publish(wall_depth(own))
    assert wait_for(lambda: node.depth_stream.received > received, timeout=60)
    exact = node.depth_stream.outcomes["exact"]
    with node.engine.lock:   # the model held up while the depth stream goes on
        future = client.call_async(Infer.Request(task="point", prompt="dog", use_latest_frame=False,
                                                 image=rgb_to_image(image(5), header=own)))
        # the request has arrived: its depth paired (a fixed sleep here was a guess at how soon)
        assert wait_for(lambda: node.depth_stream.outcomes["exact"] > exact, timeout=60)
        for i in range(11, 24):
            later = header(i, "camera_color_optical_frame")
            received = node.depth_stream.received
            pubs["camera_info"].publish(camera_info(later))
            pubs["depth"].publish(wall_depth(later))
            # each taken in (a burst would overflow the subscription's queue)
            assert wait_for(lambda: node.depth_stream.received > received, timeout=60)
        assert wait_for(lambda: node.depth_stream._kept[0][0] > stamp_ns(own.stamp), timeout=10)
    assert wait_for(future.done, timeout=60)
    answer = future.result()
    assert answer.success, answer.message
    assert answer.objects_3d.objects and all(o.has_position for o in answer.objects_3d.objects), \
        answer.objects_3d.depth_note
    # An image of its own that names no frame: any image stamped so paired with this camera's depth.
    unnamed = header(30, "camera_color_optical_frame")
    pubs["camera_info"].publish(camera_info(unnamed))
    pubs["depth"].publish(wall_depth(unnamed))
    time.sleep(0.3)
    future = client.call_async(Infer.Request(task="point", prompt="dog", use_latest_frame=False,
                                             image=rgb_to_image(image(5), header=header(30, ""))))
    assert wait_for(future.done, timeout=60)
    answer = future.result()
    assert answer.success and answer.objects_3d.objects, answer.message
    assert "names no frame" in answer.objects_3d.depth_note
    assert not any(o.has_position for o in answer.objects_3d.objects)


def test_bad_depth_input_is_said_and_survived(graph):
    """Depth the node cannot use (an image encoding that is not depth, then depth stamps that jump
    back, as a bag played again) gives frames without positions and the reason, a WARN on
    /diagnostics once three frames in a row had none, and /diagnostics counts every frame's pairing;
    the node goes on and a good frame is placed again (diagnostics back to OK)."""
    node = vision_node(graph, point=["dog"], use_depth=True, tracking=False)
    placed, diagnostics = collect(graph, Objects3D, "objects_3d"), collect(graph, DiagnosticArray, "/diagnostics")
    own = lambda: [a.status[0] for a in diagnostics if a.status[0].name.endswith(node.get_fully_qualified_name())]  # noqa: E731
    camera = graph.node("camera")
    pubs = {name: camera.create_publisher(t, name, RELIABLE) for name, t in
            (("image", Image), ("depth", Image), ("camera_info", CameraInfo))}
    for pub in pubs.values():
        wait_for_match(pub)
    for i in range(1, 4):
        optical = header(i, "camera_color_optical_frame")
        pubs["camera_info"].publish(camera_info(optical))
        pubs["depth"].publish(Image(header=optical, height=96, width=128, encoding="mono8", step=128,
                                    data=bytes(96 * 128)))
        pubs["image"].publish(rgb_to_image(image(5), header=optical))
        assert wait_for(lambda: len(placed) == i, timeout=60)
    assert all(m.depth_note == "depth image encoding 'mono8' is not a depth encoding; supported: 16UC1, 32FC1"
               and m.objects and not any(o.has_position for o in m.objects) for m in placed), placed[0].depth_note
    assert wait_for(lambda: own() and own()[-1].level == DiagnosticStatus.WARN, timeout=10)
    assert own()[-1].message.startswith("the last 3 frames had no 3D (last: depth image encoding 'mono8'")
    values = diagnostic_values(next(a for a in reversed(diagnostics) if a.status[0] is own()[-1]))
    assert values["depth_images_received"] == "3" and values["depth_paired_exact"] == "3"
    # Stamps back by about 999 s: the earlier depth images are forgotten, and this one is used.
    optical = Header(stamp=Time(sec=4), frame_id="camera_color_optical_frame")
    pubs["camera_info"].publish(camera_info(optical))
    pubs["depth"].publish(wall_depth(optical))
    pubs["image"].publish(rgb_to_image(image(5), header=optical))
    assert wait_for(lambda: len(placed) == 4, timeout=60)
    assert placed[3].depth_note == "" and all(o.has_position for o in placed[3].objects), placed[3].depth_note
    assert wait_for(lambda: own()[-1].level == DiagnosticStatus.OK, timeout=10), own()[-1]


def test_target_frame_needs_tf2(graph):
    node = graph.add(VisionNode(context=graph.context, parameter_overrides=[
        Parameter("model", value=str(checkpoint())), Parameter("use_depth", value=True),
        Parameter("target_frame", value="base_link")]))
    assert wait_for(lambda: node.model_error is not None, timeout=60)
    assert "tf2_ros" in node.model_error and node.engine is None


def test_target_frame_through_a_tf2_lookup(graph, monkeypatch):
    """With target_frame, positions are moved there by the transform tf2 gives (a test double for
    the tf2 lookup only: tf2_ros cannot be installed here); a failed lookup leaves the objects
    without positions and says why."""
    from photon_ros import frames, vision_node as vision_module

    # base_link <- camera_color_optical_frame: the camera 1 m ahead and 0.5 m up, looking along x
    # (optical z forward, x right, y down -> base x forward, y left, z up).
    mount = frames.Transform(np.array([1.0, 0.0, 0.5]), np.array([-0.5, 0.5, -0.5, 0.5]))
    calls = []

    def lookup(target, source, stamp):
        calls.append((target, source, stamp))
        if stamp > 1_001_500_000_000:   # integer nanoseconds
            raise LookupError(f"no transform {source} -> {target} at {stamp / 1e9:.3f} s: extrapolation")
        return mount
    monkeypatch.setattr(vision_module, "tf2_lookup", lambda node: lookup)
    node = vision_node(graph, point=["dog"], use_depth=True, target_frame="base_link")
    placed = collect(graph, Objects3D, "objects_3d")
    camera = graph.node("camera")
    pubs = {name: camera.create_publisher(t, name, RELIABLE) for name, t in
            (("image", Image), ("depth", Image), ("camera_info", CameraInfo))}
    for pub in pubs.values():
        wait_for_match(pub)
    for i in (1, 2):
        if i == 2:   # a change waits for the next configure (its description says): frame 2 is in base_link too
            assert node.set_parameters([Parameter("target_frame", value="odom")])[0].successful
        optical = header(i, "camera_color_optical_frame")
        pubs["camera_info"].publish(camera_info(optical))
        pubs["depth"].publish(wall_depth(optical))
        pubs["image"].publish(rgb_to_image(image(5), header=optical))
        assert wait_for(lambda: len(placed) == i, timeout=60)
    moved, failed = placed
    assert calls[0][:2] == ("base_link", "camera_color_optical_frame") and calls[0][2] == 1_001_000_000_001   # the stamp itself
    assert moved.header.frame_id == "base_link" and moved.objects
    for obj in moved.objects:
        u, v = obj.x_min_px - 0.5, obj.y_min_px - 0.5
        optical_xyz = np.array([(u - 64) / 100 * 2.0, (v - 48) / 100 * 2.0, 2.0])
        truth = np.array([1.0 + optical_xyz[2], -optical_xyz[0], 0.5 - optical_xyz[1]])
        got = np.array([obj.pose.position.x, obj.pose.position.y, obj.pose.position.z])
        assert np.abs(got - truth).max() <= 0.04, (got, truth)
    assert failed.objects and all(not o.has_position and "extrapolation" in o.reason for o in failed.objects)
    assert [c[0] for c in calls] == ["base_link", "base_link"] and failed.header.frame_id == "base_link"


def test_spoken_command_to_a_3d_target_and_a_goal(graph, monkeypatch):
    """The loop with a vision node that has depth and a target frame: the target is a PointStamped
    in metres in that frame, and a goal for a planner stops short of it, facing it."""
    from photon_ros import frames, vision_node as vision_module

    mount = frames.Transform(np.array([0.2, 0.0, 0.5]), np.array([-0.5, 0.5, -0.5, 0.5]))
    monkeypatch.setattr(vision_module, "tf2_lookup", lambda node: (lambda target, source, stamp: mount))
    vision = vision_node(graph, use_depth=True, target_frame="base_link")
    graph.add(LoopNode(context=graph.context, parameter_overrides=[
        Parameter("publish_goal", value=True), Parameter("turn", value=False)]))
    targets, goals = collect(graph, PointStamped, "target"), collect(graph, PoseStamped, "goal_pose")
    images, status = collect(graph, ImageTarget, "image_target"), collect(graph, String, "status")
    camera, speaker = graph.node("camera"), graph.node("speaker").create_publisher(Transcript, "transcript", RELIABLE)
    pubs = {name: camera.create_publisher(t, name, RELIABLE) for name, t in
            (("image", Image), ("depth", Image), ("camera_info", CameraInfo))}
    for pub in [*pubs.values(), speaker]:
        wait_for_match(pub)
    optical = header(1, "camera_color_optical_frame")
    pubs["camera_info"].publish(camera_info(optical))
    pubs["depth"].publish(wall_depth(optical, metres=2.5))
    pubs["image"].publish(rgb_to_image(image(6), header=optical))
    assert wait_for(lambda: vision.frames.latest is not None, timeout=10)   # the loop asks for the latest frame
    speaker.publish(Transcript(text="Point at the red cup.", is_final=True, audio_complete=True))
    assert wait_for(lambda: targets and goals and images, timeout=60), [s.data for s in status]
    t, g = targets[0], goals[0]
    assert t.header.frame_id == g.header.frame_id == "base_link"
    assert images[0].header.frame_id == "camera_color_optical_frame"   # the 2D result keeps the image's frame
    assert t.point.x == pytest.approx(0.2 + 2.5, abs=0.06)          # 2.5 m ahead of a camera 0.2 m forward
    yaw = 2 * math.atan2(g.pose.orientation.z, g.pose.orientation.w)
    assert yaw == pytest.approx(math.atan2(t.point.y, t.point.x), abs=1e-3)
    assert math.hypot(t.point.x - g.pose.position.x, t.point.y - g.pose.position.y) == pytest.approx(0.5, abs=1e-3)
    assert wait_for(lambda: any("m in base_link on target" in s.data and "goal" in s.data for s in status), timeout=10)


def test_a_frame_is_cropped_in_the_camera_worker_before_the_batch():
    # Moondream makes its crops ahead (prepare): the node does it in its own worker thread, so the
    # batch that every camera on the engine waits on gets crops, not frames to resize.
    from types import SimpleNamespace

    from moondream_fixtures import model as moondream

    from photon_core.models.moondream.image_crops import Crops
    from photon_core.runtime.shared_models import SharedModel
    from photon_ros.vision_node import prepared_image
    rgb = np.random.default_rng(0).integers(0, 255, (120, 160, 3), dtype=np.uint8)
    assert isinstance(prepared_image(SharedModel(moondream()), rgb), Crops)
    other = SimpleNamespace()                      # a family that makes no crops ahead
    assert prepared_image(SharedModel(other), rgb) is rgb
