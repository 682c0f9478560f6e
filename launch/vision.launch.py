"""Vision only: camera -> vision node -> detections / points / caption / infer service.

    ros2 launch photon_ros vision.launch.py namespace:=robot1 image:=/camera/color/image_raw
    ros2 launch photon_ros vision.launch.py managed:=true    # then: ros2 lifecycle set /vision configure
"""
import os

from ament_index_python.packages import get_package_share_directory
from launch import LaunchDescription
from launch.actions import DeclareLaunchArgument
from launch.conditions import IfCondition, UnlessCondition
from launch.substitutions import EnvironmentVariable, LaunchConfiguration
from launch_ros.actions import LifecycleNode, Node


def dds_profile_env(share):
    """Our nodes' Fast DDS profile: the one the user chose, else config/fastdds_large_data.xml
    (images over 512 KiB are lost between processes with Fast DDS's default shared memory)."""
    ours = os.path.join(share, "config", "fastdds_large_data.xml")
    chosen = EnvironmentVariable("FASTDDS_DEFAULT_PROFILES_FILE",
                                 default_value=EnvironmentVariable("FASTRTPS_DEFAULT_PROFILES_FILE", default_value=ours))
    return {"FASTDDS_DEFAULT_PROFILES_FILE": chosen}


def photon_node(managed, **kwargs):
    """The node as a plain node, or with managed:=true as a lifecycle node that starts
    unconfigured (autostart false) and waits for a lifecycle manager to configure and activate it."""
    parameters = kwargs.pop("parameters")
    return [Node(condition=UnlessCondition(managed), parameters=parameters, **kwargs),
            LifecycleNode(condition=IfCondition(managed), parameters=parameters + [{"autostart": False}],
                          **kwargs)]


def generate_launch_description():
    share = get_package_share_directory("photon_ros")
    config = os.path.join(share, "config", "photon.yaml")
    return LaunchDescription([
        DeclareLaunchArgument("namespace", default_value=""),
        DeclareLaunchArgument("params_file", default_value=config),
        DeclareLaunchArgument("image", default_value="image", description="the camera topic"),
        DeclareLaunchArgument("managed", default_value="false",
                              description="true: a lifecycle node waiting unconfigured for a manager"),
        *photon_node(LaunchConfiguration("managed"), package="photon_ros", executable="vision_node",
                     name="vision", namespace=LaunchConfiguration("namespace"),
                     parameters=[LaunchConfiguration("params_file")],
                     remappings=[("image", LaunchConfiguration("image")),
                                 ("image/compressed", [LaunchConfiguration("image"), "/compressed"])],
                     additional_env=dds_profile_env(share), output="screen"),
    ])
