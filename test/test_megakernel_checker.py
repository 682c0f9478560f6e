"""The graph checker: it must accept the Whisper graphs and reject cyclic graphs, unsatisfiable waits
and unordered conflicting accesses; and the kernel's bounded waits must turn a bad graph that slipped
past the host into an error instead of a hang."""
import os

os.environ["TRITON_INTERPRET"] = "1"  # must precede the first import of triton

import copy  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from photon_core.megakernel.checker import GraphError, check  # noqa: E402
from photon_core.megakernel.graph import Region, Task, TaskGraph  # noqa: E402
from photon_core.megakernel.ops import OP_EMBED, OP_LINEAR  # noqa: E402
from photon_core.models.whisper.decoder_step import (Tiling, WhisperDecoderMegakernel,  # noqa: E402
                                                    WhisperDecoderWeights)


def _graph(*tasks: Task) -> TaskGraph:
    g = TaskGraph("toy", 1)
    for t in tasks:
        g.add(t)
    return g


def test_accepts_a_chain():
    check(_graph(Task("a", OP_EMBED, {}, [], "A", writes=[Region("s", 0, 8)]),
                 Task("b", OP_LINEAR, {}, [("A", 1)], "B", reads=[Region("s", 0, 8)])))


def test_rejects_cycle():
    g = _graph(Task("a", OP_LINEAR, {}, [("B", 1)], "A"), Task("b", OP_LINEAR, {}, [("A", 1)], "B"))
    with pytest.raises(GraphError, match="cycle"):
        check(g)


def test_rejects_wait_that_can_never_be_met():
    g = _graph(Task("a", OP_EMBED, {}, [], "A"), Task("b", OP_LINEAR, {}, [("A", 2)], None))
    with pytest.raises(GraphError, match="never be satisfied"):
        check(g)


def test_rejects_wait_on_a_later_task():
    g = _graph(Task("b", OP_LINEAR, {}, [("A", 1)], None), Task("a", OP_EMBED, {}, [], "A"))
    with pytest.raises(GraphError, match="later task"):
        check(g)


def test_rejects_unordered_conflicting_writes():
    g = _graph(Task("a", OP_EMBED, {}, [], "A", writes=[Region("x", 0, 10)]),
               Task("b", OP_EMBED, {}, [], "B", reads=[Region("x", 9, 12)]))
    with pytest.raises(GraphError, match="race on x"):
        check(g)
    # A partial wait (1 of 2 signalers) orders nothing in particular: still a race.
    g = _graph(Task("a1", OP_EMBED, {}, [], "A", writes=[Region("x", 0, 4)]),
               Task("a2", OP_EMBED, {}, [], "A", writes=[Region("x", 4, 8)]),
               Task("b", OP_LINEAR, {}, [("A", 1)], None, reads=[Region("x", 0, 8)]))
    with pytest.raises(GraphError, match="race"):
        check(g)


@pytest.fixture(scope="module")
def small_mk():
    wt = WhisperDecoderWeights.random(64, 2, 1, 96, 16, seed=3)
    return WhisperDecoderMegakernel(wt, 2, 8, 8, Tiling(32, 64, 16, 1, 1), advance=True)


def test_whisper_graph_passes_and_a_dropped_wait_is_caught(small_mk):
    g = small_mk.graph
    check(g)  # the constructor checked it too; again here so a regression names this test
    names = [t.name for t in g.tasks]
    i = next(i for i, n in enumerate(names) if n.startswith("L0.self_out"))
    g2 = copy.deepcopy(g)
    g2.tasks[i].waits = []  # out-projection no longer waits for the attention it reads
    with pytest.raises(GraphError, match="race"):
        check(g2)


