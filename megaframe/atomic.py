"""Whole-file writes a reader or a crash can never see half done: write a temporary file in the same
folder (os.replace is atomic only within one file system), fsync it, then rename it over the target.
A leaf module: data preparation, metrics caches, the run's config.yaml and the tools share it."""

from __future__ import annotations

import os
from pathlib import Path


def write_atomic(path: str | Path, data: bytes | str) -> Path:
    """Replace `path` with `data` (str is written as UTF-8): readers see the old file or the whole new
    one. The temporary name carries the pid, so processes racing on one path (ranks sharing a cache)
    never write into each other's file; the last rename wins. Returns `path`."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())  # the bytes reach the disk before the rename makes them visible
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # also on KeyboardInterrupt: leave no stray temporary file
        raise
    return path
