"""Every Triton kernel against backends.reference on fresh random inputs, ragged shapes included.

Runs on CPU under TRITON_INTERPRET=1 (set here before triton is imported). Outputs are poisoned
(NaN / -1) before each kernel runs, so an element a kernel never writes fails the comparison.
"""
import os

os.environ["TRITON_INTERPRET"] = "1"  # must precede the first import of triton
os.environ["PHOTON_POISON_OUTPUTS"] = "1"

import zlib  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

import photon_core.kernels as K  # noqa: E402
from photon_core.backends import reference as ref  # noqa: E402
from photon_core.backends.select import get_backend  # noqa: E402

K.POISON_OUTPUTS = True
tri = get_backend("triton", "cpu")
RTOL = 1e-4


def close(a: torch.Tensor, b: torch.Tensor, tol: float = RTOL) -> None:
    assert a.shape == b.shape, (a.shape, b.shape)
    assert torch.isfinite(a).all(), "kernel left unwritten (NaN) or non-finite elements"
    err = ((a - b).abs().max() / b.abs().max().clamp_min(1e-6)).item()
    assert err < tol, f"relative error {err:.2e}"


@pytest.fixture(autouse=True)
def _seed(request):
    torch.manual_seed(zlib.crc32(request.node.name.encode()))   # hash() changes per process


@pytest.mark.parametrize("shape", [(1, 64), (3, 100), (2, 5, 384)])
@pytest.mark.parametrize("with_bias", [True, False])
def test_layer_norm(shape, with_bias):
    x = torch.randn(shape) * 3 + 1
    w, b = torch.randn(shape[-1]), torch.randn(shape[-1]) if with_bias else None
    close(tri.layer_norm(x, w, b, 1e-5), ref.layer_norm(x, w, b, 1e-5))


@pytest.mark.parametrize("shape", [(2, 96), (3, 130)])
def test_rms_norm_and_fused_residual(shape):
    x, r, w, b = torch.randn(shape), torch.randn(shape), torch.randn(shape[-1]), torch.randn(shape[-1])
    want = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w
    close(tri.rms_norm(x, w, 1e-6), want)
    y, s = tri.add_layer_norm(x, r, w, b, 1e-5)
    close(s, x + r)
    close(y, ref.layer_norm(x + r, w, b, 1e-5))


@pytest.mark.parametrize("m", [1, 2, 5, 8, 16, 37])  # 1..16: GEMV path; 37: tiled path, ragged
@pytest.mark.parametrize("kn", [(64, 96), (100, 77)])
@pytest.mark.parametrize("act", [None, "gelu", "gelu_tanh"])
def test_linear(m, kn, act):
    k, n = kn
    x, w, b, r = torch.randn(m, k), torch.randn(n, k) / k**0.5, torch.randn(n), torch.randn(m, n)
    close(tri.linear(x, w, b, act, r), ref.linear(x, w, b, act, r))
    close(tri.linear(x, w), ref.linear(x, w))


def test_linear_batched_leading_dims():
    x, w = torch.randn(2, 3, 48), torch.randn(40, 48)
    close(tri.linear(x, w, activation="gelu"), ref.linear(x, w, activation="gelu"))


@pytest.mark.parametrize("shape,rot", [((1, 2, 5, 32), 32), ((2, 3, 7, 64), 32), ((1, 1, 3, 24), 10)])
def test_rotary(shape, rot):
    x = torch.randn(shape)
    ang = torch.randn(shape[-2], rot // 2)
    close(tri.rotary(x, ang.cos(), ang.sin(), rot), ref.rotary(x, ang.cos(), ang.sin(), rot))


def test_kv_append_per_row_positions():
    b, h, t_max, d = 2, 3, 11, 20
    kc, vc = torch.randn(b, h, t_max, d), torch.randn(b, h, t_max, d)
    k, v = torch.randn(b, h, 2, d), torch.randn(b, h, 2, d)
    pos = torch.tensor([0, 9], dtype=torch.int32)
    want_k, want_v = kc.clone(), vc.clone()
    for i, p in enumerate(pos.tolist()):
        want_k[i, :, p:p + 2] = k[i]
        want_v[i, :, p:p + 2] = v[i]
    tri.kv_append(kc, vc, k, v, pos)
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)
    with pytest.raises(ValueError):
        tri.kv_append(kc, vc, k, v, torch.tensor([10, 0], dtype=torch.int32), check=True)