def test_kernel_reports_a_wait_that_is_never_signalled(small_mk):
    from photon_core.megakernel.kernel import Megakernel
    g = _graph(Task("stuck", OP_EMBED, dict(M=1, N=8, n0=0, w=0, b=0, out=0), [("never", 1)], None))
    g.counter("never")
    mk = object.__new__(Megakernel)  # bypass the constructor's check(): simulate a bad graph on device
    mk.graph, mk.tasks = g, g.encode()
    mk.ctrl = torch.zeros(4, dtype=torch.int32)
    mk.weights, mk.state = torch.zeros(64), torch.zeros(64)
    mk.dyn, mk.out = torch.zeros(3, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    mk.batch, mk.ln_eps, mk.num_programs, mk.spin_limit = 1, 1e-5, 1, 2
    mk.meta = dict(small_mk.kernel.meta)
    mk.launch()
    with pytest.raises(RuntimeError, match="gave up waiting"):
        mk.raise_on_error()
    with pytest.raises(GraphError):
        Megakernel(g, mk.weights, mk.state, mk.dyn, mk.out, 1, 32, 64, 16, 16, 1, 1)


def test_a_cascade_of_waits_that_gave_up_names_its_root(small_mk):
    # On the GPU a never-signalled wait makes its waiters give up too (they poll as long); the
    # error must name the root, the task of lowest index, not the last waiter to time out.
    from photon_core.gpu_proof.build import copy_graph, unchecked_kernel
    g = copy_graph(small_mk.graph)
    waiting = [i for i, t in enumerate(g.tasks) if t.waits]
    root, later = waiting[1], waiting[-1]
    for i, name in ((root, "never-root"), (later, "never-later")):
        g.counter(name)
        g.tasks[i].waits = [(name, 1)]
    mk = unchecked_kernel(small_mk.kernel, g)
    mk.launch()
    with pytest.raises(RuntimeError, match=rf"task {root} .*gave up waiting"):
        mk.raise_on_error()


def test_batch_buckets():
    from photon_core.megakernel import bucket_for
    assert [bucket_for(n) for n in (1, 2, 3, 4, 5, 8)] == [1, 2, 4, 4, 8, 8]
    with pytest.raises(ValueError):
        bucket_for(9)
    wt = WhisperDecoderWeights.random(64, 2, 1, 96, 16, seed=3)
    with pytest.raises(ValueError, match="bucket"):
        WhisperDecoderMegakernel(wt, 3, 8, 8)


@pytest.mark.parametrize("tiling", [Tiling(64, 64, 64, 4, 8), Tiling(16, 64, 64, 4, 8), Tiling(128, 64, 64, 1, 1)],
                         ids=["bn64-per-head", "bn16-per-head", "bn128-stage"])
def test_real_tiny_en_graphs_check_for_every_bucket(tiling):
    # Full tiny.en sizes (vocab 51864, 448 positions, 1500 frames) on meta tensors: the graphs the GPU
    # would run are built and proven acyclic, deadlock-free and race-free without allocating them.
    import dataclasses

    from photon_core.megakernel.compiler import lower, plan
    from photon_core.megakernel.graph import BATCH_BUCKETS
    from photon_core.models.whisper.decoder_step import step_graph
    small = WhisperDecoderWeights.random(8, 2, 4, 4, 4, seed=0)
    shapes = {"token_embedding": (51864, 384), "positional_embedding": (448, 384), "ln_w": (384,), "ln_b": (384,)}
    meta = {k: torch.empty(s, device="meta") for k, s in shapes.items()}
    d = 384
    lshape = dict(attn_ln_w=(d,), attn_ln_b=(d,), qkv_w=(3 * d, d), qkv_b=(3 * d,), out_w=(d, d), out_b=(d,),
                  cross_ln_w=(d,), cross_ln_b=(d,), cross_q_w=(d, d), cross_q_b=(d,), cross_kv_w=(2 * d, d),
                  cross_kv_b=(2 * d,), cross_out_w=(d, d), cross_out_b=(d,), mlp_ln_w=(d,), mlp_ln_b=(d,),
                  fc1_w=(4 * d, d), fc1_b=(4 * d,), fc2_w=(d, 4 * d), fc2_b=(d,))
    layers = [type(small.layers[0])(**{k: torch.empty(s, device="meta") for k, s in lshape.items()})
              for _ in range(4)]
    wt = dataclasses.replace(small, layers=layers, n_heads=6, **meta)
    for b in BATCH_BUCKETS:
        g = lower(plan(step_graph(wt, 448, 1500, advance=True, logit_bias=True), b, tiling))
        check(g)
        assert len([t for t in g.tasks if t.name.startswith("logits[")]) == -(-51864 // tiling.block_n)


# Moondream 2 at test sizes: heads of 16 features, so Tiling(block_n=16) gives each head its own q|k|v
# tiles, whose ticket's finale runs that head's append rows (TaskGraph.rows).
HEADS16 = Tiling(block_n=16, block_k=64, block_t=16, self_splits=2)


def _moondream_plan(batch, tiling=HEADS16, kv_dtype=torch.float32):
    from photon_core.megakernel.compiler import plan
    from photon_core.models.moondream import decoder_step as md
    dm = md.Dims(d=64, heads=4, head_dim=16, rot=8, ff=128, vocab=256, layers=2, region_inner=32,
                 coord_bins=64, size_bins=128, max_context=128)
    return plan(md.step_graph(dm, 100), batch, tiling, kv_dtype=kv_dtype)


def _members(g, ticket):
    return [t for t in g.tasks if t.ticket == ticket]


def _swap_rows(g):
    g.rows[0], g.rows[1] = g.rows[1], g.rows[0]      # batch 1: head 0's append <-> head 1's


def _fin_of_another_group(g):
    for t in _members(g, "L0.rope.g0"):              # head 0's tiles run head 1's rows
        t.args["fin"] = 1


def _one_members_fin(g):
    _members(g, "L0.rope.g0")[1].args["fin"] = 1


def _row_left_out(g):
    for t in _members(g, "L0.rope.g0"):              # batch 2: rows (b0, h0), (b1, h0); b1's never runs
        t.args["nfin"] = 1


def _row_not_an_append(g):
    g.rows[0].op = OP_EMBED


@pytest.mark.parametrize("batch,mutate,message", [
    (1, _swap_rows, r"ticket 'L0.rope.g0': its finale row 0 'L0.rope\[b0,h1\]' reads .* do not declare"),
    (1, _fin_of_another_group, r"ticket 'L0.rope.g0': its finale row 1 'L0.rope\[b0,h1\]' reads .* do not declare"),
    (1, _one_members_fin, r"ticket 'L0.rope.g0': tasks .* run different finales \(fin 0 and 1"),
    (2, _row_left_out, r"ticket 'L0.rope.g0': its members declare the finale writes .* none of its finale rows"),
    (1, _row_not_an_append, r"finale row 0 'L0.rope\[b0,h0\]' of ticket 'L0.rope.g0': op embed"),
], ids=["rows-swapped", "fin-of-another-group", "one-members-fin", "a-row-left-out", "row-not-an-append"])
def test_finale_rows_must_be_their_groups_own(batch, mutate, message):
    # The kernel runs the rows `fin` points at, not the accesses the members declare: a group that
    # ran another head's rows would write that head's q and cache columns unordered.
    from photon_core.megakernel.compiler import lower
    g = lower(_moondream_plan(batch))
    assert g.rows and _members(g, "L0.rope.g0")[0].args["fin"] == 0
    check(g)
    g2 = copy.deepcopy(g)
    mutate(g2)
    with pytest.raises(GraphError, match=message):
        check(g2)


@pytest.mark.parametrize("arg", ["fin", "stout"])
def test_a_finale_without_a_ticket_is_refused(arg):
    # The kernel would draw the missing ticket at ctrl_ptr + (-1), outside the control buffer.
    from photon_core.megakernel.compiler import lower
    g = lower(_moondream_plan(1))
    i, t = next((i, t) for i, t in enumerate(g.tasks) if t.op == OP_LINEAR and t.ticket is None)
    t.args.update(fin=0, nfin=1) if arg == "fin" else t.args.update(stout=0)
    with pytest.raises(GraphError, match=rf"task {i} .*names a finale \({arg}\) without a ticket"):
        check(g)


def _value_over_kcache(sa):
    sa.regions["L0.mlp_up"] = (sa.off("kcache") + 8, sa.regions["L0.mlp_up"][1])


def _vcache_over_kcache_layer_1(sa):
    sa.regions["vcache"] = (sa.off("kcache") + sa.regions["kcache"][1] // 2, sa.regions["vcache"][1])


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16], ids=["fp32-kv", "bf16-kv"])
@pytest.mark.parametrize("relocate,message", [
    (_value_over_kcache, r"task \d+ 'L0.mlp_up\[0:64\]' writes state\[.*inside the memory of cache 'kcache\[0\]'"),
    (_vcache_over_kcache_layer_1, r"caches 'kcache\[1\]' and 'vcache\[0\]' overlap"),
], ids=["value-over-cache", "cache-over-cache"])
def test_caches_must_lie_apart_from_the_state(kv_dtype, relocate, message):
    # Cache accesses are declared as "{cache}@cols" while the kernel addresses the cache inside the
    # state arena (kc / vc): a value placed there would write the K cache attention reads, unordered.
    from photon_core.megakernel.compiler import lower
    p = _moondream_plan(1, Tiling(block_n=64, block_k=128, block_t=32, self_splits=2), kv_dtype)
    g = lower(p)
    assert set(g.caches) == {f"{c}[{layer}]@cols" for c in ("kcache", "vcache") for layer in (0, 1)}
    check(g)
    relocate(p.sarena)
    with pytest.raises(GraphError, match=message):
        check(lower(p))
