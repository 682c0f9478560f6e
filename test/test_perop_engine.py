"""The per-op engine (photon_core/megakernel/perop_engine.py): a CompiledStep's graph run op by op with
torch's kernels on the step's own buffers.

(1) Every family's step graph (Whisper, Moondream 2 and 3.1, Qwen3-ASR, Qwen 3.5, Gemma 4: the GPU
proof's tiny shapes, fresh random weights, two rows at different positions, random cache history, a
Gemma ring that has wrapped, recurrent states, MoE) equals eager.run_reference: exposed values, every
cache and state after the step, the argmax results, the next tokens and positions it writes.
(2) The guards of issue 37: NaN logits -> NON_FINITE and the position kept, a full row -> FULL, a
row with no cross keys -> zeros, a token outside the table -> clamped and the launch refused.
(3) A step started on the per-op engine builds no megakernel; switched to the megakernel, the same
step on the same state gives the same values and the same greedy tokens through DeviceDecode's
rounds (Triton's interpreter).
"""
import os

os.environ["TRITON_INTERPRET"] = "1"  # must precede the first import of triton


import pytest  # noqa: E402
import torch  # noqa: E402
from proof_bench import gpu_proof  # noqa: E402

from photon_core.gpu_proof.build import fill  # noqa: E402
from photon_core.megakernel.compiler import first_engine  # noqa: E402
from photon_core.megakernel.decode_loop import FULL, NON_FINITE, DeviceDecode, restoring  # noqa: E402
from photon_core.megakernel.eager import run_reference  # noqa: E402

