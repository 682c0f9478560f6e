"""Choosing a compiled step's engine (photon_core/megakernel/engine_choice.py, issue 38.4): the faster
of the megakernel and the per-op engine runs the step; the choice is recorded beside the build cache
and read back by the next start (which then builds only that engine); a failing engine is never
chosen; an unreadable record is measured again; off a GPU "auto" runs the megakernel; photon_core.load
with backend "auto" makes its steps under the "auto" policy; the choices reach /diagnostics' values.
The timer is the one test double: GPU timings cannot exist here (the real one, replay_ms, runs in the
prepared GPU call, bench/gpu_engines.py)."""
import os

os.environ["TRITON_INTERPRET"] = "1"  # must precede the first import of triton

import json  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from photon_core.megakernel import engine_choice  # noqa: E402
from photon_core.megakernel.compiler import first_engine  # noqa: E402
from photon_core.models.whisper.decoder_step import WhisperDecoderMegakernel, WhisperDecoderWeights  # noqa: E402
from photon_core.runtime import decode  # noqa: E402

WT = WhisperDecoderWeights.random(64, 2, 1, 96, n_ctx=16, seed=0)


def build(batch: int = 1, weight_dtype: torch.dtype = torch.float32):
    with first_engine("perop"):
        return WhisperDecoderMegakernel(WT, batch, 16, 8, advance=True, weight_dtype=weight_dtype)


class Timer:
    """ms per engine (and megakernel variant: "megakernel wide512+aligned"), counting the
    measurements and keeping which kernel variant each megakernel measurement would launch."""

    CHAINED = 9.9    # the per-op engine's chained build: the slowest, where a test does not time it

    def __init__(self, ms: dict | None = None, **kw: float) -> None:
        self.ms, self.calls, self.launched = dict({"perop chained": self.CHAINED}, **(ms or {}), **kw), 0, []

    def __call__(self, step) -> float:
        self.calls += 1
        if step.engine == "megakernel":
            self.launched.append(step.kernel_for(None).variant.name())
        value = self.ms[step.engine_label]
        if isinstance(value, Exception):
            raise value
        return value


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PHOTON_BUILD_CACHE", "1")
    monkeypatch.setenv("PHOTON_CACHE_DIR", str(tmp_path))
    return tmp_path / "megakernel"


@pytest.mark.parametrize("mega, perop, want", [(7.67, 2.98, "perop"), (0.9, 2.98, "megakernel")])
def test_the_faster_engine_runs_the_step_and_the_next_start_reads_it(cache, mega, perop, want):
    step = build()
    timer = Timer(megakernel=mega, perop=perop)
    choice = engine_choice.choose(step, timer)
    assert (choice.engine, choice.how, step.engine) == (want, "measured", want)
    assert (choice.megakernel_ms, choice.perop_ms, choice.chained_ms) == (mega, perop, Timer.CHAINED)
    assert timer.calls == 3
    record = json.loads(engine_choice.record_path(step).read_text())
    assert record["engine"] == want
    # the next start: nothing measured, and a per-op choice builds no megakernel
    again = build()
    choice = engine_choice.choose(again, Timer(megakernel=AssertionError("measured"), perop=AssertionError("measured")))
    assert (choice.engine, choice.how, again.engine) == (want, "recorded", want)
    assert any(e == "megakernel" for e, _ in again._kernels) == (want == "megakernel")
    # another bucket is another key: measured
    timer = Timer(megakernel=mega, perop=perop)
    assert engine_choice.choose(build(2), timer).how == "measured" and timer.calls == 3


def test_a_failing_engine_is_not_chosen_and_not_recorded(cache):
    step = build()
    choice = engine_choice.choose(step, Timer(megakernel=RuntimeError("no spills allowed"), perop=3.0))
    assert (choice.engine, choice.how, step.engine) == ("perop", "fallback", "perop")
    assert "megakernel failed: RuntimeError: no spills allowed" in choice.note
    assert not engine_choice.record_path(step).exists()     # measured again at the next start
    with pytest.raises(RuntimeError, match="no decode engine runs here"):
        engine_choice.choose(build(), Timer({"megakernel": RuntimeError("a"), "perop": RuntimeError("b"),
                                             "perop chained": RuntimeError("c")}))


