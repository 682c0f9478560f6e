"""Segment: the outline of an object as an SVG path, plus its bounding box.

The prompt protocol (Moondream 3; facts from the kestrel engine's segment skill):
- prompt: `[BOS][729 image tokens]` + segment prefix `[1, 17374, 2]` + tokens(object) + suffix `[3]`
  (the object's text as it is, without the leading space detect/point add);
- decoding is unconstrained and greedy (settings' temperature and top_p, where given, sample every
  token and every coordinate and size, as kestrel applies them); whenever the LM head picks `coord` (5) the region head
  reads the same hidden state and the coordinate it gives is the next input embedding (encoded
  coordinate), likewise `size` (6); any other token is a word of the path; `eos` (0) ends it;
- the first two coordinates are the box centre, the first size its (width, height): the bbox is
  centre +- size/2, clamped to [0, 1];
- the path: every word token with id > 20, decoded on its own and stripped, read as SVG path
  commands (M L H V C S Q T A Z, either case) each followed by integer arguments, a "-" token
  negating the next number; arguments come in pairs and are divided by the 960-unit viewbox,
  printed with up to 3 decimals, everything joined by single spaces. The coordinates are in the
  bbox's unit square (kestrel's refiner draws the path translated to the box corner and scaled by
  its size).
On the megakernel backend each decode step is one launch of the compiled step (its LM argmax under
a zero logit bias, i.e. no mask, and the region bins of the same hidden state); otherwise a forward
of the model's ops. Both give the same tokens, coordinates and sizes.
Not done: kestrel refines the coarse path with a separate mask network over the image (not part of
the checkpoints named here); `refine=True` raises NotImplementedError.
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from photon_core.models.moondream import skills
from photon_core.runtime.sampling import Sampling, check_finite, pick, step_argmax

if TYPE_CHECKING:
    from photon_core.models.moondream.model import EncodedImage

    from .model import Moondream3Model

DEFAULT_MAX_TOKENS = 768
VIEWBOX = 960.0
PATH_COMMANDS = frozenset("MmLlHhVvCcSsQqTtAaZz")
FIRST_WORD_ID = 21   # ids up to 20 are the special/control tokens, never path words


def segment_prompt(model: "Moondream3Model", name: str, refs: list | None = None) -> list[int]:
    """prefix + the spatial references' placeholders + tokens(object) + suffix: kestrel's segment
    skill places its spatial tokens where a query's go, after the prefix (skills.ref_placeholders;
    their embeddings: skills.prompt_embeddings)."""
    if not isinstance(name, str) or not name.strip():
        raise ValueError("object must be a non-empty string")
    t = model.config.tokenizer.templates.get("segment")
    if t is None:
        raise ValueError("this checkpoint's config has no segment template")
    # the object stripped of surrounding whitespace, as kestrel's segment skill reads it (build_request)
    return list(t["prefix"]) + skills.ref_placeholders(model, refs) + model.tokenizer.encode(name.strip()) + \
        list(t["suffix"])


class _OpsSteps:
    """The decode steps as forwards of the model's ops: each step's hidden state, read by the LM
    head and the region heads on demand."""

    def __init__(self, model: "Moondream3Model", enc: "EncodedImage", length: int,
                 sampling: Sampling | None = None) -> None:
        cfg, tx = model.config, model.text_impl
        self.model, self.sampling = model, _drawn(sampling)
        self.cache = tx.KVCache(cfg.text, length, model.dtype, model.device)
        self.cache.k[:, :, :, :enc.pos] = enc.k
        self.cache.v[:, :, :, :enc.pos] = enc.v
        self.pos = enc.pos

    def start(self, prompt: list[int], refs: list | None = None) -> None:
        self.feed(skills.prompt_embeddings(self.model, prompt, refs))

    def feed(self, emb: torch.Tensor) -> None:
        """Input embeddings [1, T, dim] at the next T positions."""
        m = self.model
        self.hidden = m.text_impl.forward(emb, self.pos, m.text_w, m.config.text, self.cache, m.ops)[:, -1]
        self.pos += emb.shape[1]

    def token(self) -> int:
        m = self.model
        logits = m.text_impl.lm_logits(self.hidden, m.text_w, m.ops)
        check_finite(logits)
        if self.sampling is not None:
            return pick(logits[0], self.sampling, m.ops)
        return int(m.ops.argmax(logits)[0])

    def coord(self) -> float:
        return _coord(self.model, self.hidden, self.sampling)

    def size(self) -> tuple[float, float]:
        return _size(self.model, self.hidden, self.sampling)


class _MegakernelSteps:
    """The decode steps as launches of the compiled step (batch 1): the prompt but its last token
    prefilled per-op, then one launch per input, which yields the token and the region bins."""

    def __init__(self, seq: Any, sampling: Sampling | None = None) -> None:
        self.seq, self.sampling = seq, _drawn(sampling)
        self.n_bins = seq.fm.model.region_impl.coord_divisor(seq.fm.config.region.coord_out_dim)

    def start(self, prompt: list[int], refs: list | None = None) -> None:
        no_mask = torch.zeros(self.seq.fm.config.text.vocab_size, device=self.seq.fm.device)
        self.res = self.seq.prompt(prompt, no_mask, refs)

    def feed(self, emb: torch.Tensor) -> None:
        """One input embedding [1, 1, dim] at the next position."""
        self.res = self.seq.step(emb)

    def token(self) -> int:
        if self.sampling is not None:   # from the launch's logits (a zero bias: unmasked)
            return pick(self.seq.logits()[0], self.sampling, self.seq.fm.model.ops)
        return step_argmax(self.res.tokens[0])

    def coord(self) -> float:
        if self.sampling is not None:
            return _coord(self.seq.fm.model, self.res.hidden, self.sampling)
        return step_argmax(self.res.coord_bins[0], "coordinate logits") / self.n_bins

    def size(self) -> tuple[float, float]:
        if self.sampling is not None:
            return _size(self.seq.fm.model, self.res.hidden, self.sampling)
        from photon_core.models.moondream.megakernel_decode import _checked_sizes, size_values
        return size_values(_checked_sizes(self.res.size_bins[0]))


def _drawn(sampling: Sampling | None) -> Sampling | None:
    """The Sampling a decode draws its tokens and region values with; None: greedy (argmax)."""
    return None if sampling is None or sampling.greedy else sampling


def _coord(model: "Moondream3Model", hidden: torch.Tensor, sampling: Sampling | None) -> float:
    """The coordinate of the hidden state [1, dim]: the argmax bin's, or one drawn by `sampling`."""
    rg, h = model.region_impl, hidden.reshape(1, -1).to(model.dtype)
    if sampling is None:
        return rg.decode_coords(h, model.region_w, model.ops)[0]
    return rg.sample_coords(h, model.region_w, model.ops, [sampling])[0]


