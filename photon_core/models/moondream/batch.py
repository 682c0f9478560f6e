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

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, overload

import torch

from photon_core.runtime.requests import Request, Settings, SpatialRef, check_spatial_refs
from photon_core.runtime.sampling import Sampling, pick
from photon_core.runtime.text_stream import text_pieces

from . import object_score, skills, text

if TYPE_CHECKING:
    from .model import EncodedImage, MoondreamModel

TASKS = ("detect", "point", "caption", "query")

# What a row reads from the hidden state its last input produced.
BOUNDARY, COORD_Y, SIZE, TOKEN, THINK = "boundary", "y", "size", "token", "think"


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
    opts: Settings = None  # type: ignore[assignment]  # (None: the request's own, __post_init__)
    refs: list[SpatialRef] = field(default_factory=list)
    think: list[int] = field(default_factory=list)       # a reasoning query's reasoning tokens
    think_coords: list[float] = field(default_factory=list)  # the coordinates at its coord tokens
    remask: torch.Tensor | None = None   # the tokens it may pick from its next step on, when they change

    def __post_init__(self) -> None:
        if self.opts is None:
            self.opts = self.request.options()

    @property
    def steps(self) -> int:
        return _steps_per_object(self.request.task)

    @property
    def is_object(self) -> bool:          # detect/point, not caption/query
        return self.request.task in ("detect", "point")


def _steps_per_object(task: str) -> int:
    return 3 if task == "detect" else 2


def _prompt(model: "MoondreamModel", r: Request, opts: Settings) -> tuple[list[int], list[SpatialRef]]:
    """The request's prompt ids and its spatial references (checked)."""
    refs = check_spatial_refs(r.spatial_refs)
    if refs and r.task not in ("query", "point"):
        raise ValueError(f"spatial_refs are taken by query and point, not {r.task}")
    if refs and r.image is None:
        raise ValueError("spatial_refs can only be used with an image")
    if r.reasoning and r.task != "query":
        raise ValueError(f"reasoning is a query setting, not {r.task}'s")
    if r.image is None and r.task != "query":
        raise ValueError(f"{r.task} needs an image (only query takes image=None: a text-only question)")
    if r.task in ("detect", "point"):
        return skills.object_prompt(model, r.task, r.prompt, refs), refs
    if r.task == "caption":
        return skills.caption_prompt(model, r.prompt or "normal"), refs
    if r.task == "query":
        return skills.query_prompt(model, r.prompt, refs, r.reasoning, text_only=r.image is None), refs
    raise ValueError(f"unknown task {r.task!r}; one of {', '.join(TASKS)}")


def _sampling(r: Request, opts: Settings) -> Sampling | None:
    """A caption/query request's Sampling; None for detect/point (which decode greedily, as the
    reference's do: their temperature and top_p are not used)."""
    return None if r.task in ("detect", "point") else opts.sampling()


def _new_row(model: "MoondreamModel", r: Request, prompt: list[int], enc: "EncodedImage",
             sampling: Sampling | None, opts: Settings, refs: list[SpatialRef]) -> _Row:
    skills.check_prompt(model, enc, prompt)
    limit = model.config.text.max_context
    if r.task in ("detect", "point"):
        need = _steps_per_object(r.task) * opts.max_objects
        return _Row(r, prompt, min(limit, enc.pos + len(prompt) + need), enc.pos, BOUNDARY, opts=opts, refs=refs)
    # reasoning: its tokens, the answer marker, then the answer's
    need = 2 * opts.max_tokens + 1 if r.reasoning else opts.max_tokens
    return _Row(r, prompt, min(limit, enc.pos + len(prompt) + need), enc.pos, THINK if r.reasoning else TOKEN,
                sampling=sampling, opts=opts, refs=refs)


