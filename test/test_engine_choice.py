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


def build(batch: int = 1):
    with first_engine("perop"):
        return WhisperDecoderMegakernel(WT, batch, 16, 8, advance=True)


class Timer:
    """ms per engine, counting the measurements."""

    def __init__(self, **ms: float) -> None:
        self.ms, self.calls = ms, 0

    def __call__(self, step) -> float:
        self.calls += 1
        value = self.ms[step.engine]
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
    assert (choice.megakernel_ms, choice.perop_ms) == (mega, perop) and timer.calls == 2
    record = json.loads(engine_choice.record_path(step).read_text())
    assert record["engine"] == want
    # the next start: nothing measured, and a per-op choice builds no megakernel
    again = build()
    choice = engine_choice.choose(again, Timer(megakernel=AssertionError("measured"), perop=AssertionError("measured")))
    assert (choice.engine, choice.how, again.engine) == (want, "recorded", want)
    assert any(e == "megakernel" for e, _ in again._kernels) == (want == "megakernel")
    # another bucket is another key: measured
    timer = Timer(megakernel=mega, perop=perop)
    assert engine_choice.choose(build(2), timer).how == "measured" and timer.calls == 2


def test_a_failing_engine_is_not_chosen_and_not_recorded(cache):
    step = build()
    choice = engine_choice.choose(step, Timer(megakernel=RuntimeError("no spills allowed"), perop=3.0))
    assert (choice.engine, choice.how, step.engine) == ("perop", "fallback", "perop")
    assert "megakernel failed: RuntimeError: no spills allowed" in choice.note
    assert not engine_choice.record_path(step).exists()     # measured again at the next start
    with pytest.raises(RuntimeError, match="no decode engine runs here"):
        engine_choice.choose(build(), Timer(megakernel=RuntimeError("a"), perop=RuntimeError("b")))


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
