"""runtime/shape_graphs: an encoder replayed from a graph per input shape where measured faster.

A CUDA graph cannot exist here, so a double stands in for one with its semantics: capture runs the
call once on the static inputs, and replay runs it again writing into that same output's memory.
The timer is a double too (the order candidates are measured in: eager, then graph)."""
from __future__ import annotations

import logging

import pytest
import torch

from photon_core.runtime.measured import Choices
from photon_core.runtime.shape_graphs import ShapeGraphs


class GraphDouble:
    def __init__(self, fn):
        self.fn, self.out = fn, fn()

    def replay(self):
        self.out.copy_(self.fn())


class Encoder:
    """x -> x * 2 + 1, recording which tensors it was called on."""

    def __init__(self):
        self.seen: list[torch.Tensor] = []
        self.inner = Choices(timer=lambda fn: (fn(), 1.0)[1])   # a measured op inside, as encoders have

    def __call__(self, x):
        self.seen.append(x)
        return self.inner.run(("op", tuple(x.shape)), {"a": lambda: x * 2 + 1}, True)


def graphs(enc, eager_s, graph_s, capture=None, **kw):
    captures = []

    def double(fn, pool):
        captures.append(pool)
        g = (capture or GraphDouble)(fn)
        return g, g.out

    times = iter([eager_s, graph_s] * 10)
    sg = ShapeGraphs("test encoder", enc, capture=double, choices=Choices(timer=lambda fn: (fn(), next(times))[1]),
                     on_gpu=lambda inputs: True, pool=lambda: "pool", **kw)
    return sg, captures


def test_replays_the_graph_where_it_is_faster():
    enc = Encoder()
    sg, captures = graphs(enc, 2.0, 1.0)
    x = torch.randn(3, 5)
    assert torch.equal(sg(x), x * 2 + 1)
    assert sg.shapes() == 1 and captures == ["pool"]
    enc.seen.clear()
    y = torch.randn(3, 5)
    out = sg(y)
    assert torch.equal(out, y * 2 + 1)
    assert len(enc.seen) == 1 and enc.seen[0] is not y          # replayed on the graph's own input
    out.fill_(7.0)                                               # a caller's copy: the next call is unaffected
    z = torch.randn(3, 5)
    assert torch.equal(sg(z), z * 2 + 1) and captures == ["pool"]
    assert torch.equal(out, torch.full((3, 5), 7.0))


def test_stays_eager_where_eager_is_faster():
    enc = Encoder()
    sg, captures = graphs(enc, 1.0, 2.0)
    x = torch.randn(2, 4)
    assert torch.equal(sg(x), x * 2 + 1)
    assert sg.shapes() == 0                                      # the measured graph's memory given back
    enc.seen.clear()
    y = torch.randn(2, 4)
    assert torch.equal(sg(y), y * 2 + 1) and enc.seen == [y] and len(captures) == 1


def test_a_failed_capture_leaves_the_shape_eager(caplog):
    def broken(fn):
        raise RuntimeError("operation not permitted when stream is capturing")

    enc = Encoder()
    sg, captures = graphs(enc, 2.0, 1.0, capture=broken)
    x = torch.randn(4)
    with caplog.at_level(logging.WARNING):
        assert torch.equal(sg(x), x * 2 + 1)
    assert "graph failed" in caplog.text and "not permitted" in caplog.text
    assert torch.equal(sg(x + 1), (x + 1) * 2 + 1) and len(captures) == 1 and sg.shapes() == 0


def test_holds_at_most_max_shapes_graphs():
    enc = Encoder()
    sg, captures = graphs(enc, 2.0, 1.0, max_shapes=2)
    for n in (1, 2, 3):
        x = torch.randn(n)
        assert torch.equal(sg(x), x * 2 + 1)
    assert sg.shapes() == 2 and len(captures) == 3
    x = torch.randn(3)
    assert torch.equal(sg(x), x * 2 + 1) and len(captures) == 3  # still held
    x = torch.randn(1)                                           # dropped: measured and captured again
    assert torch.equal(sg(x), x * 2 + 1) and len(captures) == 4 and sg.shapes() == 2


def test_off_a_gpu_the_encoder_runs_as_it_is():
    enc = Encoder()
    sg = ShapeGraphs("cpu encoder", enc, choices=Choices(timer=lambda fn: pytest.fail("measured off a GPU")))
    x = torch.randn(3)
    assert torch.equal(sg(x), x * 2 + 1) and enc.seen == [x] and sg.shapes() == 0


class FrozenGraph(GraphDouble):
    """A wrong capture: its replay gives the captured input's result whatever the input holds now
    (as a graph would that read its input on the host while capturing)."""

    def replay(self):
        pass


def test_a_graph_that_replays_a_stale_result_is_never_used(caplog):
    enc = Encoder()
    sg, captures = graphs(enc, 2.0, 1.0, capture=FrozenGraph)
    x = torch.randn(6)
    with caplog.at_level(logging.ERROR):
        assert torch.equal(sg(x), x * 2 + 1)
    assert "differs from the eager call" in caplog.text and sg.shapes() == 0
    y = torch.randn(6)
    assert torch.equal(sg(y), y * 2 + 1) and len(captures) == 1


class TupleGraph:
    def __init__(self, fn):
        self.fn, self.out = fn, fn()

    def replay(self):
        for o, n in zip(self.out, self.fn()):
            o.copy_(n)


def test_a_tuple_of_outputs_each_the_callers_own():
    def kv(x):
        return x * 2, x - 1

    times = iter([2.0, 1.0])
    captures = []

    def cap(fn, pool):
        captures.append(pool)
        g = TupleGraph(fn)
        return g, g.out

    sg = ShapeGraphs("prefill", kv, capture=cap, choices=Choices(timer=lambda fn: (fn(), next(times))[1]),
                     on_gpu=lambda inputs: True, pool=lambda: "pool")
    x, y = torch.randn(2, 3), torch.randn(2, 3)
    k, v = sg(x)
    assert torch.equal(k, x * 2) and torch.equal(v, x - 1) and sg.shapes() == 1
    k2, v2 = sg(y)
    assert torch.equal(k2, y * 2) and torch.equal(v2, y - 1) and torch.equal(k, x * 2) and len(captures) == 1


def test_a_check_that_fails_leaves_the_shape_eager(caplog):
    # Out of memory while the replay is checked, say: the error reaches the caller, and the graph,
    # never checked, is never replayed.
    enc = Encoder()
    calls = {"n": 0}
    base = enc.__call__

    def flaky(x):
        calls["n"] += 1
        if calls["n"] == 3:            # eager measured, captured, then the check's eager call
            raise RuntimeError("CUDA out of memory")
        return base(x)

    sg, captures = graphs(flaky, 2.0, 1.0, capture=FrozenGraph)
    x = torch.randn(5)
    with pytest.raises(RuntimeError, match="out of memory"):
        sg(x)
    assert sg.shapes() == 0
    y = torch.randn(5)
    assert torch.equal(sg(y), y * 2 + 1) and len(captures) == 1
