"""The megakernel's build variants (kernel.KernelVariant) compute what the plain build does: the
pipelined, tensor-core, wide and unrolled K loops on Whisper's compiled step (tiny random weights, bf16
arena, Triton's interpreter), and the variants compile for sm_90 with what each is for visible in
the PTX (the prefetch instructions, the tensor-core multiplies, the traced build's timer reads) and
in the SASS (the weight bytes the K loop has in flight, sass_loops).

What the variants are worth is measured on a GPU (bench/gpu_timeline.py), not asserted here."""
from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # must precede the first import of triton

import copy  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from proof_bench import gpu_proof  # noqa: E402

from photon_core.megakernel.compiler import Tiling  # noqa: E402
from photon_core.megakernel.kernel import KernelVariant  # noqa: E402
from photon_core.models.whisper.decoder_step import WhisperDecoderMegakernel, WhisperDecoderWeights  # noqa: E402


def _whisper_step(tiling: Tiling):
    wt = WhisperDecoderWeights.random(64, 2, 1, 96, n_ctx=16, seed=3)
    s = WhisperDecoderMegakernel(wt, 2, 16, 8, tiling, advance=False)
    s.weights = s.weights.to(torch.bfloat16)
    s.kernel.weights = s.weights
    g = torch.Generator().manual_seed(0)
    s.set_cross_kv([(torch.randn(2, 2, 8, 32, generator=g), torch.randn(2, 2, 8, 32, generator=g))])
    s.set_step([5, 7], [3, 6])
    return s


@pytest.fixture(scope="module")
def step():
    # 16-column tiles, K steps of 16: several steps per task, and split-K slices (min_tasks)
    return _whisper_step(Tiling(16, 16, 16, 2, 2, min_tasks=12, min_block_n=16, max_split_k=2))


@pytest.fixture(scope="module")
def span_step():
    # tasks of up to 4 tiles, one after another (Tiling.linear_span), where `step` splits K
    return _whisper_step(Tiling(16, 16, 16, 2, 2, linear_span=4, linear_min_tasks=1))


def run(step, variant: KernelVariant) -> torch.Tensor:
    saved = step.state.clone()
    k = copy.copy(step.kernel)
    k.variant = variant
    k.launch()
    k.raise_on_error()
    out = step.view("logits").clone()
    step.state.copy_(saved)
    return out


VARIANTS = [KernelVariant(pipeline=4, aligned=True), KernelVariant(dot=32, pipeline=2), KernelVariant(wide=32),
            KernelVariant(wide=32, aligned=True), KernelVariant(unroll=4, aligned=True),
            KernelVariant(unroll=8, aligned=True), KernelVariant(static=True),
            KernelVariant(wide=32, aligned=True, static=True)]


@pytest.fixture(scope="module")
def plain(step):
    """The plain build's logits on `step`, launched once for every variant compared with it (run
    leaves the step's state as it found it, so each variant starts from the same state)."""
    return run(step, KernelVariant())


@pytest.fixture(scope="module")
def span_plain(span_step):
    return run(span_step, KernelVariant())


def _same_as_plain(step, plain: torch.Tensor, variant: KernelVariant) -> None:
    got = run(step, variant)
    err = ((got - plain).abs().max() / plain.abs().max()).item()
    # The elementwise loops sum in another order at most; the tensor-core loop drops x's third
    # bf16 term (2^-17 relative): both far inside the steps' 1e-3.
    assert err < (2e-5 if variant.dot else 1e-6), err
    assert torch.equal(got.argmax(-1), plain.argmax(-1))


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v.name())
def test_a_variant_computes_what_the_plain_build_does(step, plain, variant):
    assert any(t.op == 7 for t in step.graph.tasks)          # split-K slices are on the path too
    _same_as_plain(step, plain, variant)


@pytest.mark.parametrize("variant", VARIANTS[2:], ids=lambda v: v.name())
def test_a_variant_computes_what_the_plain_build_does_in_tasks_of_several_tiles(span_step, span_plain, variant):
    """The streaming loops, the aligned builds' tile statistics and the static schedule over tasks
    of several tiles (Tiling.linear_span) compute what the plain build does (which equals the eager
    graph: test_megakernel_compiler's span cases)."""
    assert any(t.op == 2 and t.args["n1"] - t.args["n0"] > 16 for t in span_step.graph.tasks)
    _same_as_plain(span_step, span_plain, variant)



