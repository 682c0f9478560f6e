"""The reference ops in plain PyTorch: the CPU path, and the definition other backends must match.

backends/contract.py states every op's semantics; the functions here are those statements written as
directly as PyTorch allows (readability over speed). Shapes: activations are [..., features];
attention takes q [B, Hq, Tq, D] and k, v [B, Hkv, Tk, D], where the Tq queries are the last Tq of
the Tk positions (decode: Tq = 1); the recurrent ops are time-major [B, T, ...].
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

NAME = "reference"
# contract.CAPABILITIES: plain PyTorch, op by op; a decode step is the model's own code.
CAPTURES_STEPS = False
COMPILES_STEPS = False


def activate(y: torch.Tensor, activation: str | None) -> torch.Tensor:
    """The contract's activations (None, "gelu" (erf), "gelu_tanh", "silu", "sigmoid") in y's dtype."""
    if activation is None:
        return y
    if activation == "gelu":
        return F.gelu(y)
    if activation == "gelu_tanh":
        return F.gelu(y, approximate="tanh")
    if activation == "silu":
        return F.silu(y)
    if activation == "sigmoid":
        return torch.sigmoid(y)
    raise ValueError(f"unknown activation {activation!r}")


# ---------------------------------------------------------------- dense layers and norms

def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           activation: str | None = None, residual: torch.Tensor | None = None) -> torch.Tensor:
    """act(x @ weight.T + bias) + residual; activation is None, "gelu" (erf), "gelu_tanh" or "silu"."""
    if activation == "sigmoid":
        raise ValueError("linear: unknown activation 'sigmoid'")
    out_shape = (*x.shape[:-1], weight.shape[0])
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"linear: bias {tuple(bias.shape)} for weight {tuple(weight.shape)}: not [N]")
    if residual is not None and not _broadcasts_to(residual.shape, out_shape):
        raise ValueError(f"linear: residual {tuple(residual.shape)} does not broadcast to the output "
                         f"{out_shape} of x {tuple(x.shape)} and weight {tuple(weight.shape)}")
    y = activate(F.linear(x, weight, bias), activation)
    return y if residual is None else y + residual


def _broadcasts_to(shape: torch.Size, target: tuple[int, ...]) -> bool:
    """Whether a tensor of `shape` broadcasts to `target` without changing it."""
    try:
        return tuple(torch.broadcast_shapes(shape, target)) == tuple(target)
    except RuntimeError:
        return False


def _check_norm(op: str, x: torch.Tensor, **params: torch.Tensor | None) -> None:
    """A norm's weight / bias: one value per feature of x's last dim, [N]."""
    for name, t in params.items():
        if t is not None and tuple(t.shape) != (x.shape[-1],):
            raise ValueError(f"{op}: {name} {tuple(t.shape)} for x {tuple(x.shape)}: not [{x.shape[-1]}]")


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               eps: float = 1e-5) -> torch.Tensor:
    _check_norm("layer_norm", x, weight=weight, bias=bias)
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float = 1e-6,
             offset: float = 0.0) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * (offset + weight) over the last dim, in fp32."""
    _check_norm("rms_norm", x, weight=weight)
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * (offset + weight.float())
    return y.to(x.dtype)


def rms_norm_gated(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor,
                   eps: float = 1e-6) -> torch.Tensor:
    """rms_norm(x, weight) * silu(gate): norm first, then the gate."""
    _check_norm("rms_norm_gated", x, weight=weight)
    return (rms_norm(x.float(), weight, eps) * F.silu(gate.float())).to(x.dtype)


