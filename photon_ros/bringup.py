"""Start a photon_ros graph in one process from config/photon.yaml, without `ros2 launch`.

    python -m photon_ros.bringup --graph all --namespace robot1 -r image:=/camera/image_raw
    python -m photon_ros.bringup --graph speech --wav command.wav
    python -m photon_ros.bringup --graph vision --managed   # then: ros2 lifecycle set /vision configure

The same YAML feeds the launch files; here every node shares one process (and so one engine
per model) and one multi-threaded executor. With --managed the vision and speech nodes start
unconfigured (autostart false) and wait for a lifecycle manager.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any, MutableMapping

import rclpy
import yaml
from rclpy.parameter import Parameter

from photon_ros.run_node import spin_nodes

DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "config" / "photon.yaml"
LARGE_DATA_PROFILE = "fastdds_large_data.xml"
# The first is Fast DDS 3's name; rmw_fastrtps still honours the second (deprecated).
PROFILE_VARIABLES = ("FASTDDS_DEFAULT_PROFILES_FILE", "FASTRTPS_DEFAULT_PROFILES_FILE")

# The lifecycle nodes: --managed starts them unconfigured.
MANAGED = ("vision", "speech")

GRAPHS = {
    "all": ["vision", "speech", "loop", "audio"],
    "vision": ["vision"],
    "speech": ["speech", "audio"],
    "loop": ["loop"],
}


def node_classes() -> dict[str, type]:
    # Imported on use: a vision-only graph must not need the microphone library, and so on.
    from photon_ros.loop_node import LoopNode
    from photon_ros.speech_node import SpeechNode
    from photon_ros.vision_node import VisionNode
    from photon_ros.wav_publisher import WavPublisher

    def microphone(**kwargs):
        from photon_ros.microphone_node import MicrophoneNode
        return MicrophoneNode(**kwargs)

    return {"vision": VisionNode, "speech": SpeechNode, "loop": LoopNode,
            "wav_publisher": WavPublisher, "microphone": microphone}


def large_data_profile() -> Path | None:
    """config/fastdds_large_data.xml of the source tree, else of the installed package."""
    candidates = [DEFAULT_CONFIG.parent / LARGE_DATA_PROFILE]
    try:
        from ament_index_python.packages import get_package_share_directory
        candidates.append(Path(get_package_share_directory("photon_ros")) / "config" / LARGE_DATA_PROFILE)
    except (ImportError, LookupError):   # not built or not sourced: the source tree is all there is
        pass
    return next((path for path in candidates if path.is_file()), None)


def use_large_data_profile(environ: MutableMapping[str, str] = os.environ) -> str | None:
    """Point Fast DDS at our shared-memory profile unless a profile was chosen already; returns
    the profile in effect. Without it, images this process sends to others (image_annotated)
    that exceed Fast DDS's 512 KiB default segment are lost under best-effort QoS. Fast DDS reads
    the variable once per process: call this before rclpy.init()."""
    for name in PROFILE_VARIABLES:
        if environ.get(name):
            return environ[name]
    profile = large_data_profile()
    if profile is None:
        return None
    environ["FASTDDS_DEFAULT_PROFILES_FILE"] = str(profile)
    return str(profile)


def flatten(params: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"vad": {"hangover_s": 0.6}} -> {"vad.hangover_s": 0.6}, as ROS names nested parameters."""
    flat = {}
    for key, value in params.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, name + "."))
        else:
            flat[name] = value
    return flat


def node_parameters(config: dict, node_name: str) -> list[Parameter]:
    section = (config.get(node_name) or {}).get("ros__parameters") or {}
    return [Parameter(name, value=value) for name, value in flatten(section).items()]


def build_graph(config_path: Path, graph: str, namespace: str = "", remaps: list[str] = (),
                wav: str | None = None, context=None, overrides: dict[str, dict] | None = None,
                managed: bool = False, roles: list[str] | None = None) -> list:
    """The nodes of `graph` (or of `roles`, a subset of its roles), configured from the YAML (plus
    `overrides`: node -> {param: value}). `managed`: the lifecycle nodes wait unconfigured for a
    manager (an override still wins). If one node cannot start, those made before it are destroyed."""
    config = yaml.safe_load(Path(config_path).read_text()) or {}
    classes = node_classes()
    cli_args = ["--ros-args"] + [arg for r in remaps for arg in ("-r", r)] if remaps else None
    nodes = []
    try:
        for role in roles if roles is not None else GRAPHS[graph]:
            name = role if role != "audio" else ("wav_publisher" if wav else "microphone")
            params = node_parameters(config, name)
            extra = {"autostart": False} if managed and name in MANAGED else {}
            extra.update((overrides or {}).get(name, {}))
            if name == "wav_publisher":
                extra["file"] = wav
            params = [p for p in params if p.name not in extra] + [Parameter(k, value=v) for k, v in extra.items()]
            nodes.append(classes[name](namespace=namespace, cli_args=cli_args, parameter_overrides=params,
                                       context=context))
    except Exception:
        for node in nodes:
            node.destroy_node()
        raise
    return nodes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--graph", choices=sorted(GRAPHS), default="all")
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG)
    parser.add_argument("--namespace", default="")
    parser.add_argument("-r", "--remap", action="append", default=[], metavar="FROM:=TO")
    parser.add_argument("--wav", help="play this WAV file instead of capturing the microphone")
    parser.add_argument("--managed", action="store_true",
                        help="start the vision and speech nodes unconfigured, for a lifecycle manager")
    args = parser.parse_args(argv)
    use_large_data_profile()
    rclpy.init()
    try:
        nodes = build_graph(args.config, args.graph, args.namespace, args.remap, args.wav,
                            managed=args.managed)
    except Exception as err:  # noqa: BLE001 - a bad config or missing device ends bring-up with its reason
        print(f"bringup: {err}", file=sys.stderr)
        rclpy.try_shutdown()
        return 1
    return spin_nodes(nodes)


if __name__ == "__main__":
    sys.exit(main())
