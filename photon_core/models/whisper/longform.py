"""Sequential transcription of audio of any length, as openai-whisper's `transcribe` does it.

30 s windows over the log-mel of the whole clip (plus 30 s of zero audio, so the last window has
real padding frames); each window is decoded with temperature fallback (a too-compressible text
means a repetition loop, a low average log-prob means a guess), skipped when the model says
"no speech" with low confidence in its text, cut into segments at consecutive timestamp pairs,
and the next window starts at the last complete timestamp (or the window end). The text so far is
fed back as the <|startofprev|> prompt unless a hot temperature was needed.
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Callable, ContextManager, Protocol, Sequence

import torch

from .decoding import DecodeOptions, DecodeResult, WindowDecoder
from .frontend import HOP_LENGTH, N_FRAMES, SAMPLE_RATE, pad_or_trim

DEFAULT_TEMPERATURES = (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)

# Fitted encoder context (`LongFormOptions.fit_context`, the CPU default): a window holding less
# than 30 s of audio runs the encoder on its content plus a margin, rounded up to a step, instead
# of on 30 s that are mostly padding: for a 3 s command 250 audio positions instead of 1500 (the
# encoder's products shrink 6x, its attention ~36x). Measured on bench/speech_set.py (84
# utterances, tiny.en, greedy with timestamps): WER 0.219 against the full context's 0.227
# (2026-12-01); with a 1 s margin and 2 s steps 0.229. Without timestamp tokens the same cut lets
# the decoder loop on short noisy clips (WER 0.72), so it applies to timestamped decoding only.
#
# The model was trained on 30 s contexts only: on a shortened one it can lose track of where the
# audio ends. On some short commands its greedy decode then closes the text with a timestamp far
# past the audio (18 s for a 1.2 s command in a 5 s context), never closes it (a repetition loop),
# or reads the right words at a log-prob just under the fallback threshold. Any of these used to
# send the window into temperature fallback on the same shortened context, where sampling at
# temperatures up to 1.0 turns differences in the last bits of the features (the 16 kHz samples of
# the same speech resampled from 16, 44.1, 48 or 192 kHz) into different words ("Go to the rent
# up." / "Go turn the h blind") and segments ending past the audio. So a fitted window's first
# decode is kept only when it is one the 30 s path would keep too (`fit_trusted`); otherwise the
# window is encoded again on 30 s and decoded as openai-whisper would. On the speech set
# (2026-12-02, 2-core CPU) 19 of its 82 fitted windows go back to 30 s; segments ending more than
# 0.5 s past the audio went from 12 of 84 utterances to the 30 s path's own 3 (clipped in the
# result); WER greedy 0.237 (0.242 before, full context 0.269), with temperature fallback 0.251
# (0.246 before, full context 0.272; means of the set at 22.05 and 48 kHz, between which each
# path's WER moves by 1-3 points).
FIT_MARGIN_FRAMES = 200     # 2 s after the content: room for the closing timestamp
FIT_STEP_FRAMES = 500       # 5 s steps: six encoder shapes in all (warm-up runs each)


def encoder_frames(content_frames: int, fit: bool) -> int:
    """Mel frames the encoder sees for a window with `content_frames` of audio: all N_FRAMES (30 s)
    unless fitted."""
    if not fit:
        return N_FRAMES
    steps = -(-(content_frames + FIT_MARGIN_FRAMES) // FIT_STEP_FRAMES)
    return min(N_FRAMES, steps * FIT_STEP_FRAMES)


@dataclass
class LongFormOptions:
    language: str | None = "en"
    timestamps: bool = True
    temperatures: Sequence[float] = DEFAULT_TEMPERATURES
    compression_ratio_threshold: float | None = 2.4
    logprob_threshold: float | None = -1.0
    no_speech_threshold: float | None = 0.6
    # Guards beyond openai-whisper against its classic hallucinations on silence and noise
    # ("you", "."): a strong no-speech vote skips the window even when the text looks confident,
    # and text without a letter or digit is dropped. None/False reproduce openai-whisper exactly.
    no_speech_hard_threshold: float | None = 0.9
    drop_punctuation_only: bool = True
    condition_on_previous_text: bool = True
    initial_prompt_tokens: list[int] = field(default_factory=list)
    seed: int = 0
    # Encoder context fitted to each window's audio (see encoder_frames); timestamped decoding only.
    fit_context: bool = False

    def window_frames(self, content_frames: int) -> int:
        """Mel frames the encoder sees for a window with `content_frames` of audio."""
        return encoder_frames(content_frames, self.fit_context and self.timestamps)


@dataclass
class LongFormResult:
    segments: list[dict]      # start, end, text, tokens, avg_logprob, no_speech_prob, ...
    tokens: list[int]         # all emitted tokens, initial prompt excluded
    no_speech_probs: list[float]


def accepted(result: DecodeResult, opts: LongFormOptions) -> bool:
    """Whether a window's decode is final: neither a loop nor a low-confidence guess, or an honest
    "no speech" (high no-speech prob and low log-prob)."""
    too_repetitive = (opts.compression_ratio_threshold is not None
                      and result.compression_ratio > opts.compression_ratio_threshold)
    low_logprob = opts.logprob_threshold is not None and result.avg_logprob < opts.logprob_threshold
    silence = (opts.no_speech_threshold is not None and low_logprob
               and result.no_speech_prob > opts.no_speech_threshold)
    return silence or not (too_repetitive or low_logprob)


def fit_trusted(result: DecodeResult, opts: LongFormOptions, content_frames: int,
                timestamp_begin: int, input_stride: int) -> bool:
    """Whether a fitted window's first decode stands: accepted at the first temperature, and no
    timestamp past the window's audio by more than the fitted margin (one there means the
    model lost track of where the audio ends)."""
    last = (content_frames + FIT_MARGIN_FRAMES) // input_stride
    return accepted(result, opts) and all(t - timestamp_begin <= last
                                          for t in result.tokens if t >= timestamp_begin)


def decode_with_fallback(decoder: WindowDecoder, cross: list, base: DecodeOptions,
                         opts: LongFormOptions, first: DecodeResult | None = None) -> DecodeResult:
    """Decode at the first temperature whose result is `accepted`.
    `first`: the first temperature's result, already decoded (in a batch)."""
    result = None
    for i, t in enumerate(opts.temperatures):
        base.temperature = t
        result = first if i == 0 and first is not None else decoder.decode(None, base, cross=cross)
        if accepted(result, opts):
            break
    assert result is not None, "temperatures must not be empty"
    return result


