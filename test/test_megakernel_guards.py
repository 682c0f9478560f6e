"""No value computed on the device is used as an address unchecked (Triton's interpreter, Whisper's
and Qwen3-ASR's compiled steps on tiny random weights).

The first GPU run crashed the production decode loop this way: a cross cache not yet filled
(length 0) gave 0 / 0 in the attention merge, NaN logits, an argmax that matched no NaN and wrote a
token past the vocabulary, and the next launch's embedding read far outside its table. Here each
device-side consumer is fed what it could meet: out-of-range tokens, positions and rotary
positions, NaN logits, zero cross lengths. Every buffer the kernel reads or writes lies inside a
guard zone (NaN around the weights, so a read there would show; a pattern around the state, the
per-step values and the results, checked unchanged after each launch)."""
from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # must precede the first import of triton

import pytest  # noqa: E402
import torch  # noqa: E402

from photon_core.megakernel.compiler import Tiling  # noqa: E402
from photon_core.megakernel.decode_loop import DeviceDecode  # noqa: E402
from photon_core.models.whisper.decoder_step import WhisperDecoderMegakernel, WhisperDecoderWeights  # noqa: E402
from photon_core.runtime.sampling import NonFiniteLogits  # noqa: E402

GUARD = 4096
PATTERN = -123456   # in the int32 buffers' guards (as the fp32 state's: -123456.0)
V, D, H, CTX, ENC = 96, 64, 2, 16, 8


class Guarded:
    """A kernel's four buffers moved inside guard zones of GUARD elements on each side."""

    def __init__(self, kernel) -> None:
        self.kernel, self.zones = kernel, {}
        for name, fill in (("weights", float("nan")), ("state", float(PATTERN)), ("dyn", PATTERN), ("out", PATTERN)):
            t = getattr(kernel, name)
            big = torch.full((t.numel() + 2 * GUARD,), fill, dtype=t.dtype)
            big[GUARD:GUARD + t.numel()] = t.flatten()
            self.zones[name] = big
            setattr(kernel, name, big[GUARD:GUARD + t.numel()].view(t.shape))

    def launch(self) -> None:
        self.kernel.launch()
        for name, big in self.zones.items():
            edge = torch.cat([big[:GUARD], big[-GUARD:]])
            intact = torch.isnan(edge).all() if name == "weights" else (edge == PATTERN).all()
            assert intact, f"the launch wrote into the guard zone around {name}"


