"""Vision node: camera in, detections / points / captions out.

    image (sensor_msgs/Image) or image/compressed (CompressedImage), sensor-data QoS by default
      -> newest-frame mailbox (frames arriving while the model is busy are counted and dropped)
      -> worker thread: convert; every configured task on the frame goes to the engine's batcher as
         one group (decoded in one batch with other cameras' groups, the image encoded once)
      -> detections, points (photon_ros), caption (VisionText), detections_2d (vision_msgs, where
         installed), image_annotated (only while someone subscribes); headers copied from the image.
    infer (photon_ros/Infer service): detect / point / caption / query on demand.
    /diagnostics: model state, input and processed rates, drops, latency percentiles.
Tasks (`detect`, `point`, `caption_period_s`, ...) are parameters that can change at runtime.
"""
from __future__ import annotations

import threading
import time

import numpy as np
from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus, KeyValue
from rcl_interfaces.msg import SetParametersResult
from rclpy.callback_groups import MutuallyExclusiveCallbackGroup
from rclpy.node import Node
from rclpy.parameter import Parameter
from rclpy.qos import HistoryPolicy, QoSProfile, ReliabilityPolicy
from sensor_msgs.msg import CompressedImage, Image
from std_msgs.msg import Header

from photon_core.draw import draw_results
from photon_core.runtime.requests import Request
from photon_core.runtime.shared_models import shared_engine
from photon_ros.run_node import run_node
from photon_ros.image_conversions import compressed_to_rgb, image_to_rgb, rgb_to_image
from photon_ros.latest_frame import LatestFrame
from photon_ros.msg import Detections, Points, VisionText
from photon_ros.rate_stats import RateStats
from photon_ros.result_messages import (detection2d_array, detections_message, points_message,
                                        vision_text_message)
from photon_ros.srv import Infer

VISION_SKILLS = {"detect", "point", "caption", "query", "segment"}
TASKS = (Infer.Request.TASK_DETECT, Infer.Request.TASK_POINT, Infer.Request.TASK_CAPTION,
         Infer.Request.TASK_QUERY)
CAPTION_LENGTHS = ("short", "normal", "long")


def load_vision_model(name: str, device: str, dtype: str, backend: str = "auto", skills: list[str] = ()):
    """The process's shared engine for this checkpoint, of any family with `skills` (the registry
    recognises the family from the files). backend "auto": our kernels and decode megakernel on
    CUDA, PyTorch on CPU (photon_core.backends.select)."""
    return shared_engine(name, device, dtype, backend, skills)


def skills_in_use(detect: list[str], point: list[str], caption: bool) -> list[str]:
    """The skills the node's standing tasks need from its model."""
    return [s for s, used in (("detect", detect), ("point", point), ("caption", caption)) if used]


def warm_up(engine) -> None:
    """One tiny request through the engine, so that kernel compilation (Triton, on a GPU), first
    allocations and lazy imports happen at startup instead of on the first camera frame."""
    image = np.zeros((32, 32, 3), np.uint8)
    skills = engine.family.skills if engine.family is not None else {"detect"}
    request = (Request("detect", image, "object", max_objects=1) if "detect" in skills
               else Request("caption", image, "short", max_tokens=2))
    engine.batcher.submit([request])


def frame_requests(rgb, detect: list[str], point: list[str], caption_length: str | None,
                   max_objects: int) -> list[Request]:
    """Every task configured for one frame, as engine requests (decoded together, in this order)."""
    return ([Request("detect", rgb, target, max_objects=max_objects) for target in detect]
            + [Request("point", rgb, target, max_objects=max_objects) for target in point]
            + ([Request("caption", rgb, caption_length)] if caption_length else []))


