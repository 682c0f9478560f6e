"""Greedy decoding in rounds on the device (photon_core.megakernel.decode_loop), on Qwen3-ASR's
compiled step (tiny random checkpoint, Triton's interpreter): the same tokens as the loop that
launches one step per token and reads each token back, with one read of the device per round;
a wait that gave up in the middle of a round is still reported (the next launch zeroes the control
buffer); a row reaching the end of its cache raises instead of decoding on."""
from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # must precede the first import of triton

import pytest  # noqa: E402
import torch  # noqa: E402

from test_qwen3_asr_megakernel import INTERPRETER_TILING, MAX_LEN, tensors  # noqa: E402
from test_qwen3_asr_reference import ours  # noqa: E402

from photon_core.megakernel.decode_loop import DeviceDecode, _parts_to_capture  # noqa: E402
from photon_core.models.qwen3_asr.decoder_step import Dims, Qwen3ASRDecoderMegakernel, gather_weights  # noqa: E402
from photon_core.models.qwen3_asr.megakernel_decode import MegakernelDecode  # noqa: E402


def prompts(model) -> list[torch.Tensor]:
    """Three text prompts of different lengths (rows at their own positions; bucket 4, one padding row)."""
    return [model.decoder.embed_tokens(torch.tensor(model.prompt.encode(t)))
            for t in ("turn on the lights", "stop", "pick up the red cup and bring it here")]


def per_token(mk, first: list[int], max_new: int) -> list[list[int]]:
    """The host-driven loop: one launch per token, each token read back (the old production path)."""
    out = [[t] for t in first]
    for _ in range(max_new - 1):
        mk.launch()
        for r, t in enumerate(mk.result("token")[:len(first)].tolist()):
            out[r].append(t)
    return out


def cut(rows: list[list[int]], stop: set[int], max_new: int) -> list[list[int]]:
    """Greedy rows' tokens as a loop stopping at `stop` (excluded) or max_new would give them."""
    out = []
    for row in rows:
        end = next((i for i, t in enumerate(row) if t in stop), len(row))
        out.append(row[:min(end, max_new)])
    return out


def test_rounds_give_the_per_token_tokens_with_one_read_per_round():
    model = ours()
    mkd = MegakernelDecode(model.decoder, tensors(), INTERPRETER_TILING, MAX_LEN)
    ps = prompts(model)
    mk, first = mkd.start(ps)                       # prefilled once; each run below starts from it
    saved = [t.clone() for t in (mk.state, mk.dyn)]

    def restored():
        for t, s in zip((mk.state, mk.dyn), saved):
            t.copy_(s)
        return mk

    want = per_token(restored(), first, 8)
    assert len({t for w in want for t in w}) >= 4
    # Rounds of at most 4 steps (production's are 8, mkd's loop: the same code, half the launches
    # under the interpreter). On CUDA a round is the replays of its captured parts: a round of 4
    # the 4-step part, a round of 3 the 2- and 1-step parts at offsets 0 and 2 of the history, then
    # one read. Each part stands in here for its graph by running the same round (what capture
    # records), so the offsets and the accumulators are what is tested.
    loop = DeviceDecode(mk, chunk=4)
    replayed = []

    class Part:
        def __init__(self, n: int, at: int) -> None:
            self.n, self.at = n, at

        def replay(self) -> None:
            replayed.append((self.n, self.at))
            loop._round(self.n, self.at)
    restored()
    loop._graphs = {(n, at): Part(n, at) for n, at in _parts_to_capture(loop.chunk)}
    try:
        assert loop.generate(first, 8, []) == want
    finally:
        loop._graphs = {}
    assert loop.rounds == 2   # 7 steps: rounds of 4 and 3, one read each
    assert replayed == [(4, 0), (2, 0), (1, 2)]
    # Without graphs (the CPU's rounds, launched in turn). A row stopping in the middle of a round:
    # its later tokens in that round are dropped, the others decode on (greedy tokens do not depend
    # on when a row stops). One round of 3 steps.
    stop = {want[1][2]}
    want_stop = cut(want, stop, 4)
    assert len(want_stop[1]) == want[1].index(want[1][2]) < 3 and len(want_stop[0]) == 4
    restored()
    assert loop.generate(first, 4, stop) == want_stop
    assert loop.rounds == 3
    # A prefill that already gives a stop token: that row is empty, the others unchanged.
    restored()
    assert loop.generate(first, 3, {want[0][0]}) == cut(want, {want[0][0]}, 3)
    # (The model's own entry, prefill then rounds, is test_qwen3_asr_megakernel's transcribe test.)


def test_a_wait_that_gave_up_mid_round_is_reported_with_its_task():
    model = ours()
    mkd = MegakernelDecode(model.decoder, tensors(), INTERPRETER_TILING, MAX_LEN)
    mk, _ = mkd.start(prompts(model))
    loop = DeviceDecode(mk, chunk=4)   # production's rounds are 8 steps: here 4, fewer launches
    kernel = loop.kernel
    victim = next(i for i, t in enumerate(kernel.graph.tasks) if t.waits)
    launch, calls = kernel.launch, []

    def third_launch_never_satisfied():
        # Launch 3 of the round waits for a count no task reaches; launch 4 is sound and zeroes
        # the control buffer again, so only the loop's own record still shows the error.
        calls.append(1)
        if len(calls) == 3:
            saved = kernel.tasks[victim, 2].clone()
            kernel.tasks[victim, 2] = 1 << 40
            launch()
            kernel.tasks[victim, 2] = saved
        else:
            launch()
    kernel.launch = third_launch_never_satisfied
    try:
        with pytest.raises(RuntimeError, match=f"task {victim} "):
            loop.generate([1, 2, 3], 5, [])
        assert len(calls) == 4 and kernel.ctrl[1].item() == 0   # the last launch's own flag is clear
    finally:
        kernel.launch = launch


def test_a_row_at_the_end_of_its_cache_raises():
    model = ours()
    dm = Dims.of(model.config.text, False)
    step = Qwen3ASRDecoderMegakernel(gather_weights(tensors(), dm, 16, torch.device("cpu")), dm, 1, 16,
                                     INTERPRETER_TILING)
    loop = DeviceDecode(step, chunk=4)
    step.set_step([5], [12])      # positions 12..15 are left: 4 steps, the 4th one's token the last
    fits = loop.generate([5], 5, [])
    assert len(fits) == 1 and len(fits[0]) == 5 and fits[0][-1] == step.dyn[0].item()
    step.set_step([5], [12])
    with pytest.raises(RuntimeError, match="row 0 reached the end of the megakernel's context"):
        loop.generate([5], 6, [])
    assert step.dyn[1].item() == 15   # the device kept the row inside its cache
    with pytest.raises(ValueError, match="power of two"):
        DeviceDecode(step, chunk=3)
    with pytest.raises(ValueError, match="advances the rows itself"):   # positions would step twice
        DeviceDecode(step, pick=lambda: step.dyn[:1])
    host_fed = Qwen3ASRDecoderMegakernel(gather_weights(tensors(), dm, 16, torch.device("cpu")), dm, 1, 16,
                                         INTERPRETER_TILING, advance=False)
    with pytest.raises(ValueError, match="not an advancing argmax"):
        DeviceDecode(host_fed)
