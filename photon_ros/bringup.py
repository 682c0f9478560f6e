"""Start a photon_ros graph in one process from config/photon.yaml, without `ros2 launch`.

    python -m photon_ros.bringup --graph all --namespace robot1 -r image:=/camera/image_raw
    python -m photon_ros.bringup --graph speech --wav command.wav
    python -m photon_ros.bringup --graph vision --managed   # then: ros2 lifecycle set /vision configure
    python -m photon_ros.bringup --graph vision --namespaces r1,r2,r3,r4 -r image:=camera/image_raw

The same YAML feeds the launch files; here every node shares one process (and so one engine
per model) and one multi-threaded executor. With --managed the vision and speech nodes start
unconfigured (autostart false) and wait for a lifecycle manager.

--namespaces serves several robots from one machine (a GPU workstation; DDS carries each robot's
topics): the graph once per namespace, every copy on the same engines, so the robots' requests
are decoded in shared batches while each robot's topics stay under its own namespace. Remaps
apply in every namespace, a relative target resolving inside each; one that would send every
robot's topic to the same absolute name is refused. The robots' microphones are theirs: no
microphone node is started (each robot's driver publishes its <namespace>/audio); --wav plays
the file into every namespace.
"""
from __future__ import annotations

if __name__ == "__main__":   # `python -m`: a Ctrl-C during the imports below ends it at once
    from photon_ros.run_node import exit_on_ctrl_c
    exit_on_ctrl_c()

import argparse
import os
import re
import sys
from pathlib import Path
from typing import Any, MutableMapping

import rclpy
import yaml
from rclpy.exceptions import InvalidNamespaceException
from rclpy.parameter import Parameter
from rclpy.validate_namespace import validate_namespace

from photon_ros.run_node import exit_leaving_no_thread, init_rclpy, spin_nodes

SOURCE_CONFIG_DIR = Path(__file__).resolve().parent.parent / "config"
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
        try:
            return MicrophoneNode(**kwargs)
        except RuntimeError as err:   # no sounddevice, no input device: what bringup offers instead
            raise RuntimeError(f"{err} (bringup: --wav FILE plays a file instead of the microphone)") from None

    return {"vision": VisionNode, "speech": SpeechNode, "loop": LoopNode,
            "wav_publisher": WavPublisher, "microphone": microphone}


def config_file(name: str) -> Path | None:
    """config/<name> of the source tree, else of the installed package (an installed module sits
    in site-packages, where no config/ is)."""
    candidates = [SOURCE_CONFIG_DIR / name]
    try:
        from ament_index_python.packages import get_package_share_directory
        candidates.append(Path(get_package_share_directory("photon_ros")) / "config" / name)
    except (ImportError, LookupError):   # not built or not sourced: the source tree is all there is
        pass
    return next((path for path in candidates if path.is_file()), None)


def large_data_profile() -> Path | None:
    return config_file(LARGE_DATA_PROFILE)


DEFAULT_CONFIG = config_file("photon.yaml") or SOURCE_CONFIG_DIR / "photon.yaml"


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


def section_matches(key: str, fully_qualified_name: str) -> bool:
    """Whether a params file's section `key` applies to the node `fully_qualified_name`, as rcl
    reads the file: a bare key is absolute (`vision` is /vision only), `*` one name, `**` any
    number of them (`/**/vision` is a vision node in any namespace)."""
    tokens = (key if key.startswith("/") else "/" + key).strip("/").split("/")
    pattern = "".join(r"(/\w+)*" if t == "**" else r"/\w+" if t == "*" else "/" + re.escape(t)
                      for t in tokens if t) or r"/"
    return re.fullmatch(pattern, fully_qualified_name) is not None


def sections(config: dict, prefix: str = "") -> list[tuple[str, dict]]:
    """The node sections of a params file in the file's order, each keyed by its full name. rcl
    also takes a namespace as a level of its own (`robot1:` / `vision:` / `ros__parameters:` is
    /robot1/vision, several nodes under one namespace key): those were dropped here, silently,
    while `ros2 launch` with the same file gave the nodes their values."""
    found = []
    for key, value in config.items():
        if not isinstance(key, str) or not isinstance(value, dict):
            continue
        name = f"{prefix.rstrip('/')}/{key.strip('/')}" if prefix else key
        if isinstance(value.get("ros__parameters"), dict):
            found.append((name, value["ros__parameters"]))
        nested = {k: v for k, v in value.items() if k != "ros__parameters"}
        found.extend(sections(nested, name))
    return found


