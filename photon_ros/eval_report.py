"""The evaluation report: one PNG with four panels on the input timeline (seconds from the first
input stamp): latency per result, detections per frame, transcripts over the audio, and which
frames gave no result (dropped by the vision node, or lost on the way)."""
from __future__ import annotations

import itertools
import json
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

FINAL, INCOMPLETE, PARTIAL = "tab:green", "tab:orange", "0.6"


@dataclass
class ReportData:
    title: str
    rows: dict[str, list[dict]]                       # result_log.result_rows()
    frame_times: list[float] = field(default_factory=list)       # each published frame
    frame_has_result: list[bool | None] = field(default_factory=list)   # None: not known (shared stamp)
    frame_note: str = ""                              # the vision node's counters, in words
    audio_times: np.ndarray | None = None             # the input audio's envelope: bin times (s),
    audio_low: np.ndarray | None = None               # lowest and highest sample of each bin
    audio_high: np.ndarray | None = None


def plot_report(path: Path, data: ReportData) -> None:
    """Write the report PNG."""
    import matplotlib
    matplotlib.use("Agg")   # files only: no display on robots and CI
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(4, 1, figsize=(12, 12), sharex=True,
                             gridspec_kw={"height_ratios": [3, 2, 3, 1.3]})
    latency_panel(axes[0], data.rows)
    detections_panel(axes[1], data.rows.get("detections", []))
    transcript_panel(axes[2], data.rows.get("transcript", []), data.audio_times, data.audio_low,
                     data.audio_high)
    frames_panel(axes[3], data.frame_times, data.frame_has_result, data.frame_note)
    axes[-1].set_xlabel("input time (s from the first input stamp)")
    fig.suptitle(data.title, fontsize=11, x=0.01, ha="left")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _empty(ax, text: str) -> None:
    ax.text(0.5, 0.5, text, transform=ax.transAxes, ha="center", va="center", color="0.4")
    ax.set_yticks([])


def result_time(row: dict) -> float | None:
    """Where a result sits on the timeline: its frame's time, or the end of its utterance."""
    if row.get("time_s") is None:
        return None
    return row["time_s"] + float(row.get("audio_duration") or 0.0)


def latency_panel(ax, rows: dict[str, list[dict]]) -> None:
    ax.set_title("latency per result: input published -> result received", loc="left", fontsize=10)
    series = [(label, [(result_time(r), r["delay_s"]) for r in subset
                       if r.get("delay_s") is not None and result_time(r) is not None])
              for topic, topic_rows in rows.items() for label, subset in _latency_series(topic, topic_rows)]
    series = [(label, points) for label, points in series if points]
    # Results of one frame are decoded together and share a delay: distinct, hollow markers keep
    # every series visible where they coincide.
    for (label, points), marker in zip(series, itertools.cycle("os^Dvp*")):
        x, y = zip(*points)
        ax.plot(x, y, marker, ms=6, mfc="none", mew=1.5, label=f"{label} ({len(points)})")
    if series:
        ax.set_ylabel("seconds")
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=8, loc="upper left")
        ax.grid(alpha=0.3)
    else:
        _empty(ax, "no results tied to an input")


def _latency_series(topic: str, rows: list[dict]):
    if topic == "transcript":
        return [("transcript, final", [r for r in rows if r.get("is_final")]),
                ("transcript, partial", [r for r in rows if not r.get("is_final")])]
    by_prompt: dict[str, list[dict]] = {}
    for row in rows:
        by_prompt.setdefault(row.get("prompt", ""), []).append(row)
    return [(f"{topic} {prompt!r}" if prompt else topic, subset) for prompt, subset in by_prompt.items()]


def detections_panel(ax, rows: list[dict]) -> None:
    ax.set_title("detections per frame", loc="left", fontsize=10)
    by_prompt: dict[str, list[tuple[float, int]]] = {}
    for row in rows:
        if row.get("time_s") is not None:
            by_prompt.setdefault(row["prompt"], []).append((row["time_s"], len(json.loads(row["detections"]))))
    if not by_prompt:
        _empty(ax, "no detections topic results")
        return
    # Prompts often find the same number of objects: distinct markers and dashes keep each visible.
    styles = itertools.cycle([("o", "-"), ("s", "--"), ("^", ":"), ("D", "-.")])
    for (prompt, points), (marker, line) in zip(by_prompt.items(), styles):
        x, y = zip(*sorted(points))
        ax.plot(x, y, marker=marker, ls=line, ms=6, mfc="none", mew=1.5, drawstyle="steps-mid",
                label=repr(prompt))
    ax.set_ylabel("objects")
    ax.set_ylim(bottom=0, top=max(y for pts in by_prompt.values() for _, y in pts) + 1)
    ax.yaxis.get_major_locator().set_params(integer=True)
    ax.legend(fontsize=8, loc="upper left")
    ax.grid(alpha=0.3)


