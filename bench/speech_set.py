"""A broad spoken test set made from text: espeak-ng voices, rates and word gaps, clean and noisy.

    python bench/speech_set.py [--folder DIR] [--slice]

Robot commands, numbers, names and longer dictation, each spoken once by one of several espeak-ng
voices and variants at 130-200 words per minute (some commands with pauses between words), then
the same audio again with white, pink or brown noise (sox) at 10-20 dB SNR. 1-60 s per file.
Writes 16-bit WAVs and `manifest.json` (file, reference text, voice, rate, word gap, SNR, noise,
duration, longest pause, ...) into a cache folder. Everything is deterministic: the same script,
espeak-ng and sox give the same samples, so tests (a small slice, `SLICE`) and the benchmark (all
of it) can share and trust it.

SNR is speech power over the spoken part (the file without the silence padded around it) against
noise power; the noise covers the whole file, padding included, as a room's noise would.
Needs the `espeak-ng` and `sox` programs; nothing from photon_core.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import subprocess
import sys
import tempfile
import wave
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

VERSION = 1
SEED = 16
SAMPLE_RATE = 22050          # espeak-ng's own rate: no resampling before the model's front end
LEAD_S, TAIL_S = 0.3, 0.5    # silence around the speech, as a microphone would hear it
PEAK_DB = -6.0               # speech is peak-normalised here, leaving headroom for the noise
MIN_S, MAX_S = 1.0, 60.0
NOISE_S = 70.0               # one long noise per colour; each file takes its own stretch of it
NOISES = ("white", "pink", "brown")
SNR_RANGE = (10.0, 20.0)

# Voice and variant pairs: accents (US, British, Scottish, Caribbean, New York, RP, Lancaster,
# West Midlands) and male/female variants, so no single voice dominates the set.
VOICES = ("en-us", "en-gb+m3", "en-us+f3", "en-gb-scotland", "en-029+f2", "en-us-nyc+m7",
          "en-gb-x-rp+f4", "en-gb-x-gbclan", "en-gb-x-gbcwmd+m1")
RATES = (130, 145, 160, 175, 190, 200)
WORD_GAPS_MS = (100, 150, 200)   # pauses added between the words of some commands

COMMANDS = (
    "Stop.",
    "Turn left.",
    "Go to the kitchen and bring me a glass of water.",
    "Turn on the lights in the living room.",
    "Pick up the red cup and put it in the sink.",
    "Move forward slowly and stop at the door.",
    "Find the person near the window.",
    "Go back to the charging station.",
    "Open the gripper, then close it again.",
    "Follow me to the garage.",
    "Look at the blue box on the top shelf.",
    "Please clean the table in the dining room.",
    "Turn around and face the wall.",
    "Bring the green bottle to the office.",
    "Check whether the back door is locked.",
    "Hand me the screwdriver from the toolbox.",
    "Drive to the loading dock and wait there.",
    "Put the book on the desk next to the lamp.",
    "Show me where you left the keys.",
    "Raise the arm a little and hold it there.",
)
NUMBERS = (
    "Move forward 3 meters.",
    "Turn 90 degrees to the right.",
    "Set the speed to 25 percent.",
    "Go to room 214 on the second floor.",
    "Wait 15 seconds, then continue.",
    "The battery is at 42 percent.",
    "Pick up 7 apples and 12 oranges.",
    "Lower the arm by 2.5 centimeters.",
)
NAMES = (
    "Ask Maria to bring the package to the front desk.",
    "Tell David that the meeting starts at noon.",
    "Call Sarah and say the robot is ready.",
    "Take this letter to Doctor Patel in the lab.",
    "Follow James to the elevator.",
    "Give the keys to Emma and Oliver.",
    "Is Thomas in the conference room?",
    "Send a message to Anna and Peter.",
)
_SENTENCES = (
    "The quick brown fox jumps over the lazy dog.",
    "Robots are machines that can carry out a series of actions automatically.",
    "Speech recognition lets people talk to computers using their voice.",
    "The weather today is sunny with a light breeze from the west.",
    "Please remember to charge the battery before the next mission.",
    "The library opens at nine in the morning and closes at six in the evening.",
    "We need to buy apples, bread, milk, and eggs from the store.",
    "Navigation uses maps and sensors to find a safe path through the building.",
    "After dinner, the family went for a walk along the river.",
    "The children played in the park while their parents talked about the garden.",
    "A small boat moved slowly across the lake as the sun went down behind the hills.",
    "The warehouse robot carries shelves of parts from the storage area to the packing line.",
    "Every morning the nurse checks the schedule and prepares the medicine for the patients.",
    "Cameras on the front of the vehicle watch the road for people and other cars.",
    "The old bridge was closed last winter, so the trucks now take the longer road.",
    "Good software is tested often, and every change is reviewed by another engineer.",
)
# Dictation: runs of the sentences above, from one sentence to a minute of speech.
_DICTATION_RUNS = ((0, 2), (2, 4), (4, 8), (8, 13), (0, 9), (5, 16))

SLICE = ("command-03-clean", "command-12-clean", "number-03-clean", "name-07-clean",
         "command-04-noisy", "number-05-noisy")
"""A few short utterances for tests: five voices, word gaps, a comma, numbers, a name, noise."""


@dataclass(frozen=True)
class Entry:
    id: str
    kind: str                  # command, number, name, dictation
    text: str
    voice: str
    rate: int                  # words per minute (espeak-ng -s)
    word_gap_ms: int           # pause added between words; 0 = the voice's own
    noise: str                 # "" for clean, else the sox noise colour
    snr_db: float | None       # None for clean
    noise_offset_s: float      # where in the long noise this file's stretch starts
    clean_id: str              # for noisy entries, the clean twin holding the same speech

    @property
    def file(self) -> str:
        return f"{self.id}.wav"


def _texts() -> list[tuple[str, str]]:
    dictation = tuple(" ".join(_SENTENCES[a:b]) for a, b in _DICTATION_RUNS)
    return [(kind, text) for kind, texts in (("command", COMMANDS), ("number", NUMBERS),
                                              ("name", NAMES), ("dictation", dictation))
            for text in texts]


def entries() -> list[Entry]:
    """The whole set, in a fixed order: each text clean, then with noise."""
    out, counts = [], {}
    for i, (kind, text) in enumerate(_texts()):
        counts[kind] = counts.get(kind, 0) + 1
        base = f"{kind}-{counts[kind]:02d}"
        # Strides coprime with the table sizes, so voices, rates and gaps combine variously.
        voice, rate = VOICES[i % len(VOICES)], RATES[(5 * i) % len(RATES)]
        gap = WORD_GAPS_MS[(i // 3) % len(WORD_GAPS_MS)] if kind == "command" and i % 3 == 2 else 0
        clean = Entry(f"{base}-clean", kind, text, voice, rate, gap, "", None, 0.0, "")
        rng = random.Random(f"{SEED}:{base}")   # str seeds are stable across Python versions
        snr = round(rng.uniform(*SNR_RANGE), 1)
        offset = round(rng.uniform(0.0, NOISE_S - MAX_S), 3)
        noisy = Entry(f"{base}-noisy", kind, text, voice, rate, gap, NOISES[i % len(NOISES)], snr,
                      offset, clean.id)
        out += [clean, noisy]
    return out


def _tool_version(cmd: list[str]) -> str:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    except FileNotFoundError:
        raise RuntimeError(f"the speech set needs {cmd[0]}: `apt-get install espeak-ng sox` "
                           "(scripts/setup.sh does it as root)") from None
    return (out.stdout or out.stderr).strip().splitlines()[0]


def fingerprint(selected: list[Entry]) -> str:
    """Changes whenever the audio could: the spec, this script's version, the tools' versions."""
    spec = {"version": VERSION, "entries": [asdict(e) for e in selected],
            "espeak-ng": _tool_version(["espeak-ng", "--version"]),
            "sox": _tool_version(["sox", "--version"])}
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]


def default_folder() -> Path:
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "photon" / "speech-set"


def read_pcm(path: Path) -> np.ndarray:
    """float32 samples in [-1, 1] of a 16-bit mono WAV."""
    with wave.open(str(path), "rb") as f:
        if f.getsampwidth() != 2 or f.getnchannels() != 1:
            raise ValueError(f"{path}: expected 16-bit mono")
        return np.frombuffer(f.readframes(f.getnframes()), "<i2").astype(np.float32) / 32768.0


def _sox(*args: str) -> None:
    # -D: no dither, -R: repeatable noise; both keep the output bit-exact from run to run.
    subprocess.run(["sox", "-D", "-R", *args], check=True, capture_output=True)


def espeak_gap_units(gap_ms: int, rate: int) -> int:
    """espeak-ng's -g counts 10 ms units at its default 175 words per minute and stretches them
    at slower rates: convert so the pause is `gap_ms` at any rate."""
    return max(1, round(gap_ms / 10 * rate / 175))


def _speak(entry: Entry, path: Path, tmp: Path) -> None:
    raw = tmp / f"{entry.id}.raw.wav"
    gap = ["-g", str(espeak_gap_units(entry.word_gap_ms, entry.rate))] if entry.word_gap_ms else []
    subprocess.run(["espeak-ng", "-v", entry.voice, "-s", str(entry.rate), *gap, "-w", str(raw),
                    entry.text], check=True, capture_output=True)
    _sox(str(raw), "-r", str(SAMPLE_RATE), "-b", "16", str(path), "gain", "-n", str(PEAK_DB),
         "pad", str(LEAD_S), str(TAIL_S))


def _noise_source(colour: str, tmp: Path) -> Path:
    path = tmp / f"noise-{colour}.wav"
    if not path.exists():
        _sox("-n", "-r", str(SAMPLE_RATE), "-c", "1", "-b", "16", str(path), "synth", str(NOISE_S),
             f"{colour}noise", "gain", "-n", "-3")
    return path


def speech_span(samples: np.ndarray) -> np.ndarray:
    """The spoken part of a clean file: without the padding added around it."""
    return samples[round(LEAD_S * SAMPLE_RATE):samples.size - round(TAIL_S * SAMPLE_RATE)]


def _mix(entry: Entry, clean: Path, path: Path, tmp: Path) -> None:
    """clean + noise scaled to the entry's SNR (speech power over the spoken part)."""
    speech = read_pcm(clean)
    first = round(entry.noise_offset_s * SAMPLE_RATE)
    stretch = tmp / f"{entry.id}.noise.wav"
    _sox(str(_noise_source(entry.noise, tmp)), str(stretch), "trim", f"{first}s", f"{speech.size}s")
    noise = read_pcm(stretch)
    p_speech = float(np.mean(np.square(speech_span(speech), dtype=np.float64)))
    p_noise = float(np.mean(np.square(noise, dtype=np.float64)))
    gain = (p_speech / (p_noise * 10 ** (entry.snr_db / 10))) ** 0.5
    _sox("-m", "-v", "1", str(clean), "-v", f"{gain:.9f}", str(stretch), "-b", "16", str(path))


