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

from photon_core.runtime.sampling import NonFiniteLogits

from .config import MAX_SYMBOLS_PER_STEP
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
    return greedy_tdt_many(model, enc_proj[None], [enc_proj.shape[0]], [state], max_symbols, block)[0]


def greedy_tdt_many(model: ParakeetModel, enc_proj: torch.Tensor, lengths: list[int],
                    states: list[DecoderState | None], max_symbols: int | None = None,
                    block: int = 32) -> list[tuple[TdtSteps, DecoderState]]:
    """Decode B utterances together, each its own: enc_proj [B, T_max, joint hidden] with
    lengths[b] real frames in row b, states[b] its prediction network's state (None: fresh). Every
    row steps at once (one joint and one prediction step for the batch), each at its own frame;
    a row past its end or its step limit is inactive: nothing of it is recorded or kept, so it
    decodes as it would alone."""
    if max_symbols is not None and not 1 <= max_symbols <= MAX_SYMBOLS_PER_STEP:
        # the decode runs up to frames x (max_symbols + 1) steps: past the bound a stuck model hangs
        raise ValueError(f"max_symbols must be from 1 to {MAX_SYMBOLS_PER_STEP}, got {max_symbols}")
    cfg, ops = model.cfg, model.ops
    dev = enc_proj.device
    B = enc_proj.shape[0]
    fresh = model.initial_state(1)
    h = torch.cat([(s.h if s else fresh[0]) for s in states], dim=1)
    c = torch.cat([(s.c if s else fresh[1]) for s in states], dim=1)
    pred = torch.cat([(s.pred if s else fresh[2]) for s in states])
    V = cfg.vocab_size
    dur_table = torch.tensor(cfg.durations, dtype=torch.long, device=dev)
    T = torch.tensor(lengths, dtype=torch.long, device=dev)
    # A step either moves t on or emits a zero-duration token; the guard bounds those per frame.
    # Alone, a row runs whole blocks until its limit: the same cap keeps it in step here.
    limits = [n * ((max_symbols or 10 * n) + 1) for n in lengths]
    caps = torch.tensor([-(-lim // block) * block for lim in limits], dtype=torch.long, device=dev)
    rows = torch.arange(B, device=dev)
    t = torch.zeros(B, dtype=torch.long, device=dev)
    run = torch.zeros(B, dtype=torch.long, device=dev)
    nan = torch.zeros(B, dtype=torch.bool, device=dev)   # an active row's joint gave NaN
    one = torch.ones(B, dtype=torch.long, device=dev)
    zero = torch.zeros(B, dtype=torch.long, device=dev)
    last = (T - 1).clamp(min=0)
    records: list[torch.Tensor] = []
    steps = 0
    while steps < max(limits, default=0):
        for i in range(block):
            active = (t < T) & (caps > steps + i)
            logits = model.joint(enc_proj[rows, torch.minimum(t, last)], pred)
            nan |= active & torch.isnan(logits).any(-1)
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
        if bool(((t >= T) | (caps <= steps)).all()):   # the one host read per block
            break
    if bool(nan.any()):   # (read once: the rows it poisoned decoded on to their caps, never shown)
        raise NonFiniteLogits("the model's joint logits hold NaN: no token can be chosen; the request is refused")
    table = torch.stack(records, dim=1).cpu() if records else torch.zeros(B, 0, 4, dtype=torch.long)
    out = []
    for b in range(B):
        mine = table[b][table[b, :, 3] == 1]
        out.append((TdtSteps(mine[:, 0].tolist(), mine[:, 1].tolist(), mine[:, 2].tolist()),
                    DecoderState(h[:, b:b + 1], c[:, b:b + 1], pred[b:b + 1])))
    return out
