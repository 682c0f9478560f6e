"""Compile every kernel (and the megakernel) for an H100/H200 (sm_90) WITHOUT a GPU.

The interpreter runs kernels as Python and so misses what only the compiler checks (types of values
merged across runtime branches, loop-carried types, unsupported ops). Triton's NVIDIA backend and its
bundled ptxas need no device to produce PTX and a cubin, so each kernel is compiled here in a
subprocess (TRITON_INTERPRET must be off when the kernels are defined), and the megakernel's PTX is
checked for the intended synchronisation: acquire loads for waits, a release reduction for signals,
CTA barriers around both.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = r'''
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from photon_core.kernels import attention, conv, delta_rule, glu, kv_cache, linear, lstm, moe, norm, rotary, sampling
from photon_core.megakernel import kernel as mk
from photon_core.megakernel.graph import NUM_FIELDS

T = GPUTarget("cuda", 90, 32)
P = "*fp32"
cases = {
  "norm": (norm._norm_kernel, dict(x_ptr=P, res_ptr=P, sum_ptr=P, w_ptr=P, b_ptr=P, gate_ptr=P, y_ptr=P, N="i32",
                                   eps="fp32", offset="fp32"),
           dict(HAS_RES=True, HAS_BIAS=True, HAS_WEIGHT=True, HAS_GATE=False, RMS=False, BLOCK_N=512)),
  "norm_rms_gated": (norm._norm_kernel, dict(x_ptr=P, res_ptr=P, sum_ptr=P, w_ptr=P, b_ptr=P, gate_ptr=P, y_ptr=P,
                                             N="i32", eps="fp32", offset="fp32"),
                     dict(HAS_RES=False, HAS_BIAS=False, HAS_WEIGHT=True, HAS_GATE=True, RMS=True, BLOCK_N=128)),
  "linear_gemv": (linear._linear_gemv_kernel, dict(x_ptr=P, w_ptr=P, b_ptr=P, r_ptr=P, y_ptr=P, M="i32", N="i32", K="i32"),
                  dict(HAS_BIAS=True, HAS_RES=True, ACT=1, BLOCK_M=8, BLOCK_N=32, BLOCK_K=32)),
  "linear_tiled": (linear._linear_tiled_kernel, dict(x_ptr=P, w_ptr=P, b_ptr=P, r_ptr=P, y_ptr=P, M="i32", N="i32", K="i32"),
                   dict(HAS_BIAS=True, HAS_RES=True, ACT=2, BLOCK_M=32, BLOCK_N=32, BLOCK_K=32)),
  "rotary": (rotary._rotary_kernel, dict(x_ptr=P, cos_ptr=P, sin_ptr=P, y_ptr=P, T="i32", D="i32", HALF="i32"),
             dict(BLOCK_R=16, BLOCK_D=64)),
  "kv_append": (kv_cache._append_kernel, dict(k_ptr=P, v_ptr=P, kc_ptr=P, vc_ptr=P, pos_ptr="*i32", H="i32",
                                             T_NEW="i32", T_MAX="i32", D="i32"), dict(BLOCK_D=64)),
  "attn_prefill": (attention._prefill_kernel, dict(q_ptr=P, k_ptr=P, v_ptr=P, o_ptr=P, bias_ptr=P, TQ="i32", TK="i32",
                                                  D="i32", PREFIX="i32", scale="fp32", GROUP="i32", WINDOW="i32",
                                                  HQ="i32", BIAS_SB="i32"),
                   dict(CAUSAL=True, HAS_BIAS=False, BLOCK_M=16, BLOCK_N=16, BLOCK_D=64)),
  "attn_prefill_bias": (attention._prefill_kernel, dict(q_ptr=P, k_ptr=P, v_ptr=P, o_ptr=P, bias_ptr=P, TQ="i32",
                                                       TK="i32", D="i32", PREFIX="i32", scale="fp32", GROUP="i32",
                                                       WINDOW="i32", HQ="i32", BIAS_SB="i32"),
                        dict(CAUSAL=False, HAS_BIAS=True, BLOCK_M=16, BLOCK_N=16, BLOCK_D=64)),
  "attn_decode_partial": (attention._decode_partial_kernel,
                          dict(q_ptr=P, k_ptr=P, v_ptr=P, len_ptr="*i32", part_ptr=P, H="i32", T_MAX="i32", D="i32",
                               S="i32", scale="fp32", WINDOW="i32"), dict(BLOCK_T=32, BLOCK_D=64)),
  "attn_decode_partial_gqa": (attention._decode_partial_group_kernel,
                              dict(q_ptr=P, k_ptr=P, v_ptr=P, len_ptr="*i32", part_ptr=P, HKV="i32", T_MAX="i32",
                                   D="i32", S="i32", scale="fp32", WINDOW="i32", GROUP="i32"),
                              dict(BLOCK_G=16, BLOCK_T=32, BLOCK_D=128)),
  "attn_decode_merge": (attention._decode_merge_kernel, dict(part_ptr=P, o_ptr=P, S="i32", D="i32"),
                        dict(BLOCK_S=8, BLOCK_D=64)),
  "argmax": (sampling._argmax_kernel, dict(x_ptr=P, m_ptr="*u8", out_ptr="*i64", V="i32"),
             dict(HAS_MASK=True, BLOCK_V=1024)),
  "sample": (sampling._sample_kernel, dict(x_ptr=P, u_ptr=P, out_ptr="*i64", V="i32", inv_t="fp32", top_p="fp32"),
             dict(USE_TOP_P=True, N_ITER=sampling.N_BISECT, BLOCK_V=1024)),
  "glu": (glu._glu_kernel, dict(g_ptr=P, u_ptr=P, y_ptr=P, F="i32", stride_g="i32", stride_u="i32", up_offset="fp32"),
          dict(ACT=2, BLOCK_F=1024)),
  "moe_route": (moe._route_kernel, dict(logit_ptr=P, w_ptr=P, id_ptr="*i64", E="i32", K="i32"),
                dict(RENORM=True, BLOCK_E=64, BLOCK_K=8)),
  "moe_up": (moe._experts_up_kernel, dict(x_ptr=P, wgu_ptr=P, id_ptr="*i64", h_ptr=P, D="i32", F="i32", K="i32",
                                          up_offset="fp32"),
             dict(ACT=1, BLOCK_F=moe.UP_BLOCK_F, BLOCK_D=moe.UP_BLOCK_D)),
  "moe_down": (moe._experts_down_kernel, dict(h_ptr=P, wd_ptr=P, id_ptr="*i64", w_ptr=P, y_ptr=P, D="i32", F="i32",
                                              K="i32"), dict(BLOCK_N=moe.DOWN_BLOCK_N, BLOCK_F=moe.DOWN_BLOCK_F)),
  "causal_conv1d": (conv._causal_conv1d_kernel, dict(x_ptr=P, w_ptr=P, b_ptr=P, s_ptr=P, y_ptr=P, ns_ptr=P, T="i32",
                                                     C="i32"),
                    dict(W=4, HAS_BIAS=True, HAS_STATE=True, SILU=True, BLOCK_T=conv.CONV_BLOCK_T,
                         BLOCK_C=conv.CONV_BLOCK_C, BLOCK_S=4)),
  "delta_step": (delta_rule._delta_step_kernel, dict(q_ptr=P, k_ptr=P, v_ptr=P, g_ptr=P, beta_ptr=P, s_ptr=P, o_ptr=P,
                                                     ns_ptr=P, DK="i32", DV="i32", GROUP="i32", scale="fp32"),
                 dict(L2=True, BLOCK_K=128, BLOCK_V=delta_rule.DELTA_BLOCK_V)),
  "delta_chunk": (delta_rule._delta_chunk_kernel, dict(q_ptr=P, k_ptr=P, v_ptr=P, g_ptr=P, beta_ptr=P, s_ptr=P,
                                                       o_ptr=P, ns_ptr=P, T="i32", HK="i32", HV="i32", DK="i32",
                                                       DV="i32", GROUP="i32", scale="fp32"),
                  dict(HAS_STATE=True, L2=True, CHUNK=delta_rule.DELTA_CHUNK,
                       LOG_CHUNK=delta_rule.DELTA_CHUNK.bit_length() - 1, BLOCK_K=128,
                       BLOCK_V=delta_rule.DELTA_BLOCK_V)),
  "lstm_cell": (lstm._lstm_cell_kernel, dict(x_ptr=P, h_ptr=P, c_ptr=P, wih_ptr=P, whh_ptr=P, bih_ptr=P, bhh_ptr=P,
                                             h_out_ptr=P, c_out_ptr=P, B="i32", I="i32", H="i32"),
                dict(HAS_BIH=True, HAS_BHH=True, BLOCK_B=1, BLOCK_H=lstm.LSTM_BLOCK_H, BLOCK_K=lstm.LSTM_BLOCK_K)),
}
# The per-op kernels of the newer families also for the Jetson Orin (sm_87): their tl.dot tiles and
# reductions must lower there too.
SM87 = ("attn_decode_partial_gqa", "moe_up", "causal_conv1d", "delta_step", "delta_chunk", "lstm_cell")
msig = dict(tasks_ptr="*i64", num_tasks="i32", ctrl_ptr="*i32", dyn_ptr="*i32", w_ptr=P, s_ptr=P, out_ptr="*i32",
            B="i32", ln_eps="fp32", spin_limit="i32")
for b, wdt in ((1, P), (8, P), (1, "*bf16")):
    cases[f"megakernel_b{b}_{wdt[1:]}"] = (mk._megakernel, dict(msig, w_ptr=wdt),
        dict(NF=NUM_FIELDS, BLOCK_M=b, BLOCK_N=64, BLOCK_K=max(16, 128 // b), BLOCK_T=64, BLOCK_D=64,
             BLOCK_S=8, BLOCK_R=1024, RUN_TASK=mk.step_tasks))
# Moondream 3 on a GPU: bf16 weights and KV caches, FP8 experts (the task-table variant it compiles).
cases["megakernel_b1_bf16_kvbf16_fp8"] = (mk._megakernel, dict(msig, w_ptr="*bf16"),
    dict(cases["megakernel_b1_bf16"][2], RUN_TASK=mk.step_tasks_bf16_kv_fp8))
out = {}
for name, (fn, sig, const) in cases.items():
    sig = dict(sig)
    sig.update({k: "constexpr" for k in const})
    # A launch specializes 16-byte-aligned pointer arguments (tensors from torch always are): say so
    # for the megakernel's buffers, as a real launch compiles it.
    attrs = {(i,): [["tt.divisibility", 16]] for i in (0, 2, 3, 4, 5, 6)} if name.startswith("megakernel") else None
    ck = triton.compile(ASTSource(fn, sig, const, attrs=attrs), target=T)
    ptx = ck.asm["ptx"]
    out[name] = dict(cubin=len(ck.asm["cubin"]), ptx=ptx if name.startswith("megakernel") else "")
    if name in SM87:
        out[name + "_sm87"] = dict(cubin=len(triton.compile(ASTSource(fn, sig, const),
                                                            target=GPUTarget("cuda", 87, 32)).asm["cubin"]), ptx="")
# The megakernel for the Jetson Orin (sm_87) too, in bf16 at batch 1 (what a 16 GB Orin runs).
for name in ("megakernel_b1_bf16", "megakernel_b1_bf16_kvbf16_fp8"):
    fn, sig, const = cases[name]
    sig = dict(sig, **{k: "constexpr" for k in const})
    ck = triton.compile(ASTSource(fn, sig, const, attrs={(i,): [["tt.divisibility", 16]] for i in (0, 2, 3, 4, 5, 6)}),
                        target=GPUTarget("cuda", 87, 32))
    out[name + "_sm87"] = dict(cubin=len(ck.asm["cubin"]), ptx=ck.asm["ptx"])
print(json.dumps(out))
'''


@pytest.fixture(scope="module")
def compiled():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    r = subprocess.run([sys.executable, "-c", SCRIPT], env=env, cwd=ROOT, capture_output=True, text=True,
                       timeout=600)
    if r.returncode != 0 and ("ptxas" in r.stderr and "not found" in r.stderr):
        pytest.skip("triton's NVIDIA backend (ptxas) is not available here")
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_every_kernel_compiles_for_sm90(compiled):
    for name in ("norm", "norm_rms_gated", "linear_gemv", "linear_tiled", "rotary", "kv_append", "attn_prefill",
                 "attn_prefill_bias", "attn_decode_partial", "attn_decode_partial_gqa", "attn_decode_merge", "argmax", "sample",
                 "glu", "moe_route", "moe_up", "moe_down", "causal_conv1d", "delta_step", "delta_chunk", "lstm_cell",
                 "attn_decode_partial_gqa_sm87", "moe_up_sm87", "causal_conv1d_sm87", "delta_step_sm87",
                 "delta_chunk_sm87", "lstm_cell_sm87",
                 "megakernel_b1_fp32", "megakernel_b8_fp32", "megakernel_b1_bf16", "megakernel_b1_bf16_sm87",
                 "megakernel_b1_bf16_kvbf16_fp8", "megakernel_b1_bf16_kvbf16_fp8_sm87"):
        assert compiled[name]["cubin"] > 0, name


def test_megakernel_ptx_has_acquire_waits_and_release_signals(compiled):
    ptx = compiled["megakernel_b1_fp32"]["ptx"]
    assert "ld.global.gpu.acquire" in ptx or "atom.global.gpu.acquire" in ptx  # dependency waits
    assert "red.global.gpu.release.add" in ptx or "atom.global.gpu.release.add" in ptx  # signals
    assert "bar.sync" in ptx
    assert "ld.global.cg" in ptx  # activations written by other SMs are read past L1


def test_megakernel_claims_are_relaxed_and_the_header_is_read_before_any_branch(compiled):
    """Per-task overhead sits on the dependency chain: a claim only hands out an index (its
    ordering comes from the waits), so it is a relaxed atomic, no fence; the task header (op,
    two waits, the signal) is read as one group of loads before the first branch on it, one
    round trip to L2 instead of one per branch. Tickets (last partial merges, last tile computes
    row statistics) keep acq_rel: they order data."""
    import re
    for name in ("megakernel_b1_fp32", "megakernel_b8_fp32", "megakernel_b1_bf16", "megakernel_b1_bf16_sm87"):
        ptx = compiled[name]["ptx"]
        adds = re.findall(r"atom\.global\.gpu\.(\w+)\.add\.u32", ptx)
        assert adds.count("relaxed") == 2, (name, adds)    # the first claim and the loop's claim
        # The claim loop: from its header label to the first acquire poll.
        head = ptx.index("// =>This Loop Header: Depth=1")
        body = ptx[head:ptx.index("acquire", head)]
        loads = [m.start() for m in re.finditer(r"ld\.global\.b64", body)]
        assert len(loads) >= 6, (name, len(loads))
        assert "bra" not in body[:loads[5]], name


def test_megakernel_streams_weights_with_vector_loads(compiled):
    # The compiler pads weight rows and aligns offsets and K slices to 16 elements, and the linear
    # task says so (tl.multiple_of): its weight loads become 128-bit loads (4 fp32 or 8 bf16).
    for name in ("megakernel_b1_fp32", "megakernel_b1_bf16", "megakernel_b8_fp32", "megakernel_b1_bf16_sm87",
                 "megakernel_b1_bf16_kvbf16_fp8", "megakernel_b1_bf16_kvbf16_fp8_sm87"):
        assert "ld.global.v4" in compiled[name]["ptx"], name


def test_fp8_experts_decode_with_integer_ops_on_sm87_and_sm90(compiled):
    """The FP8 variant decodes e4m3 bytes through fp16 (cvt.f32.f16: no fp8 conversion, which Orin's
    sm_87 lacks) and stores bf16 KV; the float variant has neither."""
    for name in ("megakernel_b1_bf16_kvbf16_fp8", "megakernel_b1_bf16_kvbf16_fp8_sm87"):
        ptx = compiled[name]["ptx"]
        assert "cvt.f32.f16" in ptx and "e4m3" not in ptx, name
        assert "st.global.b16" in ptx or "st.global.u16" in ptx, name
    assert "cvt.f32.f16" not in compiled["megakernel_b1_bf16"]["ptx"]


def test_megakernel_registers_fit_without_spills(compiled, tmp_path):
    """ptxas's own report for the sm_90 builds at batch 1 and 8: every value stays in registers."""
    import re

    from triton.backends.nvidia.compiler import get_ptxas
    ptxas = get_ptxas(90).path
    for name in ("megakernel_b1_fp32", "megakernel_b8_fp32", "megakernel_b1_bf16", "megakernel_b1_bf16_kvbf16_fp8"):
        src = tmp_path / f"{name}.ptx"
        src.write_text(compiled[name]["ptx"])
        target = re.search(r"\.target\s+(sm_\w+)", compiled[name]["ptx"]).group(1)
        r = subprocess.run([ptxas, f"-arch={target}", "-v", str(src), "-o", str(tmp_path / "out.cubin")],
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        report = r.stdout + r.stderr
        spills = re.findall(r"(\d+) bytes spill stores", report)
        assert spills and all(int(n) == 0 for n in spills), (name, report[-500:])
