"""bench/gpu_bench.py and the GPU proof (bench/gpu_proof.py over photon_core.gpu_proof) cannot
time anything here, but their CPU-side plumbing must work: the dry runs build every path (eager,
per-op Triton, megakernel) at tiny shapes under the interpreter and check each against the
references; the proof's two GPU calls (profiles core and others) run every part between them, write
their results after every configuration, and record the launches their compile pool warms."""
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
        _load("gpu_proof").main(["--profile", "core"])


def _steps_ok(out: dict, steps: list[dict]) -> None:
    for r in steps:
        assert r["steps"] == out["sizes"]["steps"] and max(r["max_err"].values()) < 1e-4
        assert r["exact"] + r["tolerated"] == r["picks"] > 0


def test_proof_core_dry_run(tmp_path):
    """The first GPU call's verdicts, on the interpreter: Whisper tiny.en's and Moondream 2's steps
    at both batches and both weight dtypes, stress, poisoning, the positive control and timing (with
    the per-op graph and batch ratios); what it wrote is what it returned."""
    out = _load("gpu_proof").main(["--dry-run", "--profile", "core", "--json", str(tmp_path / "p.json")])
    assert out["passed"], out["checks"]["failed"]
    assert json.loads((tmp_path / "p.json").read_text())["checks"] == out["checks"]
    parts = out["parts"]
    assert list(parts) == ["steps", "timing", "stress", "poison", "control"] and not out.get("skipped")
    steps = parts["steps"]["results"]
    assert {(r["family"], r["batch"], r["dtype"]) for r in steps} == {
        ("whisper-tiny.en", 1, "fp32"), ("whisper-tiny.en", 2, "bf16"), ("moondream2", 1, "fp32"),
        ("moondream2", 2, "bf16")}
    _steps_ok(out, steps)
    assert any("text" in r["variants"] for r in steps)       # Moondream's pruned (caption/query) graph too
    for r in parts["stress"]["results"]:
        assert [s["programs"] for s in r["runs"]] == [1, 3]
        assert all(s["differing"] == 0 and s["launches"] == out["sizes"]["launches"] for s in r["runs"])
    assert {r["family"] for r in parts["poison"]["results"]} == {"whisper-tiny.en", "moondream2"}
    assert all(r["run"]["differing"] == 0 and not r["unwritten"] for r in parts["poison"]["results"])
    (control,) = parts["control"]["results"]
    # The checker rejects the dropped wait; under the interpreter the race cannot show in place, but
    # the task moved before its producer must be caught by the same stress.
    assert control["family"] == "whisper-tiny.en" and "race" in control["checker"] and not control["race_can_show"]
    assert control["forced"]["differing"] > 0
    timing = parts["timing"]["results"]
    assert {(r["family"], r["batch"]) for r in timing} == {(f, b) for f in ("whisper-tiny.en", "moondream2")
                                                          for b in (1, 2)}
    assert all(r["us"] > 0 and r["x_floor"] > 0 for r in timing)
    assert all("x_perop" in r for r in timing if r["family"] == "whisper-tiny.en")
    assert all("x_batch1" in r for r in timing if r["batch"] == 2)


def test_proof_others_dry_run(tmp_path):
    """The second GPU call on the interpreter: the step-graph families (GraphFamily) and Whisper's
    GPU tiling, the production decode loop three ways, liveness."""
    out = _load("gpu_proof").main(["--dry-run", "--profile", "others", "--json", str(tmp_path / "p.json")])
    assert out["passed"], out["checks"]["failed"]
    parts = out["parts"]
    assert list(parts) == ["steps", "timing", "poison", "liveness", "rounds"] and not out.get("skipped")
    graph_fams = {"qwen3-asr-0.6b", "qwen3.5-0.8b", "gemma4-e2b"} | (
        {"moondream3"} if importlib.util.find_spec("photon_core.models.moondream3.decoder_step") else set())
    steps = parts["steps"]["results"]
    assert {(r["family"], r["batch"]) for r in steps} == {(f, 1) for f in graph_fams | {"whisper-tiny.en/split"}}
    _steps_ok(out, steps)
    assert {r["family"] for r in parts["poison"]["results"]} == graph_fams - {"qwen3-asr-0.6b"}
    assert all(r["run"]["differing"] == 0 and not r["unwritten"] for r in parts["poison"]["results"])
    assert {r["family"] for r in parts["timing"]["results"]} == {"qwen3.5-0.8b", "gemma4-e2b"}
    (live,) = parts["liveness"]["results"]
    assert live["ok"] and "gave up waiting" in live["message"]
    # The production decode loop: host-driven, replay per token and rounds give the same tokens;
    # Moondream 2's step is fed embeddings: host-driven vs rounds whose device ops embed the token,
    # and its detect/point rounds captured vs launched eagerly.
    rounds = parts["rounds"]["results"]
    objects = [r for r in rounds if r.get("objects")]
    assert [(r["family"], r["same"]) for r in objects] == [("moondream2", True)] and objects[0]["objects_started"] > 0
    rounds = [r for r in rounds if not r.get("objects")]
    assert {r["family"] for r in rounds} == {"whisper-tiny.en", "qwen3-asr-0.6b", "moondream2"}
    assert all(r["same"] and r["tokens"] == out["sizes"]["round_tokens"] and r["rounds_read"] > 0 for r in rounds)
    assert all(r["ways"] == (["host", "rounds"] if r["family"] == "moondream2" else ["host", "replay", "rounds", "pick"])
               for r in rounds)
    # Each family's rounds ran in a child process of its own (a sticky CUDA error ends that child
    # alone), its results file and log in a temporary folder (not beside the parent's: the device
    # tool brings back at most 8 files; test_gpu_prepared_runs).
    kids = out["children"]
    families = ("moondream2", "qwen3-asr-0.6b", "whisper-tiny.en")
    assert sorted(c["label"] for c in kids) == [f"rounds {f}" for f in families]
    assert all(c["exit"] == 0 and not c["killed"] and Path(c["log"]).exists() for c in kids)
    assert out["plan"]["total"] <= 240


