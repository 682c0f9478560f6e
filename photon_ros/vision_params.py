"""The vision node's parameters: each declared once, with its meaning, range and when a change
takes effect (photon_ros.params). Tasks, limits and the caption change at runtime; the model, its
device and the input topic at the next configure."""
from __future__ import annotations

from rclpy.parameter import Parameter

from photon_ros.frames import frame_refusal
from photon_ros.engine_params import DEVICES, device_refusal, model_refusal
from photon_ros.params import Param

CAPTION_LENGTHS = ("short", "normal", "long")
DTYPES = ("auto", "float32", "bfloat16", "float16")


def vision_params() -> list[Param]:
    return [
        Param("model", "moondream2", "checkpoint: a known name, a folder or a file (Moondream 2 / 3.1, "
              "Qwen 3.5, Gemma 4)", applies="configure", check=model_refusal),
        Param("device", "cpu", DEVICES, applies="configure", check=device_refusal),
        Param("dtype", "auto", "weights' dtype; auto: bfloat16 on a GPU, float32 on the CPU", choices=DTYPES,
              applies="configure"),
        Param("backend", "auto", "the engine's kernels: auto (the fastest usable here), reference (PyTorch), triton "
              "or megakernel (whether it can run here is checked when the model loads)",
              choices=("auto", "reference", "triton", "megakernel"), applies="configure"),
        Param("input", "raw", "subscribe to `image` (raw) or `<image>/compressed` (image_transport's name: "
              "it follows a remap of `image`)", choices=("raw", "compressed"), applies="configure"),
        Param("reliability", "best_effort", "QoS of the image subscription: best_effort matches every camera "
              "driver, best-effort (sensor-data QoS) and reliable alike; reliable matches only reliable ones, and "
              "the images of a best-effort one never arrive (/diagnostics says so)",
              choices=("best_effort", "reliable"), applies="configure"),
        Param("depth", 1, "image subscription queue depth (1: the newest frame wins)", low=1, applies="configure"),
        Param("detect", Parameter.Type.STRING_ARRAY, "objects to detect on every frame"),
        Param("point", Parameter.Type.STRING_ARRAY, "objects to point at on every frame"),
        Param("segment", Parameter.Type.STRING_ARRAY, "objects to segment on every frame (Moondream 3)"),
        Param("segment_max_tokens", 768, "the longest path a segment may take, in tokens", low=1),
        Param("caption_period_s", 0.0, "caption a frame every this many seconds; 0: never", low=0.0),
        Param("caption_length", "short", "length of the periodic captions (caption_period_s)", choices=CAPTION_LENGTHS),
        # 0 found nothing at all (a robot blind to obstacles while all looked well), not "no limit"
        Param("max_objects", 10, "most objects per prompt and frame, and a request's when it leaves its own at 0",
              low=1),
        Param("publish_annotated", True, "publish image_annotated (drawn only while someone subscribes)"),
        Param("max_pixels", 64_000_000, "larger frames are refused before they are decoded", low=1),
        Param("input_timeout_s", 5.0, "no frame for this long while active: /diagnostics warns that the camera may have "
              "stopped; 0: never (a camera triggered now and then)", low=0.0),
        Param("max_frame_age_s", 5.0, "infer, find and ask on the latest frame refuse one older than this; 0: any "
              "age", low=0.0),
        Param("use_depth", False, "also subscribe to `depth` (aligned to the colour image: 16UC1 mm or 32FC1 m) "
              "and `camera_info`, and publish detect / point results in metres on objects_3d",
              applies="configure"),
        Param("depth_tolerance_s", 0.05, "a colour frame pairs with the depth image and camera_info of its own "
              "stamp, else the nearest within this many seconds, waiting this long after its arrival for one",
              positive=True, applies="configure"),
        Param("depth_min_m", 0.1, "depths nearer than this are invalid (sensor minimum)", positive=True),
        Param("depth_max_m", 10.0, "depths farther than this are invalid (sensor range)", positive=True),
        Param("rectified", False, "the colour image is rectified (image_rect_color): camera_info's P, "
              "no distortion; false: K and the distortion (plumb_bob, rational_polynomial or none)"),
        Param("target_frame", "", "publish 3D results in this frame through tf2 (e.g. base_link, map); "
              "empty: the camera's optical frame", applies="configure", check=frame_refusal),
        Param("tracking", True, "give each detect / point result an id that follows the object across frames"),
        Param("track_max_missed", 5, "a track ends after this many model results in a row without it", low=1),
        Param("track_max_age_s", 10.0, "a track last detected this long ago ends, however few results came since "
              "(a camera off for minutes); 0: no limit", low=0.0),
    ]


def targets(values: list[str] | None) -> list[str]:
    """The non-empty prompts of a task parameter, stripped, each once (a repeated one was asked
    and published twice a frame, and its one tracker updated twice with the same frame)."""
    return list(dict.fromkeys(v.strip() for v in (values or []) if v and v.strip()))
