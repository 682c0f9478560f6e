"""bench/gpu_proof.py as a module for tests (its families' tiny shapes, the dry run's tilings): loaded
once per process under the name `gpu_proof`, with bench/ on sys.path for its own imports."""
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parents[1] / "bench"


def gpu_proof() -> ModuleType:
    if "gpu_proof" not in sys.modules:
        if str(BENCH) not in sys.path:
            sys.path.insert(0, str(BENCH))
        spec = importlib.util.spec_from_file_location("gpu_proof", BENCH / "gpu_proof.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules["gpu_proof"] = mod
        spec.loader.exec_module(mod)
    return sys.modules["gpu_proof"]
