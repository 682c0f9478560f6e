"""The audio front end for files too long to hold whole: an AudioStream's blocks -> 16 kHz mono
float32 -> Whisper log-mel frames, computed window by window, in memory that does not grow with
the file's length.

The frames equal `frontend.log_mel_content` of the whole file (same resampler, same STFT frames,
same floor), because:
- the polyphase resampler's output sample m depends only on the input within its filter's reach
  (10 * max(up, down) upsampled taps each side): each piece is resampled with that much input
  either side, starting at an input index whose output index is whole (so the filter phases line
  up), and only the outputs whose reach lies inside the piece are kept;
- a mel frame depends only on the 400 samples around it (reflect-padded at the start, zeros after
  the end, as `log_mel_content` pads them);
- the floor (the whole file's max - 8) needs the whole file's max first: the file is read twice,
  once for the max and the length, once for the windows.
"""
from __future__ import annotations

from math import gcd
from typing import Callable, Iterator

import numpy as np
import torch

from photon_core.audio_io import AudioStream
from photon_core.runtime.audio_frontend import HOP_LENGTH, N_FFT, SAMPLE_RATE, mel_filters_tensor, to_float_mono

from .frontend import N_FRAMES

# Mel frames computed at a time: 30 s, one window's worth.
MEL_PIECE_FRAMES = N_FRAMES
_HALF_WINDOW = N_FFT // 2
# log_mel_content pads the audio with this many zeros before its STFT: every frame whose window
# touches audio exists, and its max covers them.
_TAIL_PAD = N_FFT + HOP_LENGTH


