"""Many-row linear and attention by the faster of our Triton kernel and torch's (backends/fastest.py,
runtime/measured.py; issue 39): the torch candidates meet the ops contract (fp32: the reference's
values; bf16 weights: within bf16 rounding); a new shape is measured once and the faster runs from
then on; a failing candidate is never chosen; nothing is measured off a GPU or while a CUDA graph is
captured, where our kernel runs; decode rows always take our GEMV. The timer and `measurable` are the
test doubles: GPU timings cannot exist here."""
import os

os.environ["TRITON_INTERPRET"] = "1"  # must precede the first import of triton

import pytest  # noqa: E402
import torch  # noqa: E402

from photon_core.backends import fastest, reference  # noqa: E402
from photon_core.backends.select import get_backend  # noqa: E402
from photon_core.runtime import measured  # noqa: E402


def rel(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


@pytest.mark.parametrize("act", [None, "gelu", "gelu_tanh", "silu"])
def test_torch_linear_meets_the_contract(act):
    g = torch.Generator().manual_seed(1)
    x, w, b, r = (torch.randn(*s, generator=g) for s in ((3, 40, 64), (48, 64), (48,), (3, 40, 48)))
    want = reference.linear(x, w, b, act, r)
    got = fastest.torch_linear(x, w, b, act, r)
    assert got.dtype == want.dtype and got.shape == want.shape and rel(got, want) < 1e-5
    # bf16 weights: bf16 inputs to the GEMM, fp32 out (the contract's result dtype), bf16 rounding
    got16 = fastest.torch_linear(x, w.bfloat16(), b.bfloat16(), act, r)
    assert got16.dtype == torch.float32 and rel(got16, reference.linear(x, w.bfloat16().float(), b.bfloat16().float(),
                                                                         act, r)) < 2e-2
    with pytest.raises(ValueError, match="activation"):
        fastest.torch_linear(x, w, activation="relu")


class Timer:
    def __init__(self, seconds):
        self.seconds, self.calls = seconds, []

    def __call__(self, fn):
        name = fn.__name__ if hasattr(fn, "__name__") else "?"
        self.calls.append(name)
        fn()
        return self.seconds.pop(0)


def test_a_shape_is_measured_once_and_the_faster_runs(monkeypatch):
    choices = measured.Choices(Timer([2e-3, 1e-3]))
    runs = []
    cands = {"triton": lambda: runs.append("triton") or 1, "torch": lambda: runs.append("torch") or 2}
    assert choices.run("k", cands, measure=True) == 2
    assert choices.chosen == {"k": "torch"} and choices.seconds["k"] == {"triton": 2e-3, "torch": 1e-3}
    runs.clear()
    assert choices.run("k", cands, measure=True) == 2 and runs == ["torch"]       # not measured again
    assert choices.run("other", cands, measure=False) == 1                          # unmeasured: ours
    assert "other" not in choices.chosen


def test_a_failing_candidate_is_not_chosen():
    def broken():
        raise RuntimeError("out of resources: shared memory")
    choices = measured.Choices(lambda fn: (fn(), 1e-3)[1])
    assert choices.run("k", {"triton": broken, "torch": lambda: 7}, measure=True) == 7
    with pytest.raises(RuntimeError, match="out of resources"):
        choices.run("j", {"triton": broken, "torch": broken}, measure=True)


def test_a_mistake_every_candidate_refuses_keeps_its_type_and_message():
    """A caller's wrong shape raises what the unmeasured call raises (a ValueError a caller may
    catch), not a generic failure with the reason only in the log."""
    def wrong_shape():
        raise ValueError("linear: x has 64 features, weight is (48, 65)")
    choices = measured.Choices(lambda fn: (fn(), 1e-3)[1])
    with pytest.raises(ValueError, match="64 features"):
        choices.run("k", {"triton": wrong_shape, "torch": wrong_shape}, measure=True)
    assert "k" not in choices.chosen


def test_the_backend_dispatches_by_the_choice(monkeypatch):
    """The per-op backend's linear and attention on many rows: measured where measurable (the
    double says so here), our kernel otherwise; decode rows never measured."""
    ops = get_backend("triton", "cpu")
    assert ops.linear is fastest.linear and get_backend("megakernel", "cpu").attention is fastest.attention
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(32, 64, generator=g), torch.randn(48, 64, generator=g)
    q, k, v = (torch.randn(1, 2, 20, 16, generator=g) for _ in range(3))
    want_y, want_a = reference.linear(x, w), reference.attention(q, k, v, causal=True)
    timer = Timer([5e-3, 1e-3, 5e-3, 1e-3])
    monkeypatch.setattr(measured, "CHOICES", measured.Choices(timer))
    monkeypatch.setattr(fastest, "CHOICES", measured.CHOICES)
    monkeypatch.setattr(fastest, "measurable", lambda t: True)
    assert rel(ops.linear(x, w), want_y) < 1e-5 and rel(ops.attention(q, k, v, causal=True), want_a) < 1e-5
    assert sorted(v for v, _ in measured.choices().values()) == ["torch", "torch"]
    assert ops.linear(x[:4], w).shape == (4, 48) and len(measured.CHOICES.chosen) == 2   # decode rows: GEMV
    monkeypatch.setattr(fastest, "measurable", lambda t: False)
    ops.linear(torch.randn(200, 64, generator=g), w)              # a new shape, not measurable: ours
    assert len(measured.CHOICES.chosen) == 2 and len(timer.calls) == 4


def test_nothing_is_measured_off_a_gpu():
    assert not measured.measurable(torch.zeros(1))
