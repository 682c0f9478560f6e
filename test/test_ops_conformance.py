"""The ops contract (backends/contract.py): every op of every backend against the reference.

For each op in contract.OP_NAMES and each backend (reference; triton under TRITON_INTERPRET=1, set
here before triton is imported), random inputs of several odd shapes go through the backend and are
compared with the reference on the same inputs (fp32, relative error < 1e-4). Memory an op promises
never to read (KV positions past a row's length or outside its window, experts no token chose) is
filled with NaN for the backend under test, while the reference answer is computed on ordinary
values there: reading it would make the result NaN. Triton outputs are allocated NaN-poisoned too.

Then equation tests for the new references, each against an independent statement: chunked delta
rule == T recurrent steps; MoE == a dense loop over all experts; sliding window == full attention
under an explicit band mask; attention bias == added to the scaled scores (0 == no bias, a -inf mask
== masked attention); GQA == repeated kv heads; conv prefill == T single steps carrying the
state (and F.conv1d); lstm_cell == torch.nn.LSTMCell.
"""
import os

os.environ["TRITON_INTERPRET"] = "1"  # must precede the first import of triton
os.environ["PHOTON_POISON_OUTPUTS"] = "1"

import math  # noqa: E402
import zlib  # noqa: E402
from types import SimpleNamespace  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import photon_core.kernels as K  # noqa: E402
from photon_core.backends import contract  # noqa: E402
from photon_core.backends import reference as ref  # noqa: E402
from photon_core.backends.select import get_backend  # noqa: E402

K.POISON_OUTPUTS = True
tri = get_backend("triton", "cpu")
BACKENDS = {"reference": ref, "triton": tri}
RTOL = 1e-4
NAN = float("nan")


def close(got: torch.Tensor, want: torch.Tensor, tol: float = RTOL) -> None:
    assert got.shape == want.shape, (got.shape, want.shape)
    assert got.dtype == want.dtype, (got.dtype, want.dtype)
    assert torch.isfinite(got).all(), "non-finite output: an unwritten element or a read of poisoned memory"
    err = ((got.double() - want.double()).abs().max() / want.double().abs().max().clamp_min(1e-6)).item()
    assert err < tol, f"relative error {err:.2e}"


@pytest.fixture(autouse=True)
def _seed(request):
    # crc32, not hash(): str hashes change with every process (PYTHONHASHSEED), and a test's inputs
    # must be the same in every run.
    torch.manual_seed(zlib.crc32(request.node.name.encode()))


# ---------------------------------------------------------------- the contract itself

def test_contract_lists_every_op_with_a_docstring():
    assert len(contract.OP_NAMES) == len(set(contract.OP_NAMES)) >= 18
    for name in contract.OP_NAMES:
        assert (getattr(contract.Ops, name).__doc__ or "").strip(), f"{name} has no written semantics"


@pytest.mark.parametrize("backend", BACKENDS)
def test_backend_implements_the_whole_contract(backend):
    contract.check_backend(BACKENDS[backend])


def test_megakernel_backend_offers_the_whole_contract_as_triton_kernels():
    mega = get_backend("megakernel", "cpu")
    contract.check_backend(mega)
    assert all(getattr(mega, name) is getattr(tri, name) for name in contract.OP_NAMES)


def test_check_backend_names_every_problem():
    def linear(x, weight, bias=None, activation=None):  # residual missing
        return x

    def layer_norm(x, w, bias, eps=1e-5):  # parameter renamed
        return x

    def rms_norm(x, weight, eps=1e-5, offset=0.0):  # default changed
        return x

    def argmax(logits, allowed=None, *, extra):  # extra parameter without a default
        return logits

    fake = SimpleNamespace(__name__="fake", linear=linear, layer_norm=layer_norm, rms_norm=rms_norm,
                           argmax=argmax)
    with pytest.raises(contract.ContractError) as info:
        contract.check_backend(fake)
    msg = str(info.value)
    assert "linear: missing parameter 'residual'" in msg
    assert "layer_norm: parameter 1 is 'w'" in msg
    assert "rms_norm: parameter 'eps' defaults to 1e-05" in msg
    assert "argmax: extra parameter 'extra' has no default" in msg
    for name in contract.OP_NAMES:
        if name not in ("linear", "layer_norm", "rms_norm", "argmax"):
            assert f"{name}: missing" in msg


# ---------------------------------------------------------------- one case per op, run on every backend

CASES = {}


def case(fn):
    CASES[fn.__name__.removeprefix("case_")] = fn
    return fn


@case
def case_linear(B):
    for m, k, n, act in [(1, 64, 96, None), (5, 100, 77, "gelu"), (37, 48, 40, "silu"), (3, 33, 17, "gelu_tanh")]:
        x, w, b, r = torch.randn(m, k), torch.randn(n, k) / k**0.5, torch.randn(n), torch.randn(m, n)
        close(B.linear(x, w, b, act, r), ref.linear(x, w, b, act, r))
        close(B.linear(x.view(1, m, k), w), ref.linear(x.view(1, m, k), w))


