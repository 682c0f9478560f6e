"""Several skill requests decoded together: one batched forward per step instead of one per request.

Serving several cameras (or several targets per frame) means many detect/point/caption/query
requests at once. Run one after another, each decode step reads every weight once per request;
batched, one step reads the weights once for all of them, which is what makes batch 1-8 nearly as
cheap as batch 1 on a GPU. A single detect/point call is a batch of one. Each request keeps its
own protocol (skills.py's prompts, masks and stopping rules); only the forward pass is shared.

The object protocol (detect, point): at an object boundary the LM head only decides *whether*
another object follows (coord or eos); the coordinates and sizes come from the region heads reading
the same last hidden state, and are fed back as the next input embedding: 3 decode steps per box
(x, y, size), 2 per point. Inside an object the tokens are fixed, so the LM head is skipped there.
Each object's "score" is the probability the LM head gave to `coord` at its boundary
(object_score.py), read from the same logits on every stepper.

    images -> model.encode_images (distinct images once, together)
    each request: its image's K/V copied into its row of one batch cache, its prompt prefilled
    loop: every live row feeds one input embedding at its own position (text.forward with per-row
          positions); rows then read what their protocol needs from the new hidden states:
          LM logits (next token, or coord-vs-eos at an object boundary), a coordinate, or a size.
    finished rows leave the batch (the cache is compacted) so later steps stop paying for them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from photon_core.runtime.requests import Request
from photon_core.runtime.sampling import Sampling, pick
from photon_core.runtime.text_stream import text_pieces

from . import object_score, skills, text

if TYPE_CHECKING:
    from .model import EncodedImage, MoondreamModel

TASKS = ("detect", "point", "caption", "query")

# What a row reads from the hidden state its last input produced.
BOUNDARY, COORD_Y, SIZE, TOKEN = "boundary", "y", "size", "token"


@dataclass
class _Row:
    request: Request
    prompt: list[int]
    length: int                          # this request's context limit (as in the one-request path)
    pos: int
    phase: str
    objects: list[dict] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    x: float = 0.0
    y: float = 0.0
    score: float = 0.0                   # the object in progress: P(coord) at its boundary
    done: bool = False
    reported: int = 0                    # objects or tokens the caller's progress has heard of
    sampling: Sampling | None = None     # how a caption/query row picks its tokens (None: detect/point)

    @property
    def steps(self) -> int:
        return _steps_per_object(self.request.task)

    @property
    def is_object(self) -> bool:          # detect/point, not caption/query
        return self.request.task in ("detect", "point")


def _steps_per_object(task: str) -> int:
    return 3 if task == "detect" else 2


def _prompt(model: "MoondreamModel", r: Request) -> list[int]:
    if r.task in ("detect", "point"):
        if r.max_objects < 0:
            raise ValueError("max_objects must be >= 0")
        return skills.object_prompt(model, r.task, r.prompt)
    if r.task == "caption":
        return skills.caption_prompt(model, r.prompt or "normal")
    if r.task == "query":
        return skills.query_prompt(model, r.prompt)
    raise ValueError(f"unknown task {r.task!r}; one of {', '.join(TASKS)}")


def _sampling(r: Request) -> Sampling | None:
    """A caption/query request's Sampling (ValueError for a setting out of range); None for detect/point."""
    return None if r.task in ("detect", "point") else Sampling(r.max_tokens, r.temperature, r.top_p)


def _new_row(model: "MoondreamModel", r: Request, prompt: list[int], enc: "EncodedImage",
             sampling: Sampling | None) -> _Row:
    skills.check_prompt(model, enc, prompt)
    limit = model.config.text.max_context
    if r.task in ("detect", "point"):
        need = _steps_per_object(r.task) * r.max_objects
        return _Row(r, prompt, min(limit, enc.pos + len(prompt) + need), enc.pos, BOUNDARY)
    return _Row(r, prompt, min(limit, enc.pos + len(prompt) + r.max_tokens), enc.pos, TOKEN, sampling=sampling)


def run(model: "MoondreamModel", requests: list[Request], decode: Any = None) -> list[dict]:
    """Results of `requests`, each shaped as the matching single call returns it (text not
    streamed). A request that is invalid (empty object, unknown task...) raises ValueError before
    any image is encoded (one whose prompt does not fit the context, before any decoding).
    `decode(rows, encoded)` decodes the rows (default: _decode with OpsStepper, the model's own ops;
    megakernel_decode passes its own, on megakernel steps)."""
    if not requests:
        return []
    samplings, prompts = [], []
    for r in requests:   # every request checked before any image is encoded
        samplings.append(_sampling(r))
        prompts.append(_prompt(model, r))
    encoded = _encode_distinct(model, [r.image for r in requests])
    rows = [_new_row(model, r, p, enc, s) for r, p, enc, s in zip(requests, prompts, encoded, samplings)]
    with torch.inference_mode():
        if decode is None:
            _decode(model, rows, encoded, OpsStepper(model))
        else:
            decode(rows, encoded)
    return [_result(model, row) for row in rows]