def test_a_recorded_engine_that_no_longer_builds_is_measured_again(cache, monkeypatch):
    step = build()
    engine_choice.choose(step, Timer(megakernel=2.0, perop=1.0))            # records perop
    from photon_core.megakernel import perop_engine

    def refuse(*a, **k):
        raise ValueError("no per-op engine here")
    monkeypatch.setattr(perop_engine, "PerOpKernel", refuse)
    again = build()
    choice = engine_choice.choose(again, Timer(megakernel=2.0, perop=1.0))
    assert (choice.engine, choice.how, again.engine) == ("megakernel", "fallback", "megakernel")


def test_policies_are_per_thread():
    import threading
    seen = []
    with decode.engine_policy("auto"):
        t = threading.Thread(target=lambda: seen.append(decode.current_engine_policy()))
        t.start()
        t.join()
        assert decode.current_engine_policy() == "auto"
    assert seen == ["megakernel"]


def test_an_unreadable_record_is_measured_again(cache, caplog):
    step = build()
    path = engine_choice.record_path(step)
    path.parent.mkdir(parents=True)
    path.write_text('{"engine": "warp drive"}')
    choice = engine_choice.choose(step, Timer(megakernel=1.0, perop=2.0))
    assert choice.how == "measured" and "measuring again" in caplog.text
    assert json.loads(path.read_text())["engine"] == "megakernel"


def test_off_a_gpu_auto_runs_the_megakernel_and_measures_nothing(cache):
    step = build()
    choice = engine_choice.choose(step)
    assert (choice.engine, step.engine) == ("megakernel", "megakernel") and "off a GPU" in choice.note
    assert not engine_choice.record_path(step).exists()


def test_policies_reach_the_steps_and_the_diagnostics(monkeypatch):
    from photon_core.models.whisper import load_whisper
    from photon_core.models.whisper.megakernel_steps import MegakernelSteps
    model = load_whisper("whisper-tiny.en", dtype="float32", backend="reference")
    monkeypatch.setenv(decode.ENGINE_ENV, "perop")
    assert MegakernelSteps(model.net).mk.engine == "perop"
    monkeypatch.setenv(decode.ENGINE_ENV, "fast")
    with pytest.raises(ValueError, match="one of"):
        MegakernelSteps(model.net)
    monkeypatch.delenv(decode.ENGINE_ENV)
    with decode.engine_policy("auto"):          # on the CPU: the megakernel, nothing measured
        steps = MegakernelSteps(model.net)
    assert steps.mk.engine == "megakernel"
    values = decode.engine_diagnostics()
    assert any(k.endswith(" B1") and v.startswith("megakernel (asked") for k, v in values.items())
    # photon_core.load (registry.Recognised.load) loads a family under its backend's policy
    from types import SimpleNamespace

    from photon_core import registry

    class Seen(Exception):
        pass

    def load(*args):
        raise Seen(decode.current_engine_policy())
    for backend, policy in (("auto", "auto"), ("megakernel", "megakernel"), ("triton", "megakernel")):
        found = registry.Recognised(SimpleNamespace(load=load, skills=()), None, None)
        with pytest.raises(Seen, match=f"^{policy}$"):
            found.load("cuda", None, backend)
    assert decode.current_engine_policy() == "megakernel"    # restored after


