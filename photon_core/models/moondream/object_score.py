"""The confidence of each detected box or point: the model's own probability that the list goes on.

Moondream emits objects as a list: at every object boundary the LM head chooses between `coord`
(another object follows; its x is read from this same hidden state) and `eos` (the list ends),
and only then do the region heads give the object's coordinates and size as argmax bins. The score
of an object is the probability the model gave to continuing the list at that object's boundary,

    score = P(coord | boundary) = softmax over {coord, eos} of the LM logits = sigmoid(l_coord - l_eos)

i.e. the model's own belief that there is one more such object, given the prompt, the image and
the objects before it. The softmax is over the two tokens the protocol allows there (the boundary
mask), so the score is a probability in [0, 1] whatever mass a model puts on tokens it may not
emit at a boundary. Greedy decoding continues only where coord's logit is the larger, so every
object it returns scores at least 0.5; the list's last decision (the `eos` that ended it, or the
object budget) scores no object.

The coordinate and size bins' own softmax is not folded in: it measures how sharply a position is
pinned at the bins' 1/1024 resolution, not whether the object is there. A well-placed object whose
probability spreads over neighbouring bins would score near zero, and a product with it would
scale with the number of bins instead of meaning anything a planner can threshold.

Every decode path computes it with `continue_probability` on the logits it already has (the
reference and per-op Triton paths' LM logits, the megakernel's biased logits: the boundary bias is
0 on both tokens, so their difference is the same), in float32; device rounds record it per step as
the float32's bits in an int32 column (`to_bits`, `from_bits`) beside the token and bins.
"""
from __future__ import annotations

import struct

import torch


def continue_probability(logits: torch.Tensor, coord_id: int, eos_id: int) -> torch.Tensor:
    """logits [..., vocab] at object boundaries -> P(coord) among {coord, eos} [...], float32.

    Integer indexing only (no index tensor made on the host), so a CUDA graph can capture it."""
    return torch.sigmoid(logits[..., coord_id].float() - logits[..., eos_id].float())


def to_bits(p: torch.Tensor) -> torch.Tensor:
    """float32 scores [n] -> their bits as int32 [n] (a column of the device rounds' int32 records)."""
    return p.to(torch.float32).contiguous().view(torch.int32)


def from_bits(bits: int) -> float:
    """One recorded int32 (as the host reads it: a Python int) -> the float32 score it holds."""
    return struct.unpack("<f", struct.pack("<i", bits))[0]
