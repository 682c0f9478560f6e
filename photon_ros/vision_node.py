"""Vision node: camera in, detections / points / captions / segmentations out.

    image (sensor_msgs/Image) or <image>/compressed (CompressedImage: image_transport's name, which
    follows a remap of `image`), sensor-data QoS by default (a publisher it cannot match: /diagnostics)
      -> newest-frame mailbox (frames arriving while the model is busy are counted and dropped)
      -> worker thread: convert; every configured task on the frame goes to the engine's batcher as
         one group (decoded in one batch with other cameras' groups, the image encoded once);
         `segment` objects go to the model's own segment() under the engine's lock (segment is no
         batched skill), the image encoded once for all of them
      -> detections, points (photon_ros), caption (VisionText), segmentation (Segmentation: an SVG
         path in its box's unit square, and the box), detections_2d (vision_msgs, where installed),
         image_annotated (boxes, points, masks; only while someone subscribes); headers copied from
         the image.
    with use_depth: depth (aligned to the image) and camera_info; each colour frame's pairing with the
      depth image and camera_info of its own stamp starts when it arrives and goes on while the model
      runs (photon_ros.stamp_pairing) -> objects_3d, point_positions, detections_3d (metres)
    infer (photon_ros/Infer service): detect / point / caption / query / segment on demand.
    /diagnostics: lifecycle and model state, input and processed rates, drops, latency percentiles.
Tasks (`detect`, `point`, `segment`, `caption_period_s`, ...) are parameters that can change at runtime.

A managed node (photon_ros.managed): configure loads the model (`model`, `device`, `dtype`,
`backend`) and creates the topics (`input`, `reliability`, `depth`), activate starts processing,
deactivate stops it (the model stays loaded), cleanup releases the model. With `autostart` (the
default) it does the first two itself. The infer service and /diagnostics answer in every state:
infer refuses with the reason while the node is not active.
"""
from __future__ import annotations

if __name__ == "__main__":   # `python -m`: a Ctrl-C during the imports below (seconds) ends it at once
    from photon_ros.run_node import exit_on_ctrl_c
    exit_on_ctrl_c()

import math
import threading
import time
from collections import deque
from typing import NamedTuple

import numpy as np
from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus
from geometry_msgs.msg import PointStamped
from rclpy.callback_groups import MutuallyExclusiveCallbackGroup
from rclpy.clock import Clock, ClockType
from rclpy.lifecycle import LifecycleState, TransitionCallbackReturn
from rclpy.qos import HistoryPolicy, QoSProfile, ReliabilityPolicy
from sensor_msgs.msg import CameraInfo, CompressedImage, Image

from photon_core.draw import draw_results
from photon_core.runtime.decode import engine_diagnostics
from photon_core.runtime.requests import Request
from photon_core.runtime.batcher import CANCEL_POLL_S
from photon_core.runtime.shared_models import SharedModel, shared_engine
from photon_ros.diagnostics import publish_status
from photon_ros.depth_projection import DepthSettings, NoDepth, depth_view
from photon_ros.frames import optical_frame_doubt, tf2_lookup
from photon_ros.image_conversions import compressed_to_rgb, image_to_rgb, rgb_to_image
from photon_ros.input_health import FAILING_IN_A_ROW, InputHealth
from photon_ros.latest_frame import LatestFrame
from photon_ros.latched_topic import LatchedReader
from photon_ros.managed import ManagedNode, health, ready_or_released
from photon_ros.msg import Detections, Objects3D, Points, Segmentation, VisionText
from photon_ros.params import NodeParams
from photon_ros.rate_stats import RateStats
from photon_ros.result_messages import (detection2d_array, detections_message, points_message,
                                        segmentation_message, time_to_seconds, vision_text_message)
from photon_ros.run_node import exit_on_help, run_node
from photon_ros.spatial import detection3d_array, objects_3d, point_positions
from photon_ros.stamp_pairing import JUMP_BACK_NS, Match, StampPairing, Wait, stamp_ns
from photon_ros.tracking import IdSource, StreamTrackers
from photon_ros.vision_actions import VisionActions
from photon_ros.vision_requests import engine_request, missing_reasoning, request_options
from photon_ros.srv import Infer
from photon_ros.vision_params import targets, vision_params

VISION_SKILLS = {"detect", "point", "caption", "query", "segment"}
TASKS = (Infer.Request.TASK_DETECT, Infer.Request.TASK_POINT, Infer.Request.TASK_CAPTION,
         Infer.Request.TASK_QUERY, Infer.Request.TASK_SEGMENT)   # the infer service's


def load_vision_model(name: str, device: str, dtype: str | None, backend: str = "auto", skills: list[str] = ()):
    """The process's shared engine for this checkpoint, of any family with `skills` (the registry
    recognises the family from the files). backend "auto": our kernels and decode megakernel on
    CUDA, PyTorch on CPU (photon_core.backends.select)."""
    return shared_engine(name, device, dtype, backend, skills)


def check_vision_model(engine: SharedModel, name: str) -> None:
    """Refuse a model of a family without any vision skill (a speech model named by mistake)."""
    family = engine.family
    if not family.skills & VISION_SKILLS:
        raise ValueError(f"{name!r} is a {family.name} model ({', '.join(sorted(family.skills))}), "
                         "not a vision model")


def skills_in_use(detect: list[str], point: list[str], caption: bool, segment: list[str] = ()) -> list[str]:
    """The skills the node's standing tasks need from its model."""
    return [s for s, used in (("detect", detect), ("point", point), ("caption", caption), ("segment", segment))
            if used]


def warm_up(engine, per_frame: int = 1) -> None:
    """A batch of tiny requests through the engine, as many as a frame of this node's standing tasks
    makes (at least one), so that kernel compilation (Triton, on a GPU), first allocations, lazy
    imports and the compiled decode step of that batch size (built per batch bucket on first use:
    seconds to tens of seconds at real sizes on a GPU) happen at startup, not on the first frame."""
    image = np.zeros((32, 32, 3), np.uint8)
    skills = engine.family.skills if engine.family is not None else {"detect"}
    request = (Request("detect", image, "object", max_objects=1) if "detect" in skills
               else Request("caption", image, "short", max_tokens=2))
    engine.batcher.submit([request] * max(1, per_frame))