@case
def case_layer_norm(B):
    for shape in [(1, 64), (3, 100), (2, 5, 130)]:
        x, w, b = torch.randn(shape) * 3 + 1, torch.randn(shape[-1]), torch.randn(shape[-1])
        close(B.layer_norm(x, w, b, 1e-5), ref.layer_norm(x, w, b, 1e-5))
        close(B.layer_norm(x, w, None), ref.layer_norm(x, w, None))


@case
def case_rms_norm(B):
    for shape in [(2, 96), (3, 5, 130), (7, 24)]:
        x, w = torch.randn(shape) * 2, torch.randn(shape[-1]) * 0.3
        close(B.rms_norm(x, w, 1e-6), ref.rms_norm(x, w, 1e-6))
        close(B.rms_norm(x, w, 1e-5, offset=1.0), ref.rms_norm(x, w, 1e-5, offset=1.0))
        close(B.rms_norm(x, None), ref.rms_norm(x, None))


@case
def case_rms_norm_gated(B):
    for shape in [(3, 64), (2, 4, 50)]:
        x, z, w = torch.randn(shape), torch.randn(shape) * 2, torch.randn(shape[-1])
        close(B.rms_norm_gated(x, z, w, 1e-6), ref.rms_norm_gated(x, z, w, 1e-6))


@case
def case_add_layer_norm(B):
    for shape, rms, offset, with_bias in [((2, 96), False, 0.0, True), ((3, 130), True, 1.0, False),
                                          ((1, 2, 70), True, 0.0, True)]:
        x, r, w = torch.randn(shape), torch.randn(shape), torch.randn(shape[-1])
        b = torch.randn(shape[-1]) if with_bias else None
        y, s = B.add_layer_norm(x, r, w, b, 1e-5, rms, offset)
        want_y, want_s = ref.add_layer_norm(x, r, w, b, 1e-5, rms, offset)
        close(s, want_s)
        close(y, want_y)


@case
def case_glu(B):
    for shape, act, off in [((3, 37), "silu", 0.0), ((2, 5, 64), "gelu_tanh", 0.0), ((4, 33), "gelu", 1.0),
                            ((1, 100), "sigmoid", 0.0)]:
        fused = torch.randn(*shape[:-1], 2 * shape[-1]) * 2  # one gate-up projection, split by views
        gate, up = fused[..., :shape[-1]], fused[..., shape[-1]:]
        close(B.glu(gate, up, act, off), ref.glu(gate, up, act, off))


def _attention_inputs(b, hq, hkv, tq, tk, d):
    return torch.randn(b, hq, tq, d), torch.randn(b, hkv, tk, d), torch.randn(b, hkv, tk, d)


@case
def case_attention(B):
    for b, hq, hkv, tq, tk, d, causal, prefix, window in [
        (1, 2, 2, 17, 17, 32, True, 0, None),     # causal prefill, ragged
        (2, 1, 1, 20, 20, 24, True, 7, None),     # bidirectional prefix block, D not a power of 2
        (1, 1, 1, 9, 30, 64, False, 0, None),     # bidirectional (encoder), queries = last 9 of 30
        (1, 4, 2, 19, 19, 16, True, 0, None),     # GQA
        (2, 6, 2, 21, 40, 24, True, 0, 9),        # GQA + sliding window, queries the last 21 of 40
        (1, 2, 1, 18, 18, 16, True, 5, 4),        # window + prefix block
        (2, 4, 4, 1, 33, 32, True, 0, 10),        # one query (decode through attention) with a window
    ]:
        q, k, v = _attention_inputs(b, hq, hkv, tq, tk, d)
        want = ref.attention(q, k, v, causal, prefix, None, window)
        if window is not None and tk - tq >= prefix:
            lo = tk - tq - window + 1  # keys before the first query's window: no query sees them
            if lo > 0:
                k, v = k.clone(), v.clone()
                k[:, :, :lo] = NAN
                v[:, :, :lo] = NAN
        close(B.attention(q, k, v, causal, prefix, None, window), want)
    q, k, v = _attention_inputs(1, 2, 2, 12, 12, 16)
    close(B.attention(q, k, v, True, 0, 0.3), ref.attention(q, k, v, True, 0, 0.3))  # explicit scale
    with pytest.raises(ValueError):
        B.attention(q, k, v, False, 0, None, 4)  # a window needs causal
    for b, hq, hkv, tq, tk, d, causal, prefix, window, bias_b in [
        (2, 2, 2, 17, 17, 32, False, 0, None, 2),  # per-batch bias, bidirectional (Parakeet's encoder)
        (2, 4, 2, 19, 19, 24, True, 0, None, 1),   # batch-shared bias, GQA, causal
        (1, 2, 1, 21, 40, 16, True, 5, 6, 1),      # bias + window + prefix, queries the last 21 of 40
        (2, 2, 2, 1, 23, 16, False, 0, None, 2),   # one query with a bias: not the decode path
    ]:
        q, k, v = _attention_inputs(b, hq, hkv, tq, tk, d)
        bias = 2 * torch.randn(bias_b, hq, tq, tk)
        want = ref.attention(q, k, v, causal, prefix, None, window, bias)
        if causal:  # bias entries of keys a query cannot see are never used
            p = torch.arange(tk - tq, tk)[:, None]
            j = torch.arange(tk)[None, :]
            seen = (j <= p) & ((window is None) | (j > p - (window or 0)))
            seen = seen | ((p < prefix) & (j < prefix))
            bias = bias.masked_fill(~seen, NAN)
        close(B.attention(q, k, v, causal, prefix, None, window, bias), want)
    with pytest.raises(ValueError):
        B.attention(q, k, v, False, 0, None, None, torch.zeros(b, hq, tq, tk + 1))  # bias of the wrong shape


