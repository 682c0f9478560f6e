"""Compile every kernel and the megakernel for a GPU, without one: PTX, cubin and ptxas's register report.

Triton's NVIDIA backend and its bundled ptxas need no device, so this runs on any machine with the
Triton a user has (their torch's): `python -m photon_core.kernels.compile_check --arch 87 --report`
answers "does this Triton build every kernel for my Orin, and does the megakernel stay in registers".
TRITON_INTERPRET must be off (the kernels must be defined compiled). The tests compile through here
under the pinned Triton (test_kernels_compile_sm90.py) and under the older supported ones
(test_triton_versions.py), and bench/triton_versions.py prints the full matrix.

Case names: the per-op kernels by PER_OP's names; megakernel variants as
"megakernel_b<batch>_<fp32|bf16>[_kvbf16][_fp8][_trace][_pipe<N>][_prefetch<N>][_dot<N>][_wide<N>][_unroll<N>][_aligned][_static][_tiles][_lspans][_n<BLOCK_N>][_k<BLOCK_K>][_t<BLOCK_T>][_d<BLOCK_D>]"
(_trace: the traced build; _pipe / _prefetch / _dot / _wide / _unroll / _aligned / _static: kernel.KernelVariant;
_tiles: expert tasks over several column tiles, kernel.XTILES; _lspans: dense linear tasks over several, kernel.LTILES),
defaults the roofline's GPU tiling (BLOCK_N 64, BLOCK_K 128 / batch (>= 16), BLOCK_T 64, BLOCK_D 64),
BLOCK_S 8 and BLOCK_R 1024 (what a real vocabulary compiles).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
P = "*fp32"
# Every megakernel buffer argument a launch gets from torch (16-byte aligned) is specialised so.
MEGAKERNEL_ALIGNED = (0, 2, 3, 4, 5, 6)


def per_op_cases() -> dict[str, tuple[Any, dict[str, str], dict[str, Any]]]:
    """name -> (kernel, signature of its run-time arguments, constexpr values), at production tilings."""
    from photon_core.kernels import (attention, chained, conv, delta_rule, glu, kv_cache, linear, lstm, moe, norm,
                                     rotary, sampling)
    norm_sig = dict(x_ptr=P, res_ptr=P, sum_ptr=P, w_ptr=P, b_ptr=P, gate_ptr=P, y_ptr=P, N="i32", eps="fp32",
                    offset="fp32")
    lin_sig = dict(x_ptr=P, w_ptr=P, b_ptr=P, r_ptr=P, y_ptr=P, M="i32", N="i32", K="i32")
    pre_sig = dict(q_ptr=P, k_ptr=P, v_ptr=P, o_ptr=P, bias_ptr=P, TQ="i32", TK="i32", D="i32", PREFIX="i32",
                   scale="fp32", GROUP="i32", WINDOW="i32", HQ="i32", BIAS_SB="i32")
    delta_sig = dict(q_ptr=P, k_ptr=P, v_ptr=P, g_ptr=P, beta_ptr=P, s_ptr=P, o_ptr=P, ns_ptr=P)
    # The per-op engine's chained build (kernels/chained.py) as an H100 runs it: bf16 weights and
    # caches, launches chained (PDL) where this Triton chains them (chained.HAS_GDC: not 3.4, whose
    # gdc does not compile); "_orin": the same without PDL (sm_87 has no griddepcontrol).
    PDL = chained.HAS_GDC
    B16 = "*bf16"
    ch_lin = dict(x_ptr=P, w_ptr=B16, b_ptr=B16, r_ptr=P, y_ptr=P, M="i32", N="i32", K="i32", stride_w="i32",
                  nw_ptr=P, nb_ptr=P, eps="fp32", offset="fp32", g_ptr=P, stride_x="i32", stride_g="i32")
    # tiles as chained.linear_blocks picks them for Moondream 2 on an H100/H200 (264 programs):
    # its q|k|v and fc1 at batch 1 (16 x 256), its fc2 and proj (8 x 512), q|k|v at batch 8 (16 x 64)
    ch_lin_c = dict(HAS_BIAS=True, HAS_RES=True, ACT=2, ROUND_X=True, NORM=0, HAS_NW=False, HAS_NB=False,
                    STATS_K=2048, GATE_ACT=0, HAS_G=False, BLOCK_M=1, BLOCK_N=16, BLOCK_K=256)
    ch_part = dict(q_ptr=P, k_ptr=B16, v_ptr=B16, len_ptr="*i64", part_ptr=P, tick_ptr="*i32", o_ptr=P, HQ="i32",
                   GROUP="i32", DH="i32", S="i32", scale="fp32", WINDOW="i32", T="i32", RING="i32", sk_b="i32",
                   sk_h="i32", sv_b="i32", sv_h="i32")
    ch_rot = dict(qkv_ptr=P, q_ptr=P, kc_ptr=B16, vc_ptr=B16, pos_ptr="*i64", rpos_ptr="*i64", cos_ptr=P, sin_ptr=P,
                  qn_ptr=P, kn_ptr=P, t_ptr=P, alpha_ptr=P, HQ="i32", H="i32", DH="i32", HALF="i32", QKV_W="i32",
                  RING="i32", sk_b="i32", sk_h="i32", sk_t="i32", sv_b="i32", sv_h="i32", sv_t="i32", QN="i32",
                  KN="i32", VN="i32", eps="fp32", offset="fp32")
    ch_up = dict(x_ptr=P, logit_ptr=P, w_ptr="*u8", s_ptr=P, h_ptr=P, id_ptr="*i32", rw_ptr=P, D="i32", F="i32",
                 E="i32", K="i32", stride_e="i32", stride_w="i32", up_offset="fp32")
    ch_up_c = dict(ACT=1, RENORM=True, PDL=PDL, BLOCK_E=64, BLOCK_K=8, BLOCK_F=16, BLOCK_D=128)
    chained_cases = {
        "chained_linear": (chained.linear_kernel, ch_lin, dict(ch_lin_c, PDL=PDL)),
        "chained_linear_norm": (chained.linear_kernel, ch_lin,
                                dict(ch_lin_c, PDL=PDL, NORM=1, HAS_NW=True, HAS_NB=True, HAS_RES=False)),
        "chained_linear_n8": (chained.linear_kernel, ch_lin, dict(ch_lin_c, PDL=PDL, BLOCK_N=8, BLOCK_K=512)),
        # an MLP's down projection applying its GLU (Qwen3's, Gemma's: silu; 8 x 512 as fc2 above)
        "chained_linear_glu": (chained.linear_kernel, ch_lin,
                               dict(ch_lin_c, PDL=PDL, NORM=3, GATE_ACT=3, HAS_G=True, HAS_BIAS=False, BLOCK_N=8,
                                    BLOCK_K=512)),
        "chained_linear_b8": (chained.linear_kernel, ch_lin,
                              dict(ch_lin_c, PDL=PDL, BLOCK_M=8, BLOCK_K=64, NORM=1, HAS_NW=True, HAS_NB=True,
                                   STATS_K=512)),
        "chained_gated": (chained.gated_kernel, dict(a_ptr=P, b_ptr=P, y_ptr=P, W="i32", stride_a="i32",
                                                     stride_b="i32"), dict(ACT=3, HAS_B=True, PDL=PDL, BLOCK=1024)),
        "chained_add_norm": (chained.add_norm_kernel, dict(x_ptr=P, z_ptr=P, w_ptr=P, sw_ptr=P, y_ptr=P, W="i32",
                                                           CHUNK="i32", eps="fp32", offset="fp32", scale="fp32"),
                             dict(HAS_SW=True, PDL=PDL, BLOCK=2048)),
        "chained_linear_orin": (chained.linear_kernel, ch_lin, dict(ch_lin_c, PDL=False)),
        "chained_norm": (chained.norm_kernel, dict(x_ptr=P, w_ptr=P, b_ptr=P, y_ptr=P, N="i32", eps="fp32",
                                                   offset="fp32"),
                         dict(HAS_WEIGHT=True, HAS_BIAS=True, RMS=False, PDL=PDL, BLOCK_N=2048)),
        "chained_rotary_append": (chained.rotary_append_kernel, ch_rot,
                                  dict(ROTARY=True, HEAD_NORM=True, TAU=False, APPEND=True, BF16_CACHE=True,
                                       PDL=PDL, BLOCK_D=128)),
        "chained_rotary_append_tau": (chained.rotary_append_kernel, ch_rot,
                                      dict(ROTARY=True, HEAD_NORM=False, TAU=True, APPEND=True, BF16_CACHE=True,
                                           PDL=PDL, BLOCK_D=64)),
        # Moondream 3's experts at batch 1 on an H100/H200 (chained.moe_blocks at 264 programs): FP8
        # bytes (and bf16), up 16 features x 128 a step, down 8 outputs x 512 a step
        "chained_moe_up": (chained.moe_up_kernel, ch_up, dict(ch_up_c, FP8=True, ROUND_X=False)),
        "chained_moe_up_bf16": (chained.moe_up_kernel, dict(ch_up, w_ptr=B16), dict(ch_up_c, FP8=False, ROUND_X=True)),
        "chained_moe_down": (chained.moe_down_kernel,
                             dict(h_ptr=P, id_ptr="*i32", rw_ptr=P, w_ptr="*u8", s_ptr=P, r_ptr=P, y_ptr=P, D="i32",
                                  F="i32", K="i32", stride_e="i32", stride_w="i32"),
                             dict(FP8=True, ROUND_H=False, HAS_RES=True, PDL=PDL, BLOCK_N=8, BLOCK_F=512)),
        # Qwen 3.5 0.8B's Gated DeltaNet at decode: 256 channels of the conv, one 128 x 128 head a program
        "chained_conv_step": (chained.conv_step_kernel, dict(x_ptr=P, w_ptr=P, s_ptr=P, y_ptr=P, C="i32", X_W="i32",
                                                             c0="i32", W="i32"),
                              dict(ACT=3, PDL=PDL, BLOCK_N=chained.CONV_BLOCK)),
        "chained_delta_step": (chained.delta_step_kernel,
                               dict(x_ptr=P, zba_ptr=P, alog_ptr=P, dtb_ptr=P, nw_ptr=P, s_ptr=P, y_ptr=P, X_W="i32",
                                    Z_W="i32", c0="i32", HK="i32", HV="i32", DK="i32", DV="i32", eps="fp32"),
                               dict(PDL=PDL, BLOCK_K=chained.DELTA_SLAB // 128, BLOCK_V=128)),
        "chained_step_begin": (chained.step_begin_kernel,
                               dict(dyn_ptr="*i32", tok_ptr="*i64", pos_ptr="*i64", rot_ptr="*i64", cross_ptr="*i64",
                                    bad_ptr="*i32", B="i32", POS_ROWS="i32", ROT_ROWS="i32", TOK_ROWS="i32"),
                               dict(PDL=PDL, BLOCK_B=8)),
        "chained_embed": (chained.embed_kernel, dict(tok_ptr="*i64", pos_ptr="*i64", table_ptr=B16, stride_t="i32",
                                                     ptable_ptr=B16, stride_p="i32", y_ptr=P, D="i32", scale="fp32"),
                          dict(HAS_POS=True, PDL=PDL, BLOCK=1024)),
        "chained_argmax_partial": (chained.argmax_partial_kernel,
                                   dict(x_ptr=P, stride_x="i32", C0="i32", C1="i32", pv_ptr=P, pi_ptr="*i32", S="i32"),
                                   dict(PDL=PDL, BLOCK=chained.ARGMAX_BLOCK)),
        "chained_argmax": (chained.argmax_kernel, dict(pv_ptr=P, pi_ptr="*i32", S="i32", res_ptr="*i32",
                                                       res_stride="i32", dyn_ptr="*i32", B="i32", MAX_POS="i32",
                                                       bad_ptr="*i32", err_ptr="*i32"),
                           dict(ADVANCE=True, PDL=PDL, BLOCK_S=16)),
        "chained_attention": (chained.attention_kernel, ch_part,
                              dict(SELF=True, PDL=PDL, BLOCK_T=chained.ATTENTION_BLOCK_T, BLOCK_S=16, BLOCK_D=64)),
    }
    return chained_cases | {
        "norm": (norm._norm_kernel, norm_sig,
                 dict(HAS_RES=True, HAS_BIAS=True, HAS_WEIGHT=True, HAS_GATE=False, RMS=False, BLOCK_N=512)),
        "norm_rms_gated": (norm._norm_kernel, norm_sig,
                           dict(HAS_RES=False, HAS_BIAS=False, HAS_WEIGHT=True, HAS_GATE=True, RMS=True,
                                BLOCK_N=128)),
        "linear_gemv": (linear._linear_gemv_kernel, lin_sig,
                        dict(HAS_BIAS=True, HAS_RES=True, ACT=1, BLOCK_M=8, BLOCK_N=32, BLOCK_K=32)),
        "linear_tiled": (linear._linear_tiled_kernel, lin_sig,
                         dict(HAS_BIAS=True, HAS_RES=True, ACT=2, BLOCK_M=32, BLOCK_N=32, BLOCK_K=32)),
        "rotary": (rotary._rotary_kernel, dict(x_ptr=P, cos_ptr=P, sin_ptr=P, y_ptr=P, T="i32", D="i32", HALF="i32"),
                   dict(BLOCK_R=16, BLOCK_D=64)),
        "kv_append": (kv_cache._append_kernel, dict(k_ptr=P, v_ptr=P, kc_ptr=P, vc_ptr=P, pos_ptr="*i32", H="i32",
                                                   T_NEW="i32", T_MAX="i32", D="i32"), dict(BLOCK_D=64)),
        "attn_prefill": (attention._prefill_kernel, pre_sig,
                         dict(CAUSAL=True, HAS_BIAS=False, BLOCK_M=16, BLOCK_N=16, BLOCK_D=64)),
        "attn_prefill_bias": (attention._prefill_kernel, pre_sig,
                              dict(CAUSAL=False, HAS_BIAS=True, BLOCK_M=16, BLOCK_N=16, BLOCK_D=64)),
        "attn_decode_partial": (attention._decode_partial_kernel,
                                dict(q_ptr=P, k_ptr=P, v_ptr=P, len_ptr="*i32", part_ptr=P, H="i32", T_MAX="i32",
                                     D="i32", S="i32", scale="fp32", WINDOW="i32"), dict(BLOCK_T=32, BLOCK_D=64)),
        "attn_decode_partial_gqa": (attention._decode_partial_group_kernel,
                                    dict(q_ptr=P, k_ptr=P, v_ptr=P, len_ptr="*i32", part_ptr=P, HKV="i32",
                                         T_MAX="i32", D="i32", S="i32", scale="fp32", WINDOW="i32", GROUP="i32"),
                                    dict(BLOCK_G=16, BLOCK_T=32, BLOCK_D=128)),
        "attn_decode_merge": (attention._decode_merge_kernel, dict(part_ptr=P, o_ptr=P, S="i32", D="i32"),
                              dict(BLOCK_S=8, BLOCK_D=64)),
        "argmax": (sampling._argmax_kernel, dict(x_ptr=P, m_ptr="*u8", out_ptr="*i64", V="i32"),
                   dict(HAS_MASK=True, BLOCK_V=1024)),
        "sample": (sampling._sample_kernel,
                   dict(x_ptr=P, u_ptr=P, out_ptr="*i64", V="i32", inv_t="fp32", top_p="fp32"),
                   dict(USE_TOP_P=True, N_ITER=sampling.N_BISECT, BLOCK_V=1024)),
        "glu": (glu._glu_kernel,
                dict(g_ptr=P, u_ptr=P, y_ptr=P, F="i32", stride_g="i32", stride_u="i32", up_offset="fp32"),
                dict(ACT=2, BLOCK_F=1024)),
        "moe_route": (moe._route_kernel, dict(logit_ptr=P, w_ptr=P, id_ptr="*i64", E="i32", K="i32"),
                      dict(RENORM=True, BLOCK_E=64, BLOCK_K=8)),
        "moe_up": (moe._experts_up_kernel, dict(x_ptr=P, wgu_ptr=P, id_ptr="*i64", h_ptr=P, D="i32", F="i32",
                                                K="i32", up_offset="fp32"),
                   dict(ACT=1, BLOCK_F=moe.UP_BLOCK_F, BLOCK_D=moe.UP_BLOCK_D)),
        "moe_down": (moe._experts_down_kernel, dict(h_ptr=P, wd_ptr=P, id_ptr="*i64", w_ptr=P, y_ptr=P, D="i32",
                                                    F="i32", K="i32"),
                     dict(BLOCK_N=moe.DOWN_BLOCK_N, BLOCK_F=moe.DOWN_BLOCK_F)),
        "causal_conv1d": (conv._causal_conv1d_kernel, dict(x_ptr=P, w_ptr=P, b_ptr=P, s_ptr=P, y_ptr=P, ns_ptr=P,
                                                           T="i32", C="i32"),
                          dict(W=4, HAS_BIAS=True, HAS_STATE=True, SILU=True, BLOCK_T=conv.CONV_BLOCK_T,
                               BLOCK_C=conv.CONV_BLOCK_C, BLOCK_S=4)),
        "delta_step": (delta_rule._delta_step_kernel, dict(delta_sig, DK="i32", DV="i32", GROUP="i32", scale="fp32"),
                       dict(L2=True, BLOCK_K=128, BLOCK_V=delta_rule.DELTA_BLOCK_V)),
        "delta_chunk": (delta_rule._delta_chunk_kernel,
                        dict(delta_sig, T="i32", HK="i32", HV="i32", DK="i32", DV="i32", GROUP="i32", scale="fp32"),
                        dict(HAS_STATE=True, L2=True, CHUNK=delta_rule.DELTA_CHUNK,
                             LOG_CHUNK=delta_rule.DELTA_CHUNK.bit_length() - 1, BLOCK_K=128,
                             BLOCK_V=delta_rule.DELTA_BLOCK_V)),
        "lstm_cell": (lstm._lstm_cell_kernel, dict(x_ptr=P, h_ptr=P, c_ptr=P, wih_ptr=P, whh_ptr=P, bih_ptr=P,
                                                   bhh_ptr=P, h_out_ptr=P, c_out_ptr=P, B="i32", I="i32", H="i32"),
                      dict(HAS_BIH=True, HAS_BHH=True, BLOCK_B=1, BLOCK_H=lstm.LSTM_BLOCK_H,
                           BLOCK_K=lstm.LSTM_BLOCK_K)),
    }


PER_OP = ("norm", "norm_rms_gated", "linear_gemv", "linear_tiled", "rotary", "kv_append", "attn_prefill",
          "attn_prefill_bias", "attn_decode_partial", "attn_decode_partial_gqa", "attn_decode_merge", "argmax",
          "sample", "glu", "moe_route", "moe_up", "moe_down", "causal_conv1d", "delta_step", "delta_chunk",
          "lstm_cell", "chained_linear", "chained_linear_norm", "chained_linear_n8", "chained_linear_b8",
          "chained_linear_glu", "chained_gated", "chained_norm", "chained_rotary_append", "chained_attention",
          "chained_step_begin", "chained_embed", "chained_argmax_partial", "chained_argmax",
          "chained_add_norm", "chained_rotary_append_tau", "chained_moe_up", "chained_moe_up_bf16", "chained_moe_down",
          "chained_conv_step", "chained_delta_step")
# Arguments a launch specialises as multiples of 16 (pointers from torch, sizes and strides of real
# models: Triton's JIT does it at run time), where a kernel's vector loads depend on it.
PER_OP_ALIGNED = {k: (0, 1, 2, 3, 4, 6, 7, 8, 9, 10, 13, 14, 15) for k in ("chained_linear", "chained_linear_norm",
                                                               "chained_linear_n8", "chained_linear_b8",
                                                               "chained_linear_orin", "chained_linear_glu")} | {
    "chained_moe_up": (0, 1, 2, 3, 4, 5, 6, 7, 8, 11, 12), "chained_moe_up_bf16": (0, 1, 2, 3, 4, 5, 6, 7, 8, 11, 12),
    "chained_moe_down": (0, 1, 2, 3, 4, 5, 6, 7, 8, 10, 11)}
_MK = re.compile(r"megakernel_b(\d+)_(fp32|bf16|fp16)((?:_kvbf16|_fp8|_trace|_pipe\d+|_prefetch\d|_dot\d+|_wide\d+|_unroll\d|_aligned|_static|_tiles|_lspans|_[ntdk]\d+)*)$")


def compile_env(first: Path | None = None, cache_dir: Path | None = None) -> dict[str, str]:
    """The environment of a `python -m photon_core.kernels.compile_check` subprocess: `first` (a side
    install of another Triton) first on PYTHONPATH, the project next; the interpreter off (kernels
    must be defined compiled). cache_dir: Triton's kernel cache; give a fresh one to measure or check
    a build. (Triton 3.3's cache key leaves out global constexprs, such as the megakernel's
    per-version tile budgets: an old entry would answer.)"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if cache_dir is not None:
        env["TRITON_CACHE_DIR"] = str(cache_dir)
    env["PYTHONPATH"] = os.pathsep.join([str(first)] * (first is not None) + [str(ROOT), env.get("PYTHONPATH", "")])
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    return env


