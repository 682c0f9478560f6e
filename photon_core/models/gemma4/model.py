"""The loaded Gemma 4 model: weights laid out once, image encoding, prefill/step, and the skills
(query, caption, batch) with Moondream's result shapes."""
from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from photon_core.runtime import chat_messages
from photon_core.runtime.batch_rows import Progress
from photon_core.runtime.chat_template import stop_ids
from photon_core.runtime.generate import room
from photon_core.models.serials import new_serial
from photon_core.runtime.image_input import ImageLike, to_rgb
from photon_core.runtime.requests import Request
from photon_core.runtime.sampling import Sampling
from photon_core.runtime.shape_graphs import ShapeGraphs
from photon_core.runtime.text_settings import text_sampling
from photon_core.runtime.text_stream import JoinedPieces, text_pieces
from photon_core.weights.tensor_files import parse_dtype

from . import text, vision
from . import weights as weights_io
from .config import Gemma4Config
from .decoding import BatchDecoder, Row
from .prompt import CAPTIONS, Gemma4Prompter

FAMILY = "Gemma 4"
TASKS = ("caption", "query")
THOUGHT_END = "<channel|>"   # ends the thought channel that thinking mode opens


@dataclass(frozen=True)
class EncodedImage:
    """An image after the vision tower and projection: soft tokens [n, text dim]. Reusable for any
    number of questions about the same image; read-only."""
    tokens: torch.Tensor
    owner: int   # serial of the model that made it (models.serials)


