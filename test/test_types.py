"""The type checker over photon_core, as configured in pyproject.toml ([tool.mypy]): no errors.

Among what it checks is the model contract: every family's `load` must return a class that meets
photon_core.contracts.VisionModel or SpeechModel. No module is exempt (no ignore_errors override)."""
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_mypy_finds_no_errors_in_photon_core():
    pytest.importorskip("mypy", reason="mypy is pinned in requirements.txt: run scripts/setup.sh")
    out = subprocess.run([sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-2000:]
    assert "Success: no issues found" in out.stdout


def test_mypy_sees_a_family_that_breaks_the_contract(tmp_path):
    """The check above can fail: a family whose load returns a class without `batch` is an error."""
    pytest.importorskip("mypy", reason="mypy is pinned in requirements.txt: run scripts/setup.sh")
    bad = tmp_path / "bad_family.py"
    bad.write_text(
        "from typing import Any\n"
        "from photon_core.registry import Family\n\n\n"
        "class Speech:\n"
        "    model_id = 'x'\n\n"
        "    def transcribe(self, audio: Any, sample_rate: int = 16000) -> dict:\n"
        "        return {}\n\n\n"
        "def load(checkpoint: Any, device: str, dtype: Any, backend: str) -> Speech:\n"
        "    return Speech()\n\n\n"
        "FAMILY = Family(name='bad', skills=frozenset({'transcribe'}), looks_for='', recognise=lambda f: False,\n"
        "                load=load)\n")
    # photon_core is followed with the same options as above, so mypy's cache from that run serves it.
    out = subprocess.run([sys.executable, "-m", "mypy", str(bad)],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 1, out.stdout + out.stderr
    assert 'Argument "load" to "Family" has incompatible type' in out.stdout, out.stdout
