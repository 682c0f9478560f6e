"""Latency of our Whisper against openai-whisper on the same weights, in one process.

    python bench/whisper_latency.py [--runs 7] [--model whisper-tiny.en]

Speech comes from espeak-ng (~3 s and ~10 s commands). Runs are interleaved so that load from
other processes hits every engine alike; medians (and minima, the better estimate on a machine
with noisy neighbours) are printed. faster-whisper is not timed here:
CTranslate2 and torch in one process slow each other down, so time it in its own process.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "test"))

CLIPS = {
    "3s": ("Robot, please turn on the kitchen lights now.", 150),
    "10s": ("Please move the robot arm to the left side of the table, then pick up the red cup "
            "and place it gently in the sink.", 130),
}


def main(argv: list[str] | None = None) -> int:
    from photon_core.audio_io import read_wav
    from photon_core.models.whisper import load_whisper
    from photon_core.models.whisper.frontend import prepare_audio
    from photon_core.models.whisper.transcribe import cpu_has_fast_bf16
    from speech_audio import espeak_wav

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--model", default="whisper-tiny.en")
    args = ap.parse_args(argv)

    engines = {"ours_fp32": load_whisper(args.model, dtype="float32")}
    if cpu_has_fast_bf16():
        engines["ours_bf16"] = load_whisper(args.model, dtype="bfloat16")
    reference = None
    try:
        import whisper
        from photon_core.models.whisper.checkpoint import load_checkpoint_file, resolve_whisper

        ours = engines["ours_fp32"]
        reference = whisper.model.Whisper(whisper.model.ModelDimensions(**ours.dims.as_dict()))
        sd = load_checkpoint_file(resolve_whisper(args.model).path).state_dict
        reference.load_state_dict({k: v.float() for k, v in sd.items()})
        reference.eval()
    except ImportError:
        print("openai-whisper not installed: timing ours only")

    print(f"threads {torch.get_num_threads()}, fast bf16 CPU: {cpu_has_fast_bf16()}")
    for key, (text, speed) in CLIPS.items():
        pcm, sr = read_wav(espeak_wav(text, voice=None, speed=speed))   # int16, espeak-ng's default voice
        x = prepare_audio(pcm, sr)
        calls = {name: (lambda m=m: m.transcribe(pcm, sr, timestamps=False))
                 for name, m in engines.items()}
        if reference is not None:
            calls["openai_fp32"] = lambda: whisper.transcribe(
                reference, x, temperature=0.0, fp16=False, language="en",
                without_timestamps=True, verbose=None)
        times: dict[str, list[float]] = {name: [] for name in calls}
        for fn in calls.values():   # warm-up
            fn()
        for _ in range(args.runs):
            for name, fn in calls.items():
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
        med = {name: statistics.median(v) for name, v in times.items()}
        line = ", ".join(f"{n} {med[n]:.3f}s (min {min(v):.3f})" for n, v in times.items())
        if "openai_fp32" in med:
            line += f"; ours_fp32/openai {med['ours_fp32'] / med['openai_fp32']:.2f}"
        print(f"{key} ({len(x) / 16000:.2f} s audio): {line}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
