"""Results files of the GPU runs, written whole: a run is killed at its time limit (gpu.sh's
timeout, the device's), and whatever it had finished must still be readable after the kill."""
from __future__ import annotations

import os
from pathlib import Path
from typing import BinaryIO, Callable


def replace_whole(path: str | Path, data: str | bytes | Callable[[BinaryIO], None]) -> None:
    """Write `data` (text, bytes, or a function writing into the open file) to a side file named
    `path` + ".tmp", then rename it over `path`: a kill mid-write leaves the previous file, never a
    truncated one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        if callable(data):
            data(f)
        else:
            f.write(data.encode() if isinstance(data, str) else data)
    os.replace(tmp, path)
