"""Public Qwen3-ASR API: `load_qwen3_asr(path)` -> a model with `.transcribe(audio)`, behind the
same interface as Whisper's (photon_core.models.whisper.transcribe).

A clip is one prompt: its audio tokens (13 a second) in the chat template, and a budget of new
tokens (12 a second of audio by default). Prompt plus budget must fit the decoding context
(DECODE_CONTEXT positions: the megakernel's caches, and the reference path chunks as if it had
the same, so both backends cut alike), so long audio is transcribed in chunks cut at quiet points
(runtime.audio_chunks, as Parakeet's), each chunk as long as that context allows
(`Qwen3ASRSpeech.chunk_seconds_for`); the chunks' texts are joined and each is a segment. A clip
that fits one chunk is transcribed exactly as one prompt, as before.
"""
from __future__ import annotations

import time
from pathlib import Path
from types import ModuleType
from typing import Any, Sequence

import numpy as np
import torch

from photon_core.backends import reference
from photon_core.runtime.audio_chunks import chunk_bounds
from photon_core.runtime.audio_frontend import HOP_LENGTH, feature_device
from photon_core.runtime.generate import greedy_tokens
from photon_core.runtime.requests import TranscribeRequest
from photon_core.weights.tensor_files import parse_dtype

from .checkpoint import load_tensors
from .config import Qwen3ASRConfig, load_config
from .decoder import OpsSession, TextDecoder
from .encoder import AudioEncoder, conv_out_length
from .frontend import MIN_SAMPLES, SAMPLE_RATE, log_mel, prepare_audio
from .prompt import Qwen3ASRPrompt, language_code, language_name
from .speech_gate import GateOptions, speech_gate

# Options of Whisper's transcribe that mean nothing here: accepted so callers (the speech node,
# the CLI) can use one call for every family, and ignored (decoding is greedy, one pass, and
# Qwen3-ASR has no timestamp tokens).
_WHISPER_ONLY = {"timestamps", "temperature", "condition_on_previous_text", "beam_size"}

# Positions (prompt plus generated tokens) one transcription prompt is sized for: the megakernel's
# default cache length (megakernel_decode.DEFAULT_MAX_LEN is this number: a position costs
# 2 x layers x kv_heads x head_dim values per bucket row), bounded by the model's own context.
DECODE_CONTEXT = 2048
BUDGET_PER_SECOND = 12    # new tokens allowed per second of audio, unless max_new_tokens is given
MIN_BUDGET = 32           # ... and at least this many
# Positions of the context left unused when sizing chunks: the derivation below is already an
# upper bound (n audio tokens <= rate * seconds + 1), this is slack on top of it.
CONTEXT_SPARE = 1 / 16
MIN_CHUNK_SECONDS = 1.0   # a context that holds less audio than this is refused, not chunked
ROUND_ROWS = 8            # chunks encoded and decoded together (the megakernel's largest bucket)


def _pick_dtype(device: torch.device, dtype: torch.dtype | str | None) -> torch.dtype:
    """bf16 on CUDA, float32 elsewhere, unless asked (weights.parse_dtype checks the choice)."""
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return parse_dtype(dtype)


