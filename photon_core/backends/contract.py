"""The ops contract: every op a model may call, its exact signature and its exact semantics.

A backend is a module of plain functions (backends/reference.py is the definition, backends/triton.py
the per-op Triton kernels, the megakernel module re-exports those). `Ops` below is the written contract:
a typing.Protocol whose methods carry the signatures and, in their docstrings, the semantics every
backend must reproduce. `check_backend(module)` verifies that a module implements all of them with
compatible signatures; test/test_ops_conformance.py runs every op of every backend against the
reference on random inputs.

Rules shared by every op (an op's docstring only states where it differs):

* Compute in fp32; a floating output has the dtype of the op's main input (x, q, logits, ...) unless
  stated. Integer outputs (token and expert ids) are int64.
* Inputs are not modified, except the caches/states an op says it writes in place.
* Outputs are fresh tensors. Backends may allocate them poisoned (NaN) in tests: every element of an
  output is written.
* "Never reads" promises are tested by filling that memory with NaN: the result must be the same as
  with ordinary values there. A masked-out value multiplied by zero is still a read (0 * NaN = NaN).
* Extra trailing keyword parameters with defaults are allowed in a backend (tiling knobs, checks);
  model code calls only what is written here.

Conventions: attention tensors are [B, H, T, D] (heads before time); the recurrent ops (conv1d, delta
rule) are time-major [B, T, ...], which is what a linear layer produces, so no transpose is needed.
"""
from __future__ import annotations

import inspect
from types import ModuleType
from typing import Protocol, runtime_checkable

import torch

Tensor = torch.Tensor

# The activations `linear` fuses, and the gate activations `glu` and `moe` accept.
LINEAR_ACTIVATIONS = (None, "gelu", "gelu_tanh", "silu")
GLU_ACTIVATIONS = ("silu", "gelu", "gelu_tanh", "sigmoid")