def test_proof_fails_loudly(monkeypatch, tmp_path):
    """A check that fails makes the exit status 1 and names the failure."""
    from photon_core.gpu_proof import checks
    proof = _load("gpu_proof")
    monkeypatch.setattr(checks, "NOISE_RATIO", -1.0)      # no error is ever small enough against float64
    argv = ["--dry-run", "--profile", "core", "--parts", "steps", "--families", "whisper-tiny.en", "--steps", "1",
            "--json", str(tmp_path / "p.json")]
    assert proof.cli(argv) == 1
    failed = json.loads((tmp_path / "p.json").read_text())["checks"]["failed"]
    assert failed and all(f.startswith("steps whisper-tiny.en") for f in failed)


def test_a_killed_proof_keeps_what_it_finished(monkeypatch, tmp_path):
    """Results are written after every configuration: a run stopped in its second configuration
    (KeyboardInterrupt, as a kill would) leaves the first one's verdict in the results file."""
    from photon_core.gpu_proof import steps
    proof = _load("gpu_proof")
    real, calls = steps.prove_steps, []

    def second_is_killed(*a, **k):
        calls.append(a[1:])
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*a, **k)
    monkeypatch.setattr(steps, "prove_steps", second_is_killed)
    path = tmp_path / "p.json"
    with pytest.raises(KeyboardInterrupt):
        proof.main(["--dry-run", "--profile", "core", "--parts", "steps", "--families", "whisper-tiny.en",
                    "--steps", "1", "--json", str(path)])
    kept = json.loads(path.read_text())
    (first,) = kept["parts"]["steps"]["results"]
    assert (first["family"], first["batch"]) == ("whisper-tiny.en", 1) and kept["passed"]


def test_prewarm_records_the_launch_it_compiles():
    """The compile pool's job for a kernel is the launch Megakernel.launch makes, recorded without
    launching: the same arguments with tensors by dtype (the weights in the dtype asked for), the
    task table by its name, and the real kernel put back afterwards."""
    import torch

    from photon_core.megakernel import kernel as mk
    from photon_core.megakernel.compiler import Tiling
    from photon_core.gpu_proof.prewarm import launch_args, warmup_spec
    from photon_core.models.whisper.decoder_step import WhisperDecoderMegakernel, WhisperDecoderWeights
    wt = WhisperDecoderWeights.random(64, 2, 1, 96, 16, seed=0)
    step = WhisperDecoderMegakernel(wt, 2, 16, 8, Tiling(64, 64, 16, 2, 1))
    jitted = mk._megakernel
    args, kwargs = launch_args(step.kernel)
    assert mk._megakernel is jitted and not step.kernel.ctrl.any()
    assert args[1] == len(step.graph.tasks) and args[4] is step.kernel.weights and args[7] == 2
    spec = warmup_spec(step.kernel, torch.bfloat16)
    assert spec[0][4] == ("tensor", "bfloat16") and spec[0][5] == ("tensor", "float32")
    assert spec[0][1] == ("value", len(step.graph.tasks))
    named = dict(spec[1])
    assert named["RUN_TASK"] == ("jit", "step_tasks") and named["num_warps"] == ("value", kwargs["num_warps"])
    assert {k: v for k, (kind, v) in spec[1] if kind == "value"} == {k: v for k, v in kwargs.items()
                                                                     if k != "RUN_TASK"}
    # a streaming build's expert step is in bytes of an expert row: its elements follow the arena's dtype
    step.kernel.variant = mk.KernelVariant(wide=512, aligned=True)
    loops = set()
    for dt, size in ((torch.bfloat16, 2), (torch.float32, 4)):
        want = mk.expert_loop(step.kernel.variant, step.kernel.meta["BLOCK_M"], size, step.kernel.tuning)
        assert dict(warmup_spec(step.kernel, dt)[1])["XLOOP"] == ("value", want) and want > 0
        loops.add(want)
    assert len(loops) == 2


def test_prewarm_pool_reports_each_job():
    """The compile pool's bookkeeping (worker processes, spawned): every job's result or error is
    reported once, and a failed job does not stop the others."""
    from photon_core.gpu_proof.prewarm import Prewarm
    pool = Prewarm(workers=1)
    try:
        pool.run("ok", float, "1.25")
        pool.run("bad", float, "not a number")
        done = {r["label"]: r for r in pool.wait(120)}
        assert pool.wait(0) == []      # reported once
    finally:
        pool.close()
    assert done["ok"]["compile_s"] == 1.2 and done["ok"]["error"] is None
    assert done["bad"]["compile_s"] is None and "ValueError" in done["bad"]["error"]


def test_closing_the_prewarm_pool_ends_the_compiles_still_running():
    """At its exit Python waited for the pool's running jobs: a build skipped for the budget kept a
    GPU run's process past its results. close() ends them."""
    import time

    from photon_core.gpu_proof.prewarm import Prewarm
    pool = Prewarm(workers=1)
    pool.run("long", time.sleep, 60)
    pool.run("queued", time.sleep, 60)
    deadline = time.monotonic() + 60
    while not pool.pool._processes and time.monotonic() < deadline:   # the worker started
        time.sleep(0.05)
    workers = list(pool.pool._processes.values())
    time.sleep(1.0)                                                     # the first job handed to it
    pool.close()
    for worker in workers:
        worker.join(10)
        assert not worker.is_alive()