def test_aligned_builds_say_the_caches_alignment_only_where_it_holds(step):
    """An aligned build of a table whose caches are 16-aligned (head dim 32 here) says so to its
    attention tasks (kernel.KV16: 16-byte K / V loads on a GPU); with head dim 8 it must not (the
    hint rounds offsets down to 16): that build computes what the plain one does."""
    from photon_core.megakernel.kernel import KV16
    aligned = KernelVariant(wide=32, aligned=True)
    k = copy.copy(step.kernel)
    k.variant = aligned
    assert k.kv_aligned and k.loop() == aligned.loop + KV16
    k.variant = KernelVariant(wide=32)
    assert k.loop() == k.variant.loop                      # not an aligned build: nothing said
    wt = WhisperDecoderWeights.random(64, 8, 1, 96, n_ctx=16, seed=4)
    narrow = WhisperDecoderMegakernel(wt, 2, 16, 8, Tiling(16, 16, 16, 2, 2), advance=False)
    narrow.weights = narrow.weights.to(torch.bfloat16)
    narrow.kernel.weights = narrow.weights
    g = torch.Generator().manual_seed(1)
    narrow.set_cross_kv([(torch.randn(2, 8, 8, 8, generator=g), torch.randn(2, 8, 8, 8, generator=g))])
    narrow.set_step([5, 7], [3, 6])
    assert not narrow.kernel.kv_aligned
    plain, got = run(narrow, KernelVariant()), run(narrow, aligned)
    assert ((got - plain).abs().max() / plain.abs().max()).item() < 1e-6


def test_the_static_build_claims_nothing_and_counts_every_task_it_ran(step):
    """The claimed build's counter ends at tasks + programs (each program's last claim finds none);
    the static build's at the tasks its programs ran, each exactly once (one program under the
    interpreter: a share waiting on another program's task would never see it run)."""
    from photon_core.megakernel.kernel import CTRL_CLAIM
    saved = step.state.clone()
    for variant, extra in ((KernelVariant(), step.kernel.num_programs), (KernelVariant(static=True), 0)):
        k = copy.copy(step.kernel)
        k.variant = variant
        k.launch()
        k.raise_on_error()
        assert int(k.ctrl[CTRL_CLAIM]) == len(step.graph.tasks) + extra, variant.name()
        assert k.claims_at_exit() == int(k.ctrl[CTRL_CLAIM]), variant.name()   # what gpu_proof checks
        step.state.copy_(saved)
    assert KernelVariant.parse("wide512+aligned+static") == KernelVariant(wide=512, aligned=True, static=True)

def test_a_variant_that_is_no_k_loop_is_refused():
    with pytest.raises(ValueError, match="not a K loop"):
        KernelVariant(dot=32, wide=32)
    with pytest.raises(ValueError, match="not a K loop"):
        KernelVariant(wide=24)
    with pytest.raises(ValueError, match="not a K loop"):
        KernelVariant(unroll=3)


_PTX = r'''
import json, re, sys
from pathlib import Path
from photon_core.kernels import compile_check as cc
out = {}
for name in sys.argv[2:]:
    ck, _ = cc.compile_case(name, 90)
    ptx = ck.asm["ptx"]
    (Path(sys.argv[1]) / (name + ".ptx")).write_text(ptx)
    out[name] = {}
    out[name]["ptx"] = {k: len(re.findall(p, ptx)) for k, p in (("bulk_prefetch", r"cp\.async\.bulk\.prefetch\.L2"),
                 ("line_prefetch", r"prefetch\.global\.L2"), ("mma", r"mma\.sync"), ("timer", r"%globaltimer"),
                 ("smid", r"%smid"))}
    out[name].update(cc.sass_loops_of(ck.asm["cubin"], 90), threads=32 * ck.metadata.num_warps,
                     **cc.build_usage(ck, 90))
print(json.dumps(out))
'''


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """Each variant compiled for sm_90 under the pinned Triton (two compile processes side by side):
    name -> PTX instruction counts ("ptx"), the dense linear K loops (sass_loops), threads, registers, stack."""
    from photon_core.kernels.compile_check import compile_env
    out = tmp_path_factory.mktemp("variants")
    halves = [NAMES[0::2], NAMES[1::2]]
    procs = [subprocess.Popen([sys.executable, "-c", _PTX, str(out), *h], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=compile_env()) for h in halves]
    got = {}
    for p in procs:
        stdout, stderr = p.communicate(timeout=1200)
        assert p.returncode == 0, stderr[-3000:]
        got.update(json.loads(stdout.strip().splitlines()[-1]))
    return out, got


