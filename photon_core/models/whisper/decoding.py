"""Decoding one 30 s window: greedy (or temperature sampling for fallback) with Whisper's logit
rules, following openai-whisper's DecodingTask so results match it token for token.

Rules, in openai-whisper's order: blank/EOT suppressed at the first sampled position; non-speech
and special tokens always suppressed; with timestamps, the timestamp grammar (pairs, monotonic,
first token a timestamp <= 1 s, timestamp forced when their total probability beats any text
token). The no-speech probability is read at the SOT position of the first forward pass.
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import Callable

import torch

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
        ops = net.ops
        initial, sot_index = self.initial_tokens(options)
        sample_len = options.sample_len or self.n_ctx // 2
        timestamps = not options.without_timestamps
        cache = net.new_cache(cross if cross is not None else net.cross_kv(features))
        device = cache.k.device

        hidden = net.decode(torch.tensor([initial], device=device), 0, cache)
        first = net.logits(hidden[0, [sot_index, -1]])
        no_speech_prob = float("nan")
        if tok.no_speech is not None:
            no_speech_prob = first[0].softmax(-1)[tok.no_speech].item()
        logits = first[1]
        # Greedy windows on the megakernel decode every token after the first in rounds on the
        # device (the same rules as device ops): no host read per token.
        rounds = (self.steps is not None and hasattr(self.steps, "greedy") and options.temperature == 0
                  and len(initial) + sample_len <= self.n_ctx)
        if rounds:
            self.steps.prepare(self)
        if self.steps is not None:
            self.steps.start(cache, len(initial))

        sampled: list[int] = []
        sum_logprob = 0.0
        n_tokens = len(initial)
        step = torch.empty(1, 1, dtype=torch.long, device=device)
        for _ in range(sample_len):
            self._apply_rules(logits, sampled, timestamps)
            if options.temperature == 0:
                nxt = int(ops.argmax(logits))
            else:
                probs = torch.softmax(logits / options.temperature, dim=-1)
                nxt = int(torch.multinomial(probs, 1, generator=options.generator))
            sum_logprob += torch.log_softmax(logits, dim=-1)[nxt].item()
            if nxt == tok.eot:
                break
            sampled.append(nxt)
            n_tokens += 1
            if n_tokens > self.n_ctx:
                break
            if rounds:
                sampled, scores = self.steps.greedy(nxt, n_tokens - 1, timestamps, sample_len, tok.eot)
                for lp in scores:
                    sum_logprob += lp
                break
            if self.steps is not None:
                logits = self.steps.logits(nxt, n_tokens - 1)
                continue
            step[0, 0] = nxt
            logits = self._step(cache, lambda: net.logits(net.decode(step, n_tokens - 1, cache))[0, -1])

        text = tok.decode(sampled).strip()
        return DecodeResult(sampled, text, sum_logprob / (len(sampled) + 1), no_speech_prob,
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
        logits = first[:, 1]
        if rounds:
            self.steps.start(cache, len(initial))
            firsts, sum_logprob = [], []
            for i in range(bsz):
                self._apply_rules(logits[i], [], timestamps)
                t = int(net.ops.argmax(logits[i]))
                firsts.append(t)
                sum_logprob.append(torch.log_softmax(logits[i], dim=-1)[t].item())
            sampled, scores = self.steps.greedy_rows(firsts, len(initial), timestamps, sample_len, tok.eot)
            for i in range(bsz):
                for lp in scores[i]:
                    sum_logprob[i] += lp
            return [self._result(sampled[i], sum_logprob[i], no_speech[i]) for i in range(bsz)]

        sampled: list[list[int]] = [[] for _ in range(bsz)]
        sum_logprob = [0.0] * bsz
        rows = list(range(bsz))            # request index of each row still decoding
        n_tokens = len(initial)
        for _ in range(sample_len):
            nxt, keep = [], []
            for r, i in enumerate(rows):
                row = logits[r]
                self._apply_rules(row, sampled[i], timestamps)
                t = int(net.ops.argmax(row))
                sum_logprob[i] += torch.log_softmax(row, dim=-1)[t].item()
                if t != tok.eot:
                    sampled[i].append(t)
                    nxt.append(t)
                    keep.append(r)
            n_tokens += 1
            if not keep or n_tokens > self.n_ctx:
                break
            if len(keep) < len(rows):
                idx = torch.tensor(keep, device=device)
                cache = DecoderCache([(k[idx], v[idx]) for k, v in cache.cross],
                                     cache.k[:, idx], cache.v[:, idx])
                rows = [rows[r] for r in keep]
            step = torch.tensor(nxt, device=device)[:, None]
            logits = self._step(cache, lambda: net.logits(net.decode(step, n_tokens - 1, cache))[:, -1])

        return [self._result(sampled[i], sum_logprob[i], no_speech[i]) for i in range(bsz)]

    def _result(self, sampled: list[int], sum_logprob: float, no_speech: float) -> DecodeResult:
        """A greedy window's result from its tokens (EOT excluded) and their summed log-probability."""
        text = self.tok.decode(sampled).strip()
        return DecodeResult(sampled, text, sum_logprob / (len(sampled) + 1), no_speech, 0.0, compression_ratio(text))