FAMILIES = gpu_proof().families(dry=True, sms=4)
NAMES = [n for n in FAMILIES if not n.endswith("/split")]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Max error relative to b's largest; -inf (a logit bias's barred columns) must match exactly."""
    assert not a.isnan().any() and not b.isnan().any()
    inf = b.isinf()
    assert torch.equal(a[inf], b[inf]) and a[~inf].isfinite().all()
    a, b = a[~inf], b[~inf]
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def perop_step(name: str, batch: int = 2, advance: bool = True, variant: str = "plain"):
    fam = FAMILIES[name]
    fam.load(torch.device("cpu"))
    with first_engine("perop"):
        step = fam.build(batch, advance and fam.advance)
    if variant != "plain":
        step.set_engine("perop", variant)
    return fam, step


def start(fam, step, seed: int = 3):
    """Random history (finite everywhere: a real cache past a row's keys holds zeros or an earlier
    request's values), inputs, tokens and positions; returns what run_reference needs."""
    B = step.batch
    rows = fam.rows(B, "steps")
    caches = fill(step, rows, seed=seed)
    for name in step.graph_def.caches:
        step.view(name).nan_to_num_(0.0)
    inputs = fam.inputs(B, rows.tokens)
    for k, v in inputs.items():
        step.set_input(k, v)
    takes_tokens = any(n.op == "embed" for n in step.graph_def.nodes)
    step.set_step(rows.tokens if takes_tokens else None, rows.positions)
    return rows, caches, inputs


# What each family's chained build runs as its Triton kernels (at least).
CHAINED_OPS = {"whisper-tiny.en": {"embed", "linear", "layer_norm", "kv_append", "attention"},
               "moondream2": {"linear", "layer_norm", "kv_append", "attention"},
               "moondream3": {"linear", "layer_norm", "act", "kv_append", "attention", "moe"},
               "qwen3-asr-0.6b": {"embed", "linear", "rms_norm", "glu", "kv_append", "attention"},
               "qwen3.5-0.8b": {"embed", "linear", "rms_norm", "glu", "mul", "kv_append", "attention", "conv_step",
                                "delta_rule"},
               "gemma4-e2b": {"embed", "linear", "rms_norm", "glu", "mul", "add_norm", "kv_append", "attention"}}


# Gates and activations the chained build's linears apply to their inputs (the rest are launches):
# Qwen 3.5's attention output gate, Gemma 4's per-layer input gate, Moondream 3's gelu before tau.
GATES_FUSED = {"qwen3.5-0.8b": {"mul"}, "gemma4-e2b": {"mul"}, "moondream3": {"act"}}


@pytest.mark.parametrize("variant", ["plain", "chained"])
@pytest.mark.parametrize("name", NAMES)
def test_a_perop_step_equals_the_eager_graph(name, variant):
    fam, step = perop_step(name, variant=variant)
    assert all(engine == "perop" for engine, _ in step._kernels), "a megakernel was built"
    if variant == "chained":      # the ops kernels/chained.py runs are run by it
        ops = {n.op for n in step.graph_def.nodes if id(n) in step.kernel.chained}
        assert ops >= CHAINED_OPS[name] and step.engine_label == "perop chained", ops
        glus = [n for n in step.graph_def.nodes if n.op == "glu"]     # each applied by its down projection
        assert {id(n) for n in glus} == {id(p) for p in step.kernel.prologues.values() if p.op == "glu"}
        assert all(step.kernel.chained[id(n)] is None for n in glus)
        gates = {p.op for p in step.kernel.prologues.values() if p.op in ("mul", "act")}   # gates into linears
        assert gates == GATES_FUSED.get(name, set()), gates
    g, B = step.graph_def, step.batch
    rows, caches, inputs = start(fam, step)
    want = run_reference(g, fam.ref_weights(torch.float32), caches, rows.tokens, rows.positions,
                         rows.cross_len, inputs)
    step.launch()
    for key, value in g.exposed.items():
        assert rel_err(step.view(key), want[value.name]) < 1e-5, key
    for cache in (*g.caches, *g.states):        # appended entries, ring slots, recurrent states
        assert rel_err(step.view(cache), caches[cache]) < 1e-5, cache
    for result, picks in want["results"].items():
        got = step.result(result).tolist()
        advancing = any(n.op == "argmax" and n.args["name"] == result and n.args["advance"] for n in g.nodes)
        assert got == picks, result
        if advancing:
            assert step.dyn[:B].tolist() == picks
            assert step.dyn[B:2 * B].tolist() == [p + 1 for p in rows.positions]


@pytest.mark.parametrize("variant", ["plain", "chained"])
def test_the_guards_of_the_device_values(variant):
    fam, step = perop_step("whisper-tiny.en", batch=2, variant=variant)
    B, max_pos = step.batch, step.plan.max_position
    rows, _, _ = start(fam, step)
    # row 0 at the last position (full), row 1 with no cross keys (attention over nothing: zeros)
    step.set_step([5, 6], [max_pos - 1, 3])
    step.set_cross_len([4, 0])
    step.launch()
    assert step.result("token")[0].item() == FULL and step.dyn[B].item() == max_pos - 1
    assert step.dyn[B + 1].item() == 4
    assert torch.isfinite(step.view("logits")).all()
    # NaN in a row's logits: NON_FINITE, the fed token is column 0's, the position stays
    step.set_step([5, 6], [2, 3])
    step.set_cross_len([4, 4])
    table = next(n for n in step.graph_def.nodes if n.op == "embed").args["tok"]
    step.kernel.weights[table][6] = float("nan")     # an arena view: row 1's token embeds NaN
    step.launch()
    assert step.result("token").tolist()[1] == NON_FINITE
    assert step.dyn[:B].tolist()[1] == 0 and step.dyn[B + 1].item() == 3
    # a token outside the table: clamped, and the launch is refused with the reason
    step.dyn[0] = 10 ** 6
    with pytest.raises(RuntimeError, match="outside its table"):
        step.launch()


def test_switching_engines_gives_the_same_step_and_the_same_greedy_rounds():
    fam, step = perop_step("whisper-tiny.en", batch=1)
    rows, _, _ = start(fam, step)
    with restoring(step, 1):
        step.launch()
        perop = step.view("logits").clone()
    step.set_engine("megakernel")
    assert any(engine == "megakernel" for engine, _ in step._kernels)
    with restoring(step, 1):
        step.launch()
        mega = step.view("logits").clone()
    assert rel_err(perop, mega) < 1e-4
    tokens = {}
    for engine, variant in (("megakernel", "plain"), ("perop", "plain"), ("perop", "chained")):
        step.set_engine(engine, variant)
        with restoring(step, 6):
            tokens[engine, variant] = DeviceDecode(step, chunk=4).generate([rows.tokens[0]], 6, stop=())
    assert tokens["perop", "plain"] == tokens["megakernel", "plain"] == tokens["perop", "chained"]
    assert len(tokens["perop", "chained"][0]) == 6


def test_nan_left_in_a_cache_refuses_that_request_only():
    """A NaN past a row's keys (what a refused request can leave) is masked by the megakernel's
    reads but poisons the per-op engine's: that request is refused and the caches scrubbed, so the
    next one decodes."""
    from photon_core.runtime.sampling import NonFiniteLogits
    fam, step = perop_step("whisper-tiny.en", batch=1)
    rows, _, _ = start(fam, step)
    cache = next(n for n in step.graph_def.nodes if n.op == "kv_append").args["k"]
    view = step.view(cache.spec.name)
    view[(cache.layer,) if cache.layer is not None else ()][0, :, rows.positions[0] + 8] = float("nan")
    state = step.dyn.clone()
    with pytest.raises(NonFiniteLogits):
        DeviceDecode(step, chunk=2).generate([rows.tokens[0]], 4, stop=())
    assert all(torch.isfinite(step.view(n)).all() for n in step.graph_def.caches)
    step.dyn.copy_(state)
    assert len(DeviceDecode(step, chunk=2).generate([rows.tokens[0]], 4, stop=())[0]) == 4
    # a loop whose tokens a family's rules pick (Whisper's) refuses a NaN row the same way
    fam, step = perop_step("whisper-tiny.en", batch=1, advance=False)
    rows, _, _ = start(fam, step)
    view = step.view(cache.spec.name)
    view[(cache.layer,) if cache.layer is not None else ()][0, :, rows.positions[0] + 8] = float("nan")
    logits = step.view("logits")
    loop = DeviceDecode(step, pick=lambda: logits.argmax(-1).to(torch.int32), chunk=2)
    with pytest.raises(NonFiniteLogits):
        loop.generate([rows.tokens[0]], 4, stop=())
    assert all(torch.isfinite(step.view(n)).all() for n in step.graph_def.caches)


def test_what_the_engine_holds_follows_the_step():
    """An arena swapped for another (a dtype's copy) is what the next per-op launch reads; weights
    written in place are read after the engine is set again; float16 arenas are refused."""
    fam, step = perop_step("whisper-tiny.en", batch=1)
    start(fam, step)
    with restoring(step, 1):
        step.launch()
        before = step.view("logits").clone()
    step.weights = step.weights * 2          # another arena (every weight doubled)
    with restoring(step, 1):
        step.launch()
        assert not torch.allclose(step.view("logits"), before)
    norm = next(k for k in step.graph_def.weight_shapes if k.endswith(".w") and len(step.graph_def.weight_shapes[k]) == 1)
    step.weight(norm).mul_(3)
    step.set_engine("perop")
    assert torch.equal(step.kernel.weights[norm], step.weight(norm).float())
    step.weights = step.weights.half()
    with pytest.raises(ValueError, match="not float16"):
        step.launch()


def test_a_real_transcription_on_the_perop_engine_matches_the_reference():
    """Whisper tiny.en's real weights and real speech: every generated token by the per-op engine's
    steps (the compiled steps of the "megakernel" backend under the "perop" policy, the device
    rounds included), the reference backend's tokens and segments."""
    from speech_audio import espeak_pcm

    from photon_core.models.whisper import load_whisper
    from photon_core.models.whisper.megakernel_steps import MegakernelSteps
    from photon_core.runtime.decode import engine_choices, engine_policy
    model = load_whisper("whisper-tiny.en", dtype="float32", backend="reference")
    pcm, rate = espeak_pcm("Stop right there.")
    want, want_raw = model.transcribe_detailed(pcm, rate, timestamps=True)
    with engine_policy("perop"):
        steps = MegakernelSteps(model.net)
    assert steps.mk.engine == "perop" and not any(e == "megakernel" for e, _ in steps.mk._kernels)
    model.decoder.steps = steps
    got, got_raw = model.transcribe_detailed(pcm, rate, timestamps=True)
    assert got_raw.tokens == want_raw.tokens and len(want_raw.tokens) >= 4
    assert got["text"] == want["text"] and got["segments"] == want["segments"]
    assert any(c.engine == "perop" and c.how == "asked" for c in engine_choices())
    steps.mk.set_engine("perop", "chained")        # its Triton kernels (the interpreter), the same tokens
    got, got_raw = model.transcribe_detailed(pcm, rate, timestamps=True)
    assert got_raw.tokens == want_raw.tokens and got["segments"] == want["segments"]


def test_which_slots_hold_a_rows_keys():
    """The attention mask, slot by slot: a plain cache's first n (its last `window` of them), a
    ring's slots holding the last positions once it has wrapped, cross keys up to the cross length."""
    from photon_core.megakernel.perop_engine import _Run
    pos, cross = torch.tensor([0, 4, 9]), torch.tensor([3, 0, 6])
    e = _Run(3, torch.device("cpu"), pos, pos, pos, cross, {}, {}, None, kernel=None)

    def rows(mask):
        return [[t for t, v in enumerate(r) if v] for r in mask.tolist()]
    assert rows(e.keys("self", None, 12, False)) == [[0], [0, 1, 2, 3, 4], list(range(10))]
    assert rows(e.keys("self", 3, 12, False)) == [[0], [2, 3, 4], [7, 8, 9]]
    # a 4-slot ring: position p in slot p % 4; row 2 (positions 0..9) holds 6..9 in slots 2, 3, 0, 1
    assert rows(e.keys("self", 4, 4, True)) == [[0], [0, 1, 2, 3], [0, 1, 2, 3]]
    assert rows(e.keys("self", 3, 4, True)) == [[0], [0, 2, 3], [0, 1, 3]]
    assert rows(e.keys("cross", None, 8, False)) == [[0, 1, 2], [], [0, 1, 2, 3, 4, 5]]


@pytest.mark.parametrize("name", ["whisper-tiny.en", "moondream2"])
def test_the_chained_build_on_bfloat16_weights_matches_the_plain_build(name):
    """bf16 weights: both builds round a linear's input to bf16 and accumulate in fp32 (the chained
    kernels in Triton, the plain build through torch's GEMM, whose output is bf16 on the CPU): both
    within bf16's rounding of the fp32 weights' step, and of each other."""
    fam, step = perop_step(name)
    rows, _, _ = start(fam, step)
    step.weights = step.weights.to(torch.bfloat16)
    out = {}
    for variant in ("plain", "chained"):
        step.set_engine("perop", variant)
        with restoring(step, 1):
            step.launch()
            out[variant] = {k: step.view(k).clone() for k in step.graph_def.exposed}
    step.weights = step.weights.float()
    step.set_engine("perop", "plain")
    with restoring(step, 1):
        step.launch()
        exact = {k: step.view(k).clone() for k in step.graph_def.exposed}
    for k in exact:
        # bf16's 8-bit mantissa: ~0.3% a rounding, here 0.3-0.5% after a step of them
        assert 0 < rel_err(out["chained"][k], exact[k]) < 0.02, k
        assert rel_err(out["chained"][k], out["plain"][k]) < 0.02, k


def test_the_chained_build_never_reads_a_slot_past_a_rows_keys():
    """Its attention reads a row's keys only (as the megakernel): NaN a refused request left past
    them refuses nothing, and the tokens are those of the clean caches."""
    fam, step = perop_step("whisper-tiny.en", batch=1, variant="chained")
    rows, _, _ = start(fam, step)
    with restoring(step, 4):
        clean = DeviceDecode(step, chunk=2).generate([rows.tokens[0]], 4, stop=())
    cache = next(n for n in step.graph_def.nodes if n.op == "kv_append").args["k"]
    view = step.view(cache.spec.name)
    view[(cache.layer,) if cache.layer is not None else ()][0, :, rows.positions[0] + 8] = float("nan")
    with restoring(step, 4):
        assert DeviceDecode(step, chunk=2).generate([rows.tokens[0]], 4, stop=()) == clean