def _size(model: "Moondream3Model", hidden: torch.Tensor, sampling: Sampling | None) -> tuple[float, float]:
    """The (width, height) of the hidden state [1, dim]: the argmax bins', or drawn by `sampling`."""
    rg, h = model.region_impl, hidden.reshape(1, -1).to(model.dtype)
    if sampling is None:
        return rg.decode_sizes(h, model.region_w, model.ops)[0]
    return rg.sample_sizes(h, model.region_w, model.ops, [sampling])[0]


class Decoded:
    """What the protocol has decoded so far: path word ids, coordinates, sizes, in order."""

    def __init__(self) -> None:
        self.words: list[int] = []
        self.coords: list[float] = []
        self.sizes: list[tuple[float, float]] = []


def decode(model: "Moondream3Model", enc: "EncodedImage", prompt: list[int], max_tokens: int,
           refs: list | None = None, sampling: Sampling | None = None
           ) -> tuple[list[int], list[float], list[tuple[float, float]]]:
    """Decode of the segment protocol, greedy unless `sampling` samples: (path word ids,
    coordinates, sizes), in order."""
    out = Decoded()
    for _ in steps(model, enc, prompt, max_tokens, refs, out, sampling):
        pass
    return out.words, out.coords, out.sizes


def steps(model: "Moondream3Model", enc: "EncodedImage", prompt: list[int], max_tokens: int,
          refs: list | None, out: Decoded, sampling: Sampling | None = None) -> Iterator[None]:
    """The decode, yielding after each token it adds to `out` (checks done before the first step);
    on the megakernel the batch-1 step is held until the generator ends or is dropped."""
    if max_tokens < 0:
        raise ValueError("max_tokens must be >= 0")
    skills.check_prompt(model, enc, prompt)
    length = min(model.config.text.max_context, enc.pos + len(prompt) + max_tokens)
    start = enc.pos + len(prompt)

    def run() -> Iterator[None]:
        with torch.inference_mode():
            if model.decode is None:
                yield from _decode(model, _OpsSteps(model, enc, length, sampling), prompt, refs, start, length,
                                   max_tokens, out)
                return
            with model.decode.sequence(enc, length) as seq:
                yield from _decode(model, _MegakernelSteps(seq, sampling), prompt, refs, start, length, max_tokens, out)
    return run()