NAMES = ["megakernel_b1_bf16_n32_k64", "megakernel_b1_bf16_n32_k64_prefetch2", "megakernel_b1_bf16_n32_k64_prefetch1",
         "megakernel_b1_bf16_n32_k64_dot64_pipe3", "megakernel_b1_bf16_n32_k64_trace", "megakernel_b1_bf16_n32_k64_aligned",
         "megakernel_b1_bf16_n32_k64_unroll4_aligned", "megakernel_b1_bf16_n32_k64_wide512_aligned",
         "megakernel_b1_bf16_n32_k64_wide512_aligned_static", "megakernel_b8_bf16_n32_k64_unroll8_aligned",
         "megakernel_b1_bf16_kvbf16_fp8_n32_k64_wide512_aligned",
         "megakernel_b8_bf16_kvbf16_fp8_n32_k64_unroll8_aligned",
         "megakernel_b8_bf16_kvbf16_fp8_n32_k64_unroll8_aligned_tiles",
         "megakernel_b1_bf16_n32_k64_wide512_aligned_lspans", "megakernel_b1_bf16_n32_k64_pipe8_aligned",
         "megakernel_b8_bf16_n32_k64_pipe15_aligned"]


def test_variants_compile_for_sm90_with_their_instructions(compiled):
    from test_kernels_compile_sm90 import weight_loads
    tmp_path, got = compiled
    names = NAMES[:6]
    plain, bulk, line, dot, trace, _ = (got[n]["ptx"] for n in names)
    assert not any(plain.values())                       # the default build has none of them
    assert bulk["bulk_prefetch"] >= 1 and line["line_prefetch"] >= 1 and dot["mma"] >= 2
    assert trace["timer"] >= 4 and trace["smid"] >= 1
    # aligned: the dense tasks' weight tiles load 16 bytes at a time (the default build: 2)
    vectors = {n: weight_loads((tmp_path / f"{n}.ptx").read_text()).get("ld.global.v4.b32", 0)
               for n in (names[0], names[-1])}
    assert vectors[names[-1]] >= 2 * vectors[names[0]] > 0, vectors


def test_the_streaming_variants_keep_more_weight_bytes_in_flight(compiled):
    """The dense linear tasks' K loop as ptxas scheduled it (photon_core/kernels/sass_loops.py): the
    plain build has one K step's tile in flight (4 KB a program: what the first GPU run's build
    streamed, issue 38); unroll4+aligned issues four steps' tiles as 16-byte loads before using the
    first; wide512+aligned 32 KB a program a trip (the issue's >= 32 KB per SM), all in registers."""
    from photon_core.kernels.sass_loops import dense_loop, dense_loops
    _, got = compiled

    def loop(name):
        return dense_loop(got[name]["k_loops"]), got[name]["threads"]
    (plain, threads), (unrolled, _), (wide, _) = (loop(f"megakernel_b1_bf16_n32_k64{v}")
                                                  for v in ("", "_unroll4_aligned", "_wide512_aligned"))
    assert plain["in_flight_bytes"] * threads == 4096, plain
    assert unrolled["in_flight_bytes"] >= 4 * plain["in_flight_bytes"] and set(unrolled["loads"]) == {"LDG.E.128"}
    assert wide["in_flight_bytes"] * threads >= 32 * 1024 and set(wide["loads"]) == {"LDG.E.128"}, wide
    assert got["megakernel_b1_bf16_n32_k64_wide512_aligned"]["stack"] == 0
    # the static schedule (its next header held across a task) leaves the K loop as it was, unspilled
    # (its stack, 24 B under 3.9 since attention holds a step's K and V tiles at once, lies outside
    # every loop: the attention loop test checks that one)
    static = got["megakernel_b1_bf16_n32_k64_wide512_aligned_static"]
    assert dense_loop(static["k_loops"]) == wide and wide["local"] == 0, static
    # batch 8, unroll8+aligned: eight K steps' tiles (16 KB a program) issued as vector loads before the
    # first is used (16 bytes under 3.9's 128 threads; 8 under 3.6's 256, which cover the 32 x 32 tile
    # 4 elements each), no spill traffic inside the loop (3.9 spills 24 B around it)
    b8 = got["megakernel_b8_bf16_n32_k64_unroll8_aligned"]
    b8_loop = dense_loop(b8["k_loops"])
    wide_loads = {"LDG.E.128"} if b8["threads"] == 128 else {"LDG.E.64", "LDG.E.128"}
    assert b8_loop["in_flight_bytes"] * b8["threads"] >= 16 * 1024 and set(b8_loop["loads"]) <= wide_loads, b8_loop
    assert all(lp["local"] == 0 for lp in dense_loops(b8["k_loops"])), b8
    # dense tasks of several column tiles (kernel.LTILES, Tiling.linear_span): each tile's K loop the
    # one-tile build's, unspilled (the span loop's stack, 240 B under 3.9, lies outside it)
    spans = got["megakernel_b1_bf16_n32_k64_wide512_aligned_lspans"]
    keys = ("loads", "weight_bytes", "in_flight_bytes", "local")
    span_loops = [lp for lp in dense_loops(spans["k_loops"]) if lp["task"] == "_task_linear"]
    assert span_loops and all({k: lp[k] for k in keys} == {k: wide[k] for k in keys} for lp in span_loops), spans


