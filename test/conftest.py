"""Shared test setup.

DDS discovery must stay on this machine (traffic off loopback is forbidden here), and each test
run gets a domain of its own so parallel runs do not hear each other. Both must be set before
rclpy starts, which is why they are set at import time here.
"""
import os
import sys
from pathlib import Path

os.environ["ROS_AUTOMATIC_DISCOVERY_RANGE"] = "LOCALHOST"
os.environ.setdefault("ROS_DOMAIN_ID", str(100 + os.getpid() % 100))

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "test"))
