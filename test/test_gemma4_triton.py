"""Gemma 4 on the per-op Triton backend (CPU interpreter) against the reference backend on the same
tiny checkpoint: prefill logits past the sliding window, batched decode steps with rows at different
positions (ring slots, KV-shared layers, per-row rotary), and the image soft tokens."""
import os

os.environ["TRITON_INTERPRET"] = "1"  # must precede the first import of triton

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from test_gemma4_fixtures import BOS, WINDOW, gemma4_dir, gemma4_hf  # noqa: E402,F401

from photon_core.backends.select import get_backend  # noqa: E402
from photon_core.models.gemma4 import load_gemma4, text, vision  # noqa: E402

ATOL = 2e-4


@pytest.fixture(scope="module")
def pair(gemma4_dir):
    return load_gemma4(gemma4_dir), load_gemma4(gemma4_dir, backend=get_backend("triton", "cpu"))


def test_triton_prefill_and_batched_decode_match_reference(pair):
    ref, tri = pair
    prompts = [[BOS] + list(range(30, 30 + WINDOW + 3)), [BOS] + list(range(60, 63))]
    max_len = 16
    caches = []
    for m in pair:
        cache = text.KVCache(m.config.text, 2, max_len, m.dtype, m.device)
        last = []
        for b, p in enumerate(prompts):
            one = text.KVCache(m.config.text, 1, max_len, m.dtype, m.device)
            last.append(m.prefill(p, None, one)[0])
            cache.copy_row(b, one)
        caches.append((cache, torch.stack(last)))
    torch.testing.assert_close(caches[1][1], caches[0][1], atol=ATOL, rtol=0)
    pos = torch.tensor([len(p) for p in prompts])
    toks = caches[0][1].argmax(-1)
    for _ in range(2):
        a = ref.step(toks[:, None], pos, caches[0][0])
        b = tri.step(toks[:, None], pos, caches[1][0])
        torch.testing.assert_close(b, a, atol=ATOL, rtol=0)
        toks, pos = a.argmax(-1), pos + 1


def test_triton_vision_tower_matches_reference(pair):
    ref, tri = pair
    # A 4 x 6 patch grid (the interpreter's cost grows with the patch count; the skills' resize to
    # the soft-token budget is covered on the reference backend).
    image = np.random.default_rng(1).integers(0, 256, (16, 24, 3), dtype=np.uint8)
    pixels = torch.from_numpy(image.astype(np.float32) / 255).view(4, 4, 6, 4, 3).permute(0, 2, 1, 3, 4).reshape(24, 48)
    ys, xs = torch.meshgrid(torch.arange(4), torch.arange(6), indexing="ij")
    pos = torch.stack([xs.reshape(-1), ys.reshape(-1)], -1)
    a, b = (vision.project(vision.encode(pixels, pos, m.w, m.config.vision, m.ops), m.w, m.config.vision.eps, m.ops,
                           m.dtype) for m in pair)
    assert a.shape == (6, ref.config.text.dim)
    torch.testing.assert_close(b, a, atol=ATOL, rtol=0)
