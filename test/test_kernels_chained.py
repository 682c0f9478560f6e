"""The per-op engine's chained kernels (photon_core/kernels/chained.py) against PyTorch on fresh
random inputs: ragged sizes, padded weight rows, bf16 weights and caches, a norm applied by the
linear itself, partial rotary, ring caches that have wrapped, windows, grouped query heads, rows
with no keys. Under TRITON_INTERPRET=1 (PDL is compiled out there; test_kernels_compile_sm90.py
checks its waits in the sm_90 PTX); outputs poisoned with NaN before each kernel runs.
"""
import os

os.environ["TRITON_INTERPRET"] = "1"  # must precede the first import of triton
os.environ["PHOTON_POISON_OUTPUTS"] = "1"

import math  # noqa: E402
import zlib  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import photon_core.kernels as K  # noqa: E402
from photon_core.kernels import chained  # noqa: E402
from photon_core.kernels.linear import ACT_GELU, ACT_GELU_TANH, ACT_NONE, ACT_SIGMOID, ACT_SILU, ACT_TANH  # noqa: E402

K.POISON_OUTPUTS = True
ACTS = {ACT_NONE: lambda y: y, ACT_GELU: F.gelu, ACT_GELU_TANH: lambda y: F.gelu(y, approximate="tanh"),
        ACT_SILU: F.silu, ACT_SIGMOID: torch.sigmoid, ACT_TANH: torch.tanh}


def close(a: torch.Tensor, b: torch.Tensor, tol: float = 1e-5) -> None:
    assert a.shape == b.shape, (a.shape, b.shape)
    assert torch.isfinite(a).all(), "an element left unwritten (NaN)"
    err = ((a - b).abs().max() / b.abs().max().clamp_min(1e-6)).item()
    assert err < tol, f"relative error {err:.2e}"


@pytest.fixture(autouse=True)
def _seed(request):
    torch.manual_seed(zlib.crc32(request.node.name.encode()))


