"""Atomic file writes: a reader (or a crash) sees the old file or the new one, never half of one.

The data go to a temporary file beside `path` (the same filesystem, so the rename is atomic),
are fsynced, and then os.replace moves them to `path`. The temporary name starts with `.tmp-`,
the prefix checkpoint.remove_partial_saves clears from the checkpoints dir after a kill.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable


def atomic_write(path: str | os.PathLike, write: Callable[[Path], object]) -> None:
    """`write(tmp)` creates the temporary file (any writer that takes a path), then it replaces
    `path`. The temporary file is removed when anything fails."""
    path = Path(path)
    tmp = path.with_name(f".tmp-{path.name}.{os.getpid()}")
    try:
        write(tmp)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)  # the data are on disk before the name points at them
        finally:
            os.close(fd)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    atomic_write(path, lambda tmp: tmp.write_text(text))