@pytest.mark.parametrize("b,h,tq,tk,d,causal,prefix", [
    (1, 2, 17, 17, 32, True, 0),      # causal prefill, ragged
    (2, 1, 20, 20, 24, True, 7),      # bidirectional prefix block, D not a power of 2
    (1, 2, 5, 33, 16, True, 0),       # queries are the last 5 of 33 positions
    (1, 1, 9, 30, 64, False, 0),      # bidirectional (encoder)
    (2, 3, 1, 45, 32, True, 0),       # decode through attention()
])
def test_attention(b, h, tq, tk, d, causal, prefix):
    q, k, v = torch.randn(b, h, tq, d), torch.randn(b, h, tk, d), torch.randn(b, h, tk, d)
    close(tri.attention(q, k, v, causal, prefix), ref.attention(q, k, v, causal, prefix))


@pytest.mark.parametrize("splits", [1, 3, 8])
def test_decode_attention_split_kv_ragged_lengths(splits):
    b, h, t_max, d = 3, 2, 70, 32
    q, kc, vc = torch.randn(b, h, 1, d), torch.randn(b, h, t_max, d), torch.randn(b, h, t_max, d)
    lengths = torch.tensor([1, 37, 70], dtype=torch.int32)
    out = tri.decode_attention(q, kc, vc, lengths, num_splits=splits, block_t=16)
    for i, n in enumerate(lengths.tolist()):
        close(out[i:i + 1], ref.attention(q[i:i + 1], kc[i:i + 1, :, :n], vc[i:i + 1, :, :n]))


@pytest.mark.parametrize("rows,v", [(1, 1000), (3, 2053), (2, 51)])
def test_argmax_and_masked(rows, v):
    x = torch.randn(rows, v)
    x[0, 7] = x[0, v - 3] = x.max() + 1  # a tie: the first index must win, as in torch
    assert torch.equal(tri.argmax(x), ref.argmax(x))
    allowed = torch.rand(v) > 0.5
    assert torch.equal(tri.argmax(x, allowed), ref.argmax(x, allowed))
    none = torch.zeros(v, dtype=torch.bool)
    assert torch.equal(tri.argmax(x, none), ref.argmax(x, none))


@pytest.mark.parametrize("temperature,top_p", [(0.7, 0.9), (1.3, 1.0), (1.0, 0.5)])
def test_sampling_matches_definition(temperature, top_p):
    x = torch.randn(4, 1500) * 2
    u = torch.rand(4)
    got = tri.sample(x, temperature, top_p, u)
    assert torch.equal(got, ref.sample(x, temperature, top_p, u))
    assert torch.equal(tri.sample(x, 0.0, 0.9, u), x.argmax(-1))


def test_sampling_distribution_respects_nucleus():
    x = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).repeat(24, 1)
    got = tri.sample(x, 1.0, 0.7, torch.rand(24))
    assert set(got.tolist()) <= {0, 1}  # 0.5 + 0.3 >= 0.7: tokens 2 and 3 are outside the nucleus
    assert {0, 1} <= set(got.tolist())


def test_select_refuses_cpu_without_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        get_backend("triton", "cpu")
    assert get_backend("auto", "cpu") is ref
    with pytest.raises(ValueError):
        get_backend("nope")


@pytest.mark.parametrize("gpu, triton_version, why", [
    ((8, 7), None, "Triton is not installed"),          # a Jetson Orin whose JetPack torch brings no Triton
    ((8, 0), "3.2.0", "older than 3.3"),
    ((7, 5), "3.6.0", "sm_75; the kernels need sm_80"),  # a T4 (a Xavier: sm_72)
    ((9, 0), "3.6.0", ""),
])
def test_auto_on_a_gpu_the_kernels_cannot_use_runs_pytorch_there(monkeypatch, caplog, gpu, triton_version, why):
    """`auto` on CUDA is the megakernel only where Triton can build it for that GPU; elsewhere the
    reference backend (PyTorch on the GPU), logged once, where it failed at the first kernel (or at
    `import triton`). Named backends there are refused with the reason. (No GPU here: torch.cuda's
    answers are stood in for.)"""
    import sys
    import triton
    from photon_core.backends import select
    from photon_core.runtime.decode import engine_diagnostics   # the nodes' /diagnostics values
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: gpu)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "the GPU")
    monkeypatch.setattr(select, "_told", set())
    if triton_version is None:
        monkeypatch.setitem(sys.modules, "triton", None)   # import triton: ImportError
    else:
        monkeypatch.setattr(triton, "__version__", triton_version)
    with caplog.at_level("WARNING", logger="photon_core"):
        got = [get_backend("auto", "cuda") for _ in range(2)]
    if not why:
        assert got[0] is get_backend("megakernel", "cpu") and not caplog.records
        assert not any(k.startswith("backend") for k in engine_diagnostics())
        return
    assert got == [ref, ref]
    assert len(caplog.records) == 1 and why in caplog.records[0].getMessage()
    assert why in engine_diagnostics()["backend cuda"]
    for name in ("triton", "megakernel"):
        with pytest.raises(RuntimeError, match=why):
            get_backend(name, "cuda")


