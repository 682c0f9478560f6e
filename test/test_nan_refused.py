"""A model whose logits turn NaN refuses the request (NonFiniteLogits) on every path that chooses a
token or a bin: never a token, box or "nothing there" chosen by a NaN.

The compiled steps' argmax writes -2 in its result column for a NaN row and feeds a made-up but
valid token on; the per-op paths' argmax picks the NaN's index (torch) or the best other one (our
kernel). Before this was checked everywhere, a NaN gave an empty detection list (a broken model
reporting "nothing there"), Gemma 4 text from the made-up tokens, a Whisper window accepted with a
NaN log-probability, and Moondream captions an unrelated OverflowError. Each case here poisons one
weight of a small random model and runs the request through the path named. The Triton kernels run
under the CPU interpreter."""
import os

os.environ["TRITON_INTERPRET"] = "1"  # must precede the first import of triton

from types import SimpleNamespace  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

import moondream_fast_fixtures as ff  # noqa: E402
from test_gemma4_fixtures import gemma4_dir, gemma4_hf  # noqa: E402,F401

from photon_core.backends import reference, triton as triton_ops  # noqa: E402
from photon_core.backends.select import get_backend  # noqa: E402
from photon_core.megakernel.compiler import Tiling  # noqa: E402
from photon_core.models.moondream import Request, load_moondream  # noqa: E402
from photon_core.runtime.sampling import NonFiniteLogits, Sampling, pick, step_argmax  # noqa: E402

TILING = Tiling(block_n=64, block_k=128, block_t=32, self_splits=2)
GREEDY = {"temperature": 0, "max_tokens": 3}


@pytest.fixture(scope="module")
def moondream():
    """Moondream 2 (reduced) on the megakernel backend, its LM head's bias NaN at one token: the
    per-op prefill stays finite, every compiled step's logits hold a NaN."""
    model = load_moondream(ff.checkpoint(seed=1, object_bias=False), backend=get_backend("megakernel", "cpu"),
                           tiling=TILING)
    enc = model.encode_image(ff.image(seed=1))
    model.decode.decoder(1).weight("lm_b")[17] = float("nan")   # one arena: every bucket
    return model, enc


@pytest.mark.parametrize("requests", [
    [Request("detect", None, "cup", settings={"max_objects": 2})],
    [Request("point", None, "cup", settings={"max_objects": 2})],
    [Request("caption", None, "normal", settings=GREEDY), Request("detect", None, "cup")],
    [Request("query", None, "what is it?", settings=GREEDY, reasoning=True)],
], ids=["detect", "point", "caption+detect", "reasoning"])
def test_moondream_batches_refuse_nan_logits(moondream, requests):
    model, enc = moondream
    for r in requests:
        r.image = enc
    with pytest.raises(NonFiniteLogits):
        model.batch(requests)


def test_moondream_greedy_caption_on_the_compiled_step_refuses_nan_logits(moondream):
    model, enc = moondream
    with pytest.raises(NonFiniteLogits):
        model.caption(enc, settings=GREEDY)


def test_moondream_detect_refuses_nan_size_logits_host_driven_and_in_device_rounds():
    """A NaN in the size head (its bias, width half): the compiled step's size argmax marks -2.
    The host-driven steps refused it; the device rounds (greedy detect's default on the megakernel)
    turned the mark into a box about 0.001 wide and returned it."""
    model = load_moondream(ff.checkpoint(seed=1), backend=get_backend("megakernel", "cpu"),   # objects found
                           tiling=TILING)
    enc = model.encode_image(ff.image(seed=1))
    model.decode.decoder(1).weight("s_fc2_b")[3] = float("nan")   # one arena: every bucket
    for rounds in (False, True):
        model.decode.device_rounds = rounds
        with pytest.raises(NonFiniteLogits, match="size logits"):
            model.detect(enc, "cup", settings={"max_objects": 2})