class Qwen3ASRSpeech:
    """A loaded Qwen3-ASR model. Calls must be serialized (one KV cache per call)."""

    def __init__(self, folder: str | Path, model_id: str = "", device: str = "cpu",
                 dtype: torch.dtype | str | None = None, ops: ModuleType = reference,
                 tiling: Any = None, max_len: int | None = None, chunk_seconds: float | None = None) -> None:
        """ops: the per-op backend; the megakernel backend also decodes each token as one launch
        of the compiled step (megakernel_decode.py), with `tiling` (megakernel.compiler.Tiling,
        None = its default) and a context of `max_len` positions (None = DEFAULT_MAX_LEN).
        chunk_seconds: the longest chunk long audio is cut into; None (or longer than the
        context holds) = as long as the context holds (see `chunk_seconds_for`)."""
        folder = Path(folder)
        self.folder = folder
        self.device = torch.device(device)
        self.dtype = _pick_dtype(self.device, dtype)
        self.config: Qwen3ASRConfig = load_config(folder)
        self.prompt = Qwen3ASRPrompt(folder, self.config.audio_token_id)
        sd = load_tensors(folder, self.config)
        self.ops = ops
        self.encoder = AudioEncoder(sd, self.config.audio, ops, self.device, self.dtype)
        self.decoder = TextDecoder(sd, self.config.text, ops, self.device, self.dtype)
        self.model_id = model_id or folder.name
        self.gate_options = GateOptions()
        if chunk_seconds is not None and not chunk_seconds > 0:
            raise ValueError(f"chunk_seconds must be positive, got {chunk_seconds}")
        self.chunk_seconds = chunk_seconds
        self.megakernel = None
        if getattr(ops, "COMPILES_STEPS", False):
            from photon_core.megakernel.compiler import Tiling

            from .megakernel_decode import MegakernelDecode
            self.megakernel = MegakernelDecode(self.decoder, sd, tiling or Tiling(), max_len)
        elif tiling is not None or max_len is not None:
            raise ValueError("tiling and max_len apply to the megakernel backend only")

    # ---------------------------------------------------------------- the pieces, public for tests

    def features(self, pcm: np.ndarray) -> tuple[torch.Tensor, int]:
        """16 kHz float audio -> (log-mel [n_mels, frames padded to chunks], valid frames)."""
        a = self.config.audio
        return log_mel(pcm, a.n_mels, a.chunk_frames, feature_device(self.device))

    @torch.inference_mode()
    def encode(self, mel: torch.Tensor, frames: int) -> torch.Tensor:
        """Audio tokens [n, text hidden] in the decoder's embedding space."""
        return self.encoder.encode(mel, frames)

    def prompt_ids(self, n_audio: int, language: str | None, context: str | None) -> list[int]:
        return self.prompt.prompt_ids(n_audio, language, context)

    @torch.inference_mode()
    def prompt_embeds(self, ids: list[int], audio: torch.Tensor) -> torch.Tensor:
        """The prompt's embeddings with the audio tokens in the audio pads' places."""
        tokens = torch.tensor(ids, device=self.device)
        embeds = self.decoder.embed_tokens(tokens).clone()
        where = tokens == self.config.audio_token_id
        if int(where.sum()) != audio.shape[0]:
            raise ValueError(f"{int(where.sum())} audio pads for {audio.shape[0]} audio tokens")
        embeds[where] = audio.to(embeds.dtype)
        return embeds

    @torch.inference_mode()
    def generate(self, prompts: Sequence[torch.Tensor], max_new_tokens: int | Sequence[int]) -> list[list[int]]:
        """Greedy decoding of several prompts' embeddings at once (one cache row each) until each
        emits a stop token or `max_new_tokens` (or each row's own); the ids, stop token excluded
        (runtime.generate's loop; on the megakernel in rounds on the device)."""
        if self.megakernel is not None:
            return self.megakernel.generate(prompts, max_new_tokens, self.config.eos_token_ids)
        if not prompts:
            return []
        budgets = [max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int) else list(max_new_tokens)
        session = OpsSession(self.decoder, prompts, max(p.shape[0] + n for p, n in zip(prompts, budgets)))
        return greedy_tokens(session, len(prompts), max_new_tokens, self.config.eos_token_ids, self.ops)

    # ---------------------------------------------------------------- the face to the nodes

    def _check_options(self, options: dict[str, Any]) -> tuple[int | None, bool]:
        unknown = set(options) - _WHISPER_ONLY - {"max_new_tokens", "speech_gate"}
        if unknown:
            raise TypeError(f"transcribe() got unexpected options {sorted(unknown)}")
        if options.get("beam_size", 1) != 1:
            raise NotImplementedError("beam search is not implemented for Qwen3-ASR; use beam_size=1")
        max_new = options.get("max_new_tokens")
        # checked here, before any model work: 0 read as "no limit given" (the default budget), a
        # negative one failed after the encoder as a cache overflow, a fractional one in torch
        if max_new is not None and (isinstance(max_new, bool) or not isinstance(max_new, (int, np.integer))
                                    or max_new < 1):
            raise ValueError(f"max_new_tokens must be a whole number >= 1 (None: {BUDGET_PER_SECOND} a second "
                             f"of audio, at least {MIN_BUDGET}), got {max_new!r}")
        return (None if max_new is None else int(max_new)), bool(options.get("speech_gate", True))

    def transcribe(self, audio: np.ndarray, sample_rate: int = SAMPLE_RATE, language: str | None = None,
                   initial_prompt: str | None = None, **options: Any) -> dict:
        """Transcribe mono or [samples, channels] int/float PCM at any sample rate.

        language: a code ("en") or name ("English") to force, None to let the model say which.
        initial_prompt: context text (names, terms) given to the model as its system turn.
        options: max_new_tokens (per chunk; default: 12 per second of audio, at least 32),
        speech_gate (default True: silence and noise give empty text without running the model,
        and so does a chunk of long audio); Whisper's timestamps / temperature /
        condition_on_previous_text are accepted and ignored. Audio longer than the decoding
        context holds is transcribed in chunks (see the module's note).
        Returns text (the chunks' texts joined by spaces), segments (one per chunk with text, its
        start and end: no finer timestamps in this model), language (a code, None if
        undetermined; without `language`, the first chunk's the model named), duration,
        processing_time, no_speech_prob (1.0 when the gate found no speech, else 0.0), model_id.
        ValueError on empty/NaN/inf audio, a bad sample rate, or a prompt (initial_prompt,
        max_new_tokens) that leaves the context no room for audio.
        """
        return self.batch([TranscribeRequest(audio, sample_rate, language, initial_prompt, options)])[0]

    def transcribe_batch(self, clips: Sequence[tuple[np.ndarray, int]], language: str | None = None,
                         initial_prompt: str | None = None, **options: Any) -> list[dict]:
        """`transcribe` for several utterances at once, with the same options for all."""
        return self.batch([TranscribeRequest(a, r, language, initial_prompt, options) for a, r in clips])

    def batch(self, requests: Sequence[TranscribeRequest | dict]) -> list[dict]:
        """Several `transcribe` calls at once: runtime.requests.TranscribeRequest (or dicts of
        transcribe()'s keyword arguments: audio, sample_rate, language, initial_prompt, options), each
        its own; result i is transcribe(**requests[i].kwargs()). Each utterance past the speech gate
        is cut into chunks (`plan`: one when it fits the context); the chunks of all of them are
        encoded in one pass (encoder.encode_many), prefilled one by one, then decoded together (one
        batched step per token, each row to its own budget), ROUND_ROWS chunks at a time. The first
        bad request (or one that cannot fit the context) raises before any model work."""
        start = time.perf_counter()
        asked = [self._request(**TranscribeRequest.of(r).kwargs()) for r in requests]
        prepared = [(prepare_audio(a, r), lang, ctx, max_new, gate) for a, r, lang, ctx, max_new, gate in asked]
        plans = [self.plan(pcm, lang, ctx, max_new, gate) for pcm, lang, ctx, max_new, gate in prepared]
        pieces = [(i, a, b) for i, chunks in enumerate(plans) for a, b in chunks or ()]
        outputs: list[list[int]] = []
        for r in range(0, len(pieces), ROUND_ROWS):
            round_ = pieces[r:r + ROUND_ROWS]
            with torch.inference_mode():
                audio = self.encoder.encode_many([self.features(prepared[i][0][a:b]) for i, a, b in round_])
            prompts, budgets = [], []
            for (i, a, b), tokens in zip(round_, audio):
                _, lang, ctx, max_new, _ = prepared[i]
                prompts.append(self.prompt_embeds(self.prompt_ids(tokens.shape[0], lang, ctx), tokens))
                budgets.append(self._budget(b - a, max_new))
            outputs += self.generate(prompts, budgets)
        decoded: list[list[tuple[int, int, list[int]]]] = [[] for _ in prepared]
        for (i, a, b), ids in zip(pieces, outputs):
            decoded[i].append((a, b, ids))
        results = []
        for (pcm, language, *_), chunks, parts in zip(prepared, plans, decoded):
            duration = len(pcm) / SAMPLE_RATE
            forced = language_code(language_name(language)) if language else None
            segments: list[dict[str, Any]] = []
            texts: list[str] = []
            detected: list[str | None] = []
            for a, b, ids in parts:
                piece, lang = self.prompt.parse(ids, language)
                detected.append(lang)
                if piece:
                    texts.append(piece)
                    segments.append({"start": round(a / SAMPLE_RATE, 3), "end": round(b / SAMPLE_RATE, 3),
                                     "text": piece})
            results.append({
                "text": " ".join(texts),
                "segments": segments,
                # forced, or the first chunk's the model named
                "language": forced or next((d for d in detected if d), None),
                "duration": duration,
                "processing_time": time.perf_counter() - start,
                "no_speech_prob": 0.0 if chunks else 1.0,
                "model_id": self.model_id,
            })
        return results

    # ---------------------------------------------------------------- long audio: chunk sizes

    @property
    def context(self) -> int:
        """Positions one prompt plus its new tokens may take: the megakernel's caches, or on the
        other backends the same default (so every backend cuts the same chunks)."""
        if self.megakernel is not None:
            return int(self.megakernel.max_len)
        return min(DECODE_CONTEXT, self.config.text.max_positions)

    @property
    def position_limit(self) -> int:
        """Positions one prompt plus its new tokens can take at all: the megakernel's caches, or
        the text model's positions (a clip within it that needs no chunking is one prompt)."""
        if self.megakernel is not None:
            return int(self.megakernel.max_len)
        return int(self.config.text.max_positions)

    def audio_tokens(self, samples: int) -> int:
        """Audio tokens the encoder makes of `samples` 16 kHz samples (frontend + encoder_many's
        count: conv_out_length of each chunk_frames-frame chunk's valid frames)."""
        frames = max(samples, MIN_SAMPLES) // HOP_LENGTH
        full, rest = divmod(frames, self.config.audio.chunk_frames)
        return full * conv_out_length(self.config.audio.chunk_frames) + conv_out_length(rest)

    @staticmethod
    def _budget(samples: int, max_new: int | None) -> int:
        return max_new or max(MIN_BUDGET, int(BUDGET_PER_SECOND * samples / SAMPLE_RATE))

    def chunk_seconds_for(self, language: str | None, context: str | None, max_new: int | None,
                          fixed: int | None = None) -> float:
        """The longest chunk (seconds) whose prompt plus budget fits `context` positions, less
        CONTEXT_SPARE of them. A chunk of s seconds holds at most rate * s + 1 audio tokens (rate:
        conv_out_length(chunk_frames) tokens per chunk_frames mel frames, 13 a second; a part chunk
        of r frames gives ceil(r / 8) <= rate-per-frame * r + 1), the prompt's other `fixed`
        tokens, and a budget of max_new, or max(MIN_BUDGET, BUDGET_PER_SECOND * s): the decode
        needs fixed + audio + budget - 1 positions, so rate * s + budget <= room = context - spare
        - fixed. With the real 0.6B/1.7B and the default 2048: (2048 - 128 - 19) / (13 + 12) = 76 s.
        `chunk_seconds` (the constructor's), when shorter, wins. `fixed`: the prompt's length where
        the caller has it. ValueError when the context holds less than MIN_CHUNK_SECONDS of audio."""
        a = self.config.audio
        rate = conv_out_length(a.chunk_frames) / (a.chunk_frames * HOP_LENGTH / SAMPLE_RATE)
        if fixed is None:
            fixed = len(self.prompt_ids(0, language, context))
        room = self.context - int(self.context * CONTEXT_SPARE) - fixed
        if max_new:
            seconds = (room - max_new) / rate
        else:
            seconds = room / (rate + BUDGET_PER_SECOND)
            if BUDGET_PER_SECOND * seconds < MIN_BUDGET:   # the floor of the budget rules
                seconds = (room - MIN_BUDGET) / rate
        if seconds < MIN_CHUNK_SECONDS:
            raise ValueError(
                f"Qwen3-ASR cannot fit even {MIN_CHUNK_SECONDS:g} s of audio in its decoding context of "
                f"{self.context} positions: the prompt takes {fixed} tokens besides the audio "
                f"(initial_prompt included) and each chunk's budget is "
                f"{max_new or f'{BUDGET_PER_SECOND} tokens a second'}; "
                "use a shorter initial_prompt or a smaller max_new_tokens, or load with a larger max_len")
        return min(seconds, self.chunk_seconds) if self.chunk_seconds is not None else seconds

    def plan(self, pcm: np.ndarray, language: str | None, context: str | None, max_new: int | None,
             gate: bool = True) -> list[tuple[int, int]] | None:
        """The [start, end) sample ranges of 16 kHz `pcm` to transcribe: None when the gate finds
        no speech in the clip; else its chunks (runtime.audio_chunks, `chunk_seconds_for` long:
        one, the whole clip, when it fits), less those the gate finds no speech in. ValueError
        (before any model work) when a chunk's prompt plus budget cannot fit the context."""
        if gate and not speech_gate(pcm, SAMPLE_RATE, self.gate_options).speech:
            return None
        fixed = len(self.prompt_ids(0, language, context))
        whole = fixed + self.audio_tokens(len(pcm)) + self._budget(len(pcm), max_new) - 1
        short = self.chunk_seconds is None or len(pcm) <= self.chunk_seconds * SAMPLE_RATE
        if short and whole <= self.position_limit:
            # one prompt, as before chunking existed: no chunk sizing (its spare, its refusals) applies
            return [(0, len(pcm))]
        bounds = chunk_bounds(pcm, SAMPLE_RATE, self.chunk_seconds_for(language, context, max_new, fixed))
        if gate and len(bounds) > 1:
            bounds = [(a, b) for a, b in bounds if speech_gate(pcm[a:b], SAMPLE_RATE, self.gate_options).speech]
        for a, b in bounds:   # chunk_seconds_for's bound makes this hold; checked, not assumed
            need = fixed + self.audio_tokens(b - a) + self._budget(b - a, max_new) - 1
            if need > self.context:
                raise ValueError(f"a chunk of {(b - a) / SAMPLE_RATE:.2f} s needs {need} positions (prompt plus "
                                 f"budget), more than the decoding context of {self.context}")
        return bounds

    def _request(self, audio: np.ndarray, sample_rate: int = SAMPLE_RATE, language: str | None = None,
                 initial_prompt: str | None = None, **options: Any) -> tuple:
        """transcribe()'s arguments checked (an unknown option or language fails before any work)."""
        max_new, gate = self._check_options(options)
        if language is not None:
            language_name(language)
        return audio, sample_rate, language, initial_prompt, max_new, gate

    def check_language(self, language: str | None) -> None:
        """ValueError when `language` (a code or a name; None: detect it) is not one of the model's."""
        if language is not None:
            language_name(language)

    def warmup(self, language: str | None = None, initial_prompt: str | None = None) -> None:
        """Run every path a first command takes, once, at startup: the resampler (48 kHz input),
        the gate, and (past the gate, on a tone burst train) the encoder, prefill and a few
        decode steps with the prompt options later calls will use."""
        silence = np.zeros(48_000, np.float32)
        self.transcribe(silence, 48_000, language=language, initial_prompt=initial_prompt)
        t = np.arange(16_000) / 16_000
        bursts = (0.3 * np.sin(2 * np.pi * 180 * t) * (np.sin(2 * np.pi * 3 * t) > 0)).astype(np.float32)
        self.transcribe(bursts, 16_000, language=language, initial_prompt=initial_prompt,
                        max_new_tokens=4, speech_gate=False)


def load_qwen3_asr(path: str | Path, device: str = "cpu", dtype: torch.dtype | str | None = None,
                   ops: ModuleType | None = None, backend: str = "auto", tiling: Any = None,
                   max_len: int | None = None, chunk_seconds: float | None = None) -> Qwen3ASRSpeech:
    """Load Qwen3-ASR from a checkpoint folder (config.json, model*.safetensors, tokenizer.json,
    chat template). backend: "reference", "triton", "megakernel" or "auto"; `ops` overrides it.
    With the megakernel, the encoder and prefill run on its per-op kernels and every decoded token
    is one launch of the compiled step (`tiling`, context `max_len`: see Qwen3ASRSpeech); long audio
    goes in chunks of at most `chunk_seconds` (None: as long as the context holds)."""
    from photon_core.backends.select import get_backend

    chosen = ops or get_backend(backend, device)
    return Qwen3ASRSpeech(path, device=device, dtype=dtype, ops=chosen, tiling=tiling, max_len=max_len,
                          chunk_seconds=chunk_seconds)


__all__ = ["Qwen3ASRSpeech", "load_qwen3_asr"]
