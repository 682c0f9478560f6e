"""A whole transcription with every generated token decoded by the megakernel (one persistent
Triton launch per token, under TRITON_INTERPRET=1 here) gives the reference path's tokens, on
real tiny.en weights and real speech."""
import os

os.environ["TRITON_INTERPRET"] = "1"  # must precede the first import of triton

import pytest  # noqa: E402

from photon_core.models.whisper import load_whisper  # noqa: E402
from photon_core.megakernel.whisper_decoder import Tiling  # noqa: E402
from photon_core.models.whisper.megakernel_steps import MegakernelSteps  # noqa: E402

# Few, large tiles: the interpreter runs programs one after another, so its cost is per task.
# (On a GPU the default tiling spreads the step over every SM instead.)
INTERPRETER_TILING = Tiling(block_n=1024, block_k=128, block_t=512, self_splits=1, cross_splits=1)
from speech_audio import espeak_pcm  # noqa: E402


@pytest.mark.parametrize("timestamps", [False, True])
def test_megakernel_transcription_matches_reference(timestamps):
    model = load_whisper("whisper-tiny.en", dtype="float32", backend="reference")
    pcm, rate = espeak_pcm("Stop right there.")
    want, want_raw = model.transcribe_detailed(pcm, rate, timestamps=timestamps)
    model.decoder.steps = MegakernelSteps(model.net, tiling=INTERPRETER_TILING)
    got, got_raw = model.transcribe_detailed(pcm, rate, timestamps=timestamps)
    assert got_raw.tokens == want_raw.tokens and len(want_raw.tokens) >= 4
    assert got["text"] == want["text"] == "Stop right there."
    assert got["segments"] == want["segments"]


def test_backend_choice():
    from photon_core.backends.select import get_backend
    assert get_backend("auto", "cpu").__name__.endswith("reference")
    assert getattr(get_backend("megakernel", "cpu"), "NAME", "") == "megakernel"   # interpreter on
    model = load_whisper("whisper-tiny.en", dtype="float32", backend="megakernel")
    assert isinstance(model.decoder.steps, MegakernelSteps)
