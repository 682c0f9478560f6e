"""bench/gpu_bench.py and bench/gpu_proof.py cannot time anything here, but their CPU-side plumbing
must work: the dry runs build every path (eager, per-op Triton, megakernel) at tiny shapes under the
interpreter and check each against the references, and the proof runs each of its six parts."""
import os

os.environ["TRITON_INTERPRET"] = "1"  # must precede the first import of triton

import importlib.util  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

BENCH = Path(__file__).resolve().parents[1] / "bench"


def _load(name: str = "gpu_bench"):
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod      # dataclasses look their module up while the class is built
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
    with pytest.raises(SystemExit, match="CUDA"):
        _load("gpu_proof").main([])


def test_proof_dry_run_runs_every_part(tmp_path):
    """The GPU proof's dry run: every part runs and passes, for every family, and what it wrote is
    what it returned."""
    out = _load("gpu_proof").main(["--dry-run", "--json", str(tmp_path / "p.json")])
    assert out["passed"], out["checks"]["failed"]
    assert json.loads((tmp_path / "p.json").read_text())["checks"] == out["checks"]
    parts = out["parts"]
    assert list(parts) == ["steps", "stress", "poison", "control", "liveness", "rounds", "timing"]
    assert not out.get("skipped")
    steps = parts["steps"]["results"]
    assert {(r["family"], r["batch"], r["dtype"]) for r in steps} >= {
        ("whisper-tiny.en", 1, "fp32"), ("whisper-tiny.en", 2, "bf16"), ("whisper-tiny.en/split", 1, "bf16"),
        ("moondream2", 1, "fp32"), ("moondream2", 2, "bf16")}
    for r in steps:
        assert r["steps"] == out["sizes"]["steps"] and max(r["max_err"].values()) < 1e-4
        assert r["exact"] + r["tolerated"] == r["picks"] > 0
    assert any("text" in r["variants"] for r in steps)       # Moondream's pruned (caption/query) graph too
    # The step-graph families (GraphFamily): steps at both batches, poisoning, timing where it runs.
    graph_fams = {"qwen3-asr-0.6b", "qwen3.5-0.8b", "gemma4-e2b"} | (
        {"moondream3"} if importlib.util.find_spec("photon_core.models.moondream3.decoder_step") else set())
    assert {(r["family"], r["batch"]) for r in steps} >= {(f, b) for f in graph_fams for b in (1, 2)}
    assert {r["family"] for r in parts["poison"]["results"]} >= graph_fams - {"qwen3-asr-0.6b"}
    assert {r["family"] for r in parts["timing"]["results"]} >= {"qwen3.5-0.8b", "gemma4-e2b"}
    for r in parts["stress"]["results"]:
        assert [s["programs"] for s in r["runs"]] == [1, 3]
        assert all(s["differing"] == 0 and s["launches"] == out["sizes"]["launches"] for s in r["runs"])
    assert all(r["run"]["differing"] == 0 and not r["unwritten"] for r in parts["poison"]["results"])
    (control,) = parts["control"]["results"]
    # The checker rejects the dropped wait; under the interpreter the race cannot show in place, but
    # the task moved before its producer must be caught by the same stress.
    assert "race" in control["checker"] and not control["race_can_show"]
    assert control["forced"]["differing"] > 0
    (live,) = parts["liveness"]["results"]
    assert live["ok"] and "gave up waiting" in live["message"]
    # The production decode loop: host-driven, replay per token and rounds give the same tokens.
    rounds = parts["rounds"]["results"]
    # Moondream 2's step is fed embeddings: host-driven vs rounds whose device ops embed the token,
    # and its detect/point rounds captured vs launched eagerly.
    objects = [r for r in rounds if r.get("objects")]
    assert [(r["family"], r["same"]) for r in objects] == [("moondream2", True)] and objects[0]["objects_started"] > 0
    rounds = [r for r in rounds if not r.get("objects")]
    assert {r["family"] for r in rounds} == {"whisper-tiny.en", "qwen3-asr-0.6b", "moondream2"}
    assert all(r["same"] and r["tokens"] == out["sizes"]["round_tokens"] and r["rounds_read"] > 0 for r in rounds)
    assert all(r["ways"] == (["host", "rounds"] if r["family"] == "moondream2" else ["host", "replay", "rounds", "pick"])
               for r in rounds)
    timing = parts["timing"]["results"]
    assert all(r["us"] > 0 and r["x_floor"] > 0 for r in timing)
    assert any("x_perop" in r for r in timing) and any("x_batch1" in r for r in timing)


def test_proof_fails_loudly(monkeypatch, tmp_path):
    """A check that fails makes the exit status 1 and names the failure."""
    proof = _load("gpu_proof")
    monkeypatch.setattr(proof, "TOL", -1.0)      # no error is ever small enough
    argv = ["--dry-run", "--parts", "steps", "--families", "whisper-tiny.en", "--steps", "1",
            "--json", str(tmp_path / "p.json")]
    assert proof.cli(argv) == 1
    failed = json.loads((tmp_path / "p.json").read_text())["checks"]["failed"]
    assert failed and all(f.startswith("steps whisper-tiny.en") for f in failed)
