"""A scripted LM head that makes Moondream 3's segment produce a real path on the tiny random
checkpoint (test_moondream3_checkpoints): coord, coord, size (the region head on the random weights
gives the box), then the path's words, then eos; again from the start for the next segment call."""
from __future__ import annotations

import itertools
import json
from pathlib import Path

import torch

from photon_core.models.moondream3 import text as md3_text

COORD, SIZE, EOS = 5, 6, 0
# A diamond touching the middle of each side of its box: "M 0.5 0 L 1 0.5 L 0.5 1 L 0 0.5 Z".
DIAMOND = ["M", "480", "0", "L", "960", "480", "L", "480", "960", "L", "0", "480", "Z"]
DIAMOND_PATH = "M 0.5 0 L 1 0.5 L 0.5 1 L 0 0.5 Z"


def script_segment(monkeypatch, folder, words=DIAMOND) -> None:
    """From now on (until monkeypatch undoes it) every Moondream 3 LM-head call follows the script
    (the checkpoint in `folder` gives the words' ids and the vocabulary size); segment calls one
    after another each get the whole path."""
    from photon_core.models.moondream.tokenizer import MoondreamTokenizer, find_tokenizer

    tokenizer = MoondreamTokenizer(find_tokenizer(Path(folder)))
    ids = [tokenizer.encode(w)[0] for w in words]
    script = itertools.cycle([COORD, COORD, SIZE] + ids + [EOS])
    vocab = json.loads((Path(folder) / "config.json").read_text())["text"]["vocab_size"]

    def scripted(hidden, w, ops):
        logits = torch.full((hidden.shape[0], vocab), -1e9, device=hidden.device)
        logits[:, next(script)] = 0.0
        return logits

    monkeypatch.setattr(md3_text, "lm_logits", scripted)