@runtime_checkable
class Ops(Protocol):
    """Every op of a backend. Methods are written with `self` only because Protocol needs it; a
    backend provides them as module-level functions."""

    # ---------------------------------------------------------------- dense layers and norms

    def linear(self, x: Tensor, weight: Tensor, bias: Tensor | None = None, activation: str | None = None,
               residual: Tensor | None = None) -> Tensor:
        """y = act(x @ weight.T + bias) + residual.

        x [..., K], weight [N, K], bias [N] or None, residual None or broadcastable to the output
        [..., N] (e.g. [N]; other shapes: ValueError) -> [..., N], dtype
        torch.result_type(x, weight). activation: None, "gelu" (erf), "gelu_tanh" (tanh approximation)
        or "silu" (x * sigmoid(x)); the residual is added AFTER the activation. fp32 accumulation.
        """

    def layer_norm(self, x: Tensor, weight: Tensor, bias: Tensor | None, eps: float = 1e-5) -> Tensor:
        """F.layer_norm over the last dim: (x - mean) / sqrt(var + eps) * weight + bias, var biased."""

    def rms_norm(self, x: Tensor, weight: Tensor | None, eps: float = 1e-6, offset: float = 0.0) -> Tensor:
        """y = x / sqrt(mean(x^2) + eps) * (offset + weight) over the last dim.

        weight [N] or None (no scale at all, offset ignored: Gemma 4's v_norm); offset 1.0 gives the (1 + weight)
        parametrisation of Qwen3-Next / Qwen 3.5 (their weight is stored centred at 0); Gemma 4 uses
        offset 0.0. The statistic is computed in fp32; the product is taken in fp32 and cast once.
        """

    def rms_norm_gated(self, x: Tensor, gate: Tensor, weight: Tensor, eps: float = 1e-6) -> Tensor:
        """y = rms_norm(x, weight, eps) * silu(gate): Qwen 3.5 Gated DeltaNet's output norm (norm
        before gate; weight applied directly, no offset). x, gate [..., N], weight [N]."""

    def add_layer_norm(self, x: Tensor, residual: Tensor, weight: Tensor, bias: Tensor | None,
                       eps: float = 1e-5, rms: bool = False, offset: float = 0.0) -> tuple[Tensor, Tensor]:
        """s = x + residual; returns (norm(s), s): a pre-norm block's residual add fused with its norm.

        norm is layer_norm(s, offset + weight, bias) or, with rms, rms_norm(s) * (offset + weight)
        (+ bias when given). Both outputs have x's shape and dtype: the residual must broadcast to x
        (ValueError otherwise). Norm weights and biases (here and in the norms above) are [N], N =
        x.shape[-1]; other shapes: ValueError.
        """

    def glu(self, gate: Tensor, up: Tensor, activation: str = "silu", up_offset: float = 0.0) -> Tensor:
        """Gated linear unit: act(gate) * (up + up_offset), elementwise, gate and up of one shape.

        activation: "silu" (SwiGLU: Qwen), "gelu_tanh" (GeGLU: Gemma's gelu_pytorch_tanh), "gelu" (erf),
        "sigmoid" (the conformer's GLU, where the gate is the SECOND half: glu(b, a, "sigmoid")).
        up_offset 1.0 is Moondream 3's expert activation gelu(h) * (g + 1). gate/up may be strided views
        of one fused projection (y[..., :F], y[..., F:]): their last dim must be contiguous.
        A fused gate-up projection is linear(x, cat([W_gate, W_up])) followed by this op.
        """

    # ---------------------------------------------------------------- attention

    def attention(self, q: Tensor, k: Tensor, v: Tensor, causal: bool = False, prefix_len: int = 0,
                  scale: float | None = None, window: int | None = None, bias: Tensor | None = None) -> Tensor:
        """Softmax attention of q [B, Hq, Tq, D] over k, v [B, Hkv, Tk, D] -> [B, Hq, Tq, D].

        Grouped-query attention: Hkv divides Hq and query head h uses kv head h // (Hq // Hkv) (the
        repeat_interleave / transformers repeat_kv order); Hkv == Hq is plain multi-head attention.
        Query i sits at absolute position p = Tk - Tq + i (the queries are the last Tq positions).
        Visibility of key j to that query: everything when not `causal`; with `causal`,
          (j <= p  and  (window is None or j > p - window))  or  (p < prefix_len and j < prefix_len)
        i.e. a causal band of `window` keys ending at the query itself, plus a bidirectional prefix
        block (Moondream's image tokens). `window` (>= 1) requires `causal` (ValueError otherwise).
        scale defaults to 1/sqrt(D). A query at p >= 0 sees at least itself, so no row is empty; with
        `causal` and Tq > Tk the first Tq - Tk queries sit before position 0 and see only the prefix
        block, so that needs prefix_len >= 1 and Tk >= 1 (ValueError otherwise).
        Never reads: keys/values before the first position any query can see (with a window,
        j <= Tk - Tq - window when prefix_len == 0).
        bias: None, or a float tensor [B or 1, Hq, Tq, Tk] (a leading 1 broadcasts over the batch)
        ADDED to the scaled scores before the softmax: s[i, j] = scale * q_i . k_j + bias[b, h, i, j]
        (a position term such as Transformer-XL's relative attention, or an additive mask). It does
        not replace the masks: with `causal`/`window`/`prefix_len` the invisible keys stay at -inf
        whatever the bias holds (bias entries of invisible keys are never used, they may be NaN), and
        the bias only moves the visible ones. A bias of 0 is no bias; a bias of -inf hides a key; a
        row whose every visible score is -inf is undefined (0/0). Computed in fp32 on Triton.
        """

    def decode_attention(self, q: Tensor, k_cache: Tensor, v_cache: Tensor, lengths: Tensor,
                         scale: float | None = None, window: int | None = None) -> Tensor:
        """One query per row: q [B, Hq, 1, D] over a KV cache k/v [B, Hkv, T_max, D] -> [B, Hq, 1, D].

        Row b's query sits at position lengths[b] - 1 (int tensor [B] on q's device, other shapes a
        ValueError; 0 <= lengths[b] <= T_max) and sees keys [lengths[b] - window, lengths[b]) clipped
        at 0 (all of [0, lengths[b]) without a window). A row of length 0 sees no key and its output
        is zeros (a padding row, or a cross-attention state not yet filled: never 0 / 0, whose NaN
        would reach the logits).
        GQA as in `attention`. Also serves cross-attention (lengths = encoder length).
        Never reads: cache positions >= lengths[b], or before the window; they may hold NaN.
        """

    def kv_append(self, k_cache: Tensor, v_cache: Tensor, k: Tensor, v: Tensor, pos: Tensor) -> None:
        """In place: k_cache[b, :, pos[b]:pos[b]+T_new] = k[b] (same for v), cast to the cache dtype.

        Caches [B, H, T_max, D], new k/v [B, H, T_new, D], pos int tensor [B] on the device (rows at
        different positions). Positions past T_max are a caller bug (not written by Triton; an
        IndexError in the reference). Nothing else in the caches changes.
        """

    def rotary(self, x: Tensor, cos: Tensor, sin: Tensor, rot_dim: int) -> Tensor:
        """Rotary embedding, "rotate half" convention, on the first rot_dim features of each head.

        x [..., T, D], cos/sin [T, rot_dim/2]: for x1 = x[..., :rot_dim/2], x2 = x[..., rot_dim/2:rot_dim],
        out = [x1*cos - x2*sin, x2*cos + x1*sin, x[..., rot_dim:]] (the tail passes through).
        """

    # ---------------------------------------------------------------- token choice

    def argmax(self, logits: Tensor, allowed: Tensor | None = None) -> Tensor:
        """Greedy pick over the last dim -> int64 [...]. allowed (bool, broadcastable to logits) masks
        the others to -inf. Ties: the FIRST index wins (torch.argmax). An all-masked row returns 0.
        A NaN in a row: undefined (backends differ); callers refuse non-finite logits first."""

    def sample(self, logits: Tensor, temperature: float, top_p: float, uniform: Tensor) -> Tensor:
        """Temperature + nucleus sampling with caller-supplied uniforms u in [0, 1), one per row.

        logits [..., V] -> int64 [...]. temperature <= 0 means argmax. Otherwise e_i = exp((x_i - max)/T);
        with top_p < 1 the nucleus is {i : e_i >= theta} for the largest theta whose kept mass
        sum{e_i >= theta} is >= top_p * sum(e) (so tokens tied at theta are all kept); the token is the
        first index, in vocabulary order, whose running kept mass exceeds u * kept mass, or, where
        rounding leaves no running mass above it (u near 1), the last kept index (never one with e_i = 0).
        """

    # ---------------------------------------------------------------- mixture of experts

    def moe_route(self, logits: Tensor, top_k: int, renormalize: bool = True) -> tuple[Tensor, Tensor]:
        """Softmax router, top-k. logits [N, E] -> (weights [N, top_k] fp32, ids [N, top_k] int64).

        ids: the top_k largest logits in descending order; equal logits: the lower expert index first.
        weights: softmax(logits) at those ids; with `renormalize` divided by their sum (equivalently
        softmax over the chosen logits: Moondream 3, Qwen-MoE norm_topk_prob), else the plain
        probabilities over all E experts.
        """

    def moe(self, x: Tensor, router_w: Tensor, router_b: Tensor | None, experts_gate_up: Tensor,
            experts_down: Tensor, top_k: int, activation: str = "silu", up_offset: float = 0.0,
            renormalize: bool = True) -> Tensor:
        """Mixture-of-experts MLP. x [..., D] -> [..., D].

        logits = x @ router_w.T + router_b (router_w [E, D]); (w, ids) = moe_route(logits, top_k,
        renormalize); for each token and chosen expert e: h = glu(x @ G_e.T, x @ U_e.T, activation,
        up_offset) where experts_gate_up[e] = [G_e; U_e] is [2F, D] (gate rows first, up rows second),
        and y = sum_slots w * (h @ experts_down[e].T) (experts_down [E, D, F]). No expert biases.
        Moondream 3: activation "gelu", up_offset 1.0, renormalize True, 64 experts, top 8 (its
        shipped gate/up row interleave is undone at load time).
        Never reads: the weights of an expert no token chose (they may hold NaN).
        """

    # ---------------------------------------------------------------- recurrent and convolutional state

    def causal_conv1d(self, x: Tensor, weight: Tensor, bias: Tensor | None = None, state: Tensor | None = None,
                      activation: str | None = None) -> tuple[Tensor, Tensor]:
        """Causal depthwise conv over time, with carried state. Returns (y, new_state).

        x [B, T, C] (time-major, channels last), weight [C, W] (nn.Conv1d(groups=C).weight[:, 0]),
        bias [C] or None, state [B, W-1, C]: the W-1 inputs before x[:, 0], oldest first (None: zeros).
        With xp = cat([state, x], dim=1): y[b, t, c] = act(bias[c] + sum_j weight[c, j] * xp[b, t+j, c]),
        so weight[:, W-1] multiplies the current input (F.conv1d's cross-correlation, left padding).
        activation: None or "silu". new_state = xp[:, -(W-1):] (the last W-1 inputs), in x's dtype.
        Prefill from an empty state and T single-token steps carrying the state give the same y.
        A non-causal "same" conv (the conformer's) is this op on x padded with (W-1)//2 zero frames at
        the end, dropping the first (W-1)//2 outputs.
        """

    def gated_delta_step(self, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor,
                         scale: float | None = None, qk_l2norm: bool = False) -> tuple[Tensor, Tensor]:
        """One token of the gated delta rule (Gated DeltaNet; transformers' torch_recurrent_gated_delta_rule).

        q, k [B, Hk, Dk]; v [B, Hv, Dv]; g, beta [B, Hv]; state [B, Hv, Dk, Dv] (fp32). Hk divides Hv;
        value head h uses q/k head h // (Hv // Hk). Per (b, h), with S the [Dk, Dv] state:
          if qk_l2norm: q = q * rsqrt(sum(q^2) + 1e-6), k likewise   (FLA's l2norm)
          q = q * scale                                             (scale defaults to Dk ** -0.5)
          S = S * exp(g)                                            (g: log-space decay, <= 0)
          S = S + k (beta * (v - S^T k))^T                          (the delta rule write)
          o = S^T q                                                 (read AFTER the write)
        Returns (o [B, Hv, Dv] in v's dtype, new state [B, Hv, Dk, Dv] fp32). The input state is not
        modified.
        """

    def gated_delta_chunk(self, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                          state: Tensor | None = None, scale: float | None = None,
                          qk_l2norm: bool = False) -> tuple[Tensor, Tensor]:
        """The gated delta rule over T tokens (prefill): exactly T `gated_delta_step`s, computed in chunks.

        q, k [B, T, Hk, Dk]; v [B, T, Hv, Dv]; g, beta [B, T, Hv]; state [B, Hv, Dk, Dv] or None
        (zeros). Returns (o [B, T, Hv, Dv] in v's dtype, final state fp32). Any chunk size gives the
        same result up to rounding (transformers' torch_chunk_gated_delta_rule uses 64).
        """

    def lstm_cell(self, x: Tensor, h: Tensor, c: Tensor, w_ih: Tensor, w_hh: Tensor,
                  b_ih: Tensor | None = None, b_hh: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """torch.nn.LSTMCell: gates = x @ w_ih.T + b_ih + h @ w_hh.T + b_hh, split (i, f, g, o).

        x [B, I], h, c [B, H], w_ih [4H, I], w_hh [4H, H]. c' = sigmoid(f) * c + sigmoid(i) * tanh(g),
        h' = sigmoid(o) * tanh(c'). Returns (h', c') in x's dtype.
        """


def _contract_functions() -> dict[str, inspect.Signature]:
    sigs = {}
    for name, fn in Ops.__dict__.items():
        if name.startswith("_") or not callable(fn):
            continue
        sig = inspect.signature(fn)
        sigs[name] = sig.replace(parameters=list(sig.parameters.values())[1:])  # drop self
    return sigs


SIGNATURES: dict[str, inspect.Signature] = _contract_functions()
OP_NAMES: tuple[str, ...] = tuple(SIGNATURES)

# What a backend module declares beside its ops: how a family may run its per-token decode step on
# it. Model code chooses its decode path by these (`getattr(ops, "COMPILES_STEPS", False)`: an ops
# module from elsewhere declares nothing), never by a backend's name.
CAPABILITIES: dict[str, str] = {
    "CAPTURES_STEPS": "the ops a decode step calls never wait on the host, so a family may capture its "
                      "per-token step of op calls once as a CUDA graph and replay it (Whisper's per-op steps)",
    "COMPILES_STEPS": "the module also compiles a family's decode step graph (megakernel.stepgraph) into one "
                      "persistent launch (the family's megakernel_decode.py)",
}


class ContractError(TypeError):
    """A backend module misses ops of the contract or implements them with other signatures."""


def _signature_problems(name: str, want: inspect.Signature, fn: object) -> list[str]:
    if not callable(fn):
        return [f"{name}: not callable"]
    try:
        have = inspect.signature(fn)
    except (TypeError, ValueError):
        return [f"{name}: signature cannot be inspected"]
    problems = []
    want_params = list(want.parameters.values())
    have_params = [p for p in have.parameters.values()
                   if p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)]
    for i, w in enumerate(want_params):
        if i >= len(have_params):
            problems.append(f"{name}: missing parameter {w.name!r} (position {i})")
            continue
        h = have_params[i]
        if h.name != w.name:
            problems.append(f"{name}: parameter {i} is {h.name!r}, the contract has {w.name!r}")
        elif h.kind != w.kind:
            problems.append(f"{name}: parameter {w.name!r} is {h.kind.description}, the contract has "
                            f"{w.kind.description}")
        elif h.default is not w.default and h.default != w.default:
            problems.append(f"{name}: parameter {w.name!r} defaults to {h.default!r}, the contract has "
                            f"{w.default!r}")
    for h in have_params[len(want_params):]:
        if h.default is inspect.Parameter.empty:
            problems.append(f"{name}: extra parameter {h.name!r} has no default")
    return problems


def check_backend(module: ModuleType) -> None:
    """Raise ContractError naming every op `module` lacks or implements with another signature
    (parameter names, order, kinds and defaults must match the contract; extra trailing parameters
    need defaults), and every capability it does not declare."""
    problems = []
    for name, want in SIGNATURES.items():
        if not hasattr(module, name):
            problems.append(f"{name}: missing")
        else:
            problems += _signature_problems(name, want, getattr(module, name))
    for name in CAPABILITIES:
        if not isinstance(getattr(module, name, None), bool):
            problems.append(f"{name}: not declared (a bool: {CAPABILITIES[name]})")
    if problems:
        label = getattr(module, "__name__", repr(module))
        raise ContractError(f"backend {label} does not implement the ops contract:\n  " + "\n  ".join(problems))
