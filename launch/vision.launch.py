"""Vision only: camera -> vision node -> detections / points / caption / infer service.

    ros2 launch photon_ros vision.launch.py namespace:=robot1 image:=/camera/color/image_raw
"""
import os

from ament_index_python.packages import get_package_share_directory
from launch import LaunchDescription
from launch.actions import DeclareLaunchArgument
from launch.substitutions import LaunchConfiguration
from launch_ros.actions import Node


def generate_launch_description():
    config = os.path.join(get_package_share_directory("photon_ros"), "config", "photon.yaml")
    return LaunchDescription([
        DeclareLaunchArgument("namespace", default_value=""),
        DeclareLaunchArgument("params_file", default_value=config),
        DeclareLaunchArgument("image", default_value="image", description="the camera topic"),
        Node(package="photon_ros", executable="vision_node", name="vision",
             namespace=LaunchConfiguration("namespace"),
             parameters=[LaunchConfiguration("params_file")],
             remappings=[("image", LaunchConfiguration("image")),
                         ("image/compressed", [LaunchConfiguration("image"), "/compressed"])],
             output="screen"),
    ])
