"""Find files that Hugging Face tools already downloaded, without importing huggingface_hub.

The cache layout is `<hub>/models--<org>--<name>/snapshots/<commit>/<file>`, with
`refs/<revision>` holding the commit a revision points at. Nothing here downloads: on a robot the
user fetches weights once (`huggingface-cli download <repo>`), and we only read what is there.
"""
from __future__ import annotations

import os
from pathlib import Path


def hub_cache_dirs() -> list[Path]:
    """Where the Hugging Face hub cache may live, in the order huggingface_hub itself looks."""
    dirs = []
    if os.environ.get("HF_HUB_CACHE"):
        dirs.append(Path(os.environ["HF_HUB_CACHE"]))
    if os.environ.get("HUGGINGFACE_HUB_CACHE"):
        dirs.append(Path(os.environ["HUGGINGFACE_HUB_CACHE"]))
    if os.environ.get("HF_HOME"):
        dirs.append(Path(os.environ["HF_HOME"]) / "hub")
    xdg = os.environ.get("XDG_CACHE_HOME")
    dirs.append(Path(xdg or Path.home() / ".cache") / "huggingface" / "hub")
    return dirs


def find_snapshot(repo_id: str, required_file: str, revision: str = "main") -> Path | None:
    """The cached snapshot folder of `repo_id` that holds `required_file`, or None.

    Prefers the commit that `revision` points at; otherwise any snapshot holding the file.
    """
    folder = "models--" + repo_id.replace("/", "--")
    for hub in hub_cache_dirs():
        repo = hub / folder
        snapshots = repo / "snapshots"
        if not snapshots.is_dir():
            continue
        ref = repo / "refs" / revision
        if ref.is_file():
            pinned = snapshots / ref.read_text().strip()
            if (pinned / required_file).exists():
                return pinned
        for snap in sorted(snapshots.iterdir(), key=lambda p: p.stat().st_mtime, reverse=True):
            if (snap / required_file).exists():
                return snap
    return None


def describe_search(repo_id: str) -> str:
    """A sentence naming where we looked, for 'weights not found' errors."""
    folder = "models--" + repo_id.replace("/", "--")
    places = ", ".join(str(d / folder) for d in hub_cache_dirs())
    return f"looked in the Hugging Face cache ({places})"
