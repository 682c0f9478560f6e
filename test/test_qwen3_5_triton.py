"""Qwen 3.5 on the per-op Triton backend (interpreter on CPU) against the reference backend: an image
prompt's prefill (vision encoder, chunked delta rule, conv, attention), decode steps, and a two-row
batched decode step with the rows at different lengths."""
from __future__ import annotations

import copy
import os

os.environ["TRITON_INTERPRET"] = "1"  # must precede the first import of triton

import pytest  # noqa: E402
import torch  # noqa: E402

import test_qwen3_5_fixtures as fx  # noqa: E402
from photon_core.backends.select import get_backend  # noqa: E402
from photon_core.models.qwen3_5 import load_qwen3_5, text  # noqa: E402


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen3_5_triton")
    fx.build(folder, "alternate", seed=2)
    return load_qwen3_5(folder), load_qwen3_5(folder, backend=get_backend("triton"))


def test_image_prompt_prefill_decode_and_ragged_batch(models):
    ref, tri = models
    img = fx.image(16, 32, seed=1)
    s1, l1 = ref.prefill(img, "what?", extra=6)
    s2, l2 = tri.prefill(img, "what?", extra=6)
    torch.testing.assert_close(l2, l1, atol=1e-4, rtol=0)
    fresh = copy.deepcopy(s1), copy.deepcopy(s2), l1, l2
    for _ in range(3):
        tok = torch.tensor([[int(ref.ops.argmax(l1))]])
        l1, l2 = ref.step(tok, s1)[0], tri.step(tok, s2)[0]
        torch.testing.assert_close(l2, l1, atol=1e-4, rtol=0)
    # Two rows at different lengths (3 tokens apart) decoded in one batched step.
    b1 = text.DecodeState.merge([s1, fresh[0]], s1.max_len)
    b2 = text.DecodeState.merge([s2, fresh[1]], s2.max_len)
    toks = torch.tensor([[int(ref.ops.argmax(l1))], [int(ref.ops.argmax(fresh[2]))]])
    out1, out2 = ref.step(toks, b1), tri.step(toks, b2)
    torch.testing.assert_close(out2, out1, atol=1e-4, rtol=0)
    torch.testing.assert_close(out1[0], ref.step(toks[:1], s1)[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(out1[1], ref.step(toks[1:], fresh[0])[0], atol=1e-5, rtol=0)
