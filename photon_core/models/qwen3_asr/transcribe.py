"""Public Qwen3-ASR API: `load_qwen3_asr(path)` -> a model with `.transcribe(audio)`, behind the
same interface as Whisper's (photon_core.models.whisper.transcribe)."""
from __future__ import annotations

import time
from pathlib import Path
from types import ModuleType
from typing import Any, Sequence

import numpy as np
import torch

from photon_core.backends import reference
from photon_core.runtime.audio_frontend import feature_device
from photon_core.runtime.generate import greedy_tokens
from photon_core.runtime.requests import TranscribeRequest
from photon_core.weights.tensor_files import parse_dtype

from .checkpoint import load_tensors
from .config import Qwen3ASRConfig, load_config
from .decoder import OpsSession, TextDecoder
from .encoder import AudioEncoder
from .frontend import SAMPLE_RATE, log_mel, prepare_audio
from .prompt import Qwen3ASRPrompt, language_code, language_name
from .speech_gate import GateOptions, speech_gate

# Options of Whisper's transcribe that mean nothing here: accepted so callers (the speech node,
# the CLI) can use one call for every family, and ignored (decoding is greedy, one pass, and
# Qwen3-ASR has no timestamp tokens).
_WHISPER_ONLY = {"timestamps", "temperature", "condition_on_previous_text", "beam_size"}


def _pick_dtype(device: torch.device, dtype: torch.dtype | str | None) -> torch.dtype:
    """bf16 on CUDA, float32 elsewhere, unless asked (weights.parse_dtype checks the choice)."""
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return parse_dtype(dtype)


class Qwen3ASRSpeech:
    """A loaded Qwen3-ASR model. Calls must be serialized (one KV cache per call)."""

    def __init__(self, folder: str | Path, model_id: str = "", device: str = "cpu",
                 dtype: torch.dtype | str | None = None, ops: ModuleType = reference,
                 tiling: Any = None, max_len: int | None = None) -> None:
        """ops: the per-op backend; the megakernel backend also decodes each token as one launch
        of the compiled step (megakernel_decode.py), with `tiling` (megakernel.compiler.Tiling,
        None = its default) and a context of `max_len` positions (None = DEFAULT_MAX_LEN)."""
        folder = Path(folder)
        self.folder = folder
        self.device = torch.device(device)
        self.dtype = _pick_dtype(self.device, dtype)
        self.config: Qwen3ASRConfig = load_config(folder)
        self.prompt = Qwen3ASRPrompt(folder, self.config.audio_token_id)
        sd = load_tensors(folder)
        self.ops = ops
        self.encoder = AudioEncoder(sd, self.config.audio, ops, self.device, self.dtype)
        self.decoder = TextDecoder(sd, self.config.text, ops, self.device, self.dtype)
        self.model_id = model_id or folder.name
        self.gate_options = GateOptions()
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
        return options.get("max_new_tokens"), bool(options.get("speech_gate", True))

    def transcribe(self, audio: np.ndarray, sample_rate: int = SAMPLE_RATE, language: str | None = None,
                   initial_prompt: str | None = None, **options: Any) -> dict:
        """Transcribe mono or [samples, channels] int/float PCM at any sample rate.

        language: a code ("en") or name ("English") to force, None to let the model say which.
        initial_prompt: context text (names, terms) given to the model as its system turn.
        options: max_new_tokens (default: 12 per second of audio, at least 32), speech_gate
        (default True: silence and noise give empty text without running the model); Whisper's
        timestamps / temperature / condition_on_previous_text are accepted and ignored.
        Returns text, segments (one, the whole clip: no timestamps in this model), language (a
        code, None if undetermined), duration, processing_time, no_speech_prob (1.0 when the
        gate found no speech, else 0.0), model_id. ValueError on empty/NaN/inf audio or a bad
        sample rate.
        """
        return self.batch([TranscribeRequest(audio, sample_rate, language, initial_prompt, options)])[0]

    def transcribe_batch(self, clips: Sequence[tuple[np.ndarray, int]], language: str | None = None,
                         initial_prompt: str | None = None, **options: Any) -> list[dict]:
        """`transcribe` for several utterances at once, with the same options for all."""
        return self.batch([TranscribeRequest(a, r, language, initial_prompt, options) for a, r in clips])

    def batch(self, requests: Sequence[TranscribeRequest | dict]) -> list[dict]:
        """Several `transcribe` calls at once: runtime.requests.TranscribeRequest (or dicts of
        transcribe()'s keyword arguments: audio, sample_rate, language, initial_prompt, options), each
        its own; result i is transcribe(**requests[i].kwargs()). The utterances past the speech gate are encoded in one pass
        (encoder.encode_many), prefilled one by one, then decoded together (one batched step per
        token, each row to its own budget). The first bad request raises before any model work."""
        start = time.perf_counter()
        asked = [self._request(**TranscribeRequest.of(r).kwargs()) for r in requests]
        prepared = [(prepare_audio(a, r), lang, ctx, max_new, gate) for a, r, lang, ctx, max_new, gate in asked]
        speech = [speech_gate(pcm, SAMPLE_RATE, self.gate_options).speech if gate else True
                  for pcm, *_, gate in prepared]
        talking = [p for p, s in zip(prepared, speech) if s]
        prompts, budgets = [], []
        if talking:
            with torch.inference_mode():
                audio = self.encoder.encode_many([self.features(pcm) for pcm, *_ in talking])
            for (pcm, lang, ctx, max_new, _), tokens in zip(talking, audio):
                prompts.append(self.prompt_embeds(self.prompt_ids(tokens.shape[0], lang, ctx), tokens))
                budgets.append(max_new or max(32, int(12 * len(pcm) / SAMPLE_RATE)))
        outputs = self.generate(prompts, budgets) if prompts else []
        results, it = [], iter(outputs)
        for (pcm, language, *_), has_speech in zip(prepared, speech):
            duration = len(pcm) / SAMPLE_RATE
            text, lang = "", (language_code(language_name(language)) if language else None)
            if has_speech:
                text, lang = self.prompt.parse(next(it), language)
            results.append({
                "text": text,
                "segments": [{"start": 0.0, "end": round(duration, 3), "text": text}] if text else [],
                "language": lang,
                "duration": duration,
                "processing_time": time.perf_counter() - start,
                "no_speech_prob": 0.0 if has_speech else 1.0,
                "model_id": self.model_id,
            })
        return results

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
                   max_len: int | None = None) -> Qwen3ASRSpeech:
    """Load Qwen3-ASR from a checkpoint folder (config.json, model*.safetensors, tokenizer.json,
    chat template). backend: "reference", "triton", "megakernel" or "auto"; `ops` overrides it.
    With the megakernel, the encoder and prefill run on its per-op kernels and every decoded token
    is one launch of the compiled step (`tiling`, context `max_len`: see Qwen3ASRSpeech)."""
    from photon_core.backends.select import get_backend

    chosen = ops or get_backend(backend, device)
    return Qwen3ASRSpeech(path, device=device, dtype=dtype, ops=chosen, tiling=tiling, max_len=max_len)


__all__ = ["Qwen3ASRSpeech", "load_qwen3_asr"]
