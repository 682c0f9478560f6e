"""Speech only: microphone (or `wav_file:=...`, or another driver) -> speech -> transcript.

    ros2 launch photon_ros speech.launch.py namespace:=robot1 wav_file:=/path/to/command.wav
    ros2 launch photon_ros speech.launch.py device:=cuda model:=openai/whisper-small
    ros2 launch photon_ros speech.launch.py microphone:=false audio:=/mic/audio   # another driver's topic
    ros2 launch photon_ros speech.launch.py managed:=true    # then: ros2 lifecycle set /speech configure
Topics are relative (audio, transcript) so a namespace or remapping moves them together. model,
device and input_type left unset keep the params file's values (config/photon.yaml).
"""
import os
from collections.abc import Mapping

from ament_index_python.packages import get_package_share_directory
from launch import LaunchDescription
from launch.actions import DeclareLaunchArgument, OpaqueFunction
from launch.conditions import LaunchConfigurationNotEquals
from launch.substitutions import LaunchConfiguration
from launch_ros.actions import Node, SetParameter
from photon_ros.launch_helpers import dds_profile_env, photon_node

# Arguments that set the speech node's parameter of the same name. Their default is "" (unset),
# which passes nothing: the params file stays the one place that holds the defaults.
PARAMETERS = ("model", "device", "input_type")
# Topic arguments -> the relative topic of every node on it (the default remaps it to itself).
TOPICS = {"audio": "audio", "audio_info": "audio_info"}


def flag(name: str, value: str) -> bool:
    """A true/false launch argument, spelled as launch's own conditions accept it."""
    if value.strip().lower() in ("true", "1"):
        return True
    if value.strip().lower() in ("false", "0"):
        return False
    raise ValueError(f"{name}:= takes true or false, got {value!r}")


def speech_settings(args: Mapping[str, str]) -> dict:
    """What the launch arguments make of the speech graph: the speech node's parameters given on the
    command line (only those: the others keep the params file's values), the topic remaps (for
    every node on them) and which of our nodes publishes the audio: wav_publisher for a file, else
    our microphone node unless microphone:=false (another driver publishes the topic)."""
    for arg in TOPICS:
        if not args[arg]:
            raise ValueError(f"{arg}:= needs a topic name (its default is {TOPICS[arg]!r})")
    microphone = flag("microphone", args["microphone"])
    source = "wav_publisher" if args["wav_file"] else "microphone_node" if microphone else None
    return {"parameters": {name: args[name] for name in PARAMETERS if args[name]},
            "remappings": [(topic, args[arg]) for arg, topic in TOPICS.items()], "source": source}


def generate_launch_description():
    share = get_package_share_directory("photon_ros")
    config = os.path.join(share, "config", "photon.yaml")

    def speech_nodes(context):
        settings = speech_settings(context.launch_configurations)
        common = dict(namespace=LaunchConfiguration("namespace"), remappings=settings["remappings"],
                      additional_env=dds_profile_env(share), output="screen")
        params_file = LaunchConfiguration("params_file")
        set_on_command_line = [settings["parameters"]] if settings["parameters"] else []
        nodes = photon_node(LaunchConfiguration("managed"), package="photon_ros", executable="speech_node",
                            name="speech", parameters=[params_file, *set_on_command_line], **common)
        if settings["source"] == "wav_publisher":
            nodes.append(Node(package="photon_ros", executable="wav_publisher", name="wav_publisher",
                              parameters=[params_file, {"file": LaunchConfiguration("wav_file")}], **common))
        elif settings["source"] == "microphone_node":
            nodes.append(Node(package="photon_ros", executable="microphone_node", name="microphone",
                              parameters=[params_file], **common))
        return nodes

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
                              description="a model name, a local path or a Hugging Face id, e.g. "
                                          "openai/whisper-small" + unset),
        DeclareLaunchArgument("device", default_value="", description="cpu, cuda or cuda:N" + unset),
        DeclareLaunchArgument("input_type", default_value="",
                              description="the message type on the audio topic (the values are listed in "
                                          "config/photon.yaml)" + unset),
        DeclareLaunchArgument("audio", default_value="audio", description="the audio topic"),
        DeclareLaunchArgument("audio_info", default_value="audio_info",
                              description="ros-drivers/audio_common's AudioInfo topic, the format of its "
                                          "AudioData / AudioDataStamped audio"),
        DeclareLaunchArgument("wav_file", default_value="", description="play this file instead of the microphone"),
        DeclareLaunchArgument("microphone", default_value="true",
                              description="false: start no microphone node of ours (another driver publishes "
                                          "the audio topic)"),
        OpaqueFunction(function=speech_nodes),
    ])
