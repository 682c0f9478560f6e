"""The launch files' arguments: every one declared is used, one left unset keeps config/photon.yaml's
value, and set ones give the vision and speech nodes the parameters and remaps they name.

`launch` and `launch_ros` are not installed here (ROS 2's PyPI wheels do not include them), so the
launch files are read with ast: declarations and LaunchConfiguration uses off the tree, and the
functions that turn argument values into parameters, remaps and nodes to start (vision_settings,
speech_settings, refuse_ambiguous: plain Python, no launch import) run as written, lifted out of
the file with the module-level tables and standard-library imports they use."""
from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
LAUNCH = ROOT / "launch"
SHARE_CONFIG = "/opt/ros/share/photon_ros/config/photon.yaml"   # stands for the computed params_file default


def tree_of(name: str) -> ast.Module:
    return ast.parse((LAUNCH / name).read_text(), filename=name)


def calls_named(tree: ast.AST, func: str) -> list[ast.Call]:
    return [n for n in ast.walk(tree) if isinstance(n, ast.Call)
            and getattr(n.func, "id", getattr(n.func, "attr", None)) == func]


def declared(name: str) -> dict[str, ast.expr]:
    """Each DeclareLaunchArgument's name -> its default_value expression."""
    found = {}
    for call in calls_named(tree_of(name), "DeclareLaunchArgument"):
        assert isinstance(call.args[0], ast.Constant), f"{name}: declare arguments by a literal name"
        default = next(k.value for k in call.keywords if k.arg == "default_value")
        assert call.args[0].value not in found, f"{name} declares {call.args[0].value} twice"
        found[call.args[0].value] = default
    return found


def configured(name: str) -> set[str]:
    """The names read with LaunchConfiguration("...") literally."""
    return {c.args[0].value for c in calls_named(tree_of(name), "LaunchConfiguration")
            if c.args and isinstance(c.args[0], ast.Constant)}


def defaults(name: str) -> dict[str, str]:
    """What the arguments are when none is given (a computed default, the params file's path,
    stands as an installed path would)."""
    return {arg: d.value if isinstance(d, ast.Constant) else SHARE_CONFIG for arg, d in declared(name).items()}


def plain_part(name: str) -> dict:
    """The file's module-level tables and functions, run without launch: everything but the
    imports of non-standard modules and generate_launch_description (which builds launch actions)."""
    def keep(node: ast.stmt) -> bool:
        if isinstance(node, ast.Import):
            return all(a.name.split(".")[0] in sys.stdlib_module_names for a in node.names)
        if isinstance(node, ast.ImportFrom):
            return node.module.split(".")[0] in sys.stdlib_module_names
        if isinstance(node, ast.FunctionDef):
            return node.name != "generate_launch_description"
        return isinstance(node, (ast.Assign, ast.Expr))
    tree = tree_of(name)
    module = ast.Module(body=[n for n in tree.body if keep(n)], type_ignores=[])
    namespace: dict = {}
    exec(compile(module, str(LAUNCH / name), "exec"), namespace)
    return namespace


def yaml_parameters(node: str) -> dict:
    return yaml.safe_load((ROOT / "config" / "photon.yaml").read_text())[f"/**/{node}"]["ros__parameters"]


SETTINGS = {"vision.launch.py": ("vision_settings", "vision"), "speech.launch.py": ("speech_settings", "speech")}


# Arguments whose parameter is not a string: a value of its type to change them to.
TYPED = {"use_depth": "true", "depth_tolerance_s": "0.08"}


def changed(arg: str, value: str) -> str:
    return TYPED.get(arg) or {"true": "false", "false": "true"}.get(value, value + "x")


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_every_argument_is_declared_once_and_used(name):
    args = defaults(name)
    direct = configured(name)
    assert direct <= set(args), f"{name} reads undeclared {sorted(direct - set(args))}"
    settings = plain_part(name)[SETTINGS[name][0]]
    before = settings(args)
    for arg in sorted(set(args) - direct):   # the rest are used by the settings function, or by nothing
        assert settings({**args, arg: changed(arg, args[arg])}) != before, f"{name}: {arg}:= changes nothing"


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_unset_arguments_keep_the_params_file_values(name):
    function, node = SETTINGS[name]
    part = plain_part(name)
    parameters = part["PARAMETERS"]
    args = defaults(name)
    assert parameters and all(args[p] == "" for p in parameters), "a parameter argument's default must be unset"
    assert set(parameters) <= set(yaml_parameters(node)), "config/photon.yaml must hold each one's default"
    settings = part[function](args)
    assert settings["parameters"] == {}
    assert all(topic == target for topic, target in settings["remappings"] if topic != "image/compressed")


