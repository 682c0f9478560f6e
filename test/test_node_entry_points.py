"""`ros2 run` entry points start, and one that cannot (no audio device here) exits non-zero
with a reason instead of publishing nothing."""
import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_microphone_without_sounddevice_says_why():
    out = subprocess.run([sys.executable, str(ROOT / "nodes" / "microphone_node")], capture_output=True,
                         text=True, timeout=60, env={**os.environ, "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}"})
    # sounddevice is not among the pinned requirements, so here it is never importable.
    assert out.returncode == 1
    assert "sounddevice is not usable" in out.stderr and "Traceback" not in out.stderr


def test_every_node_script_names_a_module_with_main():
    for script in (ROOT / "nodes").iterdir():
        text = script.read_text()
        module = text.split("from photon_ros.")[1].split(" import")[0]
        assert (ROOT / "photon_ros" / f"{module}.py").exists()
        assert "def main(" in (ROOT / "photon_ros" / f"{module}.py").read_text()


NODE_MODULES = {"speech_node": "speech", "vision_node": "vision", "loop_node": "loop",
                "microphone_node": "microphone", "wav_publisher": "wav_publisher"}


@pytest.mark.parametrize("module", sorted(NODE_MODULES))
def test_help_prints_usage_without_starting_a_node(module):
    """--help printed nothing and started the node (only --microphones was parsed)."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}"}
    out = subprocess.run([sys.executable, "-m", f"photon_ros.{module}", "--help"], capture_output=True,
                         text=True, timeout=30, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    name = NODE_MODULES[module]
    assert out.stdout.startswith(f"usage: python -m photon_ros.{module}"), out.stdout
    assert f"'{name}'" in out.stdout and "--ros-args" in out.stdout and "-p NAME:=VALUE" in out.stdout
    assert "config/photon.yaml" in out.stdout and f"ros2 param describe /{name}" in out.stdout
    assert out.stderr == ""   # no node started: it would log (rclpy, the model load)
    # what the node is: its docstring's first sentence whole (its first line cut the loop's in two)
    doc = importlib.import_module(f"photon_ros.{module}").__doc__
    assert " ".join(doc.split("\n\n")[0].split()) in out.stdout


def test_help_of_a_ros2_run_script_and_ros_arguments_named_help():
    """The nodes/ script (`ros2 run`) takes -h too; a --help among the ROS arguments is not ours."""
    from photon_ros.run_node import help_requested

    env = {**os.environ, "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}"}
    out = subprocess.run([sys.executable, str(ROOT / "nodes" / "loop_node"), "-h"], capture_output=True,
                         text=True, timeout=30, env=env)
    assert out.returncode == 0 and "usage:" in out.stdout and "'loop'" in out.stdout, out
    assert help_requested(["prog", "--help"]) and help_requested(["prog", "--ros-args", "-p", "a:=1", "--", "-h"])
    assert not help_requested(["prog", "--ros-args", "-p", "a:=1", "--help"])
    assert not help_requested(["prog"])