@pytest.mark.parametrize("batch, streaming", [(1, "wide512+aligned"), (2, "unroll8+aligned")])
def test_a_bf16_step_also_times_the_streaming_megakernel_and_keeps_the_fastest(cache, batch, streaming):
    """16-bit weights: the megakernel's streaming build is a third candidate (the same task table,
    its K loops compiled to keep more weights in flight); the fastest of the three runs and is
    recorded with its variant, which the next start's megakernel is built as."""
    label = f"megakernel {streaming}"
    step = build(batch, torch.bfloat16)
    assert engine_choice.candidates(step) == [("megakernel", "plain"), ("megakernel", streaming), ("perop", "plain"),
                                              ("perop", "chained")]
    timer = Timer({"megakernel": 7.2, label: 1.9, "perop": 2.98})
    choice = engine_choice.choose(step, timer)
    assert (choice.engine, choice.variant, choice.how, step.engine_label) == ("megakernel", streaming, "measured", label)
    assert timer.launched == ["plain", streaming] and timer.calls == 4
    assert step.kernel_for(None).variant.name() == streaming        # what decode launches now
    if batch == 1:   # the streaming build launches and computes the plain build's logits (Triton's interpreter)
        step.set_step([5], [3])
        logits = {}
        for variant in (streaming, "plain"):
            saved = step.state.clone(), step.dyn.clone()   # the launch advances the row's token and position
            step.set_engine("megakernel", variant)
            step.kernel_for(None).launch()
            step.kernel_for(None).raise_on_error()
            logits[variant] = step.view("logits").clone()
            step.state.copy_(saved[0])
            step.dyn.copy_(saved[1])
        torch.testing.assert_close(logits[streaming], logits["plain"], rtol=1e-4, atol=1e-4)
        step.set_engine("megakernel", streaming)
    assert choice.line() == (f"megakernel {streaming} (measured: megakernel 7.200 ms, {label} 1.900 ms, "
                             "per-op 2.980 ms, per-op chained 9.900 ms)")
    record = json.loads(engine_choice.record_path(step).read_text())
    assert (record["engine"], record["variant"]) == ("megakernel", streaming)
    again = build(batch, torch.bfloat16)
    choice = engine_choice.choose(again, Timer())
    assert (choice.how, choice.variant, again.kernel_for(None).variant.name()) == ("recorded", streaming, streaming)
    # where the plain build is faster, it stays plain; where the per-op engine is, that runs
    for times, want in (({"megakernel": 1.0, label: 1.9, "perop": 2.98}, "megakernel"),
                        ({"megakernel": 7.2, label: 3.1, "perop": 2.98}, "perop")):
        step = build(batch, torch.bfloat16)
        engine_choice.record_path(step).unlink()
        choice = engine_choice.choose(step, Timer(times))
        assert (step.engine_label, choice.variant) == (want, "plain")


def test_fp32_weights_time_no_streaming_build_and_old_records_read_as_plain(cache):
    step = build()
    assert engine_choice.candidates(step) == [("megakernel", "plain"), ("perop", "plain"), ("perop", "chained")]
    choice = engine_choice.choose(step, Timer(megakernel=1.0, perop=2.0))
    assert choice.line() == "megakernel (measured: megakernel 1.000 ms, per-op 2.000 ms, per-op chained 9.900 ms)"
    path = engine_choice.record_path(step)
    path.write_text(json.dumps(dict(engine="megakernel", megakernel_ms=1.0, perop_ms=2.0)))   # written before variants
    choice = engine_choice.choose(build(), Timer())
    assert (choice.how, choice.variant) == ("recorded", "plain")
    path.write_text(json.dumps(dict(engine="megakernel", variant="wide3+nonsense")))
    assert engine_choice.choose(build(), Timer(megakernel=1.0, perop=2.0)).how == "measured"


def test_variant_names_round_trip():
    from photon_core.megakernel.kernel import KernelVariant
    for v in (KernelVariant(), KernelVariant(wide=512, aligned=True), KernelVariant(unroll=4, aligned=True),
              KernelVariant(dot=64, pipeline=4), KernelVariant(prefetch=2)):
        assert KernelVariant.parse(v.name()) == v
    for bad in ("wide", "aligned1", "wide512+bogus", "unroll3", "wide0", "aligned+wide512", "wide512+wide512", ""):
        with pytest.raises(ValueError):
            KernelVariant.parse(bad)


def test_a_streaming_build_that_computes_otherwise_is_refused_and_not_tried_again(cache, monkeypatch):
    def differs(step, variant, tolerance=1e-3, engine="megakernel"):
        raise RuntimeError(f"the {variant} build's logits differs from the plain build's (3.1e-01 of its largest)")
    monkeypatch.setattr(engine_choice, "same_as_plain", differs)
    step = build(1, torch.bfloat16)
    timer = Timer({"megakernel": 7.2, "megakernel wide512+aligned": 1.9, "perop": 2.98})
    choice = engine_choice.choose(step, timer)
    assert (choice.engine, choice.variant, choice.how) == ("perop", "plain", "fallback")
    assert "megakernel wide512+aligned failed: RuntimeError: the wide512+aligned build's logits differs" in choice.note
    assert "perop chained failed" in choice.note
    assert timer.calls == 2                      # neither build beside a plain one timed
    choice = engine_choice.choose(build(1, torch.bfloat16), Timer())   # recorded: nothing measured or compiled
    assert (choice.engine, choice.how) == ("perop", "recorded")


