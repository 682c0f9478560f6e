"""Our interfaces travel between real rclpy nodes over real DDS (Fast DDS, loopback only)."""
import numpy as np
import pytest
from builtin_interfaces.msg import Duration, Time
from rclpy.qos import QoSProfile, ReliabilityPolicy
from sensor_msgs.msg import CompressedImage, Image
from std_msgs.msg import Header

from photon_ros.audio_conversions import audio_chunk_to_pcm, pcm_to_audio_chunk
from photon_ros.image_conversions import compressed_to_rgb, image_to_rgb, rgb_to_compressed, rgb_to_image
from photon_ros.msg import (Detection, Detections, ImagePoint, Points, Transcript, TranscriptSegment,
                            VisionText)
from photon_ros.srv import Infer
from ros_harness import RosGraph, wait_for, wait_for_match

QOS = QoSProfile(depth=10, reliability=ReliabilityPolicy.RELIABLE)


@pytest.fixture(scope="module")
def graph():
    g = RosGraph()
    yield g
    g.close()


def header(frame="camera_optical"):
    return Header(stamp=Time(sec=1_700_000_123, nanosec=456_000), frame_id=frame)


def send(graph, msg_type, topic, msg):
    """Publish `msg` from one node and return what another node receives."""
    received = []
    sub_node = graph.node(f"sub_{topic}")
    sub_node.create_subscription(msg_type, topic, received.append, QOS)
    pub = graph.node(f"pub_{topic}").create_publisher(msg_type, topic, QOS)
    wait_for_match(pub)
    pub.publish(msg)
    assert wait_for(lambda: received, timeout=10), f"nothing arrived on {topic}"
    return received[0]


def test_detections(graph):
    msg = Detections(header=header(), prompt="red cup", model_id="moondream2", image_width=640,
                     image_height=480, latency=Duration(sec=0, nanosec=42_000_000))
    msg.detections = [Detection(label="red cup", score=float("nan"), x_min=0.1, y_min=0.2, x_max=0.3,
                                y_max=0.4, x_min_px=64.0, y_min_px=96.0, x_max_px=192.0, y_max_px=192.0)]
    got = send(graph, Detections, "detections", msg)
    assert got.header == msg.header and got.prompt == "red cup" and got.latency.nanosec == 42_000_000
    d = got.detections[0]
    assert d.label == "red cup" and np.isnan(d.score)
    assert (d.x_min_px, d.y_max_px) == (64.0, 192.0)
    assert abs(d.x_max - 0.3) < 1e-6


def test_points_and_text(graph):
    pts = Points(header=header(), prompt="cup", model_id="moondream2", image_width=8, image_height=4,
                 points=[ImagePoint(label="cup", x=0.5, y=0.25, x_px=4.0, y_px=1.0)])
    got = send(graph, Points, "points", pts)
    assert got.points[0].x_px == 4.0 and got.header.frame_id == "camera_optical"
    text = VisionText(header=header(), task=VisionText.TASK_QUERY, prompt="what is on the table?",
                      text="a red cup", model_id="moondream2")
    got = send(graph, VisionText, "vision_text", text)
    assert got.text == "a red cup" and got.task == "query"


def test_transcript(graph):
    msg = Transcript(header=header("mic"), text="turn left", language="en", is_final=True,
                     audio_duration=Duration(sec=2, nanosec=500_000_000),
                     processing_time=Duration(sec=0, nanosec=300_000_000),
                     latency=Duration(sec=0, nanosec=350_000_000), model_id="whisper-tiny.en",
                     segments=[TranscriptSegment(start=0.0, end=1.2, text="turn left")])
    got = send(graph, Transcript, "transcript", msg)
    assert got.text == "turn left" and got.is_final and got.segments[0].end == 1.2
    assert got.audio_duration.sec == 2 and got.header.frame_id == "mic"


def test_audio_chunk_through_dds(graph):
    pcm = np.random.default_rng().uniform(-0.5, 0.5, 4800).astype(np.float32)
    got = send(graph, type(pcm_to_audio_chunk(pcm, 48000)), "audio",
               pcm_to_audio_chunk(pcm, 48000, "S16LE", header=header("mic")))
    out = audio_chunk_to_pcm(got)
    assert out.sample_rate == 48000
    np.testing.assert_allclose(out.samples, pcm, atol=1 / 32768)


@pytest.mark.parametrize("encoding", ["rgb8", "bgra8", "mono16"])
def test_padded_images_through_dds(graph, encoding):
    rgb = np.random.default_rng().integers(0, 256, (24, 35, 3), dtype=np.uint8)
    sent = rgb_to_image(rgb, encoding, header=header(), row_padding=9, is_bigendian=True)
    got = send(graph, Image, f"image_{encoding}", sent)
    assert got.header == sent.header and got.step == sent.step
    np.testing.assert_array_equal(image_to_rgb(got), image_to_rgb(sent))


def test_compressed_image_through_dds(graph):
    rgb = np.random.default_rng().integers(0, 256, (30, 40, 3), dtype=np.uint8)
    got = send(graph, CompressedImage, "image_compressed", rgb_to_compressed(rgb, "png", header=header()))
    np.testing.assert_array_equal(compressed_to_rgb(got), rgb)


def test_infer_service_round_trip(graph):
    server = graph.node("infer_server")

    def handle(request, response):
        response.success = request.task == Infer.Request.TASK_DETECT
        response.detections.prompt = request.prompt
        response.detections.image_width = request.image.width
        return response

    server.create_service(Infer, "infer", handle)
    client = graph.node("infer_client").create_client(Infer, "infer")
    assert client.wait_for_service(timeout_sec=10)
    request = Infer.Request(task="detect", prompt="person", use_latest_frame=False,
                            image=rgb_to_image(np.zeros((4, 6, 3), np.uint8)))
    future = client.call_async(request)
    assert wait_for(future.done, timeout=10)
    result = future.result()
    assert result.success and result.detections.prompt == "person" and result.detections.image_width == 6


def test_pixel_boxes_and_points_scale_each_axis_by_its_own_size():
    """x by the width, y by the height (a non-square image: a swapped or shared scale shows)."""
    from photon_ros.result_messages import detections_message, points_message
    header = Header(frame_id="camera")
    box = {"x_min": 0.1, "y_min": 0.2, "x_max": 0.5, "y_max": 0.9, "score": 0.8}
    d = detections_message({"objects": [box]}, header, prompt="cup", width=640, height=360, latency=0.1,
                           model_id="m").detections[0]
    got = (d.x_min_px, d.y_min_px, d.x_max_px, d.y_max_px)
    np.testing.assert_allclose(got, (64.0, 72.0, 320.0, 324.0))
    assert (d.x_min, d.y_min, d.x_max, d.y_max) == (0.1, 0.2, 0.5, 0.9)
    p = points_message({"points": [{"x": 0.25, "y": 0.75}]}, header, prompt="cup", width=640, height=360,
                       latency=0.1, model_id="m").points[0]
    np.testing.assert_allclose((p.x_px, p.y_px), (160.0, 270.0))
