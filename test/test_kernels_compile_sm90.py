"""Compile every kernel (and the megakernel) for an H100/H200 (sm_90) WITHOUT a GPU.

The interpreter runs kernels as Python and so misses what only the compiler checks (types of values
merged across runtime branches, loop-carried types, unsupported ops). Triton's NVIDIA backend and its
bundled ptxas need no device to produce PTX and a cubin, so each kernel is compiled here in a
subprocess (TRITON_INTERPRET must be off when the kernels are defined), and the megakernel's PTX is
checked for the intended synchronisation: acquire loads for waits, a release reduction for signals,
CTA barriers around both.
"""
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# The per-op kernels of the newer families also for the Jetson Orin (sm_87): their tl.dot tiles and
# reductions must lower there too.
SM87 = ("attn_decode_partial_gqa", "moe_up", "causal_conv1d", "delta_step", "delta_chunk", "lstm_cell",
        "chained_linear_orin")
# Batch 1 and 8; Moondream 3 on a GPU: bf16 weights and KV caches, FP8 experts (the variant it compiles).
MEGA90 = ("megakernel_b1_fp32", "megakernel_b8_fp32", "megakernel_b1_bf16", "megakernel_b1_bf16_kvbf16_fp8")
# The megakernel for the Jetson Orin (sm_87) too, in bf16 at batch 1 (what a 16 GB Orin runs).
MEGA87 = ("megakernel_b1_bf16", "megakernel_b1_bf16_kvbf16_fp8")
# An A100 (sm_80) at what the models build there: Tiling() (32 columns, K step 64, 32 keys), bf16
# weights and KV, head 64 (Whisper, Moondream 2), batch 1. Left to pick its own register target,
# ptxas spilled this build (triton_versions.MegakernelTuning.maxnreg).
MEGA80 = ("megakernel_b1_bf16_kvbf16_n32_k64_t32_d64",)

