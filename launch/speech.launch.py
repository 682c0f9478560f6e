"""Speech only: microphone (or `wav_file:=...`) -> speech -> transcript.

    ros2 launch photon_ros speech.launch.py namespace:=robot1 wav_file:=/path/to/command.wav
    ros2 launch photon_ros speech.launch.py managed:=true    # then: ros2 lifecycle set /speech configure
Topics are relative (audio, transcript) so a namespace or remapping moves them together.
"""
import os

from ament_index_python.packages import get_package_share_directory
from launch import LaunchDescription
from launch.actions import DeclareLaunchArgument
from launch.conditions import IfCondition, UnlessCondition
from launch.substitutions import LaunchConfiguration, PythonExpression
from launch_ros.actions import Node
from photon_ros.launch_helpers import dds_profile_env, photon_node


def generate_launch_description():
    share = get_package_share_directory("photon_ros")
    config = os.path.join(share, "config", "photon.yaml")
    env = dds_profile_env(share)
    namespace = LaunchConfiguration("namespace")
    wav_file = LaunchConfiguration("wav_file")
    use_wav = PythonExpression(["'", wav_file, "' != ''"])
    return LaunchDescription([
        DeclareLaunchArgument("namespace", default_value=""),
        DeclareLaunchArgument("params_file", default_value=config),
        DeclareLaunchArgument("wav_file", default_value="", description="play this file instead of the microphone"),
        DeclareLaunchArgument("managed", default_value="false",
                              description="true: a lifecycle node waiting unconfigured for a manager"),
        *photon_node(LaunchConfiguration("managed"), package="photon_ros", executable="speech_node",
                     name="speech", namespace=namespace, parameters=[LaunchConfiguration("params_file")],
                     additional_env=env, output="screen"),
        Node(package="photon_ros", executable="microphone_node", name="microphone", namespace=namespace,
             parameters=[LaunchConfiguration("params_file")], condition=UnlessCondition(use_wav),
             additional_env=env, output="screen"),
        Node(package="photon_ros", executable="wav_publisher", name="wav_publisher", namespace=namespace,
             parameters=[LaunchConfiguration("params_file"), {"file": wav_file}], condition=IfCondition(use_wav),
             additional_env=env, output="screen"),
    ])