@pytest.mark.parametrize("broken, why", [
    (RuntimeError("libtriton.so: undefined symbol"), "Triton cannot be imported (RuntimeError"),
    (OSError("libcuda.so.1: cannot open shared object file"), "Triton cannot be imported (OSError"),
    (ModuleNotFoundError("No module named 'triton._C'", name="triton._C"), "Triton cannot be imported"),
    ("namespace", "has no version"),   # a folder an uninstall left: imports, no __version__
])
def test_auto_on_a_gpu_with_a_broken_triton_runs_pytorch_there(monkeypatch, caplog, broken, why):
    """A Triton that is installed but broken (its import raises something other than ImportError,
    or a leftover folder imports without a version) is no usable Triton: `auto` falls back as
    without one, and named backends are refused with the reason (they raised from select)."""
    import importlib.abc
    import re
    import sys
    import types
    from photon_core.backends import select
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 7))   # an Orin
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "the GPU")
    monkeypatch.setattr(select, "_told", set())
    if broken == "namespace":
        leftover = types.ModuleType("triton")
        leftover.__path__ = []
        monkeypatch.setitem(sys.modules, "triton", leftover)
    else:
        class Broken(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path, target=None):
                if name == "triton":
                    raise broken
                return None
        monkeypatch.delitem(sys.modules, "triton", raising=False)
        monkeypatch.setattr(sys, "meta_path", [Broken(), *sys.meta_path])
    with caplog.at_level("WARNING", logger="photon_core"):
        assert get_backend("auto", "cuda") is ref
    assert len(caplog.records) == 1 and why in caplog.records[0].getMessage()
    for name in ("triton", "megakernel"):
        with pytest.raises(RuntimeError, match=re.escape(why)):
            get_backend(name, "cuda")


def test_select_triton_and_megakernel_modules():
    mega = get_backend("megakernel", "cpu")
    for name in ("linear", "layer_norm", "attention", "rotary", "argmax"):
        assert getattr(mega, name) is getattr(tri, name)
        assert callable(getattr(ref, name))
    assert hasattr(mega, "CompiledStep") and hasattr(mega, "StepGraph")
    with pytest.raises(RuntimeError, match="CUDA"):
        get_backend("triton", "mps")


