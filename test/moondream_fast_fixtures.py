"""A fast variant of the small random Moondream checkpoint, for tests that run Triton under the CPU
interpreter (hundreds of times slower than PyTorch).

Same tensor names and layer structure as moondream_fixtures.small_config(), with the costs that do
not change what is tested cut down:
* vocab 1024 instead of 51200 (the LM head is 1/50 of the tiles); the prompt templates are remapped
  to ids below 1024 through config.json's tokenizer section (the fixture tokenizer still decodes them);
* crops of 126 px (9 x 9 = 81 patches, prefix 82) instead of 378 px (729 patches): vision attention
  and the bidirectional prefill are ~80x cheaper, the tiling/stitching/pooling code paths are the same;
* max_context 160 (KV caches and the rotary table).
Region bins stay real (1024 coordinate bins, 2 x 1024 size bins) so the bin arithmetic is the real one.
"""
from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np

import moondream_fixtures as mf
from moondream_fixtures import assert_same_results, split_scores  # noqa: F401  (the fast tests' too)

FAST_VOCAB = 1024


def fast_config() -> dict:
    cfg = mf.small_config()
    cfg["text"].update(vocab_size=FAST_VOCAB, max_context=160, prefix_attn=82)
    cfg["vision"].update(crop_size=126)
    cfg["tokenizer"] = {"templates": {
        "caption": {"short": [1, 708, 2, 492, 3], "normal": [1, 708, 2, 382, 3], "long": [1, 708, 2, 59, 3]},
        "query": {"prefix": [1, 381, 2], "suffix": [3]},
        "detect": {"prefix": [1, 235, 476, 2], "suffix": [3]},
        "point": {"prefix": [1, 581, 2], "suffix": [3]},
    }}
    return cfg


@functools.lru_cache(maxsize=None)
def checkpoint(seed: int = 0, object_bias: bool = True) -> Path:
    return mf.write_checkpoint(mf._ROOT / f"fast_{seed}_{int(object_bias)}", seed=seed, object_bias=object_bias,
                               config=fast_config())


def image(height: int = 100, width: int = 120, seed: int = 0) -> np.ndarray:
    """An image no bigger than one crop: tiling (1, 1), i.e. the global crop + one local crop."""
    return (np.random.default_rng(seed).random((height, width, 3)) * 255).astype(np.uint8)


@contextmanager
def coord_margin(margin: float, *models) -> Iterator[None]:
    """For the duration, each model's LM-head bias of `coord` is eos's + `margin` (instead of the
    fixtures' +100, which puts every object's score at exactly 1.0), so scores are probabilities
    strictly inside (0, 1). The hidden states do not depend on the LM head, so while every boundary
    still continues, the boxes and points are those of the unchanged checkpoint. Written into the
    megakernel's weight arena too (all its buckets share one), restored afterwards."""
    saved = []
    for m in models:
        bias = m.text_w.lm_head[1]
        saved.append((m, bias[mf.COORD_ID].item()))
        value = bias[mf.EOS_ID].item() + margin
        _set_coord_bias(m, value)
    try:
        yield
    finally:
        for m, value in saved:
            _set_coord_bias(m, value)


def _set_coord_bias(model, value: float) -> None:
    model.text_w.lm_head[1][mf.COORD_ID] = value
    decoders = model.decode._steps if model.decode is not None else {}
    for mk in decoders.values():
        mk.weight("lm_b")[mf.COORD_ID] = value



def device_coords(model, bins: list[int]) -> list[list[float]]:
    """The coordinates the megakernel's device decode paths give `bins`: the batched stepper's
    heads, the device rounds' recorded heads, and the rounds' table of encoder inputs (in the
    encoder's dtype, as float)."""
    import torch

    from photon_core.models.moondream.decoder_step import StepResult
    from photon_core.models.moondream.megakernel_decode import MegakernelHeads, MegakernelStepper
    from photon_core.models.moondream.object_rounds import RecordedHeads
    fm, rows = model.decode, list(range(len(bins)))
    res = StepResult([0] * len(bins), bins, [(0, 0)] * len(bins), torch.zeros(len(bins), 1))
    heads = MegakernelHeads(res, rows, fm.decoder(1), MegakernelStepper(fm).n_bins, model.config.tokenizer)
    dev = fm.object_rounds(fm.decoder(4))
    recorded = RecordedHeads([[0, b, 0, 0, 0] for b in bins], rows, dev.n_bins)
    return [heads.coords(rows), recorded.coords(rows), dev.coord_table[bins].float().tolist()]
