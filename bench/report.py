"""Printing a benchmark's Markdown section and putting it in bench/RESULTS.md, where each benchmark
keeps only its latest section (a rerun replaces its own; git keeps the history)."""
from __future__ import annotations

import os
import re
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"


def machine() -> str:
    """CPU model, cores, the vector flags the engine chooses paths by, memory: machines differ
    between sessions (AVX2 only, or AVX-512 with BF16 / VNNI), so every figure names its own."""
    info = Path("/proc/cpuinfo").read_text()
    model = re.search(r"model name\s*:\s*(.*)", info).group(1).strip()
    flags = set(re.search(r"flags\s*:\s*(.*)", info).group(1).split())
    vector = [f for f in ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile") if f in flags]
    mem = int(re.search(r"MemTotal:\s*(\d+)", Path("/proc/meminfo").read_text()).group(1)) / 2**20
    return (f"{model}, {os.cpu_count()} cores, flags {' '.join(vector) or 'none of avx2/avx512/amx'}, "
            f"{mem:.0f} GiB RAM")


def heading(title: str) -> list[str]:
    """Title with the date, the exact command that produced the numbers, and the machine."""
    command = " ".join(["python", "bench/" + Path(sys.argv[0]).name] + sys.argv[1:])
    return [f"### {title} — {time.strftime('%Y-%m-%d')}", "", f"Command: `{command}`", "",
            f"Machine: {machine()}.", ""]


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