def _decode(model: "Moondream3Model", steps: Any, prompt: list[int], refs: list | None, pos: int, length: int,
            max_tokens: int, out: Decoded) -> Iterator[None]:
    """The protocol on `steps` (start with the prompt, feed input embeddings; read the token, a
    coordinate, a size of the last position)."""
    tx, rg, ops, tk = model.text_impl, model.region_impl, model.ops, model.config.tokenizer
    steps.start(prompt, refs)
    for _ in range(max_tokens):
        tok = steps.token()
        if tok == tk.eos_id:
            break
        if tok == tk.coord_id:
            out.coords.append(steps.coord())
            nxt = rg.encode_coords(out.coords[-1:], model.region_w, ops)
        elif tok == tk.size_id:
            out.sizes.append(steps.size())
            nxt = rg.encode_sizes(out.sizes[-1:], model.region_w, ops)
        else:
            out.words.append(tok)
            nxt = tx.embed(torch.tensor([[tok]], device=model.device), model.text_w)
        yield None
        if pos >= length:
            break
        steps.feed(nxt)
        pos += 1


def bbox(coords: list[float], sizes: list[tuple[float, float]]) -> dict | None:
    """Centre (first two coordinates) +- half the first size, clamped to [0, 1]; None without them."""
    if len(coords) < 2 or not sizes:
        return None
    cx, cy = _clamp(coords[0]), _clamp(coords[1])
    w, h = _clamp(sizes[0][0]), _clamp(sizes[0][1])
    return {"x_min": _clamp(cx - w / 2), "y_min": _clamp(cy - h / 2),
            "x_max": _clamp(cx + w / 2), "y_max": _clamp(cy + h / 2)}


def path_words(tokenizer: Any, ids: list[int]) -> list[str]:
    """Each word token (id > 20) decoded on its own, stripped; empty ones dropped."""
    words = (tokenizer.decode([i]).strip() for i in ids if i >= FIRST_WORD_ID)
    return [w for w in words if w]


def svg_path(words: list[str], viewbox: float = VIEWBOX) -> str:
    """Path words -> the path string in unit coordinates. ValueError for words that are not a path."""
    out: list[str] = []
    i = 0
    while i < len(words):
        if words[i] not in PATH_COMMANDS:
            raise ValueError(f"unexpected SVG path token {words[i]!r} (expected a command)")
        out.append(words[i])
        i += 1
        numbers: list[int] = []
        while i < len(words) and words[i] not in PATH_COMMANDS:
            if words[i] == "-":
                if i + 1 >= len(words):
                    break
                numbers.append(-_integer(words[i + 1]))
                i += 2
            else:
                numbers.append(_integer(words[i]))
                i += 1
        for j in range(0, len(numbers) - 1, 2):   # arguments come in pairs; a lone last one is dropped
            out.extend(_format(n / viewbox) for n in numbers[j:j + 2])
    return " ".join(out)


