"""The GPU proof's time plan and its isolation of parts (issue 37, item 4). Each profile is one
call of the device tool: its predicted seconds, from what the first GPU run measured
(photon_core.gpu_proof.costs), must fit the call with every part planned; the stress sizes itself
from its first launch as the plan predicts. Each family's device rounds run in a child process:
a child that crashes or hangs fails its own check only, and the GPU lock keeps timing off a GPU
that others use. No GPU and no Triton launch here."""
import os

os.environ["TRITON_INTERPRET"] = "1"  # must precede the first import of triton (the families import it)

import importlib.util  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from dataclasses import replace  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from photon_core.gpu_proof import costs  # noqa: E402
from photon_core.gpu_proof.checks import GPU_SIZES, Checks, launch_plan  # noqa: E402

BENCH = Path(__file__).resolve().parents[1] / "bench"


def _proof():
    if "gpu_proof" not in sys.modules:
        spec = importlib.util.spec_from_file_location("gpu_proof", BENCH / "gpu_proof.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules["gpu_proof"] = mod
        spec.loader.exec_module(mod)
    return sys.modules["gpu_proof"]


@pytest.fixture(scope="module")
def works():
    proof = _proof()
    return {p: proof.gpu_work(p) for p in ("core", "others")}


def test_each_profile_fits_its_call_with_every_part_planned(works):
    from photon_core.gpu_proof.plan import predict
    proof = _proof()
    want = {"core": ["steps", "timing", "stress", "poison", "control"],
            "others": ["steps", "timing", "stress", "poison", "liveness", "rounds"]}
    for profile, work in works.items():
        pred = predict(work, GPU_SIZES)
        assert pred.total <= proof.PLAN_LIMIT_S == 240, (profile, pred.seconds)
        assert work.parts == want[profile]
        assert [k for k in pred.seconds if k in want[profile]] == want[profile]
        for part in work.parts:           # every configuration of every part has its own line
            n = sum(1 for c in work.configs if c[0] == part)
            assert len(pred.detail.get(part, [])) >= (n if part not in ("liveness", "rounds") else 1), part
    # Timing is early: a kill in the parts after it still leaves its times.
    assert works["core"].parts.index("timing") == 1
    # Rounds run in children (one per family), not in the parent, which does not build for them.
    others = works["others"]
    assert set(others.children) == {"qwen3-asr-0.6b", "whisper-tiny.en", "moondream2"}
    assert not any(f == "moondream2" for f, _, _ in others.builds)
    # Core: both batches and weight dtypes of both families in steps and timing; the stress and its
    # positive control at every program count.
    core = works["core"]
    assert {(f, b, dt) for p, f, b, dt in core.configs if p == "timing"} == {
        (f, b, dt) for f in ("whisper-tiny.en", "moondream2") for b in (1, 8) for dt in ("fp32", "bf16")}
    assert {(f, b) for p, f, b, _ in core.configs if p == "control"} == {("whisper-tiny.en", 1), ("whisper-tiny.en", 8)}
    stress = [d for d in predict(core, GPU_SIZES).detail["stress"] if "programs" in d]
    assert len(stress) == 4 * 4


def test_the_plan_can_fail(works):
    """The sizes of the first run (time caps of 3 and 10 s, at least 10 launches) do not fit core's
    call, and a configuration nobody measured is an error, not a zero."""
    from photon_core.gpu_proof.plan import predict
    old = replace(GPU_SIZES, min_launches=10, cap_few_s=3.0, cap_many_s=10.0)
    assert predict(works["core"], old).total > 240
    work = works["others"]
    unmeasured = replace(work, configs=work.configs + [("poison", "gemma4-e2b", 8, "bf16")])
    with pytest.raises(KeyError):
        predict(unmeasured, GPU_SIZES)


def test_stress_sizes_itself_as_planned():
    # Moondream 2 B8: 3.1 s a launch with 1 program -> a plain and a poisoned launch; 35 ms at
    # #SMs -> what 4 s hold; Whisper tiny.en at #SMs -> the full 1000.
    assert launch_plan(costs.STRESS_LAUNCH_S[("moondream2", 8, 1)], 1, 132, GPU_SIZES) == (2, True)
    assert launch_plan(costs.STRESS_LAUNCH_S[("moondream2", 8, 132)], 132, 132, GPU_SIZES) == (114, True)
    assert launch_plan(costs.STRESS_LAUNCH_S[("whisper-tiny.en", 1, 132)], 132, 132, GPU_SIZES) == (1000, False)


def test_plan_cli_prints_the_table(capsys):
    out = _proof().main(["--plan", "--profile", "core"])
    text = capsys.readouterr().out
    assert out["passed"] and out["plan"]["total"] <= 240
    for part in ("start", "build", "compiles", "steps", "timing", "stress", "poison", "control", "total"):
        assert f"\n  {part} " in text, part
    assert costs.RUN in text and "moondream2 B8 1 programs: 2 launches" in text


# ---------------------------------------------------------------------------------------------------
# Children and the GPU lock


def _child(tmp_path, label: str, code: str, timeout_s: float = 60.0):
    from photon_core.gpu_proof.children import Child
    j = tmp_path / f"{label}.json"
    return Child(label, [sys.executable, "-c", code.replace("JSON", str(j))], j, tmp_path / f"{label}.log",
                 timeout_s)


def test_a_child_that_dies_fails_only_its_own_check(tmp_path):
    """Three rounds children: one passes, one dies (as a process with a sticky CUDA error would,
    or one killed by the driver), one hangs past its timeout. The parent keeps the first one's
    results and checks, and fails one check for each of the others, naming it."""
    from photon_core.gpu_proof.children import Children, merge
    ok = ('import json; json.dump({"parts": {"rounds": {"results": [{"family": "a", "same": True}]}}, '
          '"checks": {"passed": 2, "failed": []}, "compiles": [{"label": "x", "compile_s": 1.0}]}, '
          'open("JSON", "w")); print("rounds a: tokens identical")')
    dies = 'import os; print("torch.AcceleratorError: CUDA error: an illegal memory access", flush=True); os.abort()'
    hangs = 'import time; time.sleep(60)'
    kids = [_child(tmp_path, "rounds a", ok), _child(tmp_path, "rounds b", dies),
            _child(tmp_path, "rounds c", hangs, timeout_s=2.0)]
    runner = Children(kids, parallel=True, lock_path=str(tmp_path / "lock"))
    runner.start()
    runner.wait(30.0)
    out, checks = {"parts": {}}, Checks()
    logs = {c.label: merge(out, checks, c, "rounds") for c in kids}
    assert out["parts"]["rounds"]["results"] == [{"family": "a", "same": True}]
    assert checks.passed == 2 and len(checks.failed) == 2
    assert checks.failed[0].startswith("rounds b (child process): exit status -6")
    assert "illegal memory" in checks.failed[0]
    assert checks.failed[1].startswith("rounds c (child process): killed after 2 s")
    assert logs["rounds a"] == ["rounds a: tokens identical"]
    assert [c["exit"] for c in out["children"]] == [0, -6, kids[2].rc] and out["children"][2]["killed"]
    assert out["compiles"][0]["label"] == "x (child rounds a)"


def test_the_gpu_lock_waits_for_the_liveness_child(tmp_path):
    """While `hold` is true (the liveness child running) the children's runner holds the lock: a
    child's launches, or the parent's timing, wait for it; then they take turns."""
    from photon_core.gpu_proof.children import Children, gpu_lock
    t0 = time.time()
    runner = Children([_child(tmp_path, "rounds a", "pass")], parallel=True, lock_path=str(tmp_path / "lock"),
                      hold=lambda: time.time() - t0 < 1.0)
    runner.start()
    # (a lock never given back is told by a generous wait, not by timing a busy machine's hand-over)
    with gpu_lock(str(tmp_path / "lock"), wait_s=60.0) as held:
        waited = time.time() - t0
        inside = threading.Event()

        def other() -> None:
            with gpu_lock(str(tmp_path / "lock")):
                inside.set()
        th = threading.Thread(target=other)
        th.start()
        time.sleep(0.3)
        assert not inside.is_set()          # one holder at a time
    th.join(60.0)
    assert held and inside.is_set() and waited >= 0.9
    runner.wait(60.0)


def test_a_broken_cuda_context_skips_the_rest_of_its_process(monkeypatch):
    """After a configuration leaves the process's CUDA context unusable, the next ones are
    skipped with the reason (one failed check, not a cascade of the same error)."""
    from photon_core.gpu_proof import checks
    ctx = checks.Ctx(None, True, GPU_SIZES, 132)
    monkeypatch.setattr(checks, "cuda_usable", lambda: False)

    def crash():
        raise RuntimeError("CUDA error: an illegal memory access was encountered")
    assert checks.guarded(ctx, "rounds whisper-tiny.en B1", crash) is None
    assert checks.guarded(ctx, "rounds moondream2 B1", lambda: 1) is None
    assert len(ctx.checks.failed) == 1 and ctx.broken == "rounds whisper-tiny.en B1"
    assert ctx.out["skipped"] == ["rounds moondream2 B1 SKIPPED: this process's CUDA context is unusable since "
                                  "rounds whisper-tiny.en B1"]
