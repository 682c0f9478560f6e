"""Vision only: camera -> vision node -> detections / points / caption / infer service.

    ros2 launch photon_ros vision.launch.py namespace:=robot1 image:=/camera/color/image_raw
    ros2 launch photon_ros vision.launch.py managed:=true    # then: ros2 lifecycle set /vision configure
"""
import os

from ament_index_python.packages import get_package_share_directory
from launch import LaunchDescription
from launch.actions import DeclareLaunchArgument
from launch.substitutions import LaunchConfiguration
from photon_ros.launch_helpers import dds_profile_env, photon_node


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
