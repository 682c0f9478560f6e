"""The end-to-end run's Markdown section: one row per (family, task, concurrency) with both sides'
whole latency, time to first token, throughput and phases, then the issue's goals read off the rows,
what was skipped and why, and what failed."""
from __future__ import annotations

from typing import Any

from e2e_phases import PHASES

# Issue 39's goals (H200): whole latency at concurrency 1 <= 0.5x the peer's, throughput at 8 >= 2x,
# and two absolute ones.
LATENCY_RATIO, THROUGHPUT_RATIO = 0.5, 2.0
ABSOLUTE = (("moondream2", "detect 756x756", 0.025), ("whisper-large-v3-turbo", "transcribe 30 s", 0.080))


def ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.1f}" if x < 10 else f"{x * 1e3:.0f}"


def rps(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}" if x >= 1 else f"{x:.2f}"


def _get(r: dict[str, Any] | None, key: str, fmt: Any) -> str:
    return "-" if r is None else fmt(r.get(key))


def phases(r: dict[str, Any] | None) -> str:
    if r is None:
        return "-"
    return " / ".join(ms(r["phases_s"][p]) if r["phases_s"][p] or p != "decode_image" else "-" for p in PHASES)


def pairs(rows: list[dict[str, Any]]) -> list[tuple[tuple, dict | None, dict | None]]:
    """(family, task, c) -> (ours, peer) in the order the rows came."""
    found: dict[tuple, dict[str, dict]] = {}
    for r in rows:
        found.setdefault((r["family"], r["task"], r["concurrency"]), {})[r["side"]] = r
    out = []
    for key, sides in found.items():
        out.append((key, sides.get("ours"), sides.get("peer")))
        if "peer+compile" in sides:
            out.append(((key[0], key[1], key[2]), None, sides["peer+compile"]))
    return out


def section(out: dict[str, Any], args: Any) -> list[str]:
    from report import heading
    m = out.get("machine", {})
    where = "cuda" if str(getattr(args, "device", "cpu")).startswith("cuda") else "cpu"
    title = {"cuda": "End to end on GPU: whole skills against their peers (random weights, real shapes)",
             "cpu": "End to end on CPU: whole skills against their peers (random weights, real shapes)"}[where]
    if getattr(args, "dry_run", False):
        title = "End to end, dry run (tiny shapes: a check of the script, not figures)"
    lines = heading(title)
    lines += [f"{m.get('gpu', 'CPU')}; Python {m.get('python')}, torch {m.get('torch')}, Triton {m.get('triton')}, "
              f"transformers {m.get('transformers')}; 1-minute load {m.get('load_1min')} at the start, "
              f"{_load():.2f} at the end; run {out.get('seconds', 0):.0f} s. Ours: photon_core "
              f"(backend {getattr(args, 'backend', '?')}, {getattr(args, 'dtype', '?')}); each family's peer "
              "below.", "",
              "Per row: c requests at once (each its own JPEG frame or audio clip); ms = median whole latency "
              "of the c requests (ours: one batch, all end together; transformers: one batched generate; "
              "the Moondream reference: one request after another, its c > 1 rows derived from c = 1 "
              "(marked ~): mean latency (c + 1) / 2 requests, throughput one request's). TTFT: the first "
              "token's logits exist. Phases (one instrumented call, synchronized at each boundary, ms): "
              "image decode / crops or resize (log-mel for speech) / encoder / prefill / decode (the rest, "
              "host work included).", "",
              "| family | task | c | photon ms | peer | peer ms | photon / peer | TTFT ms (photon / peer) "
              "| req/s (photon / peer) | photon phases ms | peer phases ms |",
              "|---|---|---:|---:|---|---:|---:|---:|---:|---|---|"]
    fams = out.get("families", {})
    for (family, task, c), ours, peer in pairs(out.get("rows", [])):
        label = peer["label"] if peer else (fams.get(family, {}).get("peer") or "-")
        q = "~" if peer and peer.get("derived") else ""
        cells = [family, task, str(c), _get(ours, "latency_s", ms), label, q + _get(peer, "latency_s", ms),
                 f"{ours['latency_s'] / peer['latency_s']:.2f}" if ours and peer else "-",
                 f"{_get(ours, 'ttft_s', ms)} / {q}{_get(peer, 'ttft_s', ms)}",
                 f"{_get(ours, 'throughput_rps', rps)} / {q}{_get(peer, 'throughput_rps', rps)}",
                 phases(ours), phases(peer)]
        lines.append("| " + " | ".join(cells) + " |")
    lines += [""] + goals(out.get("rows", []))
    notes = []
    for name, f in fams.items():
        bits = [f"set up in {f.get('setup_s', '?')} s"] if "setup_s" in f else []
        if f.get("dtype"):
            bits.append(f"{f['dtype']} on both sides")
        if f.get("peer_skip"):
            bits.append(f"no peer: {f['peer_skip']}")
        bits += f.get("notes", [])
        notes.append(f"- {name}: " + "; ".join(bits) + ".")
    if notes:
        lines += ["", "Families:"] + notes
    skipped = out.get("skipped", [])
    if skipped:
        reasons: dict[str, int] = {}
        for s in skipped:
            reasons[s["reason"].split(":")[0] if s["reason"].startswith("budget") else s["reason"]] = \
                reasons.get(s["reason"].split(":")[0] if s["reason"].startswith("budget") else s["reason"], 0) + 1
        lines += ["", f"Skipped {len(skipped)} configurations: " +
                  "; ".join(f"{n} for {why}" for why, n in reasons.items()) + " (gpu_e2e.json lists them)."]
    if out.get("failures"):
        lines += ["", "Failed: " + "; ".join(f"{f['part']} ({f['error'][:160]})" for f in out["failures"]) + "."]
    pw = out.get("prewarm") or []
    if pw:
        done = [p for p in pw if not p.get("error")]
        each = ", ".join(f"{p['family']} B{p['bucket']} {p['seconds']} s" for p in pw)
        lines += ["", f"Prewarm children: {len(done)} of {len(pw)} built their bucket ({each})."]
    return lines


def goals(rows: list[dict[str, Any]]) -> list[str]:
    """The issue's goals, each met or not, from the rows that measured them."""
    by = {(r["family"], r["task"], r["concurrency"], r["side"]): r for r in rows}
    lat, thr = [], []
    for (f, t, c, side), r in by.items():
        peer = by.get((f, t, c, "peer"))
        if side != "ours" or peer is None:
            continue
        if c == 1:
            lat.append(r["latency_s"] / peer["latency_s"] <= LATENCY_RATIO)
        if c == 8:
            thr.append(r["throughput_rps"] / peer["throughput_rps"] >= THROUGHPUT_RATIO)
    out = [f"Goals: latency at c = 1 <= {LATENCY_RATIO}x the peer's: {sum(lat)} of {len(lat)} tasks; "
           f"throughput at c = 8 >= {THROUGHPUT_RATIO}x the peer's: {sum(thr)} of {len(thr)} tasks"]
    for f, t, limit in ABSOLUTE:
        r = by.get((f, t, 1, "ours"))
        out[-1] += f"; {f} {t} under {limit * 1e3:.0f} ms: " + (
            "not measured" if r is None else f"{'yes' if r['latency_s'] < limit else 'no'} ({ms(r['latency_s'])} ms)")
    out[-1] += "."
    return out


def _load() -> float:
    import os
    return os.getloadavg()[0]