def megakernel_case(name: str) -> tuple[Any, dict[str, str], dict[str, Any]]:
    """The megakernel compiled as a launch of the named variant would compile it (module docstring):
    its constexprs from kernel.megakernel_meta, as Megakernel's."""
    import triton

    from photon_core.megakernel import kernel as mk
    m = _MK.match(name)
    if m is None:
        raise ValueError(f"not a megakernel variant name: {name!r} (e.g. megakernel_b8_bf16_kvbf16_d128)")
    batch, wdt, opts = int(m.group(1)), m.group(2), m.group(3)
    tiles = {k: int(v) for k, v in re.findall(r"_([ntdk])(\d+)", opts)}
    build = {k: int(v) for k, v in re.findall(r"_(pipe|prefetch|dot|wide|unroll)(\d+)", opts)}
    variant = mk.KernelVariant(pipeline=build.get("pipe", 0), prefetch=build.get("prefetch", 0), dot=build.get("dot", 0),
                               wide=build.get("wide", 0), unroll=build.get("unroll", 0), aligned="_aligned" in opts,
                               static="_static" in opts)
    sig = dict(tasks_ptr="*i64", num_tasks="i32", ctrl_ptr="*i32", dyn_ptr="*i32", w_ptr="*" + wdt, s_ptr=P,
               out_ptr="*i32", B="i32", ln_eps="fp32", spin_limit="i32", trace_ptr="*i64")
    # The roofline tiling's K step is 128 / the batch's row block (>= 16); 8 decode splits and 1024
    # tiles (BLOCK_R's cap) are what a real context and vocabulary compile.
    block_k = tiles.get("k", max(16, 128 // triton.next_power_of_2(batch)))
    const = dict(mk.megakernel_meta(batch, tiles.get("n", 64), block_k, tiles.get("t", 64), tiles.get("d", 64),
                                    max_splits=8, max_tiles=1024),
                 RUN_TASK=mk.step_tasks_for("_kvbf16" in opts, "_fp8" in opts), TRACE=int("_trace" in opts),
                 **variant.constexprs())
    # _aligned: a table of 16-aligned caches, as every family's (kernel.kv_aligned)
    const["LOOP"] += mk.KV16 if variant.aligned else 0
    # _lspans: a table whose dense linear tasks span several column tiles (Tiling.linear_span > 1)
    const["LOOP"] += mk.LTILES if "_lspans" in opts else 0
    # _tiles: a table whose expert tasks span several column tiles (Tiling.expert_span > 1)
    const["XLOOP"] = mk.expert_loop(variant, const["BLOCK_M"], 1 if "_fp8" in opts else 4 if wdt == "fp32" else 2,
                                    mk.Megakernel.tuning, "_tiles" in opts)
    return mk._megakernel, sig, const


def compile_case(name: str, arch: int) -> tuple[Any, float]:
    """(Triton's compiled kernel, seconds) of one case for sm_<arch>. The megakernel gets the launch
    options the running Triton needs (triton_versions.megakernel_options)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from photon_core.kernels import triton_versions
    mega = name.startswith("megakernel")
    cases = {} if mega else per_op_cases()
    if not mega and name not in cases:
        raise ValueError(f"unknown case {name!r}: a per-op kernel ({', '.join(PER_OP)}) or a megakernel variant "
                         "(megakernel_b<batch>_<fp32|bf16|fp16>...)")
    fn, sig, const = megakernel_case(name) if mega else cases[name]
    sig = dict(sig, **{k: "constexpr" for k in const})
    aligned = MEGAKERNEL_ALIGNED if mega else PER_OP_ALIGNED.get(name, ())
    attrs = {(i,): [["tt.divisibility", 16]] for i in aligned} or None
    options = triton_versions.megakernel_options() if mega else {}
    t0 = time.perf_counter()
    ck = triton.compile(ASTSource(fn, sig, const, attrs=attrs), target=GPUTarget("cuda", arch, 32),
                        options=options or None)
    return ck, time.perf_counter() - t0


def ptxas_path(arch: int) -> str:
    """The ptxas the running Triton assembles sm_<arch> with (its API differs between versions)."""
    from triton.backends.nvidia.compiler import get_ptxas
    try:
        tool = get_ptxas(arch)
    except TypeError:   # 3.4 and 3.5 take no target
        tool = get_ptxas()
    return tool[0] if isinstance(tool, tuple) else tool.path


def ptxas_report(ptx: str, arch: int) -> dict[str, int]:
    """ptxas -v on the PTX: registers per thread, bytes of spill stores / loads, stack frame."""
    found = re.search(r"\.target\s+(sm_\w+)", ptx)
    if found is None:
        raise ValueError("no .target line in the PTX")
    target = found.group(1)
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        r = subprocess.run([ptxas_path(arch), f"-arch={target}", "-v", str(src), "-o", str(Path(tmp) / "k.cubin")],
                           capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        raise RuntimeError(f"ptxas failed on {target}: {r.stderr[-2000:]}")
    text = r.stdout + r.stderr

    def total(pattern: str) -> int:
        found = re.findall(pattern, text)
        if not found:
            raise RuntimeError(f"no {pattern!r} in ptxas's report: {text[-1000:]}")
        return max(int(n) for n in found)
    return dict(registers=total(r"Used (\d+) registers"), spill_stores=total(r"(\d+) bytes spill stores"),
                spill_loads=total(r"(\d+) bytes spill loads"), stack=total(r"(\d+) bytes stack frame"))


def resource_usage(cubin: bytes, arch: int) -> dict[str, int]:
    """Registers per thread and stack bytes of a cubin (cuobjdump -res-usage, next to the ptxas):
    a cheaper check than ptxas -v (no second assembly). A stack of 0 means no spill and no local array."""
    from photon_core.kernels.sass_loops import on_disk
    tool = Path(ptxas_path(arch)).parent / "cuobjdump"
    with on_disk(cubin) as path:
        r = subprocess.run([str(tool), "-res-usage", str(path)], capture_output=True, text=True, timeout=120)
    m = re.search(r"REG:(\d+) STACK:(\d+)", r.stdout)
    if r.returncode != 0 or m is None:
        raise RuntimeError(f"cuobjdump -res-usage failed: {r.stdout[-1000:]}{r.stderr[-1000:]}")
    return dict(registers=int(m.group(1)), stack=int(m.group(2)))


def build_usage(ck: Any, arch: int) -> dict[str, int]:
    """A compiled kernel's registers and stack (resource_usage) and the shared memory a program
    takes (bytes, Triton's metadata: with the registers, how many programs an SM holds)."""
    return dict(resource_usage(ck.asm["cubin"], arch), shared_memory=int(ck.metadata.shared))


def sass_loops_of(cubin: bytes, arch: int) -> dict[str, list[dict[str, Any]]]:
    """The megakernel's loops per trip and thread, read from one disassembly of the cubin's SASS
    (sass_loops, with the disassembler next to the running Triton's ptxas), one dict per loop
    (task, loads by width, weight and in-flight bytes, barriers, shared-memory instructions,
    spill loads and stores: local; later trips in flight at a pipelined loop's wait: ahead).
    "k_loops": the weight-streaming loops, whose loads are the lines of kernel.py holding
    sass_loops.WEIGHT_LOAD (found in the source: an edit that moves them moves nothing here).
    "attention_loops": the attention key loops (decode_partial, inlined), "weight_bytes" being the
    K and V bytes a step moves: every global load on a line of decode_partial's key loop counts
    (ptxas records a load on any line of its statement, or the next; the loop holds no other
    global load)."""
    from photon_core.kernels import sass_loops
    nvdisasm = str(Path(ptxas_path(arch)).parent / "nvdisasm")
    insns, labels = sass_loops.instructions(sass_loops.disassemble(cubin, nvdisasm))

    def found(source: Path, sites: Any) -> list[sass_loops.Loop]:
        text = source.read_text().splitlines()
        names = sass_loops.enclosing_functions(text)
        return sass_loops.loops(insns, labels, source.name, sites(text, names), names)

    def key_loop_lines(text: list[str], names: dict[int, str]) -> set[int]:
        lines = [n for n, f in names.items() if f == "decode_partial"]
        start = next(n for n in lines if text[n - 1].lstrip().startswith("for "))
        return {n for n in lines if n > start}

    def record(lp: Any, task: str) -> dict[str, Any]:
        return dict(task=task, loads=lp.loads, weight_bytes=lp.weight_bytes, in_flight_bytes=lp.in_flight_bytes,
                    barriers=lp.barriers, shared=lp.shared, local=lp.local, ahead=lp.ahead)
    dense = found(ROOT / "photon_core" / "megakernel" / "kernel.py",
                  lambda text, names: sass_loops.load_sites(text, sass_loops.WEIGHT_LOAD, names))
    keys = found(ROOT / "photon_core" / "kernels" / "attention.py", key_loop_lines)
    return dict(k_loops=[record(lp, lp.task) for lp in dense],
                attention_loops=[record(lp, "decode_partial") for lp in keys])


def run(cases: list[str], archs: list[int], report: bool, ptx: bool, usage: bool = False,
        loops: bool = False) -> dict[str, Any]:
    """{"triton": version, "cases": {"<case>@sm_<arch>": {seconds, cubin, [ptx], [registers, ...]}}}:
    report adds ptxas -v's figures, usage cuobjdump's (registers, stack) and the shared memory a
    program takes (bytes, Triton's metadata), loops (megakernel cases)
    the K loops' and attention loops' figures from the SASS (sass_loops_of) and the threads of a
    program."""
    import triton
    out: dict[str, Any] = {}
    for arch in archs:
        for name in cases:
            ck, seconds = compile_case(name, arch)
            rec: dict[str, Any] = dict(seconds=round(seconds, 2), cubin=len(ck.asm["cubin"]))
            if report:
                t0 = time.perf_counter()
                rec.update(ptxas_report(ck.asm["ptx"], arch), ptxas_seconds=round(time.perf_counter() - t0, 2))
            if usage:
                rec.update(build_usage(ck, arch))
            if loops and name.startswith("megakernel"):
                rec.update(sass_loops_of(ck.asm["cubin"], arch), threads=32 * ck.metadata.num_warps)
            if ptx:
                rec["ptx"] = ck.asm["ptx"]
            out[f"{name}@sm_{arch}"] = rec
            print(f"{name}@sm_{arch}: {seconds:.1f} s", file=sys.stderr, flush=True)
    return {"triton": triton.__version__, "cases": out}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", type=int, nargs="+", default=[90], help="compute capabilities, e.g. 80 87 90")
    p.add_argument("--cases", nargs="+", default=None,
                   help="case names (default: every per-op kernel and megakernel_b1_fp32, _b8_fp32, _b1_bf16)")
    p.add_argument("--report", action="store_true", help="ptxas -v: registers and spills of each case")
    p.add_argument("--usage", action="store_true", help="cuobjdump -res-usage: registers and stack of each case")
    p.add_argument("--ptx", action="store_true", help="include each case's PTX in the JSON")
    p.add_argument("--loops", action="store_true", help="the megakernel's weight loops per trip, from its SASS")
    args = p.parse_args(argv)
    cases = args.cases or list(PER_OP) + ["megakernel_b1_fp32", "megakernel_b8_fp32", "megakernel_b1_bf16"]
    print(json.dumps(run(cases, args.arch, args.report, args.ptx, args.usage, args.loops)))


if __name__ == "__main__":
    main()