def frame_requests(rgb, detect: list[str], point: list[str], caption_length: str | None,
                   max_objects: int) -> list[Request]:
    """Every task configured for one frame, as engine requests (decoded together, in this order)."""
    return ([Request("detect", rgb, target, max_objects=max_objects) for target in detect]
            + [Request("point", rgb, target, max_objects=max_objects) for target in point]
            + ([Request("caption", rgb, caption_length)] if caption_length else []))


def prepared_image(engine: SharedModel, rgb):
    """The frame as the model takes it: its crops made here, in this camera's worker thread, where
    the model can make them ahead (Moondream's prepare: 14-67 ms of Lanczos-3 a frame on 2 CPU
    cores, bench/RESULTS.md "Moondream crops"; on a GPU the same bytes in under a millisecond there,
    runtime/lanczos.py), rather than inside the batch every camera waits on; the frame itself for
    a model that makes none."""
    model = engine.model
    return model.prepare(rgb) if hasattr(model, "prepare") else rgb


def segment_frame(engine: SharedModel, rgb, targets: list[str], max_tokens: int,
                  cancel: threading.Event | None = None) -> list[dict]:
    """`segment` results for every target on one frame. Segment is not a batched skill: each call
    goes to the model's own segment() under the engine's lock (the lock the batcher takes too), one
    target at a time so that batched requests of other cameras run in between; the image is encoded
    once for all targets. With `cancel` (a goal's): once it is set, waiting for the lock or
    decoding ends, and the target's result is {"path": "", "bbox": what was found, "error": "canceled"}."""
    if not targets:
        return []
    if not _acquire(engine.lock, cancel):
        return [CANCELED_SEGMENT] * len(targets)
    try:
        encoded = engine.model.encode_image(rgb)
    finally:
        engine.lock.release()
    results = []
    for target in targets:
        if not _acquire(engine.lock, cancel):
            return results + [CANCELED_SEGMENT] * (len(targets) - len(results))
        try:
            settings = {"max_tokens": max_tokens}
            results.append(engine.model.segment(encoded, target, settings=settings) if cancel is None else
                           segment_until(engine.model.segment(encoded, target, stream=True, settings=settings), cancel))
        finally:
            engine.lock.release()
    return results


def _acquire(lock: threading.Lock, cancel: threading.Event | None) -> bool:
    """`lock` held (True), or `cancel` set while it was waited for (False)."""
    while not lock.acquire(timeout=CANCEL_POLL_S if cancel is not None else -1):
        if cancel is not None and cancel.is_set():
            return False
    return True


CANCELED_SEGMENT = {"path": "", "bbox": None, "error": "canceled"}
IDLE_CHECK_S = 1.0   # with no task on every frame, a frame is read this often to tell it can be


def segment_until(updates, cancel: threading.Event) -> dict:
    """segment()'s result from its stream of updates, or once `cancel` is set between two of them,
    what was found so far, marked canceled (the decode stops there)."""
    box = None
    try:
        for update in updates:
            if update.get("completed"):
                return {k: v for k, v in update.items() if k != "completed"}
            box = update.get("bbox", box)
            if cancel.is_set():
                return {**CANCELED_SEGMENT, "bbox": box}
    finally:
        if callable(close := getattr(updates, "close", None)):
            close()   # a generator's decode stops here
    return {**CANCELED_SEGMENT, "bbox": box}


