"""`python -m photon_core transcribe FILE.wav [--model whisper-tiny.en]`: the result as JSON.

The speech command, shared by every transcribing family (each names this module as its `cli`): it
loads whatever `--model` names through the registry, so Whisper, Parakeet and Qwen3-ASR all serve it."""
from __future__ import annotations

import argparse
import json
import sys

from photon_core import cli_checks
from photon_core.audio_io import AudioFileError, open_audio_stream, read_wav
from photon_core.cli_checks import UserError
from photon_core.contracts import SpeechModel, StreamingSpeechModel


def _run(args: argparse.Namespace) -> int:
    stream = open_audio_stream(args.file)   # the header now: its errors name the file
    # Any family that transcribes: the checkpoint given with --model decides which.
    model = cli_checks.load_model(args.model, args.device, args.dtype, ("transcribe",))
    assert isinstance(model, SpeechModel)   # a family that transcribes: this tells the type checker
    try:
        if isinstance(model, StreamingSpeechModel):   # memory independent of the file's length
            result = model.transcribe_stream(stream, language=args.language,
                                             timestamps=not args.no_timestamps,
                                             initial_prompt=args.initial_prompt)
        else:
            audio, rate = read_wav(args.file)
            result = model.transcribe(audio, rate, language=args.language, timestamps=not args.no_timestamps,
                                      initial_prompt=args.initial_prompt)
    except AudioFileError:   # a bad sample found while streaming: its message names the file
        raise
    except ValueError as err:   # the model's own checks: the audio, --language, --initial-prompt
        raise UserError(f"transcribe {args.file}: {err}") from err
    json.dump(result, sys.stdout, ensure_ascii=False, indent=2)
    sys.stdout.write("\n")
    return 0


def add_commands(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("transcribe", help="speech to text (JSON output) with any transcribing family: "
                                                 "Whisper, Parakeet, Qwen3-ASR")
    p.add_argument("file", help="audio file (WAV: PCM 8/16/24/32-bit or float, any channel count; "
                                "more formats with soundfile)")
    p.add_argument("--model", default="whisper-tiny.en",
                   help="model name, local path (folder, .nemo, ...), or Hugging Face id in the local cache")
    p.add_argument("--language", default=None, help="language code (default: detect / en)")
    p.add_argument("--no-timestamps", action="store_true", help="decode without timestamps")
    p.add_argument("--initial-prompt", default=None, help="text to condition the first window on")
    p.add_argument("--device", default="cpu", type=cli_checks.device, help="cpu, cuda or cuda:N")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="encoder precision (default: float32 on CPU, float16 on CUDA; bfloat16 is faster "
                        "on CPUs with AMX/AVX512-BF16 at some WER cost)")
    p.set_defaults(run=_run)
