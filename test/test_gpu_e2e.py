"""The end-to-end benchmark (bench/gpu_e2e.py, issue 39) on the CPU: its phase clock, its plan, and
its dry run (tiny shapes, every family and every skill on its smaller input, every phase timed, the
peers' own code run on the CPU).
No GPU here; the dry run uses the reference backend (the megakernel path needs Triton's
interpreter, minutes a family)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import e2e_plan as plan  # noqa: E402
from e2e_family import Task  # noqa: E402
from e2e_phases import PHASES, Clock, by_length, no_sync  # noqa: E402

# The public Moondream reference, as the other reference tests find it (its peer is skipped without it).
REF = os.environ.get("MOONDREAM_REF_SRC")


# ------------------------------------------------------------------------------------ the clock


class _Model:
    def encode(self, x):
        return self.inner(x)

    def inner(self, x):
        return x

    def forward(self, x):   # a decoder: prefill with a long input, a step with one position
        return x


class _Sub(_Model):
    pass


def test_clock_counts_outer_calls_classifies_and_removes_its_hooks():
    import torch
    mod = types.SimpleNamespace(crop=lambda x: x)
    m = _Sub()
    c = Clock(no_sync)
    c.add(mod, "crop", "preprocess")
    c.add(_Sub, "encode", "encoder")
    c.add(_Sub, "inner", "encoder")            # called inside encode: not counted twice
    c.add(m, "forward", classify=by_length("prefill", None, arg=0))
    lin = torch.nn.Linear(2, 2)
    c.add(lin, None, "encoder")
    with c.installed():
        mod.crop(1)
        m.encode(1)
        m.forward(torch.zeros(1, 5))           # prefill
        m.forward(torch.zeros(1, 1))           # a step: not counted
        lin(torch.zeros(1, 2))
        assert m.inner(3) == 3
    phases = [e.phase for e in c.events]
    assert phases == ["preprocess", "encoder", "prefill", "encoder", "encoder"]
    # every hook gone: the class finds its own method again, the instance and module theirs
    assert "encode" not in _Sub.__dict__ and "inner" not in _Sub.__dict__
    assert "forward" not in vars(m) and not lin._forward_hooks and not lin._forward_pre_hooks
    assert mod.crop(2) == 2
    s = c.summary(c.events[0].start, c.events[-1].end + 0.5)
    assert set(s["phases"]) == set(PHASES)
    assert s["phases"]["decode"] >= 0.5 - 1e-3                 # the rest of the whole
    assert s["ttft"] == pytest.approx(c.events[2].end - c.events[0].start)   # the last prefill's end


def test_clock_first_token_hook_wins_over_the_prefill():
    c = Clock(no_sync)
    obj = types.SimpleNamespace(prefill=lambda: None, step=lambda: None)
    c.add(obj, "prefill", "prefill")
    c.add(obj, "step", first_token=True)
    with c.installed():
        obj.prefill()
        obj.step()
        obj.step()
    marks = [e for e in c.events if e.first_token]
    s = c.summary(c.events[0].start, c.events[-1].end)
    assert len(marks) == 2 and s["ttft"] == pytest.approx(marks[0].end - c.events[0].start)
    with pytest.raises(ValueError):
        c.add(obj, "step", "nonsense")


# ------------------------------------------------------------------------------------ the plan


def test_plan_orders_levels_and_serial_peers():
    tasks = {"moondream2": [Task("detect", "756x756", 4)], "moondream3": [Task("detect", "756x756", 4)],
             "whisper-tiny.en": [Task("transcribe", "5 s", 16)]}
    cfgs = plan.configs(list(tasks), tasks, (1, 4, 8), {"moondream2"}, {"moondream3"}, True, False)
    md2 = [(c.concurrency, c.side) for c in cfgs if c.family == "moondream2"]
    assert md2[:2] == [(1, "ours"), (1, "peer")]
    assert [c for c, _ in md2 if _ == "ours"] == [1, 8, 4]            # 1, then the extremes
    assert ("peer" not in {s for c, s in md2 if c > 1})                # a serial peer: c = 1 only
    assert not [c for c in cfgs if c.family == "moondream3" and c.side != "ours"]
    assert cfgs[-1].side == "peer+compile" and all(c.side != "peer+compile" for c in cfgs[:-2])
    measured = plan.configs(list(tasks), tasks, (1, 4), {"moondream2"}, set(), False, True)
    assert (4, "peer") in [(c.concurrency, c.side) for c in measured if c.family == "moondream2"]


def test_budget_learns_and_the_real_plan_is_long():
    cfg = plan.Config("moondream2", Task("detect", "756x756", 4), 1, "ours")
    b = plan.Budget(100.0, 0.0)
    est = b.estimate(cfg, 3, True)
    b.learn(cfg, 3, True, 2 * est)
    assert b.estimate(cfg, 3, True) == pytest.approx(2 * est)
    assert b.left(30.0) == 70.0
    # The whole matrix does not fit one 5-minute call: the plan must say so (and skip), not pretend.
    import e2e_families
    fams = list(e2e_families.ORDER)
    tasks = {f: e2e_families.family_class(f).tasks() for f in fams}
    cfgs = plan.configs(fams, tasks, (1, 8, 4), {"moondream2"}, {"moondream3"}, False, False)
    total = sum(plan.config_s(c, 3, True) for c in cfgs)
    assert total > 300
    starts = plan.family_starts(cfgs, 3, {f: 10.0 for f in fams})   # prewarm children only for these
    assert list(starts) == fams and all(a < b for a, b in zip(list(starts.values()), list(starts.values())[1:]))
    assert starts[fams[0]] == plan.START_S and starts[fams[-1]] > 270


def test_serial_peer_rows_are_derived_from_one_request():
    import gpu_e2e
    one = dict(latency_s=2.0, ttft_s=0.5, phases_s={p: 0.1 for p in PHASES}, tokens=[4])
    r = gpu_e2e.derived(one, 8)
    assert r["latency_s"] == 9.0 and r["throughput_rps"] == 0.5 and r["ttft_s"] == 7.5 and r["derived"]


# ------------------------------------------------------------------------------------ the dry run

# Each skill on its smaller input only (the 756x756 image, the 5 s clip): every family, skill, phase,
# side and concurrency level still runs; the larger inputs (more crops, longer audio) go through the same
# phases at about twice the time.
DRY_INPUTS = ("756x756", "5 s")


def dry_tasks(family: str) -> set[str]:
    import e2e_families
    return {t.name for t in e2e_families.family_class(family).tasks() if any(w in t.name for w in DRY_INPUTS)}


@pytest.fixture(scope="module")
def dry(tmp_path_factory):
    # --repeats 0: each configuration's warm-up call and its instrumented call, no timed call between
    # (the rows' latency is the warm-up's; every phase is the instrumented call's, as before).
    out = tmp_path_factory.mktemp("e2e")
    cmd = [sys.executable, str(ROOT / "bench" / "gpu_e2e.py"), "--dry-run", "--out", str(out), "--levels", "1,2",
           "--tasks", *DRY_INPUTS, "--repeats", "0"]
    if REF:
        cmd += ["--moondream-ref", REF]
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    # One torch thread: the tiny shapes' ops gain nothing from a second one, and on a busy 2-core
    # machine two threads spin-wait on each other (measured with other work running: 93 s of CPU
    # with two threads, 22 s with one, for the same rows).
    env["OMP_NUM_THREADS"] = "1"
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads((out / "gpu_e2e.json").read_text()), (out / "gpu_e2e.md").read_text()


def test_dry_run_times_every_phase_of_every_family_on_both_sides(dry):
    import e2e_families
    res, md = dry
    assert not res["failures"]
    assert res["checks"]["crops_match_pil"]["ok"]      # the device's crops checked first (here the CPU)
    rows = res["rows"]
    for family in e2e_families.ORDER:
        mine = [r for r in rows if r["family"] == family]
        tasks = dry_tasks(family)
        skills = {t.skill for t in e2e_families.family_class(family).tasks()}
        assert {t.split()[0] for t in tasks} == skills, family        # every skill of the family
        for c in (1, 2):
            assert {r["task"] for r in mine if r["side"] == "ours" and r["concurrency"] == c} == tasks, (family, c)
        for r in mine:
            assert set(r["phases_s"]) == set(PHASES) and r["latency_s"] > 0 and r["throughput_rps"] > 0
            if r.get("derived"):
                continue
            ph = r["phases_s"]
            assert ph["encoder"] > 0, (family, r["task"], r["side"])
            # the phases add up to the instrumented call (decode is its remainder)
            assert sum(ph.values()) == pytest.approx(r["instrumented_s"], rel=1e-6)
            if r["kind"] == "vision":
                assert ph["decode_image"] > 0 and ph["preprocess"] > 0 and ph["prefill"] > 0
                assert r["ttft_s"] is not None and 0 < r["ttft_s"] <= r["instrumented_s"]
        assert f"| {family} |" in md
    peers = {r["family"] for r in rows if r["side"] == "peer"}
    want = set(e2e_families.ORDER) - {"moondream3"} - (set() if REF else {"moondream2"})
    assert peers == want


def test_dry_run_sides_do_the_same_work(dry):
    res, _ = dry
    by = {(r["family"], r["task"], r["concurrency"], r["side"]): r for r in res["rows"]}
    compared = 0
    for (family, task, c, side), r in by.items():
        peer = by.get((family, task, c, "peer"))
        if side != "ours" or peer is None or peer.get("derived"):
            continue
        if family in ("moondream2", "parakeet-tdt-0.6b"):   # both count objects / words / tokens exactly
            assert r["tokens"] == peer["tokens"], (family, task, c)
            compared += 1
    # moondream2's tasks at c = 1 (its serial peer's c = 2 rows are derived) and parakeet's at both levels
    want = (len(dry_tasks("moondream2")) if REF else 0) + 2 * len(dry_tasks("parakeet-tdt-0.6b"))
    assert compared == want >= 2


def test_dry_run_derives_the_serial_reference_and_skips_with_reasons(dry):
    res, md = dry
    if REF:
        derived = [r for r in res["rows"] if r.get("derived")]
        assert derived and {r["family"] for r in derived} == {"moondream2"}
        assert all(r["concurrency"] == 2 for r in derived)
        assert "| moondream2 | detect 756x756 | 2 |" in md and "~" in md
    else:
        assert "no reference source" in res["families"]["moondream2"]["peer_skip"]
    assert "no runnable public reference" in res["families"]["moondream3"]["peer_skip"]
    assert "Goals:" in md


# ------------------------------------------------------------------------------------ prewarm children


def test_prewarm_children_run_in_order_within_the_worker_limit_and_report(tmp_path):
    from e2e_prewarm import Job, Prewarm, child_env, script_command
    env = dict(child_env(str(tmp_path)), PHOTON_BUILD_CACHE="0")
    env.pop("TRITON_INTERPRET", None)
    jobs = [Job("whisper-tiny.en", 1), Job("nonesuch", 1)]
    pw = Prewarm(script_command(str(ROOT / "bench" / "gpu_e2e.py"), ["--device", "cpu", "--dry-run"]), jobs, 1, env)
    pw.pump()
    assert pw.running() == 1 and jobs[1].proc is None          # one at a time, in the order given
    pw.wait("whisper-tiny.en", (1,), timeout_s=300)
    pw.wait("nonesuch", (1,), timeout_s=60)
    good, bad = jobs[0].result, jobs[1].result
    assert good["rc"] == 0 and good["skipped"] == "no compiled steps on this backend" and "error" not in good
    assert bad["rc"] != 0 and "nonesuch" in bad["error"]      # a failing child says why, the run goes on
    assert pw.running() == 0 and len(pw.results) == 2
