"""Everything: camera + microphone -> vision, speech -> the observe-infer-act loop.

    ros2 launch photon_ros photon.launch.py namespace:=robot1 image:=/camera/color/image_raw
    ros2 launch photon_ros photon.launch.py device:=cuda vision_model:=vikhyatk/moondream2   # on a GPU
    ros2 launch photon_ros photon.launch.py wav_file:=command.wav     # no microphone
    ros2 launch photon_ros photon.launch.py managed:=true    # vision and speech wait for a lifecycle manager
    ros2 launch photon_ros photon.launch.py image:=/camera/camera/color/image_raw use_depth:=true \
        depth_image:=/camera/camera/aligned_depth_to_color/image_raw camera_info:=/camera/camera/color/camera_info
Same graph without ros2 launch: python -m photon_ros.bringup --graph all
vision.launch.py and speech.launch.py take the arguments of their own node; here the two models
are vision_model and speech_model, device applies to both. Unset arguments keep the params file's values.
"""
import os
from collections.abc import Sequence

from ament_index_python.packages import get_package_share_directory
from launch import LaunchDescription
from launch.actions import DeclareLaunchArgument, IncludeLaunchDescription, LogInfo, OpaqueFunction
from launch.launch_description_sources import PythonLaunchDescriptionSource
from launch.conditions import LaunchConfigurationNotEquals
from launch.substitutions import LaunchConfiguration
from launch_ros.actions import Node, SetParameter
from photon_ros.launch_helpers import dds_profile_env

# Each included file's arguments -> the argument of this file that sets it.
SHARED = {"namespace": "namespace", "params_file": "params_file", "managed": "managed", "device": "device",
          "use_sim_time": "use_sim_time"}
VISION = {**SHARED, "model": "vision_model", "dtype": "dtype", "input": "input", "image": "image",
          "depth_image": "depth_image", "camera_info": "camera_info", "use_depth": "use_depth",
          "depth_tolerance_s": "depth_tolerance_s", "target_frame": "target_frame"}
SPEECH = {**SHARED, "model": "speech_model", "input_type": "input_type", "audio": "audio",
          "audio_info": "audio_info", "wav_file": "wav_file", "microphone": "microphone"}


def ambiguous_model(argv: Sequence[str]) -> str:
    """What to say when the command line gives model:=, which names neither model here (it would be
    ignored). Only the command line's: a parent launch file's own `model` argument (a URDF's, as
    robot descriptions name theirs) is not ours to refuse."""
    if any(arg.split(":=", 1)[0] == "model" for arg in argv):
        return ("photon.launch.py ignores model:=; it takes vision_model:= and speech_model:= "
                "(model:= is vision.launch.py's and speech.launch.py's)")
    return ""


def generate_launch_description():
    share = get_package_share_directory("photon_ros")
    config = os.path.join(share, "config", "photon.yaml")

    def include(name, forwarded):
        return IncludeLaunchDescription(
            PythonLaunchDescriptionSource(os.path.join(share, "launch", name)),
            launch_arguments={theirs: LaunchConfiguration(ours) for theirs, ours in forwarded.items()}.items())

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
                              description="true: vision and speech wait unconfigured for a lifecycle manager"),
        DeclareLaunchArgument("vision_model", default_value="",
                              description="the vision node's model, e.g. vikhyatk/moondream2" + unset),
        DeclareLaunchArgument("speech_model", default_value="",
                              description="the speech node's model, e.g. openai/whisper-small" + unset),
        DeclareLaunchArgument("device", default_value="",
                              description="cpu, cuda or cuda:N, for vision and speech" + unset),
        DeclareLaunchArgument("dtype", default_value="",
                              description="the vision model's: auto, float32, float16 or bfloat16" + unset),
        DeclareLaunchArgument("input", default_value="",
                              description="the vision node's input: raw or compressed" + unset),
        DeclareLaunchArgument("input_type", default_value="",
                              description="the message type on the audio topic (see config/photon.yaml)" + unset),
        DeclareLaunchArgument("image", default_value="image", description="the camera's image topic"),
        DeclareLaunchArgument("use_depth", default_value="",
                              description="true: the vision node reads depth_image and camera_info and publishes "
                                          "results in metres" + unset),
        DeclareLaunchArgument("depth_image", default_value="depth",
                              description="the depth image topic (with use_depth), aligned to the camera image"),
        DeclareLaunchArgument("camera_info", default_value="camera_info",
                              description="the camera's CameraInfo topic (with use_depth)"),
        DeclareLaunchArgument("depth_tolerance_s", default_value="",
                              description="seconds: a frame pairs with the depth nearest its stamp within this, "
                                          "waiting this long for it" + unset),
        DeclareLaunchArgument("target_frame", default_value="",
                              description="3D results in this frame through tf2, e.g. base_link" + unset),
        DeclareLaunchArgument("audio", default_value="audio", description="the audio topic"),
        DeclareLaunchArgument("audio_info", default_value="audio_info",
                              description="ros-drivers/audio_common's AudioInfo topic"),
        DeclareLaunchArgument("wav_file", default_value="", description="play this file instead of the microphone"),
        DeclareLaunchArgument("microphone", default_value="true",
                              description="false: start no microphone node of ours (another driver publishes "
                                          "the audio topic)"),
        OpaqueFunction(function=lambda context: [LogInfo(msg=m)] if (m := ambiguous_model(context.argv)) else []),
        include("vision.launch.py", VISION),
        include("speech.launch.py", SPEECH),
        Node(package="photon_ros", executable="loop_node", name="loop",
             namespace=LaunchConfiguration("namespace"),
             parameters=[LaunchConfiguration("params_file")], additional_env=dds_profile_env(share),
             output="screen"),
    ])