def add_layer_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                   bias: torch.Tensor | None, eps: float = 1e-5, rms: bool = False,
                   offset: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(x + residual), x + residual), the norm scaled by (offset + weight). The residual
    broadcasts to x; both outputs have x's shape and dtype (the norm is taken of the sum before it is
    rounded to that dtype)."""
    if not _broadcasts_to(residual.shape, tuple(x.shape)):
        raise ValueError(f"add_layer_norm: residual {tuple(residual.shape)} does not broadcast to x {tuple(x.shape)}")
    _check_norm("add_layer_norm", x, weight=weight, bias=bias)
    s = x + residual
    w = offset + weight.float()
    if rms:
        y = rms_norm(s.float(), w, eps)
        if bias is not None:
            y = y + bias.float()
    else:
        y = F.layer_norm(s.float(), (s.shape[-1],), w, None if bias is None else bias.float(), eps)
    return y.to(x.dtype), s.to(x.dtype)


def glu(gate: torch.Tensor, up: torch.Tensor, activation: str = "silu", up_offset: float = 0.0) -> torch.Tensor:
    """act(gate) * (up + up_offset)."""
    if activation is None:
        raise ValueError("glu needs an activation")
    return (activate(gate.float(), activation) * (up.float() + up_offset)).to(gate.dtype)


# ---------------------------------------------------------------- attention

def _check_gqa(hq: int, hkv: int) -> None:
    """Query head h reads kv head h // (Hq // Hkv): Hq must be a multiple of Hkv."""
    if hq % hkv:
        raise ValueError(f"{hq} query heads are not a multiple of {hkv} kv heads")


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
              prefix_len: int = 0, scale: float | None = None, window: int | None = None,
              bias: torch.Tensor | None = None) -> torch.Tensor:
    """Softmax attention. With `causal`, query i (absolute position p = Tk - Tq + i) sees keys
    j <= p, and with a window only j > p - window; the first `prefix_len` positions additionally see
    each other (a bidirectional prefix block, as Moondream's image tokens need). Keys no query can
    see are sliced away before anything reads them. `bias` [B or 1, Hq, Tq, Tk] is added to the
    scaled scores of the visible keys (invisible ones stay -inf)."""
    if window is not None and not causal:
        raise ValueError("attention: a window needs causal=True")
    tq, tk = q.shape[-2], k.shape[-2]
    if bias is not None and (bias.dim() != 4 or bias.shape[0] not in (1, q.shape[0])
                             or tuple(bias.shape[1:]) != (q.shape[1], tq, tk)):
        raise ValueError(f"attention: bias {tuple(bias.shape)} is not [B or 1, Hq, Tq, Tk] = "
                         f"[{q.shape[0]} or 1, {q.shape[1]}, {tq}, {tk}]")
    if causal and tq > tk and min(prefix_len, tk) < 1:
        # the first Tq - Tk queries sit before position 0: no key is visible to them
        raise ValueError(f"attention: causal with q {tuple(q.shape)} longer than k {tuple(k.shape)} "
                         f"(Tq {tq} > Tk {tk}) puts queries before position 0, which see no key "
                         f"(prefix_len {prefix_len})")
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    lo = 0
    if window is not None and tk - tq >= prefix_len:
        lo = max(0, tk - tq - window + 1)  # the first query's first key: nothing before it is visible
    _check_gqa(q.shape[1], k.shape[1])
    # GQA by SDPA itself (enable_gqa): no copy of the repeated kv heads per layer.
    k, v, gqa = k[:, :, lo:], v[:, :, lo:], q.shape[1] != k.shape[1]
    if causal and tq == tk and not (prefix_len or window is not None or bias is not None):
        # the plain causal square: SDPA's own is_causal, no [Tq, Tk] mask built per layer
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    mask = None
    if causal:
        qpos = torch.arange(tk - tq, tk, device=q.device)[:, None]
        kpos = torch.arange(lo, tk, device=q.device)[None, :]
        band = kpos <= qpos
        if window is not None:
            band = band & (kpos > qpos - window)
        mask = band | ((qpos < prefix_len) & (kpos < prefix_len))
    if bias is not None:
        # SDPA adds a float mask to the scaled scores; the visibility mask is folded in as -inf.
        add = bias[..., lo:].to(q.dtype)
        mask = add if mask is None else add.masked_fill(~mask, float("-inf"))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)


