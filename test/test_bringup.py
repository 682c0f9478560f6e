"""The whole graph from config/photon.yaml without ros2 launch, namespaced and remapped, closing
the loop from speech to a target: spoken WAV -> speech -> loop -> vision (infer) -> ImageTarget.
Also checks that the launch files name only executables we install and configs we ship, and that
--namespaces builds the graph once per robot and refuses what would mix robots (the robots'
traffic itself: test_multi_robot.py)."""
import ast
import re
import time
import wave
from pathlib import Path

import numpy as np
import pytest
from rclpy.qos import QoSProfile, ReliabilityPolicy
from sensor_msgs.msg import Image
from std_msgs.msg import String

from moondream_fixtures import checkpoint
from photon_ros.bringup import DEFAULT_CONFIG, build_graph, flatten, main
from photon_ros.image_conversions import rgb_to_image
from photon_ros.msg import ImageTarget, Transcript
from ros_harness import RosGraph, wait_for, wait_for_match
from speech_audio import espeak_wav

ROOT = Path(__file__).resolve().parents[1]
RELIABLE = QoSProfile(depth=10, reliability=ReliabilityPolicy.RELIABLE)


def test_flatten_names_nested_parameters_like_ros():
    assert flatten({"model": "m", "vad": {"hangover_s": 0.6, "x": {"y": 1}}}) == {
        "model": "m", "vad.hangover_s": 0.6, "vad.x.y": 1}


def test_launch_files_use_installed_executables_and_shipped_config():
    installed = re.search(r"install\(PROGRAMS ([^\n]+)", (ROOT / "CMakeLists.txt").read_text()).group(1).split()
    for launch in (ROOT / "launch").glob("*.launch.py"):
        tree = ast.parse(launch.read_text())
        for call in (n for n in ast.walk(tree) if isinstance(n, ast.Call)):
            for kw in call.keywords:
                if kw.arg == "executable":
                    assert f"nodes/{kw.value.value}" in installed and (ROOT / "nodes" / kw.value.value).exists()
        for const in (n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)):
            if const.endswith(".yaml"):
                assert (ROOT / "config" / const).exists(), f"{launch.name} names missing config {const}"
            if const.endswith(".launch.py"):
                assert (ROOT / "launch" / const).exists()


@pytest.fixture
def graph():
    g = RosGraph()
    yield g
    g.close()


def test_spoken_command_to_target_through_bringup(graph):
    nodes = build_graph(DEFAULT_CONFIG, "all", namespace="robot1", remaps=["image:=/camera/image_raw"],
                        wav=str(espeak_wav("Find the red ball.")), context=graph.context,
                        overrides={"vision": {"model": str(checkpoint()), "max_objects": 1,
                                              "reliability": "reliable"},
                                   "wav_publisher": {"speed": 2.0}})
    names = sorted(n.get_fully_qualified_name() for n in nodes)
    assert names == ["/robot1/loop", "/robot1/speech", "/robot1/vision", "/robot1/wav_publisher"]
    player = next(n for n in nodes if n.get_name() == "wav_publisher")
    player.timer.cancel()             # start playback once the camera has sent a frame
    for node in nodes:
        graph.add(node)
    targets = []
    transcripts, status = [], []
    listener = graph.node("listener")
    listener.create_subscription(ImageTarget, "/robot1/image_target", targets.append, RELIABLE)
    listener.create_subscription(Transcript, "/robot1/transcript", transcripts.append, RELIABLE)
    listener.create_subscription(String, "/robot1/status", status.append, RELIABLE)
    camera = graph.node("camera").create_publisher(Image, "/camera/image_raw", RELIABLE)
    wait_for_match(camera)
    vision = next(n for n in nodes if n.get_name() == "vision")
    speech = next(n for n in nodes if n.get_name() == "speech")
    assert wait_for(lambda: vision.engine is not None and speech.model is not None, timeout=120), \
        (vision.model_error, speech.model_error)
    frame = np.random.default_rng(0).integers(0, 256, (96, 128, 3), dtype=np.uint8)
    camera.publish(rgb_to_image(frame))
    assert wait_for(lambda: vision.frames.latest is not None, timeout=10)
    player.t0 = time.time()
    player.timer.reset()
    assert wait_for(lambda: targets, timeout=120), ([t.text for t in transcripts], [s.data for s in status])
    finals = [t for t in transcripts if t.is_final]   # partials may come first, while it is spoken
    assert finals[0].text.lower().strip(".") == "find the red ball"
    # status is another topic: it may arrive a moment after the target
    assert wait_for(lambda: any("found red ball" in s.data for s in status), timeout=10), [s.data for s in status]
    t = targets[0]
    assert (t.image_width, t.image_height) == (128, 96)
    assert 0.0 <= t.x <= 1.0 and 0.0 <= t.y <= 1.0 and 0.0 <= t.x_px <= 128 and 0.0 <= t.y_px <= 96