@pytest.fixture(scope="module")
def compiled():
    """compile_check in a process per target group, side by side (a compile uses one core), about
    equal in work: a megakernel build takes 20-30 s on an idle core, the per-op kernels a few seconds
    each. Results keyed "<case>" for sm_90, "<case>_sm<arch>" otherwise; --usage: registers and
    stack of each cubin Triton built (cuobjdump), a stack of 0 meaning no spill."""
    from photon_core.kernels.compile_check import PER_OP, compile_env
    groups = [(90, PER_OP + MEGA90[:2]), (90, MEGA90[2:]), (80, MEGA80), (87, SM87 + MEGA87)]
    procs = [subprocess.Popen([sys.executable, "-m", "photon_core.kernels.compile_check", "--arch", str(arch),
                               "--cases", *cases, "--ptx", "--usage"],
                              env=compile_env(), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for arch, cases in groups]
    out = {}
    try:
        for p in procs:
            stdout, stderr = p.communicate()   # bounded by the test timeout (pytest-timeout)
            if p.returncode != 0 and ("ptxas" in stderr and "not found" in stderr):
                pytest.skip("triton's NVIDIA backend (ptxas) is not available here")
            assert p.returncode == 0, stderr[-4000:]
            for key, rec in json.loads(stdout.strip().splitlines()[-1])["cases"].items():
                name, arch = key.split("@sm_")
                out[name + ("" if arch == "90" else f"_sm{arch}")] = rec
    finally:   # a failure or the test timeout leaves no compile running
        for p in procs:
            p.kill()
    return out


def test_every_kernel_compiles_for_sm90(compiled):
    for name in ("norm", "norm_rms_gated", "linear_gemv", "linear_tiled", "rotary", "kv_append", "attn_prefill",
                 "attn_prefill_bias", "attn_decode_partial", "attn_decode_partial_gqa", "attn_decode_merge", "argmax", "sample",
                 "glu", "moe_route", "moe_up", "moe_down", "causal_conv1d", "delta_step", "delta_chunk", "lstm_cell",
                 "attn_decode_partial_gqa_sm87", "moe_up_sm87", "causal_conv1d_sm87", "delta_step_sm87",
                 "delta_chunk_sm87", "lstm_cell_sm87", "chained_linear", "chained_linear_norm", "chained_linear_n8",
                 "chained_linear_b8",
                 "chained_gated", "chained_norm",
                 "chained_rotary_append", "chained_attention",
                 "chained_step_begin", "chained_embed", "chained_argmax_partial", "chained_argmax",
                 "chained_add_norm", "chained_linear_orin_sm87", "chained_rotary_append_tau", "chained_moe_up",
                 "chained_moe_up_bf16", "chained_moe_down", "chained_conv_step", "chained_delta_step",
                 "chained_linear_glu",
                 "megakernel_b1_fp32", "megakernel_b8_fp32", "megakernel_b1_bf16", "megakernel_b1_bf16_sm87",
                 "megakernel_b1_bf16_kvbf16_fp8", "megakernel_b1_bf16_kvbf16_fp8_sm87",
                 "megakernel_b1_bf16_kvbf16_n32_k64_t32_d64_sm80"):
        assert compiled[name]["cubin"] > 0, name


def test_chained_kernels_read_only_weights_before_the_previous_launch_ends(compiled):
    """The per-op engine's chained kernels (kernels/chained.py) under programmatic dependent
    launch: each waits for the launch ahead (griddepcontrol.wait) before any load of a value or
    cache and any store, then lets the next launch start; the linears, the norms and Qwen 3.5's
    conv and delta rule issue their weight loads first (a linear's as 16-byte loads), the others
    nothing (an expert's rows depend on the routing). On sm_87, no PDL."""
    weights_first = {"chained_linear": {"ld.global.v4.b32"}, "chained_linear_norm": {"ld.global.v4.b32"},
                     "chained_linear_n8": {"ld.global.v4.b32"}, "chained_linear_b8": {"ld.global.v4.b32"},
                     "chained_linear_glu": {"ld.global.v4.b32"},
                     "chained_norm": {"ld.global.b32"}, "chained_add_norm": {"ld.global.b32"},
                     "chained_conv_step": {"ld.global.b32"}, "chained_delta_step": {"ld.global.b32"}}
    for name in ("chained_linear", "chained_linear_norm", "chained_linear_n8", "chained_linear_b8", "chained_gated",
                 "chained_norm", "chained_rotary_append", "chained_attention",
                 "chained_step_begin", "chained_embed", "chained_argmax_partial", "chained_argmax",
                 "chained_add_norm", "chained_rotary_append_tau", "chained_moe_up", "chained_moe_up_bf16",
                 "chained_moe_down", "chained_conv_step", "chained_delta_step", "chained_linear_glu"):
        ptx = compiled[name]["ptx"]
        wait, go = ptx.find("griddepcontrol.wait"), ptx.find("griddepcontrol.launch_dependents")
        assert 0 < wait < go, name
        assert "st.global" not in ptx[:wait], name
        before = set(re.findall(r"ld\.global[.\w]*", ptx[:wait]))
        assert before == weights_first.get(name, set()), (name, before)
        assert compiled[name]["stack"] == 0, name
    assert "griddepcontrol" not in compiled["chained_linear_orin_sm87"]["ptx"]


def ptx_loops(ptx: str) -> list[list[str]]:
    """The bodies of a PTX function's loops: the lines from a label to a branch back to it."""
    lines = ptx.splitlines()
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := re.match(r"\s*(\$L__BB\d+_\d+):", line))}
    return [lines[labels[m.group(1)]:i] for i, line in enumerate(lines)
            if (m := re.search(r"\bbra(?:\.uni)?\s+(\$L__BB\d+_\d+);", line)) and labels.get(m.group(1), i) < i]


def test_chained_linears_k_loop_has_no_barrier_at_batch_1(compiled):
    """The chained linear's K loop at batch 1 (the loop with the most global loads; plain, with a
    fused LayerNorm, with a fused GLU): loads and FMAs, no shared memory and no CTA barrier (x is loaded in
    W's tile layout). Above batch 1 x goes through shared memory into the products' layout (batch 8:
    4 barriers a step); loading it in that layout keeps the loop free of them only at K steps of 32,
    whose 1 KB weight tiles load 8 bytes a thread (the GPU to weigh)."""
    for name in ("chained_linear", "chained_linear_norm", "chained_linear_glu"):
        body = max(ptx_loops(compiled[name]["ptx"]), key=lambda b: sum("ld.global" in line for line in b))
        assert not any("bar.sync" in line or "st.shared" in line for line in body), name


