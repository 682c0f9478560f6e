"""A whole transcription with every generated token decoded by our kernels gives the reference
path's tokens, on real tiny.en weights and real speech (under TRITON_INTERPRET=1 here): by the
megakernel (greedy rounds on the device: one read of the device per round, not per token; with
timestamps the rounds' log-probabilities are the host's), and by the per-op kernels of the "triton"
backend (the step that is one CUDA-graph replay on a GPU)."""
import functools
import os

os.environ["TRITON_INTERPRET"] = "1"  # must precede the first import of triton

from collections.abc import Callable  # noqa: E402

import pytest  # noqa: E402

from photon_core.backends.select import get_backend  # noqa: E402
from photon_core.megakernel import decode_loop  # noqa: E402
from photon_core.models.whisper import load_whisper  # noqa: E402
from photon_core.models.whisper.decoder_step import Tiling  # noqa: E402
from photon_core.models.whisper.megakernel_steps import MegakernelSteps  # noqa: E402
from photon_core.models.whisper.perop_steps import PerOpSteps  # noqa: E402
from photon_core.models.whisper.transcribe import WhisperSpeech  # noqa: E402
from speech_audio import espeak_pcm  # noqa: E402

# Few, large tiles: the interpreter runs programs one after another, so its cost is per task.
# (On a GPU the default tiling spreads the step over every SM instead.)
INTERPRETER_TILING = Tiling(block_n=1024, block_k=128, block_t=512, self_splits=1, cross_splits=1)
# Rounds of at most 2 steps here; production's are 8, run by the same code (test_megakernel_decode_loop
# runs rounds of 4). The host sees EOT only when it reads a round, so a round of 8 runs 8 launches
# however early the window ends, each costing seconds under the interpreter: the clip's 4 launches
# (6 with timestamps) are 2 rounds (3) here instead of one round of 8, and the rules' state on the
# device crosses round boundaries.
CHUNK = 2

CLIP = "Stop right there."


def rounds_of(monkeypatch: pytest.MonkeyPatch, chunk: int = CHUNK) -> None:
    """MegakernelSteps builds its buckets' round loops (prepare, on the first greedy window) with
    at most `chunk` steps a round."""
    class Rounds(decode_loop.DeviceDecode):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **{"chunk": chunk, **kwargs})
    monkeypatch.setattr(decode_loop, "DeviceDecode", Rounds)


@pytest.fixture(scope="module")
def model() -> WhisperSpeech:
    """One reference model for the module: each test puts its steps on the decoder and takes them
    off again (the reference path is the decoder without steps)."""
    return load_whisper("whisper-tiny.en", dtype="float32", backend="reference")


@pytest.fixture(scope="module")
def reference(model: WhisperSpeech) -> Callable[[bool], tuple]:
    """The reference path's transcription of CLIP (result, raw) with or without timestamps,
    decoded once for the module (the megakernel and the per-op tests compare with the same one)."""
    @functools.cache
    def transcribe(timestamps: bool) -> tuple:
        assert model.decoder.steps is None
        return model.transcribe_detailed(*espeak_pcm(CLIP), timestamps=timestamps)
    return transcribe


@pytest.mark.parametrize("timestamps", [False, True])
def test_megakernel_transcription_matches_reference(model, reference, monkeypatch, timestamps):
    want, want_raw = reference(timestamps)
    rounds_of(monkeypatch)
    steps = MegakernelSteps(model.net, tiling=INTERPRETER_TILING)
    model.decoder.steps = steps
    try:
        got, got_raw = model.transcribe_detailed(*espeak_pcm(CLIP), timestamps=timestamps)
    finally:
        model.decoder.steps = None
    assert got_raw.tokens == want_raw.tokens and len(want_raw.tokens) >= 4
    assert got["text"] == want["text"] == CLIP
    assert got["segments"] == want["segments"]
    # (test_whisper_device_rules checks the rules themselves, and a batch of windows as rows of a bucket.)
    n = len(want_raw.tokens)            # tokens after the first (host-chosen) one, plus EOT: n launches
    assert steps.loop.chunk == CHUNK    # one read of the device per round of CHUNK launches
    assert steps.loop.rounds == -(-n // CHUNK) and steps.loop.rounds < n
    if timestamps:   # with timestamps the rounds' log-probabilities are the host's within 1e-6
        assert n >= 6
        assert [s["avg_logprob"] for s in got_raw.segments] == pytest.approx(
            [s["avg_logprob"] for s in want_raw.segments], rel=1e-6, abs=1e-6)


def test_perop_step_transcription_matches_reference(model, reference, monkeypatch):
    import photon_core.kernels.attention as attention
    import photon_core.kernels.linear as linear
    # Few, large programs: the interpreter's cost is per program and per loop step.
    monkeypatch.setattr(linear, "GEMV_BLOCK_N", 1024)
    monkeypatch.setattr(linear, "GEMV_BLOCK_K", 128)
    monkeypatch.setattr(attention, "DECODE_BLOCK_T", 512)
    want, want_raw = reference(True)
    model.decoder.steps = PerOpSteps(model.net, get_backend("triton", "cpu"))
    try:
        got, got_raw = model.transcribe_detailed(*espeak_pcm(CLIP), timestamps=True)
    finally:
        model.decoder.steps = None
    assert got_raw.tokens == want_raw.tokens and len(want_raw.tokens) >= 4
    assert got["text"] == want["text"] == CLIP
    assert got["segments"] == want["segments"]


def test_backend_choice():
    assert get_backend("auto", "cpu").__name__.endswith("reference")
    assert getattr(get_backend("megakernel", "cpu"), "NAME", "") == "megakernel"   # interpreter on
    model = load_whisper("whisper-tiny.en", dtype="float32", backend="megakernel")
    assert isinstance(model.decoder.steps, MegakernelSteps)
    model = load_whisper("whisper-tiny.en", dtype="float32", backend="triton")
    assert isinstance(model.decoder.steps, PerOpSteps)
    assert load_whisper("whisper-tiny.en", dtype="float32", backend="reference").decoder.steps is None