def kv_append(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              pos: torch.Tensor) -> None:
    """k_cache[b, :, pos[b]:pos[b]+T_new] = k[b] (same for v), in place: rows of a batch that are
    at different positions (requests of different lengths decoded together)."""
    t_new = k.shape[2]
    rows = torch.arange(k.shape[0], device=k.device)[:, None]
    cols = pos.to(device=k.device, dtype=torch.long)[:, None] + torch.arange(t_new, device=k.device)
    # advanced indices [B, T_new] on dims 0 and 2 put those dims first: [B, T_new, H, D]
    k_cache[rows, :, cols] = k.transpose(1, 2).to(k_cache.dtype)
    v_cache[rows, :, cols] = v.transpose(1, 2).to(v_cache.dtype)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     lengths: torch.Tensor, scale: float | None = None,
                     window: int | None = None) -> torch.Tensor:
    """One query per (b, h): q [B, Hq, 1, D] over keys [max(0, n - window), n) of k/v [B, Hkv, T_max, D],
    n = lengths[b]. Positions outside that range are never read (they may hold anything, NaN
    included: a mask would still multiply them by zero), so each row attends over its own slice."""
    hq, hkv = q.shape[1], k_cache.shape[1]
    _check_gqa(hq, hkv)
    if tuple(lengths.shape) != (q.shape[0],):   # one length per row: no row dropped or invented
        raise ValueError(f"decode_attention: lengths {tuple(lengths.shape)} for q {tuple(q.shape)}: "
                         f"one length per row, [{q.shape[0]}]")
    out = []
    for b, n in enumerate(lengths.tolist()):
        if n <= 0:   # no keys: zeros (the contract), where SDPA would give NaN
            out.append(torch.zeros_like(q[b:b + 1]))
            continue
        lo = 0 if window is None else max(0, n - window)
        out.append(F.scaled_dot_product_attention(q[b:b + 1], k_cache[b:b + 1, :, lo:n], v_cache[b:b + 1, :, lo:n],
                                                  scale=scale, enable_gqa=hq != hkv))
    return torch.cat(out)


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rot_dim: int) -> torch.Tensor:
    """Rotary embedding on the first `rot_dim` features of each head (the rest pass through),
    rotating pairs (i, i + rot_dim/2) — the "rotate half" convention. cos/sin: [T, rot_dim/2]."""
    rot, rest = x[..., :rot_dim], x[..., rot_dim:]
    x1, x2 = rot.chunk(2, dim=-1)
    out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return torch.cat([out.to(x.dtype), rest], dim=-1)   # x's dtype, whatever cos/sin hold


# ---------------------------------------------------------------- token choice

def argmax(logits: torch.Tensor, allowed: torch.Tensor | None = None) -> torch.Tensor:
    """Greedy pick over the last dim; `allowed` (bool, broadcastable) masks out the rest."""
    if allowed is not None:
        logits = logits.masked_fill(~allowed, float("-inf"))
    return logits.argmax(dim=-1)


def sample(logits: torch.Tensor, temperature: float, top_p: float, uniform: torch.Tensor) -> torch.Tensor:
    """Temperature + nucleus sampling with caller-supplied uniforms (one per row), sort-based."""
    if temperature <= 0:
        return argmax(logits)
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    x = logits.reshape(-1, logits.shape[-1]).float()
    e = torch.exp((x - x.max(-1, keepdim=True).values) / temperature)
    if top_p < 1.0:
        desc = e.sort(-1, descending=True).values
        # theta: the smallest kept value, at the first rank whose cumulative mass reaches top_p * Z
        first = (desc.cumsum(-1) >= top_p * e.sum(-1, keepdim=True)).float().argmax(-1, keepdim=True)
        theta = desc.gather(-1, first)
        e = torch.where(e >= theta, e, torch.zeros_like(e))
    target = uniform.reshape(-1, 1).float() * e.sum(-1, keepdim=True)
    kept = e > 0
    crossed = (e.cumsum(-1) > target) & kept
    # The sum and the running sum round differently: for u near 1 none may cross the target, and
    # argmax of no crossing would be token 0, barred or not. The last kept token is the draw then.
    last = torch.where(kept, torch.arange(e.shape[-1], device=e.device), 0).amax(-1)
    token = torch.where(crossed.any(-1), crossed.float().argmax(-1), last)
    return token.view(logits.shape[:-1])


# ---------------------------------------------------------------- mixture of experts