class MelFrames(Protocol):
    """Log-mel frames computed as they are asked for (stream_frontend.StreamedLogMel): `start`
    never goes back from one call to the next."""

    def frames(self, start: int, stop: int) -> torch.Tensor: ...


def encoder_window(mel: torch.Tensor | MelFrames, seek: int, content_frames: int,
                   opts: LongFormOptions) -> torch.Tensor:
    """The encoder's input [n_mels, frames] for the window starting at frame `seek`: up to 30 s of
    the first `content_frames` mel frames, zero-padded to 30 s or to its fitted context."""
    content = min(N_FRAMES, content_frames - seek)
    frames = mel[:, seek:seek + content] if isinstance(mel, torch.Tensor) else mel.frames(seek, seek + content)
    return pad_or_trim(frames, opts.window_frames(content))


class _LastEncoded:
    """Cross-attention K/V of windows, remembering the last one: a window equal to the last one
    encoded reuses its K/V (the encoder is a function of its input alone). Digital silence (a
    muted microphone, a recording padded with zeros) gives the same window for as long as it
    lasts, which then costs a decode each instead of a 30 s encode each."""

    def __init__(self, net, encode: Callable[[torch.Tensor], torch.Tensor]):
        self._net, self._encode = net, encode
        self._window: torch.Tensor | None = None
        self._cross: list = []

    def cross(self, window: torch.Tensor) -> list:
        last = self._window
        if last is None or last.shape != window.shape or not torch.equal(last, window):
            self._cross = self._net.cross_kv(self._encode(window[None]))
            self._window = window
        return self._cross


def first_window_options(opts: LongFormOptions) -> DecodeOptions:
    """The options `transcribe_mel` decodes its first window with, at the first temperature."""
    return DecodeOptions(language=opts.language, without_timestamps=not opts.timestamps,
                         prompt=list(opts.initial_prompt_tokens), temperature=opts.temperatures[0])