def both(*ts: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The tensors in bf16, and the same bf16 values in fp32 (the reference's inputs)."""
    return [t.to(torch.bfloat16) for t in ts], [t.to(torch.bfloat16).float() for t in ts]


@pytest.mark.parametrize("m", [1, 37])   # the GEMV path and the tiled one
def test_bfloat16_inputs(m):
    """A model loaded in bfloat16 (the vision node's `dtype: bfloat16`) hands these kernels bf16
    tensors: they must take them, accumulate in fp32 and return bf16 within bf16's rounding of the
    fp32 reference on the same (bf16) values."""
    bf = torch.bfloat16
    (x, w, b), (x32, w32, b32) = both(torch.randn(m, 96), torch.randn(80, 96) / 96 ** 0.5, torch.randn(80))
    got = tri.linear(x, w, b, "gelu_tanh")
    assert got.dtype == bf
    close(got.float(), ref.linear(x32, w32, b32, "gelu_tanh"), tol=1e-2)
    (h, g, c), (h32, g32, c32) = both(torch.randn(m, 96) * 3 + 1, torch.randn(96), torch.randn(96))
    close(tri.layer_norm(h, g, c, 1e-5).float(), ref.layer_norm(h32, g32, c32, 1e-5), tol=1e-2)
    (q, k, v), (q32, k32, v32) = both(*(torch.randn(1, 2, t, 32) for t in (5, 9, 9)))
    close(tri.attention(q, k, v, True, 4).float(), ref.attention(q32, k32, v32, True, 4), tol=1e-2)


def test_bfloat16_inputs_of_the_other_per_op_kernels():
    """The rest of what a bf16 model's prefill and per-op decode hand the kernels (Moondream, Qwen 3.5,
    Gemma 4 load bf16 on a GPU): bf16 in, bf16 out (the caches keep their own dtype), within bf16's
    rounding of the fp32 reference on the same bf16 values."""
    bf = torch.bfloat16

    def check(got, want):
        assert got.dtype == bf
        close(got.float(), want.float(), tol=2e-2)
    (x, r, w, b, gate), (x32, r32, w32, b32, gate32) = both(
        torch.randn(3, 96), torch.randn(3, 96), torch.randn(96), torch.randn(96), torch.randn(3, 96))
    check(tri.rms_norm(x, w, 1e-6, 1.0), ref.rms_norm(x32, w32, 1e-6, 1.0))
    check(tri.rms_norm_gated(x, gate, w, 1e-6), ref.rms_norm_gated(x32, gate32, w32, 1e-6))
    y, s = tri.add_layer_norm(x, r, w, b, 1e-5)
    y32, s32 = ref.add_layer_norm(x32, r32, w32, b32, 1e-5)
    check(y, y32)
    check(s, s32)
    check(tri.glu(x, r, "gelu_tanh", 1.0), ref.glu(x32, r32, "gelu_tanh", 1.0))
    (q,), (q32,) = both(torch.randn(1, 2, 5, 32))
    ang = torch.randn(5, 8)
    check(tri.rotary(q, ang.cos().to(bf), ang.sin().to(bf), 16), ref.rotary(q32, ang.cos().to(bf).float(),
                                                                        ang.sin().to(bf).float(), 16))
    # bf16 K/V appended into bf16 caches, then one decode query over them (grouped heads).
    kc, vc = torch.zeros(2, 2, 12, 32, dtype=bf), torch.zeros(2, 2, 12, 32, dtype=bf)
    (k, v), _ = both(torch.randn(2, 2, 9, 32), torch.randn(2, 2, 9, 32))
    tri.kv_append(kc, vc, k, v, torch.tensor([0, 3], dtype=torch.int32))
    assert torch.equal(kc[0, :, :9], k[0]) and torch.equal(vc[1, :, 3:12], v[1])
    (qd,), (qd32,) = both(torch.randn(2, 4, 1, 32))
    lengths = torch.tensor([9, 12], dtype=torch.int32)
    check(tri.decode_attention(qd, kc, vc, lengths, num_splits=2, block_t=16),
          ref.decode_attention(qd32, kc.float(), vc.float(), lengths))
    # Qwen 3.5's linear-attention layers: the causal conv and one gated delta-rule step.
    (xc, wc, bc, st), (xc32, wc32, bc32, st32) = both(torch.randn(1, 3, 40), torch.randn(40, 4), torch.randn(40),
                                                      torch.randn(1, 3, 40))
    yc, sc = tri.causal_conv1d(xc, wc, bc, st, "silu")
    yc32, sc32 = ref.causal_conv1d(xc32, wc32, bc32, st32, "silu")
    check(yc, yc32)
    check(sc, sc32)
    (dq, dk, dv, g, beta), ins32 = both(torch.randn(2, 2, 16), torch.randn(2, 2, 16), torch.randn(2, 4, 24),
                                        -torch.rand(2, 4), torch.rand(2, 4))
    state = torch.randn(2, 4, 16, 24)
    o, s_new = tri.gated_delta_step(dq, dk, dv, g, beta, state, None, True)
    o32, s32 = ref.gated_delta_step(*ins32, state, None, True)
    check(o, o32)
    close(s_new.float(), s32, tol=2e-2)
    # Moondream 3's experts.
    (xm, rw, gu, dn), (xm32, rw32, gu32, dn32) = both(torch.randn(3, 32), torch.randn(6, 32) / 6,
                                                      torch.randn(6, 48, 32) / 6, torch.randn(6, 32, 24) / 5)
    check(tri.moe(xm, rw, None, gu, dn, 2, "gelu", 1.0, True), ref.moe(xm32, rw32, None, gu32, dn32, 2, "gelu", 1.0, True))
