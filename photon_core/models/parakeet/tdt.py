"""Greedy Token-and-Duration Transducer decoding, written to run on the device without a host sync
per step.

Each step reads the joint at the current frame t, takes the best token and the best duration; a
non-blank token advances the prediction network, and t moves on by the duration (a blank with
duration 0 moves on by 1, so decoding always ends; after `max_symbols` zero-duration emissions in a
row t is moved on by 1, as NeMo's greedy TDT guard does). Steps are pure tensor ops: whether a step
is still inside the audio is a mask (t < T), not a Python `if`, and the prediction network is run on
every step's token and its new state kept only where a non-blank was emitted. The host looks at the
device only once per block of `block` steps (to see whether every row is past the end), so on CUDA
a block is a stream of kernel launches with no synchronisation inside it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .model import ParakeetModel


@dataclass
class DecoderState:
    h: torch.Tensor
    c: torch.Tensor
    pred: torch.Tensor


@dataclass
class TdtSteps:
    tokens: list[int]       # every step's token, blanks included (transformers' `sequences` order)
    durations: list[int]    # every step's duration as applied (blank 0 -> 1)
    frames: list[int]       # the frame each step was read at


def greedy_tdt(model: ParakeetModel, enc_proj: torch.Tensor, state: DecoderState | None = None,
               max_symbols: int | None = None, block: int = 32) -> tuple[TdtSteps, DecoderState]:
    """Decode one utterance: enc_proj [T, joint hidden] (model.project_encoder's rows)."""
    cfg, ops = model.cfg, model.ops
    dev = enc_proj.device
    T = enc_proj.shape[0]
    if state is None:
        h, c, pred = model.initial_state(1)
        state = DecoderState(h, c, pred)
    h, c, pred = state.h, state.c, state.pred
    V = cfg.vocab_size
    dur_table = torch.tensor(cfg.durations, dtype=torch.long, device=dev)
    t = torch.zeros(1, dtype=torch.long, device=dev)
    run = torch.zeros(1, dtype=torch.long, device=dev)
    one = torch.ones(1, dtype=torch.long, device=dev)
    zero = torch.zeros(1, dtype=torch.long, device=dev)
    # A step either moves t on or emits a zero-duration token; the guard bounds those per frame.
    limit = T * ((max_symbols or 10 * T) + 1)
    records: list[torch.Tensor] = []
    steps = 0
    while steps < limit:
        for _ in range(block):
            active = t < T
            logits = model.joint(enc_proj.index_select(0, t.clamp(max=T - 1)), pred)
            tok = ops.argmax(logits[:, :V])
            dur = dur_table[ops.argmax(logits[:, V:])]
            blank = tok == cfg.blank_id
            dur = torch.where(blank & (dur == 0), one, dur)
            if max_symbols:
                run = torch.where(dur == 0, run + 1, zero)
                forced = run >= max_symbols
                dur = torch.where(forced, one, dur)
                run = torch.where(forced, zero, run)
            h2, c2, pred2 = model.predict(tok, h, c)
            keep = active & ~blank
            h = torch.where(keep[None, :, None], h2, h)
            c = torch.where(keep[None, :, None], c2, c)
            pred = torch.where(keep[:, None], pred2, pred)
            records.append(torch.stack([tok, dur, t, active.long()], dim=1))
            t = t + torch.where(active, dur, zero)
        steps += block
        if bool((t >= T).all()):   # the one host read per block
            break
    rows = torch.cat(records).cpu()
    rows = rows[rows[:, 3] == 1]
    steps_out = TdtSteps(rows[:, 0].tolist(), rows[:, 1].tolist(), rows[:, 2].tolist())
    return steps_out, DecoderState(h, c, pred)
