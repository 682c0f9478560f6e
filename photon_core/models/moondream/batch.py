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
    loop (runtime.generate over a BatchSession): every live row feeds one input embedding at its
          own position (text.forward with per-row positions); rows then read what their protocol
          needs from the new hidden states: LM logits (next token, or coord-vs-eos at an object
          boundary), a coordinate, or a size. A row's tokens are the reference's sequence (a box
          is `coord coord size`), so stop tokens, room, cancels and device rounds are the loop's.
    finished rows leave the batch (the cache is compacted) so later steps stop paying for them.
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from photon_core.runtime.batch_rows import Progress
from photon_core.runtime.generate import generate, room
from photon_core.runtime.requests import Request, Settings, SpatialRef, check_spatial_refs
from photon_core.runtime.sampling import Sampling, check_finite, pick
from photon_core.runtime.text_stream import JoinedPieces, text_pieces

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
    sampling: Sampling | None = None     # how the row picks its tokens (None: a detect/point decoded greedily)
    opts: Settings = None  # type: ignore[assignment]  # (None: the request's own, __post_init__)
    refs: list[SpatialRef] = field(default_factory=list)
    think: list[int] = field(default_factory=list)       # a reasoning query's reasoning tokens
    think_coords: list[float] = field(default_factory=list)  # the coordinates at its coord tokens
    remask: torch.Tensor | None = None   # the tokens it may pick from its next step on, when they change
    value: Any = None                    # the region heads' coordinate or (w, h) at its last step
    size: Any = None                     # an answer's or reasoning's (w, h) at its last step, where a size
                                         # token it picks is fed (model.spatial_tokens_fed)
    feed: tuple[str, Any] | None = None  # ("coord" | "size", value) its next input encodes; None: a token
    text: Any = None                     # its answer's text as reported so far (JoinedPieces)
    progress: Progress = field(init=False)   # the request's callback, as the decode calls it

    def __post_init__(self) -> None:
        if self.opts is None:
            self.opts = self.request.options()
        self.progress = Progress(self.request.progress)

    @property
    def steps(self) -> int:
        return _steps_per_object(self.request.task)

    @property
    def is_object(self) -> bool:          # detect/point, not caption/query
        return self.request.task in ("detect", "point")


@dataclass
class ChatTurn(Request):
    """A chat's last user turn, decoded as a query on the conversation before it (chat.py). Its
    text is taken as written: where the model takes such a turn (chat_turn_as_written: Moondream
    3, as kestrel's chat renders it) it may be empty (an image-only turn: no question tokens) or
    whitespace."""


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
        as_written = isinstance(r, ChatTurn) and model.chat_turn_as_written
        return skills.query_prompt(model, r.prompt, refs, r.reasoning, text_only=r.image is None,
                                   as_written=as_written), refs
    raise ValueError(f"unknown task {r.task!r}; one of {', '.join(TASKS)}")


def _sampling(model: "MoondreamModel", r: Request, opts: Settings) -> Sampling | None:
    """A request's Sampling: a caption's or query's, and a detect's or point's where the model
    samples those (spatial_values_sampled: Moondream 3, as kestrel applies settings' temperature
    and top_p to them); else None: they decode greedily, as Moondream 2's reference's do (their
    temperature and top_p are not used)."""
    if r.task in ("detect", "point") and not model.spatial_values_sampled:
        return None
    return opts.sampling()


def _new_row(model: "MoondreamModel", r: Request, prompt: list[int], enc: "EncodedImage",
             sampling: Sampling | None, opts: Settings, refs: list[SpatialRef]) -> _Row:
    skills.check_prompt(model, enc, prompt)
    length = min(model.config.text.max_context, enc.pos + len(prompt) + _need(model, r, opts))
    if r.task in ("detect", "point"):
        return _Row(r, prompt, length, enc.pos, BOUNDARY, sampling=sampling, opts=opts, refs=refs)
    return _Row(r, prompt, length, enc.pos, THINK if r.reasoning else TOKEN, sampling=sampling, opts=opts, refs=refs)


def _need(model: "MoondreamModel", r: Request, opts: Settings) -> int:
    """The tokens a request may take: its objects' steps, its answer's (a reasoning's tokens, the
    answer marker, then the answer's: max_tokens for them all where the model's reasoning shares
    one, as kestrel's does; else max_tokens each, as Moondream 2's public code gives them)."""
    if r.task in ("detect", "point"):
        return _steps_per_object(r.task) * opts.max_objects
    if r.reasoning and not model.reasoning_shares_max_tokens:
        return 2 * opts.max_tokens + 1
    return opts.max_tokens


