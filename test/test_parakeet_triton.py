"""Parakeet on the per-op Triton backend (under Triton's CPU interpreter) against the reference
backend on the same tiny random weights: encoder output within fp32 tolerance, and the same greedy
TDT tokens and durations, on one second of espeak-ng speech. The encoder's relative-position
attention runs through the Triton prefill kernel with its position-bias input, the conformer's
depthwise conv through the Triton causal_conv1d kernel."""
import os

os.environ["TRITON_INTERPRET"] = "1"  # must precede the first import of triton

import torch  # noqa: E402

import parakeet_fixtures as pf  # noqa: E402
from photon_core.backends.select import get_backend  # noqa: E402
from photon_core.models.parakeet import load_parakeet  # noqa: E402
from photon_core.models.parakeet.tdt import greedy_tdt  # noqa: E402


def _run(speech, pcm):
    with torch.inference_mode():
        enc = speech.model.encode(speech.mel(pcm)[None])
        steps, _ = greedy_tdt(speech.model, speech.model.project_encoder(enc)[0],
                              max_symbols=speech.cfg.max_symbols_per_step, block=8)
    return enc, steps


def test_triton_backend_matches_reference():
    pcm = pf.speech()[:16000]
    ref = load_parakeet(pf.hf_checkpoint(), backend="reference")
    tri = load_parakeet(pf.hf_checkpoint(), ops=get_backend("triton", "cpu"))
    enc_ref, steps_ref = _run(ref, pcm)
    enc_tri, steps_tri = _run(tri, pcm)
    torch.testing.assert_close(enc_tri, enc_ref, atol=1e-4, rtol=1e-4)
    assert len(steps_ref.tokens) > 3
    assert (steps_tri.tokens, steps_tri.durations, steps_tri.frames) == \
        (steps_ref.tokens, steps_ref.durations, steps_ref.frames)