def test_chained_attention_merges_in_its_last_split(compiled):
    """Attention in one launch: a split's partial stored, then a CTA barrier, then its ticket (an
    acq_rel add at GPU scope: the partials published, the others' seen); the last split reads the
    partials past its L1 (ld.global.cg: other SMs wrote them in this launch)."""
    ptx = compiled["chained_attention"]["ptx"]
    atom = ptx.index("atom.global.gpu.acq_rel.add")
    assert ptx.rfind("st.global", 0, atom) < ptx.rfind("bar.sync", 0, atom), "a store after the last barrier"
    assert "ld.global.cg" in ptx[atom:]


def test_chained_experts_stream_16_byte_loads(compiled):
    """Moondream 3's experts on the chained build (kernels/chained.moe at its batch-1 blocks): FP8
    bytes and bf16 weights load 16 bytes a thread (never a byte at a time), nothing spills."""
    for name in ("chained_moe_up", "chained_moe_up_bf16", "chained_moe_down"):
        ptx = compiled[name]["ptx"]
        assert "ld.global.v4.b32" in ptx and not re.search(r"ld\.global(\.\w+)*\.[bu]8", ptx), name
        assert_no_spills(name, compiled[name])


# PTX properties of a megakernel build, shared with test_triton_versions.py (every supported Triton).
# Older LLVMs spell untyped loads and stores .u64 / .u16 where newer ones write .b64 / .b16.

def assert_waits_acquire_and_signals_release(name: str, ptx: str) -> None:
    assert "ld.global.gpu.acquire" in ptx or "atom.global.gpu.acquire" in ptx, name  # dependency waits
    assert "red.global.gpu.release.add" in ptx or "atom.global.gpu.release.add" in ptx, name  # signals
    assert "bar.sync" in ptx, name
    assert "ld.global.cg" in ptx, name  # activations written by other SMs are read past L1


def assert_claims_relaxed_and_header_before_branches(name: str, ptx: str) -> None:
    adds = re.findall(r"atom\.global\.gpu\.(\w+)\.add\.u32", ptx)
    assert adds.count("relaxed") == 2, (name, adds)    # the first claim and the loop's claim
    # The claim loop: from its header label to the first acquire poll.
    head = ptx.index("// =>This Loop Header: Depth=1")
    body = ptx[head:ptx.index("acquire", head)]
    loads = [m.start() for m in re.finditer(r"ld\.global\.[bu]64", body)]
    assert len(loads) >= 6, (name, len(loads))
    assert "bra" not in body[:loads[5]], name


def assert_vector_weight_loads(name: str, ptx: str) -> None:
    # The compiler pads weight rows and aligns offsets and K slices to 16 elements, and the linear
    # task says so (tl.multiple_of): weight loads become 128-bit loads (4 fp32 or 8 bf16) where
    # Triton keeps the hint. It does not at every site: weight_loads counts them.
    assert "ld.global.v4" in ptx, name


def weight_loads(ptx: str) -> dict[str, int]:
    """The PTX's global loads attributed (its .loc lines) to kernel.py's weight-tile loads (every
    K loop's), by instruction: how many bytes each load site moves at a time."""
    src = (ROOT / "photon_core" / "megakernel" / "kernel.py").read_text().splitlines()
    lines = {i + 1 for i, line in enumerate(src) if "tl.load(w_ptr" in line and "w_off + wp" in line}
    files = dict(re.findall(r'\.file\s+(\d+)\s+"([^"]+)"', ptx))
    kernel = {k for k, v in files.items() if v.endswith("megakernel/kernel.py")}
    at, out = None, {}
    for line in ptx.splitlines():
        loc = re.match(r"\s*\.loc\s+(\d+)\s+(\d+)", line)
        if loc:
            at = (loc.group(1), int(loc.group(2)))
            continue
        op = re.search(r"\bld\.global[.\w:]*", line)
        if op and at is not None and at[0] in kernel and at[1] in lines:
            out[op.group(0)] = out.get(op.group(0), 0) + 1
    return out


def assert_fp8_decoded_with_integer_ops(name: str, ptx: str) -> None:
    """e4m3 bytes decoded through fp16 (cvt.f32.f16: no fp8 conversion, which Orin's sm_87 lacks),
    KV stored as bf16."""
    assert "cvt.f32.f16" in ptx and "e4m3" not in ptx, name
    assert "st.global.b16" in ptx or "st.global.u16" in ptx, name