def test_vision_arguments_give_its_parameters_and_remaps():
    settings = plain_part("vision.launch.py")["vision_settings"]
    camera = "/camera/camera"   # realsense2_camera's topics
    given = {**defaults("vision.launch.py"), "model": "vikhyatk/moondream2", "device": "cuda", "dtype": "bfloat16",
             "input": "compressed", "image": f"{camera}/color/image_raw",
             "depth_image": f"{camera}/aligned_depth_to_color/image_raw", "camera_info": f"{camera}/color/camera_info"}
    assert settings(given) == {
        "parameters": {"model": "vikhyatk/moondream2", "device": "cuda", "dtype": "bfloat16", "input": "compressed"},
        "remappings": [("image", f"{camera}/color/image_raw"),
                       ("depth", f"{camera}/aligned_depth_to_color/image_raw"),
                       ("camera_info", f"{camera}/color/camera_info"),
                       ("image/compressed", f"{camera}/color/image_raw/compressed")]}
    only_device = settings({**defaults("vision.launch.py"), "device": "cuda"})
    assert only_device["parameters"] == {"device": "cuda"}   # the rest stay the params file's
    with pytest.raises(ValueError, match="image:="):
        settings({**defaults("vision.launch.py"), "image": ""})


def test_depth_arguments_are_typed_and_checked():
    settings = plain_part("vision.launch.py")["vision_settings"]
    base = defaults("vision.launch.py")
    depth = settings({**base, "use_depth": "True", "depth_tolerance_s": "0.1", "target_frame": "base_link"})
    assert depth["parameters"] == {"use_depth": True, "depth_tolerance_s": 0.1, "target_frame": "base_link"}
    assert type(depth["parameters"]["depth_tolerance_s"]) is float      # "1" too: the parameter is a double
    assert settings({**base, "depth_tolerance_s": "1"})["parameters"] == {"depth_tolerance_s": 1.0}
    assert settings({**base, "use_depth": "false"})["parameters"] == {"use_depth": False}
    with pytest.raises(ValueError, match="use_depth:= takes true or false, not 'yes'"):
        settings({**base, "use_depth": "yes"})
    for bad in ("0", "-0.05", "nan", "inf", "50ms"):
        with pytest.raises(ValueError, match="depth_tolerance_s:= takes a positive number of seconds"):
            settings({**base, "depth_tolerance_s": bad})


def test_depth_arguments_reach_the_vision_node(tmp_path, monkeypatch):
    """What vision.launch.py makes of use_depth, depth_tolerance_s, target_frame and the topic
    arguments, given to a vision node as launch_ros gives it (the params file, then the arguments'
    parameters as a second params file, and the remaps): the node subscribes to the remapped depth
    and camera_info topics and pairs with that tolerance in that frame."""
    from moondream_fixtures import checkpoint
    from photon_ros import vision_node as vision_module
    from ros_harness import RosGraph, wait_for

    monkeypatch.setattr(vision_module, "tf2_lookup", lambda node: (lambda target, source, stamp: None))
    camera = "/camera/camera"
    args = {**defaults("vision.launch.py"), "model": str(checkpoint()), "use_depth": "true",
            "depth_tolerance_s": "0.08", "target_frame": "base_link", "image": f"{camera}/color/image_raw",
            "depth_image": f"{camera}/aligned_depth_to_color/image_raw",
            "camera_info": f"{camera}/color/camera_info"}
    settings = plain_part("vision.launch.py")["vision_settings"](args)
    given = tmp_path / "arguments.yaml"
    given.write_text(yaml.safe_dump({"/**": {"ros__parameters": settings["parameters"]}}))
    cli = ["--ros-args", "--params-file", str(ROOT / "config" / "photon.yaml"), "--params-file", str(given)]
    for topic, target in settings["remappings"]:
        cli += ["-r", f"{topic}:={target}"]
    graph = RosGraph()
    try:
        node = graph.add(vision_module.VisionNode(context=graph.context, cli_args=cli))
        assert wait_for(lambda: node.engine is not None or node.model_error, timeout=120)
        assert node.engine is not None, node.model_error
        assert (node.params["use_depth"], node.params["depth_tolerance_s"], node.params["target_frame"]) == \
            (True, 0.08, "base_link")
        assert node.depth_stream.tolerance_s == node.info_stream.tolerance_s == 0.08 and node.lookup is not None
        assert [s.topic_name for s in node.depth_subscriptions] == [
            f"{camera}/aligned_depth_to_color/image_raw", f"{camera}/color/camera_info"]
        assert node.subscription.topic_name == f"{camera}/color/image_raw"
        assert node.params["depth_min_m"] == yaml_parameters("vision")["depth_min_m"]   # unset: the file's
    finally:
        graph.close()


