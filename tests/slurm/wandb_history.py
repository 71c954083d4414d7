"""Read offline wandb runs back without the wandb service or network (tests; wandb 0.31's file layout).

An offline run is `<dir>/wandb/offline-run-<timestamp>-<id>[-N]/run-<id>.wandb`: a LevelDB-log-format
file (32 KiB blocks, 7-byte record headers: crc32, length, type) of `wandb_internal_pb2.Record`
protobufs behind a 7-byte `:W&B` header. Every resume of the same id (a Slurm requeue, a torchrun
restart) writes a new directory; `wandb sync` uploads them in start-time order, so a run's history is
their concatenation in that order.

    python -m tests.slurm.wandb_history outputs/<run> [ID]   # prints the segments and their steps

Without ID: the run folder's own wandb run (its id follows from ${run.dir}/megaframe.run_id, as the
trainer derives it), else every offline run in the folder. Nothing found is an error (exit 2).
"""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path
from typing import Iterator

BLOCK = 32 * 1024
HEADER = 7


def records(path: Path) -> Iterator:
    """The protobuf records of one .wandb file, in order (a torn tail record is dropped)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    if data[:4] != b":W&B":
        raise ValueError(f"{path}: not a wandb transaction log")
    pos, buf = HEADER, b""
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < HEADER:  # block trailer: zero padding
            pos += left
            continue
        _crc, length, rtype = struct.unpack("<IHB", data[pos : pos + HEADER])
        chunk = data[pos + HEADER : pos + HEADER + length]
        pos += HEADER + length
        if rtype == 0 and length == 0:  # padding record
            continue
        if len(chunk) < length:  # torn write at the end of a killed run
            break
        buf = (
            chunk if rtype in (1, 2) else buf + chunk
        )  # FULL / FIRST start a record; MIDDLE / LAST extend it
        if rtype in (2, 3):
            continue
        rec = pb.Record()
        rec.ParseFromString(buf)
        buf = b""
        yield rec


def _items(items) -> dict:
    return {it.key or ".".join(it.nested_key): json.loads(it.value_json) for it in items}


def read_run(path: Path) -> dict:
    """One offline-run segment: its id, config (flat keys, wandb's own `_wandb` dropped), history rows
    (each with `_step`), and whether it ended with an exit record."""
    run = {"id": None, "config": {}, "history": [], "exit_code": None, "path": str(path)}
    for rec in records(path):
        kind = rec.WhichOneof("record_type")
        if kind == "run":
            run["id"] = rec.run.run_id
            run["config"] = {k: v for k, v in _items(rec.run.config.update).items() if k != "_wandb"}
        elif kind == "history":
            run["history"].append(_items(rec.history.item))
        elif kind == "exit":
            run["exit_code"] = rec.exit.exit_code
    return run


def _segment_key(d: Path, run_id: str | None):
    """(timestamp, restart suffix) of `offline-run-<YYYYmmdd_HHMMSS>-<id>[-N]`, None for another id (any
    id when `run_id` is None)."""
    rest = d.name[len("offline-run-") :]
    stamp, _, tail = rest.partition("-")
    if run_id is None or tail == run_id:
        return stamp, 0
    if tail.startswith(run_id + "-") and tail[len(run_id) + 1 :].isdigit():
        return stamp, int(tail[len(run_id) + 1 :])  # a restart within the same second
    return None


def segments(run_dir: Path, run_id: str | None) -> list[dict]:
    """Every offline-run segment of `run_id` (of any id: None) under run_dir (or run_dir/wandb), oldest
    first."""
    base = Path(run_dir)
    if (base / "wandb").is_dir():
        base = base / "wandb"
    keyed = [(k, d) for d in base.glob("offline-run-*") if (k := _segment_key(d, run_id)) is not None]
    return [read_run(f) for _, d in sorted(keyed) for f in sorted(d.glob("run-*.wandb"))]


def history(run_dir: Path, run_id: str) -> list[dict]:
    """The run's history rows across all its segments, in the order `wandb sync` would upload them."""
    return [row for seg in segments(run_dir, run_id) for row in seg["history"]]


def folder_run_id(run_dir: Path) -> str | None:
    """The wandb id the trainer gives the run folder's run (megaframe/tracking.py: wandb_id), or None for a
    folder without a recorded run id."""
    from megaframe.runops.access.owner import read_id
    from megaframe.tracking import wandb_id

    owner = read_id(run_dir)
    return wandb_id(owner, "") if owner else None


def main(argv: list[str]) -> int:
    from megaframe.errors import fail

    if not argv or len(argv) > 2:
        return fail("usage: python -m tests.slurm.wandb_history RUN_DIR [WANDB_ID]")
    d = Path(argv[0])
    rid = argv[1] if len(argv) > 1 else folder_run_id(d)
    segs = segments(d, rid)
    if not segs:
        which = f" with id {rid}" if rid else ""
        base = d / "wandb" if (d / "wandb").is_dir() else d
        return fail(f"{d}: no offline wandb run{which} (no {base}/offline-run-* folder)")
    for seg in segs:
        steps = [r.get("_step") for r in seg["history"]]
        span = f"{steps[0]}..{steps[-1]}" if steps else "-"
        print(f"{seg['path']}: id={seg['id']} steps {span} ({len(steps)} rows) exit={seg['exit_code']}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
