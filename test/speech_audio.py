"""Real speech with a known text, made by espeak-ng, for speech tests (cached per process)."""
from __future__ import annotations

import contextlib
import functools
import importlib
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from photon_core.audio_io import read_wav

_DIR = Path(tempfile.mkdtemp(prefix="photon-speech-"))
_BENCH = Path(__file__).resolve().parents[1] / "bench"


def words(text: str) -> list[str]:
    """Lower-case words without punctuation: transcripts compared with the text spoken."""
    return re.sub(r"[^a-z0-9 ]", "", text.lower()).split()


@functools.lru_cache(maxsize=None)
def espeak_wav(text: str, voice: str | None = "en-us", speed: int = 160, word_gap: int = 0) -> Path:
    """A 22050 Hz mono 16-bit WAV of `text` (voice None: espeak-ng's default voice; word_gap:
    espeak-ng's -g, a pause between words in 10 ms units at 175 words per minute)."""
    path = _DIR / f"{abs(hash((text, voice, speed, word_gap)))}.wav"
    gap = ["-g", str(word_gap)] if word_gap else []
    args = ["espeak-ng"] + (["-v", voice] if voice else []) + ["-s", str(speed), *gap, "-w", str(path), text]
    subprocess.run(args, check=True, capture_output=True)
    return path


def espeak_pcm(text: str, **kwargs) -> tuple[np.ndarray, int]:
    """float32 samples in [-1, 1] and their rate."""
    samples, rate = read_wav(espeak_wav(text, **kwargs))
    return samples.astype(np.float32) / 32768.0, rate


def speech_set(ids: tuple[str, ...] | None = None) -> tuple[Path, list[dict]]:
    """bench/speech_set.py's utterances (`ids`, or all), built once per process into a temporary
    folder (a second or two: espeak-ng and sox are fast); the folder and the manifest rows."""
    return _speech_set(tuple(ids) if ids is not None else None)


@functools.lru_cache(maxsize=None)
def _speech_set(ids: tuple[str, ...] | None) -> tuple[Path, list[dict]]:
    folder = _DIR / f"set-{abs(hash(ids))}"
    return folder, bench_module("speech_set").build(folder, ids)


def set_pcm(folder: Path, row: dict) -> np.ndarray:
    """float32 samples of one speech set file."""
    return bench_module("speech_set").read_pcm(folder / row["file"])


def bench_module(name: str):
    """A module of bench/ (a folder of scripts, not a package): the speech set, the WER."""
    if str(_BENCH) not in sys.path:
        sys.path.append(str(_BENCH))
    return importlib.import_module(name)


@contextlib.contextmanager
def unspun_speech_node() -> Iterator:
    """A real SpeechNode in a context of its own, never spun: tests feed it through take_audio (the
    subscription callback's body), without partials or speculation, so only the cuts show."""
    import rclpy
    from rclpy.parameter import Parameter

    from photon_ros.speech_node import SpeechNode
    ctx = rclpy.Context()
    rclpy.init(context=ctx)
    node = SpeechNode(context=ctx, parameter_overrides=[Parameter("autostart", value=False),
                                                        Parameter("partial_interval_s", value=0.0),
                                                        Parameter("speculate", value=False)])
    try:
        yield node
    finally:
        node.destroy_node()
        rclpy.shutdown(context=ctx)