def whisper_step(nan_head: bool = False):
    wt = WhisperDecoderWeights.random(D, H, 1, V, n_ctx=CTX, seed=3)
    if nan_head:   # the final LayerNorm's weight: every logit NaN
        wt.ln_w[:] = float("nan")
    step = WhisperDecoderMegakernel(wt, 1, CTX, ENC, Tiling(32, 64, 16, 2, 2), advance=True)
    g = torch.Generator().manual_seed(0)
    step.set_cross_kv([(torch.randn(1, H, ENC, D // H, generator=g), torch.randn(1, H, ENC, D // H, generator=g))])
    step.set_step([5], [3])
    return wt, step


def embed_value(step) -> torch.Tensor:
    node = next(n for n in step.graph_def.nodes if n.op == "embed")
    at = step.sarena.off(node.value.name)
    return step.kernel.state[at:at + D]


@pytest.mark.parametrize("token,position", [(V + 5, 3), (-3, 3), (5, CTX + 40), (5, -7)])
def test_an_out_of_range_token_or_position_is_read_as_row_0_and_reported(token, position):
    wt, step = whisper_step()
    guarded = Guarded(step.kernel)
    step.kernel.dyn[0], step.kernel.dyn[1] = token, position     # as a device-side producer would leave them
    guarded.launch()
    with pytest.raises(RuntimeError, match=r"task \d+ 'x.*outside its table"):
        step.kernel.raise_on_error()
    tok_ok, pos_ok = 0 <= token < V, 0 <= position < CTX
    want = wt.token_embedding[token if tok_ok else 0] + wt.positional_embedding[position if pos_ok else 0]
    torch.testing.assert_close(embed_value(step), want)


def test_nan_logits_give_the_non_finite_result_and_an_in_range_next_token():
    _, step = whisper_step(nan_head=True)
    guarded = Guarded(step.kernel)
    guarded.launch()
    step.kernel.raise_on_error()                  # nothing failed: the row just has no argmax
    assert step.kernel.out[0].item() == -2        # NON_FINITE, never a token past the vocabulary
    tok, pos = step.kernel.dyn[0].item(), step.kernel.dyn[1].item()
    assert 0 <= tok < V and pos == 3              # fed on: an in-range token, the row stays put
    guarded.launch()                              # the next launch embeds that token: in range
    step.kernel.raise_on_error()


def test_attention_over_an_unfilled_cross_cache_gives_zeros_not_nan():
    wt, step = whisper_step()
    step.set_cross_len([0])
    Guarded(step.kernel).launch()
    step.kernel.raise_on_error()
    assert torch.isfinite(step.view("logits")).all()
    assert 0 <= step.kernel.out[0].item() < V


def test_the_decode_loop_refuses_a_row_with_nan_logits():
    _, step = whisper_step(nan_head=True)
    loop = DeviceDecode(step, chunk=4, cuda_graphs=False)
    with pytest.raises(NonFiniteLogits, match="row 0"):
        loop.generate([5], 6, stop=set())


def test_the_decode_loop_built_before_its_state_decodes_from_zero_cross_length():
    # The first GPU run's crash: the loop (and its capture warm-ups) built before the cross caches
    # were filled. Rounds from that state now give in-range tokens, and building the loop leaves
    # the step's tokens and positions as they were.
    wt = WhisperDecoderWeights.random(D, H, 1, V, n_ctx=CTX, seed=3)
    step = WhisperDecoderMegakernel(wt, 1, CTX, ENC, Tiling(32, 64, 16, 2, 2), advance=True)
    step.set_step([5], [3])
    before = step.dyn.clone()
    loop = DeviceDecode(step, chunk=2, cuda_graphs=False)
    assert torch.equal(step.dyn, before)
    tokens = loop.generate([5], 4, stop=set())[0]
    assert len(tokens) == 4 and all(0 <= t < V for t in tokens)


def test_a_rotary_position_outside_the_tables_is_reported():
    from test_qwen3_asr_megakernel import INTERPRETER_TILING, tensors
    from test_qwen3_asr_reference import ours

    from photon_core.models.qwen3_asr.decoder_step import Dims, Qwen3ASRDecoderMegakernel, gather_weights
    dm = Dims.of(ours().config.text, False)
    step = Qwen3ASRDecoderMegakernel(gather_weights(tensors(), dm, 16, torch.device("cpu")), dm, 1, 16,
                                     INTERPRETER_TILING)
    step.set_step([1], [2])
    guarded = Guarded(step.kernel)
    step.kernel.dyn[3] = 1000                     # a rotary offset no host check would let through
    guarded.launch()
    with pytest.raises(RuntimeError, match="outside its table"):
        step.kernel.raise_on_error()


def test_what_capture_warm_ups_write_is_put_back():
    # DeviceDecode's CUDA-graph capture runs its rounds once to warm up: on a session whose
    # caches and states hold a request's history, everything those launches write must be put back
    # (restoring), or building a loop would corrupt the request. Real launches here, as capture's.
    from photon_core.megakernel.decode_loop import restoring
    _, step = whisper_step()
    g = torch.Generator().manual_seed(5)
    for name in step.graph_def.caches:
        view = step.view(name)
        view.copy_(torch.randn(view.shape, generator=g))
    kept = [step.view(n) for n in list(step.graph_def.caches) + list(step.graph_def.states)] + [step.dyn, step.out]
    before = [t.clone() for t in kept]
    with restoring(step, 3):
        for _ in range(3):
            step.kernel.launch()
        assert sum(not torch.equal(t, b) for t, b in zip(kept, before)) >= 3   # caches, tokens, results
    for t, b in zip(kept, before):   # the rest of the arena is scratch each launch rewrites first
        assert torch.equal(t, b)
