"""`pip install .` as designed: a wheel of photon_core and photon_ros whose version is
package.xml's (one source: bump package.xml, the wheel follows), whose dependencies are setup.py's
and pinned by requirements.txt, and which installs and imports on its own. Built offline with
the venv's setuptools, from a copy of the sources (a build writes build/ and *.egg-info next to
setup.py, and the tree's build/ is colcon's)."""
import re
import shutil
import subprocess
import sys
import zipfile
from email.parser import Parser
from pathlib import Path
from xml.etree import ElementTree

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ["setup.py", "pyproject.toml", "package.xml", "photon_core", "photon_ros"]
# Extras the development environment installs (microphone needs PortAudio, so it is left out).
PINNED_EXTRAS = {"triton", "weights", "evaluate"}


def package_xml_version(path: Path) -> str:
    return ElementTree.parse(path).getroot().findtext("version").strip()


def copy_sources(dest: Path) -> Path:
    dest.mkdir()
    for name in SOURCES:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, dest / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(src, dest / name)
    return dest


def build_wheel(src: Path, out: Path) -> Path:
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                           "--no-index", "-q", str(src), "-w", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    wheels = list(out.glob("*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


def metadata(wheel: Path):
    with zipfile.ZipFile(wheel) as z:
        name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        return Parser().parsestr(z.read(name).decode())


def pins() -> dict[str, str]:
    found = {}
    for line in (ROOT / "requirements.txt").read_text().splitlines():
        m = re.match(r"^\s*([A-Za-z0-9_.\-]+)==([^\s#;]+)", line)
        if m:
            found[canonicalize_name(m.group(1))] = m.group(2)
    return found


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("wheel")
    return build_wheel(copy_sources(tmp / "src"), tmp / "dist")


def test_wheel_holds_the_engine_and_the_node_code(wheel):
    version = package_xml_version(ROOT / "package.xml")
    assert wheel.name == f"photon_ros-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        top_level = next(z.read(n).decode().split() for n in names if n.endswith("top_level.txt"))
        entry_points = next(z.read(n).decode() for n in names if n.endswith("entry_points.txt"))
    assert sorted(top_level) == ["photon_core", "photon_ros"]
    sources = {p.relative_to(ROOT).as_posix() for pkg in ("photon_core", "photon_ros")
               for p in (ROOT / pkg).rglob("*.py") if "__pycache__" not in p.parts}
    assert sources <= names, sorted(sources - names)
    packaged = {n for n in names if not n.startswith("photon_ros-")}
    assert packaged - sources == {"photon_core/README.md"}      # no tests, caches or build output
    assert not any(n.startswith(("photon_ros/msg/", "photon_ros/srv/")) for n in names)  # colcon's
    assert "photon = photon_core.__main__:main" in entry_points

    meta = metadata(wheel)
    assert meta["Name"] == "photon-ros" and meta["Version"] == version
    assert meta["License"] == ElementTree.parse(ROOT / "package.xml").getroot().findtext("license")


def test_dependencies_are_pinned_by_the_development_environment(wheel):
    pinned = pins()
    requirements = [Requirement(r) for r in metadata(wheel).get_all("Requires-Dist")]
    checked = [r for r in requirements
               if r.marker is None or any(r.marker.evaluate({"extra": e}) for e in PINNED_EXTRAS)]
    assert {canonicalize_name(r.name) for r in checked} >= {"torch", "numpy", "rosbags", "matplotlib"}
    for req in checked:
        name = canonicalize_name(req.name)
        assert name in pinned, f"{req} is not pinned in requirements.txt"
        assert req.specifier.contains(pinned[name], prereleases=True), \
            f"requirements.txt pins {name}=={pinned[name]}, outside {req}"


def test_installed_wheel_imports_from_its_own_folder(wheel, tmp_path):
    target = tmp_path / "site"
    done = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "-q",
                           "--target", str(target), str(wheel)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    # Only the target on the path (not the source tree, not the colcon workspace); the nodes'
    # modules need ROS (rclpy, the generated interfaces), the packages themselves do not.
    check = "import photon_core, photon_ros; print(photon_core.__file__); print(photon_ros.__file__)"
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(target), "HOME": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, env=env,
                         cwd=tmp_path, timeout=300)
    files = out.stdout.split()
    assert out.returncode == 0 and len(files) == 2, out.stderr
    assert all(Path(f).is_relative_to(target) for f in files), files


def test_version_follows_package_xml(tmp_path):
    src = copy_sources(tmp_path / "src")
    xml = src / "package.xml"
    xml.write_text(re.sub(r"<version>[^<]*</version>", "<version>9.8.7</version>", xml.read_text()))
    assert metadata(build_wheel(src, tmp_path / "dist"))["Version"] == "9.8.7"