def segment(model: "Moondream3Model", enc: "EncodedImage", name: str, max_tokens: int = DEFAULT_MAX_TOKENS,
            refine: bool = False, refs: list | None = None, sampling: Sampling | None = None) -> dict:
    _refuse_refine(refine)
    ids, coords, sizes = decode(model, enc, segment_prompt(model, name, refs), max_tokens, refs, sampling)
    return _result(model, ids, coords, sizes)


def _result(model: "Moondream3Model", ids: list[int], coords: list[float], sizes: list[tuple[float, float]]) -> dict:
    result: dict = {"path": "", "bbox": bbox(coords, sizes)}
    try:
        result["path"] = svg_path(path_words(model.tokenizer, ids))
    except ValueError as err:   # the model's words were not a path: say so, keep the box
        result["error"] = str(err)
    return result


def _refuse_refine(refine: bool) -> None:
    if refine:
        raise NotImplementedError("segment refine (a separate mask network that sharpens the coarse path "
                                  "over the image) is not supported yet; use refine=False for the model's path")


def segment_stream(model: "Moondream3Model", enc: "EncodedImage", name: str, max_tokens: int = DEFAULT_MAX_TOKENS,
                   refine: bool = False, refs: list | None = None, sampling: Sampling | None = None
                   ) -> Iterator[dict]:
    """The client's SegmentStreamChunk updates as the decode goes: {"bbox"} once it is known (the
    first coordinates and size; or None before anything else when the decode gave none), then
    {"chunk"} per path command once the next one begins (kestrel's streaming: one command with its
    arguments, a space before every chunk but the first), then {"path", "bbox", "completed": True}
    as segment() returns it. The chunks joined are the path, unless the words stop being one: no
    chunk is sent from there, and the last update carries segment()'s "error"."""
    _refuse_refine(refine)
    out = Decoded()
    decoding = steps(model, enc, segment_prompt(model, name, refs), max_tokens, refs, out, sampling)  # checks now

    def updates() -> Iterator[dict]:
        sent_box, sent_words, broken = False, 0, False
        words: list[str] = []          # the path words of out.words[:n_ids]
        n_ids = 0
        for _ in decoding:
            if not sent_box and bbox(out.coords, out.sizes) is not None:
                sent_box = True
                yield {"bbox": bbox(out.coords, out.sizes)}
            if len(out.words) > n_ids:
                words += path_words(model.tokenizer, out.words[n_ids:])
                n_ids = len(out.words)
            # A command is complete when the word after its arguments is the next command.
            done = max((i for i, w in enumerate(words) if i > sent_words and w in PATH_COMMANDS), default=0)
            if done > sent_words and not broken:
                chunk, broken = _chunk(words[sent_words:done], first=sent_words == 0)
                if chunk:
                    if not sent_box:
                        sent_box = True
                        yield {"bbox": None}
                    yield {"chunk": chunk}
                    sent_words = done
        final = _result(model, out.words, out.coords, out.sizes)
        if not sent_box:
            yield {"bbox": final["bbox"]}
        if not broken and sent_words < len(words):
            chunk, broken = _chunk(words[sent_words:], first=sent_words == 0)
            if chunk:
                yield {"chunk": chunk}
        yield {**final, "completed": True}
    return updates()


def _chunk(words: list[str], first: bool) -> tuple[str, bool]:
    """(the path text of `words`, a run of whole commands, with its leading space; whether they are
    not a path)."""
    try:
        text = svg_path(words)
    except ValueError:
        return "", True
    return (text if first or not text else " " + text), False


def _integer(word: str) -> int:
    try:
        return int(word)
    except ValueError:
        raise ValueError(f"unexpected SVG path token {word!r} (expected an integer)") from None


def _format(value: float) -> str:
    return f"{value:.3f}".rstrip("0").rstrip(".")   # kestrel's printing (-0.0001 prints "-0")


def _clamp(v: float) -> float:
    return min(max(v, 0.0), 1.0)