def longest_pause_s(samples: np.ndarray, quiet_db: float = -50.0) -> float:
    """Longest stretch of 10 ms frames below `quiet_db` between the first and last sound: the
    pause a voice-activity detector must bridge to keep the utterance whole. Measure it on clean
    audio (noise fills pauses)."""
    frame = SAMPLE_RATE // 100
    n = samples.size // frame
    power = np.mean(np.square(samples[:n * frame].reshape(n, frame), dtype=np.float64), axis=1)
    loud = np.flatnonzero(power > 10 ** (quiet_db / 10))
    if loud.size == 0:
        return 0.0
    gaps = np.diff(loud) - 1    # quiet frames between consecutive loud ones
    return float(gaps.max(initial=0)) * frame / SAMPLE_RATE


def _check(entry: Entry, path: Path) -> float:
    samples = read_pcm(path)
    duration = samples.size / SAMPLE_RATE
    if not MIN_S <= duration <= MAX_S:
        raise ValueError(f"{entry.id}: {duration:.1f} s is outside {MIN_S:g}-{MAX_S:g} s; "
                         "shorten or lengthen its text")
    if np.max(np.abs(samples)) >= 32767 / 32768:
        raise ValueError(f"{entry.id}: clipped; lower PEAK_DB")
    return duration