def _encode_distinct(model: "MoondreamModel", images: list) -> list["EncodedImage"]:
    """Every request's EncodedImage; each distinct raw image (by identity) is encoded once, and all
    of them in one batch."""
    from .model import EncodedImage

    raw: dict[int, Any] = {}
    for image in images:
        if isinstance(image, EncodedImage):
            model._check_owner(image)
        else:
            raw.setdefault(id(image), image)
    done = dict(zip(raw, model.encode_images(list(raw.values()))))
    return [image if isinstance(image, EncodedImage) else done[id(image)] for image in images]


def _decode(model: "MoondreamModel", rows: list[_Row], encoded: list["EncodedImage"], stepper: Any) -> None:
    answer = skills.answer_mask(model)       # for sampled answers; built once, not per token
    heads = stepper.start(rows, encoded)
    for row in rows:
        row.pos += len(row.prompt)
    live = list(rows)
    nxt = _advance(model, live, heads, answer)
    while True:
        watch(model, live)
        keep = [i for i, row in enumerate(live) if not row.done]
        if not keep:
            return
        if len(keep) < len(live):
            stepper.keep(keep)
            live, nxt = [live[i] for i in keep], nxt[keep]
        heads = stepper.step(nxt, [row.pos for row in live])
        for row in live:
            row.pos += 1
        nxt = _advance(model, live, heads, answer)


def watch(model: "MoondreamModel", rows: list[_Row]) -> None:
    """Between steps: a canceled request's row is done (the next keep drops it from the batch,
    freeing its slot; its result is what it has so far), and each row whose result grew (an
    object found, a token more) tells its caller (Request.progress)."""
    for row in rows:
        if row.request.canceled:
            row.done = True
        grown = len(row.objects) if row.is_object else len(row.tokens)
        if row.request.progress is not None and grown > row.reported:
            row.reported = grown
            row.request.progress(_result(model, row))


def _advance(model: "MoondreamModel", rows: list[_Row], heads: Any, answer: torch.Tensor,
             embed: bool = True) -> torch.Tensor | None:
    """Each row reads what its phase needs from the step's heads and gets its next input
    embedding; rows that finish are marked done (their embedding row is a placeholder). Every head
    is asked once, for all the rows that need it. Returns the next inputs [rows, 1, dim] (None
    without `embed`: the device feeds them, object_rounds.py)."""
    ops, rw, tk = model.ops, model.region_w, model.config.tokenizer
    nxt = torch.zeros(len(rows), 1, model.config.text.dim, dtype=model.dtype, device=model.device) if embed else None
    asks = [i for i, r in enumerate(rows) if r.phase in (BOUNDARY, TOKEN)]
    greedy = dict(zip(asks, heads.tokens(asks))) if asks else {}

    coord_rows, tokens, starts = [], {}, []
    for i, row in enumerate(rows):
        if row.phase == BOUNDARY:
            if (len(row.objects) >= row.request.max_objects or row.pos + row.steps > row.length
                    or greedy[i] != tk.coord_id):
                row.done = True
            else:
                coord_rows.append(i)          # x from this same hidden state
                starts.append(i)
        elif row.phase == COORD_Y:
            coord_rows.append(i)
        elif row.phase == TOKEN:
            tok = _answer_token(model, row, greedy[i], lambda i=i: heads.logits(i), answer)
            if tok is not None:
                row.tokens.append(tok)
            if tok is None or len(row.tokens) >= row.request.max_tokens or row.pos >= row.length:
                row.done = True
            else:
                tokens[i] = tok

    if starts:
        for i, p in zip(starts, heads.boundary_scores(starts)):
            rows[i].score = p
    size_rows = [i for i, r in enumerate(rows) if r.phase == SIZE]
    if coord_rows:
        values = heads.coords(coord_rows)
        for i, v in zip(coord_rows, values):
            row = rows[i]
            if row.phase == BOUNDARY:
                row.x, row.phase = v, COORD_Y
            else:
                row.y = v
                if row.request.task == "point":
                    row.objects.append({"x": _clamp(row.x), "y": _clamp(v), "score": row.score})
                    row.phase = BOUNDARY
                else:
                    row.phase = SIZE
        if embed:
            nxt[coord_rows] = model.region_impl.encode_coords(values, rw, ops)
    if size_rows:
        sizes = heads.sizes(size_rows)
        for i, (w, h) in zip(size_rows, sizes):
            row = rows[i]
            # The reference leaves boxes unclamped; ours are clamped to the image.
            row.objects.append({"x_min": _clamp(row.x - w / 2), "y_min": _clamp(row.y - h / 2),
                                "x_max": _clamp(row.x + w / 2), "y_max": _clamp(row.y + h / 2),
                                "score": row.score})
            row.phase = BOUNDARY
        if embed:
            nxt[size_rows] = model.region_impl.encode_sizes(sizes, rw, ops)
    if tokens and embed:
        ids = torch.tensor([[t] for t in tokens.values()], device=model.device)
        nxt[list(tokens)] = model.text_impl.embed(ids, model.text_w)
    return nxt