def prepare(model: "MoondreamModel", requests: list[Request]) -> tuple[list[_Row], list["EncodedImage"]]:
    """The requests' rows, their images encoded (each distinct one once). Every request is checked
    (ValueError/TypeError with the reason) before any image is encoded; all of them must ask for
    the same variant (run groups them)."""
    checked = []
    for r in requests:   # every request checked before any image is encoded
        opts = model.request_settings(r)
        checked.append((opts, _sampling(model, r, opts), *_prompt(model, r, opts)))
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
    `decode(rows, encoded)` decodes the rows (default: ops_steps, the model's own ops;
    megakernel_decode passes its own, on megakernel steps)."""
    if not requests:
        return []
    groups: dict[str | None, list[int]] = {}
    for i, r in enumerate(requests):
        groups.setdefault(model.request_settings(r).variant, []).append(i)
    if len(groups) > 1:
        results: list[dict] = [{}] * len(requests)
        for idx in groups.values():
            for i, res in zip(idx, run(model, [requests[i] for i in idx], decode)):
                results[i] = res
        return results
    rows, encoded = prepare(model, requests)
    with torch.inference_mode():
        if decode is None:
            for _ in ops_steps(model, rows, encoded):
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
            model.check_variant(image, None if lora is None else lora.name)
        elif image is not None:
            raw.setdefault(id(image), image)
    done = dict(zip(raw, model.encode_images(list(raw.values()), lora=lora)))
    return [image if isinstance(image, EncodedImage) else model.empty_prefix() if image is None else done[id(image)]
            for image in images]


def ops_steps(model: "MoondreamModel", rows: list[_Row], encoded: list["EncodedImage"]) -> Iterator[None]:
    """decode's steps on the model's own ops (OpsStepper, with the rows' variant)."""
    stepper = OpsStepper(model, skills.variant(model, rows[0].opts.variant))
    return decode(BatchSession(model, rows, encoded, stepper))


_OBJECTS = Sampling(0)   # detect and point without a Sampling decide greedily (_sampling)


def decode(session: "BatchSession", device_rounds: bool = False) -> Iterator[None]:
    """Decodes the session's rows through runtime.generate, yielding after each step (stream()
    reads a row's text as it grows; each request's `progress` hears its result grow). A canceled
    request stops at its next step (in device rounds, within the round) with what it has so far.
    device_rounds: greedy rows in rounds on the device, where the session has them."""
    model, rows = session.model, session.rows
    steps = generate(session, [row.sampling or _OBJECTS for row in rows], session.rooms,
                     {model.config.tokenizer.eos_id}, session.choose,
                     canceled=lambda r: rows[r].request.canceled, device_rounds=device_rounds)
    for _ in steps:
        watch(model, rows)
        yield None


def watch(model: "MoondreamModel", rows: list[_Row]) -> None:
    """Between steps: each request whose result grew (an object found, a token more) hears it
    (Request.progress)."""
    for row in rows:
        grown = len(row.objects) if row.is_object else len(row.tokens)
        if row.progress.wanted and grown > row.reported:
            row.reported = grown
            row.progress(_result(model, row, final=False))


class BatchSession:
    """runtime.generate's session on Moondream's rows. A row's tokens are its protocol's, as the
    reference lays a sequence out: an answer's tokens; per box of a detect `coord coord size`, per
    point `coord coord` (tokens whose inputs are the region encoder's values, not embeddings),
    then eos; a reasoning's tokens (a `coord` among them fed its coordinate), the answer marker,
    the answer's (Moondream 3: every coord and size token of an answer or a reasoning is fed its
    value, _fed_as_region). Each step reads the heads its rows need, each head once for all of them (_read):
    the masked LM argmax at an answer token or an object boundary, the region heads' coordinate
    or size inside an object; choose() runs the row's protocol on what was read (its objects, its
    text, the value its next input encodes) and step() feeds the next inputs.

    stepper: start(rows, encoded) / step(inputs, positions) -> heads, keep(rows), set_mask(row,
    allowed) (OpsStepper below, megakernel_decode.MegakernelStepper)."""

    def __init__(self, model: "MoondreamModel", rows: list[_Row], encoded: list["EncodedImage"], stepper: Any) -> None:
        self.model, self.rows, self.encoded, self.stepper = model, rows, encoded, stepper
        self.live = list(range(len(rows)))   # request rows, by the session's (live) row
        self.answer = skills.answer_mask(model)       # built once, not per token
        self.boundary = skills.boundary_mask(model)
        self.think = skills.reasoning_mask(model)
        # A row's room: its objects' steps, its answer's tokens (a Moondream 2 reasoning's answer
        # gets its own max_tokens when it starts, choose()), within its cache.
        self.rooms = [room(_need(model, row.request, row.opts), row.pos + len(row.prompt), row.length) for row in rows]

    def prefill(self) -> tuple[torch.Tensor, list[int]]:
        heads = self.stepper.start(self.rows, self.encoded)
        for row in self.rows:
            row.pos += len(row.prompt)
        return self._read(heads, self.rows)

    def step(self, tokens: list[int]) -> tuple[torch.Tensor, list[int]]:
        live = [self.rows[r] for r in self.live]
        nxt = self.inputs(live, tokens)
        for i, row in enumerate(live):
            # a reasoning after its first token, an answer after its reasoning: a new mask from now
            if row.remask is not None:
                self.stepper.set_mask(i, row.remask)
                row.remask = None
        heads = self.stepper.step(nxt, [row.pos for row in live])
        for row in live:
            row.pos += 1
        return self._read(heads, live)

    def keep(self, rows: list[int]) -> None:
        self.stepper.keep(rows)
        self.live = [self.live[i] for i in rows]

    def _read(self, heads: Any, rows: list[_Row]) -> tuple[torch.Tensor, list[int]]:
        """What this step's heads say to each of `rows` (heads' rows, in order): the greedy token
        (the masked argmax where the row asks the LM head; inside an object its protocol's fixed
        token), the value a coordinate or size step reads (row.value) and an object's score, and
        the logits of rows that sample ([rows, 0] when none does)."""
        tk = self.model.config.tokenizer
        asks = [i for i, r in enumerate(rows) if r.phase in (BOUNDARY, TOKEN, THINK)]
        greedy = [tk.size_id if r.phase == SIZE else tk.coord_id for r in rows]
        for i, tok in zip(asks, heads.tokens(asks) if asks else []):
            greedy[i] = tok
        sampled = [i for i in asks if not (rows[i].sampling or _OBJECTS).greedy]
        # object boundaries where another object may start (a sampled row's: before it picks)
        starts = [i for i in asks if rows[i].phase == BOUNDARY and (greedy[i] == tk.coord_id or i in sampled)]

        def fed(i: int, tok: int) -> bool:
            # an answer's or reasoning's coord/size token fed as a region value (_fed_as_region) is
            # fed the value read from the same hidden state (a sampled row's: whichever it picks)
            r = rows[i]
            return (r.phase in (TOKEN, THINK) and _fed_as_region(self.model, r, tok)
                    and (greedy[i] == tok or i in sampled))
        coord = starts + [i for i, r in enumerate(rows) if r.phase == COORD_Y or fed(i, tk.coord_id)]
        size = [i for i, r in enumerate(rows) if r.phase == SIZE or fed(i, tk.size_id)]
        if starts:
            for i, p in zip(starts, heads.boundary_scores(starts)):
                rows[i].score = p
        if coord:
            for i, v in zip(coord, self._values(heads, rows, coord, "coord")):
                rows[i].value = v
        if size:
            for i, wh in zip(size, self._values(heads, rows, size, "size")):
                if rows[i].phase == SIZE:
                    rows[i].value = wh
                else:
                    rows[i].size = wh
        logits = torch.zeros(len(rows), self.model.config.text.vocab_size if sampled else 0, device=self.model.device)
        for i in sampled:
            logits[i] = heads.logits(i)
        return logits, greedy

    def _values(self, heads: Any, rows: list[_Row], idx: list[int], kind: str) -> list[Any]:
        """The coordinates (kind "coord") or sizes of rows `idx`: the region heads' argmax, or
        where the model samples them (spatial_values_sampled) and the row samples, drawn from the
        region heads' logits on its hidden state with its temperature and top_p."""
        m = self.model
        drawn = [i for i in idx if m.spatial_values_sampled and not (rows[i].sampling or _OBJECTS).greedy]
        argmax = [i for i in idx if i not in drawn]
        got = dict(zip(argmax, (heads.coords if kind == "coord" else heads.sizes)(argmax))) if argmax else {}
        if drawn:
            draw = m.region_impl.sample_coords if kind == "coord" else m.region_impl.sample_sizes
            got.update(zip(drawn, draw(heads.hidden_of(drawn).to(m.dtype), m.region_w, m.ops,
                                       [rows[i].sampling for i in drawn])))
        return [got[i] for i in idx]

    def choose(self, r: int, logits: torch.Tensor, greedy: int | None) -> int:
        """Request row r's next token by its protocol (its greedy one, or sampled from `logits`),
        kept in its result; eos when the row ends (max_objects, no room for another object, its
        answer or reasoning done)."""
        row, tk, model = self.rows[r], self.model.config.tokenizer, self.model
        assert greedy is not None, "every step reads each row's greedy token (_read)"
        row.feed = None
        if row.phase == BOUNDARY:
            s = row.sampling   # another object (coord) or the end: greedy, or sampled under the mask
            more = greedy if s is None or s.greedy else pick(logits, s, model.ops, self.boundary)
            if len(row.objects) >= row.opts.max_objects or row.pos + row.steps > row.length or more != tk.coord_id:
                return self._end(row)
            row.x, row.phase, row.feed = row.value, COORD_Y, ("coord", row.value)
            return tk.coord_id
        if row.phase == COORD_Y:
            row.y, row.feed = row.value, ("coord", row.value)
            if row.request.task == "point":
                row.objects.append({"x": _clamp(row.x), "y": _clamp(row.y), "score": row.score})
                row.phase = BOUNDARY
            else:
                row.phase = SIZE
            return tk.coord_id
        if row.phase == SIZE:
            w, h = row.value
            row.feed = ("size", row.value)
            # The reference leaves boxes unclamped; ours are clamped to the image.
            row.objects.append({"x_min": _clamp(row.x - w / 2), "y_min": _clamp(row.y - h / 2),
                                "x_max": _clamp(row.x + w / 2), "y_max": _clamp(row.y + h / 2),
                                "score": row.score})
            row.phase = BOUNDARY
            return tk.size_id
        if row.phase == TOKEN:
            tok = _answer_token(model, row, greedy, lambda: logits, self.answer)
            if tok is None:
                return self._end(row)
            row.tokens.append(tok)
            row.feed = _region_feed(model, row, tok)
            return tok
        # THINK. The reference picks the first reasoning token from the prompt's logits unmasked.
        tok = _reasoning_token(model, row, greedy, lambda: logits, self.think if row.think else None)
        if tok == tk.eos_id and "eos_id" not in model.reasoning_barred:
            # Where reasoning may pick eos (Moondream 3: kestrel bars nothing there), it ends the
            # request with its reasoning and no answer, as kestrel's stop does. (Moondream 2's
            # first reasoning token is unmasked, and the reference feeds an eos there on.)
            return self._end(row)
        shared = model.reasoning_shares_max_tokens
        if tok is None or (not shared and row.pos >= row.length):
            # The reasoning ends (the answer marker; Moondream 2 also at max_tokens of reasoning):
            # the marker is fed next and the answer follows, as the reference prefills its suffix
            # after reasoning, with max_tokens of its own. Where reasoning and answer share one
            # max_tokens (Moondream 3, as kestrel) the request simply ends when it runs out: rooms.
            row.phase, row.remask = TOKEN, self.answer
            if not shared:
                self.rooms[r] = min(self.rooms[r], len(row.think) + 1 + row.opts.max_tokens)
            return tk.answer_id
        if not row.think:
            row.remask = self.think   # Moondream 2: eos and size barred from the second token on
        row.think.append(tok)
        if tok == tk.coord_id:
            row.think_coords.append(row.value)
        row.feed = _region_feed(model, row, tok)
        return tok

    def _end(self, row: _Row) -> int:
        row.done = True
        return self.model.config.tokenizer.eos_id

    def inputs(self, rows: list[_Row], tokens: list[int]) -> torch.Tensor:
        """The next input of each of `rows` [rows, 1, dim]: the encoded coordinate or size its
        token stands for, else the token's embedding; each encoder once for all rows."""
        m = self.model
        nxt = torch.zeros(len(rows), 1, m.config.text.dim, dtype=m.dtype, device=m.device)
        fed: dict[str, dict[int, Any]] = {"coord": {}, "size": {}}
        for i, r in enumerate(rows):
            if r.feed is not None:
                fed[r.feed[0]][i] = r.feed[1]
        plain = [i for i, r in enumerate(rows) if r.feed is None]
        if fed["coord"]:
            nxt[list(fed["coord"])] = m.region_impl.encode_coords(list(fed["coord"].values()), m.region_w, m.ops)
        if fed["size"]:
            nxt[list(fed["size"])] = m.region_impl.encode_sizes(list(fed["size"].values()), m.region_w, m.ops)
        if plain:
            ids = torch.tensor([[tokens[i]] for i in plain], device=m.device)
            nxt[plain] = m.text_impl.embed(ids, m.text_w)
        return nxt


def _fed_as_region(model: "MoondreamModel", row: _Row, tok: int) -> bool:
    """Whether `tok`, picked in `row`'s answer or reasoning, is fed back as the region encoder's
    value of what the region heads read from the hidden state that picked it (else its embedding):
    every coord and size token where the model's engine feeds them so (model.spatial_tokens_fed:
    kestrel types every coord/size id it samples as a region token and embeds it with the region
    encoder), else a reasoning's coord (Moondream 2's public code)."""
    tk = model.config.tokenizer
    if model.spatial_tokens_fed:
        return tok in (tk.coord_id, tk.size_id)
    return row.phase == THINK and tok == tk.coord_id


def _region_feed(model: "MoondreamModel", row: _Row, tok: int) -> tuple[str, Any] | None:
    """What `row`'s next input encodes after its answer or reasoning token `tok` (row.feed)."""
    if not _fed_as_region(model, row, tok):
        return None
    return ("coord", row.value) if tok == model.config.tokenizer.coord_id else ("size", row.size)


def spent(model: "MoondreamModel", row: _Row) -> int:
    """The tokens a caption/query row's max_tokens has paid for: its answer's, and where reasoning
    shares the budget (reasoning_shares_max_tokens) its reasoning's and the answer marker too."""
    if not (row.request.reasoning and model.reasoning_shares_max_tokens):
        return len(row.tokens)
    return len(row.think) + (row.phase == TOKEN) + len(row.tokens)


def _reasoning_token(model: "MoondreamModel", row: _Row, greedy: int, logits, allowed: torch.Tensor | None) -> int | None:
    """The next reasoning token (under `allowed`: None, or eos and size barred), or None when the
    reasoning ends: the answer marker, or (Moondream 2) max_tokens of reasoning."""
    s = row.sampling
    assert s is not None
    if not model.reasoning_shares_max_tokens and len(row.think) >= s.max_tokens:
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
        check_finite(logits)
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

    def hidden_of(self, rows: list[int]) -> torch.Tensor:
        return self.hidden[rows]

    def sizes(self, rows: list[int]) -> list[tuple[float, float]]:
        return self.model.region_impl.decode_sizes(self.hidden[rows], self.model.region_w, self.model.ops)


def _clamp(v: float) -> float:
    return min(max(v, 0.0), 1.0)


def _result(model: "MoondreamModel", row: _Row, final: bool = True) -> dict:
    task = row.request.task
    if task == "detect":
        return {"objects": row.objects}
    if task == "point":
        return {"points": row.objects}
    if row.text is None:
        row.text = JoinedPieces(model.tokenizer.decode)
    answer = row.text.text(skills.text_ids(model, row.tokens), final)
    if task == "caption":
        return {"caption": answer}
    return {**_reasoning(model, row), "answer": answer}


def _reasoning(model: "MoondreamModel", row: _Row) -> dict:
    return {"reasoning": skills.grounding(model, row.think, row.think_coords)} if row.request.reasoning else {}


def stream(model: "MoondreamModel", request: Request, decode: Any = None) -> dict:
    """One caption/query request as the single call returns it with stream=True: its text as an
    iterator of pieces, read as the decode goes (a reasoning query decodes its reasoning first:
    {"reasoning": ..., "answer": pieces}). decode(rows, encoded): a generator of decode's steps
    (default: on OpsStepper); it runs only while the caller reads."""
    rows, encoded = prepare(model, [request])
    row = rows[0]
    if decode is None:
        steps = ops_steps(model, rows, encoded)
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
            yield from skills.text_ids(model, row.tokens[shown:])
            shown = len(row.tokens)
            with torch.inference_mode():
                if next(steps, StopIteration) is StopIteration:
                    break
        yield from skills.text_ids(model, row.tokens[shown:])

    pieces = text_pieces(model.tokenizer.decode, tokens())
    return {**reasoning, ("caption" if request.task == "caption" else "answer"): pieces}