class VisionNode(Node):
    def __init__(self, **kwargs) -> None:
        super().__init__("vision", **kwargs)
        p = self.declare_parameter
        self.model_name = p("model", "moondream2").value
        self.device = p("device", "cpu").value
        self.dtype = p("dtype", "float32").value
        self.backend = p("backend", "auto").value
        compressed = p("input", "raw").value == "compressed"
        reliable = p("reliability", "best_effort").value == "reliable"
        depth = p("depth", 1).value
        self.detect_targets = self.targets(p("detect", Parameter.Type.STRING_ARRAY).value)
        self.point_targets = self.targets(p("point", Parameter.Type.STRING_ARRAY).value)
        self.caption_period = p("caption_period_s", 0.0).value
        self.caption_length = p("caption_length", "short").value
        self.max_objects = p("max_objects", 10).value
        self.annotate = p("publish_annotated", True).value
        self.max_pixels = p("max_pixels", 64_000_000).value
        self.add_on_set_parameters_callback(self.on_parameters)

        self.frames = LatestFrame()
        self.stats = RateStats()
        self.bad_frames = 0
        self.last_caption = 0.0
        self.engine = None
        self.model_error: str | None = None

        qos = QoSProfile(depth=depth, history=HistoryPolicy.KEEP_LAST,
                         reliability=ReliabilityPolicy.RELIABLE if reliable else ReliabilityPolicy.BEST_EFFORT)
        if compressed:
            self.create_subscription(CompressedImage, "image/compressed", self.on_image, qos)
        else:
            self.create_subscription(Image, "image", self.on_image, qos)
        out = QoSProfile(depth=10, reliability=ReliabilityPolicy.RELIABLE)
        self.pub_detections = self.create_publisher(Detections, "detections", out)
        self.pub_points = self.create_publisher(Points, "points", out)
        self.pub_caption = self.create_publisher(VisionText, "caption", out)
        self.pub_annotated = self.create_publisher(Image, "image_annotated", out)
        self.pub_diagnostics = self.create_publisher(DiagnosticArray, "/diagnostics", out)
        self.pub_detection2d = self.vision_msgs_publisher(out)
        # The service waits on the model; its own group keeps it off the timers' thread.
        self.create_service(Infer, "infer", self.on_infer, callback_group=MutuallyExclusiveCallbackGroup())
        self.create_timer(1.0, self.publish_diagnostics)
        self.stopping = threading.Event()
        self.worker = threading.Thread(target=self.work, daemon=True)
        self.worker.start()

    def on_image(self, msg) -> None:
        self.stats.tick("received")
        self.frames.put(msg)

    @staticmethod
    def targets(values) -> list[str]:
        return [v.strip() for v in (values or []) if v and v.strip()]

    def vision_msgs_publisher(self, qos):
        try:
            from vision_msgs.msg import Detection2DArray
        except ImportError:
            self.get_logger().info("vision_msgs not installed: no detections_2d topic")
            return None
        return self.create_publisher(Detection2DArray, "detections_2d", qos)

    def on_parameters(self, params: list[Parameter]) -> SetParametersResult:
        for param in params:
            lacking = self.lacks({"detect": "detect", "point": "point"}.get(param.name))
            if lacking and self.targets(param.value):
                return SetParametersResult(successful=False, reason=lacking)
            if param.name == "detect":
                self.detect_targets = self.targets(param.value)
            elif param.name == "point":
                self.point_targets = self.targets(param.value)
            elif param.name == "caption_period_s":
                self.caption_period = float(param.value)
            elif param.name == "caption_length":
                if param.value not in CAPTION_LENGTHS:
                    return SetParametersResult(successful=False, reason=f"one of {CAPTION_LENGTHS}")
                self.caption_length = param.value
            elif param.name == "max_objects":
                self.max_objects = int(param.value)
            elif param.name == "publish_annotated":
                self.annotate = bool(param.value)
        return SetParametersResult(successful=True)

    # --- worker ---------------------------------------------------------------------------------
    def work(self) -> None:
        try:
            started = time.monotonic()
            engine = load_vision_model(self.model_name, self.device, self.dtype, self.backend, skills_in_use(
                self.detect_targets, self.point_targets, self.caption_period > 0))
            if not engine.family.skills & VISION_SKILLS:
                raise ValueError(f"{self.model_name!r} is a {engine.family.name} model "
                                 f"({', '.join(sorted(engine.family.skills))}), not a vision model")
            warm_up(engine)
            self.engine = engine
            self.get_logger().info(f"loaded {engine.model.model_id} in {time.monotonic() - started:.1f} s")
        except Exception as err:  # noqa: BLE001 - the node stays up and reports why
            self.model_error = f"{type(err).__name__}: {err}"
            self.get_logger().error(f"cannot load vision model {self.model_name!r}: {self.model_error}")
            return
        while not self.stopping.is_set():
            frame = self.frames.take(timeout=0.1)
            if frame is not None:
                self.process(frame)

    def to_rgb(self, msg):
        if isinstance(msg, CompressedImage):
            return compressed_to_rgb(msg, self.max_pixels)
        return image_to_rgb(msg, self.max_pixels)

    def process(self, frame) -> None:
        caption_due = self.caption_period > 0 and time.monotonic() - self.last_caption >= self.caption_period
        detect, point = list(self.detect_targets), list(self.point_targets)
        if not (detect or point or caption_due):
            return
        try:
            rgb = self.to_rgb(frame.msg)
        except ValueError as err:
            self.bad_frames += 1
            self.get_logger().warning(f"skipping frame: {err}", throttle_duration_sec=5.0)
            return
        header, (height, width) = frame.msg.header, rgb.shape[:2]
        model = self.engine.model
        if caption_due:
            self.last_caption = time.monotonic()
        # One group per frame: its requests, and those of every other camera on this engine, are
        # decoded as one batch.
        requests = frame_requests(rgb, detect, point, self.caption_length if caption_due else None,
                                  self.max_objects)
        try:
            results = self.engine.batcher.submit(requests)
        except ValueError as err:
            self.get_logger().warning(f"frame not processed: {err}", throttle_duration_sec=5.0)
            return
        latency = time.monotonic() - frame.received_at
        boxes, points = {}, {}
        for request, result in zip(requests, results):
            if request.task == "detect":
                boxes[request.prompt] = result["objects"]
                msg = detections_message(result, header, prompt=request.prompt, width=width, height=height,
                                         latency=latency, model_id=model.model_id)
                self.pub_detections.publish(msg)
                if self.pub_detection2d is not None:
                    self.pub_detection2d.publish(detection2d_array(msg))
            elif request.task == "point":
                points[request.prompt] = result["points"]
                self.pub_points.publish(points_message(result, header, prompt=request.prompt, width=width,
                                                       height=height, latency=latency, model_id=model.model_id))
            else:
                self.pub_caption.publish(vision_text_message(
                    result["caption"], header, task=VisionText.TASK_CAPTION, prompt=request.prompt,
                    latency=latency, model_id=model.model_id))
        self.stats.tick("processed", latency=time.monotonic() - frame.received_at)
        if self.annotate and (boxes or points) and self.pub_annotated.get_subscription_count() > 0:
            self.pub_annotated.publish(rgb_to_image(draw_results(rgb, boxes, points), header=header))

    def lacks(self, skill: str | None) -> str:
        """Why the loaded model cannot do `skill` ("" when it can, or nothing is loaded yet)."""
        family = getattr(self.engine, "family", None)
        if skill is None or family is None or skill in family.skills:
            return ""
        return f"a {family.name} model cannot {skill} (it offers {', '.join(sorted(family.skills))})"

    # --- on demand ------------------------------------------------------------------------------
    def on_infer(self, request: Infer.Request, response: Infer.Response) -> Infer.Response:
        received = time.monotonic()
        if self.engine is None:
            response.success = False
            response.message = f"model not loaded: {self.model_error or 'still loading'}"
            return response
        if self.lacks(request.task):
            response.success, response.message = False, self.lacks(request.task)
            return response
        source = self.frames.latest.msg if request.use_latest_frame and self.frames.latest else request.image
        if request.use_latest_frame and self.frames.latest is None:
            response.success, response.message = False, "no frame received yet"
            return response
        try:
            rgb = self.to_rgb(source)
            task = Request(request.task, rgb, request.prompt, max_objects=self.max_objects)
            result = self.engine.batcher.submit([task])[0]
        except ValueError as err:
            response.success, response.message = False, str(err)
            return response
        model_id, header = self.engine.model.model_id, source.header
        height, width = rgb.shape[:2]
        latency = time.monotonic() - received
        if request.task == Infer.Request.TASK_DETECT:
            response.detections = detections_message(result, header, prompt=request.prompt, width=width,
                                                     height=height, latency=latency, model_id=model_id)
        elif request.task == Infer.Request.TASK_POINT:
            response.points = points_message(result, header, prompt=request.prompt, width=width,
                                             height=height, latency=latency, model_id=model_id)
        else:
            text = result.get("caption", result.get("answer", ""))
            response.text = vision_text_message(text, header, task=request.task, prompt=request.prompt,
                                                latency=latency, model_id=model_id)
        response.success = True
        return response

    # --- diagnostics ----------------------------------------------------------------------------
    def publish_diagnostics(self) -> None:
        status = DiagnosticStatus(name=f"photon_ros: {self.get_fully_qualified_name()}",
                                  hardware_id=self.model_name)
        if self.model_error:
            status.level, status.message = DiagnosticStatus.ERROR, f"model failed to load: {self.model_error}"
        elif self.engine is None:
            status.level, status.message = DiagnosticStatus.WARN, "loading model"
        elif self.frames.received == 0:
            status.level, status.message = DiagnosticStatus.WARN, "no images received"
        else:
            status.level, status.message = DiagnosticStatus.OK, "running"
        values = {
            "model": self.model_name,
            "model_loaded": str(self.engine is not None),
            "input_rate_hz": f"{self.stats.rate('received'):.2f}",
            "frames_received": str(self.frames.received),
            "frames_dropped": str(self.frames.dropped),
            "bad_frames": str(self.bad_frames),
            "processed_rate_hz": f"{self.stats.rate('processed'):.2f}",
        }
        for q, v in self.stats.latency_percentiles().items():
            values[f"latency_p{q}_ms"] = f"{v * 1000:.1f}"
        status.values = [KeyValue(key=k, value=v) for k, v in values.items()]
        header = Header(stamp=self.get_clock().now().to_msg())
        self.pub_diagnostics.publish(DiagnosticArray(header=header, status=[status]))

    def destroy_node(self) -> None:
        # The worker publishes: stop it before the publishers go away.
        self.stopping.set()
        self.worker.join(timeout=30)
        super().destroy_node()


def main(args=None) -> None:
    run_node(VisionNode, args)


if __name__ == "__main__":
    main()
