"""batch.py's decode protocol on the megakernel with the steps after the first in rounds on the device.

Host-driven (megakernel_decode.MegakernelStepper), every step ends in a read: the host learns each
row's token and bins, runs the protocol (batch.BatchSession.choose) and writes the next input embeddings.
Here the protocol's input side runs on the device. Each row's phase is a device value:

    phase 0  boundary   the token says whether another object follows (`coord`: the x comes from
                        this same launch) or not; next input: the encoded x, else the token's embedding
    phase 1  y          next input: the encoded y; then the size (detect) or the next boundary (point)
    phase 2  size       next input: the encoded (width, height); then the next boundary
    phase 3  answer     next input: the token's embedding (caption/query rows of a mixed batch); a
                        coord or size token's encoded value where the model feeds them so (Moondream 3)

After each launch device ops choose that input from the launch's results (token, coordinate bin,
width and height bins) and advance the phase; the results are recorded per step (decode_loop), and
the host reads a round of them at once and runs the protocol (BatchSession._read and choose) on
each step's record, as on the heads of a host-driven step; runtime.generate drives it
(RoundsSession.rounds). Each record also carries the step's object score (P(coord)
among {coord, eos} of the launch's logits, object_score.py) as its float32 bits in a fifth int32
column: computed on the device by the host-driven heads' own function, and read in the round's
one read, where a separate float history would cost a second. The encoders get the values the
host's heads would give them (tables of bin / divisor and of the size rule, computed by the host's
own arithmetic); they encode all rows at once, so their matmuls round as a batch of B rows does (a
host-driven step encodes the rows that need it: the last bit can differ, as it does between a
request alone and in a batch). The objects and text are the host-driven path's (bins are argmaxes;
the tests compare them exactly); the scores agree to float rounding.

A round runs to the next decision point of the object rows: a row inside an object needs its
remaining steps for sure, and only a boundary step can end it. The first round after the prompt
finishes the first object; later ones expect as many more objects as the row has found (rounds of
3, 6, 12, ... steps for detect), so a one-object detect costs two reads (the prompt's and one
round) and no wasted step, and n objects about log2(n) reads. A row that ended mid-round decodes on
to the round's end on the device; those records are ignored (its slot is its own).
Greedy answers only: a sampled caption/query in a batch needs logits, so such a batch stays
host-driven. The rounds run the whole step graph, so a batch of captions alone streams the region
heads' weights too (their results unused), which the host-driven text graph skips; one request's
caption or query has its own rounds on the text graph (megakernel_decode.generate_text), except
Moondream 3's, whose answers need the region heads (batch._fed_as_region): they decode here.
"""
from __future__ import annotations

from collections.abc import Collection, Iterator
from typing import TYPE_CHECKING

import torch

from photon_core.megakernel.decode_loop import DeviceDecode
from photon_core.runtime.sampling import NonFiniteLogits, step_argmax

from . import batch as batch_decoding
from . import object_score
from .batch import BOUNDARY, COORD_Y, SIZE, TOKEN

if TYPE_CHECKING:
    from .batch import _Row
    from .decoder_step import MoondreamDecoderMegakernel
    from .megakernel_decode import MegakernelDecode
    from .model import EncodedImage

PHASE = {BOUNDARY: 0, COORD_Y: 1, SIZE: 2, TOKEN: 3}
CHUNK = 16   # the most steps per round: five objects of a detect


