"""Transcripts -> vision requests, and the turn controller."""
import pytest

from photon_ros.commands import VisionRequest, parse_command
from photon_ros.steering import turn_towards


@pytest.mark.parametrize("text, expected", [
    ("Point at the red cup.", VisionRequest("point", "red cup")),
    ("Robot, please point to the blue bottle", VisionRequest("point", "blue bottle")),
    ("Find the person.", VisionRequest("detect", "person")),
    ("Could you find a chair?", VisionRequest("detect", "chair")),
    ("Where is my phone?", VisionRequest("point", "phone")),
    ("Look at the door, please.", VisionRequest("point", "door")),
    ("Show me all the apples", VisionRequest("detect", "apples")),
    ("Hey robot, locate the fire extinguisher", VisionRequest("detect", "fire extinguisher")),
])
def test_commands_are_understood(text, expected):
    assert parse_command(text) == expected


@pytest.mark.parametrize("text", ["", "Hello there.", "What time is it?", "Find.", "point at the"])
def test_other_sentences_ask_for_nothing(text):
    assert parse_command(text) is None


def test_turn_towards_a_target():
    assert turn_towards(0.2, gain=2.0, max_rate=1.0).angular.z == pytest.approx(0.6)   # left of centre: turn left
    assert turn_towards(0.9, gain=2.0, max_rate=1.0).angular.z == pytest.approx(-0.8)
    assert turn_towards(1.0, gain=4.0, max_rate=1.0).angular.z == -1.0                # clipped
    assert turn_towards(0.51, gain=2.0, max_rate=1.0).angular.z == 0.0                 # deadband