def test_the_pipelined_builds_stream_their_weights_through_shared_memory(compiled):
    """aligned+pipe8 (batch 1) and aligned+pipe15 (batch 8): Triton's pipeliner turns the 16-byte
    weight loads into copies into shared memory (cp.async, LDGSTS), and a trip waits for its own
    with 6 / 13 later trips' copies still in flight (sass_loops' `ahead`): at batch 1 the budgets'
    widest K step (8 KB a trip under 3.6, 16 under 3.9) and >= 48 KB in flight a program where
    wide512+aligned holds 32 KB in registers; at batch 8, whose product's registers keep a trip at
    2 KB, 26 KB where unroll8+aligned holds 16. None of it in registers: no stack, no spill
    traffic in any dense K loop. Their shared memory holds the stages (what residency counts:
    kernel.programs_per_sm)."""
    from photon_core.kernels.sass_loops import dense_loop, dense_loops, streaming_bytes
    _, got = compiled
    unroll8 = got["megakernel_b8_bf16_n32_k64_unroll8_aligned"]
    for name, ahead, least in (("megakernel_b1_bf16_n32_k64_pipe8_aligned", 6, 48 * 1024),
                               ("megakernel_b8_bf16_n32_k64_pipe15_aligned", 13, 24 * 1024)):
        rec = got[name]
        lp = dense_loop(rec["k_loops"])
        threads = rec["threads"]
        assert all(op.startswith("LDGSTS") for op in lp["loads"]) and lp["ahead"] == ahead, (name, lp)
        assert streaming_bytes(lp) * threads >= least and rec["stack"] == 0, (name, lp, rec["stack"])
        assert all(x["local"] == 0 for x in dense_loops(rec["k_loops"])), (name, rec["k_loops"])
        assert rec["shared_memory"] >= ahead * lp["weight_bytes"] * threads, (name, rec["shared_memory"])
    b1 = dense_loop(got["megakernel_b1_bf16_n32_k64_pipe8_aligned"]["k_loops"])
    assert set(b1["loads"]) == {"LDGSTS.E.BYPASS.128"}
    # a trip is the K step the host computes for the build under this Triton's budgets (the timeline's
    # linear_k_step; this process interprets, so they are named): 32 bf16 columns
    from photon_core.kernels.triton_versions import megakernel_tuning
    from photon_core.megakernel.kernel import linear_k_step, megakernel_meta
    for batch, name, stages in ((1, "megakernel_b1_bf16_n32_k64_pipe8_aligned", 8),
                                (8, "megakernel_b8_bf16_n32_k64_pipe15_aligned", 15)):
        step = linear_k_step(megakernel_meta(batch, 32, 64, 64, 64, 8, 1024), tuning=megakernel_tuning(),
                             variant=KernelVariant(pipeline=stages, aligned=True))
        assert dense_loop(got[name]["k_loops"])["weight_bytes"] * got[name]["threads"] == step * 32 * 2, name
    b8 = dense_loop(got["megakernel_b8_bf16_n32_k64_pipe15_aligned"]["k_loops"])
    assert streaming_bytes(b8) > dense_loop(unroll8["k_loops"])["in_flight_bytes"]


