"""Parakeet's face to the nodes: `transcribe(samples, sample_rate, ...)` -> text, segments, words.

Audio is validated and resampled to the model's rate, checked by the weight-independent speech
gate (speech_gate.py), cut into chunks at quiet points when long (runtime.audio_chunks; a chunk the
gate finds no speech in is skipped), and each chunk runs front end ->
encoder -> greedy TDT; the prediction network's state carries from one chunk to the next. Token
times come from the durations: a token read at encoder frame t starts at t * frame_seconds and
lasts its duration (at least one frame), within its own chunk; a punctuation mark (a token that
decodes to one punctuation character of the vocabulary) after the first token starts and ends
where the token before it ends, as NeMo's TDT timestamps (and transformers' processor) have it:
the model often emits a mark long after its word, after the pause that follows it. Words start at
tokens carrying SentencePiece's "▁", and only there (a word a chunk cut splits stays one word, as
in the text), punctuation marks never (NeMo's words: a mark joins the word before it); segments
end at sentence punctuation, at a pause of more than `segment_gap` seconds, or at the first word
of a new chunk.
"""
from __future__ import annotations

import time
from pathlib import Path
from types import ModuleType
from typing import Any, Sequence

import numpy as np
import torch

from photon_core.runtime.audio_chunks import chunk_bounds
from photon_core.runtime.requests import TranscribeRequest

from . import speech_gate
from .checkpoint import ParakeetCheckpoint, load as load_checkpoint
from .frontend import LogMel, prepare_audio
from .model import ParakeetModel
from .tdt import DecoderState, greedy_tdt_many

# Options the Whisper model takes that mean nothing to a transducer: accepted and ignored, so a
# caller can switch families without changing its calls (task only as "transcribe", beam_size only
# as 1: `_request` refuses the others).
WHISPER_ONLY_OPTIONS = frozenset({
    "timestamps", "temperature", "beam_size", "condition_on_previous_text", "no_speech_threshold",
    "logprob_threshold", "compression_ratio_threshold", "word_timestamps", "task", "prompt",
})
_SENTENCE_END = (".", "?", "!", "。", "？", "！")


