"""File names read from metadata (a checkpoint's metadata.json, a prepared dataset's meta.json) must
name plain files inside their folder: no '..', no absolute path, no link leading out."""

from __future__ import annotations

import os
from pathlib import Path


class OutsideFolder(ValueError):
    """A file name that would reach outside its folder (bad input: exit 2)."""


def inside(folder: str | Path, name: object) -> Path:
    folder = Path(folder)
    if (
        not isinstance(name, str)
        or not name
        or os.path.isabs(name)
        or Path(name).name != name
        or name in (".", "..")
    ):
        raise OutsideFolder(f"{folder}: file name {name!r} is not a plain name inside the folder")
    path = folder / name
    # a link that stays inside the folder is fine; only one leading out of it is refused
    if path.is_symlink() and not path.resolve().is_relative_to(folder.resolve()):
        raise OutsideFolder(f"{folder}: {name} is a link out of the folder")
    return path
