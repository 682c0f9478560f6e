"""Find files that Hugging Face tools already downloaded, without importing huggingface_hub.

The cache layout is `<hub>/models--<org>--<name>/snapshots/<commit>/<file>`, with
`refs/<revision>` holding the commit a revision points at. Nothing here downloads: on a robot the
user fetches weights once (`hf download <repo>`), and we only read what is there.
"""
from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path


def hub_cache_dirs() -> list[Path]:
    """Where the Hugging Face hub cache may live, in the order huggingface_hub itself looks, with
    `~` and `$VAR` expanded as it expands them (a systemd unit, Dockerfile or launch file sets
    HF_HOME=~/hf literally: `hf download` wrote to the expanded folder)."""
    def env(name: str) -> Path | None:
        value = os.environ.get(name)
        return Path(os.path.expandvars(os.path.expanduser(value))) if value else None

    dirs = [d for d in (env("HF_HUB_CACHE"), env("HUGGINGFACE_HUB_CACHE")) if d is not None]
    if (home := env("HF_HOME")) is not None:
        dirs.append(home / "hub")
    dirs.append((env("XDG_CACHE_HOME") or Path.home() / ".cache") / "huggingface" / "hub")
    return dirs


def find_snapshot(repo_id: str, required_file: str, revision: str = "main") -> Path | None:
    """The cached snapshot folder of `repo_id` that holds `required_file`, or None.

    Prefers the commit that `revision` points at; otherwise any snapshot holding the file.
    """
    return next((snap for snap in snapshots(repo_id, revision) if (snap / required_file).exists()),
                None)


def snapshots(repo_id: str, revision: str = "main") -> Iterator[Path]:
    """Every cached snapshot folder of `repo_id`: per cache directory, the commit `revision` points
    at first, then the others, newest first."""
    folder = "models--" + repo_id.replace("/", "--")
    for hub in hub_cache_dirs():
        repo = hub / folder
        snaps = repo / "snapshots"
        if not snaps.is_dir():
            continue
        ref = repo / "refs" / revision
        pinned = snaps / ref.read_text().strip() if ref.is_file() else None
        if pinned is not None and pinned.is_dir():
            yield pinned
        for snap in sorted(snaps.iterdir(), key=lambda p: p.stat().st_mtime, reverse=True):
            if snap != pinned:
                yield snap


def describe_search(repo_id: str) -> str:
    """A sentence naming where we looked, for 'weights not found' errors."""
    folder = "models--" + repo_id.replace("/", "--")
    places = ", ".join(str(d / folder) for d in hub_cache_dirs())
    return f"looked in the Hugging Face cache ({places})"