def test_a_pipelined_aligned_build_takes_the_budgets_k_step():
    """The K step of each build as the host computes it (kernel.linear_k_step): Tiling's 64 for the
    plain loop; the budgets' widest for a pipelined aligned build (128 under Triton 3.6, 256 under
    3.9), whose later steps wait in shared memory; a pipelined build of 2-byte loads (not staged)
    and batch 8 (the product's registers: 32) keep theirs."""
    from photon_core.kernels.triton_versions import megakernel_tuning
    from photon_core.megakernel.kernel import linear_k_step, megakernel_meta
    b1, b8 = (megakernel_meta(b, 32, 64, 32, 64, 8, 1024) for b in (1, 8))
    t36, t39 = megakernel_tuning("3.6.0"), megakernel_tuning("3.9.0")
    piped = KernelVariant(pipeline=8, aligned=True)
    assert linear_k_step(b1, tuning=t36) == linear_k_step(b1, tuning=t39) == 64
    assert linear_k_step(b1, tuning=t36, variant=piped) == 128 and linear_k_step(b1, tuning=t39, variant=piped) == 256
    assert linear_k_step(b1, tuning=t39, variant=KernelVariant(pipeline=8)) == 64
    assert linear_k_step(b8, tuning=t39, variant=KernelVariant(pipeline=15, aligned=True)) == 32


def test_fp8_experts_take_the_same_k_step_under_8_warps():
    """An FP8 expert tile at the roofline tiling (64 columns, BLOCK_K 128: 64 bytes a step) is 4 KB
    under Triton 3.6 (8 warps) as under 3.9 (4 warps): 16 bytes a thread at 8 warps, where half of
    3.6's weight budget made it 2 KB, 8-byte loads (MegakernelTuning.fp8_weight_tile)."""
    from photon_core.kernels.triton_versions import megakernel_tuning
    from photon_core.megakernel.kernel import linear_k_step, megakernel_meta
    meta = megakernel_meta(1, 64, 128, 64, 64, 8, 1024)
    t36, t39 = megakernel_tuning("3.6.0"), megakernel_tuning("3.9.0")
    assert linear_k_step(meta, fp8=True, tuning=t36) == linear_k_step(meta, fp8=True, tuning=t39) == 64
    assert 64 * 64 // (t36.num_warps * 32) == 16


def test_shared_memory_bounds_the_programs_an_sm_holds():
    """A build's programs an SM: the tuning's, fewer where its shared memory does not fit them (an
    H100/H200 SM has 228 KB, each block 1 KB of it reserved): aligned+pipe8 under Triton 3.9 (122 KB
    a program) one, aligned+pipe4 (52 KB) the tuning's two; never none."""
    from photon_core.megakernel.kernel import programs_per_sm
    sm = 228 * 1024
    assert programs_per_sm(2, 121856, sm) == 1
    assert programs_per_sm(2, 52224, sm) == 2
    assert programs_per_sm(2, 0, sm) == 2
    assert programs_per_sm(1, 60928, sm) == 1
    assert programs_per_sm(2, 300 * 1024, sm) == 1
    assert programs_per_sm(4, 60 * 1024, sm) == 3