@case
def case_decode_attention(B):
    for b, hq, hkv, t_max, d, lengths, window in [
        (3, 2, 2, 70, 32, [1, 37, 70], None),
        (3, 6, 2, 45, 24, [45, 3, 20], None),     # GQA, D not a power of 2
        (2, 8, 1, 50, 16, [50, 17], 7),           # multi-query + window
        (2, 2, 2, 33, 16, [5, 33], 40),           # window longer than the cache
        (2, 2, 2, 20, 16, [0, 12], None),         # a row with no keys (all NaN): zeros
    ]:
        q = torch.randn(b, hq, 1, d)
        kc, vc = torch.randn(b, hkv, t_max, d), torch.randn(b, hkv, t_max, d)
        lens = torch.tensor(lengths, dtype=torch.int32)
        want = ref.decode_attention(q, kc, vc, lens, None, window)
        kp, vp = kc.clone(), vc.clone()
        for i, n in enumerate(lengths):  # past each row's length, and before its window: NaN
            kp[i, :, n:] = vp[i, :, n:] = NAN
            if window is not None:
                kp[i, :, :max(0, n - window)] = vp[i, :, :max(0, n - window)] = NAN
        assert torch.isnan(kp).any()
        got = B.decode_attention(q, kp, vp, lens, None, window)
        empty = [i for i, n in enumerate(lengths) if n == 0]
        assert torch.equal(got[empty], torch.zeros_like(got[empty])) and torch.equal(want[empty], got[empty])
        close(got, want)
        if B is tri:  # several KV splits, some of them empty, through both phase-1 kernels
            close(tri.decode_attention(q, kp, vp, lens, None, window, num_splits=5, block_t=16), want)


@case
def case_kv_append(B):
    b, h, t_max, d = 3, 2, 11, 20
    kc, vc = torch.randn(b, h, t_max, d), torch.randn(b, h, t_max, d)
    k, v = torch.randn(b, h, 2, d), torch.randn(b, h, 2, d)
    pos = torch.tensor([0, 9, 4], dtype=torch.int32)
    want_k, want_v = kc.clone(), vc.clone()
    for i, p in enumerate(pos.tolist()):
        want_k[i, :, p:p + 2] = k[i]
        want_v[i, :, p:p + 2] = v[i]
    assert B.kv_append(kc, vc, k, v, pos) is None
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)