def node_parameters(config: dict, node_name: str, namespace: str = "") -> list[Parameter]:
    """A node's parameters from a ROS params file, as rcl takes them for the same file: every
    section matching the node's fully qualified name, in the file's order, a later one's value
    winning (`ros2 launch` with this file and bringup give a node the same values)."""
    ns = "/" + namespace.strip("/")
    fqn = (ns.rstrip("/") + "/" + node_name)
    merged: dict = {}
    for key, params in sections(config):
        if section_matches(key, fqn):
            merged.update(flatten(params))
    # An empty list carries no type to rclpy (it takes it for a byte array, and a node declaring a
    # string array refuses it); every list parameter of ours declares [] as its default, so an
    # empty one is left to that.
    return [Parameter(name, value=value) for name, value in merged.items() if value != []]


def check_namespaces(namespaces: list[str]) -> list[str]:
    """The robots' namespaces, absolute ("r1" -> "/r1"); empty, invalid or repeated ones refused."""
    checked: list[str] = []
    for given in namespaces:
        name = "/" + given.strip().lstrip("/")
        if name == "/":
            raise ValueError(f"namespaces {','.join(namespaces)!r}: every robot needs a namespace of its own "
                             "(an empty name or '/' would put its topics at the root)")
        try:
            validate_namespace(name)
        except InvalidNamespaceException as err:
            raise ValueError(f"namespace {given!r}: {str(err).splitlines()[0]}") from None
        if name in checked:
            raise ValueError(f"namespace {name} is given twice: two robots would share its topics")
        checked.append(name)
    if not checked:
        raise ValueError("no namespace given (e.g. r1,r2,r3,r4)")
    return checked


def check_remaps(remaps: list[str], namespaces: list[str] | None) -> None:
    """Refuse remaps that would merge robots: with several namespaces a relative name remapped to
    an absolute one is the same topic for every robot (one camera for all of them, or every
    robot's results on one topic), and __ns would move every node into one namespace."""
    for rule in remaps:
        if ":=" not in rule:
            raise ValueError(f"remap {rule!r}: expected FROM:=TO (e.g. image:=camera/image_raw)")
        source, target = rule.split(":=", 1)
        source = source.rsplit(":", 1)[-1]   # without a "node:" prefix, which limits a rule to one node
        if namespaces is None:
            continue
        if source == "__ns":
            raise ValueError(f"remap {rule!r}: the namespaces come from --namespaces, one per robot")
        if len(namespaces) > 1 and not source.startswith("/") and target.startswith("/"):
            raise ValueError(f"remap {rule!r} would give every robot the one topic {target}; name it "
                             f"relative ({source}:={target.lstrip('/')}) to resolve it in each namespace")


def node_overrides(overrides: dict[str, dict], namespace: str, name: str) -> dict:
    """The overrides of node `name` in `namespace`: those keyed by the node's name (every
    namespace), then those keyed "namespace/name" (that namespace's only, e.g. "r2/vision")."""
    merged = dict(overrides.get(name, {}))
    if namespace.strip("/"):
        merged.update(overrides.get(f"{namespace.strip('/')}/{name}", {}))
    return merged


def check_override_keys(overrides: dict[str, dict], namespaces: list[str]) -> None:
    for key in overrides:
        if "/" in key and "/" + key.rsplit("/", 1)[0].strip("/") not in namespaces:
            raise ValueError(f"overrides for {key!r}: {key.rsplit('/', 1)[0]} is none of the namespaces "
                             f"served ({', '.join(namespaces) or 'none'})")