def transcribe_mel(decoder: WindowDecoder, encode: Callable[[torch.Tensor], torch.Tensor],
                   mel: torch.Tensor | MelFrames, content_frames: int, opts: LongFormOptions,
                   decode_context: Callable[[], ContextManager] = nullcontext,
                   first: tuple[list, DecodeResult] | None = None) -> LongFormResult:
    """`mel`: at least the first `content_frames` frames of
    log_mel_spectrogram(audio, padding=N_SAMPLES) (see frontend.log_mel_content), whole or as
    MelFrames (read window by window, in order: nothing kept but the current window's frames,
    the segments and the tokens).
    `decode_context` wraps each window's decoding (e.g. a thread count other than the
    encoder's). `first`: the first window's cross K/V and its decode at the first temperature
    (`first_window_options`), computed beforehand (batched with other clips)."""
    tok = decoder.tok
    n_audio_ctx = decoder.net.dims.n_audio_ctx
    input_stride = N_FRAMES // n_audio_ctx                       # mel frames per audio token
    time_precision = input_stride * HOP_LENGTH / SAMPLE_RATE     # 0.02 s per timestamp step
    tb = tok.timestamp_begin
    generator = torch.Generator().manual_seed(opts.seed)

    all_tokens = list(opts.initial_prompt_tokens)
    n_initial = len(all_tokens)
    prompt_reset_since = 0
    segments: list[dict] = []
    no_speech_probs: list[float] = []
    seek = 0
    encoded = _LastEncoded(decoder.net, encode)
    while seek < content_frames:
        time_offset = seek * HOP_LENGTH / SAMPLE_RATE
        segment_size = min(N_FRAMES, content_frames - seek)
        segment_duration = segment_size * HOP_LENGTH / SAMPLE_RATE
        window = encoder_window(mel, seek, content_frames, opts)
        # encoder and cross K/V on all threads; decoding may run under `decode_context`
        done = first if seek == 0 else None
        cross = done[0] if done else encoded.cross(window)
        first_result = done[1] if done else None
        base = DecodeOptions(language=opts.language, without_timestamps=not opts.timestamps,
                             prompt=all_tokens[prompt_reset_since:], generator=generator)
        if window.shape[-1] < N_FRAMES:   # a fitted context: its first decode must earn its place
            if first_result is None:
                base.temperature = opts.temperatures[0]
                with decode_context():
                    first_result = decoder.decode(None, base, cross=cross)
            if not fit_trusted(first_result, opts, segment_size, tb, input_stride):
                cross = encoded.cross(pad_or_trim(window, N_FRAMES))
                first_result = None
        with decode_context():
            result = decode_with_fallback(decoder, cross, base, opts, first_result)
        no_speech_probs.append(result.no_speech_prob)
        tokens = result.tokens

        if opts.no_speech_threshold is not None:
            skip = result.no_speech_prob > opts.no_speech_threshold
            if opts.logprob_threshold is not None and result.avg_logprob > opts.logprob_threshold:
                skip = False   # confident text despite a "no speech" vote
            if (opts.no_speech_hard_threshold is not None
                    and result.no_speech_prob > opts.no_speech_hard_threshold):
                skip = True
            if skip:
                seek += segment_size
                continue

        def segment(start: float, end: float, toks: list[int]) -> dict:
            return {"start": start, "end": end, "text": tok.decode(toks), "tokens": toks,
                    "temperature": result.temperature, "avg_logprob": result.avg_logprob,
                    "compression_ratio": result.compression_ratio,
                    "no_speech_prob": result.no_speech_prob}

        is_ts = [t >= tb for t in tokens]
        single_timestamp_ending = is_ts[-2:] == [False, True]
        # a segment ends after each pair of consecutive timestamps <|t_end|><|t_start_next|>
        consecutive = [i + 1 for i in range(len(tokens) - 1) if is_ts[i] and is_ts[i + 1]]
        current: list[dict] = []
        if consecutive:
            slices = consecutive + ([len(tokens)] if single_timestamp_ending else [])
            last = 0
            for cut in slices:
                piece = tokens[last:cut]
                current.append(segment(time_offset + (piece[0] - tb) * time_precision,
                                       time_offset + (piece[-1] - tb) * time_precision, piece))
                last = cut
            if single_timestamp_ending:
                seek += segment_size
            else:
                # resume at the last complete timestamp: the words after it may be cut off
                seek += (tokens[last - 1] - tb) * input_stride
        else:
            duration = segment_duration
            stamps = [t for t in tokens if t >= tb]
            if stamps and stamps[-1] != tb:
                duration = (stamps[-1] - tb) * time_precision
            current.append(segment(time_offset, time_offset + duration, tokens))
            seek += segment_size

        for seg in current:
            blank = seg["text"].strip() == "" or (
                opts.drop_punctuation_only and not any(c.isalnum() for c in seg["text"]))
            if seg["start"] == seg["end"] or blank:
                seg["text"], seg["tokens"] = "", []
        segments.extend(current)
        all_tokens.extend(t for seg in current for t in seg["tokens"])
        if not opts.condition_on_previous_text or result.temperature > 0.5:
            prompt_reset_since = len(all_tokens)   # a hot sample is no context to build on

    return LongFormResult(segments, all_tokens[n_initial:], no_speech_probs)