def prepare(model: "MoondreamModel", requests: list[Request]) -> tuple[list[_Row], list["EncodedImage"]]:
    """The requests' rows, their images encoded (each distinct one once). Every request is checked
    (ValueError/TypeError with the reason) before any image is encoded; all of them must ask for
    the same variant (run groups them)."""
    checked = []
    for r in requests:   # every request checked before any image is encoded
        opts = r.options()
        checked.append((opts, _sampling(r, opts), *_prompt(model, r, opts)))
    variants = {opts.variant for opts, *_ in checked}
    if len(variants) > 1:
        raise ValueError(f"one decode serves one variant; these requests ask for {sorted(map(str, variants))}")
    lora = skills.variant(model, variants.pop()) if variants else None
    encoded = _encode_distinct(model, [r.image for r in requests], lora)
    return [_new_row(model, r, p, enc, s, opts, refs)
            for r, (opts, s, p, refs), enc in zip(requests, checked, encoded)], encoded


def run(model: "MoondreamModel", requests: list[Request], decode: Any = None) -> list[dict]:
    """Results of `requests`, each shaped as the matching single call returns it (text not
    streamed). A request that is invalid (empty object, unknown task...) raises ValueError before
    any image is encoded (one whose prompt does not fit the context, before any decoding).
    Requests with different settings["variant"] decode in one batch per variant (each variant's
    adapter applies to its rows' whole sequence, image prefill included).
    `decode(rows, encoded)` decodes the rows (default: _decode with OpsStepper, the model's own ops;
    megakernel_decode passes its own, on megakernel steps)."""
    if not requests:
        return []
    groups: dict[str | None, list[int]] = {}
    for i, r in enumerate(requests):
        groups.setdefault(r.options().variant, []).append(i)
    if len(groups) > 1:
        results: list[dict] = [{}] * len(requests)
        for idx in groups.values():
            for i, res in zip(idx, run(model, [requests[i] for i in idx], decode)):
                results[i] = res
        return results
    rows, encoded = prepare(model, requests)
    with torch.inference_mode():
        if decode is None:
            for _ in _decode(model, rows, encoded, OpsStepper(model, skills.variant(model, rows[0].opts.variant))):
                pass
        else:
            decode(rows, encoded)
    return [_result(model, row) for row in rows]


def _encode_distinct(model: "MoondreamModel", images: list, lora: Any = None) -> list["EncodedImage"]:
    """Every request's EncodedImage; each distinct raw image (by identity) is encoded once, and all
    of them in one batch (with the variant's adapter); None (a text-only query): the empty prefix."""
    from .model import EncodedImage

    raw: dict[int, Any] = {}
    for image in images:
        if isinstance(image, EncodedImage):
            model._check_owner(image)
        elif image is not None:
            raw.setdefault(id(image), image)
    done = dict(zip(raw, model.encode_images(list(raw.values()), lora=lora)))
    return [image if isinstance(image, EncodedImage) else model.empty_prefix() if image is None else done[id(image)]
            for image in images]


def _decode(model: "MoondreamModel", rows: list[_Row], encoded: list["EncodedImage"],
            stepper: Any) -> Iterator[None]:
    """Decodes the rows, yielding after each step (stream() reads a row's text as it grows)."""
    answer = skills.answer_mask(model)       # for sampled answers; built once, not per token
    think = skills.reasoning_mask(model)
    heads = stepper.start(rows, encoded)
    for row in rows:
        row.pos += len(row.prompt)
    live = list(rows)
    nxt = _advance(model, live, heads, answer, think=think)
    while True:
        _remask(stepper, live)
        watch(model, live)
        yield None
        keep = [i for i, row in enumerate(live) if not row.done]
        if not keep:
            return
        if len(keep) < len(live):
            stepper.keep(keep)
            live, nxt = [live[i] for i in keep], nxt[keep]
        heads = stepper.step(nxt, [row.pos for row in live])
        for row in live:
            row.pos += 1
        nxt = _advance(model, live, heads, answer, think=think)


def _remask(stepper: Any, live: list[_Row]) -> None:
    """Rows whose allowed tokens change (a reasoning after its first token, an answer after its
    reasoning) pick under their new mask from the next step on."""
    for i, row in enumerate(live):
        if row.remask is not None:
            stepper.set_mask(i, row.remask)
            row.remask = None


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