class VisionNode(ManagedNode):
    kind = "vision"
    blocking_callbacks = 2   # a transition, and the infer service (it waits on the engine)

    def __init__(self, **kwargs) -> None:
        super().__init__("vision", **kwargs)
        self.track_ids = IdSource.clock_based()   # unique across this node's prompts, and its restarts
        self.tracked_epoch: int | None = None      # the activation the trackers' tracks come from
        self.params = NodeParams(self, vision_params(), apply=self.apply_params, check_all=self.check_params)
        self.model_name = self.params["model"]   # the one loaded: read again at configure
        self.apply_params(self.params.values)

        self.frames = LatestFrame()
        self.stats = RateStats()
        self.bad_frames = 0
        self.health = InputHealth()   # frames lost on the way, frames failing in a row
        self.depth_health = InputHealth()   # depth images lost on the way (best-effort QoS drops them)
        self.info_health = InputHealth()    # camera_info messages lost on the way
        self.inactive_frames = 0   # frames not processed because the node was not active
        self.frames_done = 0       # frames the worker took and is done with (their results out, or none)
        self.last_caption = 0.0
        self.last_idle_check = -math.inf
        self.subscription = None
        self.image_qos = self.params["reliability"]   # the image subscription's (read at configure)
        self.pub_detections = self.pub_points = self.pub_caption = self.pub_segmentation = None
        self.pub_annotated = self.pub_detection2d = None
        self.depth_subscriptions: list = []
        self.latched_info = None
        self.pub_objects_3d = self.pub_point_positions = self.pub_detection3d = None
        self.lookup = None   # tf2 into target_frame (configure), None: the optical frame
        self.target_frame = ""
        self.depth_stream: StampPairing | None = None    # depth images by stamp, and frames waiting
        self.info_stream: StampPairing | None = None     # camera_info alike (use_depth, at configure)
        self.frames_without_depth, self.without_depth_in_a_row, self.depth_note = 0, 0, ""
        self.doubted_frames: set[str] = set()   # frames warned of once: not named optical
        self.received_before = 0   # frames.received when this configuration began
        self.depth_waits_s: deque[float] = deque(maxlen=200)   # results held back for depth, per frame
        # infer / find / ask requests the node or the model refused (a task, an option) or failed on
        self.requests_failed, self.last_request_error = 0, ""

        # Diagnostics (a plain publisher, not a lifecycle one) and the service exist in every
        # lifecycle state: a robot wants to see, and ask, an inactive or unconfigured node too.
        out = QoSProfile(depth=10, reliability=ReliabilityPolicy.RELIABLE)
        self.pub_diagnostics = self.create_publisher(DiagnosticArray, "/diagnostics", out)
        # The service waits on the model; its own group keeps it off the timers' thread.
        self.create_service(Infer, "infer", self.on_infer, callback_group=MutuallyExclusiveCallbackGroup())
        self.actions = VisionActions(self)   # find / ask, with feedback and cancel
        # A group of its own too: a configure served by the lifecycle service holds the default
        # group for as long as the model loads, and diagnostics must say "loading" meanwhile. On the
        # steady clock: under use_sim_time a simulator not started or paused silenced them.
        self.create_timer(1.0, self.publish_diagnostics, callback_group=MutuallyExclusiveCallbackGroup(),
                          clock=Clock(clock_type=ClockType.STEADY_TIME))
        self.start_worker()

    # --- lifecycle: topics and model ---------------------------------------------------------------
    def on_configure(self, state: LifecycleState) -> TransitionCallbackReturn:
        # Here, not at activate: configure replaces the model, the subscriptions and the depth
        # settings that the old failures were about, where a deactivate and activate keep them all
        # (a camera that still fails must still say so).
        self.input_starts_afresh()
        return super().on_configure(state)

    def on_activate(self, state: LifecycleState) -> TransitionCallbackReturn:
        # frames are counted from here: rates read over the time since the node was built said
        # 2.9 Hz of a 10 Hz camera for 10 s after a 5 s model load
        self.stats.restart()
        return super().on_activate(state)

    def input_starts_afresh(self) -> None:
        """Forget how the previous configuration's input went: its failures in a row (a fixed model
        or camera may see no frame for a long while to clear them) and its publishers' numbers."""
        for input_health in (self.health, self.depth_health, self.info_health):
            input_health.reset()
        self.without_depth_in_a_row = 0
        # frames.received keeps counting (received == taken + dropped for the graph probe): what
        # this configuration received is counted from here, and its silence from nothing
        self.received_before = self.frames.received
        self.last_input_at = None

    def create_interfaces(self) -> None:
        param = self.params.__getitem__
        reliable = param("reliability") == "reliable"
        qos = QoSProfile(depth=param("depth"), history=HistoryPolicy.KEEP_LAST,
                         reliability=ReliabilityPolicy.RELIABLE if reliable else ReliabilityPolicy.BEST_EFFORT)
        # image_transport's name for the compressed stream: `<image>/compressed` of the image topic as
        # resolved (namespace, remaps), so a remap of `image` moves it too (a remap matches whole names)
        topic, msg_type = (("image", Image) if param("input") == "raw"
                           else (self.resolve_topic_name("image") + "/compressed", CompressedImage))
        self.image_qos = param("reliability")   # as subscribed, until the next configure
        self.incompatible_qos = ""
        self.subscription = self.create_subscription(msg_type, topic, self.on_image, qos,
                                                     event_callbacks=self.qos_events(topic, "its images never arrive"))
        out = QoSProfile(depth=10, reliability=ReliabilityPolicy.RELIABLE)
        self.pub_detections = self.create_lifecycle_publisher(Detections, "detections", out)
        self.pub_points = self.create_lifecycle_publisher(Points, "points", out)
        self.pub_caption = self.create_lifecycle_publisher(VisionText, "caption", out)
        self.pub_segmentation = self.create_lifecycle_publisher(Segmentation, "segmentation", out)
        self.pub_annotated = self.create_lifecycle_publisher(Image, "image_annotated", out)
        self.pub_detection2d = self.vision_msgs_publisher(out)
        if param("use_depth"):
            self.create_depth_interfaces(out)

    def create_depth_interfaces(self, out: QoSProfile) -> None:
        """depth + camera_info in, objects_3d (and point_positions, vision_msgs detections_3d) out;
        a target_frame this machine cannot serve (no tf2_ros) fails the configure with the reason.
        camera_info comes as sensor data (drivers that publish it with every frame); a driver that
        latches it (published once, transient local) gets a latched subscription too, once it is
        seen (photon_ros.latched_topic), so that the one it published before this node subscribed comes.
        Not before: a volatile publisher would log each such subscription as incompatible."""
        # read once: a change applies at the next configure, as the parameter says
        self.target_frame = self.params["target_frame"]
        self.lookup = tf2_lookup(self) if self.target_frame else None
        tolerance = self.params["depth_tolerance_s"]
        self.depth_stream = StampPairing("depth image", tolerance)
        self.info_stream = StampPairing("camera_info", tolerance, keep=4, fallback_newest=True)
        sensor = QoSProfile(depth=5, history=HistoryPolicy.KEEP_LAST, reliability=ReliabilityPolicy.BEST_EFFORT)
        self.depth_subscriptions = [
            self.create_subscription(Image, "depth", self.on_depth, sensor),
            self.create_subscription(CameraInfo, "camera_info", self.on_camera_info, sensor)]
        self.latched_info = LatchedReader(self, CameraInfo, "camera_info", self.on_camera_info)
        self.pub_objects_3d = self.create_lifecycle_publisher(Objects3D, "objects_3d", out)
        self.pub_point_positions = self.create_lifecycle_publisher(PointStamped, "point_positions", out)
        self.pub_detection3d = None
        if detection3d_array(Objects3D()) is not None:   # vision_msgs installed
            from vision_msgs.msg import Detection3DArray
            self.pub_detection3d = self.create_lifecycle_publisher(Detection3DArray, "detections_3d", out)

    def on_depth(self, msg: Image, info) -> None:
        # a frame whose own depth was lost takes the nearest within the tolerance: counted, so
        # /diagnostics says why frames were paired with a neighbour's depth
        self.depth_health.arrived(info)
        self.note_input(self.depth_stream, msg, info)

    def on_camera_info(self, msg: CameraInfo, info) -> None:
        self.info_health.arrived(info)
        self.note_input(self.info_stream, msg, info)

    def note_input(self, stream: StampPairing | None, msg, info) -> None:
        if stream is not None:   # None: arrived while the interfaces were being destroyed
            note = stream.add(stamp_ns(msg.header.stamp), msg, reception_time(info))
            if note:
                self.get_logger().warning(note, throttle_duration_sec=5.0)

    def depth_waits(self, header, arrived_at: float | None = None, camera: bool = False) -> "DepthWaits | None":
        """A colour frame's pairings with depth and camera_info, from its arrival (`arrived_at`:
        reception_time; None: now, as for an image sent with a request); None without use_depth.
        `camera`: a frame of the subscribed stream (an image sent with a request is not).
        Never waits: the frame's results wait for them (space), not its arrival."""
        depth, info = self.depth_stream, self.info_stream
        if depth is None or info is None:
            return None
        stamp = stamp_ns(header.stamp)
        return DepthWaits(depth.wait_for(stamp, arrived_at, camera), info.wait_for(stamp, arrived_at, camera))

    def destroy_interfaces(self) -> None:
        if self.latched_info is not None:
            self.latched_info.destroy()
        for sub in self.depth_subscriptions:
            self.destroy_subscription(sub)
        self.latched_info = None
        for pub in (self.pub_objects_3d, self.pub_point_positions, self.pub_detection3d):
            if pub is not None:
                self.destroy_lifecycle_publisher(pub)
        close = getattr(self.lookup, "close", None)
        if close is not None:
            close()   # the tf listener's subscriptions go with the interfaces
        self.depth_subscriptions, self.lookup = [], None
        self.depth_stream = self.info_stream = None
        self.pub_objects_3d = self.pub_point_positions = self.pub_detection3d = None
        if self.subscription is not None:
            self.destroy_subscription(self.subscription)
        for pub in (self.pub_detections, self.pub_points, self.pub_caption, self.pub_segmentation,
                    self.pub_annotated, self.pub_detection2d):
            if pub is not None:
                self.destroy_lifecycle_publisher(pub)
        self.subscription = self.pub_detections = self.pub_points = self.pub_caption = None
        self.pub_segmentation = None
        self.pub_annotated = self.pub_detection2d = None

    def load_engine(self) -> SharedModel:
        started = time.monotonic()
        self.device, self.dtype, self.backend = (self.params[n] for n in ("device", "dtype", "backend"))
        # auto: the family's default for the device (bfloat16 on a GPU, float32 on the CPU)
        dtype = None if self.dtype == "auto" else self.dtype
        engine = load_vision_model(self.model_name, self.device, dtype, self.backend, skills_in_use(
            self.detect_targets, self.point_targets, self.caption_period > 0, self.segment_targets))

        def prepare(engine: SharedModel) -> None:
            check_vision_model(engine, self.model_name)
            per_frame = frame_requests(None, self.detect_targets, self.point_targets,
                                       self.caption_length if self.caption_period > 0 else None, self.max_objects)
            warm_up(engine, len(per_frame))

        engine = ready_or_released(engine, prepare)
        self.get_logger().info(f"loaded {engine.model.model_id} in {time.monotonic() - started:.1f} s")
        return engine

    def drop_pending(self) -> None:
        # A frame waiting at deactivation is not processed after a later activate, and is no
        # longer "the latest frame" the infer service may be asked about.
        if self.frames.take(timeout=0) is not None:
            self.inactive_frames += 1
        self.frames.latest = None
        # The trackers are reset by the worker at its first frame of the next activation (process):
        # reset here, a frame still in the model would track into them after.

    # --- input ----------------------------------------------------------------------------------
    def on_image(self, msg, info) -> None:
        self.input_arrived()
        self.health.arrived(info)
        with self.activity.admitting() as admitted:
            if not admitted:
                self.inactive_frames += 1
                return
            self.stats.tick("received")
            self.frames.put(msg, self.depth_waits(msg.header, reception_time(info), camera=True), self.activity.current())

    def vision_msgs_publisher(self, qos):
        try:
            from vision_msgs.msg import Detection2DArray
        except ImportError:
            self.get_logger().info("vision_msgs not installed: no detections_2d topic")
            return None
        return self.create_lifecycle_publisher(Detection2DArray, "detections_2d", qos)

    def check_params(self, values: dict) -> str:
        """Why the tasks cannot run on the loaded model ("" when they can, or none is loaded), or
        why the depth range is empty."""
        if not values["depth_min_m"] < values["depth_max_m"]:
            return f"depth_min_m ({values['depth_min_m']:g}) must be below depth_max_m ({values['depth_max_m']:g})"
        for task in ("detect", "point", "segment"):
            if targets(values[task]) and self.lacks(task):
                # the running model would fail every frame with them (its other results too), so they
                # wait for the model that can: say how to get there
                later = ("" if values["model"] == getattr(self, "model_name", values["model"]) else
                         f"; the model {values['model']!r} is loaded at the next configure: set {task} after it")
                return self.lacks(task) + later
        return ""

    def apply_params(self, values: dict) -> None:
        """Take the values of parameters that change at once (all of them at startup)."""
        for name, attr in (("segment_max_tokens", "segment_max_tokens"), ("caption_period_s", "caption_period"),
                           ("caption_length", "caption_length"), ("max_objects", "max_objects"),
                           ("publish_annotated", "annotate"), ("max_pixels", "max_pixels"),
                           ("max_frame_age_s", "max_frame_age")):
            if name in values:
                setattr(self, attr, values[name])
        if {"depth_min_m", "depth_max_m"} & set(values):
            # one object, built once a change is whole: the worker read the two values apart, and a
            # change of both between its reads made a range no check allowed (min above max), which
            # cost the frame every result
            self.depth_settings = DepthSettings(min_depth_m=self.params["depth_min_m"],
                                                max_depth_m=self.params["depth_max_m"])
        if {"track_max_missed", "track_max_age_s", "tracking"} & set(values):   # new settings: tracks start over
            self.trackers = StreamTrackers(ids=self.track_ids, max_missed=self.params["track_max_missed"],
                                           max_age_s=self.params["track_max_age_s"] or math.inf)
        for task in ("detect", "point", "segment"):
            if task in values:
                setattr(self, f"{task}_targets", targets(values[task]))
        if {"detect", "point", "track_max_missed", "track_max_age_s", "tracking"} & set(values):
            # a prompt asked again later gets new ids (new trackers too: they learn the prompts now)
            self.trackers.retain([("detect", t) for t in self.detect_targets]
                                 + [("point", t) for t in self.point_targets])

    # --- worker ---------------------------------------------------------------------------------
    def work(self) -> None:
        while not self.stopping.is_set():
            running_now = self.activity.wait_running(timeout=0.1) is not None
            frame = self.frames.take(timeout=0.1) if running_now else None
            if frame is None:
                continue
            # the frame's own activation, not the one read before waiting for it: a deactivate and
            # activate inside that wait dropped the first frame of the new activation (None: taken
            # in while an autostart loaded the model, before the first activation)
            epoch = frame.epoch if frame.epoch is not None else self.activity.current()
            with self.activity.work(epoch) as running:
                if running:
                    self.process_guarded(frame, epoch)
                else:   # deactivated since it was taken
                    self.inactive_frames += 1
            self.frames_done += 1

    def process_guarded(self, frame, epoch: int) -> None:
        """process, surviving what it did not foresee: this thread is the node's only worker, and
        if it died the node would go on receiving frames and never publish again."""
        try:
            self.process(frame, epoch)
        except Exception as err:  # noqa: BLE001 - one frame, not the node
            self.bad_frames += 1
            self.health.failed(f"{type(err).__name__}: {err}")
            self.get_logger().error(f"frame failed unexpectedly ({type(err).__name__}: {err}); skipped",
                                    throttle_duration_sec=5.0)

    def to_rgb(self, msg):
        if isinstance(msg, CompressedImage):
            return compressed_to_rgb(msg, self.max_pixels)
        return image_to_rgb(msg, self.max_pixels)

    def read_frame(self, frame):
        """The camera frame's pixels, or None when they cannot be read (counted, said, and on
        /diagnostics)."""
        try:
            return self.to_rgb(frame.msg)
        except ValueError as err:
            self.bad_frames += 1
            self.health.failed(str(err))
            self.get_logger().warning(f"skipping frame: {err}", throttle_duration_sec=5.0)
            return None

    def check_idle_frame(self, frame) -> None:
        """With no task on every frame (the shipped config: find / ask / infer only) frames were
        never read, and a camera whose every frame is unreadable showed "running" while each
        request on it failed: one frame every IDLE_CHECK_S is read to tell."""
        now = time.monotonic()
        if now - self.last_idle_check < IDLE_CHECK_S:
            return
        self.last_idle_check = now
        if self.read_frame(frame) is not None:
            self.health.succeeded()

    def process(self, frame, epoch: int) -> None:
        caption_due = self.caption_period > 0 and time.monotonic() - self.last_caption >= self.caption_period
        detect, point, segment = list(self.detect_targets), list(self.point_targets), list(self.segment_targets)
        if not (detect or point or caption_due or segment):
            self.check_idle_frame(frame)
            return
        rgb = self.read_frame(frame)
        if rgb is None:
            return
        header, (height, width) = frame.msg.header, rgb.shape[:2]
        if caption_due:
            self.last_caption = time.monotonic()
        # One group per frame: its requests, and those of every other camera on this engine, are
        # decoded as one batch.
        requests: list[Request] = []
        try:
            image = prepared_image(self.engine, rgb)
            requests = frame_requests(image, detect, point, self.caption_length if caption_due else None,
                                      self.max_objects)
            results = self.engine.batcher.submit(requests) if requests else []
            segments = segment_frame(self.engine, image, segment, self.segment_max_tokens)
        except Exception as err:  # noqa: BLE001 - a frame the model cannot take must not stop the worker
            self.bad_frames += 1
            self.health.failed(f"the model failed: {err}")
            self.get_logger().warning(f"frame not processed: {err}", throttle_duration_sec=5.0)
            return
        if epoch != self.tracked_epoch:   # a new activation: ids are not handed to whatever is there by now
            self.trackers.reset()
            self.tracked_epoch = epoch
        # The frame's depth was waited for while the model ran: its pairing began at its arrival.
        space = self.space(header, width, height, frame.extra) if (detect or point) else None
        latency = time.monotonic() - frame.received_at
        outputs, boxes, points = self.result_messages(requests, results, header, width, height, latency, space,
                                                      frame.received_at)
        masks = dict(zip(segment, segments))
        outputs += self.segmentation_messages(masks, header, width, height, latency)
        annotated = None
        if self.annotate and (boxes or points or masks) and self.pub_annotated.get_subscription_count() > 0:
            try:   # a picture for people: its failure must not cost the frame's results
                annotated = rgb_to_image(draw_results(rgb, boxes, points, masks), header=header,
                                         max_pixels=self.max_pixels)
            except Exception as err:  # noqa: BLE001 - logged; the results still go out
                self.get_logger().warning(f"image_annotated not drawn: {type(err).__name__}: {err}",
                                          throttle_duration_sec=5.0)
        with self.activity.publishing(epoch) as current:
            if not current:   # deactivated meanwhile: results of that activation stay unpublished
                self.inactive_frames += 1
                return
            for publisher, msg in outputs:
                publisher.publish(msg)
            if annotated is not None:
                self.pub_annotated.publish(annotated)
        self.health.succeeded()
        self.stats.tick("processed", latency=time.monotonic() - frame.received_at)

    def space(self, header, width: int, height: int, waits: "DepthWaits | None" = None,
              carried: bool = False) -> tuple | None:
        """Where a frame's results go in 3D: (depth view or why there is none, the frame the
        positions are in, the transform there or why there is none); None without use_depth.
        `waits`: the frame's pairings, begun at its arrival (depth_waits); None: begun now (an
        image sent with a request). Waits for them to be decided: the tolerance from the frame's
        arrival at most. `carried`: an image sent with the request, which must name its frame to
        be placed with this camera's depth (a stamp alone paired any image with it)."""
        if self.pub_objects_3d is None:
            return None
        waits = waits or self.depth_waits(header)
        if waits is None:
            return None
        started = time.monotonic()
        read_from = waits.depth.clock()
        paired, info = waits.depth.result(read_from=read_from), waits.camera_info.result(read_from=read_from)
        self.depth_waits_s.append(time.monotonic() - started)
        settings = self.depth_settings
        camera = info.msg if isinstance(info, Match) else NoDepth(info.reason)
        depth = depth_view(paired.msg if isinstance(paired, Match) else NoDepth(paired.reason), camera, width,
                           height, settings, rectified=self.params["rectified"], image_frame=header.frame_id)
        optical = (camera.header.frame_id if isinstance(info, Match) else "") or header.frame_id
        if carried and not header.frame_id and not isinstance(depth, NoDepth):
            depth = NoDepth("the image sent with the request names no frame (frame_id empty): it is placed with "
                            "this camera's depth only when it names the colour camera's frame")
        elif not optical and not isinstance(depth, NoDepth):
            depth = NoDepth("neither the image nor camera_info names a frame (frame_id empty): positions "
                            "would be metres in no frame")
        doubt = optical_frame_doubt(optical) if not isinstance(depth, NoDepth) else ""
        if doubt and optical not in self.doubted_frames:
            self.doubted_frames.add(optical)
            self.get_logger().warning(doubt)
        transform = None
        if self.lookup is not None and not isinstance(depth, NoDepth):
            try:
                transform = self.lookup(self.target_frame, optical, stamp_ns(header.stamp))
            except LookupError as err:
                transform = err
        if isinstance(depth, NoDepth) or isinstance(transform, LookupError):
            self.frames_without_depth += 1
            self.without_depth_in_a_row += 1
            self.depth_note = str(transform) if isinstance(transform, LookupError) else depth.reason
            self.get_logger().warning(f"results without 3D: {self.depth_note}", throttle_duration_sec=5.0)
        else:
            self.without_depth_in_a_row = 0
        frame_id = self.target_frame if self.lookup is not None else optical
        return depth, frame_id, transform

    def placed(self, task: str, prompt: str, msg, space: tuple, model_id: str, latency: float) -> list:
        """(publisher, message) for one 2D result's objects in 3D."""
        o3 = objects_3d(task, prompt, msg.detections if task == "detect" else msg.points, msg.header, *space)
        o3.model_id, o3.latency = model_id, msg.latency
        outputs = [(self.pub_objects_3d, o3)]
        if task == "point":
            outputs += [(self.pub_point_positions, p) for p in point_positions(o3)]
        elif self.pub_detection3d is not None:
            outputs.append((self.pub_detection3d, detection3d_array(o3)))
        return outputs

    def result_messages(self, requests: list[Request], results: list[dict], header, width: int,
                        height: int, latency: float, space: tuple | None = None,
                        received_at: float | None = None) -> tuple[list, dict, dict]:
        """(publisher, message) for every result of one frame, and the boxes and points to draw
        (`received_at`: the frame's arrival, monotonic s, for tracking an unstamped camera)."""
        model_id = self.engine.model.model_id
        outputs, boxes, points = [], {}, {}
        for request, result in zip(requests, results):
            if request.task == "detect":
                boxes[request.prompt] = result["objects"]
                msg = detections_message(result, header, prompt=request.prompt, width=width, height=height,
                                         latency=latency, model_id=model_id)
                self.track("detect", request.prompt, msg.detections, header, width, height, received_at)
                outputs.append((self.pub_detections, msg))
                if space is not None:
                    outputs += self.placed("detect", request.prompt, msg, space, model_id, latency)
                if self.pub_detection2d is not None:
                    outputs.append((self.pub_detection2d, detection2d_array(msg)))
            elif request.task == "point":
                points[request.prompt] = result["points"]
                msg = points_message(result, header, prompt=request.prompt, width=width, height=height,
                                     latency=latency, model_id=model_id)
                self.track("point", request.prompt, msg.points, header, width, height, received_at)
                outputs.append((self.pub_points, msg))
                if space is not None:
                    outputs += self.placed("point", request.prompt, msg, space, model_id, latency)
            else:
                outputs.append((self.pub_caption, vision_text_message(
                    result["caption"], header, task=VisionText.TASK_CAPTION, prompt=request.prompt,
                    latency=latency, model_id=model_id)))
        return outputs, boxes, points

    def track(self, task: str, prompt: str, items: list, header, width: int, height: int,
              received_at: float | None = None) -> None:
        """Give each detection or point of one frame's result its track id (in place).
        `received_at`: the frame's arrival (monotonic s), its time where it has no stamp."""
        if not self.params["tracking"]:
            return
        tracker = self.trackers.get(task, prompt)
        rows = ([(d.x_min_px, d.y_min_px, d.x_max_px, d.y_max_px) for d in items] if task == "detect"
                else [(p.x_px, p.y_px) for p in items])
        stamp = time_to_seconds(header.stamp)
        if stamp == 0.0 and received_at is not None:
            # an unstamped camera: every frame at 0 never aged a track, and an object seen minutes
            # ago gave its id to whatever is at its place now (track_max_age_s)
            stamp = received_at
        last = tracker.last_result_stamp
        if last is not None and stamp < last - JUMP_BACK_NS / 1e9:
            tracker.reset()   # the stream went back in time (a bag played again): new tracks
        elif last is not None and stamp < last:
            return   # a frame older than the last result (two publishers, reordering): untracked (id 0)
        # frame: another camera's frame (a topic switched between cameras) ends the tracks, as a
        # new image size does: the object at the same pixels there is another one
        for item, tracked in zip(items, tracker.update(rows, stamp, (width, height), frame=header.frame_id)):
            item.track_id = tracked.track_id

    def segmentation_messages(self, masks: dict[str, dict], header, width: int, height: int,
                              latency: float) -> list:
        """(publisher, Segmentation) for every segment result of one frame (object -> result)."""
        model_id = self.engine.model.model_id
        return [(self.pub_segmentation, segmentation_message(result, header, prompt=target, width=width,
                                                             height=height, latency=latency, model_id=model_id))
                for target, result in masks.items()]

    def lacks(self, skill: str | None) -> str:
        """Why the loaded model cannot do `skill` ("" when it can, or nothing is loaded yet)."""
        family = getattr(self.engine, "family", None)
        if skill is None or family is None or skill in family.skills:
            return ""
        return f"a {family.name} model cannot {skill} (it offers {', '.join(sorted(family.skills))})"

    # --- on demand ------------------------------------------------------------------------------
    def on_infer(self, request: Infer.Request, response: Infer.Response) -> Infer.Response:
        received = time.monotonic()
        epoch = self.activity.current()
        # Counted as work in flight: cleanup does not release the model under a request.
        with self.activity.work(epoch) as running:
            if not running or epoch is None:   # (None: not active when it came; work(None) admits any)
                response.success, response.message = False, self.why_not_running()
                return response
            response = self.infer(request, response, received)
            if response.success and self.activity.current() != epoch:
                # as the topics are: results of work begun in an activation that ended are not given
                answered = Infer.Response()
                answered.success = False
                answered.message = "the node was deactivated while the request ran: its result is not given"
                return answered
            return response

    def infer(self, request: Infer.Request, response: Infer.Response, received: float) -> Infer.Response:
        if request.task not in TASKS:   # not "a moondream model cannot Detect": no model can
            response.success = False
            response.message = self.refused("infer", f"task must be one of {', '.join(TASKS)}, got {request.task!r}")
            return response
        if self.lacks(request.task):
            response.success, response.message = False, self.refused("infer", self.lacks(request.task))
            return response
        latest = self.frames.latest
        if request.use_latest_frame and latest is None:
            response.success, response.message = False, "no frame received yet"
            return response
        if request.use_latest_frame:
            refusal = stale_frame(received - latest.received_at, self.max_frame_age)
            if refusal:
                response.success, response.message = False, refusal
                return response
        source = latest.msg if request.use_latest_frame else request.image
        placing = request.task in (Infer.Request.TASK_DETECT, Infer.Request.TASK_POINT)
        # Paired from the frame's arrival (the request's, for an image it carries), while the model runs.
        waits = (latest.extra if request.use_latest_frame else self.depth_waits(source.header)) if placing else None
        try:
            request_options(request.task, request, self.max_objects)   # checked before the image is read
            rgb = self.to_rgb(source)
            if request.task == Infer.Request.TASK_SEGMENT:   # not a batched skill (see segment_frame)
                result = segment_frame(self.engine, rgb, [request.prompt], self.segment_max_tokens)[0]
            else:
                task = engine_request(request.task, rgb, request.prompt, request, self.max_objects)
                result = self.engine.batcher.submit([task])[0]
            missing_reasoning(request.reasoning, result)
            space = (self.space(source.header, rgb.shape[1], rgb.shape[0], waits, carried=not request.use_latest_frame)
                     if placing else None)
        except Exception as err:  # noqa: BLE001 - a bad request is answered, never fatal
            response.success, response.message = False, self.refused("infer", str(err) or type(err).__name__)
            return response
        try:
            # "image received -> result ready", as on the topics: the latest frame came before the request
            since = latest.received_at if request.use_latest_frame else received
            self.answer(request, response, result, source.header, rgb.shape, space, time.monotonic() - since)
        except Exception as err:  # noqa: BLE001 - answered as a failure: never fatal to the node
            failed = Infer.Response()
            failed.success, failed.message = False, self.refused("infer", f"{type(err).__name__}: {err}")
            return failed
        response.success = True
        return response

    def answer(self, request: Infer.Request, response: Infer.Response, result: dict, header, shape: tuple,
               space: tuple | None, latency: float) -> None:
        """The model's result as the response's message for its task (and its objects in 3D)."""
        model_id = self.engine.model.model_id
        height, width = shape[:2]
        if request.task == Infer.Request.TASK_DETECT:
            response.detections = detections_message(result, header, prompt=request.prompt, width=width,
                                                     height=height, latency=latency, model_id=model_id)
            if space is not None:
                response.objects_3d = self.placed("detect", request.prompt, response.detections, space,
                                                  model_id, latency)[0][1]
        elif request.task == Infer.Request.TASK_POINT:
            response.points = points_message(result, header, prompt=request.prompt, width=width,
                                             height=height, latency=latency, model_id=model_id)
            if space is not None:
                response.objects_3d = self.placed("point", request.prompt, response.points, space,
                                                  model_id, latency)[0][1]
        elif request.task == Infer.Request.TASK_SEGMENT:
            response.segmentation = segmentation_message(result, header, prompt=request.prompt, width=width,
                                                         height=height, latency=latency, model_id=model_id)
        else:
            text = result.get("caption", result.get("answer", ""))
            response.text = vision_text_message(text, header, task=request.task, prompt=request.prompt,
                                                latency=latency, model_id=model_id,
                                                reasoning=result.get("reasoning"), width=width, height=height)

    def refused(self, what: str, reason: str) -> str:
        """`reason` (why an on-demand request failed: an option it may not take, a model that refused
        it or failed on it), logged and counted for /diagnostics."""
        self.requests_failed += 1
        self.last_request_error = f"{what}: {reason}"
        self.get_logger().warning(f"{what} refused: {reason}", throttle_duration_sec=1.0)
        return reason

    def stop_for_shutdown(self) -> None:
        if hasattr(self, "actions"):   # its goals end now, saying why (run_node lets the executor end them)
            self.actions.stop()        # (first: the goals' frame waits also end on the node's stop)
        super().stop_for_shutdown()

    def pending_goals(self) -> int:
        """Goals accepted and not yet ended: the executor must run their ends before it stops."""
        return self.actions.pending() if hasattr(self, "actions") else 0

    def destroy_node(self) -> None:
        if hasattr(self, "actions"):   # absent when __init__ refused a parameter
            # stopped first (as run_node stops it): a goal that registered after destroy()'s
            # cancels then ends at once instead of waiting out its frame wait
            self.stop_for_shutdown()
            self.actions.destroy()
        super().destroy_node()

    # --- diagnostics ----------------------------------------------------------------------------
    def depth_diagnostics(self) -> dict[str, str]:
        """How colour frames paired with depth and camera_info (every frame that arrived, processed
        or not), and how long results were held back for depth; empty without use_depth."""
        depth, info = self.depth_stream, self.info_stream
        if depth is None or info is None:
            return {}
        held = sorted(self.depth_waits_s) or [0.0]
        return {
            "depth_images_received": str(depth.received),
            "depth_images_lost_in_transport": str(self.depth_health.lost_in_transport),
            "camera_info_lost_in_transport": str(self.info_health.lost_in_transport),
            "camera_info_received": str(info.received),
            "depth_paired_exact": str(depth.outcomes["exact"]),
            "depth_paired_nearest": str(depth.outcomes["nearest"]),
            "depth_unpaired": str(depth.outcomes["none"]),
            "camera_info_paired_exact": str(info.outcomes["exact"]),
            "camera_info_latched_or_newest": str(info.outcomes["newest"] + info.outcomes["nearest"]),
            "depth_waits_given_up": str(depth.given_up + info.given_up),
            "depth_stamp_restarts": str(depth.restarts + info.restarts),
            # a frame's own message after the frame was decided: reached the process past the
            # deadline (depth_tolerance_s too short for the driver), or in time but its callback ran
            # late (the process too busy to run callbacks)
            "depth_images_too_late": str(depth.late),
            "depth_images_seen_too_late": str(depth.seen_late),
            "camera_info_too_late": str(info.late),
            "camera_info_seen_too_late": str(info.seen_late),
            "depth_hold_p50_ms": f"{held[len(held) // 2] * 1000:.1f}",
            "depth_hold_max_ms": f"{held[-1] * 1000:.1f}",
        }

    def publish_diagnostics(self) -> None:
        state = self.lifecycle_state()
        status = DiagnosticStatus(hardware_id=self.model_name)
        received = self.frames.received - self.received_before
        status.level, status.message = health(state, self.loading, self.model_error, received,
                                              "images", self.input_silence(), self.params["input_timeout_s"])
        if self.incompatible_qos and received == 0 and status.level < DiagnosticStatus.ERROR:
            status.level, status.message = DiagnosticStatus.WARN, self.incompatible_qos
        failing = self.health.failing("frames")
        if failing and state == "active":
            status.level, status.message = DiagnosticStatus.ERROR, failing
        elif (self.without_depth_in_a_row >= FAILING_IN_A_ROW and state == "active"
              and status.level < DiagnosticStatus.WARN):
            status.level = DiagnosticStatus.WARN
            status.message = f"the last {self.without_depth_in_a_row} frames had no 3D (last: {self.depth_note})"
        values = {
            "model": self.model_name,
            "model_loaded": str(self.engine is not None),
            "lifecycle_state": state,
            "image_qos": self.image_qos,
            "input_rate_hz": f"{self.stats.rate('received'):.2f}",
            "frames_received": str(self.frames.received),
            "frames_dropped": str(self.frames.dropped),
            "frames_ignored_inactive": str(self.inactive_frames),
            "bad_frames": str(self.bad_frames),
            "frames_without_depth": str(self.frames_without_depth),
            "last_depth_note": self.depth_note,
            **self.depth_diagnostics(),
            "frames_lost_in_transport": str(self.health.lost_in_transport),
            "processed_rate_hz": f"{self.stats.rate('processed'):.2f}",
            "requests_failed": str(self.requests_failed),
            "last_request_error": self.last_request_error,
            # which engine decodes each bucket on this GPU, and both times where measured (issue 38)
            **engine_diagnostics(),
        }
        for q, v in self.stats.latency_percentiles().items():
            values[f"latency_p{q}_ms"] = f"{v * 1000:.1f}"
        publish_status(self, self.pub_diagnostics, status, values)


def reception_time(info) -> float | None:
    """When a message reached this process (the middleware's reception time, wall clock seconds:
    the pairings take it onto their monotonic clock), from rclpy's MessageInfo; None where the
    middleware gives none (then: when the callback runs)."""
    received = info.get("received_timestamp") if info else None
    return received / 1e9 if received else None


class DepthWaits(NamedTuple):
    """A colour frame's pairings (photon_ros.stamp_pairing), begun when it arrived."""
    depth: Wait
    camera_info: Wait


def stale_frame(age: float, max_age: float) -> str:
    """Why the latest frame must not answer a request ("" when it may): a camera that stopped
    leaves its last frame behind, and a robot pointed where the cup was minutes ago acts on wrong
    data. max_age <= 0: any age."""
    if max_age <= 0 or age <= max_age:
        return ""
    return (f"the latest frame arrived {age:.1f} s ago, more than max_frame_age_s ({max_age:g} s): "
            "is the camera still publishing?")


def main(args=None) -> None:
    exit_on_help(args, __doc__, "photon_ros.vision_node", "vision")
    run_node(VisionNode, args)


if __name__ == "__main__":
    main()
