"""Node parameters through one mechanism (photon_ros.params): declared with descriptors, checked at
startup and on every change, changes that take effect at once applied, the others said to wait for
a configure or refused as read-only; float parameters take whole numbers (rclpy types a parameter by
its default and refused `0` for one declared 5.0). Real rclpy nodes, no DDS traffic needed."""
import math

import pytest
import rclpy
from rclpy.node import Node
from rclpy.parameter import Parameter

from photon_ros.params import NodeParams, Param, number

SPECS = [Param("gain", 1.5, "how much", low=0.0, high=10.0),
         Param("period_s", 1.0, "how often", positive=True),
         Param("mode", "fast", "how", choices=("fast", "slow"), applies="configure"),
         Param("count", 3, "how many", low=0),
         Param("names", Parameter.Type.STRING_ARRAY, "what"),
         Param("size", 8, "fixed", applies="restart")]


def make(context, name, overrides=(), **kwargs):
    node = Node(name, context=context, parameter_overrides=[Parameter(k, value=v) for k, v in overrides])
    try:
        return node, NodeParams(node, SPECS, **kwargs)
    except Exception:
        node.destroy_node()
        raise


def test_declared_with_descriptors_and_whole_numbers_taken_as_floats(context):
    node, params = make(context, "p_ok", [("gain", 2), ("names", ["a", "b"])])
    try:
        assert params["gain"] == 2.0 and isinstance(params["gain"], float) and params["names"] == ["a", "b"]
        assert params["period_s"] == 1.0 and params["count"] == 3 and params["mode"] == "fast"
        d = node.describe_parameter("gain")
        assert d.description == "how much" and d.additional_constraints == ">= 0 and <= 10"
        assert "one of fast, slow" in node.describe_parameter("mode").additional_constraints
        assert "next configure" in node.describe_parameter("mode").additional_constraints
        assert node.describe_parameter("size").read_only
    finally:
        node.destroy_node()


def test_an_empty_list_override_is_the_empty_list(context):
    """rclpy types an override of [] a byte array: the string-array parameter refused it and the
    node did not start (the evaluator's --set vision.detect=[] to clear the config's prompts)."""
    node, params = make(context, "p_empty", [("names", [])])
    try:
        assert params["names"] == []
    finally:
        node.destroy_node()
    with pytest.raises(Exception, match="names"):   # a byte array that is not empty stays refused
        make(context, "p_bytes", [("names", [b"x"])])


@pytest.mark.parametrize("empty", [Parameter.Type.BOOL_ARRAY, Parameter.Type.BYTE_ARRAY,
                                   Parameter.Type.INTEGER_ARRAY, Parameter.Type.STRING_ARRAY])
def test_a_list_is_cleared_by_an_empty_list_of_any_type(context, empty):
    """`ros2 param set /vision detect "[]"` and `ros2 param load` of `detect: []` send a bool array:
    rclpy's static type refused it (nameless), and the node kept detecting the old objects."""
    node, params = make(context, f"p_clear_{empty.name.lower()}", [("names", ["a"])])
    try:
        result = node.set_parameters([Parameter("names", empty, [])])[0]
        assert result.successful, result.reason
        assert params["names"] == [] and node.get_parameter("names").type_ == Parameter.Type.STRING_ARRAY
        refused = node.set_parameters([Parameter("names", Parameter.Type.BOOL_ARRAY, [True])])[0]
        assert not refused.successful and params["names"] == []    # only an empty list is retyped
    finally:
        node.destroy_node()


@pytest.mark.parametrize("name, value, reason", [
    ("gain", -1.0, "gain must be >= 0"), ("gain", "loud", "gain must be a number"),
    ("gain", math.nan, "gain must be a number"), ("gain", math.inf, "gain must be finite"),
    ("period_s", 0, "period_s must be > 0"),
    ("mode", "fsat", "mode must be one of fast, slow"), ("count", -5, "count must be >= 0"),
    # wrong types are named with the parameter (rclpy's own refusal names neither)
    ("mode", 3, "mode must be a string, got 3"), ("count", 2.5, "count must be an integer, got 2.5"),
    ("count", True, "count must be an integer, got True"), ("size", "big", "size must be an integer")])
def test_a_bad_value_at_startup_stops_the_node_with_the_reason(context, name, value, reason):
    with pytest.raises(ValueError, match=reason):
        make(context, "p_bad", [(name, value)])


