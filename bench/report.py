"""Printing a benchmark's Markdown section and putting it in bench/RESULTS.md, where each benchmark
keeps only its latest section (a rerun replaces its own; git keeps the history)."""
from __future__ import annotations

import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"


def heading(title: str) -> list[str]:
    """Title with the date, and the exact command that produced the numbers."""
    command = " ".join(["python", "bench/" + Path(sys.argv[0]).name] + sys.argv[1:])
    return [f"### {title} — {time.strftime('%Y-%m-%d')}", "", f"Command: `{command}`", ""]


def replace_section(text: str, section: str) -> str:
    """`text` with the section of the same title (the "### title — date" line, any date) replaced
    by `section`, or `section` appended when there is none."""
    title = section.splitlines()[0].rsplit(" — ", 1)[0]
    parts = text.split("\n### ")
    head, sections = parts[0], ["### " + p for p in parts[1:]]
    kept = [s for s in sections if s.splitlines()[0].rsplit(" — ", 1)[0] != title]
    at = next((i for i, s in enumerate(sections) if s.splitlines()[0].rsplit(" — ", 1)[0] == title), len(sections))
    kept.insert(min(at, len(kept)), section.rstrip("\n") + "\n")
    return "\n".join([head.rstrip("\n") + "\n"] + [s.rstrip("\n") + "\n" for s in kept])


def publish(lines: list[str], write: bool) -> None:
    section = "\n".join(lines) + "\n"
    print(section)
    if write:
        RESULTS.write_text(replace_section(RESULTS.read_text() if RESULTS.exists() else "", section))
