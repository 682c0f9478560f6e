"""The Qwen 3.5 model and its skills (query, caption, batch), on any ops backend."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from photon_core.runtime import chat_messages
from photon_core.models.serials import new_serial
from photon_core.runtime.generate import room
from photon_core.runtime.image_input import ImageLike
from photon_core.runtime.requests import Request
from photon_core.runtime.shape_graphs import ShapeGraphs
from photon_core.runtime.text_settings import text_sampling
from photon_core.runtime.text_stream import text_pieces
from photon_core.weights.tensor_files import parse_dtype

from . import generate, prompt, text, vision, weights
from .config import Qwen35Config

FAMILY = "Qwen 3.5"


@dataclass
class EncodedImage:
    """An image's vision features [tokens, dim] and its merged-token grid (rows, cols)."""
    features: torch.Tensor
    grid: tuple[int, int]
    owner: int   # serial of the model that made it (models.serials): another model's features are not its own


class Qwen35Model:
    """Qwen 3.5 on one ops backend. With the megakernel backend, `decode` (megakernel_decode.py)
    runs every decode step as one launch of the compiled step graph; prefill and the vision encoder
    stay on the per-op kernels. Results are the same."""

    def __init__(self, folder: Path, cfg: Qwen35Config, state: dict[str, torch.Tensor], prompts: prompt.Prompts,
                 ops: Any, device: torch.device, dtype: torch.dtype, model_id: str, tiling: Any = None,
                 max_len: int | None = None) -> None:
        self.config, self.prompts, self.ops = cfg, prompts, ops
        self.device, self.dtype, self.model_id = device, dtype, model_id
        self.serial = new_serial()   # marks the images it encodes (EncodedImage.owner)
        self.text_w = text.TextWeights(state, cfg.text)
        self.vision_w = vision.VisionWeights(state, cfg.vision) if cfg.vision else None
        self.preprocess = vision.Preprocess.from_folder(folder, cfg.vision) if cfg.vision else None
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(0)
        # a camera's frames patch to one grid: on a GPU, replayed from a graph where faster
        self.encode_patches = ShapeGraphs(f"{model_id} vision encoder", self._encode_patches)
        self._grids: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self.decode = None
        if getattr(ops, "COMPILES_STEPS", False):
            from photon_core.megakernel.compiler import Tiling

            from .megakernel_decode import MegakernelDecode
            self.decode = MegakernelDecode(self, tiling or Tiling(), max_len)

    # ------------------------------------------------------------------ model pieces

    def _encode_patches(self, patches: torch.Tensor, pos: torch.Tensor, cos: torch.Tensor,
                        sin: torch.Tensor) -> torch.Tensor:
        return vision.encode_patches(patches, pos, cos, sin, *self._vision(), self.ops)

    def _vision(self) -> tuple[vision.VisionWeights, Any]:
        if self.vision_w is None or self.config.vision is None:
            raise ValueError(f"{self.model_id} is a text-only Qwen 3.5 checkpoint: it cannot take images")
        return self.vision_w, self.config.vision

    def _positions(self, gh: int, gw: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A grid's position embeddings and rotary tables (vision.positions), kept for the last few
        grids (a camera's frames share one)."""
        grid = (gh, gw)
        if grid not in self._grids:
            if len(self._grids) >= 4:
                self._grids.pop(next(iter(self._grids)))
            self._grids[grid] = vision.positions(grid, *self._vision())
        return self._grids[grid]

    def encode_image(self, image: ImageLike | EncodedImage, channel_order: str = "rgb") -> EncodedImage:
        """Preprocess and run the vision encoder (image input: runtime.image_input; BGR arrays need
        channel_order="bgr"). ValueError for an unusable or too large image."""
        if isinstance(image, EncodedImage):
            if image.owner != self.serial:
                raise ValueError("this EncodedImage was made by another model; encode the image again")
            return image
        if self.vision_w is None or self.preprocess is None or self.config.vision is None:
            raise ValueError(f"{self.model_id} is a text-only Qwen 3.5 checkpoint: it cannot take images")
        patches, (gh, gw) = vision.preprocess(image, self.preprocess, channel_order)
        m = self.config.vision.merge
        n = gh * gw // (m * m)
        room = self.config.text.max_context - 64   # the chat turn around the image needs some tokens
        if n > room:
            raise ValueError(f"image too large: {n} image tokens ({gw * self.preprocess.patch}x"
                             f"{gh * self.preprocess.patch} pixels after resizing) exceed the context "
                             f"({self.config.text.max_context} tokens); give a smaller image")
        with torch.no_grad():
            feats = self.encode_patches(patches.to(self.device), *self._positions(gh, gw))
        return EncodedImage(feats, (gh // m, gw // m), self.serial)

    def prompt_inputs(self, image: Any, question: str) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(input embeddings [1, T, dim], rotary positions [3, T], rope delta) of a chat turn."""
        enc = self.encode_image(image) if image is not None else None
        ids = self.prompts.chat_ids(question, with_image=enc is not None)
        img_tok = self.config.image_token_id
        if enc is not None and img_tok is not None:   # (encode_image refuses images without one)
            ids = prompt.expand_images(ids, img_tok, [enc.grid[0] * enc.grid[1]])
        if enc is None and img_tok is not None and img_tok in ids:
            raise ValueError("the question holds an image placeholder token but no image was given")
        pos, delta = prompt.positions(ids, img_tok, [enc.grid] if enc else [])
        ids_t = torch.tensor(ids, device=self.device)
        x = text.embed(ids_t, self.text_w)
        if enc is not None:
            x = x.clone()
            x[ids_t == img_tok] = enc.features.to(x.dtype)
        return x[None], pos.to(self.device), delta

    def prefill(self, image: Any, question: str, extra: int) -> tuple[text.DecodeState, torch.Tensor]:
        """A fresh one-row state holding the prompt, room for `extra` more tokens; the last logits [V]."""
        return self.prefill_embedded(*self.prompt_inputs(image, question), extra)

    def prefill_embedded(self, x: torch.Tensor, pos: torch.Tensor, delta: int,
                         extra: int) -> tuple[text.DecodeState, torch.Tensor]:
        """`prefill` of a prompt already embedded (prompt_inputs' or chat_inputs' result)."""
        t = x.shape[1]
        limit = self.config.text.max_context
        if t >= limit:
            raise ValueError(f"prompt of {t} tokens does not fit the context ({limit} tokens)")
        state = text.DecodeState(self.config.text, 1, min(limit, t + max(extra, 1)), self.dtype, self.device)
        state.rope_delta[0] = delta
        with torch.no_grad():
            h = text.prefill(x, pos, state, self.text_w, self.config.text, self.ops)
            return state, text.logits(h[0, -1], self.text_w, self.ops)

    def step(self, ids: torch.Tensor, state: text.DecodeState) -> torch.Tensor:
        """One decode step for every row: ids [B, 1] -> logits [B, V]."""
        if self.decode is not None:
            return self.decode.step(ids, state)
        with torch.no_grad():
            h = text.decode(text.embed(ids, self.text_w), state, self.text_w, self.config.text, self.ops)
            return text.logits(h[:, 0], self.text_w, self.ops)

    # ------------------------------------------------------------------ skills

    # Moondream's signatures (photon_core.contracts): settings as runtime.requests.Settings reads
    # them, the reference's defaults included (temperature 0.5, top_p 0.3, max_tokens 768).
    def query(self, image: Any = None, question: str | None = None, reasoning: bool = False,
              spatial_refs: list[Any] | None = None, stream: bool = False, settings: dict | None = None) -> dict:
        """{"answer": str}, or a generator of text pieces with stream=True. image None: text only.
        reasoning and spatial_refs are Moondream's (NotImplementedError); thinking is chat's."""
        s = text_sampling(FAMILY, settings, reasoning, spatial_refs)
        gen = self._text(image, question or "", s)   # a question without words is refused (prompts.chat_ids)
        return {"answer": gen if stream else "".join(gen)}

    def caption(self, image: Any, length: str = "normal", stream: bool = False, settings: dict | None = None) -> dict:
        """{"caption": str}, or a generator of text pieces with stream=True. length: short/normal/long."""
        s = text_sampling(FAMILY, settings)
        if image is None:
            raise ValueError("caption needs an image")
        gen = self._text(image, _caption_question(length), s)
        return {"caption": gen if stream else "".join(gen)}

    def chat_inputs(self, conversation: chat_messages.Conversation,
                    thinking: bool) -> tuple[torch.Tensor, torch.Tensor, int]:
        """prompt_inputs for a whole conversation (runtime.chat_messages), its images in order."""
        encs = [self.encode_image(image) for image in conversation.images]
        ids = self.prompts.template.encode(self.prompts.tokenizer, conversation.turns, add_generation_prompt=True,
                                           enable_thinking=thinking)
        img_tok = self.config.image_token_id
        if img_tok is None and encs:
            raise ValueError(f"{self.model_id} is a text-only Qwen 3.5 checkpoint: it cannot take images")
        if img_tok is not None:
            ids = prompt.expand_images(ids, img_tok, [e.grid[0] * e.grid[1] for e in encs])
        pos, delta = prompt.positions(ids, img_tok, [e.grid for e in encs])
        ids_t = torch.tensor(ids, device=self.device)
        x = text.embed(ids_t, self.text_w)
        if encs:
            x = x.clone()
            x[ids_t == img_tok] = torch.cat([e.features for e in encs]).to(x.dtype)
        return x[None], pos.to(self.device), delta

    def chat(self, messages: list[dict], stream: bool = False, settings: dict | None = None,
             reasoning: bool | None = None) -> dict:
        """The moondream client's chat (runtime.chat_messages): the conversation through the
        checkpoint's chat template. reasoning (default on, as Qwen 3.5 thinks by default): the
        thinking before "</think>" comes back as the message's "reasoning"."""
        conversation, s = chat_messages.parse(messages), chat_messages.sampling(settings)
        thinking = True if reasoning is None else bool(reasoning)
        state, logits = self.prefill_embedded(*self.chat_inputs(conversation, thinking), s.max_tokens)
        limit = room(s.max_tokens, int(state.length[0]), state.max_len)
        # Split at the token where the tokenizer has one (decoding may drop it as special), else at the text.
        end_id = self.prompts.tokenizer.token_to_id("</think>")
        end = None if not thinking else "</think>" if end_id is None else end_id
        return chat_messages.reply(generate.tokens(self, state, logits, s), self.prompts.decode, limit, stream, end)

    def _text(self, image: Any, question: str, s: generate.Sampling):
        # Prefilled now, so that a bad image or prompt fails at the call even when streaming.
        state, logits = self.prefill(image, question, extra=s.max_tokens)
        return text_pieces(self.prompts.decode, generate.tokens(self, state, logits, s))

    def batch(self, requests: list[Request]) -> list[dict]:
        """caption/query requests decoded together (up to 8 rows, each decode step one batched
        forward); results in order, shaped as the single calls return them (not streamed)."""
        jobs = []
        for r in requests:
            if r.task not in ("query", "caption"):
                raise ValueError(f"a qwen3_5 model cannot {r.task!r}; it offers caption and query")
            s = text_sampling(FAMILY, r.options(), r.reasoning, r.spatial_refs)
            if r.task == "query":
                jobs.append((r.image, r.prompt, s))
            else:
                if r.image is None:
                    raise ValueError("caption needs an image")
                jobs.append((r.image, _caption_question(r.prompt or "normal"), s))
        texts = generate.run_batch(self, jobs, requests) if jobs else []
        return [{"answer": t} if r.task == "query" else {"caption": t} for r, t in zip(requests, texts)]


def _caption_question(length: str) -> str:
    if length not in prompt.CAPTION_PROMPTS:
        raise ValueError(f"caption length must be one of {sorted(prompt.CAPTION_PROMPTS)}, got {length!r}")
    return prompt.CAPTION_PROMPTS[length]


def load_qwen3_5(path: str | Path, device: str | torch.device = "cpu", dtype: Any = "float32",
                 backend: Any = None, model_id: str | None = None, tiling: Any = None,
                 max_len: int | None = None) -> Qwen35Model:
    """A Qwen 3.5 checkpoint folder (config.json, safetensors shards, tokenizer.json, chat template).
    With the megakernel backend: `tiling` (megakernel.compiler.Tiling) and `max_len` (positions the
    compiled decode caches hold) shape the compiled decode steps."""
    from photon_core.backends import reference

    folder = Path(path)
    folder = folder if folder.is_dir() else folder.parent
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"{folder}: no config.json")
    raw = json.loads((folder / "config.json").read_text())
    cfg = Qwen35Config.from_dict(raw)
    dtype = parse_dtype(dtype if dtype is not None else "float32")
    device = torch.device(device)
    state = weights.load_state(folder, cfg, dtype, device)
    eos = (raw.get("text_config") or raw).get("eos_token_id")
    prompts = prompt.Prompts(folder, eos)
    return Qwen35Model(folder, cfg, state, prompts, backend or reference, device, dtype,
                       model_id or folder.name, tiling, max_len)
