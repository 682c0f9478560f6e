"""Qwen3-ASR on the per-op Triton backend (under Triton's interpreter on CPU) against the
reference backend on the same tiny checkpoint: encoder, prefill logits, decode steps, greedy."""
from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # must precede the first import of triton

import torch  # noqa: E402

from test_qwen3_asr_reference import ours, speech  # noqa: E402


def test_triton_backend_matches_reference():
    ref, tri = ours("reference"), ours("triton")
    assert getattr(tri.ops, "NAME", "") == "triton"
    pcm = speech("Stop.")[:12000]
    mel, frames = ref.features(pcm)
    a_ref = ref.encode(mel, frames)
    a_tri = tri.encode(mel, frames)
    torch.testing.assert_close(a_tri, a_ref, atol=1e-4, rtol=1e-4)
    ids = ref.prompt_ids(a_ref.shape[0], "en", None)
    caches, tokens = [], []
    for m, a in ((ref, a_ref), (tri, a_tri)):
        cache = m.decoder.new_cache(2, len(ids) + 4)
        hidden = m.decoder.prefill(m.prompt_embeds(ids, a), cache, 0)
        m.decoder.prefill(m.prompt_embeds(ids, a), cache, 1)   # a second row: the batched step
        caches.append(cache)
        tokens.append(m.decoder.logits(hidden))
    torch.testing.assert_close(tokens[1], tokens[0], atol=1e-4, rtol=1e-4)
    step_in = tokens[0][-1].argmax().repeat(2)
    for _ in range(3):
        got = tri.decoder.step(step_in, caches[1])
        want = ref.decoder.step(step_in, caches[0])
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        step_in = want.argmax(-1)