@overload
def _advance(model: "MoondreamModel", rows: list[_Row], heads: Any, answer: torch.Tensor,
             embed: Literal[True] = ..., think: torch.Tensor | None = ...) -> torch.Tensor: ...


@overload
def _advance(model: "MoondreamModel", rows: list[_Row], heads: Any, answer: torch.Tensor,
             embed: Literal[False], think: torch.Tensor | None = ...) -> None: ...


def _advance(model: "MoondreamModel", rows: list[_Row], heads: Any, answer: torch.Tensor,
             embed: bool = True, think: torch.Tensor | None = None) -> torch.Tensor | None:
    """Each row reads what its phase needs from the step's heads and gets its next input
    embedding; rows that finish are marked done (their embedding row is a placeholder). Every head
    is asked once, for all the rows that need it. Returns the next inputs [rows, 1, dim] (None
    without `embed`: the device feeds them, object_rounds.py)."""
    ops, rw, tk = model.ops, model.region_w, model.config.tokenizer
    nxt = torch.zeros(len(rows), 1, model.config.text.dim, dtype=model.dtype, device=model.device) if embed else None
    asks = [i for i, r in enumerate(rows) if r.phase in (BOUNDARY, TOKEN, THINK)]
    greedy = dict(zip(asks, heads.tokens(asks))) if asks else {}

    coord_rows, tokens, starts, grounded = [], {}, [], []
    for i, row in enumerate(rows):
        if row.phase == THINK:
            # The reference picks the first reasoning token from the prompt's logits unmasked.
            tok = _reasoning_token(model, row, greedy[i], lambda i=i: heads.logits(i), think if row.think else None)
            if tok == tk.eos_id and "eos_id" not in model.reasoning_barred:
                # Where reasoning may pick eos (Moondream 3: kestrel bars nothing there), it ends
                # the request with its reasoning and no answer, as kestrel's stop does. (Moondream
                # 2's first reasoning token is unmasked, and the reference feeds an eos there on.)
                row.done = True
            elif tok is None or row.pos >= row.length:
                # The reasoning ends (the answer marker, or max_tokens): the marker is fed next
                # and the answer follows, as the reference prefills its suffix after reasoning.
                row.phase, row.remask = TOKEN, answer
                tokens[i] = tk.answer_id
            else:
                if not row.think:
                    row.remask = think    # eos and size barred from the second token on
                row.think.append(tok)
                if tok == tk.coord_id:
                    grounded.append(i)    # a coordinate from this same hidden state, fed as the input
                else:
                    tokens[i] = tok
        elif row.phase == BOUNDARY:
            if (len(row.objects) >= row.opts.max_objects or row.pos + row.steps > row.length
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
            if tok is None or len(row.tokens) >= row.opts.max_tokens or row.pos >= row.length:
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
        if nxt is not None:
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
        if nxt is not None:
            nxt[size_rows] = model.region_impl.encode_sizes(sizes, rw, ops)
    if grounded:
        values = heads.coords(grounded)
        for i, v in zip(grounded, values):
            rows[i].think_coords.append(v)
        if nxt is not None:
            nxt[grounded] = model.region_impl.encode_coords(values, rw, ops)
    if tokens and nxt is not None:
        ids = torch.tensor([[t] for t in tokens.values()], device=model.device)
        nxt[list(tokens)] = model.text_impl.embed(ids, model.text_w)
    return nxt


def _reasoning_token(model: "MoondreamModel", row: _Row, greedy: int, logits, allowed: torch.Tensor | None) -> int | None:
    """The next reasoning token (under `allowed`: None, or eos and size barred), or None when the
    reasoning ends: the answer marker, or max_tokens of reasoning."""
    s = row.sampling
    assert s is not None
    if len(row.think) >= s.max_tokens:
        return None
    tok = greedy if s.greedy else pick(logits(), s, model.ops, allowed)
    return None if tok == model.config.tokenizer.answer_id else tok


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

    def __init__(self, model: "MoondreamModel", lora: Any = None) -> None:
        self.model, self.lora = model, lora
        self.cache: text.KVCache | None = None
        self.masks: torch.Tensor | None = None

    def start(self, rows: list[_Row], encoded: list["EncodedImage"]) -> "OpsHeads":
        m = self.model
        self.cache = cache = m.text_impl.KVCache(m.config.text, max(r.length for r in rows), m.dtype, m.device,
                                                 batch=len(rows))
        self.masks = masks = torch.stack(row_masks(m, rows))
        hidden = []
        for b, (row, enc) in enumerate(zip(rows, encoded)):
            cache.k[:, b:b + 1, :, :enc.pos] = enc.k
            cache.v[:, b:b + 1, :, :enc.pos] = enc.v
            emb = skills.prompt_embeddings(m, row.prompt, row.refs)
            hidden.append(skills.forward(m, emb, row.pos, cache.row(b), self.lora, enc.pos == 0 or enc.causal)[:, -1])
        return OpsHeads(m, torch.cat(hidden), masks)

    def _started(self) -> tuple[text.KVCache, torch.Tensor]:
        """The batch's KV cache and masks, made by start()."""
        if self.cache is None or self.masks is None:
            raise RuntimeError("OpsStepper: start() the rows before stepping them")
        return self.cache, self.masks

    def step(self, inputs: torch.Tensor, positions: list[int]) -> "OpsHeads":
        m = self.model
        cache, masks = self._started()
        pos = torch.tensor(positions, device=m.device)
        hidden = skills.forward(m, inputs, pos, cache, self.lora)[:, -1]
        return OpsHeads(m, hidden, masks)

    def keep(self, rows: list[int]) -> None:
        cache, masks = self._started()
        cache.keep(rows)
        self.masks = masks[rows]

    def set_mask(self, row: int, allowed: torch.Tensor) -> None:
        self._started()[1][row] = allowed


def row_masks(model: "MoondreamModel", rows: list[_Row]) -> list[torch.Tensor]:
    """The tokens each row may pick at its first step: coord or eos at an object boundary, any
    token as a reasoning's first (the reference's prefill masks none), or the answer's tokens."""
    boundary, answer = skills.boundary_mask(model), skills.answer_mask(model)
    anything = torch.ones_like(answer)
    return [boundary if r.is_object else anything if r.phase == THINK else answer for r in rows]


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
    if task == "caption":
        return {"caption": answer}
    return {**_reasoning(model, row), "answer": answer}


def _reasoning(model: "MoondreamModel", row: _Row) -> dict:
    return {"reasoning": skills.grounding(model, row.think, row.think_coords)} if row.request.reasoning else {}


def stream(model: "MoondreamModel", request: Request, decode: Any = None) -> dict:
    """One caption/query request as the single call returns it with stream=True: its text as an
    iterator of pieces, read as the decode goes (a reasoning query decodes its reasoning first:
    {"reasoning": ..., "answer": pieces}). decode(rows, encoded): a generator of _decode's steps
    (default: on OpsStepper); it runs only while the caller reads."""
    rows, encoded = prepare(model, [request])
    row = rows[0]
    if decode is None:
        steps = _decode(model, rows, encoded, OpsStepper(model, skills.variant(model, row.opts.variant)))
    else:
        steps = decode(rows, encoded)
    reasoning = {}
    if request.reasoning:
        with torch.inference_mode():
            for _ in steps:
                if row.phase != THINK:
                    break
        reasoning = _reasoning(model, row)

    def tokens() -> Iterator[int]:
        shown = 0
        while True:
            yield from row.tokens[shown:]
            shown = len(row.tokens)
            with torch.inference_mode():
                if next(steps, StopIteration) is StopIteration:
                    break
        yield from row.tokens[shown:]

    pieces = text_pieces(model.tokenizer.decode, tokens())
    return {**reasoning, ("caption" if request.task == "caption" else "answer"): pieces}
