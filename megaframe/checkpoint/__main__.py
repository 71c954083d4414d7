"""Offline checks of checkpoints: `python -m megaframe.checkpoint verify PATH`.

PATH is a step folder, or a checkpoint dir (then every committed step in it). Every byte of every shard
is read and checked against its block checksums, the metadata's coverage is recomputed and the file
names must stay inside the folder. Exit 0 when all verify, 2 (one line naming the cause) otherwise.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    from megaframe.checkpoint import sharded
    from megaframe.checkpoint.resolve import vanished
    from megaframe.errors import fail

    ap = argparse.ArgumentParser(prog="python -m megaframe.checkpoint")
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("verify", help="check every byte of a checkpoint").add_argument("path")
    args = ap.parse_args(argv)
    path = Path(args.path)
    steps = [path] if (path / "metadata.json").is_file() else sharded.committed(path)
    if not steps:
        return fail(f"{path}: no committed checkpoint")
    for step in steps:
        try:
            meta = sharded.verify(step)
        except (ValueError, OSError) as e:  # CheckpointError, and v1 metadata that does not parse
            if step != path and vanished(step, e):  # a live run's keep_last deleted it: nothing to check
                print(f"skipped: {step} (pruned by a live run while it was verified)", flush=True)
                continue
            return fail(e)
        size = sum(f["bytes"] for f in meta.get("files", {}).values())
        print(
            f"ok: {step} (step {meta['step']}, {len(meta['files'])} files, {size} bytes, "
            f"{len(meta['tensors'])} tensors)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