def test_changes_checked_applied_or_deferred_and_never_ignored(context):
    applied = []
    node, params = make(context, "p_set", [("gain", 4)], apply=applied.append,
                        check_all=lambda v: "count must not exceed gain" if v["count"] > v["gain"] else "")
    try:
        result = node.set_parameters([Parameter("gain", value=5)])[0]
        assert result.successful and params["gain"] == 5.0 and applied == [{"gain": 5.0}]
        refused = node.set_parameters([Parameter("period_s", value=-1.0)])[0]
        assert not refused.successful and "period_s must be > 0" in refused.reason
        assert params["period_s"] == 1.0 and node.get_parameter("period_s").value == 1.0
        # A set is judged whole: nothing of it is taken when one part is refused.
        refused = node.set_parameters_atomically([Parameter("gain", value=1.0), Parameter("count", value=2)])
        assert not refused.successful and "count must not exceed gain" in refused.reason
        assert (params["gain"], params["count"]) == (5.0, 3) and len(applied) == 1
        later = node.set_parameters([Parameter("mode", value="slow")])[0]
        assert later.successful and params["mode"] == "slow"      # logged: "... at the next configure"
        assert len(applied) == 1                       # not applied now: read at configure
        wrong = node.set_parameters([Parameter("count", value="many")])[0]
        assert not wrong.successful and wrong.reason == "count must be an integer, got 'many'"
        assert params["count"] == 3 and node.get_parameter("count").value == 3
        assert not node.set_parameters([Parameter("size", value=4)])[0].successful   # read-only
        assert params["size"] == 8
    finally:
        node.destroy_node()


def test_set_parameters_checks_a_list_one_parameter_at_a_time(context):
    """As rclpy's set_parameters (ros2 param set / load, the set_parameters service) hands them
    over: each is checked against the values the others have then, and taken or refused on its
    own; only set_parameters_atomically judges the list as a whole (params.py says which rules
    need it)."""
    node, params = make(context, "p_each", [("gain", 4)],
                        check_all=lambda v: "count must not exceed gain" if v["count"] > v["gain"] else "")
    try:
        results = node.set_parameters([Parameter("count", value=2), Parameter("gain", value=1.0)])
        assert [r.successful for r in results] == [True, False]
        assert (params["count"], params["gain"]) == (2, 4.0)
        whole = node.set_parameters_atomically([Parameter("gain", value=1.0), Parameter("count", value=1)])
        assert whole.successful and (params["count"], params["gain"]) == (1, 1.0)
    finally:
        node.destroy_node()


def test_a_change_the_node_fails_to_apply_is_refused_and_the_old_values_kept(context):
    """An apply that raised left the new values in NodeParams while rclpy stored none of them
    (`ros2 param get` disagreed with what the node used), and the error escaped the callback
    (rclpy's parameter service lets it through to the executor's spin: the node ended)."""
    def apply(changes):
        if changes.get("gain") == 7.0:
            raise RuntimeError("the driver takes at most 6")

    node, params = make(context, "p_apply", apply=apply)
    try:
        refused = node.set_parameters_atomically([Parameter("gain", value=7), Parameter("mode", value="slow")])
        assert not refused.successful
        assert refused.reason == "gain not applied: RuntimeError: the driver takes at most 6"
        assert (params["gain"], params["mode"]) == (1.5, "fast")
        assert (node.get_parameter("gain").value, node.get_parameter("mode").value) == (1.5, "fast")
        assert node.set_parameters([Parameter("gain", value=6)])[0].successful and params["gain"] == 6.0
    finally:
        node.destroy_node()


def test_number():
    assert number(True) is None and number("1") is None and number(3) == 3.0


def test_the_shipped_config_sets_every_declared_parameter_and_no_other():
    """config/photon.yaml documents every parameter: one it names that no node declares would be
    silently unused, one it lacks would be undocumented."""
    from pathlib import Path

    import yaml

    from photon_ros.bringup import flatten
    from photon_ros.loop_node import LOOP_PARAMS
    from photon_ros.microphone_node import MICROPHONE_PARAMS
    from photon_ros.speech_params import speech_params
    from photon_ros.vision_params import vision_params
    from photon_ros.wav_publisher import WAV_PUBLISHER_PARAMS

    config = yaml.safe_load((Path(__file__).resolve().parents[1] / "config" / "photon.yaml").read_text())
    for node, specs in (("speech", speech_params()), ("vision", vision_params()), ("loop", LOOP_PARAMS),
                        ("microphone", MICROPHONE_PARAMS), ("wav_publisher", WAV_PUBLISHER_PARAMS)):
        named = set(flatten(config[f"/**/{node}"]["ros__parameters"])) - {"autostart"}   # the lifecycle base's
        assert named == {s.name for s in specs}, node