def transcript_panel(ax, rows: list[dict], times: np.ndarray | None, low: np.ndarray | None,
                     high: np.ndarray | None) -> None:
    ax.set_title("transcripts on the audio (green: final, orange: final of incomplete audio, "
                 "grey: partials)", loc="left", fontsize=10)
    if times is None or not len(times):
        _empty(ax, "no audio input")
        return
    peak = float(max(np.max(np.abs(low)), np.max(np.abs(high)))) or 1.0
    ax.fill_between(times, low / peak, high / peak, color="0.7", lw=0, step="mid")
    ax.set_ylim(-1.05, 2.4)
    ax.set_yticks([])
    finals = [r for r in rows if r.get("is_final") and r.get("time_s") is not None]
    partials = [r for r in rows if not r.get("is_final") and r.get("time_s") is not None]
    for i, row in enumerate(partials):
        start = row["time_s"]
        ax.plot([start, start + float(row["audio_duration"])], [1.15 + 0.06 * (i % 4)] * 2,
                color=PARTIAL, lw=2)
    for i, row in enumerate(finals):
        start, end = row["time_s"], row["time_s"] + float(row["audio_duration"])
        color = FINAL if row.get("audio_complete") else INCOMPLETE
        ax.axvspan(start, end, color=color, alpha=0.15)
        ax.plot([start, end], [1.5, 1.5], color=color, lw=4)
        text = textwrap.shorten(row.get("text", ""), width=70, placeholder=" ...")
        ax.text(start, 1.6 + 0.35 * (i % 2), text, fontsize=8, va="bottom", color="black")
    if not rows:
        _empty(ax, "no transcript")


def frames_panel(ax, times: list[float], has_result: list[bool | None], note: str) -> None:
    ax.set_title("frames with and without results" + (f": {note}" if note else ""), loc="left", fontsize=10)
    if not times:
        _empty(ax, "no camera input")
        return
    # a frame whose stamp other frames share: their results name none of them (as in inputs.csv)
    groups = [(True, 1, "|", FINAL, 14, "with results"), (False, 0, "x", "tab:red", 8, "without results"),
              (None, 0.5, "o", "0.5", 6, "stamp shared by several frames: not known")]
    for value, y, marker, color, size, label in groups:
        x = [t for t, has in zip(times, has_result) if has is value]
        if x or value is not None:
            ax.plot(x, [y] * len(x), marker, color=color, ms=size, mew=2, label=f"{label} ({len(x)})")
    ax.set_ylim(-0.6, 1.6)
    ax.set_yticks([0, 1], ["none", "results"])
    ax.legend(fontsize=8, loc="upper right", ncol=2)


def audio_envelope(messages: list, t0_ns: int, bins: int = 4000):
    """The AudioChunk audio of bag messages as (bin times, low, high) on the input timeline,
    each chunk placed at its stamp (ending at its log time when unstamped); (None, None, None) without
    any. std_msgs arrays carry neither a rate nor a stamp and are not drawn."""
    from photon_ros.audio_conversions import audio_chunk_to_pcm
    from photon_ros.msg import AudioChunk

    times, samples = [], []
    for m in messages:
        if not isinstance(m.msg, AudioChunk):
            continue
        try:
            pcm = audio_chunk_to_pcm(m.msg)
        except ValueError:
            continue
        stamp = m.msg.header.stamp.sec * 1_000_000_000 + m.msg.header.stamp.nanosec
        # unstamped: logged as its capture ended
        start = ((stamp or m.log_time_ns) - t0_ns) / 1e9 - (0.0 if stamp else pcm.samples.size / pcm.sample_rate)
        times.append(start + np.arange(pcm.samples.size) / pcm.sample_rate)
        samples.append(pcm.samples)
    if not samples:
        return None, None, None
    t, x = np.concatenate(times), np.concatenate(samples)
    order = np.argsort(t, kind="stable")
    t, x = t[order], x[order]
    edges = np.linspace(0, t.size, min(bins, t.size) + 1).astype(int)
    low = np.minimum.reduceat(x, edges[:-1])
    high = np.maximum.reduceat(x, edges[:-1])
    return t[edges[:-1]], low, high