def test_the_streaming_check_compares_a_launch_of_each_build():
    """same_as_plain itself (the interpreter): the streaming build passes; a plain build whose
    weights change between the two launches does not."""
    step = build(1, torch.bfloat16)
    step.set_step([5], [3])
    engine_choice.same_as_plain(step, "wide512+aligned")
    assert step.engine_label == "megakernel wide512+aligned"
    launch = type(step.kernel_for(None)).launch

    def drifting(kernel, *a, **k):
        if kernel.variant.name() != "plain":
            step.weights.mul_(1.5)
        return launch(kernel, *a, **k)
    import unittest.mock
    with unittest.mock.patch.object(type(step.kernel_for(None)), "launch", drifting):
        with pytest.raises(RuntimeError, match="differs from the plain build's|picks"):
            engine_choice.same_as_plain(step, "wide512+aligned")



def test_picks_that_differ_agree_only_on_a_near_tie_in_the_plain_builds_scores():
    scores = torch.tensor([[0.0, 5.0, 5.0 + 1e-4, -float("inf")], [1.0, 2.0, 3.0, 0.5]])
    assert engine_choice.picks_agree([2, 2], [2, 2], None, 1e-3)
    assert engine_choice.picks_agree([2, 2], [1, 2], scores, 1e-3)          # 1e-4 apart, the largest 5
    assert not engine_choice.picks_agree([2, 2], [1, 2], scores, 1e-6)
    assert not engine_choice.picks_agree([2, 2], [1, 2], None, 1e-3)        # scores not exposed
    assert not engine_choice.picks_agree([2, 2], [2, 1], scores, 1e-3)      # 3 against 2: no tie
    assert not engine_choice.picks_agree([-2, 2], [1, 2], scores, 1e-3)     # a NaN row's marker
    assert not engine_choice.picks_agree([2, 2], [3, 2], scores, 1e-3)      # a barred column

def test_a_new_variant_is_a_new_kernel_object_and_the_per_op_engine_has_none():
    """A loop holding the step's kernel (DeviceDecode: its CUDA graphs captured it) keeps its build."""
    step = build(1, torch.bfloat16)
    step.set_engine("megakernel")
    held = step.kernel_for(None)
    step.set_engine("megakernel", "unroll4+aligned")
    assert held.variant.name() == "plain" and step.kernel_for(None) is not held
    assert step.kernel_for(None).variant.name() == "unroll4+aligned" and step.kernel_for(None).tasks is held.tasks
    with pytest.raises(ValueError, match="per-op engine's variants"):
        step.set_engine("perop", "unroll4+aligned")


def test_the_per_op_engines_chained_build_is_timed_checked_and_recorded(cache):
    """The per-op engine's chained build (kernels/chained.py) is a candidate for fp32 and bf16
    weights: checked against the plain per-op build by one launch each (the real check, Triton's
    interpreter), chosen where it is the fastest, recorded, and built again from the record."""
    step = build(1, torch.bfloat16)
    step.set_step([5], [3])
    engine_choice.same_as_plain(step, "chained", engine_choice._tolerance(step, "perop"), engine="perop")
    assert step.engine_label == "perop chained" and step.kernel_for(None).chained
    timer = Timer({"megakernel": 7.2, "megakernel wide512+aligned": 1.9, "perop": 2.98, "perop chained": 0.9})
    choice = engine_choice.choose(build(1, torch.bfloat16), timer)
    assert (choice.engine, choice.variant, choice.how, choice.chained_ms) == ("perop", "chained", "measured", 0.9)
    assert choice.line().startswith("perop chained (measured: ")
    record = json.loads(engine_choice.record_path(step).read_text())
    assert (record["engine"], record["variant"], record["chained_ms"]) == ("perop", "chained", 0.9)
    again = build(1, torch.bfloat16)
    choice = engine_choice.choose(again, Timer())
    assert (choice.how, again.engine_label, choice.chained_ms) == ("recorded", "perop chained", 0.9)
    assert not any(e == "megakernel" for e, _ in again._kernels)
    engine_choice.record_path(step).write_text(json.dumps(dict(engine="perop", variant="wide512+aligned")))
    assert engine_choice.choose(build(1, torch.bfloat16), Timer(timer.ms)).how == "measured"