class Gemma4Model:
    """Gemma 4 (E2B / E4B) on one ops backend. Skills take a numpy RGB / PIL image, an EncodedImage,
    or None (text only)."""

    def __init__(self, config: Gemma4Config, state: dict[str, torch.Tensor], prompter: Gemma4Prompter,
                 ops: Any, device: torch.device, dtype: torch.dtype, model_id: str,
                 eos_ids: tuple[int, ...], tiling: Any = None, max_len: int | None = None) -> None:
        """With the megakernel backend, `decode` holds the compiled decode steps (tiling, context
        `max_len`: megakernel_decode.py) and every decode step is one launch; otherwise None."""
        self.config, self.w, self.prompter, self.ops = config, state, prompter, ops
        self.device, self.dtype, self.model_id, self.eos_ids = device, dtype, model_id, frozenset(eos_ids)
        self.serial = new_serial()   # marks the images it encodes (EncodedImage.owner)
        self.rotary = text.Rotary(config.text, device)
        # a camera's frames patch to one shape: on a GPU, replayed from a graph where faster
        self.encode_patches = ShapeGraphs(f"{model_id} vision encoder", self._encode_patches)
        self.decode = None
        if getattr(ops, "COMPILES_STEPS", False):
            from photon_core.megakernel.compiler import Tiling

            from .megakernel_decode import MegakernelDecode
            self.decode = MegakernelDecode(self, tiling or Tiling(), max_len)

    # -- image -------------------------------------------------------------------------------
    @torch.inference_mode()
    def encode_image(self, image: ImageLike | EncodedImage, channel_order: str = "rgb") -> EncodedImage:
        """Vision tower and projection (image input: runtime.image_input; BGR arrays need
        channel_order="bgr")."""
        if isinstance(image, EncodedImage):
            if image.owner != self.serial:
                raise ValueError("this EncodedImage was made by another model; encode the image again")
            return image
        if self.config.vision is None:
            raise ValueError("this Gemma 4 checkpoint has no vision tower (no vision_config); ask text-only")
        rgb = to_rgb(image, channel_order, alpha="white")   # as its processor (convert_to_rgb)
        pixels, pos = vision.patchify(rgb, self.config.vision, self.prompter.max_soft_tokens)
        groups = vision.pool_groups(pos, self.w, self.config.vision)
        soft = self.encode_patches(pixels.to(self.device), pos.to(self.device), groups.to(self.device))
        tokens = vision.project(soft, self.w, self.config.vision.eps, self.ops, self.dtype)
        return EncodedImage(tokens, self.serial)

    def _encode_patches(self, pixels: torch.Tensor, pos: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
        if self.config.vision is None:
            raise ValueError("this Gemma 4 checkpoint has no vision tower (no vision_config); ask text-only")
        return vision.encode_patches(pixels, pos, groups, self.w, self.config.vision, self.ops)

    # -- the decoder ---------------------------------------------------------------------------
    def embed_prompt(self, ids: list[int], image: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Input embeddings [1, T, dim] (image placeholders replaced by the soft tokens) and the
        per-layer inputs, which see the placeholders as the pad token."""
        cfg = self.config
        t = torch.tensor([ids], device=self.device)
        if int(t.max()) >= cfg.text.vocab_size or int(t.min()) < 0:
            raise ValueError(f"token ids must be in [0, {cfg.text.vocab_size})")
        slots = t == cfg.image_token_id
        n = int(slots.sum())
        if (image is None) != (n == 0) or (image is not None and image.shape[0] != n):
            raise ValueError(f"the prompt has {n} image placeholders but "
                             f"{0 if image is None else image.shape[0]} image soft tokens were given")
        plain = t.masked_fill(slots, cfg.text.pad_id)
        x = text.embed(plain, self.w, cfg.text)
        if image is not None:
            x = x.masked_scatter(slots[..., None], image.to(x.dtype))
        return x, text.per_layer_inputs(plain, x, self.w, cfg.text, self.ops)

    @torch.inference_mode()
    def prefill(self, ids: list[int], image: torch.Tensor | None, cache: text.KVCache) -> torch.Tensor:
        """The prompt through the decoder from position 0 into `cache` (batch 1): logits [1, vocab]
        after its last token."""
        x, ple = self.embed_prompt(ids, image)
        h = text.prefill(x, ple, self.w, self.config.text, cache, self.rotary, self.ops, last_only=True)
        return text.logits(h[:, -1], self.w, self.config.text, self.ops).float()

    @torch.inference_mode()
    def prefill_logits(self, ids: list[int], image: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [T, vocab] at every prompt position (tests, scoring)."""
        cache = text.KVCache(self.config.text, 1, len(ids), self.dtype, self.device)
        x, ple = self.embed_prompt(ids, image)
        h = text.prefill(x, ple, self.w, self.config.text, cache, self.rotary, self.ops)
        return text.logits(h[0], self.w, self.config.text, self.ops).float()

    @torch.inference_mode()
    def step(self, ids: torch.Tensor, pos: torch.Tensor, cache: text.KVCache) -> torch.Tensor:
        """One token per row (ids [B, 1] at positions pos [B]) -> logits [B, vocab]."""
        if pos.device.type == "cpu" and (int(pos.max()) >= cache.max_len or int(pos.min()) < 0):
            raise ValueError(f"positions {pos.tolist()} are outside the cache (0..{cache.max_len - 1})")
        x = text.embed(ids, self.w, self.config.text)
        ple = text.per_layer_inputs(ids, x, self.w, self.config.text, self.ops)
        h = text.decode_step(x, ple, pos, self.w, self.config.text, cache, self.rotary, self.ops)
        return text.logits(h[:, 0], self.w, self.config.text, self.ops).float()

    # -- skills --------------------------------------------------------------------------------
    def _row(self, image: Any, question: str, s: Sampling) -> Row:
        enc = None if image is None else self.encode_image(image)
        n = None if enc is None else enc.tokens.shape[0]
        return Row(self.prompter.prompt_ids(question, n), None if enc is None else enc.tokens,
                   s.max_tokens, s.temperature, s.top_p)

    def _generate(self, row: Row, seed: int | None) -> Iterator[str]:
        decoder = BatchDecoder(self, [row], seed)   # checks before the generator starts
        tokens = (new[0] for new in decoder.run() if new[0] is not None)   # one row: always there
        return text_pieces(self.prompter.decode, tokens)

    # Moondream's signatures (photon_core.contracts): settings as runtime.requests.Settings reads
    # them, the reference's defaults included (temperature 0.5, top_p 0.3, max_tokens 768); seed:
    # the sampler's, for repeatable sampled answers.
    def query(self, image: Any = None, question: str | None = None, reasoning: bool = False,
              spatial_refs: list[Any] | None = None, stream: bool = False, settings: dict | None = None,
              seed: int | None = None) -> dict:
        """{"answer": str}, or a generator of text pieces with stream=True. image None: text only.
        reasoning and spatial_refs are Moondream's (NotImplementedError); thinking is chat's."""
        s = text_sampling(FAMILY, settings, reasoning, spatial_refs)
        gen = self._generate(self._row(image, question or "", s), seed)
        return {"answer": gen if stream else "".join(gen)}

    def caption(self, image: Any, length: str = "normal", stream: bool = False, settings: dict | None = None,
                seed: int | None = None) -> dict:
        """{"caption": str}, or a generator of text pieces with stream=True. length: short/normal/long."""
        s = text_sampling(FAMILY, settings)
        if image is None:
            raise ValueError("caption needs an image")
        gen = self._generate(self._row(image, caption_question(length), s), seed)
        return {"caption": gen if stream else "".join(gen)}

    def chat(self, messages: list[dict], stream: bool = False, settings: dict | None = None,
             reasoning: bool | None = None, seed: int | None = None) -> dict:
        """The moondream client's chat (runtime.chat_messages): the conversation through the
        checkpoint's chat template. reasoning (default off): the template's thinking mode; the
        thought channel, up to its end token, comes back as the message's "reasoning"."""
        conversation, s = chat_messages.parse(messages), chat_messages.sampling(settings)
        end = None
        if reasoning:
            end = self.prompter.tok.token_to_id(THOUGHT_END)
            if end is None:
                raise ValueError(f"{self.model_id}: its tokenizer has no {THOUGHT_END!r} token, so there is "
                                 "no thinking mode to ask for (reasoning=False)")
        encs = [self.encode_image(image) for image in conversation.images]
        ids = self.prompter.chat_ids(conversation.turns, [e.tokens.shape[0] for e in encs],
                                     enable_thinking=bool(reasoning))
        row = Row(ids, torch.cat([e.tokens for e in encs]) if encs else None, s.max_tokens, s.temperature, s.top_p)
        decoder = BatchDecoder(self, [row], seed)   # checks the prompt before the generator starts
        limit = room(row.max_tokens, len(row.prompt), row.limit)
        tokens = (new[0] for new in decoder.run() if new[0] is not None)
        return chat_messages.reply(tokens, self.prompter.decode, limit, stream, end)

    def batch(self, requests: list[Request], seed: int | None = None) -> list[dict]:
        """caption/query requests decoded together (one batched forward per step); results in
        order, shaped as the single calls return them. seed: the first request's sampler's, as the
        single call's; the i-th request's is seed + i (what the others are changes none of its draws)."""
        if not requests:
            return []
        rows, encoded = [], {}
        for r in requests:
            if r.task not in TASKS:
                raise ValueError(f"a Gemma 4 model cannot {r.task!r}; tasks: {', '.join(TASKS)}")
            s = text_sampling(FAMILY, r.options(), r.reasoning, r.spatial_refs)
            question = caption_question(r.prompt or "normal") if r.task == "caption" else r.prompt
            if r.task == "caption" and r.image is None:
                raise ValueError("caption needs an image")
            # Several tasks on one frame (the vision node's case) encode it once.
            if r.image is not None and id(r.image) not in encoded:
                encoded[id(r.image)] = self.encode_image(r.image)
            image = None if r.image is None else encoded[id(r.image)]
            rows.append(self._row(image, question, s))
        # The compiled step holds up to 8 rows; larger batches go through it 8 rows at a time
        # (each row seeded by its place in the call, whichever group it lands in: BatchDecoder).
        size = self.decode.max_rows if self.decode is not None else len(rows)
        key = {"caption": "caption", "query": "answer"}
        progress = [Progress(r.progress) for r in requests]
        # a row's text so far, one decode a token and no unfinished character at its end
        texts = [JoinedPieces(self.prompter.decode) for _ in requests]
        for i in range(0, len(rows), size):
            group, asked, told = rows[i:i + size], requests[i:i + size], progress[i:i + size]
            for new in BatchDecoder(self, group, seed, first_row=i).run():
                # Between steps: a canceled request's row stops (the decoder skips done rows), and
                # each row that grew tells its caller (on device rounds: as each round is read).
                for r, row, tok, tell, text in zip(asked, group, new, told, texts[i:i + size]):
                    if tok is not None and tell.wanted:
                        tell({key[r.task]: text.text(row.tokens, final=False)})
                    if r.canceled:
                        row.done = True
        return [{key[r.task]: self.prompter.decode(row.tokens)} for r, row in zip(requests, rows)]


def caption_question(length: str) -> str:
    if length not in CAPTIONS:
        raise ValueError(f"caption length must be one of {sorted(CAPTIONS)}, got {length!r}")
    return CAPTIONS[length]


def load_gemma4(path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype | str = torch.float32,
                backend: Any = None, model_id: str | None = None, tiling: Any = None,
                max_len: int | None = None) -> Gemma4Model:
    """A Gemma 4 checkpoint folder (config.json, safetensors, tokenizer.json, chat template).
    tiling / max_len: the megakernel backend's compiled decode step (ignored on other backends)."""
    if backend is None:
        from photon_core.backends import reference as backend
    folder = Path(path)
    if folder.is_file():
        folder = folder.parent
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"{folder}: a Gemma 4 checkpoint needs config.json")
    cfg = Gemma4Config.from_dict(json.loads((folder / "config.json").read_text()))
    dtype, device = parse_dtype(dtype), torch.device(device)
    prompter = Gemma4Prompter(folder, cfg.image_token_id, cfg.boi_token_id, cfg.eoi_token_id)
    state = weights_io.load_state(folder, cfg, dtype, device)
    return Gemma4Model(cfg, state, prompter, backend, device, dtype, model_id or folder.name,
                       tuple(sorted(stop_ids(folder, cfg.text.eos_ids))),
                       tiling, max_len)
