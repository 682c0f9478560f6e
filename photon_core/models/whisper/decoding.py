"""Decoding one 30 s window: greedy (or temperature sampling for fallback) with Whisper's logit
rules, following openai-whisper's DecodingTask so results match it token for token.

Rules, in openai-whisper's order: blank/EOT suppressed at the first sampled position; non-speech
and special tokens always suppressed; with timestamps, the timestamp grammar (pairs, monotonic,
first token a timestamp <= 1 s, timestamp forced when their total probability beats any text
token). The no-speech probability is read at the SOT position of the first forward pass.
"""
from __future__ import annotations

import zlib
from collections.abc import Collection, Iterator
from dataclasses import dataclass, field
from typing import Callable

import torch

from photon_core.runtime.generate import generate, room, token_lists
from photon_core.runtime.sampling import GREEDY_BELOW, POSINF_REFUSAL, NonFiniteLogits, Sampling, check_finite
from photon_core.runtime.thread_tuner import ThreadTuner

from .model import DecoderCache, WhisperNet
from .tokenizer import WhisperTokenizer

MAX_INITIAL_TIMESTAMP_S = 1.0


@dataclass
class DecodeOptions:
    language: str | None = "en"
    without_timestamps: bool = False
    temperature: float = 0.0
    prompt: list[int] = field(default_factory=list)   # previous-text tokens (<|startofprev|>)
    sample_len: int | None = None                     # default n_text_ctx // 2
    generator: torch.Generator | None = None          # for temperature > 0


@dataclass
class DecodeResult:
    tokens: list[int]            # sampled tokens, EOT excluded (timestamps included)
    text: str
    avg_logprob: float
    no_speech_prob: float
    temperature: float
    compression_ratio: float


def compression_ratio(text: str) -> float:
    """How well the text zips: repetition loops compress far better than speech."""
    raw = text.encode("utf-8")
    return len(raw) / len(zlib.compress(raw)) if raw else 0.0


