"""Vision only: camera -> vision node -> detections / points / caption / infer service.

    ros2 launch photon_ros vision.launch.py namespace:=robot1 image:=/camera/color/image_raw
    ros2 launch photon_ros vision.launch.py device:=cuda model:=vikhyatk/moondream2
    ros2 launch photon_ros vision.launch.py managed:=true    # then: ros2 lifecycle set /vision configure
model, device, dtype and input left unset keep the params file's values (config/photon.yaml).
"""
import os
from collections.abc import Mapping

from ament_index_python.packages import get_package_share_directory
from launch import LaunchDescription
from launch.actions import DeclareLaunchArgument, OpaqueFunction
from launch.substitutions import LaunchConfiguration
from photon_ros.launch_helpers import dds_profile_env, photon_node

# Arguments that set the vision node's parameter of the same name. Their default is "" (unset),
# which passes nothing: the params file stays the one place that holds the defaults.
PARAMETERS = ("model", "device", "dtype", "input")
# Topic arguments -> the node's relative topic they remap (the default remaps it to itself).
TOPICS = {"image": "image", "depth_image": "depth", "camera_info": "camera_info"}


def vision_settings(args: Mapping[str, str]) -> dict:
    """What the launch arguments make of the vision node: the parameters given on the command line
    (only those: the others keep the params file's values) and its topic remaps."""
    for arg in TOPICS:
        if not args[arg]:
            raise ValueError(f"{arg}:= needs a topic name (its default is {TOPICS[arg]!r})")
    remappings = [(topic, args[arg]) for arg, topic in TOPICS.items()]
    # input:=compressed subscribes `image/compressed`: it follows the image topic as image_transport's does
    remappings.append(("image/compressed", args["image"] + "/compressed"))
    return {"parameters": {name: args[name] for name in PARAMETERS if args[name]}, "remappings": remappings}


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
        DeclareLaunchArgument("params_file", default_value=config,
                              description="the parameters file (defaults of every argument left unset)"),
        DeclareLaunchArgument("managed", default_value="false",
                              description="true: a lifecycle node waiting unconfigured for a manager"),
        DeclareLaunchArgument("model", default_value="",
                              description="a local folder/file or a Hugging Face id, e.g. vikhyatk/moondream2" + unset),
        DeclareLaunchArgument("device", default_value="", description="cpu or cuda" + unset),
        DeclareLaunchArgument("dtype", default_value="",
                              description="auto, float32, float16 or bfloat16" + unset),
        DeclareLaunchArgument("input", default_value="",
                              description="raw (sensor_msgs/Image on the image topic) or compressed "
                                          "(CompressedImage on <image>/compressed)" + unset),
        DeclareLaunchArgument("image", default_value="image", description="the camera's image topic"),
        DeclareLaunchArgument("depth_image", default_value="depth",
                              description="the depth image topic, aligned to the camera image. A remap only "
                                          "for now: the vision node does not subscribe to depth yet"),
        DeclareLaunchArgument("camera_info", default_value="camera_info",
                              description="the camera's CameraInfo topic. A remap only for now: the vision "
                                          "node does not subscribe to camera_info yet"),
        OpaqueFunction(function=vision_nodes),
    ])