def _answer_token(model: "MoondreamModel", row: _Row, greedy: int, logits, allowed: torch.Tensor) -> int | None:
    """The next answer token (the greedy one, or sampled from logits() over `allowed`), or None
    when the answer ends (eos, or max_tokens == 0)."""
    s = row.sampling
    assert s is not None, "an answer row gets its Sampling from _new_row"
    if s.max_tokens == 0:
        return None
    tok = greedy
    if not s.greedy:
        tok = pick(logits(), s, model.ops, allowed)
    return None if tok == model.config.tokenizer.eos_id else tok


class OpsStepper:
    """Forward passes on the model's ops module: each prompt prefilled in its own row of one batch
    KV cache (prompts differ in length), then one text.forward per step for every live row at its
    own position. Finished rows are dropped from the cache."""

    def __init__(self, model: "MoondreamModel") -> None:
        self.model = model
        self.cache: text.KVCache | None = None
        self.masks: torch.Tensor | None = None

    def start(self, rows: list[_Row], encoded: list["EncodedImage"]) -> "OpsHeads":
        m = self.model
        self.cache = m.text_impl.KVCache(m.config.text, max(r.length for r in rows), m.dtype, m.device, batch=len(rows))
        boundary, answer = skills.boundary_mask(m), skills.answer_mask(m)
        self.masks = torch.stack([boundary if r.is_object else answer for r in rows])
        hidden = []
        for b, (row, enc) in enumerate(zip(rows, encoded)):
            self.cache.k[:, b:b + 1, :, :enc.pos] = enc.k
            self.cache.v[:, b:b + 1, :, :enc.pos] = enc.v
            emb = m.text_impl.embed(torch.tensor([row.prompt], device=m.device), m.text_w)
            hidden.append(m.text_impl.forward(emb, row.pos, m.text_w, m.config.text, self.cache.row(b), m.ops)[:, -1])
        return OpsHeads(m, torch.cat(hidden), self.masks)

    def step(self, inputs: torch.Tensor, positions: list[int]) -> "OpsHeads":
        m = self.model
        pos = torch.tensor(positions, device=m.device)
        hidden = m.text_impl.forward(inputs, pos, m.text_w, m.config.text, self.cache, m.ops)[:, -1]
        return OpsHeads(m, hidden, self.masks)

    def keep(self, rows: list[int]) -> None:
        self.cache.keep(rows)
        self.masks = self.masks[rows]


class OpsHeads:
    """What one step's hidden states [rows, dim] (before post_ln) say, each head run once for the
    rows that ask: the masked greedy token, the logits, an object's score, a coordinate, a size."""

    def __init__(self, model: "MoondreamModel", hidden: torch.Tensor, masks: torch.Tensor) -> None:
        self.model, self.hidden, self.masks = model, hidden, masks
        self._logits: dict[int, torch.Tensor] = {}

    def tokens(self, rows: list[int]) -> list[int]:
        m = self.model
        logits = m.text_impl.lm_logits(self.hidden[rows], m.text_w, m.ops)
        self._logits = dict(zip(rows, logits))
        return m.ops.argmax(logits, self.masks[rows]).tolist()

    def logits(self, row: int) -> torch.Tensor:
        return self._logits[row]

    def boundary_scores(self, rows: list[int]) -> list[float]:
        """P(coord) at the boundaries of `rows` (object_score), from the logits tokens() made."""
        tk = self.model.config.tokenizer
        logits = torch.stack([self._logits[i] for i in rows])
        return object_score.continue_probability(logits, tk.coord_id, tk.eos_id).tolist()

    def coords(self, rows: list[int]) -> list[float]:
        return self.model.region_impl.decode_coords(self.hidden[rows], self.model.region_w, self.model.ops)

    def sizes(self, rows: list[int]) -> list[tuple[float, float]]:
        return self.model.region_impl.decode_sizes(self.hidden[rows], self.model.region_w, self.model.ops)


def _clamp(v: float) -> float:
    return min(max(v, 0.0), 1.0)


def _result(model: "MoondreamModel", row: _Row) -> dict:
    task = row.request.task
    if task == "detect":
        return {"objects": row.objects}
    if task == "point":
        return {"points": row.objects}
    answer = "".join(text_pieces(model.tokenizer.decode, row.tokens))
    return {"caption": answer} if task == "caption" else {"answer": answer}
