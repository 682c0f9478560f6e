"""Engine results (plain dicts from photon_core) -> our ROS messages, and time conversions."""
from __future__ import annotations

import math

from builtin_interfaces.msg import Duration, Time
from std_msgs.msg import Header

from photon_ros.msg import (Detection, Detections, GroundedSpan, ImagePoint, Points, Segmentation, Transcript,
                            TranscriptSegment, VisionText)


def time_to_seconds(stamp: Time) -> float:
    return stamp.sec + stamp.nanosec * 1e-9


_INT32 = 2**31


def _sec_nanosec(seconds: float) -> dict:
    """Seconds as builtin_interfaces' (sec, nanosec): rounded to the nanosecond and carried (1.9999999996
    is (2, 0), not (1, 999999999)). A value outside int32 seconds would be sent wrapped (field checks
    are off in release builds), a NaN or infinite one has no time: both refused, naming the value."""
    if not math.isfinite(seconds):
        raise ValueError(f"a time of {seconds} s cannot be a ROS time")
    sec, nanosec = divmod(round(seconds * 1e9), 1_000_000_000)
    if not -_INT32 <= sec < _INT32:
        raise ValueError(f"a time of {seconds} s is outside a ROS time's int32 seconds")
    return {"sec": int(sec), "nanosec": int(nanosec)}


def seconds_to_time(seconds: float) -> Time:
    return Time(**_sec_nanosec(seconds))


def seconds_to_duration(seconds: float) -> Duration:
    return Duration(**_sec_nanosec(seconds))


def transcript_message(result: dict, header: Header, *, audio_duration: float, processing_time: float,
                       latency: float, prompt: str, model_id: str, is_final: bool = True,
                       audio_complete: bool = True, audio_note: str = "") -> Transcript:
    """A Transcript from `transcribe()`'s result; segment times stay relative to the utterance."""
    return Transcript(
        header=header,
        text=result["text"].strip(),
        segments=[TranscriptSegment(start=float(s["start"]), end=float(s["end"]), text=s["text"].strip())
                  for s in result.get("segments", [])],
        language=result.get("language") or "",
        is_final=is_final,
        audio_complete=audio_complete,
        audio_note=audio_note,
        audio_duration=seconds_to_duration(audio_duration),
        processing_time=seconds_to_duration(processing_time),
        latency=seconds_to_duration(latency),
        prompt=prompt or "",
        model_id=model_id,
    )


def detections_message(result: dict, header: Header, *, prompt: str, width: int, height: int,
                       latency: float, model_id: str) -> Detections:
    """Detections from `detect()`'s {"objects": [...]} (normalized boxes), with pixel boxes added."""
    msg = Detections(header=header, prompt=prompt, model_id=model_id, image_width=width,
                     image_height=height, latency=seconds_to_duration(latency))
    for box in result["objects"]:
        msg.detections.append(Detection(
            label=prompt, score=float(box.get("score", math.nan)),
            x_min=box["x_min"], y_min=box["y_min"], x_max=box["x_max"], y_max=box["y_max"],
            x_min_px=box["x_min"] * width, y_min_px=box["y_min"] * height,
            x_max_px=box["x_max"] * width, y_max_px=box["y_max"] * height))
    return msg


def points_message(result: dict, header: Header, *, prompt: str, width: int, height: int,
                   latency: float, model_id: str) -> Points:
    msg = Points(header=header, prompt=prompt, model_id=model_id, image_width=width,
                 image_height=height, latency=seconds_to_duration(latency))
    msg.points = [ImagePoint(label=prompt, x=p["x"], y=p["y"], x_px=p["x"] * width, y_px=p["y"] * height,
                             score=float(p.get("score", math.nan)))
                  for p in result["points"]]
    return msg


def segmentation_message(result: dict, header: Header, *, prompt: str, width: int, height: int,
                         latency: float, model_id: str) -> Segmentation:
    """A Segmentation from `segment()`'s {"path", "bbox" (normalized, or None), "error" (optional)}:
    the path as it is (in the box's unit square), the box normalized and in pixels."""
    msg = Segmentation(header=header, prompt=prompt, model_id=model_id, image_width=width, image_height=height,
                       path=result.get("path") or "", error=result.get("error") or "",
                       latency=seconds_to_duration(latency))
    box = result.get("bbox")
    if box is not None:
        msg.has_bbox = True
        msg.x_min, msg.y_min, msg.x_max, msg.y_max = (float(box[k]) for k in ("x_min", "y_min", "x_max", "y_max"))
        msg.x_min_px, msg.x_max_px = float(box["x_min"]) * width, float(box["x_max"]) * width
        msg.y_min_px, msg.y_max_px = float(box["y_min"]) * height, float(box["y_max"]) * height
    return msg


def vision_text_message(text: str, header: Header, *, task: str, prompt: str, latency: float,
                        model_id: str, reasoning: dict | None = None, width: int = 0,
                        height: int = 0) -> VisionText:
    """A VisionText; `reasoning`: query()'s {"text", "grounding"} when it was asked with reasoning
    (its points placed in the `width` x `height` source image too)."""
    msg = VisionText(header=header, task=task, prompt=prompt, text=text.strip(), model_id=model_id,
                     latency=seconds_to_duration(latency))
    if reasoning is not None:
        msg.reasoning = reasoning["text"]
        msg.grounding = grounded_spans(reasoning, width, height)
    return msg


def grounded_spans(reasoning: dict, width: int, height: int) -> list[GroundedSpan]:
    """query()'s reasoning grounding [{"start_idx", "end_idx", "points": [(x, y), ...]}] (character
    offsets into the reasoning text, normalized points) as GroundedSpans, points also in pixels."""
    text, spans = reasoning["text"], []
    for g in reasoning.get("grounding", []):
        start, end = int(g["start_idx"]), int(g["end_idx"])
        piece = text[start:end]
        spans.append(GroundedSpan(start=start, end=end, text=piece, points=[
            ImagePoint(label=piece, score=math.nan, x=float(x), y=float(y), x_px=float(x) * width,
                       y_px=float(y) * height) for x, y in g["points"]]))
    return spans


def detection2d_array(msg: Detections):
    """The same detections as vision_msgs/Detection2DArray, or None where vision_msgs is not
    installed (it is not on PyPI; robots have it from apt)."""
    try:
        from vision_msgs.msg import Detection2D, Detection2DArray, ObjectHypothesisWithPose
    except ImportError:
        return None
    out = Detection2DArray(header=msg.header)
    for d in msg.detections:
        det = Detection2D(header=msg.header, id=str(d.track_id) if d.track_id else "")
        det.bbox.center.position.x = (d.x_min_px + d.x_max_px) / 2.0
        det.bbox.center.position.y = (d.y_min_px + d.y_max_px) / 2.0
        det.bbox.size_x = float(d.x_max_px - d.x_min_px)
        det.bbox.size_y = float(d.y_max_px - d.y_min_px)
        hypothesis = ObjectHypothesisWithPose()
        hypothesis.hypothesis.class_id = d.label
        hypothesis.hypothesis.score = 0.0 if math.isnan(d.score) else float(d.score)
        det.results.append(hypothesis)
        out.detections.append(det)
    return out