def build_graph(config_path: Path, graph: str, namespace: str = "", remaps: list[str] = (),
                wav: str | None = None, context=None, overrides: dict[str, dict] | None = None,
                managed: bool = False, roles: list[str] | None = None,
                namespaces: list[str] | None = None) -> list:
    """The nodes of `graph` (or of `roles`, a subset of its roles), configured from the YAML (plus
    `overrides`: node -> {param: value}, or "namespace/node" -> {param: value} for one namespace's).
    `managed`: the lifecycle nodes wait unconfigured for a manager (an override still wins).
    `namespaces`: the graph once in each (instead of `namespace`), every copy on the same engines;
    no microphone node then (each robot publishes its own audio), the WAV played into each.
    If one node cannot start, those made before it are destroyed."""
    if namespaces is not None and namespace:
        raise ValueError(f"namespace {namespace!r} and namespaces {','.join(namespaces)!r} together: "
                         "give one namespace, or the list of them")
    served = check_namespaces(namespaces) if namespaces is not None else None
    check_remaps(list(remaps), served)
    overrides = overrides or {}
    check_override_keys(overrides, served if served is not None else
                        (["/" + namespace.strip("/")] if namespace.strip("/") else []))
    config = yaml.safe_load(Path(config_path).read_text()) or {}
    classes = node_classes()
    cli_args = ["--ros-args"] + [arg for r in remaps for arg in ("-r", r)] if remaps else None
    nodes = []
    try:
        for ns in served if served is not None else [namespace]:
            for role in roles if roles is not None else GRAPHS[graph]:
                name = role if role != "audio" else ("wav_publisher" if wav else "microphone")
                if name == "microphone" and served is not None:
                    continue   # a robot's microphone is on the robot: its driver publishes <ns>/audio
                params = node_parameters(config, name, ns)
                extra = {"autostart": False} if managed and name in MANAGED else {}
                extra.update(node_overrides(overrides, ns, name))
                if name == "wav_publisher":
                    extra["file"] = wav
                params = [p for p in params if p.name not in extra] + [Parameter(k, value=v) for k, v in extra.items()]
                nodes.append(classes[name](namespace=ns, cli_args=cli_args, parameter_overrides=params,
                                           context=context))
    except BaseException:   # a bad section, or Ctrl-C during a long construction
        for node in nodes:
            node.destroy_node()
        raise
    return nodes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--graph", choices=sorted(GRAPHS), default="all")
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG)
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--namespace", default="", help="the nodes' namespace, e.g. robot1")
    where.add_argument("--namespaces", type=lambda text: text.split(","), metavar="NS,NS,...",
                       help="serve several robots: the graph once per namespace (e.g. r1,r2,r3,r4), "
                            "all on one engine per model")
    parser.add_argument("-r", "--remap", action="append", default=[], metavar="FROM:=TO")
    parser.add_argument("--wav", help="play this WAV file instead of capturing the microphone")
    parser.add_argument("--managed", action="store_true",
                        help="start the vision and speech nodes unconfigured, for a lifecycle manager")
    args = parser.parse_args(argv)
    use_large_data_profile()
    # Not sys.argv: rcl would take our -r rules for global ones (its deprecated syntax) and apply
    # them to every node, beside the per-node rules build_graph gives.
    init_rclpy([])
    try:
        nodes = build_graph(args.config, args.graph, args.namespace, args.remap, args.wav,
                            managed=args.managed, namespaces=args.namespaces)
    except KeyboardInterrupt:   # Ctrl-C before the graph was up: nothing ran, nothing to report
        rclpy.try_shutdown()
        exit_leaving_no_thread(0)   # a node's model load given up (as spin_nodes ends)
        return 0
    except Exception as err:  # noqa: BLE001 - a bad config or missing device ends bring-up with its reason
        print(f"bringup: {err}", file=sys.stderr)
        rclpy.try_shutdown()
        exit_leaving_no_thread(1)
        return 1
    if args.namespaces is not None and "audio" in GRAPHS[args.graph] and not args.wav:
        audio = ", ".join(node.resolve_topic_name("audio") for node in nodes if node.get_name() == "speech")
        print(f"bringup: no microphone node with --namespaces: each robot's driver publishes on {audio}",
              file=sys.stderr)
    return spin_nodes(nodes)


if __name__ == "__main__":
    sys.exit(main())
