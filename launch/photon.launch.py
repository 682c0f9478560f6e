"""Everything: camera + microphone -> vision, speech -> the observe-infer-act loop.

    ros2 launch photon_ros photon.launch.py namespace:=robot1 image:=/camera/color/image_raw
    ros2 launch photon_ros photon.launch.py wav_file:=command.wav     # no microphone
    ros2 launch photon_ros photon.launch.py managed:=true    # vision and speech wait for a lifecycle manager
Same graph without ros2 launch: python -m photon_ros.bringup --graph all
"""
import os

from ament_index_python.packages import get_package_share_directory
from launch import LaunchDescription
from launch.actions import DeclareLaunchArgument, IncludeLaunchDescription
from launch.launch_description_sources import PythonLaunchDescriptionSource
from launch.substitutions import LaunchConfiguration
from launch_ros.actions import Node
from photon_ros.launch_helpers import dds_profile_env


def generate_launch_description():
    share = get_package_share_directory("photon_ros")
    config = os.path.join(share, "config", "photon.yaml")
    forwarded = {name: LaunchConfiguration(name) for name in ("namespace", "params_file", "managed")}

    def include(name, **extra):
        return IncludeLaunchDescription(
            PythonLaunchDescriptionSource(os.path.join(share, "launch", name)),
            launch_arguments={**forwarded, **extra}.items())

    return LaunchDescription([
        DeclareLaunchArgument("namespace", default_value=""),
        DeclareLaunchArgument("params_file", default_value=config),
        DeclareLaunchArgument("image", default_value="image"),
        DeclareLaunchArgument("wav_file", default_value=""),
        DeclareLaunchArgument("managed", default_value="false",
                              description="true: vision and speech wait unconfigured for a lifecycle manager"),
        include("vision.launch.py", image=LaunchConfiguration("image")),
        include("speech.launch.py", wav_file=LaunchConfiguration("wav_file")),
        Node(package="photon_ros", executable="loop_node", name="loop",
             namespace=LaunchConfiguration("namespace"),
             parameters=[LaunchConfiguration("params_file")], additional_env=dds_profile_env(share),
             output="screen"),
    ])