def test_attention_loads_keys_and_values_together_and_aligned_builds_in_16_byte_vectors(compiled):
    """The attention key loop (decode_partial, inlined) of every build issues a step's K and V loads
    before it uses either (the reductions' barriers stop loads written after them: V was a second
    trip to memory every step); the aligned builds (kernel.KV16) load them 16 bytes at a time: the
    whole [64 keys, 64] K and V tiles of a step in flight, and keep a softmax per key lane, so a
    step has no barrier and no shared memory at all (12-14 barriers a step before). No spill inside
    the loop in any build but dot64+pipe3's (which spills everywhere: not a candidate)."""
    _, got = compiled
    for name, rec in got.items():
        loops = rec["attention_loops"]
        assert loops and all(lp["local"] == 0 or "_dot" in name for lp in loops), (name, loops)
        assert all(lp["in_flight_bytes"] > lp["weight_bytes"] // 2 for lp in loops), (name, loops)
        if "aligned" in name:
            tile = 2 * 64 * 64 * (2 if "kvbf16" in name else 4) // rec["threads"]
            assert all(all(w.startswith("LDG.E.128") for w in lp["loads"]) and lp["barriers"] == lp["shared"] == 0
                       and lp["in_flight_bytes"] == lp["weight_bytes"] == tile for lp in loops), (name, loops)


def test_the_streaming_builds_stream_the_experts_in_wide_steps(compiled):
    """The expert tasks' K loops (MoE up and down) in the streaming builds: at batch 1 (wide512+aligned)
    16 KB a program a trip, at batch 8 (unroll8+aligned) the tuning's bytes of an expert row a step
    at 32 columns (kernel.expert_loop: 16 or 8 KB), all issued before the first is used, as 16-byte
    loads, no spill traffic inside a trip (nor in the dense loop beside them), for 16-bit experts
    and FP8 ones (two halves), where the plain build's FP8 trip is 1 KB at batch 1 and 0.5 KB at
    batch 8 (bench/RESULTS.md "Megakernel K loop", FP8 table). The batch-8 FP8 build whose expert
    tasks span several column tiles (kernel.XTILES, Tiling.expert_span) streams the same way from
    its own loops over the tiles."""
    from test_kernels_compile_sm90 import assert_experts_stream

    from photon_core.kernels.triton_versions import megakernel_tuning
    _, got = compiled
    tuning = megakernel_tuning()
    for name, table, at in (("megakernel_b1_bf16_n32_k64_wide512_aligned", tuning.expert_bytes, 0),
                            ("megakernel_b1_bf16_kvbf16_fp8_n32_k64_wide512_aligned", tuning.fp8_expert_bytes, 0),
                            ("megakernel_b8_bf16_n32_k64_unroll8_aligned", tuning.expert_bytes, 3),
                            ("megakernel_b8_bf16_kvbf16_fp8_n32_k64_unroll8_aligned", tuning.fp8_expert_bytes, 3),
                            ("megakernel_b8_bf16_kvbf16_fp8_n32_k64_unroll8_aligned_tiles", tuning.fp8_expert_bytes, 3)):
        assert table[0] == 512 and table[at] >= 256
        assert_experts_stream(name, got[name], table[at], tiles=name.endswith("_tiles"))


FAMILIES = gpu_proof().families(dry=True, sms=4)


@pytest.mark.parametrize("name", [n for n in FAMILIES if not n.endswith("/split")])
def test_the_streaming_builds_compute_what_the_plain_build_does_for_every_family(name):
    """The builds engine_choice may pick on a GPU (wide512+aligned at batch 1, unroll8+aligned at
    batch 2) on each family's step graph (the GPU proof's tiny shapes: GLU, gated, activated and
    column-sliced inputs, RMS and LayerNorm, MoE, recurrent states), bf16 weights: the exposed
    values equal the plain build's up to the summation order, the picks are the same."""
    from photon_core.gpu_proof.build import fill
    from photon_core.megakernel.compiler import first_engine
    from photon_core.megakernel.decode_loop import restoring
    fam = FAMILIES[name]
    fam.load(torch.device("cpu"))
    for batch, streaming in ((1, "wide512+aligned"), (2, "unroll8+aligned")):
        with first_engine("perop"):
            step = fam.build(batch, False)
        step.weights = step.weights.to(torch.bfloat16)
        rows = fam.rows(batch, "steps")
        fill(step, rows, seed=5)
        step.scrub_nonfinite()
        takes_tokens = any(n.op == "embed" for n in step.graph_def.nodes)
        step.set_step(rows.tokens if takes_tokens else None, rows.positions)
        for key, value in fam.inputs(batch, rows.tokens).items():
            step.set_input(key, value)
        got = {}
        for variant in ("plain", streaming):
            step.set_engine("megakernel", variant)
            assert step.kernel_for(None).variant.name() == variant
            with restoring(step, 1):
                step.launch()
                got[variant] = ({k: step.view(k).clone() for k in step.graph_def.exposed},
                                {r: step.result(r).tolist() for r in step.graph_def.results})
        for key, plain in got["plain"][0].items():
            mine, barred = got[streaming][0][key], plain.isinf()    # a logit rule's -inf columns: exactly
            assert torch.equal(mine[barred], plain[barred]) and mine[~barred].isfinite().all(), (name, batch, key)
            err = ((mine[~barred] - plain[~barred]).abs().max() / plain[~barred].abs().max().clamp_min(1e-12)).item()
            assert err < 1e-5, (name, batch, key, err)
        assert got[streaming][1] == got["plain"][1], (name, batch)
