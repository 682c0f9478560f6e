"""`python -m photon_core transcribe FILE.wav [--model whisper-tiny.en]`: the result as JSON.

The speech command, shared by every transcribing family (each names this module as its `cli`): it
loads whatever `--model` names through the registry, so Whisper, Parakeet and Qwen3-ASR all serve it."""
from __future__ import annotations

import argparse
import sys

from photon_core import cli_checks
from photon_core.audio_io import AudioFileError, AudioStream, open_audio_stream, read_wav
from photon_core.cli_checks import UserError
from photon_core.contracts import SpeechModel, StreamingSpeechModel
from photon_core.runtime.audio_frontend import MAX_CHANNELS, MAX_INPUT_RATE, MIN_INPUT_RATE, to_float_mono


# A header outside the rates recordings have (audio_frontend's bounds) is damaged, and taken at its
# word it would be refused only after the model loaded (1000 samples under a 1 Hz header were once
# "1000 s" of audio and 13 s of work).
MIN_RATE, MAX_RATE = MIN_INPUT_RATE, MAX_INPUT_RATE


def _check_stream(stream: AudioStream, file: str) -> None:
    """What the models would misread in a file's header, refused naming the file, before the
    model is loaded."""
    if not MIN_RATE <= stream.rate <= MAX_RATE:
        raise UserError(f"{file}: declares a sample rate of {stream.rate} Hz, where recordings have "
                        f"{MIN_RATE} to {MAX_RATE} Hz: a damaged header")
    if stream.channels > MAX_CHANNELS:
        # the models' own message would take it for a channel-first array ("pass audio.T")
        raise UserError(f"{file}: {stream.channels} channels, where at most {MAX_CHANNELS} are mixed "
                        f"down; take the microphone's channel N first (`sox {file} out.wav remix N`)")


def _check_options(model: SpeechModel, args: argparse.Namespace) -> None:
    """--language and --initial-prompt against the model's optional check_language / check_prompt
    (photon_core.contracts.SpeechModel): transcribe() takes and ignores what they refuse (Parakeet
    even echoes the language back), so a refusal is the user's error, as for any bad argument."""
    for option, value, hook in (("--language", args.language, "check_language"),
                                ("--initial-prompt", args.initial_prompt, "check_prompt")):
        check = getattr(model, hook, None)
        if value is None or check is None:
            continue
        try:
            check(value)
        except ValueError as err:
            raise UserError(f"argument {option}: {err}") from err


def _run(args: argparse.Namespace) -> int:
    stream = open_audio_stream(args.file)   # the header now: its errors name the file
    _check_stream(stream, args.file)
    # Any family that transcribes: the checkpoint given with --model decides which.
    model = cli_checks.load_model(args.model, args.device, args.dtype, ("transcribe",))
    assert isinstance(model, SpeechModel)   # a family that transcribes: this tells the type checker
    _check_options(model, args)
    try:
        if isinstance(model, StreamingSpeechModel):   # memory independent of the file's length
            result = model.transcribe_stream(stream, language=args.language,
                                             timestamps=not args.no_timestamps,
                                             initial_prompt=args.initial_prompt)
        else:
            audio, rate = read_wav(args.file)
            if audio.ndim == 2:
                # mixed down here, as every family's prepare_audio would: a file is [frames,
                # channels] for sure, where their check of an array would take a clip of fewer
                # frames than channels for a channel-first one ("pass audio.T")
                audio = to_float_mono(audio)
            result = model.transcribe(audio, rate, language=args.language, timestamps=not args.no_timestamps,
                                      initial_prompt=args.initial_prompt)
    except AudioFileError:   # a bad sample found while streaming: its message names the file
        raise
    except ValueError as err:   # the model's own checks: the audio, --language, --initial-prompt
        raise UserError(f"transcribe {args.file}: {err}") from err
    sys.stdout.write(cli_checks.json_text(result, ensure_ascii=False, indent=2) + "\n")
    return 0


def add_commands(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("transcribe", help="speech to text (JSON output) with any transcribing family: "
                                                 "Whisper, Parakeet, Qwen3-ASR")
    p.add_argument("file", help=f"audio file (WAV: PCM 8/16/24/32-bit or float, up to {MAX_CHANNELS} "
                                f"channels mixed down, {MIN_RATE // 1000} to {MAX_RATE // 1000} kHz; more "
                                f"formats with soundfile)")
    p.add_argument("--model", default="whisper-tiny.en", type=cli_checks.non_empty,   # "" would be the current folder
                   help="model name, local path (folder, .nemo, ...), or Hugging Face id in the local cache")
    p.add_argument("--language", default=None, help="language code (default: detect / en)")
    p.add_argument("--no-timestamps", action="store_true", help="decode without timestamps")
    p.add_argument("--initial-prompt", default=None, help="text to condition the first window on")
    p.add_argument("--device", default="cpu", type=cli_checks.device, help="cpu, cuda or cuda:N")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="encoder precision (default: float32 on CPU, float16 on CUDA; bfloat16 is faster "
                        "on CPUs with AMX/AVX512-BF16 at some WER cost)")
    p.set_defaults(run=_run)
