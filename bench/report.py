"""Printing a benchmark's Markdown section and appending it to bench/RESULTS.md."""
from __future__ import annotations

import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"


def heading(title: str) -> list[str]:
    """Title with the date, and the exact command that produced the numbers."""
    command = " ".join(["python", "bench/" + Path(sys.argv[0]).name] + sys.argv[1:])
    return [f"### {title} — {time.strftime('%Y-%m-%d')}", "", f"Command: `{command}`", ""]


def publish(lines: list[str], write: bool) -> None:
    section = "\n".join(lines) + "\n"
    print(section)
    if write:
        with open(RESULTS, "a") as f:
            f.write("\n" + section)