def select(ids: list[str] | tuple[str, ...] | None = None) -> list[Entry]:
    """The entries named (with the clean twins noisy ones are made from), or all of them."""
    every = entries()
    if ids is None:
        return every
    by_id = {e.id: e for e in every}
    unknown = [i for i in ids if i not in by_id]
    if unknown:
        raise ValueError(f"unknown speech set ids {unknown}")
    wanted = set(ids) | {by_id[i].clean_id for i in ids if by_id[i].clean_id}
    return [e for e in every if e.id in wanted]


def build(folder: Path | str | None = None, ids: list[str] | tuple[str, ...] | None = None,
          ) -> list[dict]:
    """Make the WAVs and manifest.json in `folder` (reused when already made from the same
    spec and tools); returns the manifest's rows."""
    folder = Path(folder or default_folder())
    selected = select(ids)
    key = fingerprint(selected)
    manifest = folder / "manifest.json"
    if manifest.exists():
        saved = json.loads(manifest.read_text())
        if saved.get("fingerprint") == key and all((folder / r["file"]).exists() for r in saved["entries"]):
            return saved["entries"]
    folder.mkdir(parents=True, exist_ok=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="speech-set-") as tmp_name:
        tmp = Path(tmp_name)
        for entry in selected:
            target = tmp / entry.file   # made aside, then moved: readers never see half a file
            if entry.clean_id:
                _mix(entry, folder / f"{entry.clean_id}.wav", target, tmp)
            else:
                _speak(entry, target, tmp)
            duration = _check(entry, target)
            clean = folder / f"{entry.clean_id}.wav" if entry.clean_id else target
            pause = longest_pause_s(read_pcm(clean))
            os.replace(target, folder / entry.file)
            rows.append({**asdict(entry), "file": entry.file, "duration_s": round(duration, 3),
                         "pause_s": round(pause, 2), "sample_rate": SAMPLE_RATE,
                         "lead_s": LEAD_S, "tail_s": TAIL_S})
    payload = {"fingerprint": key, "seed": SEED, "entries": rows}
    part = folder / "manifest.json.part"
    part.write_text(json.dumps(payload, indent=1))
    os.replace(part, manifest)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--folder", type=Path, default=None, help=f"default {default_folder()}")
    parser.add_argument("--slice", action="store_true", help="only the tests' slice")
    args = parser.parse_args()
    rows = build(args.folder, SLICE if args.slice else None)
    durations = [r["duration_s"] for r in rows]
    print(f"{len(rows)} utterances in {args.folder or default_folder()}: {sum(durations) / 60:.1f} min, "
          f"{min(durations):.1f}-{max(durations):.1f} s, {len({r['voice'] for r in rows})} voices")
    for kind in ("command", "number", "name", "dictation"):
        print(f"  {kind}: {sum(r['kind'] == kind for r in rows)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
