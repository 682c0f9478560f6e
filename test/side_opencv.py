"""photon_ros.image_conversions under OpenCV 4.6, the OpenCV of Ubuntu's apt that ROS robots
have, beside the venv's current release.

`side_install()` puts opencv-python-headless 4.6 and a numpy 1.x it was built for (the venv's
numpy 2 cannot load it) in ~/.cache/photon/opencv-4.6 with `pip install --target`, once; the
venv is not touched. `decode_in_side_opencv(cases)` runs this file in a subprocess with that
folder first on PYTHONPATH, so the module imports that cv2 and numpy; no ROS is imported there
(image_conversions needs none at import). Cases and results cross as pickled plain Python
values, as numpy arrays do not unpickle across numpy 1 and 2."""
from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path

from side_install import CACHE
from side_install import side_install as _install

SIDE_DIR = CACHE / "opencv-4.6"
REQUIREMENTS = ("opencv-python-headless==4.6.*", "numpy<2")
REPO = Path(__file__).resolve().parent.parent


def side_install() -> Path:
    """The side install's folder, installed by pip on first use (side_install.side_install). Raises
    RuntimeError with pip's message when pip cannot install it (no index reachable)."""
    return _install(SIDE_DIR.name, REQUIREMENTS, pip_args=("--only-binary=:all:",))


def decode_in_side_opencv(cases: list[dict]) -> dict:
    """Each case ({"kind": "compressed", "format", "data"} or {"kind": "raw", <Image fields>})
    converted by photon_ros.image_conversions under the side OpenCV. Returns {"cv2": version,
    "numpy": version, "ros_imported": [...], "results": [(shape, bytes) or ("error", message)]}."""
    folder = side_install()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(folder), str(REPO), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, __file__], input=pickle.dumps(cases), env=env,
                          capture_output=True, timeout=120)
    if done.returncode != 0:
        raise RuntimeError(f"decoding under the side OpenCV failed:\n{done.stderr.decode()[-3000:]}")
    return pickle.loads(done.stdout)


def _main() -> None:
    from types import SimpleNamespace

    import cv2
    import numpy

    from photon_ros.image_conversions import compressed_to_rgb, image_to_rgb

    cases = pickle.loads(sys.stdin.buffer.read())
    results = []
    for case in cases:
        fields = {key: value for key, value in case.items() if key != "kind"}
        convert = compressed_to_rgb if case["kind"] == "compressed" else image_to_rgb
        try:
            out = convert(SimpleNamespace(**fields))
            results.append((tuple(out.shape), numpy.ascontiguousarray(out).tobytes()))
        except ValueError as err:
            results.append(("error", str(err)))
    ros = sorted(name for name in sys.modules if name.split(".")[0] in ("rclpy", "sensor_msgs"))
    sys.stdout.buffer.write(pickle.dumps({
        "cv2": cv2.__version__, "cv2_file": cv2.__file__, "numpy": numpy.__version__,
        "ros_imported": ros, "results": results}))


if __name__ == "__main__":
    _main()