def test_moondream_per_op_heads_refuse_nan_logits():
    """The host-driven per-op path (reference ops): a NaN in the LM head's bias, then in the
    coordinate head's: detect refuses, where it returned no objects."""
    model = load_moondream(ff.checkpoint(seed=1, object_bias=False))
    enc = model.encode_image(ff.image(seed=1))
    model.text_w.lm_head[1][17] = float("nan")
    with pytest.raises(NonFiniteLogits):
        model.detect(enc, "cup", settings={"max_objects": 2})
    model = load_moondream(ff.checkpoint(seed=1))   # objects found (the fixtures' coord bias)
    model.region_w.coord_fc2[1][3] = float("nan")
    with pytest.raises(NonFiniteLogits):
        model.point(model.encode_image(ff.image(seed=1)), "cup", settings={"max_objects": 2})


@pytest.mark.parametrize("device_rounds", [False, True])
def test_gemma4_refuses_nan_logits_host_driven_and_in_rounds(gemma4_dir, device_rounds):  # noqa: F811
    from photon_core.models.gemma4 import load_gemma4
    from photon_core.models.gemma4.decoding import BatchDecoder
    model = load_gemma4(gemma4_dir, backend=get_backend("megakernel", "cpu"), tiling=Tiling(64, 64, 32, 1, 1),
                        max_len=96)
    model.decode.decoder(1).view("logit_bias").view(-1)[5] = float("nan")
    row = model._row(None, "hello world", Sampling(3))
    with pytest.raises(NonFiniteLogits):
        list(BatchDecoder(model, [row], device_rounds=device_rounds).run())


def test_whisper_token_choice_refuses_nan_logits():
    from photon_core.models.whisper.decoding import TokenChooser
    dec = SimpleNamespace(net=SimpleNamespace(ops=reference), tok=SimpleNamespace(eot=50256),
                          _apply_rules=lambda *a: None)
    logits = torch.randn(51864)
    logits[123] = float("nan")
    for temperature in (0.0, 0.7):
        with pytest.raises(NonFiniteLogits):
            TokenChooser(dec, 1, False, temperature, None)(0, logits.clone(), None)


@pytest.mark.parametrize("ops", [reference, triton_ops], ids=["reference", "triton"])
def test_sampling_refuses_plus_infinity_and_greedy_takes_it(ops):
    """+inf's softmax is NaN: the draw gave token 0. Greedy's argmax is the +inf token; -inf is a mask."""
    logits = torch.tensor([0.0, 1.0, 2.0, float("inf"), 3.0, float("-inf")])
    assert pick(logits, Sampling(1), ops) == 3
    with pytest.raises(NonFiniteLogits):
        pick(logits, Sampling(1, 0.7, 1.0), ops, generator=torch.Generator().manual_seed(0))
    masked = torch.tensor([0.0, 1.0, 2.0, float("-inf")])
    assert pick(masked, Sampling(1, 0.7, 1.0), ops, generator=torch.Generator().manual_seed(0)) in (0, 1, 2)


def test_a_steps_negative_argmax_is_refused():
    assert step_argmax(0) == 0 and step_argmax(41) == 41
    for mark in (-1, -2):
        with pytest.raises(NonFiniteLogits):
            step_argmax(mark)


@pytest.mark.parametrize("ops", [reference, triton_ops], ids=["reference", "triton"])
def test_a_temperature_too_small_to_divide_by_is_the_argmax(ops):
    """logits / 1e-50 overflow float32 to NaN and token 0 was drawn every time (the backends
    disagreeing below which temperature): below GREEDY_BELOW a temperature is taken as 0."""
    logits = torch.tensor([0.0, 1.0, 5.0, 2.0])
    for t in (1e-50, 1e-40, 1e-7):
        assert Sampling(1, t).greedy and pick(logits, Sampling(1, t), ops) == 2
    assert not Sampling(1, 1e-3).greedy
