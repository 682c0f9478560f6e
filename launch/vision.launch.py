"""Vision only: camera -> vision node -> detections / points / caption / infer service.

    ros2 launch photon_ros vision.launch.py namespace:=robot1 image:=/camera/color/image_raw
    ros2 launch photon_ros vision.launch.py device:=cuda model:=vikhyatk/moondream2
    ros2 launch photon_ros vision.launch.py managed:=true    # then: ros2 lifecycle set /vision configure
    ros2 launch photon_ros vision.launch.py image:=/camera/camera/color/image_raw use_depth:=true \
        depth_image:=/camera/camera/aligned_depth_to_color/image_raw camera_info:=/camera/camera/color/camera_info
model, device, dtype, input, use_depth, depth_tolerance_s and target_frame left unset keep the params
file's values (config/photon.yaml).
"""
import math
import os
from collections.abc import Mapping

from ament_index_python.packages import get_package_share_directory
from launch import LaunchDescription
from launch.actions import DeclareLaunchArgument, OpaqueFunction
from launch.conditions import LaunchConfigurationNotEquals
from launch.substitutions import LaunchConfiguration
from launch_ros.actions import SetParameter
from photon_ros.launch_helpers import dds_profile_env, photon_node

# Arguments that set the vision node's parameter of the same name. Their default is "" (unset),
# which passes nothing: the params file stays the one place that holds the defaults.
PARAMETERS = ("model", "device", "dtype", "input", "use_depth", "depth_tolerance_s", "target_frame")
# Topic arguments -> the node's relative topic they remap (the default remaps it to itself).
TOPICS = {"image": "image", "depth_image": "depth", "camera_info": "camera_info"}


def parameter_value(name: str, text: str):
    """A launch argument's text as its parameter's type (use_depth: bool, depth_tolerance_s: float);
    ValueError with the reason for text that is not one."""
    if name == "use_depth":
        if text.strip().lower() not in ("true", "false"):
            raise ValueError(f"use_depth:= takes true or false, not {text!r}")
        return text.strip().lower() == "true"
    if name == "depth_tolerance_s":
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not (0 < value < math.inf):
            raise ValueError(f"depth_tolerance_s:= takes a positive number of seconds (e.g. 0.05), not {text!r}")
        return value
    return text


def vision_settings(args: Mapping[str, str]) -> dict:
    """What the launch arguments make of the vision node: the parameters given on the command line
    (only those: the others keep the params file's values) and its topic remaps."""
    for arg in TOPICS:
        if not args[arg]:
            raise ValueError(f"{arg}:= needs a topic name (its default is {TOPICS[arg]!r})")
    remappings = [(topic, args[arg]) for arg, topic in TOPICS.items()]
    # input:=compressed subscribes `image/compressed`: it follows the image topic as image_transport's does
    remappings.append(("image/compressed", args["image"] + "/compressed"))
    return {"parameters": {name: parameter_value(name, args[name]) for name in PARAMETERS if args[name]},
            "remappings": remappings}


def generate_launch_description():
    share = get_package_share_directory("photon_ros")
    config = os.path.join(share, "config", "photon.yaml")

    def vision_nodes(context):
        settings = vision_settings(context.launch_configurations)
        set_on_command_line = [settings["parameters"]] if settings["parameters"] else []
        return photon_node(LaunchConfiguration("managed"), package="photon_ros", executable="vision_node",
                           name="vision", namespace=LaunchConfiguration("namespace"),
                           parameters=[LaunchConfiguration("params_file"), *set_on_command_line],
                           remappings=settings["remappings"], additional_env=dds_profile_env(share),
                           output="screen")

    unset = " (unset: the params file's value)"
    return LaunchDescription([
        DeclareLaunchArgument("namespace", default_value="", description="the nodes' namespace, e.g. robot1"),
        DeclareLaunchArgument("use_sim_time", default_value="",
                              description="true: every node on the /clock topic's time (a simulator, a bag played "
                                          "with --clock)" + unset),
        SetParameter(name="use_sim_time", value=LaunchConfiguration("use_sim_time"),
                     condition=LaunchConfigurationNotEquals("use_sim_time", "")),
        DeclareLaunchArgument("params_file", default_value=config,
                              description="the parameters file (defaults of every argument left unset)"),
        DeclareLaunchArgument("managed", default_value="false",
                              description="true: a lifecycle node waiting unconfigured for a manager"),
        DeclareLaunchArgument("model", default_value="",
                              description="a local folder/file or a Hugging Face id, e.g. vikhyatk/moondream2" + unset),
        DeclareLaunchArgument("device", default_value="", description="cpu, cuda or cuda:N" + unset),
        DeclareLaunchArgument("dtype", default_value="",
                              description="auto, float32, float16 or bfloat16" + unset),
        DeclareLaunchArgument("input", default_value="",
                              description="raw (sensor_msgs/Image on the image topic) or compressed "
                                          "(CompressedImage on <image>/compressed)" + unset),
        DeclareLaunchArgument("image", default_value="image", description="the camera's image topic"),
        DeclareLaunchArgument("use_depth", default_value="",
                              description="true: read depth_image and camera_info and publish detect / point "
                                          "results in metres (objects_3d, point_positions)" + unset),
        DeclareLaunchArgument("depth_image", default_value="depth",
                              description="the depth image topic (with use_depth), aligned to the camera image: "
                                          "16UC1 millimetres or 32FC1 metres, stamped as its colour image"),
        DeclareLaunchArgument("camera_info", default_value="camera_info",
                              description="the camera's CameraInfo topic (with use_depth): published with every "
                                          "frame, or once, latched"),
        DeclareLaunchArgument("depth_tolerance_s", default_value="",
                              description="seconds: a colour frame pairs with the depth image (and camera_info) "
                                          "nearest its stamp within this, preferring its own stamp, and waits "
                                          "this long after it arrived for one" + unset),
        DeclareLaunchArgument("target_frame", default_value="",
                              description="3D results in this frame through tf2, e.g. base_link (needs tf2_ros); "
                                          "the params file's empty value: the camera's optical frame" + unset),
        OpaqueFunction(function=vision_nodes),
    ])