def test_speech_arguments_give_its_parameters_remaps_and_audio_source():
    settings = plain_part("speech.launch.py")["speech_settings"]
    base = defaults("speech.launch.py")
    assert settings(base)["source"] == "microphone_node"
    driver = settings({**base, "microphone": "false", "audio": "/audio/audio_stamped", "input_type": "int16",
                       "audio_info": "/audio/audio_info", "model": "openai/whisper-small", "device": "cuda"})
    assert driver == {"parameters": {"model": "openai/whisper-small", "device": "cuda", "input_type": "int16"},
                      "remappings": [("audio", "/audio/audio_stamped"), ("audio_info", "/audio/audio_info")],
                      "source": None}
    assert settings({**base, "wav_file": "/tmp/command.wav"})["source"] == "wav_publisher"
    assert settings({**base, "wav_file": "/tmp/command.wav", "microphone": "False"})["source"] == "wav_publisher"
    with pytest.raises(ValueError, match="microphone:= takes true or false"):
        settings({**base, "microphone": "maybe"})
    with pytest.raises(ValueError, match="audio:="):
        settings({**base, "audio": ""})


def test_photon_launch_forwards_every_argument_of_both():
    part = plain_part("photon.launch.py")
    ours = declared("photon.launch.py")
    for included, forwarded in (("vision.launch.py", part["VISION"]), ("speech.launch.py", part["SPEECH"])):
        theirs = declared(included)
        assert set(forwarded) == set(theirs), f"{included}'s arguments not all reachable from photon.launch.py"
        for their_name, our_name in forwarded.items():
            assert our_name in ours, f"photon.launch.py forwards undeclared {our_name}"
            assert ast.dump(ours[our_name]) == ast.dump(theirs[their_name]), \
                f"photon.launch.py {our_name} and {included} {their_name} default differently"
    used = set(part["VISION"].values()) | set(part["SPEECH"].values()) | configured("photon.launch.py")
    assert set(ours) == used, f"photon.launch.py declares unused {sorted(set(ours) - used)}"


def test_photon_launch_says_model_on_its_command_line_is_ignored_and_lets_a_parents_be():
    """model:= given to photon.launch.py names neither model: said. A parent launch file's own
    `model` argument (a robot description's URDF) is in the launch context too: it failed the whole
    launch when the context, not the command line, was read."""
    said = plain_part("photon.launch.py")["ambiguous_model"]
    assert said(["vision_model:=m"]) == "" and said([]) == ""
    assert "vision_model:= and speech_model:=" in said(["image:=/cam", "model:=vikhyatk/moondream2"])


@pytest.mark.parametrize("name", ["photon.launch.py", "vision.launch.py", "speech.launch.py"])
def test_use_sim_time_reaches_every_node(name):
    """use_sim_time:=true (a simulator, a bag with --clock) sets the parameter of every node the
    file starts (the loop node refused every command on the sim clock without it): declared unset,
    set by a SetParameter ahead of every node; unset, nothing is set (a params file's stands)."""
    tree = tree_of(name)
    assert ast.literal_eval(declared(name)["use_sim_time"]) == ""
    (setter,) = calls_named(tree, "SetParameter")
    keywords = {k.arg: k.value for k in setter.keywords}
    (unless_unset,) = calls_named(keywords["condition"], "LaunchConfigurationNotEquals")
    assert [ast.literal_eval(a) for a in unless_unset.args] == ["use_sim_time", ""]
    assert ast.literal_eval(keywords["name"]) == "use_sim_time"
    assert calls_named(keywords["value"], "LaunchConfiguration")[0].args[0].value == "use_sim_time"
    actions = next(c for c in calls_named(tree, "LaunchDescription")).args[0].elts
    first_node = next(i for i, a in enumerate(actions) if isinstance(a, ast.Call)
                      and getattr(a.func, "id", "") in ("Node", "OpaqueFunction", "IncludeLaunchDescription", "include"))
    assert actions.index(next(a for a in actions if a is setter)) < first_node