@pytest.mark.parametrize("name, value, reason", [
    ("input", "compresed", "input must be one of raw, compressed"),
    ("reliability", "bogus", "reliability must be one of best_effort, reliable"),
    # 0 found nothing (no limit is what a user setting it meant): refused, not a robot blind to obstacles
    ("max_objects", 0, "max_objects must be >= 1"), ("max_frame_age_s", math.nan, "max_frame_age_s must be a number"),
    ("backend", "megakernal", "backend must be one of auto, reference, triton, megakernel"),
    # ROS 1's spelling: tf2 raises InvalidArgumentException on it for every frame
    ("target_frame", "/base_link", "target_frame must not start with '/'"),
    ("device", "cuda0", r"device must be cpu, cuda or cuda:N, got 'cuda0'"), ("model", " ", "model must name a checkpoint")])
def test_the_vision_node_refuses_bad_values_at_startup(context, name, value, reason):
    from photon_ros.vision_node import VisionNode

    with pytest.raises(ValueError, match=reason):
        VisionNode(context=context, parameter_overrides=[Parameter("autostart", value=False), Parameter(name, value=value)])


def test_the_vision_node_refuses_bad_changes_and_takes_the_others(context):
    from photon_ros.vision_node import VisionNode

    node = VisionNode(context=context, parameter_overrides=[Parameter("autostart", value=False)])
    try:
        for name, value in (("max_objects", -5), ("max_frame_age_s", math.nan), ("caption_length", "huge"),
                            ("max_pixels", 0), ("segment_max_tokens", 0), ("target_frame", "/map"),
                            ("device", "cuda:x")):
            result = node.set_parameters([Parameter(name, value=value)])[0]
            assert not result.successful and name in result.reason, (name, result.reason)
        assert node.max_objects == 10 and node.max_frame_age == 5.0
        changes = [Parameter("max_pixels", value=1000), Parameter("max_objects", value=3),
                   Parameter("detect", value=[" cup ", "", "cup"]), Parameter("max_frame_age_s", value=0)]
        assert all(r.successful for r in node.set_parameters(changes))
        assert (node.max_pixels, node.max_objects, node.detect_targets, node.max_frame_age) == (1000, 3, ["cup"], 0.0)
        # a depth range moved past itself, in order: the worker's settings are one object, always whole
        assert all(r.successful for r in node.set_parameters([Parameter("depth_max_m", value=30.0),
                                                              Parameter("depth_min_m", value=20.0)]))
        assert (node.depth_settings.min_depth_m, node.depth_settings.max_depth_m) == (20.0, 30.0)
        later = node.set_parameters([Parameter("input", value="compressed")])[0]
        assert later.successful and node.params["input"] == "compressed"   # used at the next configure
    finally:
        node.destroy_node()


def test_the_params_file_reaches_nodes_in_any_namespace(tmp_path):
    """Sections keyed by a bare name (`loop:`) match /loop only: under namespace:=robot1 every value
    of the params file was dropped, silently, and the nodes ran on their defaults. Keyed /**/loop,
    as config/photon.yaml is, they reach /robot1/loop, through rcl and through bringup alike."""
    from pathlib import Path

    import yaml

    from photon_ros.bringup import node_parameters
    from photon_ros.loop_node import LoopNode

    config = yaml.safe_load((Path(__file__).resolve().parents[1] / "config" / "photon.yaml").read_text())
    config["/**/loop"]["ros__parameters"]["max_turn_s"] = 7.0
    path = tmp_path / "robot.yaml"
    path.write_text(yaml.safe_dump(config))
    ctx = rclpy.Context()
    rclpy.init(context=ctx, args=["--ros-args", "--params-file", str(path)])
    try:
        node = LoopNode(context=ctx, namespace="robot1")
        assert node.get_fully_qualified_name() == "/robot1/loop" and node.params["max_turn_s"] == 7.0
        node.destroy_node()
    finally:
        rclpy.shutdown(context=ctx)
    given = {p.name: p.value for p in node_parameters(config, "loop")}
    assert given["max_turn_s"] == 7.0
    assert {p.name: p.value for p in node_parameters({"loop": {"ros__parameters": {"max_turn_s": 2.0}}},
                                                     "loop")} == {"max_turn_s": 2.0}


def test_the_vision_nodes_backends_are_the_engines():
    from photon_core.backends.select import BACKENDS
    from photon_ros.vision_params import vision_params

    (backend,) = [p for p in vision_params() if p.name == "backend"]
    assert backend.choices == ("auto", *BACKENDS)