@case
def case_rotary(B):
    for shape, rot in [((1, 2, 5, 32), 32), ((2, 3, 7, 64), 32), ((1, 1, 3, 24), 10)]:
        x = torch.randn(shape)
        ang = torch.randn(shape[-2], rot // 2)
        close(B.rotary(x, ang.cos(), ang.sin(), rot), ref.rotary(x, ang.cos(), ang.sin(), rot))


@case
def case_argmax(B):
    for rows, v in [(1, 1000), (3, 2053), (2, 51)]:
        x = torch.randn(rows, v)
        x[0, 7] = x[0, v - 3] = x.max() + 1  # a tie: the first index wins
        assert torch.equal(B.argmax(x), ref.argmax(x))
        assert int(B.argmax(x)[0]) == 7
        allowed = torch.rand(v) > 0.5
        assert torch.equal(B.argmax(x, allowed), ref.argmax(x, allowed))
        none = torch.zeros(v, dtype=torch.bool)
        assert torch.equal(B.argmax(x, none), torch.zeros(rows, dtype=torch.int64))


@case
def case_sample(B):
    for temperature, top_p in [(0.7, 0.9), (1.3, 1.0), (1.0, 0.5), (0.0, 0.9)]:
        x = torch.randn(4, 1500) * 2
        u = torch.rand(4)
        got = B.sample(x, temperature, top_p, u)
        assert got.dtype == torch.int64
        assert torch.equal(got, ref.sample(x, temperature, top_p, u))


@case
def case_moe_route(B):
    for n, e, k, renorm in [(5, 13, 3, True), (3, 64, 8, True), (4, 7, 7, False), (2, 100, 1, False)]:
        logits = torch.randn(n, e)
        logits[0, 2] = logits[0, 5] = logits[0].max() + 1  # tie: expert 2 first, then 5
        w, ids = B.moe_route(logits, k, renorm)
        want_w, want_ids = ref.moe_route(logits, k, renorm)
        assert ids.dtype == torch.int64 and torch.equal(ids, want_ids)
        assert ids[0, 0] == 2 and (k == 1 or ids[0, 1] == 5)
        close(w, want_w)
    # a NaN logit: every id still names an expert (a GPU kernel reading one past the table faults),
    # the row's weights are NaN (its output too: refused downstream), the other rows as ever
    logits = torch.randn(2, 64)
    logits[1, 3] = float("nan")
    w, ids = B.moe_route(logits, 8, True)
    assert ((ids >= 0) & (ids < 64)).all() and w[1].isnan().all()
    assert torch.equal(ids[0], ref.moe_route(logits, 8, True)[1][0])


@case
def case_moe(B):
    for n, d, f, e, k, act, off, renorm, with_bias in [
        (3, 40, 20, 12, 3, "gelu", 1.0, True, True),       # Moondream 3's rule, shrunk
        (1, 33, 24, 16, 4, "silu", 0.0, True, False),      # one decode token
        (5, 48, 18, 12, 2, "gelu_tanh", 0.0, False, True),
    ]:  # n * k < e: some experts are always left unchosen
        x = torch.randn(n, d)
        router_w, router_b = torch.randn(e, d), (torch.randn(e) if with_bias else None)
        gate_up, down = torch.randn(e, 2 * f, d) / d**0.5, torch.randn(e, d, f) / f**0.5
        want = ref.moe(x, router_w, router_b, gate_up, down, k, act, off, renorm)
        _, ids = ref.moe_route(ref.linear(x, router_w, router_b), k, renorm)
        unused = sorted(set(range(e)) - set(ids.flatten().tolist()))
        assert unused, "the case must leave some expert unchosen"
        gate_up, down = gate_up.clone(), down.clone()
        gate_up[unused] = NAN
        down[unused] = NAN
        close(B.moe(x, router_w, router_b, gate_up, down, k, act, off, renorm), want)
    x = torch.randn(2, 3, 16)  # leading dims
    args = (torch.randn(5, 16), None, torch.randn(5, 20, 16) / 4, torch.randn(5, 16, 10) / 3, 2)
    close(B.moe(x, *args), ref.moe(x, *args))


@case
def case_causal_conv1d(B):
    for b, t, c, w, with_state, with_bias, act in [
        (2, 19, 70, 4, True, True, "silu"),
        (1, 1, 33, 4, True, False, "silu"),      # the decode step
        (2, 2, 16, 4, True, True, None),         # T < W-1: the new state keeps old rows
        (3, 23, 40, 3, False, True, None),       # prefill from zeros
        (1, 5, 8, 1, False, False, None),        # W = 1: an empty state
    ]:
        x, weight = torch.randn(b, t, c), torch.randn(c, w)
        bias = torch.randn(c) if with_bias else None
        state = torch.randn(b, w - 1, c) if with_state else None
        y, new_state = B.causal_conv1d(x, weight, bias, state, act)
        want_y, want_state = ref.causal_conv1d(x, weight, bias, state, act)
        close(y, want_y)
        assert new_state.shape == (b, w - 1, c)
        if w > 1:
            close(new_state, want_state)


def _delta_inputs(b, t, hk, hv, dk, dv, l2, hard=False):
    """Random gated-delta inputs. `hard`: nearly parallel keys, beta near 1 and almost no decay, so the
    within-chunk system L is far from small (its high powers matter, as with repeated tokens)."""
    q, k = torch.randn(b, t, hk, dk), torch.randn(b, t, hk, dk)
    if hard:
        k = torch.randn(b, 1, hk, dk) + 0.1 * k
    if not l2:  # keep |k|^2 beta below 2 (a stable recurrence) without the l2 norm
        q, k = q / dk**0.5, k / k.norm(dim=-1, keepdim=True) if hard else k / dk**0.5
    v = torch.randn(b, t, hv, dv)
    g = -F.softplus(torch.randn(b, t, hv)) * (0.01 if hard else 0.5)   # log decay <= 0
    beta = torch.sigmoid(torch.randn(b, t, hv) + (3.0 if hard else 0.0))
    return q, k, v, g, beta


@case
def case_gated_delta_step(B):
    for b, hk, hv, dk, dv, l2 in [(2, 2, 4, 16, 24, True), (1, 3, 3, 32, 16, False), (3, 1, 2, 20, 40, True)]:
        q, k, v, g, beta = (z[:, 0] for z in _delta_inputs(b, 1, hk, hv, dk, dv, l2))
        state = torch.randn(b, hv, dk, dv)
        o, s = B.gated_delta_step(q, k, v, g, beta, state, None, l2)
        want_o, want_s = ref.gated_delta_step(q, k, v, g, beta, state, None, l2)
        close(o, want_o)
        close(s, want_s)
    o, s = B.gated_delta_step(q, k, v, g, beta, state, 0.5, True)
    want_o, want_s = ref.gated_delta_step(q, k, v, g, beta, state, 0.5, True)
    close(o, want_o)
    close(s, want_s)


@case
def case_gated_delta_chunk(B):
    for b, t, hk, hv, dk, dv, l2, with_state, hard in [
        (2, 21, 2, 4, 16, 24, True, True, False),       # ragged tail chunk, GQA-style value heads
        (1, 40, 1, 1, 32, 16, False, False, False),     # several chunks from a zero state
        (1, 3, 2, 2, 20, 40, True, True, False),        # shorter than a chunk
        (1, 35, 1, 2, 16, 16, True, True, True),        # nearly parallel keys, beta ~ 1, no decay
        (1, 20, 1, 1, 24, 16, False, False, True),
    ]:
        q, k, v, g, beta = _delta_inputs(b, t, hk, hv, dk, dv, l2, hard)
        state = torch.randn(b, hv, dk, dv) if with_state else None
        o, s = B.gated_delta_chunk(q, k, v, g, beta, state, None, l2)
        want_o, want_s = ref.gated_delta_chunk(q, k, v, g, beta, state, None, l2)
        # The hard cases are ill-conditioned on purpose (nearly parallel keys, beta ~ 1, no decay:
        # the chunk's triangular solve amplifies rounding): over 24 random draws their error
        # reached 2.3e-4, the others 7e-7.
        tol = 1e-3 if hard else RTOL
        close(o, want_o, tol)
        close(s, want_s, tol)


@case
def case_lstm_cell(B):
    for b, n_in, hid, with_bias in [(1, 20, 37, True), (3, 64, 32, True), (10, 17, 9, False)]:
        x, h, c = torch.randn(b, n_in), torch.randn(b, hid), torch.randn(b, hid)
        w_ih, w_hh = torch.randn(4 * hid, n_in) / n_in**0.5, torch.randn(4 * hid, hid) / hid**0.5
        b_ih, b_hh = (torch.randn(4 * hid), torch.randn(4 * hid)) if with_bias else (None, None)
        h2, c2 = B.lstm_cell(x, h, c, w_ih, w_hh, b_ih, b_hh)
        want_h, want_c = ref.lstm_cell(x, h, c, w_ih, w_hh, b_ih, b_hh)
        close(h2, want_h)
        close(c2, want_c)


def test_every_op_has_a_case():
    assert set(CASES) == set(contract.OP_NAMES)


@pytest.mark.parametrize("op", contract.OP_NAMES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_op_matches_reference(backend, op):
    CASES[op](BACKENDS[backend])


def test_poisoned_memory_would_be_caught():
    """The poisoned regions above are live: an implementation that reads them (masked SDPA over the
    whole cache, a dense loop over all experts) turns the result into NaN."""
    q, k, v = torch.randn(1, 2, 1, 16), torch.randn(1, 2, 20, 16), torch.randn(1, 2, 20, 16)
    k[:, :, 12:] = NAN
    mask = (torch.arange(20) < 12)[None, :]
    assert torch.isnan(F.scaled_dot_product_attention(q, k, v, attn_mask=mask)).all()
    assert torch.isfinite(ref.decode_attention(q, k, v, torch.tensor([12]))).all()
    x, gate_up = torch.randn(2, 8), torch.randn(4, 6, 8)
    _, ids = ref.moe_route(torch.randn(2, 4), 1)
    unused = sorted(set(range(4)) - set(ids.flatten().tolist()))
    gate_up[unused] = NAN
    combine = torch.zeros(2, 4).scatter(1, ids, 1.0)
    dense = sum(combine[:, e:e + 1] * (x @ gate_up[e].T) for e in range(4))  # 0 * NaN = NaN
    assert torch.isnan(dense).all()


# ---------------------------------------------------------------- equation tests for the new references

def test_delta_rule_chunks_equal_recurrent_steps():
    b, t, hk, hv, dk, dv = 2, 37, 2, 4, 16, 8
    for l2, hard in [(True, False), (False, False), (True, True)]:
        q, k, v, g, beta = _delta_inputs(b, t, hk, hv, dk, dv, l2, hard)
        state = torch.randn(b, hv, dk, dv)
        s, outs = state, []
        for i in range(t):
            o, s = ref.gated_delta_step(q[:, i], k[:, i], v[:, i], g[:, i], beta[:, i], s, None, l2)
            outs.append(o)
        steps = torch.stack(outs, dim=1)
        for chunk in (64, 16, 5, 1):
            o, s_end = ref.gated_delta_chunk(q, k, v, g, beta, state, None, l2, chunk_size=chunk)
            close(o, steps)
            close(s_end, s)


def test_delta_step_is_the_written_recurrence():
    """One step, head by head, exactly as the contract writes it (loops, no einsum)."""
    b, hk, hv, dk, dv = 2, 1, 2, 8, 5
    q, k, v, g, beta = (z[:, 0] for z in _delta_inputs(b, 1, hk, hv, dk, dv, True))
    state = torch.randn(b, hv, dk, dv)
    o, s_new = ref.gated_delta_step(q, k, v, g, beta, state, None, True)
    for i in range(b):
        for h in range(hv):
            qh, kh = q[i, h // (hv // hk)], k[i, h // (hv // hk)]
            qh = qh / torch.sqrt((qh * qh).sum() + 1e-6) / math.sqrt(dk)
            kh = kh / torch.sqrt((kh * kh).sum() + 1e-6)
            s = state[i, h] * math.exp(float(g[i, h]))
            s = s + torch.outer(kh, beta[i, h] * (v[i, h] - s.T @ kh))
            close(s_new[i, h], s)
            close(o[i, h], s.T @ qh)


def test_moe_equals_dense_loop_over_all_experts():
    n, d, f, e, k = 6, 24, 12, 10, 3
    x, rw, rb = torch.randn(n, d), torch.randn(e, d), torch.randn(e)
    gate_up, down = torch.randn(e, 2 * f, d) / 5, torch.randn(e, d, f) / 4
    logits = x @ rw.T + rb
    top = logits.topk(k, dim=-1)
    combine = torch.zeros(n, e).scatter(1, top.indices, torch.softmax(top.values, -1))  # Moondream 3's rule
    want = torch.zeros(n, d)
    for ex in range(e):
        h = x @ gate_up[ex].T
        want += combine[:, ex:ex + 1] * ((F.gelu(h[:, :f]) * (h[:, f:] + 1)) @ down[ex].T)
    close(ref.moe(x, rw, rb, gate_up, down, k, "gelu", 1.0, True), want)
    probs = torch.softmax(logits, -1)
    combine = torch.zeros(n, e).scatter(1, top.indices, probs.gather(1, top.indices))
    want = sum(combine[:, ex:ex + 1] * ((F.silu((x @ gate_up[ex].T)[:, :f]) * (x @ gate_up[ex].T)[:, f:]) @ down[ex].T)
               for ex in range(e))
    close(ref.moe(x, rw, rb, gate_up, down, k, "silu", 0.0, False), want)


def _masked_softmax_attention(q, k, v, visible, scale):
    s = (q @ k.transpose(-1, -2)) * scale
    return torch.softmax(s.masked_fill(~visible, float("-inf")), dim=-1) @ v


def test_sliding_window_equals_full_attention_with_band_mask():
    b, h, tq, tk, d, window = 2, 3, 13, 29, 16, 6
    q, k, v = _attention_inputs(b, h, h, tq, tk, d)
    p = torch.arange(tk - tq, tk)[:, None]
    j = torch.arange(tk)[None, :]
    band = (j <= p) & (j > p - window)
    want = _masked_softmax_attention(q, k, v, band, d**-0.5)
    close(ref.attention(q, k, v, True, 0, None, window), want)
    lengths = torch.tensor([tk, 9])
    got = ref.decode_attention(q[:, :, -1:], k, v, lengths, None, window)
    for i, n in enumerate(lengths.tolist()):
        row_band = (torch.arange(tk) < n) & (torch.arange(tk) >= n - window)
        close(got[i:i + 1], _masked_softmax_attention(q[i:i + 1, :, -1:], k[i:i + 1], v[i:i + 1], row_band, d**-0.5))


def test_attention_bias_is_added_to_the_scaled_scores():
    b, h, tq, tk, d = 2, 3, 11, 11, 16
    q, k, v = _attention_inputs(b, h, h, tq, tk, d)
    hide = torch.rand(b, h, tq, tk) < 0.4
    hide[..., 0] = False  # every row keeps a key
    mask = torch.zeros(b, h, tq, tk).masked_fill(hide, float("-inf"))
    pos = torch.randn(1, h, tq, tk)
    for B in (ref, tri):
        # bias = 0 is no bias, causal or not
        close(B.attention(q, k, v, False, bias=torch.zeros(1, h, tq, tk)), ref.attention(q, k, v))
        close(B.attention(q, k, v, True, bias=torch.zeros(b, h, tq, tk)), ref.attention(q, k, v, True))
        # bias = a -inf mask is the masked attention (an independent softmax)
        close(B.attention(q, k, v, False, bias=mask), _masked_softmax_attention(q, k, v, ~hide, d**-0.5))
        # with causal the bias moves only the visible keys: causal mask AND the bias's -inf entries
        causal = torch.ones(tq, tk, dtype=torch.bool).tril()
        close(B.attention(q, k, v, True, bias=mask), _masked_softmax_attention(q, k, v, causal & ~hide, d**-0.5))
        # a finite bias: softmax(scale * q k^T + bias) v, with an explicit scale
        want = torch.softmax(0.3 * q @ k.transpose(-1, -2) + pos, dim=-1) @ v
        close(B.attention(q, k, v, False, 0, 0.3, None, pos), want)


def test_gqa_equals_repeated_kv_heads():
    b, hq, hkv, t, d = 2, 6, 2, 11, 16
    q, k, v = _attention_inputs(b, hq, hkv, t, t, d)
    k_rep, v_rep = k.repeat_interleave(3, dim=1), v.repeat_interleave(3, dim=1)
    for B in (ref, tri):
        close(B.attention(q, k, v, True), ref.attention(q, k_rep, v_rep, True))
        lengths = torch.tensor([t, 4], dtype=torch.int32)
        close(B.decode_attention(q[:, :, :1], k, v, lengths), ref.decode_attention(q[:, :, :1], k_rep, v_rep, lengths))
    # query head 4 reads kv head 4 // 3 = 1: its output does not move when kv head 0 changes
    k2 = k.clone()
    k2[:, 0] += 1.0
    assert torch.equal(ref.attention(q, k2, v)[:, 3:], ref.attention(q, k, v)[:, 3:])


def test_conv_prefill_equals_single_steps_and_conv1d():
    b, t, c, w = 2, 9, 6, 4
    x, weight, bias = torch.randn(b, t, c), torch.randn(c, w), torch.randn(c)
    y, state = ref.causal_conv1d(x, weight, bias, None, "silu")
    want = F.silu(F.conv1d(x.transpose(1, 2), weight[:, None], bias, padding=w - 1, groups=c)[..., :t]).transpose(1, 2)
    close(y, want)
    close(state, x[:, -(w - 1):])
    for B in (ref, tri):
        s, ys = torch.zeros(b, w - 1, c), []
        for i in range(t):
            yi, s = B.causal_conv1d(x[:, i:i + 1], weight, bias, s, "silu")
            ys.append(yi)
        close(torch.cat(ys, dim=1), y)
        close(s, state)
        # a prefill split in two, the state carried across
        y1, s1 = B.causal_conv1d(x[:, :5], weight, bias, None, "silu")
        y2, s2 = B.causal_conv1d(x[:, 5:], weight, bias, s1, "silu")
        close(torch.cat([y1, y2], dim=1), y)
        close(s2, state)


def test_lstm_cell_equals_torch_lstm_cell():
    cell = torch.nn.LSTMCell(7, 5)
    x, h, c = torch.randn(3, 7), torch.randn(3, 5), torch.randn(3, 5)
    with torch.no_grad():
        want_h, want_c = cell(x, (h, c))
        for B in (ref, tri):
            got_h, got_c = B.lstm_cell(x, h, c, cell.weight_ih, cell.weight_hh, cell.bias_ih, cell.bias_hh)
            close(got_h, want_h)
            close(got_c, want_c)


def test_norm_and_glu_conventions():
    x, w, z = torch.randn(4, 32), torch.randn(32) * 0.1, torch.randn(4, 32)
    normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    close(ref.rms_norm(x, w, 1e-6, offset=1.0), normed * (1 + w))        # Qwen 3.5 (zero-centred weight)
    close(ref.rms_norm(x, w, 1e-6), normed * w)                          # Gemma 4
    close(ref.rms_norm(x, None, 1e-6), normed)                           # Gemma 4's v_norm
    close(ref.rms_norm_gated(x, z, w, 1e-6), normed * w * F.silu(z))     # Qwen 3.5's gated norm
    a, b = torch.randn(3, 10), torch.randn(3, 10)
    close(ref.glu(b, a, "sigmoid"), F.glu(torch.cat([a, b], -1), dim=-1))   # the conformer's GLU
    close(ref.glu(a, b, "gelu_tanh"), F.gelu(a, approximate="tanh") * b)    # GeGLU
    close(ref.glu(a, b, "gelu", 1.0), F.gelu(a) * (b + 1))                  # Moondream 3's experts
    close(ref.glu(a, b, "silu"), F.silu(a) * b)                             # SwiGLU


def test_moe_route_renormalised_is_softmax_over_chosen_logits():
    logits = torch.randn(5, 64)
    w, ids = ref.moe_route(logits, 8, True)
    top = logits.topk(8, dim=-1)
    assert torch.equal(ids, top.indices)
    close(w, torch.softmax(top.values, dim=-1))
    w_all, _ = ref.moe_route(logits, 8, False)
    close(w_all, torch.softmax(logits, -1).gather(1, top.indices))


# ---------------------------------------------------------------- shapes and dtypes at the edges (the fuzz review)

def test_single_query_inside_the_prefix_block_sees_every_key():
    """Tq == 1 (Triton's decode path) with causal, a window and prefix_len >= Tk: the query (p = Tk - 1)
    is inside the prefix block, so it sees every key, not only its window; past the block
    (prefix_len < Tk) the window holds, and keys before it are never read."""
    b, hq, hkv, tk, d, window = 2, 4, 2, 9, 32, 3
    q, k, v = _attention_inputs(b, hq, hkv, 1, tk, d)
    k_rep, v_rep = k.repeat_interleave(hq // hkv, dim=1), v.repeat_interleave(hq // hkv, dim=1)
    for prefix in (tk, 20):
        every = torch.ones(1, tk, dtype=torch.bool)
        want = _masked_softmax_attention(q, k_rep, v_rep, every, d**-0.5)
        close(ref.attention(q, k, v, True, prefix, None, window), want)
        close(tri.attention(q, k, v, True, prefix, None, window), want)
    for prefix in (0, tk - 1):   # p = Tk - 1 >= prefix_len: the window applies
        band = (torch.arange(tk) > tk - 1 - window)[None, :]
        want = _masked_softmax_attention(q, k_rep, v_rep, band, d**-0.5)
        close(ref.attention(q, k, v, True, prefix, None, window), want)
        kp, vp = k.clone(), v.clone()
        kp[:, :, :tk - window] = vp[:, :, :tk - window] = NAN
        close(tri.attention(q, kp, vp, True, prefix, None, window), want)


@pytest.mark.parametrize("backend", BACKENDS)
def test_causal_attention_with_more_queries_than_keys(backend):
    """Causal, Tq > Tk: the first Tq - Tk queries sit before position 0 and see no key, unless the
    prefix block reaches them: refused (ValueError naming the shapes) without a prefix, computed with one."""
    B = BACKENDS[backend]
    for b, hq, hkv, tq, tk, prefix, window in [(1, 1, 1, 6, 4, 0, None), (2, 4, 2, 20, 3, 0, 2),
                                               (1, 2, 2, 1, 0, 0, None), (1, 2, 2, 3, 0, 5, None)]:
        q, k, v = _attention_inputs(b, hq, hkv, tq, tk, 16)
        with pytest.raises(ValueError, match=rf"\(Tq {tq} > Tk {tk}\)"):
            B.attention(q, k, v, True, prefix, None, window)
        if tk:   # not causal: every query sees every key, Tq > Tk or not (cross-attention)
            close(B.attention(q, k, v), ref.attention(q, k, v))
    for b, hq, hkv, tq, tk, prefix, window in [(1, 2, 1, 6, 4, 2, None), (2, 2, 2, 21, 17, 1, 3)]:
        q, k, v = _attention_inputs(b, hq, hkv, tq, tk, 16)
        p = torch.arange(tk - tq, tk)[:, None]
        j = torch.arange(tk)[None, :]
        seen = ((j <= p) & ((window is None) | (j > p - (window or 0)))) | ((p < prefix) & (j < prefix))
        rep = hq // hkv
        want = _masked_softmax_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), seen, 16**-0.5)
        close(B.attention(q, k, v, True, prefix, None, window), want)


@pytest.mark.parametrize("backend", BACKENDS)
def test_norm_shapes(backend):
    """Norm weights and biases are [N] (a kernel reads exactly N of them); add_layer_norm's residual
    broadcasts to x (a [1, N] residual is added to every row), never x to the residual."""
    B = BACKENDS[backend]
    x, z, w, b = torch.randn(4, 64), torch.randn(4, 64), torch.randn(64), torch.randn(64)
    for call in (lambda: B.layer_norm(x, w[:48], b), lambda: B.layer_norm(x, w, b[:48]),
                 lambda: B.rms_norm(x, w[:48]), lambda: B.rms_norm(x, torch.randn(128)),
                 lambda: B.rms_norm_gated(x, z, w[:32]), lambda: B.add_layer_norm(x, z, w[:48], None),
                 lambda: B.add_layer_norm(x, z, w, b[:48], 1e-5, True)):
        with pytest.raises(ValueError, match=r"\(4, 64\)"):
            call()
    for xs, rs in [((2, 3, 64), (3, 2, 64)), ((1, 64), (4, 64))]:
        with pytest.raises(ValueError, match="residual"):
            B.add_layer_norm(torch.randn(xs), torch.randn(rs), w, b)
    for xs, rs in [((4, 64), (1, 64)), ((2, 3, 64), (3, 64)), ((2, 3, 64), (64,))]:
        for rms in (False, True):
            x, r = torch.randn(xs), torch.randn(rs)
            y, s = B.add_layer_norm(x, r, w, b, 1e-5, rms, 1.0)
            close(s, x + r)
            norm = ref.rms_norm(x + r, 1.0 + w, 1e-5) + b if rms else ref.layer_norm(x + r, 1.0 + w, b, 1e-5)
            close(y, norm)


@pytest.mark.parametrize("backend", BACKENDS)
def test_linear_shapes(backend):
    """bias [N]; the residual broadcasts to the output [..., N] ([N], [M, 1] too), else a ValueError
    (a residual [N, M] for an output [M, N] has the right size but is not the output's layout)."""
    B = BACKENDS[backend]
    x, w = torch.randn(4, 64), torch.randn(32, 64) / 8
    with pytest.raises(ValueError, match=r"bias \(16,\)"):
        B.linear(x, w, torch.randn(16))
    for rs in [(32, 4), (4, 16), (2, 4, 32)]:
        with pytest.raises(ValueError, match=r"residual .* \(4, 32\)"):
            B.linear(x, w, None, None, torch.randn(rs))
    for xs, rs in [((4, 64), (32,)), ((4, 64), (4, 1)), ((2, 20, 64), (20, 32)), ((1, 64), (1, 32))]:
        x, r, bias = torch.randn(xs), torch.randn(rs), torch.randn(32)
        close(B.linear(x, w, bias, "silu", r), F.silu(x @ w.T + bias) + r)


@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_attention_takes_one_length_per_row(backend):
    B = BACKENDS[backend]
    q, kc, vc = torch.randn(2, 2, 1, 32), torch.randn(2, 2, 10, 32), torch.randn(2, 2, 10, 32)
    for lengths in ([3], [3, 4, 5], [[3], [4]]):
        with pytest.raises(ValueError, match=r"lengths .* \(2, 2, 1, 32\)"):
            B.decode_attention(q, kc, vc, torch.tensor(lengths, dtype=torch.int32))


def test_outputs_keep_the_main_inputs_dtype():
    """The contract's rule, output in the main input's dtype, on every backend: rotary of bf16 x with
    fp32 cos/sin, and add_layer_norm of bf16 x with an fp32 residual (both outputs), within bf16's
    rounding of the fp32 result."""
    bf = torch.bfloat16
    x = torch.randn(2, 3, 5, 64).to(bf)
    ang = torch.randn(5, 16)
    xn, r, w = torch.randn(3, 96).to(bf), torch.randn(3, 96), torch.randn(96)
    for B in (ref, tri):
        close(B.rotary(x, ang.cos(), ang.sin(), 32), ref.rotary(x.float(), ang.cos(), ang.sin(), 32).to(bf), 2e-2)
        for rms in (False, True):
            y, s = B.add_layer_norm(xn, r, w, None, 1e-5, rms)
            close(s, (xn.float() + r).to(bf), 2e-2)
            want = ref.rms_norm(xn.float() + r, w, 1e-5) if rms else ref.layer_norm(xn.float() + r, w, None, 1e-5)
            close(y, want.to(bf), 2e-2)