# --- several robots: --namespaces ----------------------------------------------------------------

@pytest.mark.parametrize("kwargs,reason", [
    ({"namespace": "robot1", "namespaces": ["r1", "r2"]}, "together"),
    ({"namespaces": ["r1", "/r1"]}, "given twice"),
    ({"namespaces": ["r1", ""]}, "namespace of its own"),
    ({"namespaces": ["1r"]}, "must not have a token that starts with a number"),
    ({"namespaces": ["r1", "r2"], "remaps": ["image:=/camera/image_raw"]}, "every robot the one topic /camera"),
    ({"namespaces": ["r1"], "remaps": ["__ns:=/shared"]}, "one per robot"),
    ({"namespaces": ["r1"], "remaps": ["image"]}, "expected FROM:=TO"),
    ({"namespaces": ["r1", "r2"], "overrides": {"r9/vision": {"max_objects": 1}}}, "none of the namespaces"),
])
def test_namespaces_that_would_mix_robots_are_refused(kwargs, reason):
    # Refused before any node exists, so no ROS context is needed.
    with pytest.raises(ValueError, match=re.escape(reason)):
        build_graph(DEFAULT_CONFIG, "vision", **kwargs)


def test_namespace_and_namespaces_on_the_command_line_are_refused(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--graph", "vision", "--namespace", "robot1", "--namespaces", "r1,r2"])
    assert exit_info.value.code == 2
    assert "--namespaces: not allowed with argument --namespace" in capsys.readouterr().err


def test_a_graph_without_a_microphone_says_to_play_a_file(graph):
    """Without sounddevice (never installed here) the microphone node's own advice names the WAV
    publisher, a node bringup starts itself: bringup says its own way, --wav."""
    from photon_ros.bringup import node_classes
    with pytest.raises(RuntimeError, match="sounddevice is not usable.*bringup: --wav FILE plays a file"):
        node_classes()["microphone"](context=graph.context)


def test_namespaces_build_the_graph_once_in_each(graph, tmp_path):
    """Managed nodes (no model loaded): every role per namespace, the WAV played into each, no
    microphone (a robot's is on the robot), remaps and overrides applied per namespace."""
    wav = tmp_path / "quiet.wav"
    with wave.open(str(wav), "wb") as out:
        out.setnchannels(1), out.setsampwidth(2), out.setframerate(16000)
        out.writeframes(bytes(3200))
    nodes = build_graph(DEFAULT_CONFIG, "all", namespaces=["r1", "site/r2"], wav=str(wav), managed=True,
                        remaps=["audio:=mic/audio", "/diagnostics:=/fleet/diagnostics"], context=graph.context,
                        overrides={"vision": {"max_objects": 3}, "site/r2/vision": {"max_objects": 5}})
    for node in nodes:
        graph.add(node)
    assert sorted(n.get_fully_qualified_name() for n in nodes) == [
        f"{ns}/{name}" for ns in ("/r1", "/site/r2") for name in ("loop", "speech", "vision", "wav_publisher")]
    by_name = {n.get_fully_qualified_name(): n for n in nodes}
    assert by_name["/r1/speech"].resolve_topic_name("audio") == "/r1/mic/audio"
    assert by_name["/site/r2/wav_publisher"].resolve_topic_name("audio") == "/site/r2/mic/audio"
    assert by_name["/site/r2/loop"].resolve_topic_name("infer") == "/site/r2/infer"
    assert by_name["/r1/vision"].resolve_topic_name("/diagnostics") == "/fleet/diagnostics"
    assert by_name["/r1/vision"].get_parameter("max_objects").value == 3
    assert by_name["/site/r2/vision"].get_parameter("max_objects").value == 5
    assert all(n.get_parameter("autostart").value is False for n in nodes if n.get_name() in ("vision", "speech"))

    speech_only = build_graph(DEFAULT_CONFIG, "speech", namespaces=["r3", "r4"], managed=True, context=graph.context)
    for node in speech_only:
        graph.add(node)
    assert sorted(n.get_fully_qualified_name() for n in speech_only) == ["/r3/speech", "/r4/speech"]


def test_an_installed_bringup_finds_the_packages_config(tmp_path, monkeypatch):
    """Installed, the module sits in site-packages, where no config/ is: bringup's default config
    was <site-packages>/config/photon.yaml and it could not start without --config."""
    from photon_ros import bringup
    monkeypatch.setattr(bringup, "SOURCE_CONFIG_DIR", tmp_path / "no-config-here")
    found = bringup.config_file("photon.yaml")
    assert found is not None and found.parts[-4:] == ("share", "photon_ros", "config", "photon.yaml")


PRECEDENCE = {   # the same parameter in several sections of one file
    "specific_first": "vision:\n  ros__parameters: {x: specific}\n/**:\n  ros__parameters: {x: wildcard}\n",
    "any_ns_then_all": "/**/vision:\n  ros__parameters: {x: any_ns}\n/**:\n  ros__parameters: {x: wildcard}\n",
    "any_ns_then_robot1": "/**/vision:\n  ros__parameters: {x: any_ns}\n/robot1/vision:\n  ros__parameters: {x: robot1}\n",
    "robot1_then_any_ns": "/robot1/vision:\n  ros__parameters: {x: robot1}\n/**/vision:\n  ros__parameters: {x: any_ns}\n",
    "bare": "vision:\n  ros__parameters: {x: bare}\n",
    "one_level": "/*/vision:\n  ros__parameters: {x: one_level}\n",
    "other_node": "/**/speech:\n  ros__parameters: {x: speech}\n",
    # a namespace as a level of its own (rcl_yaml_param_parser's `<node_namespace>: <node>:` form)
    "nested_ns": "robot1:\n  vision:\n    ros__parameters: {x: nested}\n  speech:\n    ros__parameters: {x: s}\n",
    "nested_any_ns": "/**:\n  vision:\n    ros__parameters: {x: nested_any}\n",
    "nested_two_levels": "fleet:\n  robot1:\n    vision:\n      ros__parameters: {x: deep}\n",
    "any_ns_then_nested": "/**/vision:\n  ros__parameters: {x: any_ns}\n/robot1:\n  vision:\n    ros__parameters: {x: b}\n",
    "node_and_nested": "robot1:\n  ros__parameters: {x: r}\n  vision:\n    ros__parameters: {x: v}\n",
}


@pytest.mark.parametrize("case", sorted(PRECEDENCE))
def test_bringup_reads_a_params_file_as_rcl_does(tmp_path, case):
    """The same file gives a node the same values under `ros2 launch` (rcl reads it) and under
    bringup: sections matched against the node's fully qualified name, later ones winning. Bringup
    applied a bare `vision:` section in every namespace, dropped /robot1/vision, and let the more
    specific key win over the file's order, and dropped a section whose namespace was a level of
    its own (`robot1:` / `vision:` / `ros__parameters:`), silently."""
    import rclpy
    import yaml
    from rclpy.node import Node

    from photon_ros.bringup import node_parameters

    text = PRECEDENCE[case]
    path = tmp_path / "params.yaml"
    path.write_text(text)
    ctx = rclpy.Context()
    rclpy.init(context=ctx, args=[])
    try:
        for ns in ("", "/robot1", "/fleet/robot1"):
            node = Node("vision", namespace=ns, context=ctx, cli_args=["--ros-args", "--params-file", str(path)],
                        automatically_declare_parameters_from_overrides=True)
            rcl = node.get_parameter("x").value if node.has_parameter("x") else None
            node.destroy_node()
            ours = {p.name: p.value for p in node_parameters(yaml.safe_load(text), "vision", ns)}.get("x")
            assert ours == rcl, (case, ns)
    finally:
        rclpy.shutdown(context=ctx)


def test_an_empty_list_in_the_config_builds_the_node(tmp_path):
    """`detect: []` (no objects on every frame) is left to the list's declared default, []: rclpy
    types an empty list as a byte array, and a node declaring a string array refused it."""
    import rclpy
    import yaml

    from photon_ros.bringup import build_graph, node_parameters

    config = {"/**/vision": {"ros__parameters": {"detect": ["cup"], "autostart": False}},
              "/robot1/vision": {"ros__parameters": {"detect": []}}}
    assert [p.name for p in node_parameters(config, "vision", "robot1")] == ["autostart"]
    assert [p.value for p in node_parameters(config, "vision", "robot2") if p.name == "detect"] == [["cup"]]
    path = tmp_path / "photon.yaml"
    path.write_text(yaml.safe_dump(config))
    ctx = rclpy.Context()
    rclpy.init(context=ctx, args=[])
    try:
        (node,) = build_graph(path, "vision", "robot1", context=ctx, roles=["vision"])
        try:
            assert node.params["detect"] == []
        finally:
            node.destroy_node()
    finally:
        rclpy.shutdown(context=ctx)