class ObjectRounds:
    """The device side for one batch bucket: phases, the input choice, the recorded results."""

    @torch.inference_mode(False)   # ordinary buffers, whichever mode builds them (CompiledStep's)
    def __init__(self, fm: "MegakernelDecode", mk: "MoondreamDecoderMegakernel",
                 cuda_graphs: bool | None = None) -> None:
        """fm: the MegakernelDecode (its model's encoders, embeddings and ops, and config);
        cuda_graphs: capture the rounds (default: on CUDA)."""
        from .megakernel_decode import size_values
        m = fm.model
        B, dev = mk.batch, mk.out.device
        self.fm, self.mk = fm, mk
        self.phase = torch.full((B,), PHASE[TOKEN], dtype=torch.int32, device=dev)
        self.detect = torch.zeros(B, dtype=torch.bool, device=dev)
        self.n_bins = m.region_impl.coord_divisor(fm.config.region.coord_out_dim)   # the model's rule
        rw, cols = m.region_w, mk.graph_def.results
        # The values the host-driven heads hand the encoders: bin / n_bins (in double, then the
        # encoder's dtype) and size_values' float32 rule.
        self.coord_table = torch.tensor([b / self.n_bins for b in range(mk.dm.coord_bins)],
                                        dtype=rw.coord_features.dtype, device=dev)
        self.size_table = torch.tensor([size_values((b, b))[0] for b in range(mk.dm.size_bins // 2)],
                                       dtype=rw.size_features.dtype, device=dev)
        # A device index: a Python list would be copied to the GPU in every pick, which a CUDA
        # graph's capture forbids.
        order = torch.tensor([cols.index(c) for c in ("token", "coord", "width", "height")], device=dev)
        out = mk.out.view(B, len(cols))
        logits, tk = mk.logits, fm.config.tokenizer

        def pick() -> torch.Tensor:
            score = object_score.continue_probability(logits, tk.coord_id, tk.eos_id)
            return torch.cat([out.index_select(1, order), object_score.to_bits(score)[:, None]], dim=1)
        self.loop = DeviceDecode(mk, pick=pick, feed=self._feed, width=5, chunk=CHUNK, cuda_graphs=cuda_graphs)

    def _feed(self, rec: torch.Tensor) -> None:
        """The next input of every row and its next phase, from this launch's results (device ops):
        rec [B, 4 or more], its columns token, coordinate bin, width bin, height bin (then the score)."""
        m, fm = self.fm.model, self.fm
        tok, coord, width, height = rec[:, :4].long().unbind(1)
        ph, tk = self.phase, fm.config.tokenizer
        starts = (ph == 0) & (tok == tk.coord_id)
        coord_in, size_in = starts | (ph == 1), ph == 2
        if m.spatial_tokens_fed:   # an answer's coord/size token: this launch's value (batch._fed_as_region)
            coord_in = coord_in | ((ph == 3) & (tok == tk.coord_id))
            size_in = size_in | ((ph == 3) & (tok == tk.size_id))
        coord_in, size_in = coord_in[:, None, None], size_in[:, None, None]
        e_coord = m.region_impl.encode_coord_tensor(self.coord_table[coord.clamp(min=0)], m.region_w, m.ops)
        sizes = torch.stack([self.size_table[width.clamp(min=0)], self.size_table[height.clamp(min=0)]], dim=1)
        e_size = m.region_impl.encode_size_tensor(sizes, m.region_w, m.ops)
        e_tok = m.text_impl.embed(tok.clamp(min=0)[:, None], m.text_w)
        emb = torch.where(coord_in, e_coord.to(e_tok.dtype), torch.where(size_in, e_size.to(e_tok.dtype), e_tok))
        self.mk.view("x").copy_(emb.reshape(self.mk.batch, -1))
        after_y = torch.where(self.detect, 2, 0).to(ph.dtype)
        ph.copy_(torch.where(starts, 1, torch.where(ph == 1, after_y, torch.where(ph == 2, 0, ph))))

    def begin(self, rows: list["_Row"], nxt: torch.Tensor) -> None:
        """The device state of the host's after the first (prompt) step: each slot's next input,
        position and phase (slot = row index; idle slots, and rows the prompt step finished, whose
        position may be past the caches, decode answers at position 0)."""
        B = self.mk.batch
        emb = torch.zeros(B, self.fm.config.text.dim, device=self.mk.out.device)
        emb[:len(rows)] = nxt.reshape(len(rows), -1).to(emb.dtype)
        self.mk.set_step(None, [0 if r.done else r.pos for r in rows] + [0] * (B - len(rows)))
        self.mk.view("x").copy_(emb)
        self.phase.copy_(torch.tensor([PHASE[r.phase] for r in rows] + [PHASE[TOKEN]] * (B - len(rows))))
        self.detect.copy_(torch.tensor([r.request.task == "detect" for r in rows] + [False] * (B - len(rows))))


class RecordedHeads:
    """One recorded step's results (token, coordinate bin, size bins, score bits), answering
    BatchSession._read as a host-driven step's heads do."""

    def __init__(self, records: list[list[int]], slots: list[int], n_bins: int) -> None:
        self.records, self.slots, self.n_bins = records, slots, n_bins

    def tokens(self, rows: list[int]) -> list[int]:
        return [step_argmax(self.records[self.slots[i]][0]) for i in rows]

    def boundary_scores(self, rows: list[int]) -> list[float]:
        return [object_score.from_bits(self.records[self.slots[i]][4]) for i in rows]

    def coords(self, rows: list[int]) -> list[float]:
        return [step_argmax(self.records[self.slots[i]][1], "coordinate logits") / self.n_bins for i in rows]

    def sizes(self, rows: list[int]) -> list[tuple[float, float]]:
        # Checked as the host-driven heads check theirs: a negative bin is the step's mark that the
        # size logits held NaN, which size_values would turn into a box ~0.001 wide.
        from .megakernel_decode import _checked_sizes, size_values
        return [size_values(_checked_sizes((self.records[self.slots[i]][2], self.records[self.slots[i]][3])))
                for i in rows]

    def logits(self, row: int) -> torch.Tensor:
        raise RuntimeError("rounds decode greedy answers only; a sampled one is host-driven")

    def hidden_of(self, rows: list[int]) -> torch.Tensor:
        raise RuntimeError("rounds decode greedy rows only; a sampled one's region values are drawn host-driven")


def round_size(rows: list["_Row"], live: list[int]) -> int:
    """Steps of the next round: each object row through its next boundary plus as many objects as
    it has found (within its max_objects), each answer row its tokens left; the most of them."""
    want = 1
    for s in live:
        r = rows[s]
        if r.phase == TOKEN:
            w = r.opts.max_tokens - len(r.tokens)
        else:
            in_object = r.phase in (COORD_Y, SIZE)
            to_boundary = {BOUNDARY: 1, COORD_Y: r.steps, SIZE: 2}[r.phase]
            more = min(len(r.objects), r.opts.max_objects - len(r.objects) - in_object)
            w = to_boundary + r.steps * max(more, 0)
        want = max(want, w)
    return min(CHUNK, want)


def greedy(rows: list["_Row"]) -> bool:
    """Whether rounds can decode these rows (no sampled row, no reasoning: its coordinates are
    fed back host-driven)."""
    return all((r.sampling.greedy if r.sampling is not None else r.is_object) and not r.request.reasoning
               for r in rows)


class RoundsSession(batch_decoding.BatchSession):
    """batch.BatchSession on megakernel steps whose greedy rows decode in rounds on the device
    after the prompt's (host-driven) step: runtime.generate's device rounds."""

    def __init__(self, fm: "MegakernelDecode", rows: list["_Row"], encoded: list["EncodedImage"]) -> None:
        from .megakernel_decode import MegakernelStepper
        super().__init__(fm.model, rows, encoded, MegakernelStepper(fm))
        self.fm = fm

    def rounds(self, first: list[int], max_new: list[int], stop: Collection[int]) -> Iterator[tuple[int, int]]:
        """(row, token) of each row from its first token (chosen from the prompt's step) on, the
        steps after it in rounds: the device feeds each step's inputs, the host reads a round of
        records and runs choose() on each step's (a canceled row stops within the round)."""
        rows, n = self.rows, len(self.rows)
        count = [0] * n
        for s, tok in enumerate(first):
            if tok in stop or max_new[s] == 0:
                rows[s].done = True
            else:
                yield s, tok
                count[s] = 1
                rows[s].done = count[s] >= max_new[s]
        live = [s for s in range(n) if not rows[s].done]
        if not live:
            return
        dev = self.fm.object_rounds(self.stepper.mk)
        dev.begin(rows, self.inputs(rows, first))
        full = [False] * n
        while live:
            records, round_full = dev.loop.run_round(round_size(rows, live))
            for rec, step_full in zip(records, round_full):
                for s in live:
                    if full[s]:   # the last step re-ran the row's last position
                        raise RuntimeError(f"a {rows[s].request.task} request reached the end of the megakernel's "
                                           f"context ({self.stepper.mk.max_len} positions)")
                    if step_full[s] == 2:    # decode_loop's non-finite mark: no token to choose
                        raise NonFiniteLogits(f"row {s}: the model's logits held NaN: the request is refused")
                    full[s] = bool(step_full[s])
                    rows[s].pos += 1
                _, greedy = self._read(RecordedHeads(rec, live, dev.n_bins), [rows[s] for s in live])
                for s, g in zip(live, greedy):
                    if rows[s].request.canceled:
                        rows[s].done = True
                        continue
                    tok = self.choose(s, _NO_LOGITS, g)
                    if tok in stop:
                        continue
                    yield s, tok
                    count[s] += 1
                    rows[s].done = count[s] >= max_new[s]
                live = [s for s in live if not rows[s].done]
                if not live:
                    break


_NO_LOGITS = torch.zeros(0)   # rounds decode greedy rows: choose() never samples there
