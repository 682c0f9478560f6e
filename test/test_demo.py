"""The main job (README's first command ends with it: `python -m photon_ros.demo`), run as a user
runs it, in a process of its own: espeak-ng speaks the command, the WAV publisher plays it over
DDS, the speech node transcribes it with Whisper tiny.en's real weights, and the transcript that
arrives on /transcript is printed. Nothing else in the suite runs this module, and CI's setup
skips the demo (--no-demo)."""
from __future__ import annotations

import os
import re
import subprocess
import sys

from photon_ros.demo import COMMAND


def words(text: str) -> list[str]:
    return re.findall(r"[a-z]+", text.lower())


def test_the_main_job_prints_the_spoken_command_as_its_transcript():
    # conftest's discovery range and domain reach the child through the environment
    env = {**os.environ, "ROS_AUTOMATIC_DISCOVERY_RANGE": "LOCALHOST"}
    out = subprocess.run([sys.executable, "-m", "photon_ros.demo", "--timeout", "150"], env=env,
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-2000:]
    heard = re.search(r"^\[demo\] transcript on /transcript: '(.*)'$", out.stdout, re.MULTILINE)
    assert heard, out.stdout
    assert words(heard[1]) == words(COMMAND)
    assert "Traceback" not in out.stderr