def test_a_chained_build_whose_pdl_launches_fail_is_tried_as_ordinary_launches(cache, monkeypatch):
    """Where the GPU offers PDL but its launches fail (a Triton or driver that cannot capture them),
    the same kernels are timed as ordinary launches ("chained-unlinked"), chosen where fastest,
    recorded, and built again from the record without PDL. Off a GPU nothing links: not tried."""
    monkeypatch.setattr(engine_choice, "same_as_plain", lambda *a, **k: None)
    timer = Timer({"megakernel": 7.2, "megakernel wide512+aligned": 1.9, "perop": 2.98,
                   "perop chained": RuntimeError("CUDA error: operation not permitted when stream is capturing"),
                   "perop chained-unlinked": 0.95})
    assert engine_choice.choose(build(1, torch.bfloat16), timer).variant == "wide512+aligned"   # no PDL here: not tried
    assert "perop chained-unlinked" not in json.dumps(json.loads(engine_choice.record_path(build(1, torch.bfloat16)).read_text()))
    engine_choice.record_path(build(1, torch.bfloat16)).unlink()
    monkeypatch.setattr(engine_choice, "_links", lambda step: True)
    choice = engine_choice.choose(build(1, torch.bfloat16), timer)
    assert (choice.engine, choice.variant, choice.chained_ms) == ("perop", "chained-unlinked", 0.95)
    assert "perop chained failed: RuntimeError: CUDA error: operation not permitted" in choice.note
    again = build(1, torch.bfloat16)
    assert engine_choice.choose(again, Timer()).how == "recorded"
    kernel = again.kernel_for(None)
    assert again.engine_label == "perop chained-unlinked" and kernel.chained and kernel.pdl is False


def test_fp16_weights_time_the_megakernels_builds_and_are_recorded(cache):
    """The per-op engine refuses fp16 weights, so it is no candidate: were it one, its failure would
    keep every start from recording the choice (measured and compiled again each time, 'fallback')."""
    step = build(1, torch.float16)
    assert engine_choice.candidates(step) == [("megakernel", "plain"), ("megakernel", "wide512+aligned")]
    choice = engine_choice.choose(step, Timer({"megakernel": 7.2, "megakernel wide512+aligned": 1.9}))
    assert (choice.how, choice.variant, choice.note) == ("measured", "wide512+aligned", "")
    again = engine_choice.choose(build(1, torch.float16), Timer())
    assert (again.how, again.variant) == ("recorded", "wide512+aligned")


def test_a_record_with_fields_of_the_wrong_type_is_measured_again_and_a_recorded_choice_is_logged(cache, caplog):
    step = build()
    path = engine_choice.record_path(step)
    path.parent.mkdir(parents=True)
    for bad in (dict(engine="megakernel", megakernel_ms="1.0"), dict(engine="perop", note=5), ["megakernel"]):
        path.write_text(json.dumps(bad))
        caplog.clear()
        with caplog.at_level("INFO", logger=engine_choice.__name__):
            choice = engine_choice.choose(build(), Timer(megakernel=1.0, perop=2.0))
        assert choice.how == "measured" and "measuring again" in caplog.text, bad
    caplog.clear()
    with caplog.at_level("INFO", logger=engine_choice.__name__):
        choice = engine_choice.choose(build(), Timer())
    assert choice.how == "recorded" and f"decodes on {choice.line()}" in caplog.text   # both times, every start


def test_a_record_folder_that_cannot_be_opened_costs_only_the_record(tmp_path, monkeypatch, caplog):
    """A folder stat() refuses (here a name too long for the file system; another user's 0700
    folder alike) is a miss and a warning, never a failed load."""
    monkeypatch.setenv("PHOTON_BUILD_CACHE", "1")
    monkeypatch.setenv("PHOTON_CACHE_DIR", str(tmp_path / ("x" * 300)))
    with caplog.at_level("WARNING", logger=engine_choice.__name__):
        choice = engine_choice.choose(build(), Timer(megakernel=1.0, perop=2.0))
    assert (choice.how, choice.engine) == ("measured", "megakernel") and "not written" in caplog.text


def test_a_record_that_fails_half_way_leaves_no_temporary_file(cache, monkeypatch):
    def fails(rec, f):
        f.write('{"engine": "mega')
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(engine_choice.json, "dump", fails)
    engine_choice.choose(build(), Timer(megakernel=1.0, perop=2.0))
    assert [p.name for p in cache.iterdir() if p.suffix == ".json"] == []    # the build cache's entry only