def assert_no_spills(name: str, usage: dict) -> None:
    """The cubin's resource usage (compile_check.resource_usage): every value stays in registers (no
    stack: no spill slot) and two 4-warp or one 8-warp program fit an SM's 64K registers."""
    assert usage["stack"] == 0 and 0 < usage["registers"] <= 255, (name, usage)


def assert_experts_stream(name: str, rec: dict, step_bytes: int, tiles: bool = False) -> None:
    """A build's expert tasks' K loops (MoE up and down, from its SASS: compile_check --loops; `tiles`:
    the tasks of several column tiles, kernel.XTILES) stream `step_bytes` of an expert row a trip at
    32 columns, all issued before the first is used, as 16-byte loads, and no K loop, expert or
    dense, spills inside a trip."""
    from photon_core.kernels.sass_loops import dense_loops, expert_loops
    loops = expert_loops(rec["k_loops"])
    want = {"_task_moe_up", "_task_moe_down"}
    assert {lp["task"] for lp in loops} == {t + "_tiles" * tiles for t in want}, (name, rec["k_loops"])
    for lp in loops:
        assert lp["in_flight_bytes"] == lp["weight_bytes"] and set(lp["loads"]) == {"LDG.E.128"}, (name, lp)
        assert lp["in_flight_bytes"] * rec["threads"] == 32 * step_bytes, (name, lp)
    assert all(lp["local"] == 0 for lp in loops + dense_loops(rec["k_loops"])), (name, rec["k_loops"])


def test_megakernel_ptx_has_acquire_waits_and_release_signals(compiled):
    assert_waits_acquire_and_signals_release("megakernel_b1_fp32", compiled["megakernel_b1_fp32"]["ptx"])


def test_megakernel_claims_are_relaxed_and_the_header_is_read_before_any_branch(compiled):
    """Per-task overhead sits on the dependency chain: a claim only hands out an index (its
    ordering comes from the waits), so it is a relaxed atomic, no fence; the task header (op,
    two waits, the signal) is read as one group of loads before the first branch on it, one
    round trip to L2 instead of one per branch. Tickets (last partial merges, last tile computes
    row statistics) keep acq_rel: they order data."""
    for name in ("megakernel_b1_fp32", "megakernel_b8_fp32", "megakernel_b1_bf16", "megakernel_b1_bf16_sm87"):
        assert_claims_relaxed_and_header_before_branches(name, compiled[name]["ptx"])


def test_megakernel_streams_weights_with_vector_loads(compiled):
    for name in ("megakernel_b1_fp32", "megakernel_b1_bf16", "megakernel_b8_fp32", "megakernel_b1_bf16_sm87",
                 "megakernel_b1_bf16_kvbf16_fp8", "megakernel_b1_bf16_kvbf16_fp8_sm87"):
        assert_vector_weight_loads(name, compiled[name]["ptx"])


def test_fp8_experts_decode_with_integer_ops_on_sm87_and_sm90(compiled):
    """The FP8 variant decodes e4m3 bytes with integer ops and stores bf16 KV; the float variant has neither."""
    for name in ("megakernel_b1_bf16_kvbf16_fp8", "megakernel_b1_bf16_kvbf16_fp8_sm87"):
        assert_fp8_decoded_with_integer_ops(name, compiled[name]["ptx"])
    assert "cvt.f32.f16" not in compiled["megakernel_b1_bf16"]["ptx"]


def test_fp8_expert_weights_load_as_vectors(compiled):
    """The FP8 experts' tiles stream 16 bytes a load (Triton 3.6 and 3.9; 3.6 loaded 8 before its
    FP8 weight tile had a budget of its own: MegakernelTuning.fp8_weight_tile), never a byte at a
    time, as they did under 3.9 when the MoE tasks' alignment hints were lost (kernel._sixteens)."""
    for name in ("megakernel_b1_bf16_kvbf16_fp8", "megakernel_b1_bf16_kvbf16_fp8_sm87"):
        ptx = compiled[name]["ptx"]
        assert "ld.global.b8" not in ptx and re.search(r"ld\.global(\.\w+)*\.v4\.b32", ptx), name


def test_megakernel_registers_fit_without_spills(compiled):
    """The sm_90 builds at batch 1 and 8, the Orin's and the A100's: every value stays in registers."""
    for name in MEGA90 + tuple(n + "_sm87" for n in MEGA87) + tuple(n + "_sm80" for n in MEGA80):
        assert_no_spills(name, compiled[name])