def padded(n: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    """[n, k] weights in rows of k + 16 (the arena pads rows): a view with stride k + 16."""
    return torch.randn(n, k + 16).to(dtype)[:, :k]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# (16, 9, 300): a norm's statistics in two steps of 256 and 44 columns (STATS_ELEMENTS / 16 rows)
@pytest.mark.parametrize("rows, n, k", [(1, 40, 100), (3, 72, 64), (8, 24, 200), (16, 9, 33), (16, 9, 300)])
@pytest.mark.parametrize("norm", [None, "layer", "rms", "rms_bare"])
def test_linear(dtype, rows, n, k, norm):
    x = torch.randn(rows, k) * 2 + 0.5
    w, b, r = padded(n, k, dtype), torch.randn(n), torch.randn(rows, n)
    act = [ACT_NONE, ACT_GELU, ACT_GELU_TANH, ACT_SILU, ACT_TANH][(rows + n) % 5]
    spec = None
    xn = x
    if norm == "layer":
        spec = chained.Norm(torch.randn(k), torch.randn(k), 1e-5, False)
        xn = F.layer_norm(x, (k,), spec.w, spec.b, 1e-5)
    elif norm is not None:
        spec = chained.Norm(torch.randn(k) if norm == "rms" else None, None, 1e-6, True, 1.0 if norm == "rms" else 0.0)
        xn = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        if spec.w is not None:
            xn = xn * (1.0 + spec.w)
    if dtype != torch.float32:
        xn = xn.to(dtype).float()     # a 16-bit GEMM's input
    want = ACTS[act](xn @ w.float().T + b) + r
    for programs in (0, 7):
        got = chained.linear(x, w, b, act, r, pdl=False, programs=programs, norm=spec)
        close(got, want, 1e-5 if dtype == torch.float32 else 2e-3)
    close(chained.linear(x, w, None, ACT_NONE, None, pdl=False, norm=spec), xn @ w.float().T,
          1e-5 if dtype == torch.float32 else 2e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, n, k", [(1, 40, 100), (3, 24, 64), (16, 9, 300)])
@pytest.mark.parametrize("kind", ["glu", "mul", "act"])
def test_linear_applying_a_gate(dtype, rows, n, k, kind):
    """A linear that applies what its input is to it itself: a GLU (x = gate | up, act(gate) * up),
    a gate (a slice of one value times act of another: rows of different strides) or an activation
    alone, rounded to bf16 for bf16 weights, as that node's launch then the linear would."""
    w, r = padded(n, k, dtype), torch.randn(rows, n)
    act = [ACT_SILU, ACT_GELU_TANH, ACT_GELU, ACT_SIGMOID][(rows + n) % 4]
    if kind == "glu":
        x = torch.randn(rows, 2 * k) * 2
        gate, h = chained.Gate(x[:, :k], x[:, k:], act), ACTS[act](x[:, :k]) * x[:, k:]
    elif kind == "mul":
        g, x = torch.randn(rows, k), torch.randn(rows, k + 7)
        gate, h = chained.Gate(g, x[:, 5:5 + k], act), x[:, 5:5 + k] * ACTS[act](g)
    else:
        x = torch.randn(rows, k)
        gate, h = chained.Gate(x, None, act), ACTS[act](x)
    y = chained.linear(None, w, None, ACT_NONE, r, pdl=False, gate=gate)
    if dtype == torch.float32:
        close(y, h @ w.float().T + r)
        return
    # bf16: the product takes h rounded to bf16; the kernel's activation and torch's differ in the
    # last fp32 bits, which can move an h across a rounding boundary: one bf16 step (2^-8 of |h|) at
    # most, each, so y lies within |W| @ (2^-8 |h|) of the reference, and no further
    want = h.bfloat16().float() @ w.float().T + r
    band = h.abs() * 2.0 ** -8 @ w.float().abs().T + 1e-5 * want.abs().max()
    assert torch.isfinite(y).all() and ((y - want).abs() <= band).all(), ((y - want).abs() / band).max()


def test_a_gates_halves_must_fit():
    w, a = torch.randn(8, 16), torch.randn(2, 16)
    with pytest.raises(ValueError, match="gate"):
        chained.linear(None, w, None, ACT_NONE, None, pdl=False, gate=chained.Gate(a, torch.randn(2, 12), ACT_SILU))


def test_the_linear_tiles():
    """At batch 1 on a 132-SM GPU (264 programs), bf16: 8 KB weight tiles; more rows, narrower K steps."""
    assert chained.linear_blocks(1, 6144, 2048, 2, 264) == (1, 16, 256)
    assert chained.linear_blocks(1, 2048, 8192, 2, 264) == (1, 8, 512)
    assert chained.linear_blocks(1, 51200, 2048, 2, 264) == (1, 64, 64)
    assert chained.linear_blocks(8, 2048, 8192, 2, 264) == (8, 8, 128)
    assert chained.linear_blocks(1, 384, 40, 4, 264) == (1, 8, 64)       # never past K's power of 2
    for m, n, k, e in ((1, 6144, 2048, 2), (4, 1152, 384, 4), (16, 100, 1000, 2)):
        bm, bn, bk = chained.linear_blocks(m, n, k, e, 264)
        assert bn * bk * e <= chained.LINEAR_TILE_BYTES and bm * bn * bk <= chained.LINEAR_PRODUCTS


@pytest.mark.parametrize("kind", ["layer", "rms", "rms_bare"])
def test_norm(kind):
    x = torch.randn(3, 300) * 4 + 2
    w, b = torch.randn(300), torch.randn(300)
    if kind == "layer":
        got, want = chained.norm(x, w, b, 1e-5, False, 0.0, pdl=False), F.layer_norm(x, (300,), w, b, 1e-5)
    else:
        scale = None if kind == "rms_bare" else w
        got = chained.norm(x, scale, None, 1e-6, True, 1.0, pdl=False)
        want = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * (1.0 if scale is None else 1.0 + w)
    close(got, want)


@pytest.mark.parametrize("act", list(ACTS))
def test_gated(act):
    x = torch.randn(4, 2 * 1500)         # a GLU's gate | up halves, wider than one block
    close(chained.gated(x[:, :1500], x[:, 1500:], act, pdl=False), ACTS[act](x[:, :1500]) * x[:, 1500:])
    close(chained.gated(x[:, :1500], None, act, pdl=False), ACTS[act](x[:, :1500]))


@pytest.mark.parametrize("chunk, scale_w", [(48, False), (192, True)])
def test_add_norm(chunk, scale_w):
    """(x + rms_norm(z) * (1 + w)) * scale (* sw[0]), the norm over each chunk of z's columns."""
    x, z, w, sw = torch.randn(3, 192), torch.randn(3, 192) * 5, torch.randn(chunk), torch.randn(1)
    zc = z.view(3, -1, chunk)
    zn = (zc * torch.rsqrt(zc.pow(2).mean(-1, keepdim=True) + 1e-6) * (1.0 + w)).view(3, 192)
    want = (x + zn) * 0.7 * (sw if scale_w else 1.0)
    close(chained.add_norm(x, z, w, 1e-6, 1.0, chunk, 0.7, sw if scale_w else None, pdl=False), want)


@pytest.mark.parametrize("ring, append, dims, dtype", [
    (False, True, 16, torch.float32), (True, True, 32, torch.bfloat16), (False, False, 8, torch.float32),
    (False, True, 0, torch.float32)])
def test_rotary_append(ring, append, dims, dtype):
    """Layer 1 of a two-layer cache [layers, rows, heads, T, Dh]: q (and k) rotated over their first
    `dims` (pairs i, i + dims / 2), k and v written at the row's slot (a wrapped ring: position % T),
    NaN written as 0; the other slots and layer untouched."""
    M, hq, h, dh, T = 3, 4, 2, 32, 8
    qkv = torch.randn(M, (hq + 2 * h) * dh if append else hq * dh)
    qkv[2, (hq + h) * dh + 5 if append else 0] = float("nan")      # row 2: NaN in v (or in q)
    pos = torch.tensor([0, 5, 13 if ring else 7])
    rot_pos = pos + 2
    cos, sin = torch.randn(32, max(1, dims // 2)), torch.randn(32, max(1, dims // 2))
    caches = [torch.randn(2, M, h, T, dh).to(dtype) for _ in range(2)]
    before = [c.clone() for c in caches]
    q = chained.rotary_append(qkv, hq, caches[0][1], caches[1][1], pos, rot_pos, cos if dims else None,
                              sin if dims else None, dims, ring, append, pdl=False)

    def rotate(x):                       # [M, heads, dh]
        if not dims:
            return x
        c, s = cos[rot_pos][:, None], sin[rot_pos][:, None]
        x1, x2 = x[..., :dims // 2], x[..., dims // 2:dims]
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s, x[..., dims:]], -1)
    heads = qkv.view(M, -1, dh)
    want_q = rotate(heads[:, :hq]).reshape(M, -1)
    if append:
        close(q, want_q)
    else:                                # row 2's q holds the NaN (and its rotary partner): as the reference
        close(q[:2], want_q[:2])
        assert torch.equal(q[2].isnan(), want_q[2].isnan()) and q[2].isnan().sum() == 2
        close(q[2].nan_to_num(0.0), want_q[2].nan_to_num(0.0))
    want = [b.clone() for b in before]
    if append:
        k, v = rotate(heads[:, hq:hq + h]), heads[:, hq + h:]
        for r in range(M):
            slot = pos[r] % T if ring else pos[r]
            want[0][1, r, :, slot] = k[r].nan_to_num(0.0).to(dtype)
            want[1][1, r, :, slot] = v[r].nan_to_num(0.0).to(dtype)
    for got, w in zip(caches, want):
        assert torch.isfinite(got.float()).all()
        close(got.float(), w.float(), 1e-5 if dtype == torch.float32 else 4e-3)


@pytest.mark.parametrize("case", ["self", "window", "ring", "cross", "gqa"])
@pytest.mark.parametrize("splits", [0, 3])
def test_attention(case, splits):
    """Each row's keys: positions [lo, n), n = position + 1 (self) or the cross length (clamped to
    the cache), lo = n - window (a ring: the last T positions, slot t % T); a row without keys gives
    zeros. bf16 caches of a layered cache; the reference a masked softmax in fp32. Two launches on
    one tickets buffer: the last split of each head merges, and leaves its ticket at zero for the next."""
    M, dh, T = 4, 32, 80
    hq, h = (4, 2) if case == "gqa" else (2, 2)
    window = 20 if case in ("window", "ring") else None
    ring = case == "ring"
    if ring:
        T = 20
    kc, vc = (torch.randn(2, M, h, T, dh).bfloat16() for _ in range(2))
    if case == "cross":
        lengths, self_keys = torch.tensor([5, 0, 200, 77]), False
    else:
        lengths, self_keys = torch.tensor([0, 9, 47 if ring else 63, 79 if not ring else 19]), True

    def reference(q):
        want = torch.zeros(M, hq, dh)
        for r in range(M):
            n = int(lengths[r]) + (1 if self_keys else 0)
            n_cached = n if ring else min(n, T)
            lo = max(0, n_cached - (window or T + 1), n_cached - T if ring else 0)
            keys = list(range(lo, n_cached))
            if not keys:
                continue
            slots = torch.tensor([t % T for t in keys])
            for hh in range(hq):
                kv = hh // (hq // h)
                k, v = kc[1, r, kv, slots].float(), vc[1, r, kv, slots].float()
                p = torch.softmax(k @ q[r, hh * dh:(hh + 1) * dh] / math.sqrt(dh), 0)
                want[r, hh] = p @ v
        return want.reshape(M, -1)
    tickets = torch.zeros(M * hq + 3, dtype=torch.int32)
    for _ in range(2):
        q = torch.randn(M, hq * dh)
        got = chained.attention(q, kc[1], vc[1], lengths, self_keys, window, ring, 1 / math.sqrt(dh), pdl=False,
                                splits=splits, tickets=tickets)
        close(got, reference(q))
        assert not tickets.any()
    assert got[1 if case == "cross" else 0].abs().sum() > 0 or case == "cross"
    if case == "cross":
        assert got[1].abs().sum() == 0          # no cross keys: zeros


@pytest.mark.parametrize("q_w, k_w, v", [(True, True, False), (False, True, True), (True, False, True)])
def test_rotary_append_with_head_norms(q_w, k_w, v):
    """Per-head RMSNorm before rotary (Qwen3's q/k norms, scaled by 1 + w; Gemma 4's unscaled v
    norm), grouped K/V heads, bf16 caches."""
    M, hq, h, dh, T, dims = 2, 4, 2, 64, 8, 64
    qkv = torch.randn(M, (hq + 2 * h) * dh) * 3
    pos, rot_pos = torch.tensor([1, 6]), torch.tensor([1, 6])
    cos, sin = torch.randn(16, dims // 2), torch.randn(16, dims // 2)
    wq, wk = torch.randn(dh), torch.randn(dh)
    hn = chained.HeadNorm(wq if q_w else None, wk if k_w else None, v, 1e-6, 1.0)
    kc, vc = torch.zeros(M, h, T, dh).bfloat16(), torch.zeros(M, h, T, dh).bfloat16()
    q = chained.rotary_append(qkv, hq, kc, vc, pos, rot_pos, cos, sin, dims, False, True, pdl=False, head_norm=hn)

    def rms(x, w):
        y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        return y if w is None else y * (1.0 + w)

    def rotate(x):
        c, s = cos[rot_pos][:, None], sin[rot_pos][:, None]
        x1, x2 = x[..., :dims // 2], x[..., dims // 2:]
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], -1)
    heads = qkv.view(M, -1, dh)
    wq_, wk_ = heads[:, :hq], heads[:, hq:hq + h]
    close(q, rotate(rms(wq_, wq) if q_w else wq_).reshape(M, -1))
    want_k = rotate(rms(wk_, wk) if k_w else wk_)
    want_v = rms(heads[:, hq + h:], None) if v else heads[:, hq + h:]
    for r in range(M):
        close(kc[r, :, pos[r]].float(), want_k[r], 4e-3)
        close(vc[r, :, pos[r]].float(), want_v[r], 4e-3)


def test_rotary_append_with_tau():
    """Moondream 3's tau: query head h times t[h] + p_h, value head h times t[Hq + h] + p_h, with
    p_h = sigmoid(alpha_h log(pos + 1)) + 0.5 at each row's own position; k unscaled; before rotary
    (the megakernel's ops/kv_append.reference)."""
    M, hq, h, dh, T, dims = 3, 4, 2, 16, 40, 16
    qkv = torch.randn(M, (hq + 2 * h) * dh)
    pos, rot_pos = torch.tensor([0, 5, 31]), torch.tensor([3, 8, 34])     # tau reads pos, rotary rot_pos
    cos, sin = torch.randn(40, dims // 2), torch.randn(40, dims // 2)
    t, alpha = torch.tanh(torch.randn(M, 2 * hq)), torch.randn(hq)
    kc, vc = torch.zeros(M, h, T, dh), torch.zeros(M, h, T, dh)
    q = chained.rotary_append(qkv, hq, kc, vc, pos, rot_pos, cos, sin, dims, False, True, pdl=False,
                              tau=chained.Tau(t, alpha))
    heads = qkv.view(M, -1, dh)
    p = torch.sigmoid(alpha[None] * torch.log(pos.float() + 1)[:, None]) + 0.5      # [M, hq]

    def rotate(x):
        c, s = cos[rot_pos][:, None], sin[rot_pos][:, None]
        x1, x2 = x[..., :dims // 2], x[..., dims // 2:]
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], -1)
    close(q, rotate(heads[:, :hq] * (t[:, :hq] + p)[..., None]).reshape(M, -1))
    want_k, want_v = rotate(heads[:, hq:hq + h]), heads[:, hq + h:] * (t[:, hq:hq + h] + p[:, :h])[..., None]
    for r in range(M):
        close(kc[r, :, pos[r]], want_k[r])
        close(vc[r, :, pos[r]], want_v[r])


def to_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn rows, fp32 row scales) of w [E, rows, k] (each row's largest at 448)."""
    scale = w.abs().amax(-1).clamp_min(1e-6) / 448.0
    return (w / scale[..., None]).to(torch.float8_e4m3fn), scale


def moe_reference(x, logits, gu, dn, top_k, act, up_offset, renorm, residual, round_h=False):
    """backends.reference's routing, each (row, slot) applied in fp32 and summed in slot order
    (round_h: the expert's h rounded to bf16 before its down projection, as bf16 experts take it)."""
    from photon_core.backends import reference as ref
    weights, ids = ref.moe_route(logits, top_k, renorm)
    f = dn.shape[-1]
    y = torch.zeros(x.shape[0], dn.shape[1])
    for r in range(x.shape[0]):
        for s in range(top_k):
            e = int(ids[r, s])
            g = gu[e].float() @ x[r]
            h = ACTS[act](g[:f]) * (g[f:] + up_offset)
            y[r] += weights[r, s] * (dn[e].float() @ (h.bfloat16().float() if round_h else h))
    return y if residual is None else y + residual


@pytest.mark.parametrize("experts", ["fp32", "bf16", "fp8"])
@pytest.mark.parametrize("rows, top_k, renorm, programs", [(1, 2, True, 0), (3, 3, False, 0), (2, 4, True, 64)])
def test_moe(experts, rows, top_k, renorm, programs):
    """Each row's top_k of 6 experts (ties in the logits: the lower id first), their gated MLPs
    weighted and summed, + residual; gate_up rows padded as the arena pads them; bf16 experts take
    x and h rounded to bf16; FP8 experts decoded with their row scales (W = bytes.float() x scale).
    programs 64: the GPU's block sizes (several F and D blocks, steps walking across slots)."""
    E, D, F_ = 6, 48, 40
    x, logits, residual = torch.randn(rows, D), torch.randn(rows, E), torch.randn(rows, D)
    logits[0] = torch.tensor([5.0, 2.0, 4.0, 1.0, 2.0, 0.0])    # a tie at the third place: expert 1 before 4
    gu = torch.randn(E, 2 * F_, D + 16)[:, :, :D] / 4
    dn = torch.randn(E, D, F_) / 4
    scales, act = None, ACT_GELU_TANH
    if experts == "bf16":
        # small dyadic x and weights, no activation: every product and sum of the up projection is
        # exact in fp32, so h and its bf16 rounding are the same in any summation order, and only the
        # roundings the kernel applies (or not) move y; x's 2^-10 parts are what bf16 rounds away
        x = torch.randint(-4, 5, (rows, D)) / 4 + torch.randint(0, 2, (rows, D)) * 2.0 ** -10
        gu = (torch.randint(-4, 5, (E, 2 * F_, D + 16)) / 8)[:, :, :D].bfloat16()
        dn = (torch.randint(-4, 5, (E, D, F_)) / 8).bfloat16()
        act, ref_x = ACT_NONE, x.bfloat16().float()
    elif experts == "fp8":
        (gq, gs), (dq, ds) = to_fp8(gu), to_fp8(dn)
        gu, dn, scales = gq, dq, (gs, ds)
        ref_x = x
    else:
        ref_x = x
    y = chained.moe(x, logits, gu, dn, top_k, act, 0.5, renorm, residual, pdl=False, programs=programs,
                    scales=scales)
    gu_ref = gu.float() * scales[0][..., None] if scales else gu.float()
    dn_ref = dn.float() * scales[1][..., None] if scales else dn.float()
    want = moe_reference(ref_x, logits, gu_ref, dn_ref, top_k, act, 0.5, renorm, residual, round_h=experts == "bf16")
    close(y, want)


@pytest.mark.filterwarnings("ignore:All-NaN slice")    # the interpreter's numpy on the NaN row
def test_moe_nan_logits_read_only_real_experts():
    """A row whose router logits hold NaN still reads experts inside the table (one past it would
    read past the weights: on a GPU an illegal address), and its output is NaN (the row is refused
    downstream); the other rows are exact."""
    E, D, F_ = 4, 32, 16
    x, logits = torch.randn(2, D), torch.randn(2, E)
    logits[1] = float("nan")
    gu, dn = torch.randn(E, 2 * F_, D), torch.randn(E, D, F_)
    y = chained.moe(x, logits, gu, dn, 2, ACT_SILU, 0.0, True, None, pdl=False)
    assert y[1].isnan().all()
    close(y[:1], moe_reference(x[:1], logits[:1], gu, dn, 2, ACT_SILU, 0.0, True, None))


def test_moe_blocks_reach_the_programs_asked_for():
    """Moondream 3's FP8 experts at batch 1 on a 132-SM GPU (264 programs): 8 pairs x 64 feature
    blocks of 16 up, 2048 / 8 output blocks down (no fewer than 8 outputs a program); up steps of
    MOE_UP_TILE elements, down steps of MOE_DOWN_TILE_BYTES (bf16: half the elements)."""
    up_f, up_d, dn_n, dn_f = chained.moe_blocks(8, 1024, 1, 2048, 264, 1)
    assert (up_f, dn_n) == (16, 8) and 8 * 1024 // up_f >= 264 and 2048 // dn_n < 264
    assert up_f * up_d == chained.MOE_UP_TILE and dn_n * dn_f == chained.MOE_DOWN_TILE_BYTES
    assert chained.moe_blocks(8, 1024, 1, 2048, 264, 2)[3] == dn_f // 2


@pytest.mark.parametrize("width, act", [(4, "silu"), (2, None)])
def test_conv_step(width, act, monkeypatch):
    """Qwen 3.5's causal conv at decode: channels x[:, c0:c0 + C] against backends.reference's
    causal_conv1d over [state; x], the [M, C, W-1] state shifted in place (channel-major); three
    channel blocks a row (the last ragged)."""
    from photon_core.backends import reference as ref
    monkeypatch.setattr(chained, "CONV_BLOCK", 16)
    M, C, c0 = 3, 40, 8
    x, w = torch.randn(M, c0 + C + 5), torch.randn(C, width)
    state = torch.randn(M, C, width - 1)
    want, want_state = ref.causal_conv1d(x[:, None, c0:c0 + C], w, None, state.transpose(1, 2).clone(), act)
    y = chained.conv_step(x, c0, w, state, {None: ACT_NONE, "silu": ACT_SILU}[act], pdl=False)
    close(y, want[:, 0])
    assert torch.equal(state, want_state.transpose(1, 2))


@pytest.mark.parametrize("k_heads, dk, dv, slab", [(2, 16, 24, 4096), (4, 32, 32, 4096), (2, 48, 32, 256)])
def test_delta_step(k_heads, dk, dv, slab, monkeypatch):
    """Qwen 3.5's Gated DeltaNet at decode: q | k | v and z | b | a columns (from c0) as the step
    graph lays them out, grouped key heads, a value head width that is not a power of two, a state
    in one slab or in six (as Qwen 3.5's 128 x 128 heads take four): against backends.reference
    (gates, gated_delta_step with q/k L2 norms, rms_norm_gated), the state in place."""
    from photon_core.backends import reference as ref
    monkeypatch.setattr(chained, "DELTA_SLAB", slab)
    M, hv, c0, eps = 2, 4, 3, 1e-6
    x = torch.randn(M, 2 * k_heads * dk + hv * dv)
    zba = torch.randn(M, c0 + hv * dv + 2 * hv)
    a_log, dt_bias, norm_w = torch.randn(hv), torch.randn(hv), torch.randn(dv)
    state = torch.randn(M, hv, dk, dv)
    q, k, v = x.split([k_heads * dk, k_heads * dk, hv * dv], dim=1)
    z, b, a = zba[:, c0:c0 + hv * dv], zba[:, c0 + hv * dv:c0 + hv * dv + hv], zba[:, c0 + hv * dv + hv:]
    g = -a_log.exp() * F.softplus(a + dt_bias)
    o, want_state = ref.gated_delta_step(q.reshape(M, k_heads, dk), k.reshape(M, k_heads, dk), v.reshape(M, hv, dv),
                                         g, torch.sigmoid(b), state.clone(), qk_l2norm=True)
    want = ref.rms_norm_gated(o, z.reshape(M, hv, dv), norm_w, eps).reshape(M, hv * dv)
    y = chained.delta_step(x, zba, c0, k_heads, a_log, dt_bias, norm_w, eps, state, pdl=False)
    close(y, want)
    close(state, want_state)


@pytest.mark.parametrize("advance", [False, True])
def test_argmax_and_the_step_begin(advance):
    """The picks over columns [c0, c1) of rows of several partials: the first of tied largest values
    across blocks, barred (-inf) columns, a NaN row mid-cache (-2; its fed token 0, its position
    kept), a row at the last position (-1 advancing, its position kept); the error word copied from bad. And
    step_begin's clamps: a token past its table and a negative position flag the launch."""
    B, c0, c1, max_pos = 4, 10, 11000, 50             # 3 partials of ARGMAX_BLOCK (4096) columns a row
    x = torch.randn(B, 12000)
    x[0, 20], x[0, 9000] = 9.0, 9.0                  # a tie two blocks apart: the first wins
    x[1, :5000] = -float("inf")
    x[1, 10999] = 8.0                                 # the last column in range
    x[2, 700] = float("nan")
    x[3, 11500] = 99.0                                # outside [c0, c1): ignored
    dyn = torch.tensor([5, 6, 7, 8, 3, 4, 4, max_pos - 1, 0, 0, 0, 0, 0, 0, 0, 0], dtype=torch.int32)
    results, err, bad = torch.full((B, 2), -7, dtype=torch.int32), torch.zeros(1, dtype=torch.int32), \
        torch.tensor([1], dtype=torch.int32)
    chained.argmax(x, c0, c1, results[:, 1], dyn, B, max_pos, bad, err, advance, pdl=False)
    best = [10, 10989, 0, int(x[3, c0:c1].argmax())]
    want = [10, 10989, -2, -1 if advance else best[3]]
    assert results[:, 1].tolist() == want and results[:, 0].tolist() == [-7] * B and err.item() == 1
    if advance:     # row 2 (NaN) keeps its position 4, row 3 (full) its last
        assert dyn[:B].tolist() == best and dyn[B:2 * B].tolist() == [4, 5, 4, max_pos - 1]
    else:
        assert dyn[:2 * B].tolist() == [5, 6, 7, 8, 3, 4, 4, max_pos - 1]
    dyn = torch.tensor([3, 99, 4, -1, 8, 0, 2, 2], dtype=torch.int32)      # B = 2: tokens, positions, cross, offsets
    tok, pos, rot, cross = chained.step_begin(dyn, 2, 40, 64, 50, bad, pdl=False)
    assert (tok.tolist(), pos.tolist(), rot.tolist(), cross.tolist(), bad.item()) == ([3, 49], [4, 0], [6, 1], [8, 0], 1)
    tok, pos, rot, cross = chained.step_begin(torch.tensor([3, 9, 4, 5, 8, 0, 2, 2], dtype=torch.int32), 2, 40, 0, 0,
                                              bad, pdl=False)
    assert (tok.tolist(), pos.tolist(), rot.tolist(), bad.item()) == ([3, 9], [4, 5], [6, 7], 0)


def test_the_installed_triton_takes_the_programmatic_launch_option():
    """chained._launch passes launch_pdl=True on sm_90+: an option of this Triton's CUDA backend
    (the launcher then sets CUDA's programmatic stream serialization attribute), which it keeps."""
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend
    assert chained.HAS_GDC
    assert CUDABackend(GPUTarget("cuda", 90, 32)).parse_options({"launch_pdl": True}).launch_pdl is True
    assert not chained.pdl_for(torch.device("cpu"))


def test_a_gpus_nan_survives_the_bf16_rounding_and_infinities_are_not_cached():
    """A GPU's NaN is 0x7FFFFFFF (numpy's, the interpreter's, 0x7FC00000): the bf16 rounding by bits
    must keep it NaN (the carry would make it -0.0 and a NaN row's logits finite: never refused);
    an append stores NaN and infinities as 0, as the plain build's nan_to_num(0, 0, 0)."""
    gpu_nan = torch.tensor([0x7FFFFFFF, 0x7F800001, -1], dtype=torch.int32).view(torch.float32)
    x = torch.randn(2, 64)
    x[1, 5] = gpu_nan[0]
    y = chained.linear(x, torch.randn(16, 64).bfloat16(), None, ACT_NONE, None, pdl=False)
    assert torch.isfinite(y[0]).all() and y[1].isnan().all()
    for bits in gpu_nan:
        x[1, 5] = bits
        assert chained.linear(x, torch.randn(16, 64).bfloat16(), None, ACT_NONE, None, pdl=False)[1].isnan().all()
    M, hq, h, dh = 1, 2, 2, 32
    qkv = torch.randn(M, (hq + 2 * h) * dh)
    qkv[0, hq * dh + 3], qkv[0, (hq + h) * dh + 7] = float("inf"), gpu_nan[0]     # k and v
    kc, vc = torch.full((M, h, 4, dh), 5.0).bfloat16(), torch.full((M, h, 4, dh), 5.0).bfloat16()
    chained.rotary_append(qkv, hq, kc, vc, torch.tensor([2]), None, None, None, 0, False, True, pdl=False)
    assert kc[0, 0, 2, 3] == 0 and vc[0, 0, 2, 7] == 0 and torch.isfinite(kc.float()).all()
    assert torch.isfinite(vc.float()).all()


def test_attention_refuses_shapes_it_would_read_past():
    """Query head h reads kv head h // (Hq / Hkv): 3 query heads over 2 kv heads would read a kv head
    that does not exist (head 2 // 1 = 2). A query of other rows than the caches, or fewer lengths
    than rows, would be read past its end. All refused with the shapes named, before any launch."""
    M, h, T, dh = 2, 2, 8, 16
    kc, vc = torch.randn(M, h, T, dh), torch.randn(M, h, T, dh)
    lengths = torch.tensor([5, 3])
    for q, lens in [(torch.randn(M, 3 * dh), lengths), (torch.randn(M, 3 * dh + 5), lengths),
                    (torch.randn(M + 1, 2 * dh), lengths), (torch.randn(M, 4 * dh), lengths[:1]),
                    (torch.randn(4 * dh, M).t(), lengths)]:
        with pytest.raises(ValueError, match=r"\(2, 2, 8, 16\)"):
            chained.attention(q, kc, vc, lens, True, None, False, 1 / math.sqrt(dh), pdl=False)
    q = torch.randn(M, 4 * dh)   # 4 query heads over 2: the grouped case still runs
    got = chained.attention(q, kc, vc, lengths, True, None, False, 1 / math.sqrt(dh), pdl=False)
    for r, n in enumerate((6, 4)):
        for hh in range(4):
            k, v = kc[r, hh // 2, :n], vc[r, hh // 2, :n]
            want = torch.softmax(k @ q[r, hh * dh:(hh + 1) * dh] / math.sqrt(dh), 0) @ v
            close(got[r, hh * dh:(hh + 1) * dh], want)
