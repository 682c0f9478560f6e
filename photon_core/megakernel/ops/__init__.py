"""The compiler's ops, each declared once, in its own module: its kernel op code(s), eager reference,
planning rule (checks, fusion), lowering (the tasks, their fields and the state regions each reads
and writes, which checker.check proves race-free) and extra state regions (OpRule, ops/base.py).
The StepGraph builder method of each op is stepgraph.StepGraph.<op>; the kernel's task body of each
code is kernel._task_<name>, dispatched by these codes (kernel._step_tasks).

Adding an op: a builder method on StepGraph, a module here with its RULE, listed below, and (if it
runs tasks of a new kind) a kernel op code in that module and its task body in kernel.py reading its
fields by the named offsets (kernel.F_*; fields are graph.FIELDS).
"""
from __future__ import annotations

from photon_core.megakernel.graph import OP_NAMES
from photon_core.megakernel.ops import add_norm, argmax, attention, embed, fused, kv_append, linear, moe, recurrent
from photon_core.megakernel.ops.add_norm import OP_ADD_NORM
from photon_core.megakernel.ops.argmax import OP_ARGMAX
from photon_core.megakernel.ops.attention import LEN_CROSS, LEN_SELF, OP_ATTN_MERGE, OP_ATTN_PARTIAL
from photon_core.megakernel.ops.base import Eager, Lowering, OpRule, Planning, Stage
from photon_core.megakernel.ops.embed import OP_EMBED
from photon_core.megakernel.ops.kv_append import OP_ROPE_APPEND
from photon_core.megakernel.ops.linear import MODE_LOGITS, MODE_PLAIN, MODE_QKV, OP_LINEAR, OP_LINEAR_SPLIT
from photon_core.megakernel.ops.moe import OP_MOE_DOWN, OP_MOE_ROUTE, OP_MOE_SUM, OP_MOE_UP
from photon_core.megakernel.ops.recurrent import OP_CONV_STEP, OP_DELTA_STEP

RULES: dict[str, OpRule] = {}
for _rule in (*fused.RULES, embed.RULE, linear.RULE, kv_append.RULE, attention.RULE, add_norm.RULE,
              recurrent.CONV_RULE, recurrent.DELTA_RULE, moe.RULE, argmax.RULE):
    if _rule.op in RULES:
        raise ValueError(f"op {_rule.op!r} declared twice")
    RULES[_rule.op] = _rule

# Kernel op code -> name, over every rule (the task table's op column; kernel._step_tasks), kept in
# graph.OP_NAMES (graph.py names ops without importing them).
_names: dict[int, str] = {}
for _rule in RULES.values():
    for _code, _name in _rule.codes.items():
        if _code in _names or _code <= 0:
            raise ValueError(f"kernel op code {_code} ({_name}) declared twice or not positive")
        _names[_code] = _name
OP_NAMES.clear()
OP_NAMES.update(sorted(_names.items()))
# Kernel ops whose tasks may draw a tile ticket (split-K slices).
KTICKET_OPS = frozenset(c for r in RULES.values() for c in r.kticket_codes)


def rule(op: str) -> OpRule:
    """The rule of step-graph op `op`."""
    try:
        return RULES[op]
    except KeyError:
        raise ValueError(f"no rule for op {op!r}; ops: {sorted(RULES)}") from None


__all__ = ["RULES", "OP_NAMES", "KTICKET_OPS", "rule", "OpRule", "Planning", "Lowering", "Eager", "Stage",
           "OP_EMBED", "OP_LINEAR", "OP_ATTN_PARTIAL", "OP_ATTN_MERGE", "OP_ARGMAX", "OP_ROPE_APPEND",
           "OP_LINEAR_SPLIT", "OP_CONV_STEP", "OP_DELTA_STEP", "OP_ADD_NORM", "OP_MOE_ROUTE", "OP_MOE_UP",
           "OP_MOE_DOWN", "OP_MOE_SUM", "MODE_PLAIN", "MODE_QKV", "MODE_LOGITS", "LEN_SELF", "LEN_CROSS"]
