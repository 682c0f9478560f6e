"""Vision only: camera -> vision node -> detections / points / caption / infer service.

    ros2 launch photon_ros vision.launch.py namespace:=robot1 image:=/camera/color/image_raw
"""
import os

from ament_index_python.packages import get_package_share_directory
from launch import LaunchDescription
from launch.actions import DeclareLaunchArgument
from launch.substitutions import EnvironmentVariable, LaunchConfiguration
from launch_ros.actions import Node


def dds_profile_env(share):
    """Our nodes' Fast DDS profile: the one the user chose, else config/fastdds_large_data.xml
    (images over 512 KiB are lost between processes with Fast DDS's default shared memory)."""
    ours = os.path.join(share, "config", "fastdds_large_data.xml")
    chosen = EnvironmentVariable("FASTDDS_DEFAULT_PROFILES_FILE",
                                 default_value=EnvironmentVariable("FASTRTPS_DEFAULT_PROFILES_FILE", default_value=ours))
    return {"FASTDDS_DEFAULT_PROFILES_FILE": chosen}


def generate_launch_description():
    share = get_package_share_directory("photon_ros")
    config = os.path.join(share, "config", "photon.yaml")
    return LaunchDescription([
        DeclareLaunchArgument("namespace", default_value=""),
        DeclareLaunchArgument("params_file", default_value=config),
        DeclareLaunchArgument("image", default_value="image", description="the camera topic"),
        Node(package="photon_ros", executable="vision_node", name="vision",
             namespace=LaunchConfiguration("namespace"),
             parameters=[LaunchConfiguration("params_file")],
             remappings=[("image", LaunchConfiguration("image")),
                         ("image/compressed", [LaunchConfiguration("image"), "/compressed"])],
             additional_env=dds_profile_env(share), output="screen"),
    ])
