"""What the launch files share (imported only by them: `launch` and `launch_ros` come with a ROS
install, not with photon_ros itself)."""
from __future__ import annotations

import os

from launch.conditions import IfCondition, UnlessCondition
from launch.substitutions import EnvironmentVariable
from launch_ros.actions import LifecycleNode, Node


def dds_profile_env(share: str) -> dict:
    """Our nodes' Fast DDS profile: the one the user chose, else config/fastdds_large_data.xml
    (images over 512 KiB are lost between processes with Fast DDS's default shared memory)."""
    ours = os.path.join(share, "config", "fastdds_large_data.xml")
    chosen = EnvironmentVariable("FASTDDS_DEFAULT_PROFILES_FILE",
                                 default_value=EnvironmentVariable("FASTRTPS_DEFAULT_PROFILES_FILE", default_value=ours))
    return {"FASTDDS_DEFAULT_PROFILES_FILE": chosen}


def photon_node(managed, **kwargs) -> list:
    """The node as a plain node, or with managed:=true as a lifecycle node that starts
    unconfigured (autostart false) and waits for a lifecycle manager to configure and activate it."""
    parameters = kwargs.pop("parameters")
    return [Node(condition=UnlessCondition(managed), parameters=parameters, **kwargs),
            LifecycleNode(condition=IfCondition(managed), parameters=parameters + [{"autostart": False}],
                          **kwargs)]
