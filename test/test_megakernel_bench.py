"""bench/gpu_bench.py cannot time anything here, but its CPU-side plumbing must work: the dry run
builds every path (eager, per-op Triton, megakernel) at tiny shapes under the interpreter and checks
each against the reference step."""
import os

os.environ["TRITON_INTERPRET"] = "1"  # must precede the first import of triton

import importlib.util  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

BENCH = Path(__file__).resolve().parents[1] / "bench" / "gpu_bench.py"


def _load():
    spec = importlib.util.spec_from_file_location("gpu_bench", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_dry_run_checks_every_path(tmp_path):
    out = _load().main(["--dry-run", "--json", str(tmp_path / "r.json")])
    assert (tmp_path / "r.json").exists()
    assert all(r["rel_err"] < 1e-4 for r in out["ops"])
    (step,) = out["steps"]
    assert step["megakernel_same_argmax"] and step["perop_same_argmax"]
    assert step["megakernel_rel_err"] < 1e-4 and step["perop_rel_err"] < 1e-4
    assert step["megakernel_bf16_same_argmax"] and step["megakernel_bf16_rel_err"] < 2e-2
    for path in ("eager", "perop_triton_graph", "megakernel", "megakernel_graph", "megakernel_bf16_graph"):
        assert step[path]["us"] > 0


def test_refuses_to_time_without_a_gpu(monkeypatch):
    import torch
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(SystemExit, match="CUDA"):
        _load().main([])
