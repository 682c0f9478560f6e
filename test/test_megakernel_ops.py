"""The compiler's ops are declared once each (photon_core/megakernel/ops/): every op a StepGraph can
build has one rule, every kernel op code one task body and one dispatch in the kernel, and the kernel
reads every task field by the name graph.FIELDS gives it. A new op is a rule the compiler and the
eager reference reach through the registry alone."""
import os

os.environ["TRITON_INTERPRET"] = "1"  # must precede the first import of triton

import ast  # noqa: E402
import inspect  # noqa: E402
import re  # noqa: E402

import torch  # noqa: E402

from photon_core.megakernel import kernel, ops, stepgraph  # noqa: E402
from photon_core.megakernel.compiler import Tiling, lower, plan  # noqa: E402
from photon_core.megakernel.graph import FIELDS, F, Task  # noqa: E402
from photon_core.megakernel.ops.base import OpRule, Stage  # noqa: E402
from photon_core.megakernel.eager import run_reference  # noqa: E402
from photon_core.megakernel.stepgraph import Node, StepGraph, Value  # noqa: E402


def test_every_step_graph_op_has_exactly_one_rule():
    src = inspect.getsource(stepgraph.StepGraph)
    built = set(re.findall(r'self\._add\("(\w+)"', src)) | set(re.findall(r'Node\("(\w+)"', src))
    assert built == set(ops.RULES)
    for name, rule in ops.RULES.items():
        assert rule.op == name and callable(rule.reference)


def test_every_kernel_op_code_has_a_task_body_and_a_dispatch():
    src = inspect.getsource(kernel)   # (jit functions hide their own source under the interpreter)
    fn = next(n for n in ast.parse(src).body if isinstance(n, ast.FunctionDef) and n.name == "_step_tasks")
    dispatch = ast.get_source_segment(src, fn)
    assert sorted(ops.OP_NAMES) == sorted(set(ops.OP_NAMES))
    for code, name in ops.OP_NAMES.items():
        const = f"OP_{name.upper()}"
        assert getattr(kernel, const) == code == getattr(ops, const)
        assert hasattr(kernel, f"_task_{name}"), name
        assert f"op == {const}" in dispatch, name
    # the codes the compiler emits are exactly those its rules declare
    emitted = {c for r in ops.RULES.values() for c in r.codes}
    assert emitted == set(ops.OP_NAMES)


def test_the_kernel_reads_every_field_by_its_name():
    src = inspect.getsource(kernel)
    assert not re.findall(r"\brow \+ \d", src), "a task field read at a literal column"
    for name in FIELDS:
        assert getattr(kernel, f"F_{name}") == F[name]
    used = set(re.findall(r"\brow \+ F_(\w+)\b", src))
    assert used <= set(FIELDS) and {"op", "M", "K", "N", "out", "fin", "nfin"} <= used


def test_a_new_op_is_a_rule_the_compiler_and_the_reference_reach(monkeypatch):
    """A toy op ("double": 2x, lowered as add_norm tasks of its own) registered as a rule, with no
    change to compiler.py or eager.run_reference: plan, lower and the eager run all use it."""
    def reference(e, node):
        return 2 * e.val(node.args["x"])

    def lower_double(lo, node):
        st = Stage(node.out.name, lo.g.counter(node.out.name), ancestors=lo.ancestors([node.args["x"]], node.out.name))
        for r in range(lo.B):
            lo.g.add(Task(f"{node.out.name}[b{r}]", ops.OP_ADD_NORM, dict(bi=r, out=lo.S.off(node.out.name)),
                          lo.waits([node.args["x"]]), st.counter, [lo.S.region(node.args["x"].name)],
                          [lo.S.region(node.out.name)]))
        lo.stage_of[node.out.name] = st

    seen = []
    monkeypatch.setitem(ops.RULES, "double", OpRule("double", reference, lower_double,
                                                    plan=lambda pl, node: seen.append(node.out.name)))
    g = StepGraph("toy-op", {"tok": (10, 16)})
    x = g.embed("x", "tok")
    y = Value("y", 16)
    g.values["y"] = y
    g.nodes.append(Node("double", y, dict(x=x)))
    p = plan(g, 2, Tiling(16, 32, 8, 1, 1))
    assert seen == ["y"] and p.shapes["y"] == (2, 16)
    tasks = lower(p).tasks
    doubles = [t for t in tasks if t.name.startswith("y[")]
    assert [t.name for t in doubles] == ["y[b0]", "y[b1]"]
    assert all(t.waits == [("x", 1)] for t in doubles)   # after the one embed tile of x
    w = {"tok": torch.randn(10, 16)}
    out = run_reference(g, w, {}, [3, 7], [0, 0])
    torch.testing.assert_close(out["y"], 2 * w["tok"][[3, 7]])