class StreamResampler:
    """`frontend.resample` (scipy's resample_poly) of a signal given piece by piece: `push` each
    piece, then `finish`; the concatenated outputs equal resample() of the whole signal."""

    def __init__(self, rate_in: int, rate_out: int = SAMPLE_RATE, hop_s: float = 10.0):
        if rate_in <= 0 or rate_out <= 0:
            raise ValueError(f"sample rates must be positive, got {rate_in} -> {rate_out}")
        g = gcd(int(rate_in), int(rate_out))
        self.up, self.down = int(rate_out) // g, int(rate_in) // g
        self.rate_in, self.rate_out = int(rate_in), int(rate_out)
        # Input samples on each side of a piece whose outputs are kept: the filter's reach
        # (resample_poly's half_len = 10 * max(up, down) upsampled taps, its zero pre-pad of up to
        # `down` taps, a post-pad) in input samples, with room to spare, rounded to whole `down`s
        # so every piece starts where an output sample falls on an input sample.
        reach = -(-(10 * max(self.up, self.down) + 3 * self.down + self.up) // self.up) + 1
        self.pad = -(-reach // self.down) * self.down
        self.hop = max(1, round(hop_s * rate_in / self.down)) * self.down
        self._buf = np.zeros(0, np.float32)
        self._buf_start = 0    # input index of _buf[0]
        self._next = 0         # input index (a multiple of down) of the next output to give

    def _resample(self, x: np.ndarray) -> np.ndarray:
        from scipy.signal import resample_poly
        return resample_poly(x, self.up, self.down).astype(np.float32)

    def push(self, x: np.ndarray) -> np.ndarray:
        """Take the next input samples (float32 mono); return the outputs now complete."""
        if self.up == self.down:
            return np.asarray(x, np.float32)
        self._buf = np.concatenate([self._buf, np.asarray(x, np.float32)])
        out = []
        while self._buf_start + len(self._buf) >= self._next + self.hop + self.pad:
            lo = max(0, self._next - self.pad)
            piece = self._buf[lo - self._buf_start:self._next + self.hop + self.pad - self._buf_start]
            first = (self._next - lo) * self.up // self.down
            out.append(self._resample(piece)[first:first + self.hop * self.up // self.down])
            self._next += self.hop
            keep = max(0, self._next - self.pad)
            self._buf = self._buf[keep - self._buf_start:]
            self._buf_start = keep
        return np.concatenate(out) if out else np.zeros(0, np.float32)

    def finish(self) -> np.ndarray:
        """The outputs of the last input samples (the signal ends here)."""
        if self.up == self.down:
            return np.zeros(0, np.float32)
        lo = max(0, self._next - self.pad)
        piece = self._buf[lo - self._buf_start:]
        self._buf = np.zeros(0, np.float32)
        if len(piece) <= self._next - lo:
            return np.zeros(0, np.float32)
        first = (self._next - lo) * self.up // self.down
        return self._resample(piece)[first:]


def pcm_16k_blocks(stream: AudioStream) -> Iterator[np.ndarray]:
    """The stream's audio as 16 kHz mono float32 pieces: `frontend.prepare_audio` of the whole file,
    in pieces."""
    resampler = StreamResampler(stream.rate)
    for block in stream.blocks():
        out = resampler.push(to_float_mono(block))
        if len(out):
            yield out
    tail = resampler.finish()
    if len(tail):
        yield tail


def _log10_mel(samples: torch.Tensor, n_mels: int) -> torch.Tensor:
    """log10 mel power (clamped at 1e-10, before the floor) of the frames whose 400-sample windows
    start every 160 samples of `samples`: log_mel_spectrogram's frames, without its padding."""
    stft = torch.stft(samples, N_FFT, HOP_LENGTH, window=torch.hann_window(N_FFT), center=False,
                      return_complex=True)
    return torch.clamp(mel_filters_tensor(n_mels) @ (stft.abs() ** 2), min=1e-10).log10()


class _PaddedAudio:
    """The audio as log_mel_content's STFT sees it, read forward: torch.stft's reflection in front
    (x[200], ..., x[1]), then the samples, then zeros (log_mel_content's padding and beyond)."""

    def __init__(self, pcm: Iterator[np.ndarray]):
        self._blocks = iter(pcm)
        self.seen = 0          # audio samples read so far
        self.ended = False     # all of them
        self._buf = np.zeros(0, np.float32)
        self._start = 0        # index of _buf[0]; negative once the reflection is in front

    def _pull(self) -> None:
        block = next(self._blocks, None)
        if block is None:
            self.ended = True
            return
        self._buf = np.concatenate([self._buf, np.asarray(block, np.float32)])
        self.seen += len(block)

    def get(self, lo: int, hi: int) -> np.ndarray:
        """Samples [lo, hi); `lo` never before the last `release`."""
        if self._start == 0 and lo < 0:
            while self.seen <= _HALF_WINDOW and not self.ended:
                self._pull()
            ext = np.concatenate([self._buf, np.zeros(max(0, _HALF_WINDOW + 1 - len(self._buf)), np.float32)])
            self._buf = np.concatenate([ext[_HALF_WINDOW:0:-1], self._buf])
            self._start = -_HALF_WINDOW
        while self._start + len(self._buf) < hi and not self.ended:
            self._pull()
        short = hi - self._start - len(self._buf)
        if short > 0:   # past the end: zeros
            self._buf = np.concatenate([self._buf, np.zeros(short, np.float32)])
        return self._buf[lo - self._start:hi - self._start]

    def release(self, before: int) -> None:
        """Samples before `before` will not be asked for again."""
        drop = min(max(0, before - self._start), len(self._buf))
        self._buf, self._start = self._buf[drop:], self._start + drop


def log10_mel_pieces(pcm: Iterator[np.ndarray], n_mels: int,
                     piece_frames: int = MEL_PIECE_FRAMES) -> Iterator[tuple[torch.Tensor, int]]:
    """(log10 mel frames [n_mels, k], audio samples read so far) in order, for every frame
    `log_mel_content` takes its floor over: those of the audio followed by _TAIL_PAD zeros. The
    sample count is the audio's length in the last piece."""
    audio = _PaddedAudio(pcm)
    frame = 0
    while True:
        stop = frame + piece_frames
        samples = audio.get(frame * HOP_LENGTH - _HALF_WINDOW, (stop - 1) * HOP_LENGTH + _HALF_WINDOW)
        if audio.ended:
            stop = min(stop, (audio.seen + _TAIL_PAD) // HOP_LENGTH)
            if stop <= frame:
                return
            samples = samples[:(stop - frame - 1) * HOP_LENGTH + N_FFT]
        yield _log10_mel(torch.from_numpy(samples), n_mels), audio.seen
        frame = stop
        audio.release(frame * HOP_LENGTH - _HALF_WINDOW)


class StreamedLogMel:
    """Whisper log-mel frames of a long recording, computed as the long-form loop asks for them:
    `frames(start, stop)` with `start` never going back; earlier frames are forgotten. `pcm`: a
    function giving the 16 kHz float32 pieces from the start (called twice: a pass for the floor,
    then one for the windows). n_samples and content_frames are known after construction."""

    def __init__(self, pcm: Callable[[], Iterator[np.ndarray]], n_mels: int = 80,
                 piece_frames: int = MEL_PIECE_FRAMES):
        peak, seen = -np.inf, 0
        for piece, seen in log10_mel_pieces(pcm(), n_mels, piece_frames):
            peak = max(peak, float(piece.max()))
        if seen == 0:
            raise ValueError("audio is empty")
        self.n_samples = seen
        self.content_frames = seen // HOP_LENGTH
        self._floor = peak - 8.0
        self._n_mels = n_mels
        self._pieces = log10_mel_pieces(pcm(), n_mels, piece_frames)
        self._buf = torch.zeros(n_mels, 0)
        self._buf_start = 0   # frame index of _buf[:, 0]

    def frames(self, start: int, stop: int) -> torch.Tensor:
        """Frames [start, min(stop, content_frames)) as log_mel_content gives them."""
        if start < self._buf_start:
            raise ValueError(f"frames {start}.. were already released (the stream is at {self._buf_start})")
        stop = min(stop, self.content_frames)
        while self._buf_start + self._buf.shape[1] < stop:
            piece, _ = next(self._pieces)
            piece = (torch.maximum(piece, torch.tensor(self._floor)) + 4.0) / 4.0
            self._buf = torch.cat([self._buf, piece], dim=1)
        self._buf = self._buf[:, start - self._buf_start:]
        self._buf_start = start
        return self._buf[:, :max(0, stop - start)]