class WindowDecoder:
    """Per-model constants for decoding (suppression masks); `decode(features, options)`."""

    def __init__(self, net: WhisperNet, tokenizer: WhisperTokenizer, time_precision: float,
                 steps=None):
        self.net = net
        self.steps = steps   # MegakernelSteps: per-token steps as one launch; None = the model's ops
        # Thread count of each per-token step, chosen by timing (CPU); None: torch's setting.
        self.threads: ThreadTuner | None = None
        self.tok = tokenizer
        self.n_ctx = net.dims.n_text_ctx
        self.n_vocab = net.dims.n_vocab
        tok = tokenizer
        suppress = set(tok.non_speech_tokens)
        suppress |= {tok.transcribe, tok.translate, tok.sot, tok.sot_prev, tok.sot_lm}
        if tok.no_speech is not None:
            suppress.add(tok.no_speech)
        self.suppress = torch.tensor(sorted(t for t in suppress if t < self.n_vocab))
        self.blank = torch.tensor(tok.encode(" ") + [tok.eot])
        self.max_initial_ts = round(MAX_INITIAL_TIMESTAMP_S / time_precision)

    def _step(self, cache: DecoderCache, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        """One token step's forward pass, on the thread count the tuner picks for steps of this
        shape (rows, encoder positions: a fitted context's steps cost less than a 30 s one's)."""
        if self.threads is None:
            return fn()
        return self.threads.run((cache.k.shape[1], cache.cross[0][0].shape[2]), fn)

    def initial_tokens(self, options: DecodeOptions) -> tuple[list[int], int]:
        """Prompt tokens and the index of SOT in them."""
        tok = self.tok
        seq = tok.sot_sequence(options.language)
        if options.without_timestamps:
            seq = seq + [tok.no_timestamps]
        if options.prompt:
            prev = [tok.sot_prev] + list(options.prompt)[-(self.n_ctx // 2 - 1):]
            return prev + seq, len(prev)
        return seq, 0

    def _apply_rules(self, logits: torch.Tensor, sampled: list[int], timestamps: bool) -> None:
        """In-place -inf masking of one [vocab] logits row, given the tokens sampled so far."""
        tok = self.tok
        neg = float("-inf")
        if not sampled:
            logits[self.blank] = neg
        logits[self.suppress] = neg
        if not timestamps:
            return
        tb, eot = tok.timestamp_begin, tok.eot
        logits[tok.no_timestamps] = neg
        last_ts = len(sampled) >= 1 and sampled[-1] >= tb
        penult_ts = len(sampled) < 2 or sampled[-2] >= tb
        if last_ts:
            if penult_ts:
                logits[tb:] = neg          # a pair just closed: text must follow
            else:
                logits[:eot] = neg         # an open timestamp: close it (or end)
        last_timestamp = next((t for t in reversed(sampled) if t >= tb), None)
        if last_timestamp is not None:
            # Non-decreasing timestamps; a segment must have non-zero length.
            limit = last_timestamp if (last_ts and not penult_ts) else last_timestamp + 1
            logits[tb:limit] = neg
        if not sampled:
            logits[:tb] = neg
            logits[tb + self.max_initial_ts + 1:] = neg
        logprobs = torch.log_softmax(logits, dim=-1)
        if logprobs[tb:].logsumexp(dim=-1) > logprobs[:tb].max():
            logits[:tb] = neg

    @torch.inference_mode()
    def decode(self, features: torch.Tensor | None, options: DecodeOptions,
               cross: list[tuple[torch.Tensor, torch.Tensor]] | None = None) -> DecodeResult:
        """Decode one window from its encoder output [1, n_audio_ctx, d], or from its
        precomputed cross-attention K/V (`cross`, from net.cross_kv) when given."""
        net, tok = self.net, self.tok
        initial, sot_index = self.initial_tokens(options)
        sample_len = options.sample_len or self.n_ctx // 2
        timestamps = not options.without_timestamps
        if cross is None:
            if features is None:
                raise ValueError("decode needs the window's encoder output or its cross-attention K/V")
            cross = net.cross_kv(features)
        cache = net.new_cache(cross)
        device = cache.k.device

        hidden = net.decode(torch.tensor([initial], device=device), 0, cache)
        first = net.logits(hidden[0, [sot_index, -1]])
        no_speech_prob = float("nan")
        if tok.no_speech is not None:
            no_speech_prob = first[0].softmax(-1)[tok.no_speech].item()
        # Greedy windows on the megakernel decode every token after the first in rounds on the
        # device (the same rules as device ops): no host read per token.
        rounds = (self.steps is not None and hasattr(self.steps, "greedy_rows") and options.temperature == 0
                  and len(initial) + sample_len <= self.n_ctx)
        if rounds:
            self.steps.prepare(self)
        if self.steps is not None:
            self.steps.start(cache, len(initial))
        session = WindowSession(self, cache, first[1][None], len(initial), timestamps, on_steps=self.steps is not None)
        chooser = TokenChooser(self, 1, timestamps, options.temperature, options.generator)
        sampled = self._generate(session, chooser, sample_len, len(initial), options.temperature, rounds)[0]
        text = tok.decode(sampled).strip()
        return DecodeResult(sampled, text, chooser.sum_logprob[0] / (len(sampled) + 1), no_speech_prob,
                            options.temperature, compression_ratio(text))

    @torch.inference_mode()
    def decode_greedy_batch(self, cross: list[tuple[torch.Tensor, torch.Tensor]],
                            options: DecodeOptions) -> list[DecodeResult]:
        """Greedy decoding of B windows at once from their cross K/V ([B, H, n_audio_ctx, Dh] per
        layer), all with the same options (so the same prompt, and every row at the same
        position at each step). Row i is what `decode` gives for row i alone: every per-row rule
        runs on that row's logits, and a finished row leaves the batch (its cache rows dropped)."""
        if options.temperature != 0:
            raise ValueError("batched decoding is greedy only (temperature 0)")
        net, tok = self.net, self.tok
        initial, sot_index = self.initial_tokens(options)
        sample_len = options.sample_len or self.n_ctx // 2
        timestamps = not options.without_timestamps
        cache = net.new_cache(cross)
        device = cache.k.device
        bsz = cache.k.shape[1]

        # On the megakernel the rows take a batch bucket and every token after the first decodes
        # in rounds on the device (as `decode` does for one window).
        rounds = (self.steps is not None and hasattr(self.steps, "greedy_rows") and bsz <= self.steps.max_rows
                  and len(initial) + sample_len <= self.n_ctx)
        if rounds:
            self.steps.prepare(self, bsz)
        hidden = net.decode(torch.tensor([initial] * bsz, device=device), 0, cache)
        first = net.logits(hidden[:, [sot_index, -1]])
        no_speech = ([first[i, 0].softmax(-1)[tok.no_speech].item() for i in range(bsz)]
                     if tok.no_speech is not None else [float("nan")] * bsz)
        if rounds:
            self.steps.start(cache, len(initial))
        session = WindowSession(self, cache, first[:, 1], len(initial), timestamps)
        chooser = TokenChooser(self, bsz, timestamps, 0.0, None)
        sampled = self._generate(session, chooser, sample_len, len(initial), 0.0, rounds)
        return [self._result(sampled[i], chooser.sum_logprob[i], no_speech[i]) for i in range(bsz)]

    def _generate(self, session: "WindowSession", chooser: "TokenChooser", sample_len: int, prompt_len: int,
                  temperature: float, rounds: bool) -> list[list[int]]:
        """Each row's tokens (EOT excluded) by runtime.generate's loop: at most sample_len, and no
        more than the context holds (a row's k-th token is fed at prompt_len + k - 1)."""
        rows = len(chooser.sampled)
        space = room(sample_len, prompt_len, self.n_ctx)
        steps = generate(session, [Sampling(sample_len, temperature)] * rows, [space] * rows, {self.tok.eot},
                         chooser, device_rounds=rounds)
        tokens = token_lists(steps, rows)
        if rounds:   # the steps' tokens' log-probabilities, in order
            for i, scores in enumerate(self.steps.scores):
                for lp in scores:
                    chooser.sum_logprob[i] += lp
        return tokens

    def _result(self, sampled: list[int], sum_logprob: float, no_speech: float) -> DecodeResult:
        """A greedy window's result from its tokens (EOT excluded) and their summed log-probability."""
        text = self.tok.decode(sampled).strip()
        return DecodeResult(sampled, text, sum_logprob / (len(sampled) + 1), no_speech, 0.0, compression_ratio(text))


class TokenChooser:
    """runtime.generate's choice of each row's next token by Whisper's rules: the logit rules on
    the row's tokens so far, then the argmax (temperature 0, or below GREEDY_BELOW) or a draw from
    the softmax at the temperature (openai-whisper's categorical sampling, not the ops' nucleus
    sampling); every chosen token's log-probability (EOT's too) summed per row."""

    def __init__(self, dec: WindowDecoder, rows: int, timestamps: bool, temperature: float,
                 generator: torch.Generator | None) -> None:
        self.dec, self.timestamps, self.temperature, self.generator = dec, timestamps, temperature, generator
        self.sampled: list[list[int]] = [[] for _ in range(rows)]
        self.sum_logprob = [0.0] * rows

    def __call__(self, row: int, logits: torch.Tensor, greedy: int | None) -> int:
        check_finite(logits)   # (before the rules: they mask with -inf, never NaN)
        self.dec._apply_rules(logits, self.sampled[row], self.timestamps)
        # below GREEDY_BELOW, logits / temperature overflow to NaN: such a temperature asks for
        # the argmax, as everywhere in the package (Sampling.greedy)
        if self.temperature < GREEDY_BELOW:
            t = int(self.dec.net.ops.argmax(logits))
        else:
            # +inf makes the softmax NaN, and multinomial would fail on it (after the rules, so a
            # suppressed token's +inf is never drawn): refused as runtime.sampling.pick refuses it
            if bool(torch.isposinf(logits).any()):
                raise NonFiniteLogits(POSINF_REFUSAL)
            probs = torch.softmax(logits / self.temperature, dim=-1)
            t = int(torch.multinomial(probs, 1, generator=self.generator))
        self.sum_logprob[row] += torch.log_softmax(logits, dim=-1)[t].item()
        if t != self.dec.tok.eot:
            self.sampled[row].append(t)
        return t


class WindowSession:
    """runtime.generate's session on B windows decoded with one prompt (so every row at the same
    position): after the prompt's pass, each token is one step of the decoder's `steps` (one
    window: a per-op CUDA-graph replay or a compiled step) or of the model's ops on the cache
    (whose rows leave with their windows); `rounds`: greedy rows on the megakernel, the logit
    rules applied on the device, the log-probabilities added to the chooser's sums afterwards."""

    def __init__(self, dec: WindowDecoder, cache: DecoderCache, first: torch.Tensor, prompt_len: int,
                 timestamps: bool, on_steps: bool = False) -> None:
        """first: the logits [B, vocab] after the prompt; on_steps: one window started on the
        decoder's `steps` (their `start`), which then take every step."""
        self.dec, self.cache, self.first, self.timestamps = dec, cache, first, timestamps
        self.on_steps = on_steps
        self.pos = prompt_len   # the next token's position

    def prefill(self) -> tuple[torch.Tensor, None]:
        return self.first, None

    def step(self, tokens: list[int]) -> tuple[torch.Tensor, None]:
        dec, net, pos = self.dec, self.dec.net, self.pos
        self.pos += 1
        if self.on_steps:
            return dec.steps.logits(tokens[0], pos)[None], None
        step = torch.tensor(tokens, device=self.cache.k.device)[:, None]
        return dec._step(self.cache, lambda: net.logits(net.decode(step, pos, self.cache))[:, -1]), None

    def keep(self, rows: list[int]) -> None:
        idx = torch.tensor(rows, device=self.cache.k.device)
        c = self.cache
        self.cache = DecoderCache([(k[idx], v[idx]) for k, v in c.cross], c.k[:, idx], c.v[:, idx])

    def rounds(self, first: list[int], max_new: list[int], stop: Collection[int]) -> Iterator[tuple[int, int]]:
        return self.dec.steps.stream_rows(first, self.pos, self.timestamps, max_new, self.dec.tok.eot)
