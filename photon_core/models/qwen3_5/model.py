"""The Qwen 3.5 model and its skills (query, caption, batch), on any ops backend."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from photon_core.runtime.image_input import ImageLike
from photon_core.runtime.requests import DEFAULT_MAX_TOKENS, Request
from photon_core.runtime.text_stream import text_pieces
from photon_core.weights.tensor_files import parse_dtype

from . import generate, prompt, text, vision, weights
from .config import Qwen35Config


@dataclass
class EncodedImage:
    """An image's vision features [tokens, dim] and its merged-token grid (rows, cols)."""
    features: torch.Tensor
    grid: tuple[int, int]


class Qwen35Model:
    """Qwen 3.5 on one ops backend. With the megakernel backend, `decode` (megakernel_decode.py)
    runs every decode step as one launch of the compiled step graph; prefill and the vision encoder
    stay on the per-op kernels. Results are the same."""

    def __init__(self, folder: Path, cfg: Qwen35Config, state: dict[str, torch.Tensor], prompts: prompt.Prompts,
                 ops: Any, device: torch.device, dtype: torch.dtype, model_id: str, tiling: Any = None,
                 max_len: int | None = None) -> None:
        self.config, self.prompts, self.ops = cfg, prompts, ops
        self.device, self.dtype, self.model_id = device, dtype, model_id
        self.text_w = text.TextWeights(state, cfg.text)
        self.vision_w = vision.VisionWeights(state, cfg.vision) if cfg.vision else None
        self.preprocess = vision.Preprocess.from_folder(folder, cfg.vision) if cfg.vision else None
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(0)
        self.decode = None
        if getattr(ops, "NAME", "") == "megakernel":
            from photon_core.megakernel.compiler import Tiling

            from .megakernel_decode import MegakernelDecode
            self.decode = MegakernelDecode(self, tiling or Tiling(), max_len)

    # ------------------------------------------------------------------ model pieces

    def encode_image(self, image: ImageLike | EncodedImage, channel_order: str = "rgb") -> EncodedImage:
        """Preprocess and run the vision encoder (image input: runtime.image_input; BGR arrays need
        channel_order="bgr"). ValueError for an unusable or too large image."""
        if isinstance(image, EncodedImage):
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
            feats = vision.encode(patches, (gh, gw), self.vision_w, self.config.vision, self.ops)
        return EncodedImage(feats, (gh // m, gw // m))

    def prompt_inputs(self, image: Any, question: str) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(input embeddings [1, T, dim], rotary positions [3, T], rope delta) of a chat turn."""
        enc = self.encode_image(image) if image is not None else None
        ids = self.prompts.chat_ids(question, with_image=enc is not None)
        img_tok = self.config.image_token_id
        counts = [enc.grid[0] * enc.grid[1]] if enc is not None else []
        ids = prompt.expand_images(ids, img_tok, counts) if enc is not None else ids
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
        x, pos, delta = self.prompt_inputs(image, question)
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

    def query(self, image: Any, question: str, stream: bool = False, max_tokens: int = DEFAULT_MAX_TOKENS,
              temperature: float = 0.0, top_p: float = 1.0) -> dict:
        """{"answer": str}, or a generator of text pieces with stream=True. image None: text only."""
        if not isinstance(question, str) or not question.strip():
            raise ValueError("query needs a non-empty question")
        gen = self._text(image, question, generate.Sampling(max_tokens, temperature, top_p))
        return {"answer": gen if stream else "".join(gen)}

    def caption(self, image: Any, length: str = "normal", stream: bool = False, max_tokens: int = DEFAULT_MAX_TOKENS,
                temperature: float = 0.0, top_p: float = 1.0) -> dict:
        """{"caption": str}, or a generator of text pieces with stream=True. length: short/normal/long."""
        if image is None:
            raise ValueError("caption needs an image")
        gen = self._text(image, _caption_question(length), generate.Sampling(max_tokens, temperature, top_p))
        return {"caption": gen if stream else "".join(gen)}

    def _text(self, image: Any, question: str, s: generate.Sampling):
        # Prefilled now, so that a bad image or prompt fails at the call even when streaming.
        state, logits = self.prefill(image, question, extra=s.max_tokens)
        return text_pieces(self.prompts.decode, generate.tokens(self, state, logits, s))

    def batch(self, requests: list[Request]) -> list[dict]:
        """caption/query requests decoded together (up to 8 rows, each decode step one batched
        forward); results in order, shaped as the single calls return them (not streamed)."""
        jobs = []
        for r in requests:
            if r.task == "query":
                jobs.append((r.image, r.prompt, generate.Sampling(r.max_tokens, r.temperature, r.top_p)))
            elif r.task == "caption":
                if r.image is None:
                    raise ValueError("caption needs an image")
                jobs.append((r.image, _caption_question(r.prompt or "normal"),
                             generate.Sampling(r.max_tokens, r.temperature, r.top_p)))
            else:
                raise ValueError(f"a qwen3_5 model cannot {r.task!r}; it offers caption and query")
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
