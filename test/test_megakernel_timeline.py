"""The traced build of the megakernel and the timeline analysis (Triton's interpreter, Whisper's
compiled step on tiny random weights; the interpreter's trace counts ticks of a logical clock,
which orders events as they happened, so the trace's order invariants hold as on a GPU)."""
from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # must precede the first import of triton

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from photon_core.megakernel import timeline  # noqa: E402
from photon_core.megakernel.compiler import Tiling  # noqa: E402
from photon_core.megakernel.kernel import linear_k_step  # noqa: E402
from photon_core.models.whisper.decoder_step import WhisperDecoderMegakernel, WhisperDecoderWeights  # noqa: E402


# A script run as its own process (as the device runs it: `python script args`), with the interpreter
# patch the suite's in-process tests get (conftest._patch_triton_language_once_per_launch: the same
# interpreted kernels, a fifth less Python; the timeline's dry run 15 s of CPU without it, 12 s with).
# argv: the test folder, then the script and its arguments.
RUN_PATCHED = ("import runpy, sys; sys.path.insert(0, sys.argv.pop(1)); import conftest; "
               "conftest._patch_triton_language_once_per_launch(); sys.argv = sys.argv[1:]; "
               "runpy.run_path(sys.argv[0], run_name='__main__')")


@pytest.fixture(scope="module")
def traced():
    wt = WhisperDecoderWeights.random(64, 2, 1, 96, n_ctx=16, seed=3)
    step = WhisperDecoderMegakernel(wt, 2, 16, 8, Tiling(32, 64, 16, 2, 2), advance=False)
    g = torch.Generator().manual_seed(0)
    step.set_cross_kv([(torch.randn(2, 2, 8, 32, generator=g), torch.randn(2, 2, 8, 32, generator=g))])
    step.set_step([5, 7], [3, 6])
    saved = step.state.clone()
    step.launch()
    plain = step.view("logits").clone()
    step.state.copy_(saved)
    trace = step.kernel.traced_launch()
    step.kernel.raise_on_error()
    return step, trace, plain


def test_the_traced_build_computes_what_the_plain_one_does(traced):
    step, _, plain = traced
    assert torch.equal(step.view("logits"), plain)


def test_every_task_has_its_row_in_order(traced):
    step, trace, _ = traced
    graph = step.graph
    col = {name: trace[:, i].numpy() for i, name in enumerate(timeline.COLUMNS)}
    assert trace.shape == (len(graph.tasks), len(timeline.COLUMNS))
    assert (col["claimed"] < col["waited"]).all() and (col["waited"] < col["ran"]).all()
    assert (col["ran"] < col["released"]).all() and (col["status"] == 0).all()
    assert set(col["program"]) <= set(range(step.kernel.num_programs))
    # A task sees its inputs only after every producer finished: its wait ended after their bodies.
    signalers = {}
    for i, t in enumerate(graph.tasks):
        signalers.setdefault(t.signal, []).append(i)
    for i, t in enumerate(graph.tasks):
        for counter, _ in t.waits:
            assert all(col["waited"][i] > col["ran"][j] for j in signalers[counter]), (t.name, counter)


def test_the_analysis_accounts_for_every_task(traced):
    step, trace, _ = traced
    graph = step.graph
    a = timeline.analyse(graph, trace, linear_k_step(step.kernel.meta))
    lv = timeline.levels(graph)
    assert a["tasks"] == len(graph.tasks) and a["levels"] == max(lv) + 1
    assert sum(r["tasks"] for r in a["level_rows"]) == len(graph.tasks)
    assert sum(r["tasks"] for r in a["program_rows"]) == len(graph.tasks)
    assert a["linear_step"]["count"] == sum(t.op in (2, 7) for t in graph.tasks) > 0
    # Level 0 waits on nothing; every later task waits on a task one level down.
    assert all(not graph.tasks[i].waits for i, level in enumerate(lv) if level == 0)
    assert a["failed"] == 0
    text = timeline.report("whisper", a, unit="ticks")
    assert "levels" in text and "linear K step" in text


def test_a_trace_missing_tasks_is_refused(traced):
    step, trace, _ = traced
    cut = trace.clone()
    cut[3] = 0
    with pytest.raises(ValueError, match="no trace row"):
        timeline.analyse(step.graph, cut, 16)
    with pytest.raises(ValueError, match="does not match"):
        timeline.analyse(step.graph, np.zeros((2, 7)), 16)


def test_the_prepared_gpu_run_runs_whole_on_the_cpu(tmp_path):
    # bench/gpu_timeline.py is the next GPU session's first call: its dry run (tiny shapes, the
    # interpreter, the peers' code on the CPU) must go through every part without a failure. --iters 0:
    # every row launched and checked once, no replay after it and no warm-up before a trace (the
    # replays' path is test_gpu_prepared_runs' measure tests' and the peers').
    import json
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    script = root / "bench" / "gpu_timeline.py"
    r = subprocess.run([sys.executable, "-c", RUN_PATCHED, str(root / "test"), str(script), "--dry-run", "--iters", "0",
                        "--out", str(tmp_path)], capture_output=True, text=True, timeout=600)
    out = json.loads((tmp_path / "gpu_timeline.json").read_text())
    assert r.returncode == 0 and not out.get("failures"), (r.stdout[-3000:], r.stderr[-3000:])
    assert set(out["peers"]) == {"peer phi B1", "peer whisper B1"}
    rows = {(t["config"], t["variant"]) for t in out["timing"]}
    assert ("moondream2 B1 prod", "plain") in rows and ("whisper-tiny.en B1 prod", "dot64+pipe4") in rows
    for c in ("moondream2 B1 prod", "whisper-tiny.en B1 prod"):
        assert (c, "per-op engine") in rows and (c, "per-op engine chained") in rows
    # build variants differ from the plain build by rounding only; the per-op engine's linears take
    # bf16 inputs with the bf16 weights (as transformers' do), the megakernel's fp32 ones
    assert all(t["rel_err_vs_plain"] < (2e-2 if t["variant"].startswith("per-op") else 1e-4) for t in out["timing"])
    assert {c: e["how"] for c, e in out["engine_choice"].items()} == {
        "moondream2 B1 prod": "measured", "whisper-tiny.en B1 prod": "measured"}
    assert set(out["timelines"]) == {"moondream2 B1 prod.plain", "whisper-tiny.en B1 prod.plain"}
    # what it leaves for the device tool to bring back: the results, whole (no side file left)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpu_timeline.json", "traces.npz"]
    # floors at fp32 caches' bytes and a bandwidth it names (no device known here: the default, said so)
    assert {t["kv_dtype"] for t in out["timing"]} == {"float32"}
    assert out["machine"]["hbm_tbps"] == 4.8 and "UNKNOWN" in out["machine"]["hbm_source"]
