"""The recurrent ops, whose state is updated in place: conv_step (a causal depthwise conv, one new
input) and delta_rule (one token of the gated delta rule, Gated DeltaNet)."""
from __future__ import annotations

import torch

from photon_core.kernels.linear import activation_code
from photon_core.megakernel.graph import Task
from photon_core.megakernel.ops.base import FUSED, Eager, Lowering, OpRule, Planning, Stage
from photon_core.megakernel.stepgraph import Node

OP_CONV_STEP = 9      # a tile of channels of a causal depthwise conv, one new input; state shifted in place
OP_DELTA_STEP = 10    # (row, value head) of the gated delta rule; state updated in place; gated RMSNorm out


def plan(pl: Planning, node: Node) -> None:
    """Their inputs are read by their own tasks, so no fused op (only linears' loads fuse them) may
    produce one."""
    a = node.args
    if node.op == "delta_rule":
        pl.eps.add(a["eps"])
    for arg in ("x", "zba"):
        src = pl.producer.get(a[arg].name) if arg in a else None
        if src is not None and src.op in FUSED:
            raise ValueError(f"{pl.graph.name}: {node.op} {node.value.name!r} reads {src.op} "
                             f"{src.value.name!r}, which is fused into linears only")


def conv_reference(e: Eager, node: Node) -> torch.Tensor:
    from photon_core.backends import reference as ref
    a = node.args
    st = e.caches[a["state"].name]                      # [B, C, W-1]: channel-major in the arena
    xs = e.val(a["x"])[:, a["c0"]:a["c0"] + node.value.width]
    y, new = ref.causal_conv1d(xs[:, None, :], e.weight(a["w"]), None, st.transpose(1, 2), a["act"])
    st.copy_(new.transpose(1, 2))
    return y[:, 0]


def conv_lower(lo: Lowering, node: Node) -> None:
    """One task per tile of channels (all rows): the conv and its state shift in place."""
    g, a, B, S, W = lo.g, node.args, lo.B, lo.S, lo.W
    st = Stage(node.value.name, g.counter(node.value.name), ancestors=lo.ancestors([a["x"]], node.value.name))
    C, taps = lo.graph.weight_shapes[a["w"]]
    x, state = a["x"], a["state"].name
    for n0 in range(0, C, lo.bn):
        n1 = min(C, n0 + lo.bn)
        regions = [S.region(state, (r * C + n0) * (taps - 1), (r * C + n1) * (taps - 1)) for r in range(B)]
        g.add(Task(f"{node.value.name}[{n0}:{n1}]", OP_CONV_STEP,
                   dict(M=B, K=x.width, N=C, n0=n0, n1=n1, k0=a["c0"], x=S.off(x.name), w=W.off(a["w"]),
                        kc=S.off(state), Dh=taps, act=activation_code(a["act"]), out=S.off(node.value.name)),
                   lo.waits([x]), st.counter,
                   S.columns(x.name, B, x.width, a["c0"] + n0, a["c0"] + n1) + regions,
                   S.columns(node.value.name, B, C, n0, n1) + regions))
    lo.stage_of[node.value.name] = st


def delta_reference(e: Eager, node: Node) -> torch.Tensor:
    from photon_core.backends import reference as ref
    a, bsz = node.args, e.bsz
    st = e.caches[a["state"].name]
    hv, dk, dv = a["state"].shape
    hk = a["k_heads"]
    q, k, v = e.val(a["x"]).split([hk * dk, hk * dk, hv * dv], dim=1)
    zba = e.val(a["zba"])[:, a["c0"]:]
    z, b_, a_ = zba[:, :hv * dv], zba[:, hv * dv:hv * dv + hv], zba[:, hv * dv + hv:hv * dv + 2 * hv]
    g = -e.weight(a["a_log"]).exp() * torch.nn.functional.softplus(a_ + e.weight(a["dt_bias"]))
    o, new = ref.gated_delta_step(q.reshape(bsz, hk, dk), k.reshape(bsz, hk, dk), v.reshape(bsz, hv, dv),
                                  g, torch.sigmoid(b_), st, qk_l2norm=True)
    st.copy_(new)
    y = ref.rms_norm_gated(o, z.reshape(bsz, hv, dv), e.weight(a["norm_w"]), a["eps"])
    return y.reshape(bsz, hv * dv)


def delta_lower(lo: Lowering, node: Node) -> None:
    """One task per (row, value head): the state read, decayed, written and read again, then the
    gated per-head RMSNorm of the output."""
    g, a, B, S, W = lo.g, node.args, lo.B, lo.S, lo.W
    x, zba, state = a["x"], a["zba"], a["state"]
    hv, dk, dv = state.shape
    hk, c0 = a["k_heads"], a["c0"]
    st = Stage(node.value.name, g.counter(node.value.name), ancestors=lo.ancestors([x, zba], node.value.name))
    for r in range(B):
        for h in range(hv):
            j = h // (hv // hk)
            s0 = (r * hv + h) * dk * dv
            reads = [S.region(x.name, r * x.width + j * dk, r * x.width + (j + 1) * dk),
                     S.region(x.name, r * x.width + (hk + j) * dk, r * x.width + (hk + j + 1) * dk),
                     S.region(x.name, r * x.width + 2 * hk * dk + h * dv, r * x.width + 2 * hk * dk + (h + 1) * dv),
                     S.region(zba.name, r * zba.width + c0 + h * dv, r * zba.width + c0 + (h + 1) * dv),
                     S.region(zba.name, r * zba.width + c0 + hv * dv + h, r * zba.width + c0 + hv * dv + h + 1),
                     S.region(zba.name, r * zba.width + c0 + hv * dv + hv + h,
                              r * zba.width + c0 + hv * dv + hv + h + 1),
                     S.region(state.name, s0, s0 + dk * dv)]
            g.add(Task(f"{node.value.name}[b{r},h{h}]", OP_DELTA_STEP,
                       dict(K=x.width, N=zba.width, k0=c0, x=S.off(x.name), res=S.off(zba.name),
                            w=W.off(a["a_log"]), b=W.off(a["dt_bias"]), lnw=W.off(a["norm_w"]),
                            kc=S.off(state.name), H=hk, ntiles=hv, Dh=dk, Tmax=dv, bi=r, hi=h,
                            out=S.off(node.value.name)),
                       lo.waits([x, zba]), st.counter, reads,
                       [S.region(state.name, s0, s0 + dk * dv),
                        S.region(node.value.name, (r * hv + h) * dv, (r * hv + h + 1) * dv)]))
    lo.stage_of[node.value.name] = st


CONV_RULE = OpRule("conv_step", conv_reference, conv_lower, plan, codes={OP_CONV_STEP: "conv_step"})
DELTA_RULE = OpRule("delta_rule", delta_reference, delta_lower, plan, codes={OP_DELTA_STEP: "delta_step"})