def moe_route(logits: torch.Tensor, top_k: int, renormalize: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights fp32, ids int64) of the top_k experts per row: descending logit, lower id first on ties."""
    probs = torch.softmax(logits.float(), dim=-1)
    ids = torch.sort(logits.float(), dim=-1, descending=True, stable=True).indices[..., :top_k]
    weights = probs.gather(-1, ids)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights, ids


def moe(x: torch.Tensor, router_w: torch.Tensor, router_b: torch.Tensor | None, experts_gate_up: torch.Tensor,
        experts_down: torch.Tensor, top_k: int, activation: str = "silu", up_offset: float = 0.0,
        renormalize: bool = True) -> torch.Tensor:
    """Router, top-k, and the weighted sum of the chosen experts' gated MLPs: only the chosen
    experts' weights are touched. Each expert runs once over the (token, slot) pairs routed to it (a
    prefill's hundreds of tokens are a few matrix products, not a Python loop per token); a token's
    slots are then summed in slot order."""
    d = x.shape[-1]
    f = experts_down.shape[-1]
    xs = x.reshape(-1, d).float()
    weights, ids = moe_route(F.linear(xs, router_w.float(), None if router_b is None else router_b.float()),
                             top_k, renormalize)
    per_slot = xs.new_zeros(xs.shape[0] * top_k, d)          # row t * top_k + slot
    flat_ids, flat_weights = ids.reshape(-1), weights.reshape(-1)
    for e in torch.unique(flat_ids).tolist():
        pairs = (flat_ids == e).nonzero().squeeze(1)
        gate_up = xs[pairs // top_k] @ experts_gate_up[e].float().T
        h = glu(gate_up[:, :f], gate_up[:, f:], activation, up_offset)
        per_slot[pairs] = flat_weights[pairs, None] * (h @ experts_down[e].float().T)
    slots = per_slot.view(-1, top_k, d)
    y = torch.zeros_like(xs)
    for slot in range(top_k):
        y += slots[:, slot]
    return y.to(x.dtype).view(x.shape)


# ---------------------------------------------------------------- recurrent and convolutional state

def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  state: torch.Tensor | None = None,
                  activation: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """y[t] = act(bias + sum_j weight[:, j] * xp[t + j]) with xp = [state; x] along time."""
    if activation not in (None, "silu"):
        raise ValueError(f"causal_conv1d: unknown activation {activation!r}")
    b, t, c = x.shape
    w = weight.shape[1]
    if state is None:
        state = x.new_zeros(b, w - 1, c)
    xp = torch.cat([state.to(x.dtype), x], dim=1).float()  # [B, W-1+T, C]
    y = torch.zeros(b, t, c, dtype=torch.float32, device=x.device)
    for j in range(w):
        y += weight[:, j].float() * xp[:, j:j + t]
    if bias is not None:
        y += bias.float()
    y = activate(y, activation)
    return y.to(x.dtype), xp[:, xp.shape[1] - (w - 1):].to(x.dtype)


def _delta_inputs(q, k, v, g, beta, scale, qk_l2norm):
    """fp32 copies with q/k heads repeated up to the value heads, l2-normalised and q scaled."""
    hv, hk = v.shape[-2], k.shape[-2]
    if hv % hk:
        raise ValueError(f"gated delta rule: {hv} value heads are not a multiple of {hk} key heads")
    q, k = q.float().repeat_interleave(hv // hk, dim=-2), k.float().repeat_interleave(hv // hk, dim=-2)
    if qk_l2norm:
        q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    scale = scale if scale is not None else q.shape[-1] ** -0.5
    return q * scale, k, v.float(), g.float(), beta.float()


def gated_delta_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     state: torch.Tensor, scale: float | None = None,
                     qk_l2norm: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """S = S * exp(g); S += k (beta (v - S^T k))^T; o = S^T q, per (batch, value head)."""
    out_dtype = v.dtype
    q, k, v, g, beta = _delta_inputs(q, k, v, g, beta, scale, qk_l2norm)
    s = state.float() * g.exp()[..., None, None]                  # [B, H, Dk, Dv]
    predicted = torch.einsum("bhkv,bhk->bhv", s, k)               # S^T k
    s = s + k[..., :, None] * (beta[..., None] * (v - predicted))[..., None, :]
    o = torch.einsum("bhkv,bhk->bhv", s, q)
    return o.to(out_dtype), s


def gated_delta_chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                      state: torch.Tensor | None = None, scale: float | None = None, qk_l2norm: bool = False,
                      chunk_size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over T tokens in chunks of C (the WY / UT-transform form).

    Inside a chunk, with G_i = g_1 + ... + g_i (cumulative log decay from the chunk start) and S the
    state entering the chunk, the recurrence unrolls to S_i = exp(G_i) S + sum_{j<=i} exp(G_i - G_j)
    k_j u_j^T, where u_j is what token j writes. Substituting into u_i = beta_i (v_i - S_{i-1}^T k_i):
        (I + L) U = beta (V - exp(G) K S),  L_ij = beta_i exp(G_i - G_j) k_i.k_j  for j < i
    a unit lower-triangular system (one triangular solve per chunk). Then
        O = exp(G) Q S + (Q K^T * D) U,     D_ij = exp(G_i - G_j) for j <= i, else 0
        S' = exp(G_C) S + sum_j exp(G_C - G_j) k_j u_j^T.
    The tail chunk is padded with g = beta = 0 tokens, which leave the state unchanged.
    """
    out_dtype = v.dtype
    q, k, v, g, beta = _delta_inputs(q, k, v, g, beta, scale, qk_l2norm)
    bsz, t, h, dk = k.shape
    dv = v.shape[-1]
    # [B, T, H, ...] -> [B, H, T, ...], padded to whole chunks
    q, k, v = (z.transpose(1, 2) for z in (q, k, v))
    g, beta = g.transpose(1, 2), beta.transpose(1, 2)
    pad = (-t) % chunk_size
    q, k, v = (F.pad(z, (0, 0, 0, pad)) for z in (q, k, v))
    g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))
    s = (torch.zeros(bsz, h, dk, dv, device=q.device) if state is None else state.float().clone())
    c = chunk_size
    below = torch.ones(c, c, dtype=torch.bool, device=q.device).tril(-1)
    upto = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
    eye = torch.eye(c, device=q.device)
    out = []
    for c0 in range(0, t + pad, c):
        qc, kc, vc = q[:, :, c0:c0 + c], k[:, :, c0:c0 + c], v[:, :, c0:c0 + c]
        bc = beta[:, :, c0:c0 + c]
        gcum = g[:, :, c0:c0 + c].cumsum(-1)                                     # G_i
        diff = gcum[..., :, None] - gcum[..., None, :]                           # G_i - G_j
        decay = torch.where(upto, diff, torch.full_like(diff, float("-inf"))).exp()
        lower = torch.where(below, bc[..., :, None] * (kc @ kc.transpose(-1, -2)) * decay, torch.zeros_like(decay))
        rhs = bc[..., None] * (vc - gcum.exp()[..., None] * (kc @ s))
        u = torch.linalg.solve_triangular(eye + lower, rhs, upper=False, unitriangular=True)
        out.append(gcum.exp()[..., None] * (qc @ s) + ((qc @ kc.transpose(-1, -2)) * decay) @ u)
        g_end = gcum[..., -1:]
        s = g_end.exp()[..., None] * s + (kc * (g_end - gcum).exp()[..., None]).transpose(-1, -2) @ u
    o = torch.cat(out, dim=2)[:, :, :t].transpose(1, 2)
    return o.to(out_dtype), s


def lstm_cell(x: torch.Tensor, h: torch.Tensor, c: torch.Tensor, w_ih: torch.Tensor, w_hh: torch.Tensor,
              b_ih: torch.Tensor | None = None, b_hh: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One LSTM step, PyTorch's gate order (input, forget, cell, output)."""
    gates = F.linear(x.float(), w_ih.float(), None if b_ih is None else b_ih.float()) \
        + F.linear(h.float(), w_hh.float(), None if b_hh is None else b_hh.float())
    i, f, g, o = gates.chunk(4, dim=-1)
    c_new = torch.sigmoid(f) * c.float() + torch.sigmoid(i) * torch.tanh(g)
    h_new = torch.sigmoid(o) * torch.tanh(c_new)
    return h_new.to(x.dtype), c_new.to(x.dtype)