class ParakeetSpeech:
    def __init__(self, checkpoint: ParakeetCheckpoint, model_id: str, device: str = "cpu",
                 dtype: torch.dtype = torch.float32, ops: ModuleType | None = None,
                 chunk_seconds: float = 60.0, segment_gap: float = 1.0) -> None:
        from photon_core.backends import reference

        self.cfg = checkpoint.config
        self.vocab = checkpoint.vocab
        self.model_id = model_id
        self.device = torch.device(device)
        self.model = ParakeetModel(checkpoint.tensors, self.cfg, ops or reference, self.device, dtype)
        self.mel = LogMel(self.cfg.frontend, checkpoint.mel_filters, checkpoint.window)
        self.chunk_seconds = chunk_seconds
        self.segment_gap = segment_gap

    def check_language(self, language: str | None) -> None:
        """ValueError for any `language` (None passes): Parakeet cannot be told one. It transcribes
        what it hears (v2: English only; v3: 25 European languages) and does not say which, so a
        language asked for would be ignored, and a node echoing it would claim what the model
        never used."""
        if language:
            raise ValueError(f"Parakeet TDT cannot be told a language (it transcribes what it hears and does "
                             f"not say which), so {language!r} would be ignored; leave it empty")

    def check_prompt(self, initial_prompt: str | None) -> None:
        """ValueError for any `initial_prompt` (None passes): Parakeet reads no prompt."""
        if initial_prompt:
            raise ValueError("Parakeet TDT reads no prompt, so it would be ignored; leave it empty")

    def warmup(self, language: str | None = None, initial_prompt: str | None = None) -> None:
        """Run the whole path once (resampler, front end, encoder, decode loop) so the first real
        request pays no first-call costs. The gate would stop silence before the model, so the
        model is run directly on one second of a tone as well."""
        self.transcribe(np.zeros(48_000, np.float32), 48_000, language=language, initial_prompt=initial_prompt)
        tone = (0.1 * np.sin(np.arange(self.cfg.frontend.sample_rate) * 0.05)).astype(np.float32)
        self._decode_chunk(tone, None)

    def _decode_chunk(self, pcm: np.ndarray, state: DecoderState | None):
        return self._decode_chunks([pcm], [state])[0]

    @torch.inference_mode()
    def _decode_chunks(self, pcms: list[np.ndarray], states: list[DecoderState | None]):
        """Front end per clip, then the encoder over the clips right-padded together (each row
        masked to its own length) and greedy TDT with every row stepping at once."""
        mels = [self.mel(p) for p in pcms]
        lengths = torch.tensor([m.shape[0] for m in mels])
        mel = torch.nn.utils.rnn.pad_sequence(mels, batch_first=True).to(self.device)
        enc = self.model.encode(mel, lengths)
        frames = self.model.subsampled_lengths(lengths).tolist()
        return greedy_tdt_many(self.model, self.model.project_encoder(enc), frames, states,
                               max_symbols=self.cfg.max_symbols_per_step)

    def transcribe(self, audio: np.ndarray, sample_rate: int = 16000, language: str | None = None,
                   initial_prompt: str | None = None, **options) -> dict:
        """Mono or [samples, channels] int/float PCM at any rate -> {"text", "segments" [{start, end,
        text}], "words", "tokens", "language", "duration", "processing_time", "model_id"}. Parakeet
        has no prompt and no language switch (v3 recognises its 25 languages by itself): `language`
        is reported back as given ("" when None), `initial_prompt` is ignored (check_language and
        check_prompt refuse both, for callers that must not have them ignored: the speech node), and
        so are Whisper's decoding options (WHISPER_ONLY_OPTIONS; task="translate" and beam_size != 1
        are a NotImplementedError); others are a TypeError.
        ValueError on empty / NaN / inf audio or a bad sample rate."""
        return self.batch([TranscribeRequest(audio, sample_rate, language, initial_prompt, options)])[0]

    def batch(self, requests: Sequence[TranscribeRequest | dict]) -> list[dict]:
        """Several `transcribe` calls at once (runtime.requests.TranscribeRequest, or dicts of
        transcribe()'s keyword arguments); result i is transcribe(**requests[i].kwargs()). Long audio
        is cut into chunks as alone; round r decodes the r-th speech chunk of every utterance that
        has one in one batch (encoder over the padded chunks, TDT rows stepping together), each row
        carrying its own prediction state from its previous chunk. The first bad request raises
        before any model work."""
        start = time.perf_counter()
        sr = self.cfg.frontend.sample_rate
        asked = [self._request(**TranscribeRequest.of(r).kwargs()) for r in requests]
        pcms = [prepare_audio(audio, rate, sr) for audio, rate, _ in asked]
        plans = []   # per request: the speech chunks (index, first sample, end sample); None: no speech
        for pcm in pcms:
            chunks = None
            if speech_gate.has_speech(pcm, sr):
                chunks = []
                for n, (a, b) in enumerate(chunk_bounds(pcm, sr, self.chunk_seconds)):
                    # a chunk of only silence or noise is not shown to the model either
                    if self.mel.frames(b - a) >= 2 and speech_gate.has_speech(pcm[a:b], sr):
                        chunks.append((n, a, b))
            plans.append(chunks)
        tokens: list[list[tuple[int, float, float, int]]] = [[] for _ in requests]   # token, start s, end s, chunk
        states: list[DecoderState | None] = [None] * len(requests)
        fs = self.cfg.frame_seconds
        for r in range(max((len(c or ()) for c in plans), default=0)):
            rows = [i for i, chunks in enumerate(plans) if len(chunks or ()) > r]
            decoded = self._decode_chunks([pcms[i][plans[i][r][1]:plans[i][r][2]] for i in rows],
                                          [states[i] for i in rows])
            for i, (steps, state) in zip(rows, decoded):
                n, a, b = plans[i][r]
                states[i] = state
                # A token's duration can reach past its chunk's end (the last frame's padding):
                # its times are kept within its own chunk (so within the audio, as Whisper's are),
                # never reaching into the next chunk's first word.
                end_s = b / sr
                for tok, dur, frame in zip(steps.tokens, steps.durations, steps.frames):
                    if tok != self.cfg.blank_id:
                        tokens[i].append((tok, min(a / sr + frame * fs, end_s),
                                          min(a / sr + (frame + max(dur, 1)) * fs, end_s), n))
        results = []
        for pcm, (_, _, language), chunks, toks in zip(pcms, asked, plans, tokens):
            result: dict[str, Any] = {"text": "", "segments": [], "words": [], "language": language or "",
                      "duration": len(pcm) / sr, "model_id": self.model_id}
            if chunks is not None:
                result.update(self._assemble(toks))
            result["processing_time"] = time.perf_counter() - start
            results.append(result)
        return results

    @staticmethod
    def _request(audio: np.ndarray, sample_rate: int = 16000, language: str | None = None,
                 initial_prompt: str | None = None, **options) -> tuple:
        unknown = set(options) - WHISPER_ONLY_OPTIONS
        if unknown:
            raise TypeError(f"transcribe() got unexpected options {sorted(unknown)}")
        # Ignoring these would hand back something else than what was asked for: a transcript in
        # the spoken language for a translation, greedy text for a beam search.
        if options.get("task", "transcribe") != "transcribe":
            raise NotImplementedError(f"task={options['task']!r} is not offered: Parakeet TDT transcribes only")
        if options.get("beam_size", 1) != 1:
            raise NotImplementedError("beam search is not implemented for Parakeet TDT; use beam_size=1")
        return audio, sample_rate, language

    def _assemble(self, tokens: list[tuple[int, float, float, int]]) -> dict:
        words: list[dict] = []
        groups: list[list[tuple]] = []
        timed: list[tuple[int, float, float, int]] = []
        for tok, start, end, chunk in tokens:
            # NeMo's _refine_timestamps_tdt: a mark takes the end of the token before it
            if timed and self.vocab.is_punctuation(tok):
                start = end = timed[-1][2]
            timed.append((tok, start, end, chunk))
        for item in timed:
            # a chunk cut inside a word does not split it: `text` decodes all tokens together
            if not groups or (self.vocab.starts_word(item[0]) and not self.vocab.is_punctuation(item[0])):
                groups.append([item])
            else:
                groups[-1].append(item)
        for g in groups:
            text = self.vocab.decode([x[0] for x in g])
            if text:
                words.append({"start": round(g[0][1], 3), "end": round(g[-1][2], 3), "word": text,
                              "_tokens": [x[0] for x in g], "_chunk": g[0][3]})
        segments: list[dict] = []
        current: list[dict] = []
        for w in words:
            if current and (w["_chunk"] != current[-1]["_chunk"]
                            or w["start"] - current[-1]["end"] > self.segment_gap):
                segments.append(self._segment(current))
                current = []
            current.append(w)
            if w["word"].endswith(_SENTENCE_END):
                segments.append(self._segment(current))
                current = []
        if current:
            segments.append(self._segment(current))
        return {"text": self.vocab.decode([t[0] for t in tokens]),
                "segments": [s for s in segments if s["text"]],
                "words": [{k: w[k] for k in ("start", "end", "word")} for w in words],
                "tokens": [t[0] for t in tokens]}

    def _segment(self, words: list[dict]) -> dict:
        ids = [i for w in words for i in w["_tokens"]]
        return {"start": words[0]["start"], "end": words[-1]["end"], "text": self.vocab.decode(ids)}


def load_parakeet(path: str | Path, device: str = "cpu", dtype: torch.dtype | str | None = None,
                  ops: ModuleType | None = None, backend: str = "auto", model_id: str | None = None,
                  **kwargs) -> ParakeetSpeech:
    """A transformers folder (config.json parakeet_tdt) or a .nemo file (or a folder holding one).
    dtype: the encoder's (float32 default; the transducer heads always run in float32).
    backend: "reference", "triton", "megakernel" or "auto" (as photon_core.backends.select picks).
    Parakeet has no megakernel step graph yet, so under "megakernel" it runs on that module's
    per-op kernels (the same as "triton"); `ops` overrides the choice with an ops module."""
    from photon_core.backends.select import get_backend
    from photon_core.weights.tensor_files import parse_dtype

    if ops is None:
        ops = get_backend(backend, device)
    checkpoint = load_checkpoint(path)
    name = model_id or Path(path).name
    return ParakeetSpeech(checkpoint, name, device=device,
                          dtype=parse_dtype(dtype) if dtype is not None else torch.float32, ops=ops, **kwargs)
